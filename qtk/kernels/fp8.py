"""FP8 e4m3 W8A8 GEMM: C = (A_q @ W_q^T) * a_scale * w_scale (+ bias), A_q/W_q float8_e4m3fn.

Scales: per token [M, 1] or per tensor [1] for A; per channel [N, 1] or per tensor [1] for W
(contract of qtk.kernels.w8a8.scaled_mm). Two backends:
    SCALED_MM  torch._scaled_mm (cuBLASLt / CUTLASS): per-tensor scales on sm_89+, row-wise
               (per token x per channel) on sm_90+ with a bf16 output; K and N multiples of 16.
    TRITON     the general path (w8a8._scaled_mm_kernel with fp8 operands, wgmma on sm_90):
               any scale combination, fp16 output, odd shapes, split-K for small M.
AUTO takes SCALED_MM where it applies and M > SCALED_MM_MIN_M, TRITON otherwise: decode-sized
M is a weight stream, which split-K spreads over all SMs. The threshold is a first guess until
`qtk bench kernels` has measured both on the target GPU (it reports them side by side).
FP8 tensor cores need sm_89+; on older GPUs qtk.kernels.dispatch falls back to the reference.
"""
from __future__ import annotations

from enum import Enum

import torch

from .common import check
from .w8a8 import MMConfig, check_scaled_mm, scaled_mm

SCALED_MM_MIN_M = 16


class Fp8Backend(str, Enum):
    AUTO = "auto"
    SCALED_MM = "scaled_mm"
    TRITON = "triton"


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_applies(m: int, n: int, k: int, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch._scaled_mm takes these operands (decided from shapes and the GPU, no trial)."""
    if not fp8_supported(device) or not hasattr(torch, "_scaled_mm") or k % 16 or n % 16:
        return False
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        return True
    return torch.cuda.get_device_capability(device) >= (9, 0) and out_dtype == torch.bfloat16


def _scaled_mm_torch(a_q, w_q, a_scale, w_scale, bias, out_dtype):
    m, n = a_q.shape[0], w_q.shape[0]
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sw = a_scale.reshape(()), w_scale.reshape(()).float()
    else:  # row-wise: both scales as vectors
        sa = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sw = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
    fuse_bias = bias is not None and bias.dtype == out_dtype
    y = torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sw, bias=bias if fuse_bias else None,
                         out_dtype=out_dtype)
    if bias is not None and not fuse_bias:
        y = y + bias.to(out_dtype)
    return y


def fp8_gemm(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             backend: Fp8Backend = Fp8Backend.AUTO, config: MMConfig | None = None) -> torch.Tensor:
    """C [M, N] = (A_q @ W_q^T) * a_scale * w_scale + bias for float8_e4m3fn codes."""
    check(a_q.dtype == torch.float8_e4m3fn, f"A_q must be float8_e4m3fn, got {a_q.dtype}")
    m, n, k = check_scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    if a_q.is_cuda and not fp8_supported(a_q.device):
        major, minor = torch.cuda.get_device_capability(a_q.device)
        raise ValueError(f"FP8 GEMM needs an sm_89+ GPU, this one is sm_{major}{minor}")
    backend = Fp8Backend(backend)
    applies = scaled_mm_applies(m, n, k, a_scale, w_scale, out_dtype, a_q.device)
    if backend is Fp8Backend.SCALED_MM:
        check(applies, f"torch._scaled_mm does not take M={m} N={n} K={k}, a_scale {list(a_scale.shape)}, "
                       f"w_scale {list(w_scale.shape)}, {out_dtype} on {a_q.device}")
    if backend is Fp8Backend.SCALED_MM or (backend is Fp8Backend.AUTO and applies and m > SCALED_MM_MIN_M):
        return _scaled_mm_torch(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    return scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype, config)
