"""Tiny GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them, from a transformers
model: the GGUF side of the reader tests (tests/test_readers_families.py).

What the converter does per family, and the reader (transformers' GGUF loader) undoes:
- names: gguf's TensorNameMap (blk.N.attn_q, ffn_gate_exps, ...), as get_gguf_hf_weights_map reads it;
- llama (and Mixtral, which llama.cpp writes as llama): q/k rows permuted for ggml's rotary
  (LlamaModel.permute), undone by LlamaTensorProcessor;
- Gemma 2/3 (and Nemotron's LayerNorm1P): every norm weight stored as w + 1 (their (1 + w)), undone by - 1;
- MoE: each block's experts stacked [E, out, in] as ffn_{gate,up,down}_exps;
- RoPE scaling: linear in the metadata (Gemma 3), Llama 3's as rope_freqs (each frequency's divisor),
  Phi-3's LongRoPE as rope_factors_long / _short;
- metadata: the keys llama.cpp writes (block_count, embedding_length, ...), a byte-level "gpt2"
  tokenizer of 256 tokens (the byte tokenizer's vocabulary).
Weights go in as F32, F16 or Q8_0 (quantized with gguf's own quantizer).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

# model_type -> (llama.cpp's architecture name, what the converter does beyond renaming)
ARCH = {
    "llama": ("llama", {"permute_qk"}),
    "mistral": ("llama", {"permute_qk"}),
    "mixtral": ("llama", {"permute_qk"}),
    "qwen2": ("qwen2", set()),
    "qwen3": ("qwen3", set()),
    "qwen2_moe": ("qwen2moe", set()),
    "qwen3_moe": ("qwen3moe", set()),
    "gemma2": ("gemma2", {"norm_plus_one"}),
    "gemma3_text": ("gemma3", {"norm_plus_one"}),
    "phi3": ("phi3", set()),
    "starcoder2": ("starcoder2", set()),
    "nemotron": ("nemotron", {"norm_plus_one"}),  # LayerNorm1P: (1 + w)
    "gpt_oss": ("gpt-oss", set()),
    "olmo2": ("olmo2", set()),
    "granite": ("granite", set()),
}


def _tokenizer(w) -> None:
    from tokenizers import pre_tokenizers

    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)
    w.add_token_merges([])
    w.add_token_scores([0.0] * 256)  # no merges: transformers derives them from the scores (none here)
    w.add_pad_token_id(0)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _metadata(w, config) -> None:
    import gguf

    c = config
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    rope = (getattr(c, "rope_parameters", None) or {})
    theta = rope.get("rope_theta") or (rope.get("full_attention") or {}).get("rope_theta")
    if theta:
        w.add_rope_freq_base(theta)
    scaled = rope.get("full_attention", rope)
    if scaled.get("rope_type") == "linear":  # Gemma 3 4B and up
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaled["factor"])
    if scaled.get("rope_type") == "yarn":  # gpt-oss
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaled["factor"])
        w.add_rope_scaling_orig_ctx_len(scaled["original_max_position_embeddings"])
    if scaled.get("rope_type") == "longrope":  # Phi-3 128k (its factors are tensors: _rope_tensors)
        original = scaled["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    if getattr(c, "rms_norm_eps", None) is not None:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "norm_eps", None) is not None:
        w.add_layer_norm_rms_eps(c.norm_eps)
    if getattr(c, "norm_epsilon", None) is not None:
        w.add_layer_norm_eps(c.norm_epsilon)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if getattr(c, key, None) is not None:
            add(getattr(c, key))
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model, arch: str, does: set, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's names, transformed as its converter transforms them."""
    import gguf

    c = model.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     c.num_hidden_layers)
    out = {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        t = t.detach().float()
        base, _, suffix = hf.rpartition(".")
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?", hf):
            stacked = _experts(model.get_submodule(f"model.layers.{m[1]}.mlp.experts"), m[1], m[2], m[3], t)
            out.update(_one_per_expert(stacked) if per_expert else stacked)
            continue
        if base.endswith("self_attn") and suffix == "sinks":
            out[f"blk.{base.split('.')[2]}.attn_sinks.weight"] = t
            continue
        name = names.get_name(base)
        if name is None:
            raise KeyError(f"gguf has no name for {hf} in {arch}")
        if "permute_qk" in does and base.endswith("q_proj"):
            t = _permute(t, c.num_attention_heads)
        if "permute_qk" in does and base.endswith("k_proj"):
            t = _permute(t, c.num_key_value_heads)
        if "norm_plus_one" in does and "norm" in base and suffix == "weight":
            t = t + 1
        if name.endswith("ffn_gate_inp_shexp"):
            t = t.reshape(-1)
        out[f"{name}.{suffix}"] = t
    return out


def _experts(module, block: str, proj: str, bias: str | None, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 3-D experts tensor as llama.cpp stacks it: ffn_{gate,up,down}_exps [E, out, in] (biases [E, out])."""
    suffix = "bias" if bias else "weight"
    if not bias and module.is_transposed:  # gpt-oss: [E, in, out]
        t = t.transpose(1, 2)
    if proj == "down_proj":
        return {f"blk.{block}.ffn_down_exps.{suffix}": t}
    gate, up = t.chunk(2, dim=1) if module.is_concatenated else (t[:, 0::2], t[:, 1::2])  # gpt-oss interleaves
    return {f"blk.{block}.ffn_gate_exps.{suffix}": gate, f"blk.{block}.ffn_up_exps.{suffix}": up}


def _one_per_expert(stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's first Mixtral layout (early 2024): blk.N.ffn_gate.E.weight, one tensor per expert."""
    return {name.replace("_exps.", f".{e}."): w for name, t in stacked.items() for e, w in enumerate(t)}


def _rope_tensors(model) -> dict[str, torch.Tensor]:
    """RoPE scaling llama.cpp stores as tensors: Llama 3.1's divisor of each frequency (rope_freqs),
    Phi-3's LongRoPE factors."""
    rope = model.config.rope_parameters
    if rope.get("rope_type") == "llama3":
        rotary = model.model.rotary_emb
        dim = rotary.inv_freq.shape[0] * 2
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return {"rope_freqs.weight": plain / rotary.inv_freq}
    if rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": torch.tensor(rope["long_factor"]),
                "rope_factors_short.weight": torch.tensor(rope["short_factor"])}
    return {}


def _stored_as(dtype: str, ndim: int) -> str:
    """The GGML type a tensor of `ndim` dims is written in: 1-D ones F32 as llama.cpp keeps them;
    "MXFP4": the stacked experts (3-D) in MXFP4 as gpt-oss's GGUFs hold them, the rest F32."""
    if ndim == 1:
        return "F32"
    if dtype == "MXFP4":
        return "MXFP4" if ndim == 3 else "F32"
    return dtype


def write(model, path: Path, dtype: str = "F32", per_expert: bool = False) -> Path:
    """`model` (a transformers causal LM) as a GGUF file at `path`, weights in `dtype` (F32, F16,
    Q8_0, or MXFP4 experts: _stored_as); per_expert: experts one tensor each."""
    import gguf

    arch, does = ARCH[model.config.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny " + model.config.model_type)
    _metadata(w, model.config)
    _tokenizer(w)
    for name, t in {**_tensors(model, arch, does, per_expert), **_rope_tensors(model)}.items():
        a = t.numpy()
        kind = _stored_as(dtype, a.ndim)
        if kind in ("F32", "F16"):
            w.add_tensor(name, a.astype(np.float32 if kind == "F32" else np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            q = gguf.quants.quantize(a.astype(np.float32), qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
