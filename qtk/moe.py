"""Mixture-of-experts layers as per-expert Linear layers, and the names their tensors have on the hub.

transformers 5 keeps a block's experts as 3-D parameters (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]; gpt-oss transposed, gate/up interleaved, with biases), in a class
decorated by `transformers.integrations.moe.use_experts_implementation`. qtk quantizes each
expert's projections as their own layers, so `linearize_experts` replaces every such module by
`LinearExperts`: a list of `Expert`s (gate_proj, up_proj, down_proj nn.Linear) computing the same
function from the same routing arguments, tokens grouped by expert. Hooks on an expert's Linears
therefore see exactly the tokens routed to it; with `calibrate_all` set (`all_experts`) every
token goes through every expert, for statistics only: the output still sums the routed ones.

A checkpoint names the experts as the hub and vLLM do (HUB: `...mlp.experts.7.gate_proj`,
Mixtral's `...block_sparse_moe.experts.7.w1`); `hub_state` renames on writing and
`model_tensors` back on reading. Families whose hub checkpoints hold the 3-D tensors (GraniteMoE,
gpt-oss) get float experts written 3-D again, so transformers loads them as it loads the hub's.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import re
from dataclasses import dataclass

import torch
from torch import nn

from .errors import InputError

ROUTERS = ("gate", "router", "shared_expert_gate")  # a MoE block's children that route: never quantized
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# --- the module -------------------------------------------------------------------------

class Expert(nn.Module):
    """One expert: down(glu(gate(x), up(x))), or down(act(up(x))) for experts without a gate."""

    def __init__(self, gate_proj: nn.Linear | None, up_proj: nn.Linear, down_proj: nn.Linear, glu):
        super().__init__()
        if gate_proj is not None:
            self.gate_proj = gate_proj
        self.up_proj, self.down_proj = up_proj, down_proj
        self.glu = glu  # (gate [.., I], up [.., I]) -> [.., I], or (up) -> act(up); not a module

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        if hasattr(self, "gate_proj"):
            return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.glu(self.up_proj(x)))


class LinearExperts(nn.ModuleList):
    """The experts of one MoE block as Expert modules named 0..E-1; forward takes what the 3-D
    module took: hidden_states [T, H], top_k_index [T, k] (expert ids), top_k_weights [T, k]."""

    def __init__(self, experts: list[Expert], layout: dict):
        super().__init__(experts)
        self.layout = layout  # the replaced module's has_gate, has_bias, is_transposed, is_concatenated
        self.calibrate_all = False  # every token through every expert (statistics only): all_experts()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [T, H]
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self)).tolist()  # one device sync per block
        ends = list(itertools.accumulate(counts))
        for e, expert in enumerate(self):
            if not counts[e] and not self.calibrate_all:
                continue
            pairs = order[ends[e] - counts[e]:ends[e]]
            token, slot = pairs // k, pairs % k  # the tokens routed to e, and where in their top-k
            if self.calibrate_all:
                y = expert(hidden_states)[token]  # hooks see every token; only the routed ones are summed
            else:
                y = expert(hidden_states[token])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module with 3-D parameters (built with use_experts_implementation)."""
    return (hasattr(module, "is_concatenated") and hasattr(module, "has_gate")
            and isinstance(getattr(module, "down_proj", None), nn.Parameter))


def linearize_experts(model: nn.Module) -> list[str]:
    """Replace every 3-D experts module of `model` by LinearExperts in place (on the meta device
    too: the Linears are then meta, for a checkpoint to fill); returns their names."""
    names = [n for n, m in model.named_modules() if is_fused_experts(m)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, linear_experts(getattr(owner, child)))
    return names


@torch.no_grad()
def linear_experts(fused: nn.Module) -> LinearExperts:
    """The LinearExperts computing what `fused` computes, its weights copied (not shared)."""
    layout = {k: bool(getattr(fused, k)) for k in ("has_gate", "has_bias", "is_transposed", "is_concatenated")}
    if getattr(fused, "has_post_expert_norm", False):
        raise InputError(f"{type(fused).__name__} normalizes each expert's output (has_post_expert_norm): "
                         "qtk does not quantize such experts yet; use a model without it")
    glu = _glu(fused, layout)
    up = "gate_up_proj" if layout["has_gate"] else "up_proj"
    experts = []
    for e in range(fused.down_proj.shape[0]):
        w_up, w_down = _rows(getattr(fused, up)[e], layout), _rows(fused.down_proj[e], layout)  # [2I or I, H], [H, I]
        b_up = getattr(fused, up + "_bias")[e] if layout["has_bias"] else None
        b_down = fused.down_proj_bias[e] if layout["has_bias"] else None
        if layout["has_gate"]:
            (w_g, w_u), (b_g, b_u) = _split(w_up, layout), _split(b_up, layout)
            experts.append(Expert(_linear(w_g, b_g), _linear(w_u, b_u), _linear(w_down, b_down), glu))
        else:
            experts.append(Expert(None, _linear(w_up, b_up), _linear(w_down, b_down), glu))
    return LinearExperts(experts, layout)


def _rows(w: torch.Tensor, layout: dict) -> torch.Tensor:
    """An expert's weight as nn.Linear holds it, [out, in]."""
    return w.t() if layout["is_transposed"] else w


def _split(gate_up: torch.Tensor | None, layout: dict) -> tuple:
    """(gate, up) rows of a gate_up weight [2I, H] or bias [2I]: halves, or interleaved (gpt-oss)."""
    if gate_up is None:
        return None, None
    if layout["is_concatenated"]:
        return gate_up.chunk(2, dim=0)
    return gate_up[0::2], gate_up[1::2]


def _join(gate: torch.Tensor, up: torch.Tensor, layout: dict) -> torch.Tensor:
    """The inverse of _split on the last dim: gate, up [.., I] -> [.., 2I] in the fused module's layout."""
    if layout["is_concatenated"]:
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)  # gate0, up0, gate1, up1, ...


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    """nn.Linear holding copies of w [out, in] and b [out] (meta stays meta)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
    lin.weight = nn.Parameter(w if w.is_meta else w.detach().clone().contiguous())
    if b is not None:
        lin.bias = nn.Parameter(b if b.is_meta else b.detach().clone().contiguous())
    return lin


def _glu(fused: nn.Module, layout: dict):
    """The fused module's own activation as a function of (gate, up): its `_apply_gate` (SwiGLU, or
    gpt-oss's clamped one) on gate/up joined back into its layout, so any family's gate is exact."""
    shell = nn.Module.__new__(type(fused))  # the module's attributes (act_fn, alpha, limit), no weights
    shell.__dict__.update({k: v for k, v in fused.__dict__.items() if k != "_parameters"})
    shell._parameters = {}
    if not layout["has_gate"]:
        return functools.partial(_act, shell)
    from transformers.integrations.moe import _default_apply_gate

    if type(fused)._apply_gate is _default_apply_gate and layout["is_concatenated"]:  # act(gate) * up, unjoined
        return functools.partial(_swiglu, shell)
    return functools.partial(_gated, shell, layout)


def _gated(shell, layout, gate, up):
    return type(shell)._apply_gate(shell, _join(gate, up, layout))


def _swiglu(shell, gate, up):
    return shell.act_fn(gate) * up


def _act(shell, up):
    return shell.act_fn(up)


def experts_modules(model: nn.Module) -> dict[str, LinearExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearExperts)}


@contextlib.contextmanager
def all_experts(module: nn.Module, on: bool = True):
    """Within: every LinearExperts in `module` runs every token through every expert (hooks on the
    experts see them all; the outputs are unchanged)."""
    found = [m for m in module.modules() if isinstance(m, LinearExperts)]
    saved = [m.calibrate_all for m in found]
    for m in found:
        m.calibrate_all = on
    try:
        yield
    finally:
        for m, s in zip(found, saved):
            m.calibrate_all = s


def router_names(model: nn.Module) -> list[str]:
    """The routers of every MoE block (a LinearExperts' siblings named in ROUTERS)."""
    out = []
    for name in experts_modules(model):
        block, _, _ = name.rpartition(".")
        parent = model.get_submodule(block) if block else model
        out += [f"{block}.{r}" if block else r for r in ROUTERS if isinstance(getattr(parent, r, None), nn.Module)]
    return out



# --- checkpoint names -------------------------------------------------------------------

@dataclass(frozen=True)
class HubLayout:
    """How a family's hub checkpoints name what LinearExperts holds.

    renames: (qtk's name, the hub's) substrings of a tensor or module name, '*' an expert number,
    each applied once in this order both ways (the more specific first). fused: the hub stores the
    experts 3-D (as transformers' module holds them): float experts are written that way."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: bool = False


_W132 = ((".experts.*.gate_proj.", ".experts.*.w1."), (".experts.*.up_proj.", ".experts.*.w3."),
         (".experts.*.down_proj.", ".experts.*.w2."))  # Mixtral's names (vLLM's mixtral/phimoe ckpt_names)

# model_type -> its hub layout (transformers' conversion_mapping.py read backwards); a type not
# here names its experts as qtk does (Qwen2/3-MoE, OLMoE: mlp.experts.7.gate_proj, mlp.gate)
HUB: dict[str, HubLayout] = {
    "mixtral": HubLayout(((".mlp.", ".block_sparse_moe."), *_W132)),
    "phimoe": HubLayout(((".mlp.router.", ".block_sparse_moe.gate."), (".mlp.", ".block_sparse_moe."), *_W132)),
    # hub: block_sparse_moe.input_linear / output_linear [E, ..] and router.layer; quantized experts
    # as vLLM's granitemoe FusedMoE reads them (its default names: experts.N.gate_proj, vLLM 0.32)
    "granitemoe": HubLayout(((".router.", ".router.layer."), (".experts.gate_up_proj.", ".input_linear.weight."),
                             (".experts.down_proj.", ".output_linear.weight.")), fused=True),
    # hub: mlp.experts.gate_up_proj [E, H, 2I] (+ bias, gate/up interleaved); quantized experts as
    # llm-compressor 0.14 writes them (mlp.experts.N.gate_proj, with biases). vLLM 0.32's gpt-oss
    # loader reads no per-expert compressed-tensors names (3-D, mxfp4 and quark only)
    "gpt_oss": HubLayout(fused=True),
}


def _rename(name: str, pairs, to_hub: bool) -> str:
    s = name + "."  # every pattern ends at a name boundary
    for ours, hub in pairs:
        src, dst = (ours, hub) if to_hub else (hub, ours)
        s = re.sub(re.escape(src).replace(r"\*", r"(\d+)"), dst.replace("*", r"\1"), s)
    return s[:-1]


def hub_name(model_type: str, name: str) -> str:
    """A tensor's or module's name in qtk's model -> the hub's name for it."""
    return _rename(name, HUB.get(model_type, HubLayout()).renames, to_hub=True)


def model_name(model_type: str, name: str) -> str:
    """The hub's name -> the name in qtk's model (with LinearExperts)."""
    return _rename(name, HUB.get(model_type, HubLayout()).renames, to_hub=False)


def hub_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of `model` (LinearExperts inside) as the hub names it; in families whose hub is
    3-D, a LinearExperts whose projections are all float is written 3-D again (one on meta, a block
    a streamed run wrote already, is not `state`'s)."""
    mt = model.config.model_type
    if HUB.get(mt, HubLayout()).fused:
        for name, experts in experts_modules(model).items():
            if any(p.is_meta for p in experts.parameters()):
                continue
            if all(isinstance(getattr(x, p), nn.Linear) for x in experts for p in _projections(experts)):
                state = {k: v for k, v in state.items() if not k.startswith(name + ".")}
                state.update({f"{name}.{k}": v for k, v in fuse(experts).items()})
    return {hub_name(mt, k): v for k, v in state.items()}


def model_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (hub names) under `model`'s names; 3-D experts split per expert."""
    mt = model.config.model_type
    out = {model_name(mt, k): v for k, v in tensors.items()}
    for name, experts in experts_modules(model).items():
        own = [k for k in out if k.startswith(name + ".") and "." not in k[len(name) + 1:]]  # name.gate_up_proj
        fused = {k[len(name) + 1:]: out.pop(k) for k in own}
        if fused:
            out.update({f"{name}.{k}": v for k, v in unfuse(experts, fused).items()})
    return out


def _projections(experts: LinearExperts) -> tuple[str, ...]:
    return PROJECTIONS if experts.layout["has_gate"] else PROJECTIONS[1:]


def fuse(experts: LinearExperts) -> dict[str, torch.Tensor]:
    """The 3-D tensors of the transformers module `experts` replaced (its parameter names)."""
    lay = experts.layout
    up = "gate_up_proj" if lay["has_gate"] else "up_proj"

    def rows(x):  # the expert's up weight [2I or I, H]: gate and up rows joined in the layout
        if not lay["has_gate"]:
            return x.up_proj.weight.detach()
        return _join(x.gate_proj.weight.detach().t(), x.up_proj.weight.detach().t(), lay).t()

    def bias(x):  # [2I or I]
        if not lay["has_gate"]:
            return x.up_proj.bias.detach()
        return _join(x.gate_proj.bias.detach(), x.up_proj.bias.detach(), lay)

    out = {up: torch.stack([_rows(rows(x), lay) for x in experts]),  # _rows is its own inverse
           "down_proj": torch.stack([_rows(x.down_proj.weight.detach(), lay) for x in experts])}
    if lay["has_bias"]:
        out[up + "_bias"] = torch.stack([bias(x) for x in experts])
        out["down_proj_bias"] = torch.stack([x.down_proj.bias.detach() for x in experts])
    return out


def unfuse(experts: LinearExperts, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fuse's inverse: per-expert `N.gate_proj.weight`, ... from the 3-D tensors."""
    lay = experts.layout
    up = "gate_up_proj" if lay["has_gate"] else "up_proj"
    out = {}
    for e in range(len(experts)):
        w_up, w_down = _rows(fused[up][e], lay), _rows(fused["down_proj"][e], lay)
        b_up = fused[up + "_bias"][e] if lay["has_bias"] else None
        parts = dict(zip(("gate_proj", "up_proj"), _split(w_up, lay))) if lay["has_gate"] else {"up_proj": w_up}
        parts["down_proj"] = w_down
        biases = dict(zip(("gate_proj", "up_proj"), _split(b_up, lay))) if lay["has_gate"] else {"up_proj": b_up}
        biases["down_proj"] = fused["down_proj_bias"][e] if lay["has_bias"] else None
        for p, t in parts.items():
            out[f"{e}.{p}.weight"] = t.contiguous()
            if biases[p] is not None:
                out[f"{e}.{p}.bias"] = biases[p].contiguous()
    return out
