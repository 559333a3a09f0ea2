"""Kernel dispatch: Triton on CUDA, torch's int4/int8 ops or the pure-torch reference on CPU.

Modules: layout (run-time weight layout), w4a16 (weight-only int4/int8 GEMM), act_quant
(per-token / static activation quantization), w8a8 (int8 and fp8 scaled GEMM), fp8
(torch._scaled_mm or Triton), ops (torch.ops.qtk.* custom ops), dispatch (which one runs a
layer), reference (pure-torch twins), attention (the runtime's paged KV-cache
attention in Triton).
"""
from __future__ import annotations

import torch

from .dispatch import dense_weights, prepare, runtime_for

__all__ = ["dense_weights", "prepare", "quant_linear"]


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Forward of a QuantLinear (see qtk.quant_linear) for any scheme: x [..., K] -> [..., N]."""
    runtime = runtime_for(layer, x)
    y = runtime(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*x.shape[:-1], y.shape[-1])
