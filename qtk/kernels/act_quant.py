"""Activation quantization for W8A8: dynamic per-token (absmax -> scale -> codes in one kernel)
or static per-tensor (a given scale), to int8 or fp8 e4m3.

Contract (`act_quant`):
    X      [M, K] fp16/bf16/fp32, unit stride along K
    Q      [M, K] int8 or float8_e4m3fn (contiguous)
    scale  [M, 1] fp32 (dynamic per token) or the given [1] fp32 (static per tensor)
Same numbers as qtk.quant.quantize_activation: s = absmax / qmax (eps when 0);
int8: q = clamp(round_half_even(x / s), -128, 127); fp8: q = e4m3(clamp(x / s, -448, 448)).
One program quantizes a row: read once into registers (absmax, scale, codes) for K up to 16384,
in two sweeps over K beyond that.
"""
from __future__ import annotations

from enum import Enum

import torch
import triton
import triton.language as tl

from .common import check, check_matrix
from .fp8 import fp8_supported

# round half to even in fp32 for |x| < 2^22: (x + 1.5 * 2^23) - 1.5 * 2^23 (libdevice.rint does it on
# a GPU, but the interpreter has no libdevice; tests/test_kernels_aot.py checks both adds survive)
ROUND_MAGIC = tl.constexpr(12582912.0)
FP32_EPS = tl.constexpr(1.1920928955078125e-07)  # torch.finfo(torch.float32).eps, as qtk.quant.qparams


class QuantDtype(str, Enum):
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.int8 if self is QuantDtype.INT8 else torch.float8_e4m3fn

    @classmethod
    def of(cls, dtype: torch.dtype) -> QuantDtype:
        if dtype == torch.int8:
            return cls.INT8
        if dtype == torch.float8_e4m3fn:
            return cls.FP8
        raise ValueError(f"activation codes must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


@triton.jit
def _quantize(x, scale, OUT: tl.constexpr):
    """Codes of fp32 x [BLOCK_M, BLOCK_K] for per-row scales [BLOCK_M]. """
    y = tl.math.div_rn(x, scale[:, None])
    if OUT == "fp8":
        q = tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv)
    else:
        q = tl.clamp((y + ROUND_MAGIC) - ROUND_MAGIC, -128.0, 127.0).to(tl.int8)
    return q


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, OUT: tl.constexpr, STATIC: tl.constexpr,
                      ONE_SWEEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BLOCK_M] per program. ONE_SWEEP (BLOCK_K >= K): the rows are read once and kept in
    registers; otherwise a first sweep takes the absmax and a second re-reads them (from L2)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_m.to(tl.int64)[:, None] * K
    qmax: tl.constexpr = 448.0 if OUT == "fp8" else 127.0
    offs_k = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(s_ptr).to(tl.float32)
    if ONE_SWEEP:
        mask = m_mask[:, None] & (offs_k[None, :] < K)
        x = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        if not STATIC:
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), qmax)
            scale = tl.where(scale > 0, scale, FP32_EPS)
            tl.store(s_ptr + offs_m, scale, mask=m_mask)
        tl.store(q_rows + offs_k[None, :], _quantize(x, scale, OUT), mask=mask)
    else:
        if not STATIC:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = m_mask[:, None] & (k0 + offs_k[None, :] < K)
                x = tl.load(x_rows + k0 + offs_k[None, :], mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
            scale = tl.math.div_rn(amax, qmax)
            scale = tl.where(scale > 0, scale, FP32_EPS)
            tl.store(s_ptr + offs_m, scale, mask=m_mask)
        for k0 in range(0, K, BLOCK_K):
            mask = m_mask[:, None] & (k0 + offs_k[None, :] < K)
            x = tl.load(x_rows + k0 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + offs_k[None, :], _quantize(x, scale, OUT), mask=mask)


def act_quant_config(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps): one row per program, held in registers up to 16K columns."""
    block_k = min(triton.next_power_of_2(max(k, 16)), 16384)
    return 1, block_k, 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16


def check_act_quant(x: torch.Tensor, out_dtype: torch.dtype, static_scale: torch.Tensor | None) -> QuantDtype:
    """Validate act_quant's operands (ValueError naming the tensor); returns the code kind."""
    kind = QuantDtype.of(out_dtype)
    check_matrix("X", x, (torch.float16, torch.bfloat16, torch.float32))
    check(kind is QuantDtype.INT8 or x.device.type != "cuda" or fp8_supported(x.device),
          f"FP8 codes need an sm_89+ GPU, {x.device} is not one")  # Triton has no e4m3 before sm_89
    if static_scale is not None:
        check(isinstance(static_scale, torch.Tensor) and static_scale.dtype.is_floating_point,
              f"static_scale must be a float tensor, got {getattr(static_scale, 'dtype', type(static_scale))}")
        check(static_scale.numel() == 1, f"static_scale must hold one value, got shape {list(static_scale.shape)}")
        check(static_scale.device == x.device, f"static_scale is on {static_scale.device}, X on {x.device}")
    return kind


def act_quant(x: torch.Tensor, out_dtype: torch.dtype = torch.int8, static_scale: torch.Tensor | None = None,
              block_m: int | None = None, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [M, K] and scales ([M, 1] fp32 per token, or static_scale as [1] fp32)."""
    kind = check_act_quant(x, out_dtype, static_scale)
    m, k = x.shape
    if static_scale is not None:
        scale = static_scale.reshape(1).to(torch.float32)
    else:
        scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    q = torch.empty(m, k, device=x.device, dtype=kind.torch_dtype)
    if m == 0 or k == 0:
        return q, scale
    bm, bk, warps = act_quant_config(m, k)
    bm, bk = block_m or bm, block_k or bk
    _act_quant_kernel[(triton.cdiv(m, bm),)](x, q, scale, m, k, x.stride(0), OUT=kind.value,
                                             STATIC=static_scale is not None, ONE_SWEEP=bk >= k,
                                             BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
    return q, scale
