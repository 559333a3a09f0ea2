"""FP8 / INT8 KV-cache scales: where they live and how they are computed.

The layout calibration writes and the runtime reads (compressed-tensors' kv_cache_scheme): each
attention module holds `k_scale` / `v_scale` buffers, [1] per tensor or [kv_heads, 1, 1] per head
(strategy attn_head); a scale is quant.qparams' symmetric scale of the observed absmax (absmax / 448
for fp8 e4m3, absmax / 127.5 for int8: compressed-tensors' grid, -absmax is code -128), applied to
K after RoPE and to V. The runtime measures scales at load with the same kv_scale, and rescales a
checkpoint's to the other grid by grid_absmax (absmax = scale * grid_absmax).
"""
from __future__ import annotations

import torch
from torch import nn

from .quant import FP8_DTYPE, FP8_MAX, qparams
from .schemes import KVCacheScheme

NAMES = ("k_scale", "v_scale")
CACHE_TYPES = {FP8_DTYPE: "float", torch.int8: "int"}  # the runtime's cache dtype -> KVCacheScheme.type


def scale_shape(model_config, kv: KVCacheScheme) -> tuple[int, ...]:
    if kv.strategy == "attn_head":
        return (model_config.num_key_value_heads, 1, 1)
    return (1,)


def kv_scale(absmax: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    """Scale [1] or [kv_heads, 1, 1] from the observed absmax of the same shape."""
    return qparams(-absmax, absmax, kv.args)[0]


def grid_absmax(kv: KVCacheScheme) -> float:
    """The absmax a scale spans (absmax = scale * grid_absmax, kv_scale's grid): 448 for fp8, 127.5 for int8."""
    a = kv.args
    return FP8_MAX if a.type == "float" else (a.qmax - a.qmin) / 2


def cache_scheme(dtype: torch.dtype) -> KVCacheScheme:
    """The scheme of the runtime's FP8 / INT8 cache of `dtype`, per KV head (as it holds scales)."""
    return KVCacheScheme(type=CACHE_TYPES[dtype], strategy="attn_head")


def attach_kv_scales(model: nn.Module, modules: list[str], kv: KVCacheScheme, device="cpu", dtype=None) -> None:
    """Register k_scale / v_scale buffers (ones) on each named attention module, for a load to fill."""
    dtype = dtype or next(model.parameters()).dtype
    shape = scale_shape(model.config, kv)
    for name in modules:
        attn = model.get_submodule(name)
        for buf in NAMES:
            attn.register_buffer(buf, torch.ones(shape, dtype=dtype, device=device))
        attn.kv_scheme = kv
