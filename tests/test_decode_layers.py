"""A step of decodes only as one call of qtk's DecodeLayers (csrc/cpu_decode.cpp): the same logits, bit for bit,
as the fused forward calling the same ops one by one from Python, on each family and weight kind it takes."""
from __future__ import annotations

import pytest
import torch

from qtk import hadamard
from qtk.kernels import cpu
from qtk.runtime.draft_model import quantized_twin
from qtk.runtime.models import build
from qtk.runtime.models.native import NativeModel
from tests.test_runtime import greedy_through_runtime, hf_model

pytestmark = pytest.mark.skipif(cpu.ops() is None, reason="qtk's CPU kernels are not built here")


def runtime_model(family: str, weights: str, **overrides) -> NativeModel:
    """A tiny model of `family` as the engine runs it: float weights rounded to bf16 (kept in bf16 on the weight-only
    kernel; layers of more than packed_linear.SMALL_FLOAT weights) or the RTN int4 twin with a Hadamard rotation of
    each down projection's input."""
    if weights == "bf16":
        overrides = {"hidden_size": 256, "intermediate_size": 512, **overrides}
    if family == "gemma":
        import transformers

        from interop import TINY
        torch.manual_seed(0)
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**{**TINY, "head_dim": 16, **overrides})).eval()
    else:
        model = hf_model(family, **overrides)
    if weights == "bf16":
        model = model.to(torch.bfloat16).float()
    else:
        quantized_twin(model)
        for layer in model.model.layers:
            hadamard.attach(layer.mlp.down_proj, 32)
    return build(model)


class Counting:
    """DecodeLayers with its calls counted."""

    def __init__(self, decode):
        self.decode, self.calls = decode, 0

    def forward(self, *args):
        self.calls += 1
        return self.decode.forward(*args)


def decode_both_ways(model: NativeModel, monkeypatch, **kv):
    """Greedy decoding of four prompts (prefill chunks beside decodes, then decode batches of 1-4), decode steps in
    one call, then op by op -> (calls of DecodeLayers, each sequence's logits per step in one way, in the other)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 1, 6, 3)]
    built, real = [], NativeModel._decode_layers

    def counted(self, caches):  # each runner's caches get their own DecodeLayers
        made = real(self, caches)
        if made is None:
            return None
        built.append(Counting(made[0]))
        return built[-1], made[1]

    monkeypatch.setattr(NativeModel, "_decode_layers", counted)
    _, fused, _ = greedy_through_runtime(model, prompts, new_tokens=9, runtime=model, **kv)
    monkeypatch.setattr(NativeModel, "_decode_rows", lambda self, caches: 0)
    _, op_by_op, _ = greedy_through_runtime(model, prompts, new_tokens=9, runtime=model, **kv)
    return sum(c.calls for c in built), list(fused.values()), list(op_by_op.values())


@pytest.mark.parametrize("family,weights,overrides", [
    ("llama", "bf16", {}), ("llama", "int4", {}), ("qwen2", "bf16", {}),
    ("mistral", "bf16", {"sliding_window": 5}), ("gemma", "int4", {})])
@pytest.mark.parametrize("kv", ["float", "int8"])
def test_one_call_decode_steps_equal_the_op_by_op_forward(family, weights, overrides, kv, monkeypatch):
    model = runtime_model(family, weights, **overrides)
    scales = {} if kv == "float" else {"kv_dtype": torch.int8, "kv_scales": [
        (torch.full((1, 1, 1), 0.05), torch.full((1, 1, 1), 0.05))] * len(model.layers)}
    calls, fused, op_by_op = decode_both_ways(model, monkeypatch, **scales)
    assert calls > 0  # the decode steps took the one call
    assert len(fused) == len(op_by_op) == 4
    for a, b in zip(fused, op_by_op):
        assert len(a) == len(b) == 9 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_models_it_does_not_take_run_op_by_op():
    """q/k norms (Qwen3) are not in DecodeLayers: no bound, every step op by op."""
    model = build(hf_model("qwen3", hidden_size=256, intermediate_size=512).to(torch.bfloat16).float())
    greedy_through_runtime(model, [[1, 2, 3]], new_tokens=3, runtime=model)
    assert model._decode is None and model._decode_rows_below == 0


def test_the_bound_is_where_a_layer_leaves_the_weight_only_kernel():
    """A bf16 layer multiplies on qtk's bf16 dot products (or oneDNN) from some rows on: from there the step goes op
    by op, as its kernels differ."""
    model = runtime_model("llama", "bf16")
    greedy_through_runtime(model, [[1, 2, 3]], new_tokens=3, runtime=model)
    bounds = []
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            bounds += [m.dot.lo] if m.dot is not None else [m.many.rows] if m.many is not None else []
    assert model._decode is not None and model._decode_rows_below == min(bounds, default=1 << 62)


def test_a_new_runner_drops_the_last_ones_caches():
    """The one-call step holds its runner's KV caches: a new runner over the model lets them go."""
    from qtk.runtime.model_runner import ModelRunner

    model = runtime_model("llama", "int4")
    greedy_through_runtime(model, [[1, 2, 3]], new_tokens=3, runtime=model)
    assert model._decode is not None
    ModelRunner(model, 8, 4)
    assert model._decode is None and model._decode_caches is None
