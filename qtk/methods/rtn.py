"""Round-to-nearest: each weight quantized on its own grid, no data needed.

Static activation scales (fp8_static, static W8A8) are the only thing RTN calibrates: the absmax
of each Linear's input over the calibration batches."""
from __future__ import annotations

import torch

from .. import distributed
from ..errors import InputError
from ..moe import all_experts
from ..quant import dequantize_weight, qparams, quantize_weight
from ..quant_linear import QuantLinear


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Relative Frobenius error of a quantized weight."""
    return ((w.float() - w_hat.float()).norm() / w.float().norm().clamp_min(1e-12)).item()


def static_input_scales(block, names) -> dict[str, torch.Tensor]:
    """Absmax of each named Linear's input over the calibration batches (for static input scales)."""
    absmax = {}

    def observe(name, x):
        m = x.detach().float().abs().amax().reshape(1)
        absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)

    with block.hooks(names, observe), all_experts(block.layer):  # a range covers any token an expert may get
        block.observe()
    if distributed.active():  # the max over every rank's batches; -inf: no rank's input reached it
        maxima = {n: distributed.max_(absmax.get(n, torch.full((1,), -torch.inf, device=block.device))) for n in names}
        absmax = {n: m for n, m in maxima.items() if m.item() > -torch.inf}
    return absmax


def to_quant_linear(linear: torch.nn.Linear, q, scale, zp, scheme, input_absmax=None) -> QuantLinear:
    input_scale = None
    if input_absmax is not None:
        input_scale = qparams(-input_absmax, input_absmax, scheme.input_activations)[0]
    return QuantLinear.from_codes(q, scale, zp, scheme, bias=linear.bias, input_scale=input_scale,
                                  dtype=linear.weight.dtype)


def quantize_block(block, recipe) -> None:
    scheme = recipe.scheme
    act = scheme.input_activations
    absmax = static_input_scales(block, block.targets) if act is not None and not act.dynamic else {}
    quantize_linears(block, block.targets, scheme, absmax)


def quantize_linears(block, names, scheme, absmax) -> None:
    """Each named Linear of the block rounded to nearest and replaced by its QuantLinear."""
    act = scheme.input_activations
    for name in names:
        if act is not None and not act.dynamic and name not in absmax:  # no input ever reached it
            raise InputError(f"{block.name}.{name} saw no calibration input, so it has no static input scale; "
                             "add it to ignore or use a dynamic activation scheme")
        lin = block.linear(name)
        w = lin.weight.data
        q, scale, zp = quantize_weight(w, scheme.weights)
        block.errors[name] = weight_error(w, dequantize_weight(q, scale, zp, scheme.weights))
        block.replace(name, to_quant_linear(lin, q, scale, zp, scheme, absmax.get(name)))
