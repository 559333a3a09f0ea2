"""Architectures as data: where a model_type keeps its decoder layers, their Linear layers and
the AWQ / SmoothQuant pairs. Adding a family that shares Llama's layout is a table row."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .errors import InputError


@dataclass(frozen=True)
class SmoothPair:
    """A smoothing pair: `prev` (a norm or a linear) feeds `linears`; scales fold into `prev`.

    `inspect` is the module whose input is the linears' input (for AWQ's block-output loss)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None


@dataclass(frozen=True)
class Arch:
    layers: str  # path of the decoder-layer ModuleList
    linears: tuple[str, ...]  # Linear layers inside a decoder layer, in execution order
    smooth: tuple[SmoothPair, ...]  # AWQ / SmoothQuant pairs, in execution order
    attention: str = "self_attn"  # module that owns k_scale / v_scale
    rotary: str = "model.rotary_emb"
    embed: str = "model.embed_tokens"


_LLAMA = Arch(
    layers="model.layers",
    linears=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    smooth=(
        SmoothPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        SmoothPair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothPair("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothPair("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
)

ARCHITECTURES: dict[str, Arch] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA}


def arch_for(config) -> Arch:
    mt = getattr(config, "model_type", None)
    if mt not in ARCHITECTURES:
        raise InputError(f"unsupported architecture {mt!r}; qtk supports model_type {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[mt]


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)
