"""Readers for the deployed families (issue 28, part 5): GGUF files, and GPTQ / AWQ hub checkpoints.

GGUF: a tiny random model of each family written as llama.cpp's converter writes it (tests/ggufs.py:
its names, q/k permutation, Gemma's w + 1 norms, stacked experts; F32, F16 or Q8_0 weights) goes
through qtk's reader (qtk/loading.py: transformers dequantizes it once into a bf16 HF directory) and
must compute what the source model computes with its weights rounded as the file and the bf16
directory round them. Families transformers has no GGUF mapping for are refused in one line.

GPTQ / AWQ: each Linear of a tiny model (every expert's projections included, routers float)
quantized to 4 bits, g32, and packed as AutoGPTQ / GPTQModel (v1 and v2) and AutoAWQ (gemm) pack
it, under the hub's names (Mixtral's block_sparse_moe.experts.N.w1): qtk's checkpoint loader must
compute what the model with the dequantized weights computes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import ggufs
from interop import byte_tokenizer
from qtk import moe
from qtk.errors import CheckpointError
from zoo import tiny

IDS = torch.tensor([[1, 17, 200, 33, 95, 4, 250, 61, 128, 7, 42, 180]])

# model_type -> overrides: what the GGUF metadata carries (transformers reads no sliding-window
# layout for llama / qwen2 / starcoder2 GGUFs, Gemma 3's comes from its default pattern, Qwen3-MoE's
# llama.cpp always renormalizes the top-k); Gemma's embeddings are tied, as in every Gemma GGUF
GGUF_FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "qwen3": {},
    "gemma2": dict(tie_word_embeddings=True),
    "gemma3_text": dict(layer_types=None, tie_word_embeddings=True),
    "phi3": {},
    "starcoder2": dict(sliding_window=None),
    "nemotron": {},
    "qwen2_moe": {},
    "qwen3_moe": dict(norm_topk_prob=True),
}

# transformers reads a 'llama' GGUF as Mistral only when general.name is exactly "mistral": Mistral's
# GGUFs become Llama, the same function where there is no sliding window (Mistral v0.2 on)
GGUF_CLASS = {"mistral": "LlamaForCausalLM"}

# model_type -> the one line qtk refuses its GGUF with
GGUF_REFUSED = {
    "olmo2": "has no GGUF mapping for architecture 'olmo2'",
    "granite": "has no GGUF mapping for architecture 'granite'",
    "mixtral": "its 4 experts per block have no GGUF mapping for 'llama'",
    "gpt_oss": "GptOssForCausalLM from this GGUF but 10 of its weights are not in the file",
}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """GGUF conversions in the test's own cache (the CPU kernels stay where they are built once)."""
    from qtk import loading

    monkeypatch.setattr(loading, "cache_dir", lambda: tmp_path / "cache")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits.float()


# --- GGUF ------------------------------------------------------------------------------------

def _as_stored(model, dtype: str):
    """The model with its weights rounded as the GGUF (`dtype` for 2-D weights) and then the bf16
    conversion store them."""
    import gguf

    with torch.no_grad():
        for p in model.parameters():
            w = p.data
            if w.dim() >= 2 and dtype == "F16":
                w = w.half().float()
            elif w.dim() >= 2 and dtype == "Q8_0":  # blocks of 32 along the last (input) dim
                q8 = gguf.GGMLQuantizationType.Q8_0
                w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), q8), q8).copy())
            p.data = w.bfloat16().float()
    return model


def _gguf(model_type: str, tmp_path: Path, dtype: str = "F32") -> tuple[nn.Module, Path]:
    model = tiny(model_type, **GGUF_FAMILIES.get(model_type, {}))
    return model, ggufs.write(model, tmp_path / f"{model_type}.gguf", dtype)


@pytest.mark.parametrize("dtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_a_gguf_of_the_family_reads_as_its_model(model_type, dtype, tmp_path):
    from qtk.loading import load_model

    model, path = _gguf(model_type, tmp_path, dtype)
    ref = _logits(_as_stored(model, dtype))
    loaded, tok = load_model(str(path))
    assert type(loaded).__name__ == GGUF_CLASS.get(model_type, type(model).__name__)
    assert tok("GGUF,read")["input_ids"] == byte_tokenizer()("GGUF,read")["input_ids"]  # Gemma's builder: no spaces
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_an_f16_gguf_reads_as_its_model(model_type, tmp_path):
    from qtk.loading import load_model

    model, path = _gguf(model_type, tmp_path, "F16")
    torch.testing.assert_close(_logits(load_model(str(path))[0]), _logits(_as_stored(model, "F16")), rtol=0, atol=2e-4)


@pytest.mark.parametrize("model_type", sorted(GGUF_REFUSED))
def test_a_gguf_transformers_cannot_map_is_refused_in_one_line(model_type, tmp_path):
    from qtk.loading import resolve

    _, path = _gguf(model_type, tmp_path)
    with pytest.raises(CheckpointError, match=GGUF_REFUSED[model_type]) as e:
        resolve(str(path))
    assert "\n" not in str(e.value) and "HF directory" in str(e.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe"])
def test_a_gguf_is_quantized_and_served_like_any_model(model_type, tmp_path):
    """`qtk quantize X.gguf --method gptq` -> the engine serves transformers' logits on the checkpoint."""
    from test_any_decoder import assert_engine_is_transformers, quantize, referee

    _, path = _gguf(model_type, tmp_path, "Q8_0")
    ckpt = quantize(str(path), "gptq", tmp_path / "q")
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == model_type
    assert_engine_is_transformers(ckpt, referee(ckpt, tmp_path))
