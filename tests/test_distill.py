"""Scales distilled end to end (qtk/distill.py): the start is the checkpoint's own weight, gradients
reach every scale through the bf16 rounding, only the scales change, the result is closer to the
float model on text no calibration sample comes from, and the recipe, the CLI and the rotations
carry it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qtk import distill, pipeline
from qtk.errors import InputError
from qtk.loading import load_model
from qtk.methods.args import DistillArgs
from qtk.quant import SCALE_DTYPE, quantize_weight
from qtk.quant_linear import QuantLinear
from qtk.recipe import build
from qtk.schemes import preset

CALIBRATION = {"num_samples": 16, "seq_len": 64, "batch_size": 4}


def _layer(scheme: str, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g) * 0.05
    s = preset(scheme, 32 if scheme != "w8a16" else None)
    q, scale, zp = quantize_weight(w, s.weights)
    return QuantLinear.from_codes(q, scale, zp, s, bias=torch.randn(16, generator=g), dtype=torch.float32)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym", "w8a16"])
def test_the_start_is_the_checkpoints_weight(scheme):
    """u = 0: (q - zp) * s is the QuantLinear's own dequantized weight, bit for bit, and the training
    forward is its forward."""
    m = _layer(scheme)
    t = distill.TrainedScales.of(m)
    assert torch.equal(t.weight().detach(), m.dequantized_weight())
    x = torch.randn(3, 64)
    torch.testing.assert_close(t.forward(x), m(x), rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_scale_through_the_stored_rounding():
    """The forward multiplies by s rounded to bf16 (what the checkpoint stores), the backward passes
    straight through it: d(sum W_hat)/du = s * sum over the group of (q - zp), exactly."""
    m = _layer("w4a16_asym")
    t = distill.TrainedScales.of(m)
    with torch.no_grad():
        t.log_ratio.add_(0.001)  # a change below bf16's step for most scales: rounded away forward ...
    s = t.scale()
    assert torch.equal(s.detach(), (t.base * torch.exp(t.log_ratio.detach())).to(SCALE_DTYPE).float())
    t.weight().sum().backward()
    q_minus_zp = t.codes.float().reshape(16, 2, 32).sum(-1)
    want = t.base * torch.exp(t.log_ratio.detach()) * q_minus_zp  # ... but still felt backward
    torch.testing.assert_close(t.log_ratio.grad, want, rtol=1e-5, atol=1e-7)


def test_store_writes_the_rounded_scales_and_nothing_else():
    m = _layer("w4a16_asym")
    packed, zp = m.weight_packed.clone(), m.weight_zero_point.clone()
    t = distill.TrainedScales.of(m)
    with torch.no_grad():
        t.log_ratio.uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(1))
    moved = t.store()
    assert torch.equal(m.weight_scale, t.scale().detach())
    assert torch.equal(m.weight_scale, m.weight_scale.to(SCALE_DTYPE).float())
    assert torch.equal(m.weight_packed, packed) and torch.equal(m.weight_zero_point, zp)
    assert 0.03 < moved < 0.06


def test_kl_divergence_is_the_teachers_against_the_students():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    p, q = a.softmax(-1), b.softmax(-1)
    want = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(distill.kl_divergence(a, b), want)
    assert distill.kl_divergence(a, a).item() == pytest.approx(0, abs=1e-6)


def _tensors(path) -> dict:
    return load_file(str(path / "model.safetensors"))


def test_closer_to_the_float_model_with_only_the_scales_changed(tiny_dir, tmp_path, kl_of):
    """RTN w4a16, then 32 steps of distillation: nearer the float model on the built-in text's
    evaluation windows (no calibration sample is drawn there) than RTN alone; the codes and zero
    points are RTN's, every scale is a bf16 value, and the report says what ran."""
    common = dict(method="rtn", scheme="w4a16_asym", group_size=32, dtype="float32")
    pipeline.quantize(str(tiny_dir), build(**common), tmp_path / "rtn", progress=False)
    calibration = {**CALIBRATION, "num_samples": 32}
    pipeline.quantize(str(tiny_dir), build(**common, calibration=calibration, distill={"samples": 32, "lr": 1e-2}),
                      tmp_path / "kd", progress=False)
    assert kl_of(tmp_path / "kd") < 0.85 * kl_of(tmp_path / "rtn")  # 0.77 measured
    rtn, kd = _tensors(tmp_path / "rtn"), _tensors(tmp_path / "kd")
    assert rtn.keys() == kd.keys()
    changed = set()
    for name, value in rtn.items():
        if name.endswith("weight_scale"):
            changed |= {name} if not torch.equal(value, kd[name]) else set()
        else:
            assert torch.equal(value, kd[name]), name
    assert len(changed) == 14  # every quantized layer's scales moved
    report = json.loads((tmp_path / "kd" / "qtk_report.json").read_text())["distill"]
    assert report["samples"] == 32 and report["layers"] == 14
    assert report["kl_last_quarter"] < report["kl_first_quarter"]


def test_through_the_cli_with_the_online_rotation(tiny_dir, tmp_path, kl_of):
    """`--method awq --rotate down --distill-samples 8`: the down projections' inputs are rotated in
    the training forward too (the hook runs around it), so the loaded checkpoint is the model that
    was trained: nearer the float model than AWQ alone, and recipe.yaml says what ran."""
    from click.testing import CliRunner

    from qtk.cli import main

    common = ["--method", "awq", "--group-size", "32", "--num-samples", "16", "--seq-len", "64", "--batch-size", "4",
              "--dtype", "float32", "--rotate", "down"]
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), *common, "-o", str(tmp_path / "awq")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), *common, "--distill-samples", "8",
                                  "-o", str(tmp_path / "kd")])
    assert r.exit_code == 0, r.output
    assert kl_of(tmp_path / "kd") < kl_of(tmp_path / "awq")
    saved = build(recipe_file=str(tmp_path / "kd" / "recipe.yaml"))
    assert saved.distill == DistillArgs(samples=8) and saved.rotate == ("down",)
    config = json.loads((tmp_path / "kd" / "config.json").read_text())
    assert "transform_config" in config["quantization_config"]


def test_the_trained_forward_keeps_the_modules_hooks(tiny_dir):
    """A forward pre-hook (the online Hadamard rotation) runs before the training forward, and the
    module's own forward comes back after."""
    from qtk import hadamard

    m = _layer("w4a16")
    hadamard.attach(m, 32)
    x = torch.randn(3, 64)
    want = m(x)
    t = distill.TrainedScales.of(m)
    with distill.training_forward([t]):
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(m)


def test_refusals():
    with pytest.raises(InputError, match="distill trains the scales of weight-only int schemes"):
        build(method="smoothquant", distill={"samples": 4})
    with pytest.raises(InputError, match="distill.samples must be >= 0"):
        build(method="gptq", distill={"samples": -1})
    with pytest.raises(InputError, match="distill.lr must be positive"):
        build(method="gptq", distill={"lr": 0})
    with pytest.raises(InputError, match="distill.samples must be an integer"):
        build(method="gptq", distill={"samples": 2.5})
    assert build(method="rtn", distill={"samples": 2}).needs_data
    assert not build(method="rtn").needs_data


def test_the_loaded_checkpoint_is_the_trained_model(tiny_dir, tmp_path):
    """What the loader reads back computes what the distillation left in memory."""
    recipe = build(method="rtn", group_size=32, dtype="float32", calibration=CALIBRATION,
                   distill={"samples": 4, "lr": 1e-2})
    job = pipeline.prepare(str(tiny_dir), recipe, tmp_path / "kd", force=False)
    model = job.load()
    pipeline.write(job, model, recipe, tmp_path / "kd", force=False, dtype=torch.float32, progress=False)
    loaded, _ = load_model(str(tmp_path / "kd"), dtype=torch.float32)
    ids = job.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
