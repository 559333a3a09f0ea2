"""Mixed precision in one checkpoint: a recipe's overrides give named layers a scheme of their own
(8 bits where the main scheme is 4), written as a config group of their names ahead of the main
group's "Linear"; readers pick the most specific target (the name) as compressed-tensors does,
whatever the groups' order; the layers keep the 8-bit grid's error; compressed-tensors' own
dequantization agrees; the runtime serves it; a mistyped target is refused before any work."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from interop import ct_dequantize
from qtk import pipeline
from qtk.checkpoint import load_quantized
from qtk.errors import InputError
from qtk.quant_linear import QuantLinear
from qtk.recipe import Override, build, from_flags, to_yaml
from qtk.schemes import preset

EIGHT = ("model.layers.0.mlp.down_proj", r"re:.*layers\.1\.self_attn\.v_proj")
NAMES = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj"]


@pytest.fixture(scope="module")
def mixed(tiny_dir, tmp_path_factory):
    recipe = dataclasses.replace(from_flags("gptq", "w4a16_asym", group_size=32),
                                 overrides=(Override(EIGHT, preset("w8a16")),))
    out = tmp_path_factory.mktemp("mixed") / "q"
    pipeline.quantize(str(tiny_dir), recipe, out, progress=False)
    return out, recipe


def test_overrides_are_their_own_config_group(mixed, tiny_dir):
    from transformers import AutoModelForCausalLM

    out, recipe = mixed
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    first, main = groups.values()
    assert sorted(first["targets"]) == NAMES and first["weights"]["num_bits"] == 8
    assert first["weights"]["strategy"] == "channel" and main["targets"] == ["Linear"]
    assert main["weights"]["num_bits"] == 4
    model = load_quantized(out)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14 and {n for n, m in layers.items() if m.scheme.weights.num_bits == 8} == set(NAMES)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    err = {n: ((m.dequantized_weight().float() - float_model.get_submodule(n).weight).norm()
               / float_model.get_submodule(n).weight.norm()).item() for n, m in layers.items()}
    assert max(err[n] for n in NAMES) < 0.01 < min(e for n, e in err.items() if n not in NAMES)
    reference = ct_dequantize(out, fp32_scales=True)  # compressed-tensors reads each group's grid
    for n, m in layers.items():
        torch.testing.assert_close(reference[f"{n}.weight"].float(), m.dequantized_weight().float(), rtol=0, atol=0)
    assert build(recipe_file=str(out / "recipe.yaml")).overrides == recipe.overrides


def test_the_name_wins_over_linear_whatever_the_order(mixed, tmp_path):
    import shutil

    out, _ = mixed
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    config = json.loads((swapped / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    config["quantization_config"]["config_groups"] = {"group_0": groups["group_1"], "group_1": groups["group_0"]}
    (swapped / "config.json").write_text(json.dumps(config))
    a, b = load_quantized(out), load_quantized(swapped)
    for (n, m), (_, m2) in zip(a.named_modules(), b.named_modules()):
        if isinstance(m, QuantLinear):
            assert m.scheme == m2.scheme, n


def test_the_runtime_serves_a_mixed_checkpoint(mixed):
    """Its prompt distributions are transformers' forward on the same checkpoint."""
    from qtk import LLM
    from qtk.evals.kld import kl_divergence

    out, _ = mixed
    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_memory=2**22, block_size=8)
    ids = list(range(5, 45))
    rows = llm.prompt_log_probs([ids])[0]
    with torch.no_grad():
        ref = load_quantized(out)(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    kl, agree = kl_divergence(ref, rows)  # the engine's int kernels take bf16 products where the CPU has them
    assert kl.max() < 1e-5 and agree.all()


def test_override_mistakes_are_refused_before_any_work(tiny_dir, tmp_path):
    base = from_flags("rtn", "w4a16", group_size=32)
    bad = dataclasses.replace(base, overrides=(Override(("model.layers.0.mlp.down_prog",), preset("w8a16")),))
    with pytest.raises(InputError, match="down_prog.*matches no quantized decoder Linear"):
        pipeline.quantize(str(tiny_dir), bad, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(InputError, match="weight-only int"):
        Override(("a",), preset("w8a8"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(to_yaml(base) + "overrides: [{targets: model.layers.0.mlp.down_proj, scheme: w8a16}]\n")
    with pytest.raises(InputError, match="targets must be a list"):
        build(recipe_file=str(recipe))


def test_layer_sensitivity_replays_the_blocks_before_and_ranks_a_hurt_layer_first(tiny_llama):
    """Each layer's KL with the blocks before it standing in by their outputs equals a full forward
    with that layer alone rounded; a layer given an outlier weight (its rows' grids stretched) ranks
    first."""
    from qtk.arch import discover
    from qtk.calibrate import targeted_linears
    from qtk.quant import dequantize_weight, quantize_weight
    from qtk.sensitivity import layer_sensitivity

    model = tiny_llama(initializer_range=0.1)
    hurt = "model.layers.1.mlp.down_proj"
    with torch.no_grad():
        model.get_submodule(hurt).weight[:, 3] *= 40  # one input column 40x: every row's range is its
    recipe = from_flags("rtn", "w4a16", group_size=32)
    arch = discover(model)
    targets = targeted_linears(model, recipe, arch)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))  # TINY: vocab 256
    kl = layer_sensitivity(model, arch, targets, recipe.scheme, ids, progress=False)
    assert max(kl, key=kl.get) == hurt and set(kl) == set(targets)
    name = "model.layers.1.self_attn.v_proj"  # the full forward, by hand
    w = model.get_submodule(name).weight.data
    with torch.no_grad():
        base = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
        q, s, zp = quantize_weight(w, recipe.scheme.weights)
        model.get_submodule(name).weight.data = dequantize_weight(q, s, zp, recipe.scheme.weights)
        rounded = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
        model.get_submodule(name).weight.data = w
    assert kl[name] == pytest.approx((base.exp() * (base - rounded)).sum(-1).mean().item(), rel=1e-4)


def test_choose_keeps_the_most_sensitive_within_the_budget():
    from qtk.sensitivity import choose, weight_bits

    four, eight = preset("w4a16_asym", 64), preset("w8a16")
    assert weight_bits(four, 576) == 4 + 20 / 64 and weight_bits(eight, 576) == 8 + 16 / 576
    shapes = {"a": (576, 1536), "b": (576, 576), "c": (192, 576), "d": (1536, 576)}
    kl = {"a": 0.03, "b": 0.02, "c": 0.01, "d": 0.001}
    params = {n: o * i for n, (o, i) in shapes.items()}
    total = sum(params.values())
    bits = lambda names: sum(params[n] * weight_bits(eight if n in names else four, shapes[n][1])  # noqa: E731
                             for n in shapes) / total
    chosen, avg = choose(kl, shapes, four, eight, bits({"a", "c"}) + 1e-9)
    assert chosen == ["a", "c"] and avg == pytest.approx(bits({"a", "c"}))  # b does not fit beside a; c does
    assert choose(kl, shapes, four, eight, bits(set()))[0] == []
    # b and d read one input (vLLM fuses them): together (KL 0.021, after a) or not at all
    chosen, _ = choose(kl, shapes, four, eight, bits({"a", "b", "d"}) + 1e-9, groups=[("b", "d")])
    assert chosen == ["a", "b", "d"]
    chosen, _ = choose(kl, shapes, four, eight, bits({"a", "b"}) + 1e-9, groups=[("b", "d")])
    assert chosen == ["a", "c"]  # b alone would fit; without d it may not go


def test_sensitivity_samples_cover_every_source_of_a_mix():
    """builtin+self is the sources' samples concatenated in order: the samples the per-layer KL is
    measured on are spread from the first to the last, so each source is measured."""
    ids = torch.arange(128).unsqueeze(1).repeat(1, 4)  # sample i is all i's
    assert pipeline.spread(ids, 2)[:, 0].tolist() == [0, 127]
    assert pipeline.spread(ids, 4)[:, 0].tolist() == [0, 42, 85, 127]
    assert torch.equal(pipeline.spread(ids[:2], 4), ids[:2])


def test_layers_reading_one_input_are_found_on_every_family(tiny_llama):
    """discover's shared_input: q/k/v and gate/up (vLLM's qkv_proj and gate_up_proj) on Llama; on
    every zoo type, groups of 2+ distinct layers of one block with equal in_features."""
    from qtk.arch import discover
    from qtk.moe import linearize_experts
    from zoo import tiny

    assert discover(tiny_llama()).shared_input[0] == (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                                      ("mlp.gate_proj", "mlp.up_proj"))
    for model_type in _zoo_types():
        model = tiny(model_type)
        linearize_experts(model)
        arch = discover(model)
        for i, groups in enumerate(arch.shared_input):
            names = [n for g in groups for n in g]
            assert len(names) == len(set(names)) and all(len(g) > 1 for g in groups), model_type
            for g in groups:
                block = model.get_submodule(f"{arch.layers}.{i}")
                assert len({block.get_submodule(n).in_features for n in g}) == 1, (model_type, g)


def test_max_bits_end_to_end(tiny_dir, tmp_path):
    """qtk quantize --max-bits: the chosen layers are an 8-bit config group, the report names them
    with their KL and the bits per weight reached, within the budget; q/k/v and gate/up are kept
    together or not at all; the recipe it writes
    quantizes the same layers again; a budget below the scheme's own is refused (exit 2)."""
    from click.testing import CliRunner

    from qtk.cli import main

    out = tmp_path / "q"
    args = ["--method", "gptq", "--scheme", "w4a16_asym", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "64"]
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), *args, "--max-bits", "4.9", "-o", str(out)])
    assert r.exit_code == 0, r.output
    mixed = json.loads((out / "qtk_report.json").read_text())["mixed_precision"]
    kept = mixed["kept_at_8_bits"]
    assert kept and mixed["bits_per_weight"] <= 4.9 and len(mixed["kl_each_layer_alone"]) == 14
    groups = list(json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values())
    assert sorted(groups[0]["targets"]) == sorted(kept) and groups[0]["weights"]["num_bits"] == 8
    # layers reading one input share a config group (vLLM loads qkv_proj / gate_up_proj with one scheme)
    assert len(mixed["kept_together"]) == 4
    for together in mixed["kept_together"]:
        assert len({n in groups[0]["targets"] for n in together}) == 1, (together, groups[0]["targets"])
    again = tmp_path / "again"
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--recipe", str(out / "recipe.yaml"), "-o", str(again)])
    assert r.exit_code == 0, r.output
    assert json.loads((again / "config.json").read_text())["quantization_config"]["config_groups"] == \
        json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), *args, "--max-bits", "4.2", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "below what the scheme alone takes" in r.output and not (tmp_path / "x").exists()


def _zoo_types():
    from zoo import DENSE, MOE

    return [*DENSE, *MOE]


@pytest.mark.parametrize("model_type", _zoo_types())
def test_sensitivity_replay_is_exact_on_every_family(model_type):
    """On every model type qtk quantizes, the KL of the last block's first layer with the blocks
    before it replayed from their outputs equals the KL of a full forward with that layer rounded."""
    from qtk.arch import discover
    from qtk.calibrate import targeted_linears
    from qtk.moe import linearize_experts
    from qtk.quant import dequantize_weight, quantize_weight
    from qtk.sensitivity import layer_sensitivity
    from zoo import tiny

    model = tiny(model_type)
    linearize_experts(model)
    recipe = from_flags("rtn", "w4a16", group_size=16)
    arch = discover(model)
    targets = targeted_linears(model, recipe, arch)
    name = next(n for n in targets if n.startswith(f"{arch.layers}.{len(arch.linears) - 1}."))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    kl = layer_sensitivity(model, arch, {name: targets[name]}, recipe.scheme, ids, progress=False)
    linear = targets[name]
    w = linear.weight.data
    with torch.no_grad():
        base = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)
        q, s, zp = quantize_weight(w, recipe.scheme.weights)
        linear.weight.data = dequantize_weight(q, s, zp, recipe.scheme.weights)
        rounded = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)
        linear.weight.data = w
    want = (base.exp() * (base - rounded)).sum(-1).mean().item()
    assert kl[name] == pytest.approx(want, rel=1e-3, abs=1e-9), model_type
