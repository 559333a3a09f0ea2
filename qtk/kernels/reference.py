"""Pure-torch twins of every kernel: the oracle in tests and the CPU path."""
from __future__ import annotations

import torch

from ..quant import quantize_activation


def quant_linear_ref(x: torch.Tensor, layer) -> torch.Tensor:
    """y = act_quant(x) @ dequant(W).T + b, computed in float32 and returned in x.dtype.

    Activations are fake-quantized exactly as a W8A8 kernel sees them (dynamic per-token or
    static per-tensor), so CPU perplexity measures the real scheme."""
    act = layer.scheme.input_activations
    xf = x.float()
    if act is not None:
        static = getattr(layer, "input_scale", None)
        q, s = quantize_activation(xf, act, None if act.dynamic else static.float())
        xf = q.float() * s.float()
    w = layer.cached_weight(torch.float32)
    y = xf @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x.dtype)
