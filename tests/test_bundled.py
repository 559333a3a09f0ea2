"""End to end on the bundled SmolLM2-135M (slow: loads the model, scores 2 x 512 tokens).

Numbers measured on CPU, float32, builtin evaluation split, 2 windows of 512 tokens
(1022 scored): baseline ppl 17.93, RTN w4a16 g64 29.26 (g32: 24.68).
"""
from __future__ import annotations

import copy

import pytest
import torch

from qtk.calibrate import checkpoint_groups, quantize_model
from qtk.checkpoint import load_quantized, save_quantized
from qtk.evals.perplexity import eval_windows, perplexity
from qtk.recipe import from_flags
from qtk.quant_linear import QuantLinear

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def windows(bundled_model):
    _, tok = bundled_model
    return eval_windows(tok, "builtin", seq_len=512, limit=2)


@pytest.fixture(scope="module")
def baseline(bundled_model, windows):
    return perplexity(bundled_model[0], windows, progress=False)


@pytest.fixture(scope="module")
def rtn_g64(bundled_model):
    model = copy.deepcopy(bundled_model[0])
    recipe = from_flags("rtn", scheme="w4a16", group_size=64)
    report = quantize_model(model, recipe, progress=False)
    return model, recipe, report


def test_baseline_ppl(baseline):
    assert (baseline.windows, baseline.seq_len, baseline.scored_tokens) == (2, 512, 1022)
    assert baseline.ppl == pytest.approx(17.93, rel=0.01)


def test_rtn_w4a16_g64_ppl(rtn_g64, windows, baseline):
    model, _, report = rtn_g64
    assert len(report["layers"]) == 30 * 7
    errs = list(report["layers"].values())
    assert 0.10 < sum(errs) / len(errs) < 0.125 and max(errs) < 0.16  # measured 0.1136 mean, 0.139 max
    res = perplexity(model, windows, progress=False)
    assert res.scored_tokens == 1022
    assert baseline.ppl * 1.3 < res.ppl < baseline.ppl * 2  # measured 26.44 = 1.47x
    assert res.ppl == pytest.approx(26.44, rel=0.03)  # scale absmax/7.5, stored bf16 (round to nearest)


def test_group_128_refused_on_576_inputs(bundled_model):
    with pytest.raises(ValueError, match=r"group size 128 does not divide the input size of 180 layer\(s\): "
                                         r"model.layers.0.self_attn.q_proj \(in_features=576\).* use --group-size 64"):
        quantize_model(bundled_model[0], from_flags("rtn"), progress=False)
    assert not any(isinstance(m, QuantLinear) for m in bundled_model[0].modules())


def test_checkpoint_round_trip_tied(rtn_g64, tmp_path):
    model, recipe, _ = rtn_g64
    groups, ignore = checkpoint_groups(model, recipe)
    assert ignore == ["lm_head"]
    out = save_quantized(model, None, tmp_path / "ck", groups, ignore, None, dtype=torch.float32)
    loaded = load_quantized(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
