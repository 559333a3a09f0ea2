"""Mixtral GGUFs: llama.cpp writes Mixtral as its 'llama' architecture with experts, which
transformers' GGUF reader builds as a dense Llama (the experts unread, the MLPs random). qtk reads
them itself: the 'llama' config with {arch}.expert_count / expert_used_count becomes a MixtralConfig,
and the tensors, dequantized by gguf, go onto MixtralForCausalLM by llama.cpp's names (_NAMES):
q/k rows un-permuted (llama.cpp interleaves each head's rotary halves), each block's stacked
ffn_gate_exps / ffn_up_exps [E, I, H] joined into transformers' experts.gate_up_proj [E, 2I, H].
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError

log = logging.getLogger(__name__)

# llama.cpp's tensor name -> MixtralForCausalLM's (\1: the block)
_NAMES = {
    r"token_embd\.weight": "model.embed_tokens.weight",
    r"output_norm\.weight": "model.norm.weight",
    r"output\.weight": "lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.weight": r"model.layers.\1.input_layernorm.weight",
    r"blk\.(\d+)\.attn_q\.weight": r"model.layers.\1.self_attn.q_proj.weight",
    r"blk\.(\d+)\.attn_k\.weight": r"model.layers.\1.self_attn.k_proj.weight",
    r"blk\.(\d+)\.attn_v\.weight": r"model.layers.\1.self_attn.v_proj.weight",
    r"blk\.(\d+)\.attn_output\.weight": r"model.layers.\1.self_attn.o_proj.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
    r"blk\.(\d+)\.ffn_gate_inp\.weight": r"model.layers.\1.mlp.gate.weight",
    r"blk\.(\d+)\.ffn_down_exps\.weight": r"model.layers.\1.mlp.experts.down_proj",
    r"blk\.(\d+)\.ffn_(gate|up)_exps\.weight": r"model.layers.\1.mlp.experts.\2",  # joined below
}


def is_mixtral(metadata: dict, raw: str) -> bool:
    return raw == "llama" and bool(metadata.get("llama.expert_count"))


def mixtral_config(config, metadata: dict):
    """The MixtralConfig of a 'llama' GGUF with experts (`config`: transformers' LlamaConfig of it)."""
    from transformers import MixtralConfig

    own = ("model_type", "architectures", "transformers_version")
    fields = {k: v for k, v in config.to_dict().items() if k not in own}
    return MixtralConfig(**{**fields, "num_local_experts": metadata["llama.expert_count"],
                            "num_experts_per_tok": metadata["llama.expert_used_count"]})


def read_mixtral(gguf: Path, config, dtype: torch.dtype) -> nn.Module:
    """MixtralForCausalLM with every weight from the file."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _tensors(gguf, config, dtype)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing or set(tensors) - set(expected):
        extra = sorted(set(tensors) - set(expected))
        raise CheckpointError(f"{gguf}: a 'llama' GGUF with experts read as Mixtral, but "
                              + (f"{missing[0]} is not in the file" if missing else f"{extra[0]} is no Mixtral weight")
                              + " (llama.cpp's per-expert layout of early 2024, blk.N.ffn_gate.E, is not read); "
                              "give the model's HF directory")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def _tensors(gguf: Path, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantized (in `dtype`, one tensor at a time), under MixtralForCausalLM's names."""
    from gguf import GGUFReader, dequantize

    out, halves = {}, {}
    for t in GGUFReader(str(gguf)).tensors:
        name = _name(t.name)
        if name is None:
            out[t.name] = None  # reported as no Mixtral weight
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        w = w.to(dtype)
        if name.endswith((".gate", ".up")) and ".experts." in name:
            block, which = name.rsplit(".", 1)
            halves.setdefault(block, {})[which] = w  # [E, I, H]
            continue
        out[name] = w
    for block, h in halves.items():
        out[f"{block}.gate_up_proj"] = torch.cat([h["gate"], h["up"]], dim=1)  # [E, 2I, H]
    return out


def _name(gguf_name: str) -> str | None:
    for pattern, hf in _NAMES.items():
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, hf, gguf_name)
    return None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: [heads * D, H] rows back in rotate_half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
