"""QuantLinear: one Linear class for every scheme, holding the compressed-tensors tensors as-is.

Its state_dict keys are exactly the checkpoint's (weight_packed, weight_scale, weight_zero_point,
weight_shape, weight_g_idx, weight, input_scale, bias), so writing a checkpoint is saving the
model and reading one is loading it. The forward dispatches to qtk.kernels by scheme; what a
kernel needs beyond these tensors (a repacked or decoded weight) is built once and cached by
qtk.kernels.dispatch, never stored here.

Calibration and the runtime both import this module (calibration writes QuantLinears, the
runtime's models run them); it imports neither.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .kernels import dispatch
from .quant import FP8_DTYPE, dequantize_weight, pack_int32, unpack_int32
from .schemes import QuantArgs, Scheme


def scale_shape(args: QuantArgs, out_features: int, in_features: int) -> tuple[int, ...]:
    if args.strategy == "group":
        return (out_features, math.ceil(in_features / args.group_size))
    if args.strategy == "channel":
        return (out_features, 1)
    return (1,)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None, g_idx: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        w = scheme.weights
        kw = {"device": device}
        sshape = scale_shape(w, out_features, in_features)
        if scheme.format == "pack-quantized":
            words = math.ceil(in_features * w.num_bits / 32)
            self.register_buffer("weight_packed", torch.empty(out_features, words, dtype=torch.int32, **kw))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, device=device))
            if not w.symmetric:
                zrows = math.ceil(out_features * w.num_bits / 32)
                self.register_buffer("weight_zero_point", torch.empty(zrows, sshape[-1], dtype=torch.int32, **kw))
        else:
            wdtype = FP8_DTYPE if w.type == "float" else torch.int8
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=wdtype, **kw))
            if not w.symmetric:
                self.register_buffer("weight_zero_point", torch.empty(*sshape, dtype=torch.int8, **kw))
        self.register_buffer("weight_scale", torch.empty(*sshape, dtype=dtype, **kw))
        if g_idx:
            self.register_buffer("weight_g_idx", torch.empty(in_features, dtype=torch.int32, **kw))
        a = scheme.input_activations
        if a is not None and not a.dynamic:
            self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32 if w.type == "float" else dtype, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, **kw), requires_grad=False) if bias else None

    def describe(self) -> dict:
        """What rebuilds this layer's structure (QuantLinear.described): sizes, scheme, dtype, options."""
        return {"in_features": self.in_features, "out_features": self.out_features, "scheme": self.scheme,
                "bias": self.bias is not None, "dtype": str(self.weight_scale.dtype).removeprefix("torch."),
                "g_idx": hasattr(self, "weight_g_idx")}

    @classmethod
    def described(cls, d: dict, device=None) -> QuantLinear:
        """An empty layer of describe()'s structure (on `device`; meta: tensors written elsewhere)."""
        return cls(d["in_features"], d["out_features"], d["scheme"], d["bias"],
                   dtype=getattr(torch, d["dtype"]), device=device, g_idx=d["g_idx"])

    @classmethod
    @torch.no_grad()  # bias / scales may come from tensors that require grad: keep them leaves
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, scheme: Scheme,
                   bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> QuantLinear:
        """Build from codes q [out, in] (int8 or fp8), scale/zp shaped as quant.qparams returns."""
        out_f, in_f = q.shape
        m = cls(in_f, out_f, scheme, bias=bias is not None, dtype=dtype, device=q.device)
        w = scheme.weights
        if scheme.format == "pack-quantized":
            m.weight_packed.copy_(pack_int32(q.to(torch.int8), w.num_bits, packed_dim=1))
            if zp is not None:
                m.weight_zero_point.copy_(pack_int32(zp.round().to(torch.int8), w.num_bits, packed_dim=0))
        else:
            m.weight.copy_(q)
            if zp is not None:
                m.weight_zero_point.copy_(zp.round().to(torch.int8))
        m.weight_scale.copy_(scale.reshape(m.weight_scale.shape).to(dtype))
        if bias is not None:
            m.bias.copy_(bias.to(dtype))
        if input_scale is not None:
            m.input_scale.copy_(input_scale.reshape(1).to(m.input_scale.dtype))
        return m

    # -- decoding -------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """Signed integer (int8) or fp8 codes [out, in]."""
        if hasattr(self, "weight_packed"):
            return unpack_int32(self.weight_packed, self.scheme.weights.num_bits, self.in_features)
        return self.weight

    def zero_point(self) -> torch.Tensor | None:
        if not hasattr(self, "weight_zero_point"):
            return None
        zp = self.weight_zero_point
        if hasattr(self, "weight_packed"):
            zp = unpack_int32(zp, self.scheme.weights.num_bits, self.out_features, packed_dim=0)
        return zp

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.scheme.weights
        scale, zp = self.weight_scale, self.zero_point()
        if hasattr(self, "weight_g_idx"):
            # activation-ordered groups: column j belongs to group g_idx[j]
            g = self.weight_g_idx.long()
            q = self.codes().float()
            zpf = 0.0 if zp is None else zp.float()[:, g]
            return ((q - zpf) * scale.float()[:, g]).to(dtype)
        return dequantize_weight(self.codes(), scale, zp, w, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.quant_linear(x, self)

    def extra_repr(self) -> str:
        w = self.scheme.weights
        act = self.scheme.input_activations
        a = "" if act is None else f", act={act.type}{act.num_bits}/{act.strategy}"
        g = f"/g{w.group_size}" if w.strategy == "group" else f"/{w.strategy}"
        return f"in={self.in_features}, out={self.out_features}, w={w.type}{w.num_bits}{g}{'' if w.symmetric else ' asym'}{a}"
