"""A GGUF file's transformers config, with what transformers' GGUF reader leaves unread read by qtk.

transformers (5.24) maps a fixed set of llama.cpp's metadata keys per architecture onto the config
class; every other field keeps the class's default, which fits the family's flagship checkpoint
and no other size of it. What llama.cpp writes and qtk reads besides:
- sizes and soft-caps (_UNREAD): Qwen3's head_dim (default 128), the MoE expert sizes, Gemma 2's caps;
- RoPE scaling, which llama.cpp stores as metadata (linear: Gemma 3 4B and up) or as tensors of
  per-frequency divisors: rope_freqs (Llama 3.1 and later) and rope_factors_long / _short
  (Phi-3's and Phi-4-mini's LongRoPE). Unread, every position would rotate by the wrong angles.
A file of an architecture transformers has no GGUF mapping for is refused before any tensor is read.
"""
from __future__ import annotations

import copy
import logging
import struct
from pathlib import Path

import torch

from .errors import CheckpointError

log = logging.getLogger(__name__)

# llama.cpp's architecture names transformers' GGUF reader renames (load_gguf_checkpoint)
ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}

# {arch}.KEY llama.cpp writes -> the config attribute, where transformers' mapping has no entry for KEY
_UNREAD = {
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.sliding_window": "sliding_window",  # gpt-oss: transformers reads "sliding_window", never written
}

# Llama 3.1 / 3.2 / 3.3's RoPE scaling besides its factor: what llama.cpp computed rope_freqs from
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gguf_architectures() -> list[str]:
    """The GGUF architectures transformers reads and dequantizes, in transformers' names (its newer
    GGUF path, GGUF_CONFIG_ARCHS, keeps the weights packed in its own modules: nothing to quantize)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # those two: metadata sections


def gguf_metadata(gguf: Path) -> tuple[dict, str]:
    """(the GGUF's metadata, its llama.cpp architecture name); a file transformers has no GGUF
    mapping for is refused here, in one line."""
    import transformers
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(gguf))
        raw = metadata["general.architecture"]
    except (ValueError, KeyError, IndexError, EOFError, struct.error) as e:  # what a bad GGUF raises there
        raise CheckpointError(f"{gguf}: transformers cannot read this GGUF file ({e}); give a whole GGUF of an "
                              f"architecture transformers dequantizes ({', '.join(gguf_architectures())}) or an HF "
                              "model directory") from e
    if raw in GGUF_CONFIG_ARCHS:
        raise CheckpointError(f"{gguf}: transformers {transformers.__version__} reads {raw!r} GGUFs into its packed "
                              "GGUF modules, not the plain weights qtk quantizes; give the model's HF directory")
    if ALIASES.get(raw, raw) not in gguf_architectures():
        raise CheckpointError(f"{gguf}: transformers {transformers.__version__} has no GGUF mapping for architecture "
                              f"{raw!r} (it reads {', '.join(gguf_architectures())}); give the model's HF directory")
    return metadata, raw


def gguf_config(gguf: Path, metadata: dict, raw: str):
    """transformers' config of the GGUF, with what its mapping leaves unread filled in."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = _gpt_oss_config(metadata) if raw == "gpt-oss" else AutoConfig.from_pretrained(gguf.parent,
                                                                                          gguf_file=gguf.name)
    mapped = GGUF_CONFIG_MAPPING.get(ALIASES.get(raw, raw), {})
    for key, attr in _UNREAD.items():
        value = metadata.get(f"{raw}.{key}")
        if value is not None and key not in mapped and hasattr(config, attr) and getattr(config, attr) != value:
            log.info("%s: %s = %s from the GGUF's %s.%s (transformers leaves it unread)", gguf, attr, value, raw, key)
            setattr(config, attr, value)
    _linear_rope(gguf, config, metadata, raw)
    factors = _rope_tensors(gguf)
    if "rope_freqs.weight" in factors:
        _llama3_rope(gguf, config, factors["rope_freqs.weight"])
    if "rope_factors_long.weight" in factors:
        _longrope(gguf, config, metadata, raw, factors)
    return config


def _gpt_oss_config(metadata: dict):
    """gpt-oss's config from transformers' own key mapping, built here: transformers' reader fails on
    the rope.scaling keys every gpt-oss GGUF holds (it reads each key's length field as its value).
    YaRN's factor, pretrained context and theta come from the file, the rest (no truncation, betas)
    is gpt-oss's default."""
    from transformers import GptOssConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    fields = {attr: metadata[f"gpt-oss.{key}"] for key, attr in GGUF_CONFIG_MAPPING["gpt_oss"].items()
              if attr and f"gpt-oss.{key}" in metadata}
    fields.update({attr: metadata[f"tokenizer.{key}"] for key, attr in GGUF_CONFIG_MAPPING["tokenizer"].items()
                   if f"tokenizer.{key}" in metadata})
    rope = dict(GptOssConfig().rope_parameters)
    rope["rope_theta"] = fields.pop("rope_theta", rope["rope_theta"])
    if metadata.get("gpt-oss.rope.scaling.type") == "yarn":
        rope.update(factor=float(metadata.get("gpt-oss.rope.scaling.factor", rope["factor"])),
                    original_max_position_embeddings=int(metadata.get("gpt-oss.rope.scaling.original_context_length",
                                                                      rope["original_max_position_embeddings"])))
    return GptOssConfig(**fields, rope_parameters=rope)


def _linear_rope(gguf: Path, config, metadata: dict, raw: str) -> None:
    """Linear RoPE scaling (Gemma 3 4B and up: factor 8 on the global layers), from the metadata."""
    factor = metadata.get(f"{raw}.rope.scaling.factor")
    rope = getattr(config, "rope_parameters", None)
    if metadata.get(f"{raw}.rope.scaling.type") != "linear" or not factor or not isinstance(rope, dict):
        return
    target = rope.get("full_attention", rope)  # per layer type (the sliding layers keep theirs), or one for all
    if target.get("rope_type") != "linear":
        log.info("%s: linear RoPE scaling, factor %s, from the GGUF (transformers leaves it unread)", gguf, factor)
        target.update(rope_type="linear", factor=float(factor))


def _rope_tensors(gguf: Path) -> dict[str, list[float]]:
    """The file's RoPE factor tensors (1-D F32, a few dozen values each), by name."""
    from gguf import GGUFReader

    names = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
    return {t.name: t.data.astype("float32").tolist() for t in GGUFReader(str(gguf)).tensors if t.name in names}


def _llama3_rope(gguf: Path, config, divisors: list[float]) -> None:
    """rope_freqs: llama.cpp's divisor of each RoPE frequency, computed from Llama 3.1's scaling.
    Read back as transformers' "llama3" RoPE type (LLAMA3_ROPE, factor = the largest divisor), which
    must give those divisors; other divisors are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        return
    trial = copy.deepcopy(config)
    trial.rope_parameters = {**rope, "rope_type": "llama3", "factor": max(divisors), **LLAMA3_ROPE}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, "cpu")
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    if scaled.shape != plain.shape or not torch.allclose(plain / scaled, torch.tensor(divisors), rtol=1e-4):
        raise CheckpointError(f"{gguf}: its RoPE frequency divisors (rope_freqs) are not Llama 3's RoPE scaling "
                              f"(factor {max(divisors):g}, {LLAMA3_ROPE}), and transformers' GGUF reader drops them; "
                              "give the model's HF directory")
    log.info("%s: Llama 3 RoPE scaling, factor %g, from the GGUF's rope_freqs (transformers drops it)", gguf,
             max(divisors))
    config.rope_parameters = trial.rope_parameters


def _longrope(gguf: Path, config, metadata: dict, raw: str, factors: dict[str, list[float]]) -> None:
    """Phi-3's LongRoPE: long and short factors as tensors, the pretrained context and attention
    factor as metadata (llama.cpp's Phi3MiniModel)."""
    original = metadata.get(f"{raw}.rope.scaling.original_context_length")
    if original is None or "rope_factors_short.weight" not in factors:
        raise CheckpointError(f"{gguf}: it holds LongRoPE factors without rope_factors_short or "
                              f"{raw}.rope.scaling.original_context_length; give the model's HF directory")
    rope = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"], "original_max_position_embeddings": original}
    if metadata.get(f"{raw}.rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = metadata[f"{raw}.rope.scaling.attn_factor"]
    log.info("%s: LongRoPE factors from the GGUF (transformers drops them)", gguf)
    config.rope_parameters.update(rope)
    config.original_max_position_embeddings = original
