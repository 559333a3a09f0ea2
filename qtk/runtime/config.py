"""EngineConfig: the engine's options, under vLLM's names, checked when the config is made.

    config = EngineConfig("smollm2-135m", kv_cache_dtype="int8", max_model_len=1024)
    llm = LLM(config=config)            # or LLM("smollm2-135m", kv_cache_dtype="int8", ...), the same

LLM, the CLI's engine flags (--device, --dtype, --block-size, ...), the gates' scoring and the
lm-eval adapter all take one; a bad value is an InputError naming the field. What depends on the
machine (a CUDA device present, FP8 support, the memory a KV cache can have) is checked when the
engine starts.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from ..errors import InputError
from .scheduler import SchedulerConfig

_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")
MODEL_IMPLS = ("auto", "qtk", "transformers")  # vLLM's model_impl, with qtk's native code in place of vLLM's


# A CPU step's token budget. A step's prompts all get their first token when it ends, so on a CPU, where a
# step of 2048 prompt tokens takes over a second, smaller steps bring first tokens sooner: 16 prompts of 256
# tokens arriving together (serving at concurrency 16), 2-core Zen 4, in-process, from admission: median TTFT
# 1.21-1.38 s with 2048 (vLLM's CPU default), 0.66 s with 1024, 0.38-0.42 s with 512, at the same output
# tok/s; on 1024-token prompts 1.59-1.80 -> 1.25-1.45 s for 5-10% of the throughput (more steps, each
# carrying the decodes). (The first qtk default, 2048, followed vLLM's; before that a single step of 16 x 256
# tokens held every first token back ~3 s.)
CPU_STEP_TOKENS = 512
# ...and under many decodes, at least CPU_PROMPT_TOKENS_PER_DECODE prompt tokens a step per decoding
# sequence, up to CPU_MAX_STEP_TOKENS (SchedulerConfig.budget), so that at concurrency 64 a step's decodes
# (each reading its whole context) stay near a tenth of its work on 1024-token contexts. vLLM's client, 128
# prompts of 1024 tokens at concurrency 64, 2-core Zen 5: median TTFT 7.4 s with a fixed 512 (1.13x vLLM's),
# 2.3 s with a fixed 2048, 2.1-2.2 s with this rule, all at 241-246 output tok/s; at concurrency 16 the rule
# gives 512, whose median TTFT at 256 tokens is half a fixed 2048's (356-440 against 762 ms).
CPU_PROMPT_TOKENS_PER_DECODE = 32
CPU_MAX_STEP_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: str  # an HF directory or hub name, a .gguf, a qtk checkpoint, or a bundled model's name
    dtype: str = "auto"  # compute dtype: auto, bfloat16 or float32 (qtk.device.choose_dtype)
    device: str = "cpu"  # cpu or cuda[:N]
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 256  # sequences per step at most
    # tokens per step at most (longer prompts prefill in chunks); None: 8192 on CUDA, and on CPU
    # CPU_STEP_TOKENS growing with the decodes (scheduler_config)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # context length (None: the model's)
    kv_cache_memory: int | None = None  # bytes for the KV cache (None: 2 GiB on CPU; CUDA: by utilization)
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix already computed
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bfloat16, fp8 (e4m3) or int8
    gpu_memory_utilization: float = 0.9  # CUDA: the fraction of the GPU's memory for weights + KV cache
    max_logprobs: int = 20  # the most logprobs a request may ask for (-1: the vocabulary)
    enforce_eager: bool = False  # CUDA: every step eagerly, without the decode steps' CUDA graphs
    # which model code runs: auto (qtk's native forward where it has one, else transformers' modeling
    # code with qtk's paged attention), qtk (native only: an error for other types) or transformers
    model_impl: str = "auto"
    # speculative decoding (runtime/spec_decode.py), vLLM's dict: {"method": "ngram", "num_speculative_tokens": 5,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5}; None: off
    speculative_config: dict | None = None

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.model, str) or not self.model:
            raise InputError(f"model must be a model name or path, got {self.model!r}")
        # torch comes with these: imported when a config is made, not when the CLI reads the defaults
        from ..device import DTYPE_CHOICES
        from .attention import KV_DTYPES

        if self.dtype not in DTYPE_CHOICES:
            raise InputError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise InputError(f"device must be cpu or cuda[:N], got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory"):
            value = getattr(self, name)
            if value is None and name in ("max_num_batched_tokens", "max_model_len", "kv_cache_memory"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_DTYPES:
            raise InputError(f"kv_cache_dtype must be auto, bfloat16, fp8 or int8, not {self.kv_cache_dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InputError(f"max_logprobs must be an integer of at least -1 (-1: the vocabulary), "
                             f"got {self.max_logprobs!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise InputError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        from .spec_decode import SpeculativeConfig

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r}")


    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits: max_num_batched_tokens as given, fixed; by default 8192 on CUDA, and on a
        CPU CPU_STEP_TOKENS growing with the step's decodes (CPU_PROMPT_TOKENS_PER_DECODE)."""
        if self.max_num_batched_tokens is not None or self.device.startswith("cuda"):
            return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens or 8192, max_model_len)
        return SchedulerConfig(self.max_num_seqs, CPU_STEP_TOKENS, max_model_len,
                               CPU_PROMPT_TOKENS_PER_DECODE, CPU_MAX_STEP_TOKENS)


ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")  # what a caller may set
