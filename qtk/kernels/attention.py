"""Paged attention over the runtime's KV cache in Triton: store, decode (flash-decoding), prefill.

Cache of one layer (the CPU path's layout):
    k_cache, v_cache  [kv_heads, num_slots, D] contiguous, num_slots = num_blocks * block_size;
                      the token at position p of a sequence sits at slot
                      block_table[p // block_size] * block_size + p % block_size, so one block of
                      one head is a contiguous [block_size, D] tile (vLLM's paged KV cache)
    dtype             the model's (fp16/bf16/fp32), or float8_e4m3fn / int8 codes with fp32 scales
                      k_scale, v_scale [1] (per tensor) or [kv_heads] (per head):
                      fp8: code = e4m3(clamp(x / s, -448, 448)); int8: code = clamp(round(x / s), -128, 127);
                      x ~ code * s
    GQA               query head h reads kv head h // (heads / kv_heads)

Kernels:
    store_kv           vLLM's reshape_and_cache: one program per new token writes K and V of every
                       kv head at its slot, quantizing on the way for an fp8/int8 cache (the codes
                       of qtk.kernels.act_quant); slot < 0 marks padding and is skipped.
    decode_attention   flash-decoding (Dao et al. 2023; vLLM's paged_attention_v2): one query per
                       sequence. Grid (B, kv_heads, splits): a program takes the G query heads of one
                       kv head as the rows of a [BLOCK_M, D] tile (G padded to 16, the least tl.dot
                       takes; decode is bound by reading the cache, not by the idle MMA rows) and
                       runs the online softmax over its split of the context, BLOCK_N keys at a time
                       gathered through the block table. With one split it writes the output; else
                       each split leaves (m, l, acc) in fp32 and `_decode_reduce_kernel` combines
                       them: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
    prefill_attention  flash-attention 2's forward over a packed ragged batch of prefill chunks
                       (vLLM's triton unified attention): grid (query blocks of all sequences, heads);
                       query i of a chunk of n tokens in a context of L sits at position L - n + i and
                       sees keys 0 .. L - n + i (causal with an offset: the cached prefix is visible).
Both attention kernels share `_attend`, one online-softmax step (FlashAttention, Alg. 1):
    s = q k^T * scale; m' = max(m, rowmax s); p = exp(s - m'); l' = l e^(m - m') + rowsum p;
    acc' = acc e^(m - m') + p v;  out = acc / l
computed with exp2 (log2 e folded into the scale), fp32 statistics and accumulators, tl.dot on q's
dtype (p is rounded to it for the PV product, as FlashAttention does; fp32 models use IEEE fp32 dots).
Cache codes are exact in fp16/bf16 (|int8| <= 128, e4m3 within both ranges), so a quantized tile
enters tl.dot as codes and its scale, one per program (one kv head), multiplies the scores (k_scale)
and the output (v_scale): the dequantized values without a rounding of code * scale.
The configs are a starting point, not tuned on a GPU yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .act_quant import _quantize
from .common import check, check_same_device, pick_split_k, sm_count
from .fp8 import fp8_supported

LOG2E = tl.constexpr(1.4426950408889634)
NO_SCORE = tl.constexpr(-1.0e30)  # the running max before any key: finite, so 2^(m - m') is never NaN
ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_MODES = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}  # any other cache dtype: "float"
MAX_SPLITS = 16


@dataclass(frozen=True)
class AttnConfig:
    """Launch config: query rows per program (decode: the padded GQA group), keys per step,
    context splits (decode), warps, pipeline stages."""

    block_m: int
    block_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


def decode_config(batch: int, kv_heads: int, group: int, max_context: int, sms: int) -> AttnConfig:
    """Split the context when the B * kv_heads programs cannot fill the SMs twice, each split
    keeping at least 4 key tiles (common.pick_split_k's rule)."""
    block_n = 64
    splits = pick_split_k(batch * kv_heads, triton.cdiv(max_context, block_n), sms, MAX_SPLITS, min_blocks=4)
    return AttnConfig(max(16, triton.next_power_of_2(group)), block_n, splits)


def prefill_config(head_dim: int) -> AttnConfig:
    """64 query rows (a warpgroup's wgmma on sm_90, mma.sync on sm_80) x 64 keys, 32 above D = 128:
    no register spills for D = 96, 128, 256."""
    return AttnConfig(64, 32 if head_dim > 128 else 64, num_warps=4, num_stages=2)


# -- shared device helpers ---------------------------------------------------------------------

@triton.jit
def _kv_scale(scale_ptr, head, CACHE: tl.constexpr, PER_HEAD_SCALE: tl.constexpr):
    """Dequantization scale of kv head `head` (1 for a float cache)."""
    if CACHE == "float":
        scale = 1.0
    elif PER_HEAD_SCALE:
        scale = tl.load(scale_ptr + head).to(tl.float32)
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    return scale


@triton.jit
def _slots(table_ptr, offs_n, n_mask, BLOCK_SIZE: tl.constexpr):
    """Cache slots [BLOCK_N] (int64) of key positions offs_n, through one sequence's block table."""
    blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    return blocks.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE


@triton.jit
def _attend(q, k_head_ptr, v_head_ptr, slots, n_mask, visible, m_i, l_i, acc, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One online-softmax step over BLOCK_N keys of one kv head (see the module docstring).
    q [R, BLOCK_D]; slots, n_mask [BLOCK_N]; visible [R, BLOCK_N]; qk_scale = scale * k_scale * log2 e;
    running max m_i [R] (log2 units), sum l_i [R], acc [R, BLOCK_D] fp32 -> updated (m_i, l_i, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # K^T [BLOCK_D, BLOCK_N]: codes -> fp32 -> q's dtype (exact; the interpreter needs the fp32 hop)
    kt = tl.load(k_head_ptr + slots[None, :] * HEAD_DIM + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :],
                 other=0.0).to(tl.float32).to(q.dtype)
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_head_ptr + slots[:, None] * HEAD_DIM + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32).to(q.dtype)
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _store_rows(out_ptr, rows, stride_row, acc, l_i, v_scale, row_mask, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """out[rows] = acc / l * v_scale in out's dtype (zeros for a row that saw no key)."""
    offs_d = tl.arange(0, BLOCK_D)
    y = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :]
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


# -- store --------------------------------------------------------------------------------------

@triton.jit
def _store_one(src_ptr, stride_h, cache_ptr, scale_ptr, slot, num_slots, kv_heads, HEAD_DIM: tl.constexpr,
               CACHE: tl.constexpr, PER_HEAD_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's [kv_heads, D] into cache[:, slot, :], quantized for an fp8/int8 cache."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < kv_heads
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(src_ptr + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + offs_h.to(tl.int64)[:, None] * num_slots * HEAD_DIM + slot * HEAD_DIM + offs_d[None, :]
    if CACHE == "float":
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        if PER_HEAD_SCALE:
            scale = tl.load(scale_ptr + offs_h, mask=h_mask, other=1.0).to(tl.float32)
        else:
            scale = tl.zeros([BLOCK_H], dtype=tl.float32) + tl.load(scale_ptr).to(tl.float32)
        tl.store(dst, _quantize(x.to(tl.float32), scale, CACHE), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, num_slots, kv_heads,
                     HEAD_DIM: tl.constexpr, CACHE: tl.constexpr, PER_HEAD_SCALE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t = program_id(0): k[t], v[t] [kv_heads, D] -> k_cache, v_cache [:, slot_mapping[t], :]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    _store_one(k_ptr + t.to(tl.int64) * stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, slot, num_slots, kv_heads,
               HEAD_DIM, CACHE, PER_HEAD_SCALE, BLOCK_H, BLOCK_D)
    _store_one(v_ptr + t.to(tl.int64) * stride_vt, stride_vh, v_cache_ptr, v_scale_ptr, slot, num_slots, kv_heads,
               HEAD_DIM, CACHE, PER_HEAD_SCALE, BLOCK_H, BLOCK_D)


# -- decode -------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, lens_ptr,
                   out_ptr, m_ptr, l_ptr, sm_scale, stride_qb, stride_qh, stride_table, num_slots, num_heads,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CACHE: tl.constexpr,
                   PER_HEAD_SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sequence b, kv head g, split p (grid (B, kv_heads, NUM_SPLITS)): the GROUP query heads of g
    against keys [p * part, (p + 1) * part) of b's context, part = context / NUM_SPLITS in whole tiles.
    One split: out [B, H, D]. Else fp32 partials m, l [B, H, NUM_SPLITS] and acc (out_ptr) [B, H, NUM_SPLITS, D]."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + b)
    part = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * part
    end = tl.minimum(start + part, context)
    r = tl.arange(0, BLOCK_M)
    row_mask = r < GROUP
    heads = g * GROUP + r  # the rows: query heads h with h // GROUP == g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # q [BLOCK_M, BLOCK_D], rows past GROUP zero
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E * _kv_scale(k_scale_ptr, g, CACHE, PER_HEAD_SCALE)
    k_head_ptr = k_cache_ptr + g.to(tl.int64) * num_slots * HEAD_DIM
    v_head_ptr = v_cache_ptr + g.to(tl.int64) * num_slots * HEAD_DIM
    table_ptr += b.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = _slots(table_ptr, offs_n, n_mask, BLOCK_SIZE)
        m_i, l_i, acc = _attend(q, k_head_ptr, v_head_ptr, slots, n_mask, n_mask[None, :], m_i, l_i, acc, qk_scale,
                                HEAD_DIM, BLOCK_D)
    v_scale = _kv_scale(v_scale_ptr, g, CACHE, PER_HEAD_SCALE)
    rows = b * num_heads + heads  # [B, H] row-major
    if NUM_SPLITS == 1:
        _store_rows(out_ptr, rows, HEAD_DIM, acc, l_i, v_scale, row_mask, HEAD_DIM, BLOCK_D)
    else:
        part_rows = rows.to(tl.int64) * NUM_SPLITS + split
        tl.store(m_ptr + part_rows, m_i, mask=row_mask)
        tl.store(l_ptr + part_rows, l_i, mask=row_mask)
        tl.store(out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc * v_scale,
                 mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r = b * H + h (grid (B * H,)): out[r] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    m = tl.load(m_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=NO_SCORE)
    l_s = tl.load(l_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    w = tl.exp2(m - tl.max(m, axis=0))
    l_i = tl.sum(w * l_s, axis=0)
    y = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_i > 0, l_i, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, y.to(out_ptr.dtype.element_ty), mask=d_mask)


# -- prefill ------------------------------------------------------------------------------------

@triton.jit
def _sequence_of(query_start_ptr, block, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence owning query block `block`. Sequence s's blocks are numbered from
    query_start[s] // BLOCK_M + s on: at least cdiv(n_s, BLOCK_M) of them, T // BLOCK_M + S in all."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:  # binary search: the last s whose first block is <= block
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_M + mid <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, lens_ptr, query_start_ptr,
                    out_ptr, sm_scale, stride_qt, stride_qh, stride_table, num_slots, num_seqs, num_heads,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CACHE: tl.constexpr,
                    PER_HEAD_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Query block i, head h (grid (T // BLOCK_M + S, H)): BLOCK_M queries of one chunk, each against
    the keys up to its own position. out [T, H, D]."""
    h = tl.program_id(1)
    s = _sequence_of(query_start_ptr, tl.program_id(0), num_seqs, BLOCK_M)
    q_start = tl.load(query_start_ptr + s)
    chunk = tl.load(query_start_ptr + s + 1) - q_start
    m0 = (tl.program_id(0) - q_start // BLOCK_M - s) * BLOCK_M
    if m0 >= chunk:  # a spare block of the numbering
        return
    context = tl.load(lens_ptr + s)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < chunk
    pos = context - chunk + offs_m  # each query's position in the context
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    g = h // GROUP
    qk_scale = sm_scale * LOG2E * _kv_scale(k_scale_ptr, g, CACHE, PER_HEAD_SCALE)
    k_head_ptr = k_cache_ptr + g.to(tl.int64) * num_slots * HEAD_DIM
    v_head_ptr = v_cache_ptr + g.to(tl.int64) * num_slots * HEAD_DIM
    table_ptr += s.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(context, context - chunk + m0 + BLOCK_M)  # past the block's last query
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = _slots(table_ptr, offs_n, n_mask, BLOCK_SIZE)
        visible = (offs_n[None, :] <= pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _attend(q, k_head_ptr, v_head_ptr, slots, n_mask, visible, m_i, l_i, acc, qk_scale,
                                HEAD_DIM, BLOCK_D)
    v_scale = _kv_scale(v_scale_ptr, g, CACHE, PER_HEAD_SCALE)
    _store_rows(out_ptr + h * HEAD_DIM, q_start + offs_m, num_heads * HEAD_DIM, acc, l_i, v_scale, m_mask,
                HEAD_DIM, BLOCK_D)


# -- launchers ----------------------------------------------------------------------------------

def _check_tokens(name: str, x: torch.Tensor, dtypes: tuple) -> None:
    """x [T, heads, D] of one of dtypes, unit stride along D."""
    check(isinstance(x, torch.Tensor) and x.dim() == 3, f"{name} must be a 3-D tensor [tokens, heads, D]")
    check(x.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {x.dtype}")
    check(x.stride(2) == 1, f"{name} must be contiguous along D, got strides {x.stride()}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, model_dtype: torch.dtype,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """Validate a layer's cache and scales -> (CACHE mode, per-head scales, k_scale, v_scale as flat
    tensors; the caches themselves stand in for the unused scale pointers of a float cache)."""
    check(k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "k_cache and v_cache must both be "
          f"[kv_heads, num_slots, D], got {list(k_cache.shape)}, {list(v_cache.shape)}")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    check(k_cache.dtype == v_cache.dtype, f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    check_same_device(k_cache=k_cache, v_cache=v_cache)
    mode = CACHE_MODES.get(k_cache.dtype, "float")
    if mode == "float":
        check(k_cache.dtype == model_dtype,
              f"a float cache must be in the model dtype {model_dtype}, got {k_cache.dtype}")
        check(k_scale is None and v_scale is None, f"k_scale/v_scale given for a {k_cache.dtype} cache")
        return mode, False, k_cache, v_cache
    # Triton has no e4m3 type before sm_89 (the kernels would fail to compile there)
    check(mode != "fp8" or k_cache.device.type != "cuda" or fp8_supported(k_cache.device),
          f"an FP8 KV cache needs an sm_89+ GPU, {k_cache.device} is not one: use an INT8 cache")
    check(k_scale is not None and v_scale is not None, f"a {k_cache.dtype} cache needs k_scale and v_scale")
    kv_heads = k_cache.shape[0]
    # flat and dense: the kernels read scale h at offset h (an expanded [1] is a stride-0 view)
    k_scale, v_scale = k_scale.reshape(-1).contiguous(), v_scale.reshape(-1).contiguous()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(s.numel() in (1, kv_heads), f"{name} must hold 1 or kv_heads={kv_heads} values, got {s.numel()}")
        check(s.dtype.is_floating_point and s.device == k_cache.device, f"{name} must be float on {k_cache.device}")
    check(k_scale.numel() == v_scale.numel(), "k_scale and v_scale must both be per tensor or both per head")
    return mode, k_scale.numel() > 1, k_scale, v_scale


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     seqs: int, block_size: int) -> None:
    """q [., H, D] against the cache of block_size-slot blocks; int32 block_tables [seqs, max_blocks]
    and context_lens [seqs]."""
    check(block_size > 0 and k_cache.shape[1] % block_size == 0,
          f"block_size {block_size} must divide num_slots {k_cache.shape[1]}")
    check(k_cache.shape[2] == q.shape[2], f"cache head dim {k_cache.shape[2]} != q's {q.shape[2]}")
    check(q.shape[1] % k_cache.shape[0] == 0, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[0]}")
    check(block_tables.dim() == 2 and block_tables.shape[0] == seqs and block_tables.dtype == torch.int32
          and block_tables.stride(1) == 1, f"block_tables must be int32 [{seqs}, max_blocks] with unit column stride")
    check(context_lens.shape == (seqs,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous(),
          f"context_lens must be contiguous int32 [{seqs}]")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, kv_heads, D] -> k_cache, v_cache [kv_heads, num_slots, D] at slot_mapping [T] (int64;
    < 0 skipped), quantized with k_scale / v_scale for an fp8/int8 cache."""
    _check_tokens("k", k, ATTN_DTYPES)
    _check_tokens("v", v, (k.dtype,))
    cache, per_head, ks, vs = _check_cache(k_cache, v_cache, k.dtype, k_scale, v_scale)
    kv_heads, num_slots, d = k_cache.shape
    check(k.shape == v.shape and k.shape[1:] == (kv_heads, d), f"k, v must be [T, {kv_heads}, {d}]")
    check(slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous(),
          f"slot_mapping must be contiguous int64 [{k.shape[0]}]")
    check_same_device(k=k, v=v, k_cache=k_cache, slot_mapping=slot_mapping)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, ks, vs, slot_mapping, k.stride(0), k.stride(1),
                                    v.stride(0), v.stride(1), num_slots, kv_heads, HEAD_DIM=d, CACHE=cache,
                                    PER_HEAD_SCALE=per_head, BLOCK_H=triton.next_power_of_2(kv_heads),
                                    BLOCK_D=triton.next_power_of_2(d))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, block_size: int, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """out [B, H, D] (q's dtype): q [B, H, D], one query per sequence, attends to the keys 0 ..
    context_lens[b] - 1 of its block table. num_splits None: decode_config's, from the longest
    context the block tables can hold (no device sync)."""
    _check_tokens("q", q, ATTN_DTYPES)
    cache, per_head, ks, vs = _check_cache(k_cache, v_cache, q.dtype, k_scale, v_scale)
    b, h, d = q.shape
    _check_attention(q, k_cache, block_tables, context_lens, b, block_size)
    kv_heads = k_cache.shape[0]
    cfg = decode_config(b, kv_heads, h // kv_heads, block_tables.shape[1] * block_size, sm_count(q.device))
    splits = cfg.num_splits if num_splits is None else num_splits
    check(splits >= 1, f"num_splits must be >= 1, got {splits}")
    out = torch.empty(b, h, d, device=q.device, dtype=q.dtype)
    if b == 0:
        return out
    if splits == 1:
        acc = m = l_s = out
    else:
        acc = torch.empty(b, h, splits, d, device=q.device, dtype=torch.float32)
        m, l_s = (torch.empty(b, h, splits, device=q.device, dtype=torch.float32) for _ in range(2))
    block_d = triton.next_power_of_2(d)
    _decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, acc, m, l_s, scale, q.stride(0), q.stride(1),
        block_tables.stride(0), k_cache.shape[1], h, GROUP=h // kv_heads, HEAD_DIM=d, BLOCK_SIZE=block_size,
        CACHE=cache, PER_HEAD_SCALE=per_head, NUM_SPLITS=splits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _decode_reduce_kernel[(b * h,)](m, l_s, acc, out, NUM_SPLITS=splits, HEAD_DIM=d,
                                        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, block_size: int,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H, D] (q's dtype): sequence s owns the queries query_start_loc[s] .. query_start_loc[s+1] - 1
    of q [T, H, D] (int32 [S+1]), the last tokens of its context of context_lens[s] (their K/V already
    stored); query i of a chunk of n sees the keys 0 .. context_lens[s] - n + i."""
    _check_tokens("q", q, ATTN_DTYPES)
    cache, per_head, ks, vs = _check_cache(k_cache, v_cache, q.dtype, k_scale, v_scale)
    t, h, d = q.shape
    seqs = context_lens.numel()
    _check_attention(q, k_cache, block_tables, context_lens, seqs, block_size)
    check(query_start_loc.shape == (seqs + 1,) and query_start_loc.dtype == torch.int32
          and query_start_loc.is_contiguous(), f"query_start_loc must be contiguous int32 [{seqs + 1}]")
    check_same_device(q=q, query_start_loc=query_start_loc)
    out = torch.empty(t, h, d, device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    kv_heads = k_cache.shape[0]
    cfg = prefill_config(d)
    _prefill_kernel[(t // cfg.block_m + seqs, h)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, query_start_loc, out, scale, q.stride(0),
        q.stride(1), block_tables.stride(0), k_cache.shape[1], seqs, h, GROUP=h // kv_heads, HEAD_DIM=d,
        BLOCK_SIZE=block_size, CACHE=cache, PER_HEAD_SCALE=per_head, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=triton.next_power_of_2(d), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
