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
# llama.cpp always renormalizes the top-k); Gemma's embeddings are tied, as in every Gemma GGUF. Sizes
# and soft-caps other than the config classes' defaults: what transformers leaves unread and qtk reads
GGUF_FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "qwen3": {},
    "gemma2": dict(tie_word_embeddings=True, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(layer_types=None, tie_word_embeddings=True),
    "phi3": {},
    "starcoder2": dict(sliding_window=None),
    "nemotron": {},
    "qwen2_moe": {},
    "qwen3_moe": dict(norm_topk_prob=True),
    "mixtral": {},  # written as 'llama' with experts: read by qtk (gguf_moe), not transformers
    "gpt_oss": {},  # transformers maps its experts onto names its model no longer has: read by qtk
}

# transformers reads a 'llama' GGUF as Mistral only when general.name is exactly "mistral": Mistral's
# GGUFs become Llama, the same function where there is no sliding window (Mistral v0.2 on)
GGUF_CLASS = {"mistral": "LlamaForCausalLM"}

# model_type -> the one line qtk refuses its GGUF with
GGUF_REFUSED = {
    "olmo2": "has no GGUF mapping for architecture 'olmo2'",
    "granite": "has no GGUF mapping for architecture 'granite'",
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

    # experts held [E, in, out] (gpt-oss) are stored [E, out, in]: Q8_0's blocks run along `in`
    transposed = {f"{n}.{p}" for n, m in model.named_modules() if getattr(m, "is_transposed", False)
                  for p in ("gate_up_proj", "down_proj")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = p.data.transpose(-1, -2) if name in transposed else p.data
            kind = ggufs._stored_as(dtype, w.dim())
            if kind == "F16":
                w = w.half().float()
            elif kind != "F32":  # blocks of 32 along the last (input) dim
                qtype = gguf.GGMLQuantizationType[kind]
                w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype).copy())
            p.data = (w.transpose(-1, -2) if name in transposed else w).bfloat16().float()
    return model


def _gguf(model_type: str, tmp_path: Path, dtype: str = "F32") -> tuple[nn.Module, Path]:
    model = tiny(model_type, **GGUF_FAMILIES.get(model_type, {}))
    return model, ggufs.write(model, tmp_path / f"{model_type}.gguf", dtype)


@pytest.mark.parametrize("dtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_a_gguf_of_the_family_reads_as_its_model(model_type, dtype, tmp_path):
    from qtk.loading import load_model

    model, path = _gguf(model_type, tmp_path, dtype)
    ref = _logits(_as_stored(model, dtype))
    loaded, tok = load_model(str(path))
    assert type(loaded).__name__ == GGUF_CLASS.get(model_type, type(model).__name__)
    assert tok("GGUF,read")["input_ids"] == byte_tokenizer()("GGUF,read")["input_ids"]  # Gemma's builder: no spaces
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_a_gguf_with_mxfp4_experts_reads_as_its_model(model_type, tmp_path):
    """gpt-oss's GGUFs hold the experts in MXFP4 (llama.cpp repacks the checkpoint's own)."""
    from qtk.loading import load_model

    model, path = _gguf(model_type, tmp_path, "MXFP4")
    ref = _logits(_as_stored(model, "MXFP4"))
    torch.testing.assert_close(_logits(load_model(str(path))[0]), ref, rtol=0, atol=2e-4)


def test_gemma3s_linear_rope_scaling_is_read_from_the_gguf(tmp_path):
    """Gemma 3 4B and up scale RoPE linearly (factor 8) on their global layers: llama.cpp writes it
    (rope.scaling.type / factor), transformers' GGUF reader does not read it, qtk does."""
    from qtk.loading import load_model

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    model = tiny("gemma3_text", layer_types=None, num_hidden_layers=6, tie_word_embeddings=True,  # 6th global
                 rope_parameters=rope, sliding_window=4)
    path = ggufs.write(model, tmp_path / "gemma3.gguf")
    loaded = load_model(str(path))[0]
    assert loaded.config.rope_parameters == rope
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(loaded, ids), _logits(_as_stored(model, "F32"), ids), rtol=0, atol=2e-4)


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.1's, its theta scaled
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
             "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0],
             "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0]}


@pytest.mark.parametrize("model_type, rope", [("llama", _LLAMA3), ("phi3", _LONGROPE)], ids=["llama3", "longrope"])
def test_rope_scaling_stored_as_tensors_is_read_from_the_gguf(model_type, rope, tmp_path):
    """Llama 3.1+ and Phi-3 128k / Phi-4-mini: llama.cpp stores their RoPE scaling as per-frequency
    tensors (rope_freqs; rope_factors_long / _short), which transformers' GGUF reader drops and qtk
    reads back into the config. Head dim 16 has frequencies in each of llama3's three regimes; 80
    tokens pass LongRoPE's pretrained 64 (its long factors)."""
    from qtk.loading import load_model

    original = dict(original_max_position_embeddings=64) if model_type == "phi3" else {}  # Phi-3's own field too
    model = tiny(model_type, rope_parameters=dict(rope), **original)
    path = ggufs.write(model, tmp_path / f"{model_type}.gguf")
    loaded = load_model(str(path))[0]
    read = loaded.config.rope_parameters
    assert {k: _rounded(read.get(k)) for k in rope} == {k: _rounded(v) for k, v in rope.items()}
    for n in (12, 80):
        ids = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(_logits(loaded, ids), _logits(_as_stored(model, "F32"), ids), rtol=0, atol=2e-4)


def _rounded(v):
    """A config value as float32 stores it, to compare (the factors went through an F32 tensor)."""
    if isinstance(v, list):
        return [round(x, 5) for x in v]
    return round(v, 5) if isinstance(v, float) else v


def test_rope_divisors_that_are_not_llama3s_are_refused(tmp_path):
    import gguf

    from qtk.loading import load_model

    model = tiny("llama", rope_parameters=dict(_LLAMA3))
    path = ggufs.write(model, tmp_path / "llama.gguf")
    # the same file with other divisors: a scaling transformers has no RoPE type for
    reader = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    t.data[:] = t.data[::-1].copy()
    reader.data.flush()
    with pytest.raises(CheckpointError, match=r"its RoPE frequency divisors \(rope_freqs\) are not Llama 3's"):
        load_model(str(path))


@pytest.mark.parametrize("model_type", sorted(GGUF_REFUSED))
def test_a_gguf_transformers_cannot_map_is_refused_in_one_line(model_type, tmp_path):
    from qtk.loading import resolve

    _, path = _gguf(model_type, tmp_path)
    with pytest.raises(CheckpointError, match=GGUF_REFUSED[model_type]) as e:
        resolve(str(path))
    assert "\n" not in str(e.value) and "HF directory" in str(e.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_a_gguf_transformers_keeps_packed_is_refused_in_one_line(tmp_path):
    """transformers' newer GGUF path (qwen35, qwen35moe, lfm2) keeps the weights in its packed GGUF
    modules: nothing qtk can quantize (and hybrid models, which qtk does not run)."""
    import gguf

    from qtk.loading import resolve

    w = gguf.GGUFWriter(str(tmp_path / "qwen35.gguf"), "qwen35")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"reads 'qwen35' GGUFs into its packed GGUF modules, not the plain "
                                              r"weights qtk quantizes; give the model's HF directory"):
        resolve(str(tmp_path / "qwen35.gguf"))


def test_a_mixtral_gguf_in_the_per_expert_layout_is_refused_in_one_line(tmp_path):
    """llama.cpp's first Mixtral files (early 2024) held each expert as its own tensor, blk.N.ffn_gate.E."""
    from qtk.loading import resolve

    path = ggufs.write(tiny("mixtral"), tmp_path / "mixtral.gguf", per_expert=True)
    with pytest.raises(CheckpointError, match=r"mixtral.gguf: read as MixtralForCausalLM, but .* is not in the "
                                              r"file \(llama.cpp's per-expert layout of early 2024") as e:
        resolve(str(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe", "mixtral", "gpt_oss"])
def test_a_gguf_is_quantized_and_served_like_any_model(model_type, tmp_path):
    """`qtk quantize X.gguf --method gptq` -> the engine serves transformers' logits on the checkpoint."""
    from test_any_decoder import assert_engine_is_transformers, quantize, referee

    _, path = _gguf(model_type, tmp_path, "Q8_0")
    ckpt = quantize(str(path), "gptq", tmp_path / "q")
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == model_type
    assert_engine_is_transformers(ckpt, referee(ckpt, tmp_path))


# --- GPTQ / AWQ hub checkpoints ----------------------------------------------------------------

GROUP = 32
HUB_DENSE = ["gemma2", "gemma3_text", "phi3", "olmo2", "granite", "qwen3", "starcoder2", "nemotron", "cohere"]
HUB_MOE = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "phimoe", "granitemoe", "gpt_oss"]
# format -> (quantization_config, symmetric)
HUB_FORMATS = {
    "gptq_v1_sym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False}, True),
    "gptq_v2_asym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": False,
                      "checkpoint_format": "gptq_v2"}, False),
    "awq_gemm": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}, False),
}


def _rtn(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit g32 round-to-nearest of w [N, K]: (unsigned codes [N, K], zeros [G, N], fp16 scales [G, N])."""
    g = w.reshape(w.shape[0], -1, GROUP)  # [N, G, 32]
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-5).half()
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-5).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).long()
    q = (g / scale.float()[..., None]).round() + zero[..., None]
    return q.clamp(0, 15).long().reshape(w.shape), zero.t(), scale.t()


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 tensors the checkpoints hold (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _words(fields: torch.Tensor) -> torch.Tensor:
    """[.., 8] 4-bit fields -> int32 words, field j at bits 4j."""
    return _int32((fields.long() << (4 * torch.arange(8))).sum(-1))


def _gptq(q, zero, scale, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ / GPTQModel: qweight [K/8, N] packed along K, qzeros [G, N/8] along N, g_idx [K];
    v1 stores zero - 1 as GPTQModel writes it: the v2 word - 0x11111111 (a zero of 0 borrows)."""
    n, k = q.shape
    qzeros = _words(zero.reshape(zero.shape[0], n // 8, 8))
    if v1:
        qzeros = _int32(qzeros.long() - 0x11111111)
    return {"qweight": _words(q.t().reshape(k // 8, 8, n).transpose(1, 2)), "qzeros": qzeros, "scales": scale,
            "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: word c's field j holds output 8c + AWQ_ORDER[j]


def _awq(q, zero, scale) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm: qweight [K, N/8] and qzeros [G, N/8], both packed along N in AWQ_ORDER."""
    n, k = q.shape
    order = list(AWQ_ORDER)
    return {"qweight": _words(q.t().reshape(k, n // 8, 8)[..., order]),
            "qzeros": _words(zero.reshape(zero.shape[0], n // 8, 8)[..., order]), "scales": scale}


def _hub_checkpoint(model_type: str, fmt: str, d: Path, model: nn.Module | None = None, hub_name=moe.hub_name,
                    skip=()) -> nn.Module:
    """A GPTQ / AWQ checkpoint of tiny(model_type) (or `model`) in `d`, every Linear but lm_head, the
    routers and `skip` quantized, named by `hub_name`; returns the model holding the dequantized
    weights (experts per expert)."""
    qc, symmetric = HUB_FORMATS[fmt]
    model = model if model is not None else tiny(model_type)
    moe.linearize_experts(model)  # the per-expert Linears GPTQModel / AutoAWQ quantize
    skip = {"lm_head", *moe.router_names(model), *skip}
    state = {k: v for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    for name, lin in model.named_modules():
        if not isinstance(lin, nn.Linear) or name in skip:
            continue
        q, zero, scale = _rtn(lin.weight.data, symmetric)
        del state[f"{name}.weight"]
        v1 = "checkpoint_format" not in qc
        packed = _awq(q, zero, scale) if qc["quant_method"] == "awq" else _gptq(q, zero, scale, v1)
        state.update({f"{name}.{k}": v for k, v in packed.items()})
        g = scale.float().t().repeat_interleave(GROUP, dim=1)  # [N, K]
        lin.weight.data = g * (q - zero.t().repeat_interleave(GROUP, dim=1)).float()
    d.mkdir()
    save_file({hub_name(model_type, k): v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(d)
    return model


@pytest.mark.parametrize("fmt", sorted(HUB_FORMATS))
@pytest.mark.parametrize("model_type", HUB_DENSE + HUB_MOE)
def test_a_hub_gptq_or_awq_checkpoint_of_the_family_loads(model_type, fmt, tmp_path):
    from qtk.checkpoint import load_quantized
    from qtk.quant_linear import QuantLinear

    ref = _hub_checkpoint(model_type, fmt, tmp_path / "hub")
    loaded = load_quantized(tmp_path / "hub")
    quantized = {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    linears = {n for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
    assert quantized == linears - {"lm_head", *moe.router_names(ref)}  # every expert, no router
    torch.testing.assert_close(_logits(loaded), _logits(ref), rtol=0, atol=1e-4)


# transformers 5's Gemma3ForConditionalGeneration names -> transformers 4's, which every hub checkpoint has
_V4_NAMES = ((r"^model\.language_model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
             (r"^model\.vision_tower\.", "vision_tower.vision_model."),
             (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


def _v4_name(model_type: str, name: str) -> str:
    import re

    for pattern, old in _V4_NAMES:
        name = re.sub(pattern, old, name)
    return name


@pytest.mark.parametrize("fmt", ["gptq_v1_sym", "awq_gemm"])
def test_a_multimodal_gemma3_hub_checkpoint_saved_by_transformers_4_loads(fmt, tmp_path, monkeypatch):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: their hub GPTQ / AWQ checkpoints name
    the text model language_model.model.layers.N (transformers 4), which transformers 5 renames on
    loading and so does qtk. The text Linears quantized, the vision tower float, as GPTQModel does.
    Without transformers' apply_renamings, which transformers 5.17 lacks (the H200 image's)."""
    import transformers.core_model_loading
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Gemma3Config

    from qtk.checkpoint import load_quantized

    monkeypatch.delattr(transformers.core_model_loading, "apply_renamings", raising=False)

    torch.manual_seed(0)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    model = AutoModelForCausalLM.from_config(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                          image_token_index=255, boi_token_index=253,
                                                          eoi_token_index=254)).eval()
    vision_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "language_model" not in n]
    ref = _hub_checkpoint("gemma3", fmt, tmp_path / "hub", model=model, hub_name=_v4_name, skip=vision_linears)
    with safe_open(str(tmp_path / "hub" / "model.safetensors"), "pt") as f:
        assert "language_model.model.layers.0.self_attn.q_proj.qweight" in f.keys()
    torch.testing.assert_close(_logits(load_quantized(tmp_path / "hub")), _logits(ref), rtol=0, atol=1e-4)


def test_experts_packed_in_an_unknown_layout_are_named(tmp_path):
    """Quantized experts under names no Linear of the model has (here one gate_up per expert, as a
    tool fusing gate and up would write them) are refused in one line naming one of them."""
    from safetensors.torch import load_file

    from qtk.checkpoint import load_quantized

    _hub_checkpoint("qwen3_moe", "gptq_v2_asym", tmp_path / "hub")
    f = tmp_path / "hub" / "model.safetensors"
    t = {k.replace(".experts.0.gate_proj.", ".experts.gate_up.0."): v for k, v in load_file(str(f)).items()}
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"2 quantized layers are no Linear of the qwen3_moe model the config "
                                              r"describes, e\.g\. model\.layers\.0\.mlp\.experts\.gate_up\.0;") as e:
        load_quantized(tmp_path / "hub")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type, fmt", [("gemma2", "gptq_v1_sym"), ("phi3", "awq_gemm"),
                                             ("mixtral", "awq_gemm"), ("qwen3_moe", "gptq_v2_asym")])
def test_the_engine_serves_a_hub_checkpoint_as_transformers_runs_its_weights(model_type, fmt, tmp_path):
    """The checkpoint through qtk's engine (chunked prefill beside decodes) against transformers on
    the dequantized weights: prompt and sampled logprobs, greedy tokens."""
    from test_any_decoder import assert_engine_is_transformers

    ref = _hub_checkpoint(model_type, fmt, tmp_path / "hub")
    assert_engine_is_transformers(tmp_path / "hub", ref)
