"""The native path's MoE blocks (runtime/models/moe.py): the block's router, tokens grouped by expert,
each expert's gate/up one packed matmul on qtk's CPU kernels. Against transformers' block forward on
the same weights (float, and quantized experts against their dequantized weights), for Mixtral,
Qwen3-MoE and gpt-oss (biases, clamped SwiGLU); then the engine on the native path against the
generic one and transformers, chunked prefills beside decodes (gpt-oss with large attention sinks)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qtk import moe
from qtk.runtime.models.native import FUSED
from qtk.runtime.models.moe import MOE, SparseMoE
from qtk.runtime.packed_linear import KernelLinear, PackedLinear, pack_linears
from zoo import tiny, tiny_config

TYPES = ["mixtral", "qwen3_moe", "gpt_oss"]
CALIB = torch.randint(3, 256, (8, 24), generator=torch.Generator().manual_seed(2))


def _cpu_ops():
    from qtk.kernels import cpu as cpu_kernels

    return cpu_kernels.ops()


def _strong(model):
    """Expert weights large enough that outputs are O(1) and gpt-oss's clamp at 7 is reached; gpt-oss's
    attention sinks large enough to matter (random ones are ~0.02)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "gate_up" in name else 0.05))
            elif ".experts." in name:  # gpt-oss's biases
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 3)
    return model


def _block_forward(block, x):
    """transformers' block forward on x [T, H] -> [T, H] (gpt-oss's returns (out, router scores))."""
    with torch.no_grad():
        out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _native(block, cfg, pack=True):
    block = copy.deepcopy(block)
    moe.linearize_experts(block)
    if pack:
        pack_linears(block, fuse=FUSED)
    return SparseMoE(block, MOE[cfg.model_type], cfg, _cpu_ops())


def assert_float32_close(got, want):
    """Equal up to float32 rounding at the output's scale (sums in another order)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def _x(T, H, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("pack", ["F.linear", "oneDNN", None])  # float experts' packed matmul, or modules
@pytest.mark.parametrize("model_type", TYPES)
def test_sparse_moe_is_the_blocks_forward(model_type, pack, monkeypatch):
    from qtk.runtime import packed_linear

    if pack == "oneDNN":  # the tiny experts are below SMALL_FLOAT, which runs them on F.linear
        monkeypatch.setattr(packed_linear, "SMALL_FLOAT", 0)
    model = _strong(tiny(model_type))
    block, cfg = model.model.layers[1].mlp, model.config
    native = _native(block, cfg, pack is not None)
    if pack:  # every expert's gate/up one packed matmul, its down another
        assert all(isinstance(e.gate_up_proj, PackedLinear) and not hasattr(e, "gate_proj") for e in native.experts)
    for T in (1, 3, 17):
        x = _x(T, cfg.hidden_size, T)
        want = _block_forward(block, x)
        assert want.abs().mean() > 0.1
        with torch.no_grad():
            assert_float32_close(native(x), want)


@pytest.mark.parametrize("model_type, overrides", [*((t, {}) for t in TYPES), ("qwen3_moe", dict(mlp_only_layers=[1]))])
def test_install_gives_each_moe_layer_a_sparse_moe(model_type, overrides):
    """install (what NativeModel runs at construction, and a gpt-oss native forward would): every MoE
    layer's mlp a SparseMoE over [T, H] computing transformers' block (its 3-D experts linearized on
    the way), a dense layer (Qwen3-MoE's mlp_only_layers) left as it is."""
    from qtk.runtime.models.moe import install

    model = _strong(tiny(model_type, **overrides))
    x = _x(5, model.config.hidden_size)
    want = [_block_forward(layer.mlp, x) for layer in model.model.layers]
    assert install(model.model.layers, model.config, _cpu_ops())
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == [i not in overrides.get("mlp_only_layers", []) for i in range(2)]
    with torch.no_grad():
        for layer, w in zip(model.model.layers, want):
            assert_float32_close(layer.mlp(x) if isinstance(layer.mlp, SparseMoE) else layer.mlp(x[None])[0], w)
    assert not install(tiny("llama").model.layers, tiny_config("llama"), None)


def test_gpt_oss_clamp_and_biases_matter():
    """The clamp at swiglu_limit is reached and the biases change the output (else the test above
    could not see either dropped)."""
    model = _strong(tiny("gpt_oss"))
    block, cfg = model.model.layers[0].mlp, model.config
    x = _x(9, cfg.hidden_size)
    experts = moe.linear_experts(block.experts)
    with torch.no_grad():
        gate = torch.stack([e.gate_proj(x) for e in experts])
        assert (gate > cfg.swiglu_limit).float().mean() > 0.05
        native = _native(block, cfg)
        want = native(x)
        for e in native.experts:
            e.gate_up_proj.bias.zero_()
        native._plan = None
        assert (native(x) - want).abs().max() > 0.1


def _quantized(model_type, scheme):
    from qtk.calibrate import quantize_model
    from qtk.recipe import from_flags

    model = _strong(tiny(model_type))
    moe.linearize_experts(model)
    recipe = from_flags("rtn", scheme=scheme, **({"group_size": 32} if scheme == "w4a16" else {}))
    quantize_model(model, recipe, CALIB, progress=False)
    return model


def _dequantized(block):
    """A copy of block with every QuantLinear a float nn.Linear of its dequantized weight."""
    from qtk.quant_linear import QuantLinear

    block = copy.deepcopy(block)
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data = child.dequantized_weight(torch.float32)
                if child.bias is not None:
                    lin.bias.data = child.bias.float()
                setattr(parent, name, lin)
    return block


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16"])
@pytest.mark.parametrize("model_type", TYPES)
def test_quantized_experts_on_qtks_kernel_are_the_dequantized_block(model_type, scheme):
    if _cpu_ops() is None:
        pytest.skip("no C++ compiler: no qtk CPU kernels")
    model = _quantized(model_type, scheme)
    block, cfg = model.model.layers[0].mlp, model.config
    reference = _dequantized(block)
    native = _native(block, cfg)
    assert all(isinstance(e.gate_up_proj, KernelLinear) and isinstance(e.down_proj, KernelLinear)
               for e in native.experts)
    for T in (1, 13):
        x = _x(T, cfg.hidden_size, T)
        with torch.no_grad():
            assert_float32_close(native(x), _block_forward(reference, x))


def test_bf16_activations_call_the_modules_not_the_float32_kernels():
    """A bf16 model (no fused CPU ops: ops None): the experts' fused WOQLinear modules, which cast to
    the kernel's float32, give the dequantized block's output within bf16 rounding."""
    if _cpu_ops() is None:
        pytest.skip("no C++ compiler: no qtk CPU kernels")
    model = _quantized("mixtral", "w4a16")
    block, cfg = model.model.layers[0].mlp, model.config
    reference = _dequantized(block)
    native = copy.deepcopy(block).to(torch.bfloat16)
    pack_linears(native, fuse=FUSED)
    native = SparseMoE(native, MOE["mixtral"], cfg, None)
    assert isinstance(native.experts[0].gate_up_proj, KernelLinear)
    x = _x(13, cfg.hidden_size)
    with torch.no_grad():
        got, want = native(x.to(torch.bfloat16)), _block_forward(reference, x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_w8a8_experts_are_the_blocks_own_quantized_forward(model_type):
    """W8A8: activations quantized per token inside the kernel, so the reference is the block's own
    forward over its QuantLinears (the same rows quantized alike), not the dequantized weights."""
    if _cpu_ops() is None:
        pytest.skip("no C++ compiler: no qtk CPU kernels")
    model = _quantized(model_type, "w8a8")
    block, cfg = model.model.layers[0].mlp, model.config
    native = _native(block, cfg)
    x = _x(13, cfg.hidden_size)
    with torch.no_grad():
        assert_float32_close(native(x), _block_forward(block, x))


# --- the engine on the native path ------------------------------------------------------

@pytest.mark.parametrize("model_type, overrides, backend", [
    ("mixtral", {}, "cpu"), ("mixtral", {}, "torch"), ("qwen3_moe", {}, "cpu"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "cpu"),  # a dense layer first
    ("gpt_oss", {}, "cpu"), ("gpt_oss", {}, "torch")])  # sinks, a window of 8, biases, clamped SwiGLU
def test_native_path_gives_the_generic_paths_logits(model_type, overrides, backend):
    """Prompts of 23, 9 and 5 tokens prefilled in 7-token chunks beside decodes, each path as the
    engine builds it, on qtk's fused CPU ops ("cpu") and without ("torch"): the same greedy tokens,
    and every step's logits transformers' (on an unpacked twin)."""
    from qtk.runtime.models import build
    from qtk.runtime.models.generic import GenericModel
    from qtk.runtime.models.native import NativeModel
    from test_model_families import backend_context, prompts
    from test_runtime import greedy_through_runtime

    models = [_strong(tiny(model_type, **overrides)) for _ in range(3)]
    native, generic = build(models[0]), build(models[1], "transformers")
    assert type(native) is NativeModel and type(generic) is GenericModel and native.why_no_graphs
    assert [isinstance(layer.mlp, SparseMoE) for layer in native.layers] == [0 not in overrides.get(
        "mlp_only_layers", []), True]
    with backend_context(backend):
        runs = [greedy_through_runtime(m, prompts(23, 9, 5), new_tokens=6, runtime=r, backend=backend)[:2]
                for m, r in ((models[0], native), (models[1], generic))]
    (seqs, native_logits), (generic_seqs, generic_logits) = runs
    assert [s.token_ids for s in seqs] == [s.token_ids for s in generic_seqs]
    for s, g in zip(seqs, generic_seqs):
        with torch.no_grad():
            want = models[2](torch.tensor([s.token_ids])).logits[0, s.num_prompt_tokens - 1:len(s) - 1]
        for got in (native_logits[s.seq_id], generic_logits[g.seq_id]):
            assert_float32_close(torch.stack(got), want)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_engine_serves_a_quantized_moe_checkpoint_natively_as_generically(model_type, tmp_path):
    """`qtk serve` on an RTN w4a16 checkpoint, model_impl "qtk" (experts on qtk's WOQ kernel, tokens
    grouped by expert) against "transformers": the same tokens and logprobs, chunked prefill beside
    decodes (an 8-token budget)."""
    from qtk import LLM, SamplingParams
    from qtk.runtime.models.generic import GenericModel
    from qtk.runtime.models.native import NativeModel
    from test_any_decoder import prompts, quantize
    from zoo import saved

    ckpt = quantize(saved(_strong(tiny(model_type)), tmp_path / "src"), "rtn", tmp_path / "q")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = {}
    for impl, runtime in (("qtk", NativeModel), ("transformers", GenericModel)):
        llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=8,
                  model_impl=impl)
        assert type(llm.model) is runtime
        outs[impl] = llm.generate(prompts(), params)
        if impl == "qtk" and _cpu_ops() is not None:
            expert = llm.model.layers[0].mlp.experts[0]
            assert isinstance(expert.gate_up_proj, KernelLinear) and expert.gate_up_proj.weights.startswith("int4")
    for a, b in zip(outs["qtk"], outs["transformers"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
