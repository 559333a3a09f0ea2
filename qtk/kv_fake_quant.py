"""transformers' attention with K and V fake-quantized by the attention module's k_scale / v_scale
(qtk.kv_scales' layout): what a checkpoint with a kv_cache_scheme runs when it is loaded through
transformers (perplexity as the referee, calibration's end), so its figures include the KV-cache
error. Registered with transformers' AttentionInterface as "qtk_kv_quant", over chunked_sdpa."""
from __future__ import annotations

import torch
from torch import nn

from .chunked_sdpa import chunked_causal_attention, register, set_implementation
from .quant import dequantize, quantize
from .schemes import KVCacheScheme

FAKE_QUANT = "qtk_kv_quant"


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, kv: KVCacheScheme) -> torch.Tensor:
    s = scale.float().to(x.device)
    return dequantize(quantize(x, s, None, kv.args), s, None, x.dtype)


def _quantized_attention(module, query, key, value, attention_mask, **kwargs):
    kv = getattr(module, "kv_scheme", None)
    if kv is not None and hasattr(module, "k_scale"):
        key = _fake_quant(key, module.k_scale, kv)
        value = _fake_quant(value, module.v_scale, kv)
    return chunked_causal_attention(module, query, key, value, attention_mask, **kwargs)


def enable_kv_quant(model: nn.Module) -> None:
    """Run `model`'s attention with K and V fake-quantized (modules with a kv_scheme and scales)."""
    register(FAKE_QUANT, _quantized_attention)
    set_implementation(model, FAKE_QUANT)
