"""SmoothQuant: the formula, exact folding into the norms only, and W8A8 end to end vs RTN."""
import copy
import dataclasses

import torch

from qtk.calibrate import quantize_model
from qtk.methods import METHODS
from qtk.methods.args import SmoothQuantArgs
from qtk.methods.smoothquant import smoothing_scale
from qtk.recipe import from_flags

import outliers
from outliers import ids, logits


def tiny_llama(outlier=50.0, channel=5):
    return outliers.tiny_llama(outlier=outlier, channel=channel)


def test_smoothing_scale_formula():
    act = torch.tensor([8.0, 1.0, 0.0, 4.0])
    w = torch.tensor([2.0, 1.0, 0.5, 0.0])
    s = smoothing_scale(act, w, 0.5)
    torch.testing.assert_close(s[:2], torch.tensor([2.0, 1.0]))  # sqrt(8 / 2), sqrt(1 / 1)
    assert torch.isfinite(s).all() and (s > 0).all()  # dead channels stay finite and positive
    torch.testing.assert_close(smoothing_scale(act, w, 1.0)[:2], act[:2])


def test_smoothing_alone_keeps_logits_and_touches_norm_pairs_only(monkeypatch):
    model = tiny_llama()
    float_model = copy.deepcopy(model)
    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=lambda block, recipe: None))
    quantize_model(model, from_flags("smoothquant", scheme="w8a8"), ids(16, 0), progress=False)
    new, old = model.model.layers[0], float_model.model.layers[0]
    assert not torch.equal(new.input_layernorm.weight, old.input_layernorm.weight)
    assert not torch.equal(new.post_attention_layernorm.weight, old.post_attention_layernorm.weight)
    # llm-compressor's Llama mapping: the two norm pairs only, so o_proj and down_proj keep their columns
    assert torch.equal(new.self_attn.o_proj.weight, old.self_attn.o_proj.weight)
    assert torch.equal(new.mlp.down_proj.weight, old.mlp.down_proj.weight)
    torch.testing.assert_close(logits(model, ids(2, 1)), logits(float_model, ids(2, 1)), atol=1e-4, rtol=1e-4)


def test_smoothquant_w8a8_beats_rtn_with_an_outlier_channel():
    model = tiny_llama()
    calib, held_out = ids(16, 0), ids(4, 99)
    ref = logits(model, held_out)
    errors = {}
    for method, recipe in (("rtn", from_flags("rtn", scheme="w8a8")),
                           ("smoothquant", from_flags("smoothquant", scheme="w8a8",
                                                      smoothquant=SmoothQuantArgs(alpha=0.5)))):
        m = copy.deepcopy(model)
        quantize_model(m, recipe, calib, progress=False)
        errors[method] = (logits(m, held_out) - ref).pow(2).mean().item()
    assert errors["smoothquant"] < 0.5 * errors["rtn"], errors
