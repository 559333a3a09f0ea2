"""Mixture of experts: per-expert Linears compute what transformers' 3-D experts compute, on every
MoE type of the zoo; their checkpoint names are the hub's; routing every token through every
expert (calibrate_all) changes no output."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qtk import moe
from zoo import MOE, tiny

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))

# model_type -> the hub's names of layer 0's expert 1 projections and of its router (what
# transformers' conversion_mapping.py reads, and vLLM's loaders); None where the hub holds 3-D
HUB_NAMES = {
    "qwen3_moe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "qwen2_moe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "olmoe": ("mlp.experts.1.gate_proj", "mlp.experts.1.up_proj", "mlp.experts.1.down_proj", "mlp.gate"),
    "mixtral": ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3", "block_sparse_moe.experts.1.w2",
                "block_sparse_moe.gate"),
    "phimoe": ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3", "block_sparse_moe.experts.1.w2",
               "block_sparse_moe.gate"),
    "granitemoe": ("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3", "block_sparse_moe.experts.1.w2",
                   "block_sparse_moe.router.layer"),
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
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
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
