"""vLLM's CPU build loads qtk's checkpoints of the bundled model and agrees with qtk's runtime
(benchmarks/vllm_referee.py): perplexity on the same windows within 1%, greedy tokens equal up to
a near-tie (check_logprobs_close); vLLM's parser gives every layer it builds (qkv_proj, gate_up_proj
fused) the scheme its shards were written in. Where vLLM refuses a scheme, its reason is what is checked.

Opt-in (QTK_VLLM_REFEREE=1): vLLM takes minutes per model to start, and its venv (a few GB,
scripts/peer_env.sh vllm) is built on first use. Recorded figures: benchmarks/results/vllm_referee.json.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("QTK_VLLM_REFEREE") != "1",
                                 reason="opt-in: QTK_VLLM_REFEREE=1 runs vLLM (minutes per checkpoint)")]

REFEREE = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_referee.py"


@pytest.fixture(scope="module")
def referee_module():
    spec = importlib.util.spec_from_file_location("vllm_referee", REFEREE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(referee_module, bundled_dir, tokenizer, tmp_path_factory):
    dirs = referee_module.quantize_all(tmp_path_factory.mktemp("referee"), bundled_dir)
    return dirs, referee_module.inputs(tokenizer)


W8A8_GAP = pytest.mark.xfail(strict=True, reason=(
    "vLLM 0.32's CPU W8A8 path scores 3.9% above qtk (14.996 against 14.429 on 4 x 1024 tokens), and "
    "3.7% above compressed-tensors' own fake-quant forward (14.463, transformers 5.17): vLLM departs "
    "from the format here, qtk does not (benchmarks/results/vllm_referee.md). Strict: a fixed vLLM fails this"))


@pytest.mark.parametrize("name", ["float", "w4a16", "w4a16_asym", "mixed", pytest.param("w8a8", marks=W8A8_GAP), "fp8"])
def test_vllm_serves_what_qtk_writes(referee_module, setup, name):
    dirs, (windows, prompts) = setup
    res = referee_module.referee(dirs[name], windows, prompts)
    assert res["vllm_scheme_mismatches"] == [], res  # vLLM's parser reads every layer in the scheme written
    if "vllm_refused" in res:
        assert name != "float", res["vllm_refused"]  # the unquantized model must load
        assert res["vllm_refused"].strip()  # vLLM's own reason, recorded
        pytest.skip(f"vLLM refuses {name} here: {res['vllm_refused'][:300]}")
    assert res["ppl_rel_diff"] < 0.01, res
    assert all(p["near_tie"] for p in res["greedy"]), res["greedy"]
