"""Mixture-of-experts blocks on the native path (Mixtral, Qwen3-MoE, gpt-oss's experts): the block's
own router, then the experts over the tokens routed to each, as direct kernel calls.

    ids, w = router(x)                     x [T, H] -> top-k expert ids, weights [T, k] (float, the block's)
    pairs (token, slot) sorted by expert   order [T*k]; counts [E] (one sync per block)
    xs = x[order // k]                     [T*k, H], each expert's rows side by side
    per expert e with n_e rows:  hs_e = gate_up_e(xs_e)        [n_e, 2I], gate/up fused: one matmul
    h = act(hs)                            [T*k, I], one call for every expert's rows
    per expert e:                ys_e = down_e(h_e)            [n_e, H]
    out = zeros [T, H].index_add_(order // k, ys * w[order])

The experts are qtk.moe.LinearExperts (a checkpoint's, or transformers' 3-D experts linearized at
build), each Expert's gate_proj and up_proj joined by packed_linear.pack_linears into gate_up_proj
(PackedLinear for float, run on oneDNN or, below packed_linear.SMALL_FLOAT, F.linear; WOQLinear / W8A8Linear
for quantized ones), [gate | up] side by side.
Adding a family is a row of MOE: the router's name and the activation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...moe import LinearExperts, is_fused_experts, linearize_experts
from ..packed_linear import direct

WHY_NO_GRAPHS = "MoE routing sizes each expert's matmul by its token count (a device sync per block): not captured"


@dataclass(frozen=True)
class MoEFamily:
    router: str  # the block's child: hidden [T, H] -> (logits, top-k weights [T, k], top-k ids [T, k])
    act: str = "swiglu"  # ACTIVATIONS' key: gate_up [n, 2I] -> [n, I]


MOE = {"mixtral": MoEFamily("gate"), "qwen3_moe": MoEFamily("gate"), "gpt_oss": MoEFamily("router", "clamped_swiglu")}


def swiglu(y: torch.Tensor, cfg, ops) -> torch.Tensor:
    """y [n, 2I] = [gate | up] -> silu(gate) * up [n, I]."""
    if ops is not None:
        return ops.silu_and_mul(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(y: torch.Tensor, cfg, ops) -> torch.Tensor:
    """gpt-oss: y [n, 2I] = [gate | up] -> (clamp(up, ±limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
    (transformers' GptOssExperts._apply_gate, on gate/up rows the checkpoint interleaves)."""
    gate, up = y.chunk(2, dim=-1)
    gate = gate.clamp(max=cfg.swiglu_limit)
    up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))).contiguous()


ACTIVATIONS = {"swiglu": swiglu, "clamped_swiglu": clamped_swiglu}


def is_moe_block(module: nn.Module, family: MoEFamily) -> bool:
    experts = getattr(module, "experts", None)
    return (isinstance(experts, LinearExperts) or (experts is not None and is_fused_experts(experts))) and \
        isinstance(getattr(module, family.router, None), nn.Module)


def install(layers: nn.ModuleList, cfg, ops) -> bool:
    """Give each layer whose mlp is a MoE block of cfg's family a SparseMoE in its place (its experts
    linearized first where transformers holds them 3-D). True if any layer has one."""
    family = MOE.get(cfg.model_type)
    if family is None:
        return False
    found = False
    for layer in layers:
        if not isinstance(layer.mlp, SparseMoE) and is_moe_block(layer.mlp, family):
            linearize_experts(layer.mlp)
            layer.mlp = SparseMoE(layer.mlp, family, cfg, ops)
        found = found or isinstance(layer.mlp, SparseMoE)
    return found


def expert_plan(expert: nn.Module, kernels: bool) -> tuple:
    """(gate_up, down) callables of one Expert: gate_up x [n, H] -> [gate | up] [n, 2I]; the kernels
    called directly where `kernels` (float32 activations on CPU), else the modules."""
    call = direct if kernels else (lambda m: m)
    if hasattr(expert, "gate_up_proj"):  # fused by pack_linears
        return call(expert.gate_up_proj), call(expert.down_proj)
    gate, up = expert.gate_proj, expert.up_proj  # not fused (a CUDA model, or kernels that cannot join)
    return (lambda x: torch.cat((gate(x), up(x)), dim=-1)), expert.down_proj


class SparseMoE(nn.Module):
    """A MoE block over a packed batch, x [T, H] -> [T, H]: its router and LinearExperts (same modules,
    same names under the layer's mlp), run as the module docstring says."""

    def __init__(self, block: nn.Module, family: MoEFamily, cfg, ops):
        super().__init__()
        self.family, self.cfg = family, cfg
        self.ops = ops  # qtk's CPU ops where activations are float32 on CPU, else None
        setattr(self, family.router, getattr(block, family.router))
        self.experts: LinearExperts = block.experts
        self.act = ACTIVATIONS[family.act]
        self._plan = None  # per expert (gate_up, down), built at the first forward (after packing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            self._plan = [expert_plan(e, self.ops is not None) for e in self.experts]
        _, weights, ids = getattr(self, self.family.router)(x)  # [T, k], [T, k]
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self._plan)).tolist()  # one device sync per block
        tokens = order.div(k, rounding_mode="floor")
        xs = x.index_select(0, tokens)  # [T*k, H]
        rows, start = [], 0  # (expert's plan, its rows' slice) for each expert with tokens
        for plan, n in zip(self._plan, counts):
            if n:
                rows.append((plan, slice(start, start + n)))
                start += n
        h = self.act(_cat([gate_up(xs[r]) for (gate_up, _), r in rows]), self.cfg, self.ops)  # [T*k, I]: one call
        y = _cat([down(h[r]) for (_, down), r in rows])  # [T*k, H]
        y = y * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if len(parts) > 1 else parts[0]
