"""Schemes and recipes: validation names the field, presets, YAML round trip."""
from __future__ import annotations

import dataclasses

import pytest

from qtk import recipe as rec
from qtk.methods.args import AWQArgs, GPTQArgs, SmoothQuantArgs
from qtk.schemes import (PRESETS, KVCacheScheme, QuantArgs, Scheme, check_group_divides, kv_cache_scheme,
                         preset)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_bits=9), "num_bits"),
    (dict(num_bits=0), "num_bits"),
    (dict(num_bits=4, type="float"), "num_bits"),
    (dict(type="bfloat"), "type"),
    (dict(strategy="row"), "strategy"),
    (dict(strategy="token"), "strategy 'token' requires dynamic"),
    (dict(strategy="group"), "group_size"),
    (dict(strategy="group", group_size=-8), "group_size"),
    (dict(strategy="channel", group_size=64), "group_size"),
    (dict(type="float", symmetric=False), "symmetric"),
    (dict(actorder="sometimes"), "actorder"),
])
def test_quant_args_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantArgs(**kwargs)


def test_scheme_errors():
    w4 = QuantArgs(num_bits=4, strategy="group", group_size=128)
    a8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    with pytest.raises(ValueError, match="W8A8"):
        Scheme(w4, a8)
    with pytest.raises(ValueError, match="input_activations.strategy"):
        Scheme(QuantArgs(), QuantArgs(strategy="channel"))
    with pytest.raises(ValueError, match="both int or both float"):
        Scheme(QuantArgs(), QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True))
    with pytest.raises(ValueError, match="format 'sparse-24'"):
        Scheme(QuantArgs(), stored_format="sparse-24")


def test_group_size_on_w8a8_refused():
    with pytest.raises(ValueError, match="--group-size applies to weight-only int schemes"):
        preset("w8a8", 128)
    with pytest.raises(ValueError, match="--group-size"):
        rec.from_flags("fp8", scheme="fp8", group_size=64)


def test_presets_and_formats():
    assert {k: v.format for k, v in PRESETS.items()} == {
        "w4a16": "pack-quantized", "w4a16_asym": "pack-quantized", "w8a16": "pack-quantized",
        "w8a8": "int-quantized", "fp8": "float-quantized", "fp8_dynamic": "float-quantized",
        "fp8_static": "float-quantized"}
    assert preset("W4A16").weights.group_size == 128
    assert preset("w4a16", 32).weights.group_size == 32
    ch = preset("w4a16", -1).weights
    assert (ch.strategy, ch.group_size) == ("channel", None)
    assert preset("w8a16", 64).weights.strategy == "group"
    with pytest.raises(ValueError, match="unknown scheme 'w3a16'; choose one of"):
        preset("w3a16")


def test_kv_cache_scheme_flags():
    assert kv_cache_scheme(None) is None and kv_cache_scheme("none") is None
    assert kv_cache_scheme("int8", "head") == KVCacheScheme(type="int", strategy="attn_head")
    with pytest.raises(ValueError, match="kv_cache 'fp4' is not supported"):
        kv_cache_scheme("fp4")
    with pytest.raises(ValueError, match="kv_strategy 'channel'"):
        kv_cache_scheme("fp8", "channel")
    with pytest.raises(ValueError, match="kv_cache_scheme must be static symmetric 8-bit"):
        KVCacheScheme.from_dict({"num_bits": 4, "type": "int", "strategy": "tensor"})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_scheme_dict_round_trip_and_keys(name):
    from compressed_tensors.quantization import QuantizationScheme

    s = PRESETS[name]
    d = s.to_dict()
    assert set(d) == {"targets", "weights", "input_activations", "output_activations", "format"}
    assert Scheme.from_dict(d) == dataclasses.replace(s, stored_format=d["format"])
    QuantizationScheme.model_validate(d)  # the referee: unknown keys are rejected


def test_scheme_from_dict_rejects_unknown_keys():
    d = PRESETS["w4a16"].to_dict()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sparsity'\] in a config group"):
        Scheme.from_dict({**d, "sparsity": 1})
    with pytest.raises(ValueError, match=r"unknown quantization arg key\(s\) \['bits'\]"):
        QuantArgs.from_dict({**d["weights"], "bits": 4})
    with pytest.raises(ValueError, match="strategy 'block' is not supported"):
        QuantArgs.from_dict({**d["weights"], "strategy": "block", "group_size": None})


def test_check_group_divides_names_layers_and_suggests():
    scheme = preset("w4a16", 128)
    layers = {f"model.layers.{i}.self_attn.q_proj": 576 for i in range(6)}
    layers["model.layers.0.mlp.down_proj"] = 1536
    with pytest.raises(ValueError) as e:
        check_group_divides(scheme, layers)
    msg = str(e.value)
    assert "group size 128 does not divide the input size of 6 layer(s)" in msg
    assert "model.layers.0.self_attn.q_proj (in_features=576)" in msg
    assert "and 2 more" in msg and "down_proj" not in msg
    assert msg.endswith("use --group-size 64")
    check_group_divides(preset("w4a16", 64), layers)
    check_group_divides(preset("w8a16"), layers)  # per channel: nothing to divide
    with pytest.raises(ValueError, match="use --group-size -1"):
        check_group_divides(preset("w4a16", 128), {"a": 100})


# --- recipes -------------------------------------------------------------------------------

def test_method_scheme_compatibility():
    with pytest.raises(ValueError, match="awq protects salient weights of weight-only int schemes"):
        rec.from_flags("awq", scheme="w8a8")
    with pytest.raises(ValueError, match="smoothquant .* needs an activation-quantized scheme"):
        rec.from_flags("smoothquant", scheme="w4a16")
    with pytest.raises(ValueError, match="--method fp8 takes an fp8 scheme"):
        rec.from_flags("fp8", scheme="w8a8")
    with pytest.raises(ValueError, match="gptq solves for integer weights"):
        rec.from_flags("smoothquant", scheme="fp8", weights="gptq")
    with pytest.raises(ValueError, match="for gptq weights alone use --method gptq"):  # it ran gptq, said "rtn"
        rec.from_flags("rtn", weights="gptq")
    with pytest.raises(ValueError, match="unknown method 'hqq'"):
        rec.from_flags("hqq")
    with pytest.raises(ValueError, match="keep 'lm_head' in ignore"):
        dataclasses.replace(rec.from_flags("rtn"), ignore=())


def test_section_errors_name_the_field():
    with pytest.raises(ValueError, match="gptq.dampening"):
        GPTQArgs(dampening=0)
    with pytest.raises(ValueError, match="calibration.seq_len"):
        rec.CalibrationArgs(seq_len=0)
    with pytest.raises(ValueError, match="smoothquant.alpha"):
        SmoothQuantArgs(alpha=1.5)
    with pytest.raises(ValueError, match="awq.grid"):
        AWQArgs(grid=0)


def test_each_method_with_options_has_its_recipe_section():
    """qtk.methods.METHODS is the one list: a method's options are the Recipe field and YAML section named
    after it, and the roles give the CLI's --weights choices."""
    from qtk.methods import METHODS, SMOOTHING, WEIGHTS, named

    fields = {f.name: f.type for f in dataclasses.fields(rec.Recipe)}
    for name, m in METHODS.items():
        if m.args is not None:
            assert fields[name] == m.args.__name__ and isinstance(getattr(rec.from_flags("rtn"), name), m.args)
    assert named(WEIGHTS) == ("rtn", "gptq", "autoround") and named(SMOOTHING) == ("awq", "smoothquant")
    with pytest.raises(ValueError, match="weights must be 'rtn', 'gptq' or 'autoround', got 'awq'"):
        dataclasses.replace(rec.from_flags("rtn"), weights="awq")
    with pytest.raises(ValueError, match="smoothing must be 'awq' or 'smoothquant', got 'gptq'"):
        dataclasses.replace(rec.from_flags("rtn"), smoothing="gptq")


def test_needs_data():
    assert not rec.from_flags("rtn").needs_data
    assert not rec.from_flags("fp8").needs_data
    assert rec.from_flags("fp8", scheme="fp8_static").needs_data
    assert rec.from_flags("rtn", kv_cache="fp8").needs_data
    assert rec.from_flags("gptq").needs_data


def test_yaml_unknown_keys_are_named(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("method: rtn\nschem: w4a16\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['schem'\] in recipe"):
        rec.build(recipe_file=str(f))
    f.write_text("method: gptq\ngptq:\n  damp: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['damp'\] in recipe section 'gptq'"):
        rec.build(recipe_file=str(f))
    f.write_text("- method\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        rec.build(recipe_file=str(f))
    with pytest.raises(FileNotFoundError, match="recipe file .* not found"):
        rec.build(recipe_file=str(tmp_path / "none.yaml"))
    f.write_text("scheme: w4a16\n")
    with pytest.raises(ValueError, match="no method"):
        rec.build(recipe_file=str(f))


def test_default_recipe_is_the_best_4bit_recipe_file():
    """No --method and no --recipe: the recipe in calibration/recipes/awq-gptq-w4a16.yaml."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "calibration/recipes/awq-gptq-w4a16.yaml"
    default = rec.build()
    assert default == rec.build(recipe_file=str(path))
    assert (default.method, default.smoothing, default.weights) == ("awq", "awq", "gptq")
    assert default.gptq.mse_clip and default.gptq.act_order and not default.scheme.weights.symmetric
    assert rec.build(group_size=64).scheme.weights.group_size == 64
    assert default.max_bits == 5.1 and default.calibration.dataset == "builtin+self+instruct" and rec.build(max_bits=5.0).max_bits == 5.0  # mixed precision by measurement
    assert rec.build(scheme="w8a16").max_bits is None  # its budget is for its own 4-bit scheme
    assert rec.build(max_bits=0).max_bits is None  # --max-bits 0: int4 everywhere
    assert default.rotate == ("down",) and rec.build(rotate=("none",)).rotate == ()  # R4 online; --rotate none
    assert default.distill.samples == 64  # the scales distilled after the blocks


def test_yaml_flags_override_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("method: gptq\nscheme: w4a16\ngroup_size: 64\ngptq:\n  dampening: 0.05\n"
                 "calibration:\n  num_samples: 16\n")
    r = rec.build(recipe_file=str(f), group_size=32, gptq={"dampening": None}, calibration={"seq_len": 128})
    assert r.scheme.weights.group_size == 32
    assert r.gptq.dampening == 0.05
    assert (r.calibration.num_samples, r.calibration.seq_len) == (16, 128)


@pytest.mark.parametrize("kwargs", [
    dict(method="rtn"),
    dict(method="rtn", scheme="w4a16", group_size=32, kv_cache="fp8", kv_strategy="head"),
    dict(method="rtn", scheme="w4a16", group_size=-1),
    dict(method="rtn", scheme="w8a16", group_size=64),
    dict(method="rtn", scheme="w8a16"),
    dict(method="rtn", scheme="w4a16_asym", group_size=16, ignore=("re:.*down_proj",)),
    dict(method="gptq", scheme="w4a16", calibration={"num_samples": 8, "seed": 3}, gptq={"act_order": True}),
    dict(method="awq", awq={"grid": 5}),
    dict(method="smoothquant", scheme="w8a8", smoothquant={"alpha": 0.8}, kv_cache="int8"),
    dict(method="fp8", scheme="fp8_static", kv_cache="fp8", device="cuda:1"),
    dict(method="fp8", scheme="fp8_static", group_size=-1),  # per-channel weights, static activations
    dict(method="fp8"),
])
def test_to_yaml_build_round_trip(tmp_path, kwargs):
    r = rec.build(**kwargs)
    f = tmp_path / "recipe.yaml"
    f.write_text(rec.to_yaml(r))
    assert rec.build(recipe_file=str(f)) == r


def test_calibration_dtype_is_validated_and_round_trips(tmp_path):
    r = rec.build(method="gptq", group_size=64, dtype="float32")
    assert r.dtype == "float32" and rec.build(method="gptq").dtype == "auto"
    f = tmp_path / "r.yaml"
    f.write_text(rec.to_yaml(r))
    assert rec.build(recipe_file=str(f)) == r
    with pytest.raises(ValueError, match="dtype must be one of"):
        rec.build(method="gptq", dtype="float16")
