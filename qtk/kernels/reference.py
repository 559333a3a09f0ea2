"""Pure-torch twins of every kernel: the oracle in tests and the CPU path.

Each twin takes exactly the operands of its kernel (same layouts, see the kernel's docstring)
and computes in float32 (float64 where the kernel accumulates exactly), so a test compares the
kernel against the math and nothing else.
"""
from __future__ import annotations

import torch

from ..quant import quantize_activation
from ..schemes import QuantArgs
from .layout import dequant_woq


def quant_linear_ref(x: torch.Tensor, layer) -> torch.Tensor:
    """y = act_quant(x) @ dequant(W).T + b, computed in float32 and returned in x.dtype.

    Activations are fake-quantized exactly as a W8A8 kernel sees them (dynamic per-token or
    static per-tensor), so CPU perplexity measures the real scheme. The oracle decodes the weight
    on every call; the CPU path (dispatch.Dense) does the same math on a weight decoded once."""
    act = layer.scheme.input_activations
    xf = x.float()
    if act is not None:
        static = getattr(layer, "input_scale", None)
        q, s = quantize_activation(xf, act, None if act.dynamic else static.float())
        xf = q.float() * s.float()
    w = layer.dequantized_weight(torch.float32)
    y = xf @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x.dtype)


def woq_gemm_ref(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None, bits: int, group_size: int | None) -> torch.Tensor:
    """Twin of w4a16.woq_gemm: A [M, K] @ dequant(qweight [K*b/32, N]) + bias, in A's dtype."""
    w_t = dequant_woq(qweight, scales, zeros, bits, group_size, a.shape[1])  # [K, N]
    y = a.float() @ w_t
    if bias is not None:
        y = y + bias.float()
    return y.to(a.dtype)


def act_quant_ref(x: torch.Tensor, out_dtype: torch.dtype = torch.int8,
                  static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of act_quant.act_quant: (codes [M, K], scale [M, 1] per token or [1] static), fp32 scale."""
    kind = "float" if out_dtype == torch.float8_e4m3fn else "int"
    if static_scale is None:
        args = QuantArgs(num_bits=8, type=kind, strategy="token", dynamic=True)
        return quantize_activation(x.float(), args)
    args = QuantArgs(num_bits=8, type=kind, strategy="tensor")
    s = static_scale.reshape(1).float()
    return quantize_activation(x.float(), args, s)[0], s


def scaled_mm_ref(a_q: torch.Tensor, w_q: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Twin of w8a8.scaled_mm / fp8.fp8_gemm: (A_q @ W_q^T) exact in float64, scales in fp32."""
    acc = (a_q.double() @ w_q.double().t()).float()
    y = acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def cpu_woq_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor | None,
                       bias: torch.Tensor | None, bits: int, n: int) -> torch.Tensor:
    """Twin of qtk_cpu.woq_linear (csrc/cpu_woq.cpp, layout in kernels/cpu.py): decode the packed
    blocks, W[n, k] = u * s - zs, and multiply in float64; float32 out."""
    nb, k = codes.shape[0], x.shape[-1]
    if bits == 4:  # [N/8, K/8, 8 lanes] words -> [N/8, K, 8]
        u = (codes.unsqueeze(2) >> torch.arange(0, 32, 4, dtype=torch.int32).reshape(1, 1, 8, 1)) & 0xF
        u = u.reshape(nb, k, 8)
    elif bits == 16:
        u = codes.reshape(nb, k, 8).view(torch.bfloat16)
    else:
        u = codes.reshape(nb, k, 8)
    gs = k // scales.shape[1]
    w = u.double() * scales.double().repeat_interleave(gs, dim=1)
    if zs is not None:
        w = w - zs.double().repeat_interleave(gs, dim=1)
    w = w.transpose(1, 2).reshape(nb * 8, k)[:n]
    y = x.double() @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.float()
