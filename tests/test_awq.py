"""AWQ: exact folding, a search that never loses to identity, the GQA skip, and end to end vs RTN."""
import copy
import dataclasses

import pytest
import torch
from torch import nn

from qtk.arch import discover
from qtk.calibrate import Block, capture_inputs, quantize_model
from qtk.methods import METHODS, awq
from qtk.methods.args import AWQArgs
from qtk.methods.fold import fold_scale, folds
from qtk.recipe import from_flags
from qtk.schemes import preset

from outliers import ids, logits, tiny_llama


def blocks(model, recipe, calib):
    """The driver's Blocks for each layer, on float inputs (for tests that smooth only)."""
    arch = discover(model)
    inputs = capture_inputs(model, arch, calib, torch.device("cpu"), 8)
    for i, layer in enumerate(model.get_submodule(arch.layers)):
        yield Block(i, f"{arch.layers}.{i}", layer, arch, inputs, torch.device("cpu"), arch.linears[i])


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_fold_scale_is_exact(kv_heads):
    model = tiny_llama(kv_heads)
    ref = logits(model, ids(2, 1))
    recipe = from_flags("awq", scheme="w4a16_asym", group_size=32)
    folded = 0
    for block in blocks(model, recipe, ids(4, 0)):
        for pair in block.pairs:
            if folds(block, pair):
                n = block.linear(pair.linears[0]).in_features
                fold_scale(block, pair, torch.rand(n, generator=torch.Generator().manual_seed(n)) * 4 + 0.25)
                folded += 1
    assert folded == (8 if kv_heads == 4 else 6)  # v -> o folds only without GQA
    torch.testing.assert_close(logits(model, ids(2, 1)), ref, atol=1e-4, rtol=1e-4)


def test_awq_smoothing_alone_keeps_logits(monkeypatch):
    """The driver with AWQ's scales (clip off) and no weight quantizer computes the same function."""
    model = tiny_llama(outlier=50.0)
    float_model = copy.deepcopy(model)
    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=lambda block, recipe: None))
    recipe = from_flags("awq", scheme="w4a16_asym", group_size=32, awq=AWQArgs(clip=False))
    quantize_model(model, recipe, ids(16, 0), progress=False)
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, float_model.model.layers[0].input_layernorm.weight)  # a scale was chosen
    torch.testing.assert_close(logits(model, ids(2, 1)), logits(float_model, ids(2, 1)), atol=1e-4, rtol=1e-4)


def test_gqa_skips_v_to_o():
    model = tiny_llama(kv_heads=2)
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    recipe = from_flags("awq", scheme="w4a16_asym", group_size=32, awq=AWQArgs(clip=False))
    block = next(blocks(model, recipe, ids(8, 0)))
    v_to_o = next(p for p in block.pairs if p.prev == "self_attn.v_proj")
    assert not folds(block, v_to_o)  # v_proj out 32 = 2 kv heads x 16, o_proj in 64
    awq.smooth_block(block, recipe)
    assert torch.equal(block.linear("self_attn.o_proj").weight, o_before)


def outlier_linear(seed=0):
    """A Linear whose input channel 3 is 30x larger than the others."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g) * 0.1)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 30
    return lin, x


def test_search_beats_identity_and_scales_the_outlier_up():
    lin, x = outlier_linear()
    args = preset("w4a16", 32).weights
    w = {"fc": lin.weight.detach()}
    loss = awq.gram_loss(w, x.T @ x, len(x))
    s, best, identity = awq.search_scale(x.abs().mean(0), awq.weight_mean([w["fc"]], 32), w, args, loss)
    assert best < 0.7 * identity
    assert s[3] > 2 * s.median()
    # the Gram loss is the output MSE of the linear
    w_hat = awq.fake_quant(w["fc"] * s, args) / s
    assert loss({"fc": w_hat}) == pytest.approx(((x @ w_hat.T - x @ w["fc"].T) ** 2).mean().item(), rel=1e-3)


def test_search_keeps_identity_when_no_scale_helps():
    lin, x = outlier_linear()
    args = preset("w4a16", 32).weights
    w = {"fc": lin.weight.detach()}
    identity_hat = awq.fake_quant(w["fc"], args)
    only_identity = lambda w_hats: 0.0 if torch.equal(w_hats["fc"], identity_hat) else 1.0  # noqa: E731
    s, best, identity = awq.search_scale(x.abs().mean(0), awq.weight_mean([w["fc"]], 32), w, args, only_identity)
    assert torch.equal(s, torch.ones(64)) and best == identity == 0.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_lowers_the_output_error(symmetric):
    lin, x = outlier_linear()
    args = preset("w4a16" if symmetric else "w4a16_asym", 32).weights
    w = lin.weight.detach()
    w[0, 7] = 2.0  # a weight outlier that stretches its group's grid
    clipped = awq.clip_weight(w, x.T @ x, args)
    err = lambda w_hat: ((x @ w_hat.T - x @ w.T) ** 2).mean().item()  # noqa: E731
    assert err(awq.fake_quant(clipped, args)) < err(awq.fake_quant(w, args))
    assert (clipped.abs() <= w.abs() + 1e-7).all()
    gram = x.T @ x  # no row's whole output error grows (the group search alone leaves out cross terms)
    assert (awq.row_error(clipped, w, gram, args) <= awq.row_error(w, w, gram, args)).all()


@pytest.mark.parametrize("outlier,ratio", [(1.0, 1.0), (10.0, 0.8)])
def test_awq_end_to_end_beats_rtn(outlier, ratio):
    """Held-out logits of AWQ w4a16_asym g32 are closer to float than RTN's (by `ratio` in MSE)."""
    model = tiny_llama(outlier=outlier)
    calib, held_out = ids(16, 0), ids(4, 99)
    ref = logits(model, held_out)
    errors = {}
    for method in ("rtn", "awq"):
        m = copy.deepcopy(model)
        quantize_model(m, from_flags(method, scheme="w4a16_asym", group_size=32), calib, progress=False)
        errors[method] = (logits(m, held_out) - ref).pow(2).mean().item()
    assert errors["awq"] < ratio * errors["rtn"], errors


def test_coarse_search_finds_the_grids_best_with_fewer_losses():
    """Coarse to fine (every 4th ratio, then around the best) picks what trying all 20 picks on a
    loss with one wide valley (the outlier linear's output MSE: its minimum at r = 0.3, one small
    bump at r = 0.1), in 11 losses (+ the identity's)."""
    lin, x = outlier_linear()
    args = preset("w4a16", 32).weights
    w = {"fc": lin.weight.detach()}
    gram = awq.gram_loss(w, x.T @ x, len(x))
    calls = []

    def loss(w_hats):
        calls.append(1)
        return gram(w_hats)

    x_mean, w_mean = x.abs().mean(0), awq.weight_mean([w["fc"]], 32)
    s_all, best_all, _ = awq.search_scale(x_mean, w_mean, w, args, loss, grid=20, coarse=1)
    assert len(calls) == 21
    calls.clear()
    s, best, _ = awq.search_scale(x_mean, w_mean, w, args, loss, grid=20, coarse=4)
    assert len(calls) <= 12 and torch.equal(s, s_all) and best == best_all
