"""Tiny random-weight models of many transformers decoder types, built from their configs: the
model zoo of the any-decoder tests (calibration, checkpoint, generic and native runtime paths).

Each is TINY's sizes (2 layers, hidden 64, 4 heads / 2 KV heads of 16) plus what its type needs
to stay tiny or to exercise what is new about it: short sliding windows (8 tokens, so a 20-token
prompt crosses them), soft-capping, few small experts. Token ids fit the 256-token vocabulary of
the byte tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch

from interop import TINY, byte_tokenizer

_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_WINDOW = 8
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# model_type -> config overrides on top of TINY (and head_dim 16, ids in the vocabulary)
DENSE: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=_WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1),
    "qwen3": {},
    "gemma": {},
    "gemma2": dict(sliding_window=_WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "vaultgemma": {},
    "phi3": {},
    "phi": {},
    "olmo": {},
    "olmo2": {},
    "olmo3": dict(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=4.0),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "glm": {},
    "glm4": {},
    "starcoder2": dict(sliding_window=_WINDOW),
    "gpt_neox": {},
    "helium": {},
    "smollm3": {},
    "ministral": {},
    "exaone4": {},
    "seed_oss": {},
    "arcee": {},
    "nemotron": {},
    "hunyuan_v1_dense": {},
    "ernie4_5": {},
    "persimmon": {},
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
}
MOE: dict[str, dict] = {
    "mixtral": {},
    "qwen3_moe": {},
    "qwen2_moe": dict(shared_expert_intermediate_size=32),
    "olmoe": {},
    "phimoe": {},
    "granitemoe": {},
    "gpt_oss": dict(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
}
ZOO = {**DENSE, **MOE}


def tiny_config(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING

    extra = dict(_MOE) if model_type in MOE else {}
    return CONFIG_MAPPING[model_type](**{**TINY, "head_dim": 16, **_IDS, **extra, **ZOO[model_type], **overrides})


def tiny(model_type: str, seed: int = 0, **overrides):
    """A seeded random model of the type, eval mode, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def saved(model, path) -> str:
    """The model and the byte tokenizer in a model directory, as a user's HF model is."""
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def files_state(d) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files, by name."""
    from safetensors import safe_open

    from qtk.checkpoint import weight_files

    out = {}
    for f in weight_files(Path(d)):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out
