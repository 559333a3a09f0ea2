"""MoE GGUFs transformers' GGUF reader builds wrong, read by qtk: Mixtral, which llama.cpp writes as
its 'llama' architecture with experts (transformers builds a dense Llama, its MLPs random), and
gpt-oss (transformers maps the experts onto module names its GptOss model no longer has).

The config is transformers' (a Mixtral's made a MixtralConfig from the 'llama' one and the expert
counts); the tensors, dequantized by gguf one at a time, go onto the model by llama.cpp's names
(gguf's TensorNameMap, as transformers maps them), with what llama.cpp's converter did undone:
- 'llama': q/k rows un-permuted (llama.cpp interleaves each head's rotary halves);
- experts: each block's stacked ffn_{gate,up,down}_exps [E, out, in] (and biases [E, out]) joined
  back into the experts module's own layout (gate_up concatenated or interleaved, transposed or
  not: its is_concatenated / is_transposed), e.g. Mixtral's gate_up_proj [E, 2I, H];
- gpt-oss: each attention's sinks from attn_sinks.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError

log = logging.getLogger(__name__)

_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")


def moe_type(metadata: dict, raw: str) -> str | None:
    """The model type of a GGUF qtk reads itself (None: transformers reads it)."""
    if raw == "llama" and metadata.get("llama.expert_count"):
        return "mixtral"
    return "gpt_oss" if raw == "gpt-oss" else None


def moe_config(config, metadata: dict, model_type: str):
    """transformers' config of the GGUF, a Mixtral's made a MixtralConfig."""
    if model_type != "mixtral":
        return config
    from transformers import MixtralConfig

    own = ("model_type", "architectures", "transformers_version")
    fields = {k: v for k, v in config.to_dict().items() if k not in own}
    return MixtralConfig(**{**fields, "num_local_experts": metadata["llama.expert_count"],
                            "num_experts_per_tok": metadata["llama.expert_used_count"]})


def read_moe(gguf: Path, config, raw: str, dtype: torch.dtype) -> nn.Module:
    """The model of `config` with every weight from the file."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _tensors(gguf, model, raw, dtype)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise CheckpointError(f"{gguf}: read as {type(model).__name__}, but "
                              + (f"{missing[0]} is not in the file" if missing else f"{extra[0]} is no weight of it")
                              + " (llama.cpp's per-expert layout of early 2024, blk.N.ffn_gate.E, is not read); "
                              "give the model's HF directory")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def _tensors(gguf: Path, model: nn.Module, raw: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantized into `dtype` one at a time, under the model's names (a
    tensor the model has no name for keeps its own, for read_moe to report)."""
    from gguf import GGUFReader, dequantize

    names = _hf_names(model, raw)
    out, experts = {}, {}
    for t in GGUFReader(str(gguf)).tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if m := _EXPERTS.fullmatch(t.name):
            experts.setdefault(int(m[1]), {})[(m[2], m[3])] = w.to(dtype)
            continue
        name = names.get(t.name, t.name)
        if raw == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = model.config.num_attention_heads if "q_proj" in name else model.config.num_key_value_heads
            w = _unpermute(w.float(), heads)
        out[name] = w.to(dtype)
    for block, parts in experts.items():
        module = model.get_submodule(f"model.layers.{block}.mlp.experts")
        out.update({f"model.layers.{block}.mlp.experts.{k}": v for k, v in _join_experts(module, parts).items()})
    return out


def _hf_names(model: nn.Module, raw: str) -> dict[str, str]:
    """llama.cpp's tensor name -> the model's, for every parameter gguf's TensorNameMap names."""
    import gguf

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == raw)
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    out = {}
    for hf in model.state_dict():
        base, _, suffix = hf.rpartition(".")
        if suffix == "sinks":  # gpt-oss: self_attn.sinks
            out[f"blk.{base.split('.')[2]}.attn_sinks.weight"] = hf
        elif (name := name_map.get_name(base)) is not None:
            out[f"{name}.{suffix}"] = hf
    return out


def _join_experts(module: nn.Module, parts: dict) -> dict[str, torch.Tensor]:
    """ffn_{gate,up,down}_exps (weights [E, out, in], biases [E, out]) -> the experts module's own
    parameters: gate_up_proj [E, 2I, H] (gpt-oss: [E, H, 2I], gate and up interleaved), down_proj."""
    def join(gate, up):  # on the last dim
        return torch.cat([gate, up], -1) if module.is_concatenated else torch.stack([gate, up], -1).flatten(-2)

    def stored(w):  # [E, out, in] -> the module's layout
        return w.transpose(1, 2).contiguous() if module.is_transposed else w

    out = {"gate_up_proj": stored(join(parts["gate", "weight"].transpose(1, 2), parts["up", "weight"].transpose(1, 2))
                                  .transpose(1, 2)),
           "down_proj": stored(parts["down", "weight"])}
    if ("gate", "bias") in parts:
        out["gate_up_proj_bias"] = join(parts["gate", "bias"], parts["up", "bias"])
        out["down_proj_bias"] = parts["down", "bias"]
    return out


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: [heads * D, H] rows back in rotate_half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
