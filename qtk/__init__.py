"""qtk: quantize Hugging Face causal LMs, gate their quality, serve them.

    from qtk import LLM, SamplingParams, StructuredOutputsParams   # the runtime (imported on first use)
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]
from .version import __version__


def __getattr__(name: str):
    if name == "LLM":
        from .runtime.engine import LLM

        return LLM
    if name == "SamplingParams":
        from .runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from .runtime.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'qtk' has no attribute {name!r}")
