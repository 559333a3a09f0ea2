"""The decoder layer's small ops fused for CUDA, one Triton kernel each: the residual add with the
RMSNorm that follows it, RoPE on q and k in place, and SiLU(gate) * up (vLLM's fused_add_rms_norm,
rotary_embedding and silu_and_mul).

Eager torch runs each of these as 4-8 kernels, 25-35 a layer: on the H200 a batch-1 bf16 decode
step of a Llama-3-8B shape took 7.36 ms under CUDA graphs against a 3.61 ms roofline. Every op
rounds where transformers' eager modules round (LlamaRMSNorm: the normalized row to the input's
dtype, then times the weight; RoPE: each product and the sum; the GLU: SiLU, then the product), so
a fused step computes what the eager one does up to the order of one fp32 sum (the norm's mean).
NativeModel uses them on the Triton backend (runtime/models/native.py, _forward_triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, N, stride_x, stride_res, stride_out, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program. ADD: res = x + res (rounded to res's dtype, written back), normalized;
    else x normalized. out = w * (h * rsqrt(mean(h^2) + eps)).to(dtype), h the row in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_res + offs, s, mask=mask)
        x = s
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    t = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * t).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm(x: torch.Tensor, w: torch.Tensor) -> None:
    check(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, N] with unit stride along N, got {list(x.shape)} "
                                             f"strides {x.stride()}")
    check(w.shape == (x.shape[1],) and w.is_contiguous(), f"weight must be [{x.shape[1]}], got {list(w.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm(x) with weight w: [T, N] -> [T, N] in the dtype w * x promotes to."""
    _check_norm(x, w)
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(w.dtype, x.dtype))
    if x.numel():
        _rms_norm_kernel[(x.shape[0],)](x, x, w, out, x.shape[1], x.stride(0), x.stride(0), out.stride(0), eps,
                                        ADD=False, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def add_rms_norm_(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += a in place (rounded to h's dtype, as `h = h + a`), then LlamaRMSNorm(h) with weight w."""
    _check_norm(h, w)
    check(a.shape == h.shape and a.stride(1) == 1, f"a must be {list(h.shape)} with unit stride along N, "
                                                   f"got {list(a.shape)} strides {a.stride()}")
    out = torch.empty(h.shape, device=h.device, dtype=torch.promote_types(w.dtype, h.dtype))
    if h.numel():
        _rms_norm_kernel[(h.shape[0],)](a, h, w, out, h.shape[1], a.stride(0), h.stride(0), out.stride(0), eps,
                                        ADD=True, BLOCK=triton.next_power_of_2(h.shape[1]))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_x, stride_cs, HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row (token) per program: its HEADS heads of 2*HALF dims rotated in place,
    x1' = x1*cos1 - x2*sin1, x2' = x2*cos2 + x1*sin2, each product and sum rounded to x's dtype."""
    row = tl.program_id(0).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)[:, None]
    ds = tl.arange(0, BLOCK_D)[None, :]
    mask = (hs < HEADS) & (ds < HALF)
    p1 = x_ptr + row * stride_x + hs * (2 * HALF) + ds
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dmask = ds < HALF
    c1 = tl.load(cos_ptr + row * stride_cs + ds, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cs + HALF + ds, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_cs + ds, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_cs + HALF + ds, mask=dmask, other=0.0).to(tl.float32)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)
    y2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
    tl.store(p1, y1.to(dt), mask=mask)
    tl.store(p1 + HALF, y2.to(dt), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
    """x [T, >= heads*D] (rows may be strided: q and k side by side in the qkv output) rotated in place
    over its first heads*D columns: as models.native.rope_ with cos, sin [T, D] in x's dtype."""
    d = cos.shape[-1]
    check(x.dim() == 2 and x.stride(1) == 1 and x.shape[1] >= heads * d, f"x must be [T, >= {heads * d}] with "
                                                                          f"unit stride, got {list(x.shape)}")
    check(cos.shape == sin.shape == (x.shape[0], d) and cos.stride() == sin.stride() and cos.stride(1) == 1,
          f"cos and sin must be [{x.shape[0]}, D] alike, got {list(cos.shape)} and {list(sin.shape)}")
    check(d % 2 == 0, f"the rotary dimension must be even, got {d}")
    if x.shape[0]:
        _rope_kernel[(x.shape[0],)](x, cos, sin, x.stride(0), cos.stride(0), HEADS=heads, HALF=d // 2,
                                    BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d // 2))


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_out, BLOCK: tl.constexpr):
    """out[t, :] = (silu(gate) rounded to the dtype) * up; grid (T, N / BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] each (rows may be strided), as LlamaMLP computes it."""
    check(gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == up.stride(1) == 1
          and gate.dtype == up.dtype, f"gate and up must be [T, I] alike with unit stride, got {list(gate.shape)} "
                                      f"{gate.dtype} and {list(up.shape)} {up.dtype}")
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    if out.numel():
        n = gate.shape[1]
        block = min(triton.next_power_of_2(n), 1024)
        _silu_mul_kernel[(gate.shape[0], triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0),
                                                                 out.stride(0), BLOCK=block)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, as gate_up_proj's output) -> [T, I] = silu(gate) * up."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {list(x.shape)}")
    gate, up = x.chunk(2, dim=-1)
    return silu_mul(gate, up)
