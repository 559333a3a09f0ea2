"""Quantization primitives: qparams, quantize/dequantize (int and fp8 e4m3fn), int packing.

Conventions follow compressed-tensors so a checkpoint means the same thing everywhere:
  int:   q = clamp(round(x / s) + zp, qmin, qmax),  x ~ (q - zp) * s,  qmin/qmax = -2^(b-1), 2^(b-1)-1
  fp8:   q = clamp(x / s, -448, 448).to(e4m3fn),     x ~ q * s
Scales and zero points are shaped to broadcast against the weight after grouping:
  channel: [out, 1]   group: [out, in/g]   tensor: [1]
"""
from __future__ import annotations

import math

import torch

from .schemes import QuantArgs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_DTYPE = torch.bfloat16  # checkpoints store scales in bf16 (qtk.pipeline's default dtype)


def reduce_dims_minmax(w: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of a weight [out, in] over the reduction axes of the strategy."""
    w = w.float()
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if args.strategy == "group":
        g = grouped(w, args.group_size)  # [out, n_groups, g]
        return g.amin(dim=-1), g.amax(dim=-1)
    raise ValueError(f"strategy {args.strategy!r} has no weight min/max")


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    # w [out, in] -> [out, in/g, g]
    out, cols = w.shape
    if cols % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {cols}")
    return w.reshape(out, cols // group_size, group_size)


def qparams(xmin: torch.Tensor, xmax: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point from a range; 0 is always representable."""
    xmin = torch.minimum(xmin.float(), torch.zeros_like(xmin, dtype=torch.float32))
    xmax = torch.maximum(xmax.float(), torch.zeros_like(xmax, dtype=torch.float32))
    if args.type == "float":
        scale = torch.maximum(xmin.abs(), xmax) / FP8_MAX
        zp = torch.zeros_like(scale)
    elif args.symmetric:
        # compressed-tensors' convention: absmax spans half the full range (absmax / 7.5 for int4),
        # so -absmax is code qmin and +absmax rounds just past qmax (clipped by half a step);
        # measured better than absmax / qmax on SmolLM2 (RTN w4a16 g64 ppl 21.7 vs 22.9)
        scale = _round_scale(torch.maximum(xmin.abs(), xmax) / ((args.qmax - args.qmin) / 2))
        zp = torch.zeros_like(scale)
    else:
        scale = _round_scale((xmax - xmin) / (args.qmax - args.qmin))
        zp = torch.round(args.qmin - xmin / scale).clamp(args.qmin, args.qmax)
    if args.type == "float":
        scale = _round_scale(scale)
    return scale, zp


def _round_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as the checkpoint stores them (SCALE_DTYPE, round to nearest), never zero, so codes
    are rounded against exactly the scale a reader multiplies by. (Rounding up instead, to keep
    the whole range on the grid, measured clearly worse: RTN w4a16 g64 ppl 19.07 vs 17.45.)"""
    s = scale.to(SCALE_DTYPE).float()
    return torch.where(s > 0, s, torch.full_like(s, torch.finfo(SCALE_DTYPE).tiny))


def expand(p: torch.Tensor, shape: torch.Size, args: QuantArgs) -> torch.Tensor:
    """Broadcast a per-channel/group/tensor param to a weight of `shape` [out, in]."""
    if args.strategy == "group":
        return p.repeat_interleave(args.group_size, dim=1)
    return p


def quantize(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    """Codes of x (int8 tensor for int, float8_e4m3fn for float); params broadcast to x."""
    if args.type == "float":
        return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = torch.round(x.float() / scale.float())
    if zp is not None:
        q = q + zp.float()
    return q.clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    x = q.float()
    if zp is not None:
        x = x - zp.float()
    return (x * scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    return dequantize(quantize(x, scale, zp, args), scale, zp, x.dtype)


def quantize_weight(w: torch.Tensor, args: QuantArgs, scale=None, zp=None):
    """Round-to-nearest: (codes [out, in], scale, zero point or None) with the strategy's shapes."""
    if scale is None:
        scale, zp = qparams(*reduce_dims_minmax(w, args), args)
    zp = zp if not args.symmetric else None
    q = quantize(w, expand(scale, w.shape, args), None if zp is None else expand(zp, w.shape, args), args)
    return q, scale, zp


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs,
                      dtype=torch.float32) -> torch.Tensor:
    return dequantize(q, expand(scale, q.shape, args), None if zp is None else expand(zp, q.shape, args), dtype)


def quantize_activation(x: torch.Tensor, args: QuantArgs, scale: torch.Tensor | None = None):
    """Dynamic per-token (scale None) or static per-tensor symmetric activation quantization.

    Returns (codes, scale) with scale [..., 1] for per-token."""
    if scale is None:
        # dynamic scales are computed at run time in fp32: absmax / qmax, as vLLM's kernels do
        absmax = x.float().abs().amax(dim=-1, keepdim=True) if args.strategy == "token" else x.float().abs().amax().reshape(1)
        scale = absmax / (FP8_MAX if args.type == "float" else args.qmax)
        scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).eps))
    return quantize(x, scale, None, args), scale


# --- packing (compressed-tensors pack-quantized layout) -----------------------------------

def pack_int32(q: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed b-bit codes (int8) into int32 words, densely, lowest bits first.

    The code q is stored unsigned as q + 2^(b-1); element i of a row starts at bit i*b of the
    row's bit stream (for b=4: word k holds columns 8k..8k+7, column 8k+j in bits 4j..4j+3).
    [rows, cols] -> [rows, ceil(cols*b/32)] for packed_dim=1 (dim 0 packs columns of the transpose).
    """
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int32 expects int8 codes, got {q.dtype}")
    if packed_dim == 0:
        q = q.t()
    rows, cols = q.shape
    n_words = math.ceil(cols * num_bits / 32)
    if 32 % num_bits == 0:  # whole codes per word (int4, int8): shift and sum, no scatter
        per = 32 // num_bits
        v = (q.to(torch.int32) + (1 << (num_bits - 1))).reshape(rows, -1)
        v = torch.nn.functional.pad(v, (0, n_words * per - cols)).reshape(rows, n_words, per)
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=q.device)
        out = (v << shifts).sum(-1, dtype=torch.int32)  # disjoint bits: the sum is the OR (wrapping at 2^31)
        return out.t().contiguous() if packed_dim == 0 else out.contiguous()
    v = q.to(torch.int64) + (1 << (num_bits - 1))
    bit = torch.arange(cols, dtype=torch.int64) * num_bits  # start bit of each element
    words = torch.zeros(rows, n_words + 1, dtype=torch.int64)
    # low part into word bit//32, overflow (for b not dividing 32) into the next word
    words.index_add_(1, bit // 32, (v << (bit % 32)) & 0xFFFFFFFF)
    spill = (bit % 32) + num_bits - 32
    if (spill > 0).any():
        cols_spill = spill > 0
        words.index_add_(1, bit[cols_spill] // 32 + 1, v[:, cols_spill] >> (num_bits - spill[cols_spill]))
    out = words[:, :n_words]
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.t().contiguous() if packed_dim == 0 else out.contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, n: int, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: n signed codes per row (int8)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int32 expects int32 words, got {packed.dtype}")
    w = packed.t() if packed_dim == 0 else packed
    if 32 % num_bits == 0:  # whole codes per word (int4, int2): shift and mask, no gathers
        if w.shape[1] * (32 // num_bits) < n:
            raise ValueError(f"{w.shape[1]} words hold fewer than {n} {num_bits}-bit codes")
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=w.device)
        v = (w.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # arithmetic shift, then masked
        v = (v.reshape(w.shape[0], -1)[:, :n] - (1 << (num_bits - 1))).to(torch.int8)
        return v.t().contiguous() if packed_dim == 0 else v
    w = w.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[:, :1])], dim=1)
    bit = torch.arange(n, dtype=torch.int64) * num_bits
    lo = w[:, bit // 32] >> (bit % 32)
    hi = w[:, bit // 32 + 1] << (32 - bit % 32)
    v = ((lo | hi) & ((1 << num_bits) - 1)) - (1 << (num_bits - 1))
    v = v.to(torch.int8)
    return v.t().contiguous() if packed_dim == 0 else v
