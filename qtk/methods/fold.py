"""Equivalent per-channel rescaling, shared by AWQ and SmoothQuant.

For a smoothing pair prev -> linears, y = W x = (W diag(s)) (x / s): the linears' weight columns
are multiplied by s and 1/s is folded into the op that produces x (a norm's weight, or a previous
Linear's output rows and bias). In float the block computes exactly the same function.
"""
from __future__ import annotations

import torch
from torch import nn

from ..arch import SmoothPair


def prev_width(prev: nn.Module) -> int:
    """Number of output channels of the op a scale is folded into."""
    return prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()


def folds(block, pair: SmoothPair) -> bool:
    """True when 1/s can be folded into `prev`: its outputs are exactly the linears' inputs.

    Under GQA v_proj gives kv_heads*head_dim channels while o_proj reads heads*head_dim, so the
    v -> o pair does not fold (llm-compressor skips it too)."""
    width = prev_width(block.linear(pair.prev))
    return all(block.linear(n).in_features == width for n in pair.linears)


@torch.no_grad()
def fold_scale(block, pair: SmoothPair, s: torch.Tensor) -> None:
    """prev <- prev / s, linears' columns <- W * s, for s [in_features] (> 0)."""
    prev = block.linear(pair.prev)
    s = s.float()
    if isinstance(prev, nn.Linear):
        # rows of prev [out, in] are the channels of x
        prev.weight.copy_(prev.weight.float() / s.to(prev.weight.device)[:, None])
    else:
        prev.weight.copy_(prev.weight.float() / s.to(prev.weight.device))
    if getattr(prev, "bias", None) is not None:
        prev.bias.copy_(prev.bias.float() / s.to(prev.bias.device))
    for name in pair.linears:
        w = block.linear(name).weight
        w.copy_(w.float() * s.to(w.device))  # w [out, in] * s [in]
