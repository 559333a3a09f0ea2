"""The kernels as torch custom ops (torch.ops.qtk.*), so torch.compile and CUDA graphs capture them.

Each op runs its Triton launcher on GPUs, its reference twin on CPU, and has a fake (meta)
implementation that checks the operands the same way and returns an empty output of the right
shape and dtype. Wrong operands raise ValueError naming the tensor in every mode.
"""
from __future__ import annotations

import torch

from . import reference
from .act_quant import act_quant, check_act_quant
from .fp8 import fp8_gemm
from .w4a16 import check_woq, woq_gemm
from .w8a8 import check_scaled_mm, scaled_mm


@torch.library.custom_op("qtk::woq_gemm", mutates_args=())
def woq_gemm_op(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                bias: torch.Tensor | None, bits: int, group_size: int | None) -> torch.Tensor:
    """W4A16/W8A16: A [M, K] @ dequant(qweight)^T + bias (qtk.kernels.w4a16)."""
    return woq_gemm(a, qweight, scales, zeros, bias, bits, group_size)


@woq_gemm_op.register_kernel("cpu")
def _woq_gemm_cpu(a, qweight, scales, zeros, bias, bits, group_size):
    check_woq(a, qweight, scales, zeros, bias, bits, group_size)
    return reference.woq_gemm_ref(a, qweight, scales, zeros, bias, bits, group_size)


@woq_gemm_op.register_fake
def _woq_gemm_fake(a, qweight, scales, zeros, bias, bits, group_size):
    m, n, _ = check_woq(a, qweight, scales, zeros, bias, bits, group_size)
    return a.new_empty(m, n)


@torch.library.custom_op("qtk::act_quant", mutates_args=())
def act_quant_op(x: torch.Tensor, out_dtype: torch.dtype,
                 static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic (static_scale None) or static per-tensor int8/fp8 quantization."""
    q, s = act_quant(x, out_dtype, static_scale)
    return q, s.clone() if static_scale is not None else s  # outputs may not alias inputs


@act_quant_op.register_kernel("cpu")
def _act_quant_cpu(x, out_dtype, static_scale):
    check_act_quant(x, out_dtype, static_scale)
    q, s = reference.act_quant_ref(x, out_dtype, static_scale)
    return q, s.clone() if static_scale is not None else s


@act_quant_op.register_fake
def _act_quant_fake(x, out_dtype, static_scale):
    check_act_quant(x, out_dtype, static_scale)
    scale = x.new_empty(1, dtype=torch.float32) if static_scale is not None else x.new_empty(x.shape[0], 1, dtype=torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype), scale


@torch.library.custom_op("qtk::scaled_mm", mutates_args=())
def scaled_mm_op(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """W8A8 int8 (Triton) or fp8 e4m3 (torch._scaled_mm or Triton): (A_q @ W_q^T) * scales + bias."""
    if a_q.dtype == torch.float8_e4m3fn:
        return fp8_gemm(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    return scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype)


@scaled_mm_op.register_kernel("cpu")
def _scaled_mm_cpu(a_q, w_q, a_scale, w_scale, bias, out_dtype):
    check_scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    return reference.scaled_mm_ref(a_q, w_q, a_scale, w_scale, bias, out_dtype)


@scaled_mm_op.register_fake
def _scaled_mm_fake(a_q, w_q, a_scale, w_scale, bias, out_dtype):
    m, n, _ = check_scaled_mm(a_q, w_q, a_scale, w_scale, bias, out_dtype)
    return a_q.new_empty(m, n, dtype=out_dtype)
