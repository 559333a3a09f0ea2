"""FP8 / INT8 KV-cache scales: where they live and how they are computed.

The layout calibration writes and the runtime reads (compressed-tensors' kv_cache_scheme): each
attention module holds `k_scale` / `v_scale` buffers, [1] per tensor or [kv_heads, 1, 1] per head
(strategy attn_head); a scale is quant.qparams' symmetric scale of the observed absmax (absmax / 448
for fp8 e4m3, absmax / 127.5 for int8: compressed-tensors' grid, -absmax is code -128), applied to
K after RoPE and to V.
"""
from __future__ import annotations

import torch
from torch import nn

from .models import Arch, get_module
from .quant import qparams
from .schemes import KVCacheScheme

NAMES = ("k_scale", "v_scale")


def scale_shape(model_config, kv: KVCacheScheme) -> tuple[int, ...]:
    if kv.strategy == "attn_head":
        return (model_config.num_key_value_heads, 1, 1)
    return (1,)


def kv_scale(absmax: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    """Scale [1] or [kv_heads, 1, 1] from the observed absmax of the same shape."""
    return qparams(-absmax, absmax, kv.args)[0]


def attach_kv_scales(model: nn.Module, arch: Arch, kv: KVCacheScheme, device="cpu", dtype=None) -> None:
    """Register k_scale / v_scale buffers (ones) on every attention module, for a load to fill."""
    dtype = dtype or next(model.parameters()).dtype
    shape = scale_shape(model.config, kv)
    for layer in get_module(model, arch.layers):
        attn = get_module(layer, arch.attention)
        for name in NAMES:
            attn.register_buffer(name, torch.ones(shape, dtype=dtype, device=device))
        attn.kv_scheme = kv
