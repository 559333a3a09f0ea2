"""Equivalent per-channel rescaling, shared by AWQ and SmoothQuant.

For a smoothing pair prev -> linears, y = W x = (W diag(s)) (x / s): the linears' weight columns
are multiplied by s and 1/s is folded into the op that produces x (a norm's weight, or a previous
Linear's output rows and bias). In float the block computes exactly the same function.
"""
from __future__ import annotations

import torch

from ..smoothing import SmoothPair, fold, widths_match


def folds(block, pair: SmoothPair) -> bool:
    """True when 1/s can be folded into `prev`: its outputs are exactly the linears' inputs.

    Under GQA v_proj gives kv_heads*head_dim channels while o_proj reads heads*head_dim, so the
    v -> o pair does not fold (llm-compressor skips it too)."""
    return widths_match(block.layer, pair)


def fold_scale(block, pair: SmoothPair, s: torch.Tensor) -> None:
    """prev <- prev / s (a (1 + w) norm: (1 + w') = (1 + w) / s), linears' columns <- W * s, for s [in_features] (> 0)."""
    fold(block.layer, pair, s)
