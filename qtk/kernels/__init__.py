"""Kernel dispatch: Triton on CUDA, torch's int4/int8 ops or the pure-torch reference on CPU.

Modules: layout (run-time weight layout), w4a16 (weight-only int4/int8 GEMM), act_quant
(per-token / static activation quantization), w8a8 (int8 and fp8 scaled GEMM), fp8
(torch._scaled_mm or Triton), ops (torch.ops.qtk.* custom ops), dispatch (which one runs a
layer), reference (pure-torch twins), bench (GPU benchmark).
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from ..device import native_bf16
from .dispatch import prepare, runtime_for
from .reference import quant_linear_ref

__all__ = ["dequantized_weights", "prepare", "quant_linear"]


class _Decoded(threading.local):
    weights: dict | None = None  # QuantLinear -> its decoded weight, inside dequantized_weights()


_decoded = _Decoded()


@contextlib.contextmanager
def dequantized_weights():
    """Weight-only QuantLinears compute x @ dequant(W)^T with a plain matmul in x's dtype, each
    weight decoded once and dropped on exit.

    For calibration, which runs one block over thousands of tokens per batch: there a dense bf16
    matmul is about 3x faster on CPU than the int4 kernel, and the decoded block fits in memory.
    bf16 activations on a CPU without bf16 units are multiplied in float32 (the emulated bf16 matmul
    is ~100x slower there). Activation-quantized schemes keep their kernels (their integer matmul is
    part of the scheme)."""
    saved = _decoded.weights
    _decoded.weights = {}
    try:
        yield
    finally:
        _decoded.weights = saved


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Forward of a QuantLinear (see qtk.runtime.layers) for any scheme: x [..., K] -> [..., N]."""
    decoded = _decoded.weights
    if decoded is not None and layer.scheme.input_activations is None:
        dtype = x.dtype if native_bf16(x.device) or x.dtype != torch.bfloat16 else torch.float32
        w = decoded.get(layer)
        if w is None or w.dtype != dtype or w.device != x.device:
            w = decoded[layer] = layer.dequantized_weight(dtype).to(x.device)
        y = F.linear(x.to(dtype), w, None if layer.bias is None else layer.bias.to(dtype))
        return y.to(x.dtype)
    runtime = runtime_for(layer, x)
    if runtime is None:
        return quant_linear_ref(x, layer)
    y = runtime(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*x.shape[:-1], y.shape[-1])
