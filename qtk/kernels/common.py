"""What every Triton GEMM here shares: input checks, the SM count, the split-K reduction.

Split-K: when M is small the (M/BLOCK_M) x (N/BLOCK_N) tiles are too few to keep every SM
streaming weights, so K is cut into SPLIT_K slices; each program writes its float32 partial
(scales already applied) to P [SPLIT_K, M, N] and `splitk_reduce` sums them in a fixed order,
adds the bias and casts: deterministic, and no atomics or zero-filled buffer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ACT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TileConfig:
    """Launch config of a tiled GEMM: tile sizes, K slices (split-K), band height (tile_of), warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_matrix(name: str, t: torch.Tensor, dtypes: tuple, rows: int | None = None,
                 cols: int | None = None, row_major: bool = True) -> None:
    """t is 2-D, of one of `dtypes`, [rows, cols] where given, with unit stride along dim 1."""
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    check(t.dim() == 2, f"{name} must be 2-D, got shape {list(t.shape)}")
    check(t.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if rows is not None:
        check(t.shape[0] == rows, f"{name} must have {rows} rows, got shape {list(t.shape)}")
    if cols is not None:
        check(t.shape[1] == cols, f"{name} must have {cols} columns, got shape {list(t.shape)}")
    if row_major:
        check(t.stride(1) == 1 or t.shape[1] == 1,
              f"{name} must be contiguous along dim 1, got strides {t.stride()}")


def check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is None:
        return
    check(bias.dim() == 1 and bias.shape[0] == n, f"bias must be [{n}], got shape {list(bias.shape)}")
    check(bias.is_contiguous(), f"bias must be contiguous, got strides {bias.stride()}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    check(len(set(devices.values())) <= 1, f"tensors on different devices: {devices}")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (the interpreter: fewest programs is fastest)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pick_split_k(tiles: int, k_blocks: int, sms: int, max_split: int = 16, min_blocks: int = 2) -> int:
    """Slices of K so tiles * split covers the SMs twice, each slice at least min_blocks blocks
    (1 for no tiles at all: an empty M or N launches nothing)."""
    if tiles == 0 or tiles >= sms:
        return 1
    split = min(max_split, triton.cdiv(2 * sms, tiles), max(1, k_blocks // min_blocks))
    return max(1, split)


def k_splits(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(length of each K slice, a multiple of block_k, the last one maybe shorter; slices, at most
    split_k and each non-empty). K = 0 is one empty slice: the GEMM writes the bias."""
    k_per_split = max(1, triton.cdiv(triton.cdiv(k, split_k), block_k)) * block_k
    return k_per_split, max(1, triton.cdiv(k, k_per_split))


@triton.jit
def tile_of(M, N, K, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile and K slice: (offs_m, offs_n, m_mask, n_mask, k_start, k_end).

    Grid (tiles, SPLIT_K); tiles are ordered in bands of GROUP_M tile-rows so consecutive programs
    share W tiles while they are in L2 (Triton's matmul tutorial ordering)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * grid_n)
    first_m = band * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows
    pid_n = (pid % (GROUP_M * grid_n)) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * K_PER_SPLIT
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + K_PER_SPLIT, K)


@triton.jit
def store_tile(y, bias_ptr, c_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr):
    """Write a scaled fp32 tile: the partial of K slice pid_k into P [SPLIT_K, M, N] (splitk_reduce
    adds the bias), or + bias, cast, into C [M, N]."""
    n_mask = offs_n < N
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if WRITE_PARTIAL:
        tl.store(c_ptr + pid_k.to(tl.int64) * M * N + offs, y, mask=mask)
    else:
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs, y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(p_ptr, bias_ptr, c_ptr, MN, N,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # p [SPLIT_K, M, N] fp32 -> c [M, N] = sum_s p[s] + bias
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK = 1024


def splitk_reduce(partials: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """partials [SPLIT_K, M, N] float32 -> [M, N] out_dtype, bias added."""
    split_k, m, n = partials.shape
    out = torch.empty(m, n, device=partials.device, dtype=out_dtype)
    grid = (triton.cdiv(m * n, REDUCE_BLOCK),)
    _splitk_reduce_kernel[grid](partials, bias if bias is not None else partials, out, m * n, n,
                                SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK)
    return out
