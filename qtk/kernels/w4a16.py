"""W4A16 / W8A16 weight-only GEMM: C = A @ dequant(W)^T (+ bias).

Contract (`woq_gemm`):
    A       [M, K] fp16/bf16, unit stride along K
    qweight int32 [ceil(K*b/32), N]   the run-time layout of qtk.kernels.layout (b = 4 or 8)
    scales  [K/G, N] (group G) or [1, N] (per channel), fp16/bf16/fp32
    zeros   uint8 like scales (asymmetric) or None (symmetric)
    bias    [N] or None
    C       [M, N] in A's dtype
The checkpoint's pack-quantized tensors are repacked into that layout once per layer
(qtk.kernels.layout.pack_woq, cached by qtk.kernels.dispatch).

Paths, by M:
    M <= GEMV_MAX_M   `_woq_gemv_kernel`: CUDA-core dot products, the few rows of A kept in
                      registers while each weight tile is dequantized once; split-K over K.
    larger M          `_woq_mm_kernel`: tiles dequantized to A's dtype feed tl.dot (mma on
                      sm_80, wgmma on sm_90) with an fp32 accumulator; split-K when the tiles
                      alone cannot fill the SMs (M up to a few hundred), none for prefill.
    M >= DEQUANT_MM_MIN_M
                      `woq_dequant` (`_woq_dequant_kernel`: W^T decoded once into A's dtype)
                      then cuBLAS. On the H200 the tiled kernel ran at a third of cuBLAS bf16 at
                      M = 1024-4096, while decoding W^T costs about one read of the bf16 weight;
                      vLLM's AWQ path switches to dequantize + matmul at the same 256 tokens.
Group scales are applied per K tile (in the tiled path BLOCK_K divides G, so a tile lies in one
group; the GEMV loads them per word row); per-channel scales are applied once to the accumulator. The configs below are a starting point, not tuned
on a GPU yet (qtk bench kernels measures them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import ACT_DTYPES, check, check_bias, check_matrix, check_same_device, k_splits, pick_split_k, \
    TileConfig, sm_count, splitk_reduce, store_tile, tile_of
from .layout import WOQ_BITS

GEMV_MAX_M = 4
DEQUANT_MM_MIN_M = 256


@dataclass(frozen=True)
class WOQConfig(TileConfig):
    """Launch config: the GEMV kernel (gemv), the tiled one, or W^T decoded by tiles of
    [block_k, block_n] then cuBLAS (dequant_mm); block sizes, K slices."""

    gemv: bool = False
    dequant_mm: bool = False


def _block_k(preferred: int, group_size: int | None) -> int:
    """The largest power of two <= preferred dividing the group size (a tile never spans groups)."""
    if group_size is None:
        return preferred
    bk = preferred
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk


def woq_config(m: int, n: int, k: int, group_size: int | None, sms: int) -> WOQConfig:
    """Heuristic config by M (see the module docstring)."""
    if m <= GEMV_MAX_M:
        bm, bn, bk, warps, stages = triton.next_power_of_2(m), 128, 256, 4, 2
        tiles = triton.cdiv(n, bn)
        split = pick_split_k(tiles, triton.cdiv(k, bk), sms)
        return WOQConfig(bm, bn, bk, split, num_warps=warps, num_stages=stages, gemv=True)
    if m <= 64:
        bm, bn, bk, warps, stages = max(16, triton.next_power_of_2(m)), 64, _block_k(128, group_size), 4, 4
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, _block_k(64, group_size), 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, _block_k(64, group_size), 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = pick_split_k(tiles, triton.cdiv(k, bk), sms)
    return WOQConfig(bm, bn, bk, split, num_warps=warps, num_stages=stages, dequant_mm=m >= DEQUANT_MM_MIN_M)


@triton.jit
def _load_dequant(w_ptr, s_ptr, z_ptr, offs_k, offs_n, k_mask, n_mask, g, N,
                  BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZP: tl.constexpr):
    """W^T tile [BLOCK_K, BLOCK_N] in fp32; group g for the whole tile (row 0 per channel)."""
    PER_WORD: tl.constexpr = 32 // BITS
    mask = k_mask[:, None] & n_mask[None, :]
    # a word holds PER_WORD consecutive rows of one column: each of them loads it (L1 hits after
    # the first) and shifts its own field out
    words = tl.load(w_ptr + (offs_k // PER_WORD)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    u = ((words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    if HAS_ZP:
        u0 = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        w = u - u0[None, :]
    else:
        w = u - (1 << (BITS - 1))
    if not PER_CHANNEL:
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = w * s[None, :]
    return w


@triton.jit
def _woq_gemv_kernel(a_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, M, N, K, stride_am, K_PER_SPLIT,
                     BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Small M: C[m, n] = sum_k A[m, k] W^T[k, n] on CUDA cores; grid (N / BLOCK_N, SPLIT_K).

    Each word row of the tile [BLOCK_K / E, BLOCK_N] is loaded once (coalesced along N) and its
    E fields unpacked in registers: field j holds rows k0 + E*r + j, whose A values are a strided
    load from the (cached) row of A. A word's E rows share a group, so scales and zero points are
    loaded per word row and BLOCK_K need not divide the group size."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PER_WORD
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_word = k0 + offs_r * PER_WORD  # first row of each word
        mask = (k_word < k_end)[:, None] & n_mask[None, :]
        words = tl.load(w_ptr + (k_word // PER_WORD)[:, None] * N + offs_n[None, :], mask=mask, other=0)
        if PER_CHANNEL:
            sz_offs = offs_n[None, :] + 0 * k_word[:, None]  # row 0 for every word
        else:
            sz_offs = (k_word // GROUP_SIZE)[:, None] * N + offs_n[None, :]
        if HAS_ZP:
            u0 = tl.load(z_ptr + sz_offs, mask=mask, other=0).to(tl.float32)
        else:
            u0 = (1 << (BITS - 1))
        if not PER_CHANNEL:
            s = tl.load(s_ptr + sz_offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(PER_WORD):
            w = ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32) - u0
            if not PER_CHANNEL:
                w = w * s
            k_mask = k_word + j < k_end
            for m in tl.static_range(BLOCK_M):
                # rows past M re-read row M-1; their results are never stored
                a = tl.load(a_ptr + tl.minimum(m, M - 1) * stride_am + k_word + j, mask=k_mask, other=0.0)
                part = tl.sum(a.to(tl.float32)[:, None] * w, axis=0)  # [BLOCK_N]
                acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    _epilogue(acc, s_ptr, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k, PER_CHANNEL, HAS_BIAS, WRITE_PARTIAL)


@triton.jit
def _epilogue(acc, s_ptr, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k,
              PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr):
    """Per-channel scale, then either the fp32 partial of slice pid_k or bias + cast into C."""
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    store_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, WRITE_PARTIAL)


@triton.jit
def _woq_mm_kernel(a_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, M, N, K, stride_am, K_PER_SPLIT,
                   BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                   HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tiled: C tile [BLOCK_M, BLOCK_N] += A tile @ dequant(W^T tile) on tensor cores;
    grid (tiles, SPLIT_K), tiles ordered in GROUP_M-row bands so W tiles are reused from L2."""
    pid_k = tl.program_id(1)
    offs_m, offs_n, m_mask, n_mask, k_start, k_end = tile_of(M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        g = 0 if PER_CHANNEL else k0 // GROUP_SIZE
        w = _load_dequant(w_ptr, s_ptr, z_ptr, offs_k, offs_n, k_mask, n_mask, g, N, BITS, PER_CHANNEL, HAS_ZP)
        acc = tl.dot(a, w.to(a.dtype), acc)
    _epilogue(acc, s_ptr, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k, PER_CHANNEL, HAS_BIAS, WRITE_PARTIAL)


@triton.jit
def _woq_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K,
                        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                        HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T [K, N] in out's dtype, one [BLOCK_K, BLOCK_N] tile per program; grid (K / BLOCK_K,
    N / BLOCK_N). BLOCK_K divides the group size, as in the tiled GEMM."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = offs_k < K, offs_n < N
    g = 0 if PER_CHANNEL else tl.program_id(0) * BLOCK_K // GROUP_SIZE
    w = _load_dequant(w_ptr, s_ptr, z_ptr, offs_k, offs_n, k_mask, n_mask, g, N, BITS, PER_CHANNEL, HAS_ZP)
    if PER_CHANNEL:
        w = w * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


def woq_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int | None, k: int, dtype: torch.dtype, block_k: int = 64,
                block_n: int = 128) -> torch.Tensor:
    """W^T [K, N] in dtype from the run-time layout (the twin of layout.dequant_woq)."""
    n = qweight.shape[1]
    block_k = _block_k(block_k, group_size)
    out = torch.empty(k, n, device=qweight.device, dtype=dtype)
    if k and n:
        _woq_dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
            qweight, scales, zeros if zeros is not None else scales, out, n, k, BITS=bits,
            GROUP_SIZE=group_size or 1, PER_CHANNEL=group_size is None, HAS_ZP=zeros is not None,
            BLOCK_K=block_k, BLOCK_N=block_n)
    return out


def check_woq(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              bias: torch.Tensor | None, bits: int, group_size: int | None) -> tuple[int, int, int]:
    """Validate woq_gemm's inputs (ValueError naming the tensor); returns (M, N, K)."""
    check(bits in WOQ_BITS, f"bits must be one of {WOQ_BITS}, got {bits}")
    check_matrix("A", a, ACT_DTYPES)
    m, k = a.shape
    check_matrix("qweight", qweight, (torch.int32,), rows=triton.cdiv(k * bits, 32))
    check(qweight.is_contiguous(), f"qweight must be contiguous, got strides {qweight.stride()}")
    n = qweight.shape[1]
    if group_size is None:
        groups = 1
    else:
        check(group_size >= 16 and group_size % 16 == 0, f"group_size must be a multiple of 16, got {group_size}")
        check(k % group_size == 0, f"group_size {group_size} does not divide K={k}")
        groups = k // group_size
    check_matrix("scales", scales, ACT_DTYPES + (torch.float32,), rows=groups, cols=n)
    check(scales.is_contiguous(), f"scales must be contiguous, got strides {scales.stride()}")
    if zeros is not None:
        check_matrix("zeros", zeros, (torch.uint8,), rows=groups, cols=n)
        check(zeros.is_contiguous(), f"zeros must be contiguous, got strides {zeros.stride()}")
    check_bias(bias, n)
    check_same_device(A=a, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    return m, n, k


def woq_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, bits: int = 4, group_size: int | None = 128,
             config: WOQConfig | None = None) -> torch.Tensor:
    """C [M, N] = A @ dequant(qweight)^T + bias in A's dtype (contract in the module docstring)."""
    m, n, k = check_woq(a, qweight, scales, zeros, bias, bits, group_size)
    cfg = config or woq_config(m, n, k, group_size, sm_count(a.device))
    if cfg.gemv:
        check(cfg.block_k % (32 // bits) == 0, f"GEMV block_k {cfg.block_k} must be a multiple of {32 // bits}")
    else:
        check(group_size is None or group_size % cfg.block_k == 0,
              f"config block_k {cfg.block_k} must divide group_size {group_size}")
    if cfg.dequant_mm and m and n:
        wt = woq_dequant(qweight, scales, zeros, bits, group_size, k, a.dtype, cfg.block_k, cfg.block_n)
        return torch.mm(a, wt) if bias is None else torch.addmm(bias.to(a.dtype), a, wt)
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    if m == 0 or n == 0:
        return out
    kps, split = k_splits(k, cfg.split_k, cfg.block_k)
    c = torch.empty(split, m, n, device=a.device, dtype=torch.float32) if split > 1 else out
    common = dict(BITS=bits, GROUP_SIZE=group_size or 1, PER_CHANNEL=group_size is None, HAS_ZP=zeros is not None,
                  HAS_BIAS=bias is not None, WRITE_PARTIAL=split > 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (a, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, c,
            m, n, k, a.stride(0), kps)
    if cfg.gemv:
        check(m <= cfg.block_m, f"GEMV config block_m {cfg.block_m} is smaller than M={m}")
        _woq_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](*args, BLOCK_M=cfg.block_m, **common)
    else:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        _woq_mm_kernel[(tiles, split)](*args, BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m, **common)
    return splitk_reduce(c, bias, a.dtype) if split > 1 else out
