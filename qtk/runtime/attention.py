"""Attention over the paged KV cache, CPU path in torch.

The cache of one layer is two tensors [num_slots, kv_heads, head_dim] (num_slots = num_blocks *
block_size); a token's slot is block_table[pos // block_size] * block_size + pos % block_size.
Each step first writes the new tokens' K and V at their slots, then:
    decodes   (one new token per sequence): batched over the sequences, keys gathered into
              [B, L_max] with a padding mask, one pair of einsums for the whole group
    prefills  (a chunk of n tokens at the end of a context of L): per sequence, sdpa of the n
              queries over the L cached keys with the causal offset mask j <= L - n + i
GQA: query head h reads KV head h // (heads / kv_heads), as transformers' repeat_kv lays it out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first query's index in the packed batch
    length: int  # queries (new tokens)
    slots: torch.Tensor  # long [L]: the slots of the whole context, the new tokens last


@dataclass
class AttentionMetadata:
    """Per step, shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # long [T]: where each new token's K/V go
    decode_index: torch.Tensor  # long [B]: packed-batch index of each decoding sequence's token
    decode_slots: torch.Tensor  # long [B, L_max]: their context slots (0 where padded)
    decode_mask: torch.Tensor  # bool [B, L_max]: True for a real context token
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into the cache at slots [T]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] of the step's tokens -> attention output [T, heads, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_index.numel():
        out[meta.decode_index] = _decode(q[meta.decode_index], k_cache, v_cache, meta, scale)
    for p in meta.prefills:
        out[p.start:p.start + p.length] = _prefill(q[p.start:p.start + p.length], k_cache, v_cache, p, scale)
    return out


def _decode(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    B, H, D = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[meta.decode_slots].to(q.dtype)  # [B, L, kv_heads, D]
    values = v_cache[meta.decode_slots].to(q.dtype)
    qg = q.view(B, kv_heads, H // kv_heads, D)  # head h -> kv head h // group
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys).float() * scale
    scores.masked_fill_(~meta.decode_mask[:, None, None, :], float("-inf"))
    p = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", p, values).reshape(B, H, D)


def _prefill(q: torch.Tensor, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    n, L = chunk.length, chunk.slots.numel()
    keys = k_cache[chunk.slots].to(q.dtype).transpose(0, 1)  # [kv_heads, L, D]
    values = v_cache[chunk.slots].to(q.dtype).transpose(0, 1)
    # query i sits at context position L - n + i and sees keys 0 .. L - n + i
    mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                       enable_gqa=keys.shape[0] != q.shape[1])
    return o.transpose(0, 1)
