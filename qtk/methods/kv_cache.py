"""FP8 / INT8 KV-cache scales: observe |K| (after RoPE) and |V| during calibration, write k_scale/v_scale.

Where the scales live and how they are computed is qtk.kv_scales (shared with the runtime). The
same attention hook that observes during calibration fake-quantizes K and V when a checkpoint is
evaluated through transformers, so that perplexity includes the KV-cache error.
"""
from __future__ import annotations

import torch
from torch import nn

from ..chunked_sdpa import chunked_causal_attention, register, set_implementation
from ..kv_scales import kv_scale
from ..models import Arch, get_module
from ..quant import dequantize, quantize
from ..schemes import KVCacheScheme

OBSERVE = "qtk_kv_observe"
FAKE_QUANT = "qtk_kv_quant"


def _absmax(x: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    # x [batch, kv_heads, seq, head_dim] -> [1] or [kv_heads, 1, 1]
    x = x.detach().float().abs()
    if kv.strategy == "attn_head":
        return x.amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
    return x.amax().reshape(1)


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    s = scale.float().to(x.device)
    return dequantize(quantize(x, s, None, kv.args), s, None, x.dtype)


def _observe_attention(module, query, key, value, attention_mask, **kwargs):
    kv = module.kv_scheme
    for name, t in (("_k_absmax", key), ("_v_absmax", value)):
        m = _absmax(t, kv)
        prev = getattr(module, name, None)
        setattr(module, name, m if prev is None else torch.maximum(prev, m))
    return chunked_causal_attention(module, query, key, value, attention_mask, **kwargs)


def _quantized_attention(module, query, key, value, attention_mask, **kwargs):
    kv = getattr(module, "kv_scheme", None)
    if kv is not None and hasattr(module, "k_scale"):
        key = _fake_quant(key, module.k_scale, kv)
        value = _fake_quant(value, module.v_scale, kv)
    return chunked_causal_attention(module, query, key, value, attention_mask, **kwargs)


def _register():
    register(OBSERVE, _observe_attention)
    register(FAKE_QUANT, _quantized_attention)


def enable_kv_quant(model: nn.Module) -> None:
    _register()
    set_implementation(model, FAKE_QUANT)


def start_observing(model: nn.Module, layer: nn.Module, arch: Arch, kv: KVCacheScheme) -> nn.Module:
    _register()
    attn = get_module(layer, arch.attention)
    attn._attn_before_observing = set_implementation(model, OBSERVE)
    attn.kv_scheme = kv
    attn._k_absmax = attn._v_absmax = None
    return attn


def finish_observing(model: nn.Module, attn: nn.Module, kv: KVCacheScheme, dtype) -> None:
    """Turn the observed absmax into k_scale / v_scale buffers on the attention module."""
    if attn._k_absmax is None:
        raise RuntimeError("no keys were observed: the KV-cache scales need calibration data")
    attn.register_buffer("k_scale", kv_scale(attn._k_absmax, kv).to(dtype))
    attn.register_buffer("v_scale", kv_scale(attn._v_absmax, kv).to(dtype))
    del attn._k_absmax, attn._v_absmax
    set_implementation(model, attn.__dict__.pop("_attn_before_observing"))
