"""Causal attention in query chunks, for long full-sequence forwards on CPU (calibration, perplexity).

A causal query chunk [q0, q1) cannot see keys at or after q1, so each chunk is given keys [0, q1)
only: for 512 tokens in chunks of 128 that is 10/16 of the score work, for 2048 tokens 136/256.
The result is sdpa's up to the order of the softmax sums.

Used where it measured faster (benchmarks/cpu_dtype.py, benchmarks/results/cpu_dtype.md): on a CPU
with bf16 units, and elsewhere for sequences of at most 512 tokens (calibration's). On an AVX2-only
CPU in float32 the chunks took 46.0 ms against sdpa's 52.2 ms at 8 x 512 tokens (a tie, 56.4 vs
56.0, in another run), but 80.6 against 60.5 ms at 1 x 2048 (perplexity's windows): there sdpa runs.

Under autograd in bf16 (AutoRound's and distillation's steps) sdpa runs: its backward over the whole
causal sequence took 48 ms against the chunks' 71 ms at 8 x 512 tokens, 9 heads of 64, on an Intel
Xeon with AMX (the forwards tie; in float32 the chunks' backward was the faster, 54 vs 57 ms).

Registered with transformers' AttentionInterface as "qtk_chunked"; `chunked_attention(model)`
switches a model to it for the duration of a with-block.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .device import cpu_has_native_bf16

NAME = "qtk_chunked"
CHUNK = 128  # queries per sdpa call
LONGEST_WITHOUT_BF16 = 512  # without bf16 units, longer sequences go to sdpa (measured faster)


def sdpa(*args, **kwargs):
    """transformers' own sdpa attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def chunked_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Same signature and result as transformers' sdpa_attention_forward (query [B, H, L, D],
    key/value [B, H_kv, L, D] -> [B, L, H, D]), for causal self-attention over a whole sequence;
    anything else (decoding, a cache, softcap, sinks, dropout, a GPU, whose flash kernels skip masked
    blocks themselves, a bf16 forward that autograd records) goes to sdpa unchanged."""
    L = query.shape[2]
    plain = (query.device.type == "cpu" and L > CHUNK and (L <= LONGEST_WITHOUT_BF16 or cpu_has_native_bf16())
             and key.shape[2] == L and dropout == 0.0 and getattr(module, "is_causal", True)
             and kwargs.get("is_causal", True) is not False and not kwargs.get("softcap")
             and kwargs.get("cache") is None and getattr(module, "sinks", None) is None
             and not (attention_mask is None and kwargs.get("sliding_window"))
             and (attention_mask is None or attention_mask.shape[-1] == L)
             and not (query.requires_grad and query.dtype == torch.bfloat16 and torch.is_grad_enabled()))
    if not plain:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for q0 in range(0, L, CHUNK):
        q1 = min(q0 + CHUNK, L)
        if attention_mask is None:
            mask = torch.ones(q1 - q0, q1, dtype=torch.bool, device=query.device).tril(diagonal=q0)
        else:
            mask = attention_mask[..., q0:q1, :q1]
        outs.append(F.scaled_dot_product_attention(query[:, :, q0:q1], key[:, :, :q1], value[:, :, :q1],
                                                   attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register(name: str = NAME, attention=chunked_causal_attention) -> None:
    """Register `attention` under `name` with transformers, with sdpa's masks: transformers builds no
    mask at all for an attention name it has no mask function for, so sliding windows would be lost."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attention_configs(model) -> list:
    """The model's config and every distinct sub-config (e.g. a text model's) naming an attention."""
    configs = [model.config, *(getattr(m, "config", None) for m in model.modules())]
    return list({id(c): c for c in configs if hasattr(c, "_attn_implementation")}.values())


def set_implementation(model, name: str, configs: list | None = None) -> str:
    """Point the model (and any sub-config) at attention `name`; returns the old one. configs:
    attention_configs(model), where the caller keeps them (no walk over the modules per call)."""
    old = model.config._attn_implementation
    for cfg in attention_configs(model) if configs is None else configs:
        cfg._attn_implementation = name
    return old


@contextlib.contextmanager
def chunked_attention(model):
    """Run `model` with chunked causal attention on CPU when it uses sdpa (each call still goes to sdpa
    where that measured faster); a no-op otherwise."""
    if model.config._attn_implementation != "sdpa" or next(model.parameters()).device.type != "cpu":
        yield
        return
    register()
    old = set_implementation(model, NAME)
    try:
        yield
    finally:
        set_implementation(model, old)
