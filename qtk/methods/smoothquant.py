"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights before W8A8.

Per norm -> linears pair (llm-compressor's default mapping for Llama: input_layernorm -> q,k,v and
post_attention_layernorm -> gate,up), from the calibration inputs of the linears:
    s_j = max|X_j|^a / max|W_j|^(1-a)        (max|W_j| over the rows of all the pair's linears)
x / s is folded into the norm's weight, W s into the linears' columns (fold.py). The weight
quantizer then gives int8 per-channel weights; activations are quantized per token at run time.
"""
from __future__ import annotations

import logging

import torch

from .. import distributed
from ..arch import SmoothPair
from .fold import fold_scale, folds

log = logging.getLogger(__name__)

EPS = 1e-5  # floor for both maxima: a dead channel gets a finite scale


def smoothing_scale(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    # SmoothQuant: s_j = max|X_j|^a / max|W_j|^(1-a)
    return act_absmax.float().clamp_min(EPS).pow(alpha) / w_absmax.float().clamp_min(EPS).pow(1 - alpha)


def smoothed_pairs(block) -> list[SmoothPair]:
    """The pairs whose `prev` is a norm (not a Linear of the block), with a targeted linear, that fold."""
    return [p for p in block.pairs
            if p.prev not in block.arch.linears[block.index] and any(n in block.targets for n in p.linears) and folds(block, p)]


def activation_absmax(block, pairs: list[SmoothPair]) -> dict[SmoothPair, torch.Tensor]:
    """max |x| per input channel of each pair's linears over the calibration batches."""
    by_input = {p.linears[0]: p for p in pairs}  # a pair's linears share their input
    absmax = {}

    def observe(name, x):
        m = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        pair = by_input[name]
        absmax[pair] = m if pair not in absmax else torch.maximum(absmax[pair], m)

    with block.hooks(list(by_input), observe):
        block.observe()
    for pair in pairs:  # the max over every rank's batches (distributed.py)
        width = block.linear(pair.linears[0]).in_features
        absmax[pair] = distributed.max_(absmax.get(pair, torch.zeros(width, device=block.device)))
    return absmax


@torch.no_grad()
def smooth_block(block, recipe) -> None:
    """METHODS["smoothquant"]: fold s into each norm -> linears pair of the block."""
    pairs = smoothed_pairs(block)
    absmax = activation_absmax(block, pairs)
    for pair in pairs:
        w = torch.cat([block.linear(n).weight.detach() for n in pair.linears], dim=0)  # [sum out, in]
        s = smoothing_scale(absmax[pair], w.abs().amax(dim=0), recipe.smoothquant.alpha)
        log.debug("smoothquant %s %s: s in [%.3g, %.3g]", block.name, pair.prev, s.min(), s.max())
        fold_scale(block, pair, s)
