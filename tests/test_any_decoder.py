"""Any transformers decoder, end to end, as a user runs it: a tiny random model of each type of
tests/zoo.py is quantized by `qtk quantize`'s pipeline (rtn, gptq; awq and smoothquant where the
type has smoothing pairs), written as a compressed-tensors checkpoint, and served by qtk's engine
with chunked prefills beside decodes. The referee is not qtk: compressed-tensors dequantizes the
checkpoint and transformers loads those weights by its own loader (MoE experts included, by the
hub's names) and computes the logits. The engine's prompt logprobs, its sampled tokens' logprobs
and its greedy tokens must be transformers' on those weights.

The fast set covers every family of the issue and a long tail; the whole zoo with every method is
marked slow.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from interop import ct_dequantize
from zoo import ZOO, saved, tiny

# types run by default (rtn and gptq each): the families of issue 28 and a long tail
FAST = ["llama", "mistral", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "olmo2", "granite",
        "cohere", "cohere2", "glm4", "starcoder2", "gpt_neox", "helium", "exaone4", "nemotron", "ernie4_5", "seed_oss",
        "persimmon", "mixtral", "qwen3_moe", "gpt_oss", "olmoe"]
PROMPT_LENGTHS = (13, 5)  # with an 8-token budget the long one is prefilled in chunks beside decodes
NEW_TOKENS = 6
TOL = 2e-4  # float32 logprobs, two implementations of the same function


def quantize(src: str, method: str, out: Path) -> Path:
    from qtk import pipeline
    from qtk.recipe import CalibrationArgs, from_flags

    recipe = from_flags(method, group_size=16, calibration=CalibrationArgs(num_samples=4, seq_len=32))
    pipeline.quantize(src, recipe, out, dtype=torch.float32, progress=False)
    return out


def referee(ckpt: Path, tmp: Path):
    """transformers' model on compressed-tensors' dequantization of the checkpoint's weights, loaded
    by transformers' own loader (which turns the hub's per-expert names into its 3-D experts). Where
    the hub stores experts 3-D only (gpt-oss, GraniteMoE: transformers reads no per-expert names),
    the dequantized experts go into qtk's per-expert module in transformers' model (qtk.moe, held
    equal to transformers' experts forward by tests/test_moe.py)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from qtk.moe import HUB, linearize_experts, model_tensors

    weights = ct_dequantize(ckpt)
    d = tmp / "dequantized"
    d.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (d / "config.json").write_text(json.dumps(config))
    if config["model_type"] in HUB and HUB[config["model_type"]].fused:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
        linearize_experts(model)
        model.load_state_dict(model_tensors(model, weights), strict=not model.config.tie_word_embeddings)
        return model.eval()
    save_file({k: v.contiguous() for k, v in weights.items()}, d / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    return model.eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def assert_engine_is_transformers(ckpt: Path, ref, model_impl: str = "auto") -> None:
    """The engine's float32 path against transformers' float32 (QTK_CPU_BF16=0: the checkpoints qtk writes
    are bf16, whose prefill and KV cache a CPU with bf16 units runs in bf16, held to this path within bf16
    rounding by tests/test_prefill_paths.py)."""
    from qtk import LLM, SamplingParams

    with mock.patch.dict(os.environ, {"QTK_CPU_BF16": "0"}):
        llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=8,
                  model_impl=model_impl)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    for p, out in zip(prompts(), llm.generate(prompts(), params)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            lp = ref(torch.tensor([p + tokens])).logits[0].float().log_softmax(-1)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert abs(entry[p[i]] - lp[i - 1, p[i]].item()) < TOL, f"prompt position {i}"
        for j, (t, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert abs(entry[t] - lp[len(p) - 1 + j, t].item()) < TOL, f"generated token {j}"
        assert tokens == lp[len(p) - 1:-1].argmax(-1).tolist()


def check(model_type: str, method: str, tmp_path: Path, model_impl: str = "auto") -> None:
    src = saved(tiny(model_type), tmp_path / "src")
    ckpt = quantize(src, method, tmp_path / "q")
    assert_engine_is_transformers(ckpt, referee(ckpt, tmp_path), model_impl)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("model_type", FAST)
def test_quantized_checkpoint_serves_transformers_logits(model_type, method, tmp_path):
    check(model_type, method, tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_the_generic_path_serves_a_native_family_checkpoint_as_the_native_one(model_type, tmp_path):
    """The same GPTQ checkpoint through model_impl "transformers" (the native path ran above)."""
    check(model_type, "gptq", tmp_path, model_impl="transformers")


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3", "cohere", "gpt_neox", "qwen3_moe"])
def test_awq_checkpoints_of_other_families(model_type, tmp_path):
    """AWQ's scales folded by each family's pairs (Gemma's (1 + w) norms, Phi-3's fused projections,
    Cohere's parallel block, GPT-NeoX's LayerNorm with bias, an MoE's attention and experts)."""
    check(model_type, "awq", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_every_zoo_type_and_method(model_type, method, tmp_path):
    """The whole zoo; AWQ where the type has smoothing pairs (else its one-line error)."""
    from qtk.errors import InputError

    try:
        check(model_type, method, tmp_path)
    except InputError as e:
        assert method == "awq" and "gptq" in str(e).lower(), e
        pytest.skip(f"{model_type} has no AWQ pairs: {e}")


GATES = """
gates:
  ppl: {task: ppl, args: {seq_len: 64, limit: 2}, max_increase_pct: 25}
"""


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe"])
def test_the_cli_end_to_end(model_type, tmp_path):
    """What a user runs, on a native dense family and an MoE one: `qtk quantize` (GPTQ; every expert a
    layer of its own, the router float), `qtk inspect`, `qtk generate` (the engine's greedy text),
    `qtk eval` against the float model under a gates file (exit 0). The engine's agreement with
    transformers is the tests above (float32 checkpoints: the CLI's bf16 scales would make the
    referee's dequantized weights round to bf16 where qtk's do not)."""
    from click.testing import CliRunner

    from qtk import LLM, SamplingParams
    from qtk.cli import main

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    src = saved(tiny(model_type), tmp_path / "src")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "q"
    r = run("quantize", src, "--method", "gptq", "--group-size", 16, "--dataset", text, "--num-samples", 4,
            "--seq-len", 32, "-o", out)
    assert r.exit_code == 0, r.output
    info = json.loads(run("inspect", out, "--json").stdout)
    layers = info["layers"]
    assert len(layers) == 14 + (24 - 6 if model_type == "qwen3_moe" else 0), sorted(layers)
    if model_type == "qwen3_moe":  # 2 layers x 4 experts x 3 projections, under the hub's names
        assert sum(".mlp.experts." in n for n in layers) == 24 and not any(n.endswith("mlp.gate") for n in layers)
    r = run("generate", out, "--prompt", "hi", "--max-tokens", 6, "--dtype", "float32")
    assert r.exit_code == 0, r.output
    llm = LLM(str(out), dtype="float32", kv_cache_memory=2**22)
    said = llm.generate("hi", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    assert r.stdout == said + "\n"
    gates = tmp_path / "gates.yaml"
    gates.write_text(GATES)
    r = run("eval", out, "--baseline", src, "--gates", gates, "--dtype", "float32", "--no-cache")
    assert r.exit_code == 0, r.output
