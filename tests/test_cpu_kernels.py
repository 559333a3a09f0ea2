"""qtk's CPU kernels (kernels/cpu.py, csrc/cpu_woq.cpp) against their reference twin.

Both builds run here: the AVX2 one (on a CPU with AVX2, i.e. any x86 machine CI runs on) and the
portable one, which is what a CPU without AVX2 runs; QTK_CPU_KERNEL=off (the reference path) is
covered in test_kernels.py's dispatch table."""
from __future__ import annotations

import logging

import pytest
import torch

from qtk.errors import InputError
from qtk.kernels import cpu, dispatch, reference
from qtk.quant import quantize_weight
from qtk.quant_linear import QuantLinear
from qtk.schemes import preset

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
BUILDS = [pytest.param("avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="CPU without AVX2")), "generic"]


@pytest.fixture(params=BUILDS)
def lib(request):
    lib = cpu.library(request.param)
    if lib is None:
        pytest.skip("no C++ compiler: the reference path runs (covered in test_kernels.py)")
    return lib


def random_layer(n, k, group, bits, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    groups = 1 if group is None else k // group
    codes = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zero = torch.randint(lo, hi, (n, groups), generator=g).float() if asym else None
    return codes, scale, zero


def dequant(codes, scale, zero):
    gs = codes.shape[1] // scale.shape[1]
    z = 0 if zero is None else zero.repeat_interleave(gs, 1)
    return (codes.double() - z) * scale.double().repeat_interleave(gs, 1)


def rel_err(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 256, None])
@pytest.mark.parametrize("asym", [False, True])
def test_kernel_matches_twin_and_math(lib, bits, group, asym):
    """Every group size (None: per channel), sym/asym, int4/int8; M across the gemv (<= 16) and
    tiled paths, odd M; N not a multiple of the 32-column tile nor of 8 (padded blocks)."""
    k = 512
    for n in (72, 53):
        codes, scale, zero = random_layer(n, k, group, bits, asym)
        w = cpu.pack(codes, scale, zero, bits)
        bias = torch.randn(n)
        for m in (1, 2, 3, 7, 16, 17, 40):
            x = torch.randn(m, k)
            b = bias if m % 2 else None
            y = cpu.woq_linear(x, w, b, lib)
            twin = reference.cpu_woq_linear_ref(x, w.codes, w.scales, w.zs, b, w.bits, w.n)
            math = (x.double() @ dequant(codes, scale, zero).t() + (0 if b is None else b.double())).float()
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert rel_err(y, twin) < 2e-6 and rel_err(twin, math) < 1e-6, (n, m)


def test_non_contiguous_and_batched_inputs(lib):
    codes, scale, zero = random_layer(64, 256, 64, 4, True)
    w = cpu.pack(codes, scale, zero, 4)
    base = torch.randn(256, 6)
    for x in (base.t(), torch.randn(3, 5, 512)[..., ::2], torch.randn(2, 3, 256)):
        y = cpu.woq_linear(x, w, None, lib)
        ref = reference.cpu_woq_linear_ref(x.reshape(-1, 256), w.codes, w.scales, w.zs, None, 4, 64)
        assert y.shape == (*x.shape[:-1], 64)
        assert rel_err(y.reshape(-1, 64), ref) < 2e-6
    assert cpu.woq_linear(torch.randn(0, 256), w, None, lib).shape == (0, 64)


def test_builds_agree(lib):
    """The AVX2 and portable builds compute the same sums (up to float32 rounding order)."""
    other = cpu.library("generic")
    codes, scale, zero = random_layer(96, 384, 128, 4, False, seed=3)
    w = cpu.pack(codes, scale, zero, 4)
    x = torch.randn(5, 384)
    assert rel_err(cpu.woq_linear(x, w, None, lib), cpu.woq_linear(x, w, None, other)) < 2e-6


def test_bad_operands_are_refused(lib):
    codes, scale, zero = random_layer(32, 128, 32, 4, False)
    w = cpu.pack(codes, scale, zero, 4)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu.woq_linear(torch.randn(2, 128).bfloat16(), w, None, lib)
    with pytest.raises(RuntimeError, match="do not match K"):
        cpu.woq_linear(torch.randn(2, 96), w, None, lib)
    with pytest.raises(ValueError, match="groups do not divide"):
        cpu.pack(codes[:, :100], scale[:, :3], None, 4)


def test_variant_override(monkeypatch):
    monkeypatch.setenv("QTK_CPU_KERNEL", "generic")
    assert cpu.variant() == "generic"
    monkeypatch.setenv("QTK_CPU_KERNEL", "off")
    assert cpu.variant() is None and cpu.ops() is None
    monkeypatch.setenv("QTK_CPU_KERNEL", "avx9")
    with pytest.raises(InputError, match="QTK_CPU_KERNEL must be one of avx2, generic, off"):
        cpu.variant()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger="qtk.kernels.cpu"):
        assert cpu.library.__wrapped__("generic") is None
    assert "could not be built (Ninja is required" in caplog.text


@pytest.mark.parametrize("scheme,group", [("w4a16", 64), ("w4a16_asym", 32), ("w8a16", None), ("w4a16", -1)])
def test_quant_linear_runs_the_kernel(scheme, group, monkeypatch):
    monkeypatch.setenv("QTK_CPU_BF16", "0")
    if cpu.ops() is None:
        pytest.skip("no C++ compiler")
    w = torch.randn(80, 192) * 0.05
    s = preset(scheme, group_size=group)
    q, scale, zp = quantize_weight(w, s.weights)
    layer = QuantLinear.from_codes(q, scale, zp, s, bias=torch.randn(80), dtype=torch.float32)
    x = torch.randn(3, 192)
    assert isinstance(dispatch.runtime_for(layer, x), dispatch.CpuWOQ)
    assert rel_err(layer(x), reference.quant_linear_ref(x, layer)) < 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
                                  "model.layers.29.mlp.gate_proj.weight"])
def test_bundled_model_weights(lib, name):
    """Real weights (the bundled model's, quantized by RTN int4 g64 asym and int8 per channel):
    the kernel against the reference twin and the plain float64 math."""
    from safetensors import safe_open

    from qtk.models import resolve

    with safe_open(str(resolve("smollm2-135m") / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name).float()
    x = torch.randn(5, w.shape[1])
    for scheme, group in (("w4a16_asym", 64), ("w8a16", None)):
        args = preset(scheme, group_size=group).weights
        q, scale, zp = quantize_weight(w, args)
        n = w.shape[0]
        packed = cpu.pack(q, scale.reshape(n, -1), None if zp is None else zp.reshape(n, -1), args.num_bits)
        for m in (1, 5):
            y = cpu.woq_linear(x[:m], packed, None, lib)
            twin = reference.cpu_woq_linear_ref(x[:m], packed.codes, packed.scales, packed.zs, None, packed.bits, n)
            zz = None if zp is None else zp.reshape(n, -1).float()
            math = x[:m].double() @ dequant(q, scale.reshape(n, -1), zz).t()
            assert rel_err(y, twin) < 2e-6 and rel_err(twin, math) < 1e-6
