"""W8A8 GEMM with a scale epilogue: C = (A_q @ W_q^T) * a_scale * w_scale (+ bias).

Contract (`scaled_mm`, shared by int8 and fp8 e4m3):
    A_q      [M, K] int8 (or float8_e4m3fn), unit stride along K
    W_q      [N, K] same dtype, row-major: the checkpoint's int-/float-quantized `weight` read
             as is (W^T tiles are K-contiguous, the K-major operand mma/wgmma want for 8-bit)
    a_scale  [M, 1] fp32 per token, or [1] per tensor (static)
    w_scale  [N, 1] or [N] per channel, or [1] per tensor; fp32/fp16/bf16
    bias     [N] or None
    C        [M, N] fp16/bf16
Accumulation is exact int32 for int8 and fp32 for fp8; the epilogue is fp32. Small M splits K
(qtk.kernels.common) so the weight stream keeps every SM busy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ACT_DTYPES, check, check_bias, check_matrix, check_same_device, k_splits, pick_split_k, \
    TileConfig, sm_count, splitk_reduce, store_tile, tile_of

W8A8_DTYPES = (torch.int8, torch.float8_e4m3fn)


MMConfig = TileConfig  # the scaled GEMM's launch config


def mm_config(m: int, n: int, k: int, sms: int) -> MMConfig:
    """Heuristic config by M; BLOCK_K 128 = 128 bytes of 8-bit codes per row of a tile."""
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = triton.next_power_of_2(m), 64, 4, 4
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    bk = 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = pick_split_k(tiles, triton.cdiv(k, bk), sms)
    return MMConfig(bm, bn, bk, split, num_warps=warps, num_stages=stages)


@triton.jit
def _scaled_mm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_wn, K_PER_SPLIT,
                      IS_FP8: tl.constexpr, A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (tiles, SPLIT_K); tiles ordered in GROUP_M-row bands so W tiles are reused from L2."""
    pid_k = tl.program_id(1)
    offs_m, offs_n, m_mask, n_mask, k_start, k_end = tile_of(M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    if IS_FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IS_FP8:  # Hopper's fp8 MMA accumulates coarsely: add into acc in fp32 every BLOCK_K (as cuBLAS does)
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
    # epilogue in fp32: per-token x per-channel (or per-tensor) scales
    y = acc.to(tl.float32)
    if A_PER_TOKEN:
        y = y * tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    else:
        y = y * tl.load(as_ptr)
    if W_PER_CHANNEL:
        y = y * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        y = y * tl.load(ws_ptr).to(tl.float32)
    store_tile(y, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, WRITE_PARTIAL)


def check_scaled_mm(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[int, int, int]:
    """Validate scaled_mm's inputs (ValueError naming the tensor); returns (M, N, K)."""
    check_matrix("A_q", a_q, W8A8_DTYPES)
    m, k = a_q.shape
    check_matrix("W_q", w_q, (a_q.dtype,), cols=k)
    n = w_q.shape[0]
    check(a_scale.dtype == torch.float32, f"a_scale must be float32, got {a_scale.dtype}")
    check(a_scale.numel() == 1 or tuple(a_scale.shape) == (m, 1),
          f"a_scale must be [{m}, 1] (per token) or [1] (per tensor), got shape {list(a_scale.shape)}")
    check(a_scale.is_contiguous(), f"a_scale must be contiguous, got strides {a_scale.stride()}")
    check(w_scale.dtype in ACT_DTYPES + (torch.float32,), f"w_scale must be fp32/fp16/bf16, got {w_scale.dtype}")
    check(w_scale.numel() == 1 or (w_scale.numel() == n and w_scale.shape[0] == n),
          f"w_scale must be [{n}, 1] / [{n}] (per channel) or [1] (per tensor), got shape {list(w_scale.shape)}")
    check(w_scale.is_contiguous(), f"w_scale must be contiguous, got strides {w_scale.stride()}")
    check(out_dtype in ACT_DTYPES, f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    check_bias(bias, n)
    check_same_device(A_q=a_q, W_q=w_q, a_scale=a_scale, w_scale=w_scale, bias=bias)
    return m, n, k


def scaled_mm(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              config: MMConfig | None = None) -> torch.Tensor:
    """C [M, N] = (A_q @ W_q^T) * a_scale * w_scale + bias (contract in the module docstring)."""
    m, n, k = check_scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    cfg = config or mm_config(m, n, k, sm_count(a_q.device))
    out = torch.empty(m, n, device=a_q.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    kps, split = k_splits(k, cfg.split_k, cfg.block_k)
    c = torch.empty(split, m, n, device=a_q.device, dtype=torch.float32) if split > 1 else out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _scaled_mm_kernel[(tiles, split)](
        a_q, w_q, a_scale, w_scale, bias if bias is not None else w_scale, c, m, n, k, a_q.stride(0), w_q.stride(0),
        kps, IS_FP8=a_q.dtype == torch.float8_e4m3fn, A_PER_TOKEN=a_scale.numel() != 1,
        W_PER_CHANNEL=w_scale.numel() != 1, HAS_BIAS=bias is not None, WRITE_PARTIAL=split > 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return splitk_reduce(c, bias, out_dtype) if split > 1 else out


def int8_gemm(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              config: MMConfig | None = None) -> torch.Tensor:
    """int8 x int8 -> int32 GEMM with the fp32 scale epilogue (scaled_mm for int8 codes)."""
    check(a_q.dtype == torch.int8, f"A_q must be int8, got {a_q.dtype}")
    return scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype, config)
