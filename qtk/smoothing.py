"""Smoothing pairs (AWQ / SmoothQuant): which op's output channels can take 1/s while the linears
it feeds take s, per decoder-layer structure, and the fold itself.

A pair prev -> linears folds when y = W x = (W diag(s)) (x / s) and x / s is what prev gives once
its weight (and bias) are divided by s: a norm whose output is (offset + w) * n(x) + b (offset 1
for Gemma's and Nemotron's (1 + w) norms), or a Linear whose output rows (all, or the tail of a
fused projection: Phi-3's qkv_proj -> o_proj reads v, gate_up_proj -> down_proj reads up) reach the
linears unchanged up to a per-channel factor (v -> o through attention, up -> down through
act(gate) * up). The pairs of a model type come from PAIRS (the families, as llm-compressor's and
AutoAWQ's mappings) or, for any other type, are inferred by probing one layer: scale a candidate's
output by a random s and see which linears' inputs become exactly x * s (a MoE router reading x * s
joins the pair, its input held at x, so the routing stays and every expert's gate/up reads x * s:
llm-compressor's norm -> router + experts mapping). Every pair whose widths
match is then checked the same way the methods will use it: a random s folded into a float32 copy
of the layer leaves its output unchanged, or the pair is dropped. A pair whose widths do not match
(v -> o under GQA) is kept, unfolded: the methods skip its fold but still observe its inputs.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from .moe import ROUTERS, all_experts

log = logging.getLogger(__name__)

# the routers that pick experts: a fold through a MoE block scales their columns too, so the routing
# stays exact (llm-compressor's MoE mappings: the norm -> router and every expert's gate/up)
EXPERT_ROUTERS = tuple(r for r in ROUTERS if r != "shared_expert_gate")

FOLD_TOLERANCE = 1e-4  # relative: a fold is exact up to float32 rounding


@dataclass(frozen=True)
class SmoothPair:
    """A smoothing pair: `prev` (a norm or a linear) feeds `linears`; scales fold into `prev`.

    `inspect` is the module whose input is the linears' input (for AWQ's block-output loss);
    `offset`: prev is a norm scaling by (offset + w); `tail`: only prev's last rows (as many as the
    linears' in_features) feed the linears (a fused projection)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None
    offset: float = 0.0
    tail: bool = False


def _llama_like(attn: str = "self_attn", mlp: str = "mlp", mlp_norm: str = "post_attention_layernorm",
                q="q_proj", k="k_proj", v="v_proj", o="o_proj") -> tuple[SmoothPair, ...]:
    qkv = tuple(f"{attn}.{n}" for n in (q, k, v))
    return (SmoothPair("input_layernorm", qkv, attn),
            SmoothPair(f"{attn}.{v}", (f"{attn}.{o}",), f"{attn}.{o}"),
            SmoothPair(mlp_norm, (f"{mlp}.gate_proj", f"{mlp}.up_proj"), mlp),
            SmoothPair(f"{mlp}.up_proj", (f"{mlp}.down_proj",), f"{mlp}.down_proj"))


_LLAMA = _llama_like()
_GEMMA2 = _llama_like(mlp_norm="pre_feedforward_layernorm")  # post_* norms act on outputs: nothing to fold
_FUSED_MLP = (SmoothPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
              SmoothPair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
              SmoothPair("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
              SmoothPair("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", tail=True))
_PHI3 = (SmoothPair("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
         SmoothPair("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", tail=True),
         *_FUSED_MLP[2:])
# one norm feeds attention and mlp side by side (parallel blocks): the loss is the linears' own
_COHERE = (SmoothPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "mlp.gate_proj", "mlp.up_proj")),
           *_LLAMA[1:2], *_LLAMA[3:])
_PHI = (SmoothPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")),
        SmoothPair("self_attn.v_proj", ("self_attn.dense",), "self_attn.dense"))
# fused qkv interleaved per head (no v tail); gelu between the mlp's linears
_GPT_NEOX = (SmoothPair("input_layernorm", ("attention.query_key_value",), "attention"),
             SmoothPair("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp.dense_h_to_4h"))
_PERSIMMON = (SmoothPair("input_layernorm", ("self_attn.query_key_value",), "self_attn"),
              SmoothPair("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp.dense_h_to_4h"))
_STARCODER2 = (*_LLAMA[:2], SmoothPair("post_attention_layernorm", ("mlp.c_fc",), "mlp.c_fc"))
_POST_NORM = (_LLAMA[1], _LLAMA[3])  # OLMo 2 / 3, EXAONE 4: norms after attention and mlp, none feeds a linear

# model_type -> its pairs in execution order; types not here are inferred (infer_pairs)
PAIRS: dict[str, tuple[SmoothPair, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "helium", "smollm3", "ministral",
                     "seed_oss", "hunyuan_v1_dense", "ernie4_5"), _LLAMA),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), _GEMMA2),
    **dict.fromkeys(("phi3",), _PHI3),
    **dict.fromkeys(("glm", "glm4"), _FUSED_MLP),
    **dict.fromkeys(("cohere", "cohere2"), _COHERE),
    "phi": _PHI,
    "gpt_neox": _GPT_NEOX,
    "persimmon": _PERSIMMON,
    "starcoder2": _STARCODER2,
    **dict.fromkeys(("olmo2", "olmo3", "exaone4"), _POST_NORM),
}


# --- the fold ---------------------------------------------------------------------------------

def in_width(m: nn.Module) -> int:
    """Input channels of a Linear, or of a router holding a bare weight [experts, in]."""
    return m.in_features if hasattr(m, "in_features") else m.weight.shape[-1]


def fold_width(layer: nn.Module, pair: SmoothPair) -> int:
    """Number of prev's output channels the scale divides."""
    prev = layer.get_submodule(pair.prev)
    if not isinstance(prev, nn.Linear):
        return prev.weight.numel()
    return in_width(layer.get_submodule(pair.linears[0])) if pair.tail else prev.out_features


def widths_match(layer: nn.Module, pair: SmoothPair) -> bool:
    """prev's scaled channels are as many as each linear's inputs (and, for a tail, prev has them)."""
    prev = layer.get_submodule(pair.prev)
    width = fold_width(layer, pair)
    if isinstance(prev, nn.Linear) and width > prev.out_features:
        return False
    return all(in_width(layer.get_submodule(n)) == width for n in pair.linears)


@torch.no_grad()
def fold(layer: nn.Module, pair: SmoothPair, s: torch.Tensor) -> None:
    """prev <- prev / s, linears' columns <- W * s, for s [in_features] (> 0)."""
    prev = layer.get_submodule(pair.prev)
    s = s.float()
    if isinstance(prev, nn.Linear):
        w = prev.weight[-s.numel():] if pair.tail else prev.weight  # rows of prev [out, in] are x's channels
        w.copy_(w.float() / s.to(w.device)[:, None])
    elif pair.offset:  # (offset + w') = (offset + w) / s
        prev.weight.copy_((prev.weight.float() + pair.offset) / s.to(prev.weight.device) - pair.offset)
    else:
        prev.weight.copy_(prev.weight.float() / s.to(prev.weight.device))
    if getattr(prev, "bias", None) is not None:
        b = prev.bias[-s.numel():] if pair.tail else prev.bias
        b.copy_(b.float() / s.to(b.device))
    for name in pair.linears:
        w = layer.get_submodule(name).weight
        w.copy_(w.float() * s.to(w.device))  # w [out, in] * s [in]


def is_norm_like(module: nn.Module) -> bool:
    """A module whose only parameters are a 1-D weight (and maybe a bias): a norm that may take a fold."""
    params = dict(module.named_parameters(recurse=False))
    w = params.get("weight")
    return (not isinstance(module, (nn.Linear, nn.Embedding)) and w is not None and w.dim() == 1
            and set(params) <= {"weight", "bias"} and not any(True for _ in module.children()))


@torch.no_grad()
def norm_offset(norm: nn.Module) -> float | None:
    """1.0 for a norm scaling by (1 + w) (Gemma), 0.0 for one scaling by w, None for anything else:
    with weight and bias zeroed the output is 0 for w, and is 0 with weight -1 for (1 + w)."""
    probe = copy.deepcopy(norm).float()
    x = torch.randn(4, probe.weight.numel(), generator=torch.Generator().manual_seed(0)).to(probe.weight.device)
    if getattr(probe, "bias", None) is not None:
        probe.bias.zero_()
    for offset in (0.0, 1.0):
        probe.weight.fill_(-offset)
        if probe(x).abs().max() <= 1e-6:
            return offset
    return None


# --- finding the pairs of one layer -------------------------------------------------------------

class LayerProbe:
    """A float32 copy of one decoder layer and the call the model made to it (a few tokens)."""

    def __init__(self, layer: nn.Module, call: tuple[tuple, dict], order: tuple[str, ...]):
        self.layer = copy.deepcopy(layer).float()
        self.args, self.kwargs = _to_float(call)
        self.order = order  # its Linear layers in execution order
        self.routers = [n for n, m in self.layer.named_modules() if n.rsplit(".", 1)[-1] in EXPERT_ROUTERS
                        and getattr(m, "weight", None) is not None and m.weight.dim() == 2]
        self.gen = torch.Generator().manual_seed(0)
        self.base, self.calls = self.run(record=True)
        self.inputs = self.linear_inputs(self.calls)

    def run(self, record: bool = False, scale: tuple[str, torch.Tensor] | None = None,
            unscale: tuple[list[str], torch.Tensor] = ((), None)):
        """The layer's output (every token through every expert too, for the records); with `record`
        also each module's first call {name: (args, kwargs)}; with `scale` = (module, s) that
        module's output multiplied by s; with `unscale` = (routers, s) their inputs divided by s."""
        calls, handles = {}, []
        if record:
            def keep(name):
                def hook(_, args, kwargs):
                    calls.setdefault(name, (args, kwargs))
                return hook
            handles += [m.register_forward_pre_hook(keep(name), with_kwargs=True)
                        for name, m in self.layer.named_modules()]
        if scale is not None:
            handles.append(self.layer.get_submodule(scale[0]).register_forward_hook(_scaled(scale[1])))
        handles += [self.layer.get_submodule(r).register_forward_pre_hook(
            lambda _, args, s=unscale[1]: (args[0] / s, *args[1:])) for r in unscale[0]]
        try:
            with torch.no_grad(), all_experts(self.layer):
                y = self.layer(*self.args, **self.kwargs)
        finally:
            for h in handles:
                h.remove()
        y = y[0] if isinstance(y, tuple) else y
        return (y, calls) if record else y

    def linear_inputs(self, calls: dict) -> dict[str, torch.Tensor]:
        return {n: calls[n][0][0] for n in self.order if n in calls and calls[n][0]}  # called as linear(x)

    def random_scale(self, n: int) -> torch.Tensor:
        return (torch.rand(n, generator=self.gen) * 1.5 + 0.5).to(self.base.device)  # s in [0.5, 2]

    def fold_is_exact(self, pair: SmoothPair) -> bool:
        """A random s folded into the pair leaves the layer's output unchanged (weights restored after)."""
        names = (pair.prev, *pair.linears)
        saved = {n: {k: p.detach().clone() for k, p in self.layer.get_submodule(n).named_parameters()} for n in names}
        fold(self.layer, pair, self.random_scale(fold_width(self.layer, pair)))
        out = self.run()
        with torch.no_grad():
            for n, params in saved.items():
                for k, p in params.items():
                    self.layer.get_submodule(n).get_parameter(k).copy_(p)
        return _close(out, self.base)

    def fed_by(self, prev: str) -> tuple[str, ...]:
        """The linears whose input becomes exactly x * s when prev's output is multiplied by s. A
        router reading x * s takes the fold too (first, so its input is what the pair observes):
        with its input kept at x the routing stays, and the experts' gate/up read x * s."""
        width = self._output_width(prev)
        s = self.random_scale(width)
        calls = self.run(record=True, scale=(prev, s))[1]
        routers = [r for r in self.routers if r != prev and r in calls and calls[r][0]
                   and self._scaled_input(calls[r][0][0], self.calls[r][0][0], s)]
        if routers:
            calls = self.run(record=True, scale=(prev, s), unscale=(routers, s))[1]
        after = self.linear_inputs(calls)
        fed = tuple(n for n in self.order if n != prev and n not in routers and n in after
                    and self._scaled_input(after[n], self.inputs[n], s))
        return (*routers, *fed) if fed else ()

    @staticmethod
    def _scaled_input(after: torch.Tensor, before: torch.Tensor, s: torch.Tensor) -> bool:
        return after.shape[-1] == s.numel() and _close(after, before * s)

    def _output_width(self, name: str) -> int:
        m = self.layer.get_submodule(name)
        return m.out_features if isinstance(m, nn.Linear) else m.weight.numel()

    def inspect_for(self, linears: tuple[str, ...], attention: str | None) -> str | None:
        """The module whose output AWQ's loss compares: the linear itself, the attention module, or
        a parent called with the linears' input alone (the mlp); None: the linears' own outputs."""
        if len(linears) == 1:
            return linears[0]
        parent = _common_parent(linears)
        if parent and parent == attention:
            return parent
        args, kwargs = self.calls.get(parent, ((), {})) if parent else ((), {})
        first = self.calls.get(linears[0], ((None,), {}))[0]
        if len(args) == 1 and not kwargs and first and args[0] is first[0]:
            return parent
        return None


def _scaled(s: torch.Tensor):
    """A forward hook multiplying a module's output channels by s (an output that is not one tensor
    of that width is left alone: nothing then reads x * s)."""
    def hook(_, __, y):
        if isinstance(y, torch.Tensor) and y.shape[-1] == s.numel():
            return y * s
        return None
    return hook


def _to_float(call):
    def conv(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float()
        if isinstance(v, tuple):
            return tuple(conv(t) for t in v)
        return v
    args, kwargs = call
    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= FOLD_TOLERANCE * b.abs().max().clamp_min(1e-12))


def _common_parent(names: tuple[str, ...]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def infer_pairs(probe: LayerProbe, attention: str | None) -> tuple[SmoothPair, ...]:
    """Pairs found by scaling each norm-like module's and each Linear's output: the linears whose
    inputs scale exactly with it (nothing nonlinear in between)."""
    candidates = [n for n, m in probe.layer.named_modules() if n in probe.calls and is_norm_like(m)]
    candidates += [n for n in probe.order if n in probe.calls]
    pairs = []
    for prev in candidates:
        linears = probe.fed_by(prev)
        if linears:
            pairs.append(SmoothPair(prev, linears, probe.inspect_for(linears, attention)))
    # in execution order of each pair's first Linear (a router that leads a pair is not one of them)
    return tuple(sorted(pairs, key=lambda p: probe.order.index(next(n for n in p.linears if n in probe.order))))


def layer_pairs(model_type: str, probe: LayerProbe, attention: str | None) -> tuple[SmoothPair, ...]:
    """The checked pairs of one layer: PAIRS' row for the type (those whose modules the layer has),
    else the inferred ones; each norm's offset set, each inexact fold dropped."""
    if model_type in PAIRS:
        names = set(dict(probe.layer.named_modules()))
        candidates = tuple(p for p in PAIRS[model_type] if {p.prev, *p.linears} <= names)
    else:
        candidates = infer_pairs(probe, attention)
    kept = []
    for pair in candidates:
        prev = probe.layer.get_submodule(pair.prev)
        if not isinstance(prev, nn.Linear):
            offset = norm_offset(prev) if is_norm_like(prev) else None
            if offset is None:
                log.debug("%s: %s does not scale by a weight; no pair", model_type, pair.prev)
                continue
            pair = replace(pair, offset=offset)
        if widths_match(probe.layer, pair) and not probe.fold_is_exact(pair):
            log.debug("%s: folding into %s changes the layer's output; no pair", model_type, pair.prev)
            continue
        kept.append(pair)
    return tuple(kept)
