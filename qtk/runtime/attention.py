"""Attention over the paged KV cache: the CPU path in torch, below; on CUDA the Triton kernels of
qtk.kernels.attention over the same layout (`_triton_attention`), and on a CPU with qtk's C++ ops
(float32 activations) the fused store and decode of kernels/csrc/cpu_layers.cpp (`_cpu_attention`;
in a step whose matmuls run in bf16, where the CPU has AVX512-BF16, its prefill chunks in the bf16
flash kernel of kernels/csrc/cpu_attention.cpp and its decodes over a bf16 cache in that file's bf16
decode kernel; else prefill chunks in torch): chosen by AttentionMetadata.backend.

The cache of one layer (KVCache) is two tensors [kv_heads, num_slots, head_dim], num_slots =
num_blocks * block_size, so one block of one head is a contiguous [block_size, head_dim] tile; a
token's slot is block_table[pos // block_size] * block_size + pos % block_size. The cache holds
the model's dtype, or FP8 e4m3 / INT8 with static scales per tensor or per KV head (stored =
K / k_scale, rounded and clamped to the grid; read back as stored * k_scale).
Each step first writes the new tokens' K and V at their slots (quantizing on the way), then:
    decodes   (one new token per sequence): whole blocks copied through the block tables into
              [kv_heads, B, blocks * block_size, D] (one buffer per step, reused by every layer),
              a padding mask by context length, and one pair of batched matmuls for the group
    prefills  (a chunk of n tokens at the end of a context of L): per sequence, sdpa of the n
              queries over the L cached keys with the causal offset mask j <= L - n + i (a whole
              prompt, n = L: sdpa's own causal flag, no mask)
GQA: query head h reads KV head h // (heads / kv_heads), as transformers' repeat_kv lays it out.
A sliding window w (Mistral; Qwen2/Qwen3 sliding layers) limits the query at position p to the keys
p - w < j <= p (transformers' sliding_window_overlay, vLLM's flash-attention window (w - 1, 0)). The
Triton and C++ kernels have no window: a step with a context longer than a layer's window runs that
layer on the torch path (shorter contexts: the window hides nothing).
Two more per-layer terms of the scores, as transformers' eager attention applies them (torch path
only: the kernels have neither, so a layer with one always runs in torch):
    softcap c (Gemma 2):     s = c * tanh(s / c), after the scale, before the mask
    sinks a_h (gpt-oss):     softmax over [s_0 .. s_L, a_h], the sink's column dropped: each head's
                             weights sum to 1 - its sink's share
A k_scale is applied to the scores and a v_scale to the output, not to the gathered tensors.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..quant import FP8_MAX

# kv_cache_dtype -> the cache's dtype: bf16 holds a float32 model's K and V at half the bytes (no scales;
# rounded to nearest even, as vLLM's bf16 cache), FP8 / INT8 with scales
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
SCALED_KV = (torch.float8_e4m3fn, torch.int8)


@dataclass
class KVCache:
    """One layer's K and V; scales (float32, [kv_heads, 1, 1] or [1, 1, 1]) for an FP8/INT8 cache."""

    k: torch.Tensor  # [kv_heads, num_slots, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass
class PrefillChunk:
    start: int  # first query's index in the packed batch
    length: int  # queries (new tokens)
    slots: torch.Tensor  # long [L]: the slots of the whole context, the new tokens last
    block_table: list[int] = field(default_factory=list)  # the sequence's (for the Triton kernels)


@dataclass
class AttentionMetadata:
    """Per step, shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # long [T]: where each new token's K/V go
    decode_index: torch.Tensor  # long [B]: packed-batch index of each decoding sequence's token
    block_tables: torch.Tensor  # long [B, max_blocks]: their block tables (0 where padded)
    decode_mask: torch.Tensor | None  # bool [B, max_blocks * block_size]: True for a real context token
    # (the torch path's; None in a CUDA graph's step, which runs the Triton kernels)
    prefills: list[PrefillChunk]
    block_size: int
    decode_lens: torch.Tensor | None = None  # long [B]: their context lengths (the Triton kernels')
    backend: str = "torch"  # or "triton" (CUDA; the interpreter in tests) or "cpu" (qtk's C++ ops)
    max_context_len: int = 0  # the step's longest context, on the host: does a sliding window hide keys
    # (0 in a CUDA graph's step: graphs are captured only where no window is shorter than max_model_len)
    _buffers: dict = field(default_factory=dict, repr=False)

    def gather_buffers(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [kv_heads, B * max_blocks, block_size * D] tensors for the decodes' keys and values,
        allocated once per step and reused by every layer."""
        key = (cache.k.dtype, cache.k.shape[0], cache.k.shape[2])
        if key not in self._buffers:
            kv_heads, _, D = cache.k.shape
            shape = (kv_heads, self.block_tables.numel(), self.block_size * D)
            self._buffers[key] = tuple(torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device) for _ in "kv")
        return self._buffers[key]

    def window_mask(self, window: int) -> torch.Tensor:
        """decode_mask less the keys before each decode's last `window` ones (built once per step)."""
        key = ("window", window)
        if key not in self._buffers:
            cols = torch.arange(self.decode_mask.shape[1], device=self.decode_mask.device)
            self._buffers[key] = self.decode_mask & (cols[None, :] >= (self.decode_lens - window)[:, None])
        return self._buffers[key]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [kv_heads, T, D] onto the FP8 / INT8 grid of `scale` (round to nearest, saturate). With
    kv_scales' int8 scale absmax / 127.5, -absmax is code -128 and +absmax rounds to 128, saturated to 127."""
    y = x.float() / scale
    if dtype == torch.int8:
        return y.round().clamp(-128, 127).to(dtype)
    return y.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into the cache at slots [T] (the fused quantize-and-store of the CPU path)."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    if cache.quantized:
        k, v = quantize_kv(k, cache.k_scale, cache.k.dtype), quantize_kv(v, cache.v_scale, cache.v.dtype)
    for dst, src in ((cache.k, k), (cache.v, v)):
        _bytes(dst).index_copy_(1, slots, _bytes(src.to(dst.dtype)))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """FP8 as uint8: the same bytes, for the copy kernels torch has no FP8 version of."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


@dataclass(frozen=True)
class ScoreTerms:
    """A layer's terms of the attention scores beyond the scale (None: none)."""

    softcap: float | None = None  # s = softcap * tanh(s / softcap)
    sinks: torch.Tensor | None = None  # [heads]: one more logit per head in the softmax, its weight dropped

    def __bool__(self) -> bool:
        return bool(self.softcap) or self.sinks is not None

    def softmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """scores [kv, ..., group, L] float32 (head h = kv * group + g), mask broadcastable (True:
        seen) -> the attention weights, float32."""
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return scores.softmax(dim=-1)
        kv, group = scores.shape[0], scores.shape[-2]
        sinks = self.sinks.float().view(kv, *[1] * (scores.dim() - 3), group, 1).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]


NO_TERMS = ScoreTerms()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, cpu_ops=None, window: int | None = None,
                    terms: ScoreTerms = NO_TERMS, bf16: bool = False) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] of the step's tokens -> attention output [T, heads, D].
    cpu_ops: qtk's CPU kernel library for the "cpu" backend, where the caller holds it already;
    window: the layer's sliding window, or None; terms: its softcap and sinks (the CPU kernel's and
    the torch path's; Triton's kernels have neither, nor windows); bf16: the step's matmuls run in
    bf16 (a bf16 checkpoint's many rows on a CPU with the units), so may its prefill attention."""
    if meta.backend == "cpu":
        return _cpu_attention(q, k, v, cache, meta, scale, cpu_ops, window, terms, bf16)
    torch_only = (window is not None and meta.max_context_len > window) or bool(terms)
    if meta.backend == "triton" and not torch_only:
        return _triton_attention(q, k, v, cache, meta, scale)
    write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_index.numel():
        out[meta.decode_index] = _decode(q[meta.decode_index], cache, meta, scale, window, terms)
    for p in meta.prefills:
        out[p.start:p.start + p.length] = _prefill(q[p.start:p.start + p.length], cache, p, scale, window, terms)
    return out


def _decode(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
            window: int | None = None, terms: ScoreTerms = NO_TERMS) -> torch.Tensor:
    B, H, D = q.shape
    kv_heads = cache.k.shape[0]
    keys, values = meta.gather_buffers(cache)
    block_ids = meta.block_tables.view(-1)
    for src, dst in ((cache.k, keys), (cache.v, values)):
        blocks = _bytes(src).view(kv_heads, -1, meta.block_size * D)
        for h in range(kv_heads):  # whole blocks: row copies, 4x faster than indexing [kv, B, L] slots
            torch.index_select(blocks[h], 0, block_ids, out=_bytes(dst)[h])
    keys = keys.view(kv_heads, B, -1, D).to(q.dtype)  # [kv, B, L, D]
    values = values.view(kv_heads, B, -1, D).to(q.dtype)
    qg = q.view(B, kv_heads, H // kv_heads, D).transpose(0, 1)  # [kv, B, group, D]: head h -> kv head h // group
    scores = (qg @ keys.transpose(-1, -2)).float() * scale  # [kv, B, group, L]
    if cache.quantized:
        scores *= cache.k_scale[..., None]
    mask = meta.decode_mask if window is None else meta.window_mask(window)
    if terms:
        weights = terms.softmax(scores, mask[None, :, None, :])
    else:
        weights = scores.masked_fill_(~mask[None, :, None, :], float("-inf")).softmax(dim=-1)
    o = weights.to(q.dtype) @ values  # [kv, B, group, D]
    if cache.quantized:
        o = o * cache.v_scale[..., None].to(o.dtype)
    return o.transpose(0, 1).reshape(B, H, D)


def _cpu_attention(q, k, v, cache: KVCache, meta: AttentionMetadata, scale: float, ops=None,
                   window: int | None = None, terms: ScoreTerms = NO_TERMS, bf16: bool = False) -> torch.Tensor:
    """qtk's CPU kernels store the step's keys and values and attend for the decodes (window, softcap
    and sinks included), in bf16 where `bf16` and the bf16 decode kernel runs (_bf16_decode_kernel);
    prefill chunks attend in qtk's flash kernel where it runs (_prefill_kernel: in bf16 where `bf16`,
    else in float32), else in torch (_prefill)."""
    if ops is None:
        from ..kernels import cpu as cpu_kernels

        ops = cpu_kernels.ops()
    scales = (None, None) if not cache.quantized else (cache.k_scale.reshape(-1), cache.v_scale.reshape(-1))
    kc, vc = _bytes(cache.k), _bytes(cache.v)
    ops.store_kv_(kc, vc, k, v, meta.slot_mapping, *scales)
    extra = (window or 0, terms.softcap or 0.0, terms.sinks)

    if bf16 and _bf16_decode_kernel(ops, q, kc):
        def decode(q):
            return ops.paged_decode_attention_bf16(q, kc, vc, meta.block_tables, meta.decode_lens, meta.block_size,
                                                   scale, *extra)
    else:
        def decode(q):
            return ops.paged_decode_attention(q, kc, vc, meta.block_tables, meta.decode_lens, meta.block_size, scale,
                                              *scales, *extra)
    if not meta.prefills:  # a step of decodes only: token i is sequence i's
        return decode(q)
    out = torch.empty_like(q)
    if meta.decode_index.numel():
        out[meta.decode_index] = decode(q[meta.decode_index])
    kernel = _prefill_kernel(ops, q, terms, bf16)
    for p in meta.prefills:
        qp = q[p.start:p.start + p.length]
        if kernel:  # written into the step's output rows
            first = _first_key(p.length, p.slots.numel(), window)
            ops.prefill_attention(qp, kc, vc, p.slots[first:], window or 0, scale, *scales, bf16=bf16,
                                  out=out[p.start:p.start + p.length])
        else:
            out[p.start:p.start + p.length] = _prefill(qp, cache, p, scale, window, terms)
    return out


def _prefill_kernel(ops, q: torch.Tensor, terms: ScoreTerms, bf16: bool) -> bool:
    """Whether qtk's flash kernel (csrc/cpu_attention.cpp) takes a layer's prefill chunks: D % 16 == 0, the
    layer has no softcap or sinks, and the CPU has what the kernel's math needs: AVX512-BF16 in a bf16 step
    (q, K, V and the softmax weights in bf16, the sums float32; 2.5-3.4x torch's float32 flash kernel at
    256-4096 tokens on Zen 4), AVX-512 or AVX2 in a float32 one (all float32; 1.4-2.2x torch's on Zen 4's
    AVX-512; the avx2 build's 8-lane version on AVX2-only CPUs)."""
    return (not terms and q.dtype == torch.float32 and q.shape[-1] % 16 == 0 and
            hasattr(ops, "prefill_attention_runs") and ops.prefill_attention_runs(bf16=bf16))


def _bf16_decode_kernel(ops, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether qtk's bf16 decode kernel (csrc/cpu_attention.cpp: q and the softmax weights rounded to bf16,
    the sums float32, keys read in place; 1.3-2.2x the float32-math kernel at 16 sequences x 320-1024 keys on
    Zen 4) takes a step's decodes: a bf16 cache, D % 16 == 0, and the CPU has AVX512-BF16."""
    return (k_cache.dtype == torch.bfloat16 and q.dtype == torch.float32 and q.shape[-1] % 16 == 0 and
            hasattr(ops, "prefill_attention_runs") and ops.prefill_attention_runs())


def _first_key(n: int, L: int, window: int | None) -> int:
    """The first key any of a chunk's n queries sees, of a context of L: query i sits at position
    p = L - n + i and sees keys 0 .. p (in a window, p - window + 1 .. p)."""
    return 0 if window is None else max(0, L - n - window + 1)


def _dequantized(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if scale is None else (x.float() * scale).to(dtype)


def _prefill(q: torch.Tensor, cache: KVCache, chunk: PrefillChunk, scale: float,
             window: int | None = None, terms: ScoreTerms = NO_TERMS) -> torch.Tensor:
    n, L = chunk.length, chunk.slots.numel()
    first = _first_key(n, L, window)  # the keys from there on are read
    slots = chunk.slots[first:]
    keys = _dequantized(cache.k[:, slots], cache.k_scale, q.dtype)  # [kv_heads, L - first, D]
    values = _dequantized(cache.v[:, slots], cache.v_scale, q.dtype)
    # a whole prompt in one chunk is plainly causal: sdpa skips the blocks above the diagonal instead
    # of reading a mask (1.7x less time at 1024 tokens)
    whole = first == 0 and n == L and window is None and not terms
    mask = None
    if not whole:
        cols, pos = torch.arange(first, L, device=q.device)[None, :], torch.arange(L - n, L, device=q.device)[:, None]
        mask = cols <= pos
        if window is not None:
            mask &= cols > pos - window
    if terms:  # sdpa has neither term: the scores in float32, as _decode
        return _prefill_with_terms(q, keys, values, mask, scale, terms)
    # 4-D: torch runs its flash kernel on CPU only for [batch, heads, L, D] (3-D takes the math path,
    # 4x slower at 1024 tokens)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                       is_causal=whole, scale=scale, enable_gqa=keys.shape[0] != q.shape[1])
    return o[0].transpose(0, 1)


def _prefill_with_terms(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        scale: float, terms: ScoreTerms) -> torch.Tensor:
    """q [n, heads, D], keys/values [kv_heads, L, D], mask bool [n, L] -> [n, heads, D]."""
    n, H, D = q.shape
    kv = keys.shape[0]
    qg = q.transpose(0, 1).reshape(kv, H // kv * n, D)  # [kv, group * n, D]: head h -> kv head h // group
    scores = (qg @ keys.transpose(-1, -2)).float().view(kv, H // kv, n, -1).transpose(1, 2) * scale  # [kv, n, group, L]
    weights = terms.softmax(scores, mask[None, :, None, :])
    o = weights.to(q.dtype).transpose(1, 2).reshape(kv, H // kv * n, -1) @ values  # [kv, group * n, D]
    return o.view(H, n, D).transpose(0, 1)


def _triton_attention(q, k, v, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The same step through kernels/attention.py's kernels: fused quantize-and-store, split-K decode
    over the decodes' block tables, one varlen prefill launch over all prefill chunks."""
    from ..kernels import attention as ta

    ta.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)

    def decode(q):
        return ta.decode_attention(q, cache.k, cache.v, meta.block_tables.to(torch.int32),
                                   meta.decode_lens.to(torch.int32), scale, meta.block_size, cache.k_scale,
                                   cache.v_scale)
    if not meta.prefills:  # a step of decodes only (a CUDA graph's too): token i is sequence i's
        return decode(q)
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device=q.device)
    if meta.decode_index.numel():
        out[meta.decode_index] = decode(q[meta.decode_index])
    chunks = meta.prefills  # one varlen launch over every prefill chunk
    rows = torch.cat([torch.arange(p.start, p.start + p.length, device=q.device) for p in chunks])
    width = max(len(p.block_table) for p in chunks)
    tables = torch.tensor([p.block_table + [0] * (width - len(p.block_table)) for p in chunks], **i32)
    lens = torch.tensor([p.slots.numel() for p in chunks], **i32)
    starts = torch.tensor([0, *itertools.accumulate(p.length for p in chunks)], **i32)
    out[rows] = ta.prefill_attention(q[rows], cache.k, cache.v, tables, lens, starts, scale, meta.block_size,
                                     cache.k_scale, cache.v_scale)
    return out
