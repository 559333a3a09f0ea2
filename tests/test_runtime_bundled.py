"""The bundled SmolLM2-135M through qtk's runtime against transformers (the referee) on the same
weights: float, RTN w8a16 and default-recipe w4a16 checkpoints; plain, and with prefix caching,
prefill chunks of 16 tokens and a pool so small that sequences are preempted and recomputed.

Greedy tokens must agree; where they part, it must be a near-tie as vLLM's check_logprobs_close
accepts one (each side's token among the other's top 5), and the comparison stops there."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves falling.",
             "Explain in one sentence why the sky is blue, for a child.", "Name three primary colors."]
NEW = 24


@pytest.fixture(scope="module")
def checkpoints(bundled_dir, tmp_path_factory):
    """name -> model dir: the float weights, an RTN w8a16 and a default-recipe w4a16 checkpoint
    (calibrated on 4 x 128 tokens to keep the suite fast)."""
    from click.testing import CliRunner

    from qtk.cli import main

    root = tmp_path_factory.mktemp("bundled-ckpts")
    dirs = {"float": bundled_dir}
    for name, args in {"w8a16": ["--method", "rtn", "--scheme", "w8a16"],
                       "w4a16": ["--num-samples", "4", "--seq-len", "128"]}.items():
        r = CliRunner().invoke(main, ["quantize", str(bundled_dir), *args, "-o", str(root / name)])
        assert r.exit_code == 0, r.output
        dirs[name] = root / name
    return dirs


def compare_greedy(outs, ref) -> int:
    """Tokens that agree exactly; asserts that any parting is a near-tie."""
    agreed = 0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, output_scores=True, return_dict_in_generate=True)
        want = hf.sequences[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        assert len(got) == NEW
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                assert b in out.outputs[0].logprobs[i] and a in hf.scores[i][0].topk(5).indices.tolist(), (i, a, b)
                break
            agreed += 1
    return agreed


@pytest.mark.parametrize("weights", ["float", "w8a16", "w4a16"])
def test_bundled_greedy_matches_transformers(checkpoints, weights):
    from qtk import LLM, SamplingParams
    from qtk.loading import load_model

    ref, _ = load_model(str(checkpoints[weights]), dtype=torch.float32)
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, logprobs=5)
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    plain = LLM(str(checkpoints[weights]), dtype="float32", max_model_len=512, kv_cache_memory=2**27)
    agreed = compare_greedy(plain.chat(convs, params), ref)
    assert agreed >= 0.75 * NEW * len(QUESTIONS), agreed
    kv_bytes = plain.kv_dtype.itemsize  # "auto": bf16 where the CPU multiplies the bf16 checkpoint's prefills in bf16
    del plain
    # the shared system prompt is a cached prefix; 16-token prefill chunks; a pool of 160 tokens
    # for 4 sequences of ~60: preempted and recomputed
    per_token = 2 * 30 * 3 * 64 * kv_bytes
    tight = LLM(str(checkpoints[weights]), dtype="float32", max_model_len=160, kv_cache_memory=160 * per_token,
                max_num_batched_tokens=16, block_size=16, enable_prefix_caching=True)
    outs = tight.chat(convs, params)
    assert tight.scheduler.num_preemptions > 0 and tight.block_manager.prefix_hits > 0
    assert compare_greedy(outs, ref) >= 0.75 * NEW * len(QUESTIONS)
