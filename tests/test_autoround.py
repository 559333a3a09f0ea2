"""AutoRound (SignRound): the learned rounding against auto-round's own formulas, its start at
round-to-nearest, the signed-gradient step and the best-step rule, the float chain it targets, and
end to end on a tiny model (alone and after AWQ) against RTN."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from qtk import pipeline
from qtk.errors import InputError
from qtk.methods import METHODS, autoround
from qtk.quant import SCALE_DTYPE, quantize_weight
from qtk.recipe import build, from_flags
from qtk.schemes import preset


def _weight(seed=0, out=16, cols=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=g) * 0.05


def _perturbed(r: autoround.Rounding, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.v.copy_((torch.rand(r.v.shape, generator=g) - 0.5) * 0.9)
        r.min_scale.copy_(0.6 + 0.4 * torch.rand(r.min_scale.shape, generator=g))
        r.max_scale.copy_(0.6 + 0.4 * torch.rand(r.max_scale.shape, generator=g))


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym", "w8a16"])
def test_the_start_is_round_to_nearest(scheme):
    """v = 0 and unit scales: the codes, scales and zero points of quant.quantize_weight exactly."""
    args = preset(scheme, 32 if scheme != "w8a16" else None).weights
    w = _weight().to(torch.bfloat16)
    q, s, zp = autoround.Rounding(w, args).final()
    rq, rs, rzp = quantize_weight(w, args)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert (zp is None and rzp is None) or torch.equal(zp, rzp)


def test_asymmetric_is_auto_rounds_quant_tensor_asym():
    """auto-round's int_asym (auto_round/data_type/int.py), written out here on its unsigned codes
    0..15, with the scale rounded to the checkpoint's bf16: the same dequantized weight."""
    args = preset("w4a16_asym", 32).weights
    w = _weight(3)
    r = autoround.Rounding(w, args)
    _perturbed(r)
    g = w.reshape(16, 2, 32)
    wmin = g.amin(-1).clamp(max=0) * r.min_scale.detach()
    wmax = g.amax(-1).clamp(min=0) * r.max_scale.detach()
    maxq = 15
    scale = ((wmax - wmin) / maxq).to(SCALE_DTYPE).float()[..., None]
    zp = torch.round(-wmin[..., None] / scale)
    q = torch.clamp(torch.round(g / scale + r.v.detach().reshape(16, 2, 32)) + zp, 0, maxq)
    want = (scale * (q - zp)).reshape(16, 64)
    torch.testing.assert_close(r.dequantized().detach(), want, rtol=0, atol=1e-7)


def test_symmetric_clips_each_side_on_the_compressed_tensors_grid():
    """Symmetric: the larger clipped side spans half the signed range (absmax / 7.5 for int4), codes
    -8..7, no zero point."""
    args = preset("w4a16", 32).weights
    w = _weight(4)
    r = autoround.Rounding(w, args)
    _perturbed(r, seed=5)
    g = w.reshape(16, 2, 32)
    side = torch.maximum(-g.amin(-1).clamp(max=0) * r.min_scale.detach(), g.amax(-1).clamp(min=0) * r.max_scale.detach())
    scale = (side / 7.5).to(SCALE_DTYPE).float()[..., None]
    want = (torch.clamp(torch.round(g / scale + r.v.detach().reshape(16, 2, 32)), -8, 7) * scale).reshape(16, 64)
    torch.testing.assert_close(r.dequantized().detach(), want, rtol=0, atol=1e-7)
    q, s, zp = r.final()
    assert zp is None and q.min() >= -8 and q.max() <= 7


def test_gradients_pass_straight_through_the_rounding():
    x = torch.tensor([0.2, 1.7, -2.5], requires_grad=True)
    autoround.round_ste(x * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))
    r = autoround.Rounding(_weight(), preset("w4a16_asym", 32).weights)
    (r.dequantized() ** 2).sum().backward()
    assert r.v.grad.abs().sum() > 0 and r.min_scale.grad.abs().sum() > 0 and r.max_scale.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym"])
def test_fused_fake_quant_matches_autograd_through_the_formula(scheme):
    """FakeQuantized's hand-written backward against autograd through the expression written out with
    round_ste and clamp: the same W_hat, the same gradients for v and both clipping scales (some
    codes clamped, some not)."""
    args = preset(scheme, 32).weights
    r = autoround.Rounding(_weight(8, out=24), args)
    _perturbed(r, seed=9)
    g = torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(10))

    (r.dequantized() * g).sum().backward()
    fused = [p.grad.clone() for p in (r.v, r.min_scale, r.max_scale)]
    for p in (r.v, r.min_scale, r.max_scale):
        p.grad = None
    s, zp = r.qparams()
    x = r._grouped(r.weight) / s[..., None] + r._grouped(r.v)
    q = autoround.round_ste(x) + (0 if zp is None else zp[..., None])
    q = q.clamp(args.qmin, args.qmax)
    assert 0 < ((q == args.qmin) | (q == args.qmax)).float().mean() < 0.5  # both sides of the clamp tested
    want = ((q - (0 if zp is None else zp[..., None])) * s[..., None]).reshape(r.weight.shape)
    torch.testing.assert_close(r.dequantized().detach(), want.detach(), rtol=0, atol=0)
    (want * g).sum().backward()
    for got, p in zip(fused, (r.v, r.min_scale, r.max_scale)):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)


class _Block:
    """A stand-in for calibrate.Block around one Linear: what autoround.tune reads."""

    def __init__(self, linear, hidden):
        self.layer = torch.nn.Sequential(linear)
        self.inputs = type("Inputs", (), {"hidden": hidden, "kwargs": [{} for _ in hidden]})()
        self.device = torch.device("cpu")

    def linear(self, name):
        return self.layer.get_submodule(name)


def test_signed_steps_and_the_best_step_rule():
    """One step keeps the start (the best loss is the one measured before the update: round to
    nearest); each step moves every offset by exactly lr * (1 - t / iters) against its gradient's
    sign; the loss falls from round-to-nearest's and the best step's parameters are kept."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16, bias=False)
    lin.weight.data = _weight(7)
    x = [torch.randn(4, 8, 64) for _ in range(3)]
    ref = [F.linear(h, lin.weight).detach() for h in x]
    args = preset("w4a16", 32).weights

    r = autoround.Rounding(lin.weight, args)
    autoround.tune(_Block(lin, x), {"0": r}, ref, iters=1, lr=0.05, minmax_lr=0.05)
    assert torch.equal(r.v, torch.zeros_like(r.v)) and torch.equal(r.min_scale, torch.ones_like(r.min_scale))

    r = autoround.Rounding(lin.weight, args)  # the first step by hand
    loss = F.mse_loss(F.linear(x[0], r.dequantized()), ref[0])
    loss.backward()
    want = -0.05 * torch.sign(r.v.grad)
    r2 = autoround.Rounding(lin.weight, args)
    block = _Block(lin, x[:1])
    with autoround.fake_quantized(block, {"0": r2}), torch.enable_grad():
        F.mse_loss(block.layer(x[0]), ref[0]).backward()
    torch.testing.assert_close(r2.v.grad, r.v.grad)
    r3 = autoround.Rounding(lin.weight, args)
    first, best = autoround.tune(_Block(lin, x[:1]), {"0": r3}, ref[:1], iters=2, lr=0.05, minmax_lr=0.05)
    if best < first:  # the second step's parameters (after one update) are kept
        torch.testing.assert_close(r3.v, want)

    r = autoround.Rounding(lin.weight, args)
    first, best = autoround.tune(_Block(lin, x), {"0": r}, ref, iters=60, lr=1 / 60, minmax_lr=1 / 60)
    assert best < 0.8 * first
    assert lin.weight.requires_grad  # the block's weights are frozen only while tuning


def test_refuses_what_it_cannot_round():
    with pytest.raises(InputError, match="weight-only int"):
        from_flags("autoround", scheme="w8a8")
    with pytest.raises(InputError, match="autoround.iters"):
        build(method="autoround", autoround={"iters": 0})
    with pytest.raises(InputError, match="--iters: autoround option"):
        build(method="gptq", autoround={"iters": 10})


CALIBRATION = {"num_samples": 16, "seq_len": 64, "batch_size": 4}


def test_targets_the_float_model_and_beats_round_to_nearest(tiny_dir, tmp_path, kl_of, monkeypatch):
    """Each block's target is the float model's own hidden state there (transformers' forward), not
    the quantized chain's; the checkpoint is closer to the float model than RTN's, and its recipe
    says what ran."""
    from transformers import AutoModelForCausalLM

    from qtk.data import calibration_ids
    from qtk.loading import load_tokenizer

    seen = {}
    real = autoround.quantize_block

    def spy(block, recipe):
        seen[block.index] = torch.cat(block.reference)
        real(block, recipe)

    monkeypatch.setitem(METHODS, "autoround", dataclasses.replace(METHODS["autoround"], run=spy))
    recipe = build(method="autoround", group_size=32, dtype="float32", calibration=CALIBRATION,
                   autoround={"iters": 60})
    pipeline.quantize(str(tiny_dir), recipe, tmp_path / "ar", progress=False)
    ids = calibration_ids(load_tokenizer(str(tiny_dir)), "builtin", 16, 64, 0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    outputs = {}
    for i, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hf(ids)
    assert sorted(seen) == [0, 1]
    for i, ref in seen.items():  # block 1's: the float block 0's output, not the quantized one's
        torch.testing.assert_close(ref, outputs[i], rtol=1e-4, atol=1e-4)

    pipeline.quantize(str(tiny_dir), build(method="rtn", group_size=32, dtype="float32"), tmp_path / "rtn",
                      progress=False)
    assert kl_of(tmp_path / "ar") < 0.7 * kl_of(tmp_path / "rtn")
    saved = build(recipe_file=str(tmp_path / "ar" / "recipe.yaml"))
    assert saved.weights == "autoround" and saved.autoround.iters == 60
    assert len(json.loads((tmp_path / "ar" / "qtk_report.json").read_text())["layers"]) == 14


def test_after_awq_and_through_the_cli(tiny_dir, tmp_path, kl_of):
    """`--method awq --weights autoround --iters N`: AWQ's scales, then learned rounding on the
    asymmetric grid; closer to the float model than AWQ with round-to-nearest."""
    from click.testing import CliRunner

    from qtk.cli import main

    common = ["--group-size", "32", "--num-samples", "16", "--seq-len", "64", "--batch-size", "4", "--dtype", "float32"]
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "awq", "--weights", "autoround", "--iters",
                                  "60", *common, "-o", str(tmp_path / "awq-ar")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "awq", *common, "-o", str(tmp_path / "awq")])
    assert r.exit_code == 0, r.output
    assert kl_of(tmp_path / "awq-ar") < kl_of(tmp_path / "awq")
    config = json.loads((tmp_path / "awq-ar" / "config.json").read_text())["quantization_config"]
    assert next(iter(config["config_groups"].values()))["weights"]["symmetric"] is False


def test_composes_with_the_rotations(tiny_dir, tmp_path, kl_of):
    """AWQ then learned rounding on a model rotated every way (the residual stream and each head's
    values fused, the down projections online): the checkpoint carries the online rotation, and is
    closer to the float model than round-to-nearest on the same rotated model."""
    from click.testing import CliRunner

    from qtk.cli import main

    common = ["--group-size", "32", "--dtype", "float32", "--rotate", "residual", "--rotate", "v_o", "--rotate", "down"]
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "awq", "--weights", "autoround", "--iters",
                                  "60", "--num-samples", "16", "--seq-len", "64", "--batch-size", "4", *common,
                                  "-o", str(tmp_path / "ar")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "rtn", "--scheme", "w4a16_asym", *common,
                                  "-o", str(tmp_path / "rtn")])
    assert r.exit_code == 0, r.output
    assert kl_of(tmp_path / "ar") < kl_of(tmp_path / "rtn")
    config = json.loads((tmp_path / "ar" / "config.json").read_text())
    assert "R4" in config["quantization_config"]["transform_config"]["config_groups"]
    assert config["tie_word_embeddings"] is False
