"""The native path's MoE blocks (runtime/models/moe.py): the block's router, tokens grouped by expert,
each expert's gate/up one packed matmul on qtk's CPU kernels. Against transformers' block forward on
the same weights (float, and quantized experts against their dequantized weights), for Mixtral,
Qwen3-MoE and gpt-oss's experts (biases, clamped SwiGLU); then the engine on the native path against
the generic one."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qtk import moe
from qtk.runtime.models.llama import FUSED
from qtk.runtime.models.moe import MOE, SparseMoE
from qtk.runtime.packed_linear import KernelLinear, PackedLinear, pack_linears
from zoo import tiny

TYPES = ["mixtral", "qwen3_moe", "gpt_oss"]
CALIB = torch.randint(3, 256, (8, 24), generator=torch.Generator().manual_seed(2))


def _cpu_ops():
    from qtk.kernels import cpu as cpu_kernels

    return cpu_kernels.ops()


def _strong(model):
    """Expert weights large enough that outputs are O(1) and gpt-oss's clamp at 7 is reached."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "gate_up" in name else 0.05))
            elif ".experts." in name:  # gpt-oss's biases
                p.copy_(torch.randn(p.shape, generator=g))
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


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("model_type", TYPES)
def test_sparse_moe_is_the_blocks_forward(model_type, pack):
    model = _strong(tiny(model_type))
    block, cfg = model.model.layers[1].mlp, model.config
    native = _native(block, cfg, pack)
    if pack:  # every expert's gate/up one packed matmul, its down another
        assert all(isinstance(e.gate_up_proj, PackedLinear) and not hasattr(e, "gate_proj") for e in native.experts)
    for T in (1, 3, 17):
        x = _x(T, cfg.hidden_size, T)
        want = _block_forward(block, x)
        assert want.abs().mean() > 0.1
        with torch.no_grad():
            assert_float32_close(native(x), want)


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
