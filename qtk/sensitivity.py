"""Which layers a scheme hurts most, and which to keep wider within a size budget.

Each targeted Linear is rounded alone to the scheme (every other layer as it is) and scored by the
KL divergence of the model's next-token distributions from the unrounded model's, on calibration
samples (never the evaluation text the gates judge on). The blocks before the layer's own are
not run again: their outputs from the unrounded forward stand in for them.

`choose` then keeps the most sensitive layers at a wider scheme (8 bits) for as long as the
average bits per quantized weight stay within the budget: `qtk quantize --max-bits B`. Layers that
read one input (q/k/v, gate/up) are kept together or not at all: vLLM fuses them into one layer
(qkv_proj, gate_up_proj) and cannot load the shards of one layer in different schemes. Ranked by
KL alone, not KL per bit kept: per bit (a knapsack's greedy order) scored the same on the
calibration domain and worse on held-out text (benchmarks/results/calibration-data-*.md).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from .arch import Arch, set_module
from .chunked_sdpa import chunked_attention
from .quant import dequantize_weight, quantize_weight
from .schemes import Scheme

log = logging.getLogger(__name__)


class _Cached(nn.Module):
    """Stands in for a decoder block before the rounded layer's: returns its unrounded output."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[N * (L - 1), V] float32 next-token log-probabilities of the samples ids [N, L]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return logits.log_softmax(-1).flatten(0, 1)


@torch.no_grad()
def layer_sensitivity(model: nn.Module, arch: Arch, targets: dict[str, nn.Linear], scheme: Scheme,
                      ids: torch.Tensor, progress: bool = True) -> dict[str, float]:
    """{layer name: mean KL(unrounded || that layer alone rounded to `scheme`)} over ids [N, L]."""
    layers = model.get_submodule(arch.layers)
    outputs: list = [None] * len(layers)
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
             for i, layer in enumerate(layers)]
    try:
        with chunked_attention(model):
            base = _log_probs(model, ids)
    finally:
        for h in hooks:
            h.remove()
    p = base.exp()
    kl = {}
    for name, linear in tqdm(targets.items(), desc="qtk sensitivity", unit="layer", disable=not progress):
        block = int(name[len(arch.layers) + 1:].split(".", 1)[0])
        w = linear.weight.data
        q, s, zp = quantize_weight(w.float(), scheme.weights)
        linear.weight.data = dequantize_weight(q, s, zp, scheme.weights).to(w.dtype)
        set_module(model, arch.layers, nn.ModuleList([*(_Cached(outputs[j]) for j in range(block)),
                                                     *layers[block:]]))
        try:
            with chunked_attention(model):
                kl[name] = (p * (base - _log_probs(model, ids))).sum(-1).mean().item()
        finally:
            set_module(model, arch.layers, layers)
            linear.weight.data = w
    return kl


def weight_bits(scheme: Scheme, in_features: int) -> float:
    """Bits per weight a layer takes on disk: the codes, plus a bf16 scale (and a zero point of the
    codes' width, when asymmetric) per group or output channel."""
    w = scheme.weights
    per = w.group_size if w.strategy == "group" else in_features
    return w.num_bits + (16 + (0 if w.symmetric else w.num_bits)) / per


def bits_per_weight(shapes: dict[str, tuple[int, int]], scheme: Scheme, wider: Scheme, kept=()) -> float:
    """The average bits per quantized weight, scales included, with the layers `kept` at `wider` and
    the others at `scheme`. shapes: name -> (out_features, in_features)."""
    kept = set(kept)
    bits = sum(o * i * weight_bits(wider if n in kept else scheme, i) for n, (o, i) in shapes.items())
    return bits / sum(o * i for o, i in shapes.values())


def choose(kl: dict[str, float], shapes: dict[str, tuple[int, int]], scheme: Scheme, wider: Scheme,
           max_bits: float, groups=()) -> tuple[list[str], float]:
    """The most sensitive layers moved to `wider` while the average bits per quantized weight stay
    <= max_bits; returns (those layers, the average bits). shapes: name -> (out_features, in_features).
    groups: layers that go together or not at all (they read one input, and vLLM fuses them into one
    layer with one scheme); the rest go alone (choose_units)."""
    units, avg = choose_units(kl, shapes, scheme, wider, max_bits, groups)
    return [n for unit in units for n in unit], avg


def units_of(names, groups=()) -> list[tuple[str, ...]]:
    """`names` partitioned into the `groups` (their members among names) and the rest alone."""
    names = list(names)
    grouped = [tuple(n for n in g if n in set(names)) for g in groups]
    grouped = [g for g in grouped if g]
    inside = {n for g in grouped for n in g}
    return grouped + [(n,) for n in names if n not in inside]


def choose_units(kl: dict[str, float], shapes: dict[str, tuple[int, int]], scheme: Scheme, wider: Scheme,
                 max_bits: float, groups=()) -> tuple[list[tuple[str, ...]], float]:
    """choose, by unit (a group, or a layer alone): the units by their layers' summed KL, largest
    first, each kept while the average stays <= max_bits (a unit that does not fit is passed over
    for smaller ones); returns (the units kept, most sensitive first, and the average bits)."""
    params = {n: o * i for n, (o, i) in shapes.items()}
    total = sum(params.values())
    bits = sum(params[n] * weight_bits(scheme, shapes[n][1]) for n in shapes)
    chosen = []
    for unit in sorted(units_of(kl, groups), key=lambda u: sum(kl[n] for n in u), reverse=True):
        extra = sum(params[n] * (weight_bits(wider, shapes[n][1]) - weight_bits(scheme, shapes[n][1]))
                    for n in unit)
        if (bits + extra) / total <= max_bits:
            chosen.append(unit)
            bits += extra
    return chosen, bits / total
