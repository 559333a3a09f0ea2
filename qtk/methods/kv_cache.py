"""FP8 / INT8 KV-cache scales: observe |K| (after RoPE) and |V| during calibration, write k_scale/v_scale.

Where the scales live and how they are computed is qtk.kv_scales (shared with the runtime); the
attention that fake-quantizes K and V with them, once they are written, is qtk.kv_fake_quant.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import distributed
from ..chunked_sdpa import chunked_causal_attention, register, set_implementation
from ..kv_scales import kv_scale
from ..schemes import KVCacheScheme

OBSERVE = "qtk_kv_observe"


def _absmax(x: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    # x [batch, kv_heads, seq, head_dim] -> [1] or [kv_heads, 1, 1]
    x = x.detach().float().abs()
    if kv.strategy == "attn_head":
        return x.amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
    return x.amax().reshape(1)


def _observe_attention(module, query, key, value, attention_mask, **kwargs):
    kv = module.kv_scheme
    for name, t in (("_k_absmax", key), ("_v_absmax", value)):
        m = _absmax(t, kv)
        prev = getattr(module, name, None)
        setattr(module, name, m if prev is None else torch.maximum(prev, m))
    return chunked_causal_attention(module, query, key, value, attention_mask, **kwargs)


def start_observing(model: nn.Module, attn: nn.Module, kv: KVCacheScheme) -> nn.Module:
    """Observe |K| and |V| at the attention module `attn` (a block's, as arch.discover found it)."""
    register(OBSERVE, _observe_attention)
    attn._attn_before_observing = set_implementation(model, OBSERVE)
    attn.kv_scheme = kv
    attn._k_absmax = attn._v_absmax = None
    return attn


def finish_observing(model: nn.Module, attn: nn.Module, kv: KVCacheScheme, dtype) -> None:
    """Turn the observed absmax into k_scale / v_scale buffers on the attention module."""
    if attn._k_absmax is None:
        raise RuntimeError("no keys were observed: the KV-cache scales need calibration data")
    distributed.max_(attn._k_absmax)  # the max over every rank's batches (distributed.py)
    distributed.max_(attn._v_absmax)
    attn.register_buffer("k_scale", kv_scale(attn._k_absmax, kv).to(dtype))
    attn.register_buffer("v_scale", kv_scale(attn._v_absmax, kv).to(dtype))
    del attn._k_absmax, attn._v_absmax
    set_implementation(model, attn.__dict__.pop("_attn_before_observing"))
