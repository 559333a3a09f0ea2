"""The run-time layout of int4/int8 weight-only (WOQ) weights, built once from a QuantLinear.

The checkpoint (compressed-tensors pack-quantized) stores W [N, K] row-major, packed along K:
weight_packed int32 [N, K/8], column 8k+j of row n in bits 4j..4j+3 of word k, code q stored
as q + 8. A GEMM tile needs W^T [BLOCK_K, BLOCK_N]; read from that layout each warp would fetch
BLOCK_K/2 bytes from each of BLOCK_N rows N*K/2 bytes apart. So it is repacked once (as GPTQ
kernels, Marlin and Machete do) into the transposed layout, where a tile row is BLOCK_N
consecutive words and loads coalesce along N:

    qweight int32 [ceil(K*b/32), N]   word r of column n holds rows k = r*E + j (E = 32/b) in bits
                                      j*b .. j*b+b-1, each as the unsigned code u = q + 2^(b-1)
    scales  model dtype [K/G, N]      group g covers rows g*G .. g*G+G-1; [1, N] per channel
    zeros   uint8 [K/G, N] or None    unsigned zero point u0 = zp + 2^(b-1); None when symmetric
    perm    int64 [K] or None         act-order (g_idx): rows sorted by group; x is gathered by it

so that W^T[k, n] = (u[k, n] - u0[g, n]) * s[g, n] with u0 = 2^(b-1) when symmetric.
Symmetric int4 qweight equals GPTQ's qweight (GPTQ stores codes unsigned with zero 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WOQ_BITS = (4, 8)


@dataclass(frozen=True)
class WOQWeights:
    """Weight-only int weights in the run-time layout (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int | None  # None: per channel
    in_features: int
    perm: torch.Tensor | None = None


def pack_woq(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bits: int,
             group_size: int | None, dtype: torch.dtype | None = None,
             perm: torch.Tensor | None = None) -> WOQWeights:
    """Run-time layout from signed codes [N, K] (int8), scale and zero point [N, K/G] or [N, 1]
    or [1] (per tensor, stored as per channel), as QuantLinear.codes()/zero_point() return them.

    With act-order, codes/scale/zp must already be permuted so groups are contiguous."""
    if bits not in WOQ_BITS:
        raise ValueError(f"pack_woq: bits must be one of {WOQ_BITS}, got {bits}")
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise ValueError(f"pack_woq: codes must be int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    per_row = 32 // bits
    half = 1 << (bits - 1)
    u = (codes.to(torch.int64) + half).t()  # [K, N] unsigned codes
    pad = -k % per_row
    if pad:
        u = torch.cat([u, u.new_zeros(pad, n)])
    u = u.reshape(-1, per_row, n)  # [K/E, E, N]
    shifts = (torch.arange(per_row, device=u.device) * bits).reshape(1, per_row, 1)
    words = (u << shifts).sum(dim=1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()

    def groups_by_n(p: torch.Tensor) -> torch.Tensor:
        # [N, K/G] | [N, 1] | [1] -> [K/G or 1, N]
        return p.reshape(1, 1).expand(n, 1).t() if p.numel() == 1 else p.reshape(n, -1).t()

    scales = groups_by_n(scale).to(dtype or scale.dtype).contiguous()
    zeros = None if zp is None else (groups_by_n(zp).round().to(torch.int16) + half).to(torch.uint8).contiguous()
    if group_size is not None and scales.shape[0] * group_size != k:
        raise ValueError(f"pack_woq: {scales.shape[0]} groups of {group_size} do not cover K={k}")
    return WOQWeights(qweight, scales, zeros, bits, group_size, k, perm)


def unpack_woq(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Unsigned codes u [K, N] (int64) from a run-time qweight [ceil(K*b/32), N]."""
    per_row = 32 // bits
    shifts = (torch.arange(per_row, device=qweight.device) * bits).reshape(1, per_row, 1)
    u = (qweight.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [K/E, E, N]
    return u.reshape(-1, qweight.shape[1])[:k]


def dequant_woq(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int | None, k: int) -> torch.Tensor:
    """W^T [K, N] in float32 from the run-time layout: (u - u0) * s."""
    u = unpack_woq(qweight, bits, k).float()
    rows = k if group_size is None else group_size
    s = scales.float().repeat_interleave(rows, dim=0)[:k]
    u0 = float(1 << (bits - 1)) if zeros is None else zeros.float().repeat_interleave(rows, dim=0)[:k]
    return (u - u0) * s
