"""qtk's CPU kernels (kernels/cpu.py, csrc/cpu_*.cpp) against their reference twin or the torch path.

Every build the CPU can run is tested here: the AVX-512 one (on a CPU with AVX-512 and VNNI), the AVX2
one (on a CPU with AVX2, i.e. any x86 machine CI runs on) and the portable one, which is what a CPU
without AVX2 runs; QTK_CPU_KERNEL=off (the reference path) is
covered in test_kernels.py's dispatch table."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from qtk.errors import InputError
from qtk.kernels import cpu, dispatch, reference
from qtk.quant import quantize_weight
from qtk.quant_linear import QuantLinear
from qtk.schemes import preset

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
HAS_AVX512 = cpu._has_avx512()
BUILDS = [pytest.param("avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="CPU without AVX-512 + VNNI")),
          pytest.param("avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="CPU without AVX2")), "generic"]


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
    """Every group size (None: per channel), sym/asym, int4/int8; M across the gemv (below rows_min:
    8-12 rows on the avx2 build, 20 on avx512, whose int4 gemv multiplies x's 24-bit limbs on VNNI:
    within float32 rounding all the same), decoded slices (to 512: 6-row micro-tiles and each
    remainder) and tiled (> 512) paths, odd M; N not a multiple of the 32-column tile nor of 8 (padded
    blocks)."""
    k = 512
    for n in (72, 53):
        codes, scale, zero = random_layer(n, k, group, bits, asym)
        w = cpu.pack(codes, scale, zero, bits)
        bias = torch.randn(n)
        for m in (1, 2, 3, 7, 16, 19, 20, 21, 23, 40, 515):
            x = torch.randn(m, k)
            b = bias if m % 2 else None
            y = cpu.woq_linear(x, w, b, lib)
            twin = reference.cpu_woq_linear_ref(x, w.codes, w.scales, w.zs, b, w.bits, w.n)
            math = (x.double() @ dequant(codes, scale, zero).t() + (0 if b is None else b.double())).float()
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert rel_err(y, twin) < 1e-5 and rel_err(twin, math) < 1e-6, (n, m)  # float32 sums vs float64


def test_int4_gemv_rows_with_zeros_nan_and_inf(lib):
    """The int4 gemv's rows (on the avx512 build: x split into 24-bit limbs per group, int4_limb_rows())
    with a group of zeros give the twin's result; a row with a NaN or an inf gives NaN or inf where the
    twin does (the limbs cannot hold them: such rows take the float gemv)."""
    k, n = 256, 40
    codes, scale, zero = random_layer(n, k, 64, 4, True, seed=5)
    w = cpu.pack(codes, scale, zero, 4)
    for m in (1, 2, 3):
        x = torch.randn(m, k)
        x[:, 64:128] = 0
        twin = reference.cpu_woq_linear_ref(x, w.codes, w.scales, w.zs, None, 4, n)
        assert rel_err(cpu.woq_linear(x, w, None, lib), twin) < 1e-5
        for bad in (float("nan"), float("inf")):
            x[-1, 70] = bad
            y = cpu.woq_linear(x, w, None, lib)
            twin = reference.cpu_woq_linear_ref(x, w.codes, w.scales, w.zs, None, 4, n)
            assert torch.equal(y[-1].isfinite(), twin[-1].isfinite()) and not y[-1].isfinite().any(), (m, bad)
            if m > 1:
                assert rel_err(y[:-1], twin[:-1]) < 1e-5
            x[-1, 70] = 0


@pytest.mark.skipif(not HAS_AVX512, reason="CPU without AVX-512 + VNNI")
def test_int4_gemv_with_and_without_vnni_limbs(monkeypatch):
    """QTK_CPU_VNNI=0 (read when a build is loaded) turns the avx512 build's int4 gemv on VNNI off: every
    row multiplies x in float32. Both give the twin's result below int4_limb_rows() rows."""
    codes, scale, zero = random_layer(100, 384, 128, 4, True, seed=7)
    w = cpu.pack(codes, scale, zero, 4)
    x = torch.randn(3, 384)
    lib = cpu.library("avx512")
    try:
        monkeypatch.setenv("QTK_CPU_VNNI", "0")
        cpu.set_int4_limbs(lib)
        assert lib.int4_limb_rows() == 0
        floats = [cpu.woq_linear(x[:m], w, None, lib) for m in (1, 2, 3)]
    finally:
        monkeypatch.delenv("QTK_CPU_VNNI")
        cpu.set_int4_limbs(lib)
    assert lib.int4_limb_rows() == 20  # the whole gemv
    limbs = [cpu.woq_linear(x[:m], w, None, lib) for m in (1, 2, 3)]
    for m, y0, y1 in zip((1, 2, 3), floats, limbs):
        twin = reference.cpu_woq_linear_ref(x[:m], w.codes, w.scales, w.zs, None, 4, 100)
        assert rel_err(y0, twin) < 1e-5 and rel_err(y1, twin) < 1e-5 and not torch.equal(y0, y1), m


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(lib, bits):
    """Through the gemv's rows (below rows_min: 6-12 on the avx2 build, 20 on avx512) each row sums in the
    same order at any M: each row's result is its one-row call's to the bit (a step verifying drafts then
    gives plain decoding's logits); N with a partial tile and a partial block."""
    k, n = 384, 100
    if bits == 16:
        w = cpu.pack_bf16(torch.randn(n, k).bfloat16().float())
    else:
        codes, scale, zero = random_layer(n, k, 64, bits, True, seed=9)
        w = cpu.pack(codes, scale, zero, bits)
    bias = torch.randn(n)
    x = torch.randn(19, k)
    ones = torch.cat([cpu.woq_linear(x[i:i + 1], w, bias, lib) for i in range(19)])
    for m in range(2, 20 if lib.compiled_avx512() else 6):
        assert torch.equal(cpu.woq_linear(x[:m], w, bias, lib), ones[:m]), m


def test_a_bf16_weight_gives_the_float32_products_on_every_path(lib):
    """A bf16 weight (bits 16: a bf16 checkpoint's float layer) gives F.linear's float32 result (the
    same products, float32 sums) at every M: the gemv (few rows), the slices (from rows_min(16), 6 on the
    avx2 build, to 512: the first 6 rows convert each slice as they multiply it) and the tiles + sgemm
    (> 512); N not a multiple of 32 nor of 8."""
    torch.manual_seed(4)
    for n in (72, 53):
        weight, bias = torch.randn(n, 320).bfloat16().float(), torch.randn(n)
        w = cpu.pack_bf16(weight)
        for m in (1, 2, 5, 6, 7, 9, 10, 11, 16, 19, 20, 33, 515):
            x = torch.randn(m, 320)
            b = bias if m % 2 else None
            y = cpu.woq_linear(x, w, b, lib)
            want = (x.double() @ weight.double().t() + (0 if b is None else b.double())).float()
            assert y.shape == (m, n) and rel_err(y, want) < 1e-6, (n, m)


def test_non_contiguous_and_batched_inputs(lib):
    codes, scale, zero = random_layer(64, 256, 64, 4, True)
    w = cpu.pack(codes, scale, zero, 4)
    base = torch.randn(256, 6)
    for x in (base.t(), torch.randn(3, 5, 512)[..., ::2], torch.randn(2, 3, 256)):
        y = cpu.woq_linear(x, w, None, lib)
        ref = reference.cpu_woq_linear_ref(x.reshape(-1, 256), w.codes, w.scales, w.zs, None, 4, 64)
        assert y.shape == (*x.shape[:-1], 64)
        assert rel_err(y.reshape(-1, 64), ref) < 1e-5
    assert cpu.woq_linear(torch.randn(0, 256), w, None, lib).shape == (0, 64)


def test_builds_agree(lib):
    """The AVX2 and portable builds compute the same sums (up to float32 rounding order)."""
    other = cpu.library("generic")
    codes, scale, zero = random_layer(96, 384, 128, 4, False, seed=3)
    w = cpu.pack(codes, scale, zero, 4)
    x = torch.randn(5, 384)
    assert rel_err(cpu.woq_linear(x, w, None, lib), cpu.woq_linear(x, w, None, other)) < 1e-5


def test_bad_operands_are_refused(lib):
    codes, scale, zero = random_layer(32, 128, 32, 4, False)
    w = cpu.pack(codes, scale, zero, 4)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu.woq_linear(torch.randn(2, 128).bfloat16(), w, None, lib)
    with pytest.raises(RuntimeError, match="do not match K"):
        cpu.woq_linear(torch.randn(2, 96), w, None, lib)
    with pytest.raises(ValueError, match="groups do not divide"):
        cpu.pack(codes[:, :100], scale[:, :3], None, 4)


def test_packed_operands_of_the_wrong_shape_are_refused(lib):
    """A bias or scales that do not cover every column are refused (they were read out of bounds)."""
    codes, scale, zero = random_layer(64, 256, 64, 4, True)
    w = cpu.pack(codes, scale, zero, 4)
    x = torch.randn(3, 256)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\], got \[3\]"):
        lib.woq_linear(x, w.codes, w.scales, w.zs, torch.randn(3), 4, 64)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\], got \[2, 64\]"):
        lib.woq_linear(x, w.codes, w.scales, w.zs, torch.randn(2, 64), 4, 64)
    with pytest.raises(RuntimeError, match=r"scales must be \[8, G, 8\]"):
        lib.woq_linear(x, w.codes, w.scales[:2].contiguous(), w.zs[:2].contiguous(), None, 4, 64)


@pytest.mark.parametrize("m", [5, 600])  # the gemv (or decoded slices) and the tiles + sgemm path
def test_x_that_requires_grad(lib, m):
    """Every path computes without autograd, with or without grad mode (the tiles' mm_out refused an
    x that requires grad: 'functions with out=... arguments don't support automatic differentiation')."""
    codes, scale, zero = random_layer(40, 128, 32, 4, False)
    w = cpu.pack(codes, scale, zero, 4)
    x, bias = torch.randn(m, 128, requires_grad=True), torch.randn(40)
    want = reference.cpu_woq_linear_ref(x.detach(), w.codes, w.scales, w.zs, bias, 4, 40)
    assert rel_err(cpu.woq_linear(x, w, bias, lib), want) < 1e-5
    with torch.no_grad():
        assert rel_err(cpu.woq_linear(x, w, bias, lib), want) < 1e-5


def test_variant_override(monkeypatch):
    monkeypatch.setenv("QTK_CPU_KERNEL", "generic")
    assert cpu.variant() == "generic"
    monkeypatch.setenv("QTK_CPU_KERNEL", "off")
    assert cpu.variant() is None and cpu.ops() is None
    monkeypatch.setenv("QTK_CPU_KERNEL", "avx9")
    with pytest.raises(InputError, match="QTK_CPU_KERNEL must be one of avx512, avx2, generic, off"):
        cpu.variant()
    monkeypatch.setenv("QTK_CPU_KERNEL", "avx512")
    monkeypatch.setattr(cpu, "_has_avx512", lambda: False)
    with pytest.raises(InputError, match="needs a CPU with AVX-512"):
        cpu.variant()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger="qtk.kernels.cpu"):
        assert cpu.library.__wrapped__("generic") is None
    assert "could not be built (Ninja is required" in caplog.text


def test_unwritable_cache_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    """No build directory (a read-only home, QTK_CACHE under a file): the reference path, with one
    warning, instead of an error at the first layer."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "file" / "qtk"))
    with caplog.at_level(logging.WARNING, logger="qtk.kernels.cpu"):
        assert cpu.library.__wrapped__("generic") is None
    assert "could not be built" in caplog.text and "writable cache" in caplog.text


def test_a_killed_builds_lock_is_removed(tmp_path, monkeypatch, caplog):
    """cpp_extension waits while its build directory holds a lock file: one a killed build left
    would hang every later process. An old lock is removed (with a warning), a recent one kept."""
    import os
    import time

    from torch.utils import cpp_extension

    monkeypatch.setenv("QTK_CACHE", str(tmp_path))
    seen = []

    def load(**kw):  # records whether the build would have waited, then fails (no real build)
        lock = Path(kw["build_directory"]) / "lock"
        seen.append(lock.exists())
        lock.touch()
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu.library.__wrapped__("generic") is None  # leaves a fresh lock: another build running
    assert cpu.library.__wrapped__("generic") is None
    lock = next(tmp_path.glob("kernels/*/lock"))
    old = time.time() - 2 * cpu.STALE_LOCK_S
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="qtk.kernels.cpu"):
        assert cpu.library.__wrapped__("generic") is None
    assert seen == [False, True, False] and "did not finish" in caplog.text


def test_checkouts_of_one_version_share_a_build(tmp_path, monkeypatch):
    """Two copies of the sources (git worktrees, an unpacked archive) compile the same files in the
    same build directory: ninja's commands name the files, so compiling each copy's own rebuilt
    the other's build at every first call (about two minutes on 2 cores)."""
    import shutil

    from torch.utils import cpp_extension

    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    calls = []

    def load(**kw):
        calls.append((kw["build_directory"], kw["sources"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", load)
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        copies = [Path(shutil.copy(p, tmp_path / checkout / p.name)) for p in cpu.SOURCES]
        monkeypatch.setattr(cpu, "SOURCES", copies)
        assert cpu.library.__wrapped__("generic") is None
    assert calls[0] == calls[1]
    compiled = [p for p in cpu.SOURCES if p.suffix == ".cpp"]  # the header is written beside them
    assert [Path(p).read_bytes() for p in calls[0][1]] == [p.read_bytes() for p in compiled]
    assert (Path(calls[0][1][0]).parent / "cpu_kv.h").read_bytes() == (tmp_path / "b" / "cpu_kv.h").read_bytes()


def w8a8_twin(x, codes, w_scale, static, bias):
    q, s = reference.act_quant_ref(x.reshape(-1, x.shape[-1]), torch.int8, static)
    y = reference.scaled_mm_ref(q, codes, s, w_scale, bias, torch.float32)
    return y.reshape(*x.shape[:-1], codes.shape[0])


@pytest.mark.parametrize("static", [None, 0.02])
def test_w8a8_kernel_matches_twin(lib, static):
    """x quantized inside the call (per token, or with a static scale) and exact int8 products: the
    twin's act_quant + scaled_mm, for M across 6/4/2/1-row passes and, from 256 rows, bands of 60 rows (a tile's bands
    split between threads), N not a multiple of 16 or of the 64-column tile, K not a multiple of 4, bias
    or none, per-channel and per-tensor weight scales."""
    g = torch.Generator().manual_seed(0)
    st = None if static is None else torch.tensor([static])
    for n, k in ((64, 576), (72, 130), (53, 33), (200, 256)):
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        for w_scale in (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4, torch.tensor([3e-4])):
            w = cpu.pack_w8a8(codes, w_scale)
            for m in (1, 2, 3, 4, 5, 6, 7, 9, 11, 33, 130, 300):
                x = torch.randn(m, k, generator=g) * 3
                b = torch.randn(n, generator=g) if m % 2 else None
                y = cpu.w8a8_linear(x, w, st, b, lib)
                assert y.shape == (m, n) and rel_err(y, w8a8_twin(x, codes, w_scale, st, b)) < 1e-6, (n, k, m)


def test_w8a8_kernel_rounds_as_the_reference(lib):
    """Ties (x / s exactly half-way) round to even, saturate at -128 / 127, a zero row gets eps as its
    scale: with unit weight scales a single code off by one would show in y."""
    k = 40
    codes = torch.eye(k, dtype=torch.int8)[:32] * 127  # y[:, j] = 127 * q_x[:, j] * s_x
    w = cpu.pack_w8a8(codes, torch.ones(32, 1))
    st = torch.tensor([0.5])
    x = torch.arange(-k, k, 2).float().reshape(1, k) * 0.25  # x / s = -20, -19, ..., 19 (step 1): no ties
    x = torch.cat([x, x + 0.125, x * 40, torch.zeros(1, k)])  # halves (ties), saturation, a zero row
    for static in (st, None):
        y = cpu.w8a8_linear(x, w, static, None, lib)
        assert torch.equal(y, w8a8_twin(x, codes, torch.ones(32, 1), static, None))


def test_w8a8_kernel_inputs(lib):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    w = cpu.pack_w8a8(codes, torch.rand(48, 1, generator=g) * 1e-3)
    for x in (torch.randn(64, 6).t(), torch.randn(3, 5, 128)[..., ::2], torch.randn(2, 3, 64)):
        y = cpu.w8a8_linear(x, w, None, None, lib)
        assert y.shape == (*x.shape[:-1], 48) and rel_err(y, w8a8_twin(x, codes, w.scales[:48], None, None)) < 1e-6
    assert cpu.w8a8_linear(torch.randn(0, 64), w, None, None, lib).shape == (0, 48)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu.w8a8_linear(torch.randn(2, 64).bfloat16(), w, None, None, lib)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        cpu.w8a8_linear(torch.randn(2, 60), w, None, None, lib)
    with pytest.raises(RuntimeError, match=r"bias must be \[48\]"):
        cpu.w8a8_linear(torch.randn(2, 64), w, None, torch.randn(47), lib)


@pytest.mark.parametrize("static", [None, 0.02])
def test_w8a8_layer_on_rows_quantized_before(lib, static):
    """w8a8_quantize writes the codes + 128 and the scales of quantize_activation (per token, or the static
    scale), padded with 128 to a multiple of 4; w8a8_linear_quantized on them gives w8a8_linear's y to the bit."""
    g = torch.Generator().manual_seed(2)
    st = None if static is None else torch.tensor([static])
    for n, k in ((64, 576), (53, 33)):
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        w = cpu.pack_w8a8(codes, torch.rand(n, 1, generator=g) * 1e-3)
        bias = torch.randn(n, generator=g)
        for m in (1, 7, 300):
            x = torch.randn(m, k, generator=g) * 3
            xq, sx = lib.w8a8_quantize(x, st)
            q, s = reference.act_quant_ref(x, torch.int8, st)
            k4 = (k + 3) // 4 * 4
            assert xq.dtype == torch.uint8 and xq.shape == (m, k4) and torch.equal(sx, s.reshape(-1).expand(m))
            assert torch.equal(xq[:, :k].int() - 128, q.int()) and bool((xq[:, k:] == 128).all())
            for b in (None, bias):
                y = lib.w8a8_linear_quantized(xq, sx, w.codes, w.colsum, w.scales, b, w.n)
                assert torch.equal(y, cpu.w8a8_linear(x, w, st, b, lib))
    with pytest.raises(RuntimeError, match=r"xq must be contiguous uint8 \[M, 36\]"):
        lib.w8a8_linear_quantized(xq[:, :32].contiguous(), sx, w.codes, w.colsum, w.scales, None, w.n)
    with pytest.raises(RuntimeError, match=r"sx must be contiguous float32 \[300\]"):
        lib.w8a8_linear_quantized(xq, sx[:5], w.codes, w.colsum, w.scales, None, w.n)
    with pytest.raises(RuntimeError, match="a static input scale must be one float32"):
        lib.w8a8_quantize(x, torch.tensor([0.1, 0.2]))


def test_w8a8_gate_up_with_the_glu_in_its_epilogue(lib):
    """w8a8_linear_glu_quantized of a joined gate_up layer [2I, K] gives the GLU op's h [M, I] of
    w8a8_linear_quantized's y to the bit (SiLU and tanh GELU, bias or none, from one row to bands of rows
    split between threads, I a multiple of 32 from one tile up); other widths and activations are refused."""
    g = torch.Generator().manual_seed(4)
    for i, k in ((32, 40), (96, 576), (160, 33)):
        codes = torch.randint(-128, 128, (2 * i, k), dtype=torch.int8, generator=g)
        w = cpu.pack_w8a8(codes, torch.rand(2 * i, 1, generator=g) * 1e-3)
        bias = torch.randn(2 * i, generator=g)
        for m in (1, 7, 300):
            xq, sx = lib.w8a8_quantize(torch.randn(m, k, generator=g) * 3, None)
            for b in (None, bias):
                y = lib.w8a8_linear_quantized(xq, sx, w.codes, w.colsum, w.scales, b, w.n)
                for act, glu in (("silu", lib.silu_and_mul), ("gelu_tanh", lib.gelu_tanh_and_mul)):
                    h = lib.w8a8_linear_glu_quantized(xq, sx, w.codes, w.colsum, w.scales, b, w.n, act)
                    assert h.shape == (m, i) and torch.equal(h, glu(y)), (i, k, m, act, b is None)
    odd = cpu.pack_w8a8(torch.randint(-128, 128, (96, 40), dtype=torch.int8, generator=g), torch.full((96, 1), 1e-3))
    xq, sx = lib.w8a8_quantize(torch.randn(3, 40, generator=g), None)
    with pytest.raises(RuntimeError, match="must be a multiple of 64, got 96"):
        lib.w8a8_linear_glu_quantized(xq, sx, odd.codes, odd.colsum, odd.scales, None, odd.n, "silu")
    with pytest.raises(RuntimeError, match="act must be silu or gelu_tanh, got relu"):
        lib.w8a8_linear_glu_quantized(xq, sx, w.codes, w.colsum, w.scales, None, w.n, "relu")


@pytest.mark.parametrize("static", [None, 0.05])
def test_norms_and_glus_that_quantize_their_rows(lib, static):
    """rms_norm_quant, add_rms_norm_quant_ and the GLUs' _quant ops write what w8a8_quantize makes of the
    float32 rows of rms_norm, add_rms_norm_ and the GLUs (the same codes and scales, to the bit), and
    add_rms_norm_quant_ leaves the residual stream as add_rms_norm_ does; widths with 16-, 8-lane and scalar
    parts, and not a multiple of 4."""
    g = torch.Generator().manual_seed(3)
    st = None if static is None else torch.tensor([static])
    for rows, h in ((1, 576), (7, 130), (300, 45)):
        x, a, w = torch.randn(rows, h, generator=g), torch.randn(rows, h, generator=g), torch.rand(h, generator=g) + 0.5
        got = lib.rms_norm_quant(x, w, 1e-5, st)
        want = lib.w8a8_quantize(lib.rms_norm(x, w, 1e-5, False), st)
        assert all(torch.equal(u, v) for u, v in zip(got, want))
        r1, r2 = x.clone(), x.clone()
        got = lib.add_rms_norm_quant_(r1, a, w, 1e-5, st)
        want = lib.w8a8_quantize(lib.add_rms_norm_(r2, a, w, 1e-5, False), st)
        assert torch.equal(r1, r2) and all(torch.equal(u, v) for u, v in zip(got, want))
        for op in ("silu_and_mul", "gelu_tanh_and_mul"):
            y = torch.randn(rows, 2 * h, generator=g) * 3
            got = getattr(lib, f"{op}_quant")(y, st)
            want = lib.w8a8_quantize(getattr(lib, op)(y), st)
            assert all(torch.equal(u, v) for u, v in zip(got, want)), (op, rows, h)
    with pytest.raises(RuntimeError, match="even number of columns"):
        lib.silu_and_mul_quant(torch.randn(2, 7), None)
    with pytest.raises(RuntimeError, match="x and residual differ in shape"):
        lib.add_rms_norm_quant_(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5, None)


def test_glu_results_do_not_depend_on_the_threads(lib):
    """The GLUs share rows out in spans of 16 elements, so every element takes the same vector path whatever
    the split (the scalar tail's std::exp differs from the vector exp in the last bits): 1 thread and 2
    give the same bits, rows whose width is not a multiple of 16 included."""
    x = torch.randn(5, 2 * 1000, generator=torch.Generator().manual_seed(4)) * 3
    threads = torch.get_num_threads()
    try:
        out = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            out[t] = [lib.silu_and_mul(x), lib.gelu_tanh_and_mul(x), lib.silu_and_mul(x.bfloat16())]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(u, v) for u, v in zip(out[1], out[2]))


@pytest.mark.parametrize("scheme,group", [("w4a16", 64), ("w4a16_asym", 32), ("w8a16", None), ("w4a16", -1),
                                          ("w4a16", 8), ("w4a16_asym", 24), ("w8a16", 20)])
def test_quant_linear_runs_the_kernel(scheme, group, monkeypatch):
    """Every group the kernel takes runs it: int4 groups of a multiple of 8 and int8 groups of any
    size too (the Triton kernel's multiple of 16 once sent them to a float32 matmul on CPU)."""
    monkeypatch.setenv("QTK_CPU_BF16", "0")
    if cpu.ops() is None:
        pytest.skip("no C++ compiler")
    k = 240 if group in (8, 24, 20) else 192
    w = torch.randn(80, k) * 0.05
    s = preset(scheme, group_size=group)
    q, scale, zp = quantize_weight(w, s.weights)
    layer = QuantLinear.from_codes(q, scale, zp, s, bias=torch.randn(80), dtype=torch.float32)
    x = torch.randn(3, k)
    assert isinstance(dispatch.runtime_for(layer, x), dispatch.CpuWOQ)
    assert rel_err(layer(x), reference.quant_linear_ref(x, layer)) < 1e-5


def test_runtime_follows_a_data_reload(monkeypatch):
    """`tensor.data = new` (a reload) keeps the tensor and its version counter: the cached runtime
    is rebuilt from the new weights all the same."""
    monkeypatch.setenv("QTK_CPU_BF16", "0")
    s = preset("w4a16_asym", group_size=32)
    q, scale, zp = quantize_weight(torch.randn(48, 128) * 0.05, s.weights)
    layer = QuantLinear.from_codes(q, scale, zp, s, bias=torch.randn(48), dtype=torch.float32)
    x = torch.randn(3, 128)
    layer(x)
    q2, scale2, zp2 = quantize_weight(torch.randn(48, 128) * 0.05, s.weights)
    new = QuantLinear.from_codes(q2, scale2, zp2, s, bias=torch.randn(48), dtype=torch.float32)
    for name, t in new.state_dict().items():
        getattr(layer, name).data = t
    assert rel_err(layer(x), reference.quant_linear_ref(x, new)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
                                  "model.layers.29.mlp.gate_proj.weight"])
def test_bundled_model_weights(lib, name):
    """Real weights (the bundled model's, quantized by RTN int4 g64 asym and int8 per channel):
    the kernel against the reference twin and the plain float64 math."""
    from safetensors import safe_open

    from qtk.loading import resolve

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
            assert rel_err(y, twin) < 1e-5 and rel_err(twin, math) < 1e-6
    q, scale, _ = quantize_weight(w, preset("w8a8").weights)  # W8A8: int8 per channel, x per token
    y = cpu.w8a8_linear(x, cpu.pack_w8a8(q, scale), None, None, lib)
    assert rel_err(y, w8a8_twin(x, q, scale, None, None)) < 1e-6


# -- the fused per-layer ops (csrc/cpu_layers.cpp) against the torch code they replace ------------

def test_rms_norm_and_residual_add(lib):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x, res = torch.randn(5, 96) * 3, torch.randn(5, 96)
    assert rel_err(lib.rms_norm(x, norm.weight, 1e-5), norm(x)) < 1e-6
    strided = torch.randn(5, 200)[:, :96]  # rows with a stride
    assert rel_err(lib.rms_norm(strided, norm.weight, 1e-5), norm(strided)) < 1e-6
    want_res = res + x
    got = lib.add_rms_norm_(res, x, norm.weight, 1e-5)
    assert torch.equal(res, want_res) and rel_err(got, norm(want_res)) < 1e-6


def test_rms_norms_take_and_give_bf16_rows(lib):
    """A bf16 prefill step: the norms write bf16 (what the float32 output rounds to, to nearest even),
    and the residual adds a bf16 matmul output as its float32 value; 100 columns: vectors and a tail."""
    w = torch.randn(100)
    x, res = torch.randn(7, 100) * 3, torch.randn(7, 100)
    got = lib.rms_norm(x, w, 1e-5, True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, lib.rms_norm(x, w, 1e-5).bfloat16())
    a = torch.randn(7, 100).bfloat16()
    want_res, want = res + a.float(), lib.add_rms_norm_(res.clone(), a.float(), w, 1e-5)
    for bf16_out in (False, True):
        r = res.clone()
        got = lib.add_rms_norm_(r, a, w, 1e-5, bf16_out)
        assert torch.equal(r, want_res)
        assert torch.equal(got, want.bfloat16() if bf16_out else want)
    with pytest.raises(RuntimeError, match="x must be a float32 or bf16"):
        lib.add_rms_norm_(res, a.half(), w, 1e-5)


def test_rope_in_place_matches_rotate_half(lib):
    T, H, KV, D = 4, 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KV) * D)
    ang = torch.randn(T, D // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rotate(x, heads):
        x = x.reshape(T, heads, D)
        rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
        return (x * cos[:, None] + rot * sin[:, None]).reshape(T, heads * D)

    want_q, want_k = rotate(qkv[:, :H * D], H), rotate(qkv[:, H * D:(H + KV) * D], KV)
    v = qkv[:, (H + KV) * D:].clone()
    fused = qkv.clone()
    lib.rope_(fused, cos, sin, H + KV)  # q and k side by side: one pass
    assert rel_err(fused[:, :H * D], want_q) < 1e-6 and rel_err(fused[:, H * D:(H + KV) * D], want_k) < 1e-6
    assert torch.equal(fused[:, (H + KV) * D:], v)  # v untouched
    q = qkv[:, :H * D]  # a strided view, rotated in place
    lib.rope_(q, cos, sin, H)
    assert rel_err(qkv[:, :H * D], want_q) < 1e-6


def test_silu_and_mul(lib):
    x = torch.randn(3, 2 * 700)  # 700: eight lanes at a time and a scalar tail
    x[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 200.0])  # past exp's float range
    got, want = lib.silu_and_mul(x), torch.nn.functional.silu(x[:, :700]) * x[:, 700:]
    assert rel_err(got, want) < 1e-6
    assert torch.allclose(got, want, rtol=3e-7, atol=1e-30)  # each element, not only the norm


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("lens,D,H", [([1, 5, 17, 40], 32, 6), ([37], 36, 6), ([9, 40], 72, 6), ([3, 70], 64, 8),
                                      ([70], 64, 10), ([33, 70], 64, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_store_and_decode_match_the_torch_path(lib, kv_dtype, lens, D, H, threads):
    """store_kv_ writes the bytes attention.write_kv writes; paged_decode_attention gives what the
    torch decode gives, over random block tables, context lengths and GQA (1 to 5 query heads per KV
    head: 2 and 3 at a time, and one by one), per-head scales; head sizes in and out of whole vectors,
    contexts longer than a tile and than the rows asked for ahead, and one sequence on 2 threads (its
    query heads split into work items of one head each); with a sliding window (shorter and longer
    than contexts), score soft-capping and attention sinks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _store_and_decode_match_the_torch_path(lib, kv_dtype, lens, D, H)
    finally:
        torch.set_num_threads(before)


def _store_and_decode_match_the_torch_path(lib, kv_dtype, lens, D, H):
    from qtk.runtime.attention import NO_TERMS, AttentionMetadata, KVCache, ScoreTerms, _bytes, _decode, write_kv

    g = torch.Generator().manual_seed(0)
    KV, bs, blocks = 2, 4, 40
    quant = kv_dtype not in (torch.float32, torch.bfloat16)  # bf16: a float cache at half the bytes, no scales
    scales = (torch.rand(KV, 1, 1, generator=g) + 0.5, torch.rand(KV, 1, 1, generator=g) + 0.5) if quant else (None, None)
    make = lambda: KVCache(torch.zeros(KV, blocks * bs, D, dtype=kv_dtype), torch.zeros(KV, blocks * bs, D, dtype=kv_dtype),
                           *scales)  # noqa: E731
    ref, ours = make(), make()
    slots = torch.randperm(blocks * bs, generator=g)[:90]
    k, v = torch.randn(90, KV, D, generator=g) * 3, torch.randn(90, KV, D, generator=g)
    write_kv(ref, k, v, slots)
    flat = (None, None) if not quant else (scales[0].reshape(-1), scales[1].reshape(-1))
    lib.store_kv_(_bytes(ours.k), _bytes(ours.v), k, v, slots, *flat)
    assert torch.equal(_bytes(ours.k), _bytes(ref.k)) and torch.equal(_bytes(ours.v), _bytes(ref.v))
    lens = torch.tensor(lens)
    B, width = len(lens), 20
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens])
    mask = torch.arange(width * bs)[None, :] < lens[:, None]
    meta = AttentionMetadata(slots[:B], torch.arange(B), tables, mask, [], bs, lens)
    q = torch.randn(B, H, D, generator=g)
    want = _decode(q, ref, meta, 0.125)
    got = lib.paged_decode_attention(q, _bytes(ours.k), _bytes(ours.v), tables, lens, bs, 0.125, *flat)
    assert rel_err(got, want) < 1e-5
    for window, terms in ((6, NO_TERMS), (None, ScoreTerms(softcap=2.5)), (9, ScoreTerms(4.0, torch.randn(H, generator=g))),
                          (None, ScoreTerms(sinks=torch.randn(H, generator=g) * 3))):  # Gemma 2 / 3, gpt-oss
        want = _decode(q, ref, meta, 0.125, window, terms)
        got = lib.paged_decode_attention(q, _bytes(ours.k), _bytes(ours.v), tables, lens, bs, 0.125, *flat,
                                         window or 0, terms.softcap or 0.0, terms.sinks)
        assert rel_err(got, want) < 1e-5, (window, terms)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5])
def test_decode_reads_int8_fp8_and_bf16_codes_exactly(lib, kv_dtype, G):
    """paged_decode_attention reads an INT8 / FP8 / bf16 cache in place, decoding in registers: each
    of the 256 INT8 and FP8 codes (and 256 random bf16 bit patterns), as a value and as a key, counts
    as torch's value of it, times the scale for INT8 / FP8 (FP8's subnormals, -0 and largest; NaN as
    NaN), with 1 to 5 query heads per KV head (2 and 3 at a time, and one by one) and with one sequence
    (its heads split over threads)."""
    from qtk.runtime.attention import _bytes

    D, bs = 256, 4
    if kv_dtype == torch.bfloat16:
        codes = torch.randint(0, 2 ** 16, (D,), generator=torch.Generator().manual_seed(0)).to(torch.int16).view(kv_dtype)
        ks = vs = None
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
        ks, vs = torch.tensor([0.75]), torch.tensor([1.25])
    vals = codes.float()  # torch's decoding, the reference
    one = torch.ones(D).to(kv_dtype)
    kscale, vscale = (1.0, 1.0) if ks is None else (ks, vs)
    for B in (256, 1):
        tables, q = torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, G, D)
        kc, vc = torch.zeros(1, bs, D, dtype=kv_dtype), torch.zeros(1, bs, D, dtype=kv_dtype)
        vc[0, 0] = codes  # one key: the output is its value row, times v_scale
        got = lib.paged_decode_attention(torch.randn(B, G, D), _bytes(kc), _bytes(vc), tables, torch.ones(B, dtype=torch.long),
                                         bs, 0.5, ks, vs)
        torch.testing.assert_close(got, (vals * vscale).expand(B, G, D), rtol=1e-6, atol=0, equal_nan=True)
        # keys 0 (zeros) and 1 (the codes, NaN and inf as 0: 0 * NaN is NaN), values 0 and 1 (ones):
        # sequence b's query picks code b and scales it to a score of +-1 (0 for a zero), so the output is
        # sigmoid(score) * v_scale
        b = torch.arange(B)
        nan = ~vals.isfinite()
        kc[0, 1], vc[0, 0], vc[0, 1] = torch.where(nan, torch.zeros_like(codes), codes), 0, one
        w = torch.where(nan | (vals == 0), 1.0, 1 / vals.abs())
        q[b, :, b] = w[b, None] / kscale
        lens = torch.full((B,), 2)
        got = lib.paged_decode_attention(q, _bytes(kc), _bytes(vc), tables, lens, bs, 1.0, ks, vs)
        want = torch.sigmoid(w * torch.where(nan, 0.0, vals))[b] * vscale
        torch.testing.assert_close(got, want[:, None, None].expand(B, G, D), rtol=1e-6, atol=1e-7)
        if vals.isnan().any():  # a NaN key's score is NaN, and so is every output that sees it
            kc[0, 1, 0] = codes[vals.isnan()][0]
            assert lib.paged_decode_attention(q, _bytes(kc), _bytes(vc), tables, lens, bs, 1.0, ks, vs).isnan().all()


def test_store_kv_rounds_to_bf16_as_torch(lib):
    """A bf16 cache holds torch's .to(bfloat16) of each value to the bit (ties to even, the largest floats
    to inf, subnormals, signed zeros, infinities), and NaN where the value is NaN (torch's bits for a NaN
    vary with its path: c10's scalar conversion gives 0x7FC0, as the kernel does)."""
    from qtk.runtime.attention import _bytes

    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130 * (1 + 2 ** -8)])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, -3.4028235e38, 1e-45, 1e-40])
    x = torch.cat([ties, special, torch.randn(64 - ties.numel() - special.numel()) * 1e3])
    x[-1] = torch.tensor([0x7F80_0001], dtype=torch.int32).view(torch.float32)  # a signalling NaN's bits
    k = x.view(1, 1, 64).expand(3, 1, 64).contiguous()
    kc, vc = torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    lib.store_kv_(kc, vc, k, -k, torch.tensor([2, 0, 3]), None, None)
    nan = x.isnan()
    for got, want in ((kc[0, 0], x.to(torch.bfloat16)), (vc[0, 2], (-x).to(torch.bfloat16))):
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) and got[nan].isnan().all()


def test_store_and_decode_refuse_mismatched_operands(lib):
    """Operands that do not match the cache are refused with a message (they were read or written
    out of bounds, or crashed the process); strided slots are stored where they say."""
    KV, S, D = 2, 16, 8
    cache = lambda slots=S, dtype=torch.float32: torch.zeros(KV, slots, D, dtype=dtype)  # noqa: E731
    k, slots = torch.randn(4, KV, D), torch.arange(8)[::2]
    kc, vc = cache(), cache()
    lib.store_kv_(kc, vc, k, k, slots, None, None)
    assert torch.equal(kc[:, slots], k.transpose(0, 1)) and torch.equal(vc[:, slots], k.transpose(0, 1))
    with pytest.raises(RuntimeError, match="both of one shape"):
        lib.store_kv_(cache(), cache(2), k, k, slots, None, None)
    with pytest.raises(RuntimeError, match="k, v must be float32"):
        lib.store_kv_(cache(), cache(), k, k[:1], slots, None, None)
    for bad in (-1, S):  # refused before any row is stored
        kc, vc = cache(), cache()
        with pytest.raises(RuntimeError, match=f"store_kv_: slot {bad} is outside the cache's {S}"):
            lib.store_kv_(kc, vc, k, k, torch.tensor([0, 1, 2, bad]), None, None)
        assert not kc.any() and not vc.any()
    bf16 = lambda: cache(dtype=torch.bfloat16)  # noqa: E731
    with pytest.raises(RuntimeError, match="scales go with \\(and only with\\) an INT8 / FP8 cache"):
        lib.store_kv_(bf16(), bf16(), k, k, slots, torch.ones(1), torch.ones(1))
    with pytest.raises(RuntimeError, match="must be float32, bf16, int8 or FP8"):
        lib.store_kv_(cache(dtype=torch.float16), cache(dtype=torch.float16), k, k, slots, None, None)
    i8 = lambda: cache(dtype=torch.int8)  # noqa: E731
    for n in (0, 3):
        with pytest.raises(RuntimeError, match=f"must hold 1 or 2 \\(kv_heads\\) values, got {n}"):
            lib.store_kv_(i8(), i8(), k, k, slots, torch.ones(n), torch.ones(n))
    q, tables, lens = torch.randn(1, 4, D), torch.tensor([[0, 1]]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="both of one shape"):
        lib.paged_decode_attention(q, cache(), cache(2), tables, lens, 8, 0.3, None, None)
    with pytest.raises(RuntimeError, match="block_size must be positive, got 0"):
        lib.paged_decode_attention(q, cache(), cache(), tables, lens, 0, 0.3, None, None)
    with pytest.raises(RuntimeError, match="context length 0 of sequence 0"):
        lib.paged_decode_attention(q, cache(), cache(), tables, torch.tensor([0]), 8, 0.3, None, None)
    with pytest.raises(RuntimeError, match="got 3"):
        lib.paged_decode_attention(q, i8(), i8(), tables, lens, 8, 0.3, torch.ones(3), torch.ones(3))
    with pytest.raises(RuntimeError, match="one value per query head \\(4\\), got 3"):
        lib.paged_decode_attention(q, cache(), cache(), tables, lens, 8, 0.3, None, None, 0, 0.0, torch.ones(3))


@pytest.mark.parametrize("V", [49152, 1000, 77])  # whole blocks of 64 and of 8, and tails of both
def test_sample_rows_draws_the_token_where_the_cdf_passes_u(lib, V):
    """sample_rows is the sampler's inverse-CDF draw: the token it returns is the one whose
    cumulative probability (float64, at that row's temperature) passes u, up to float32's rounding;
    u = 0 gives the first token of weight > 0 and u near 1 the last; NaN and -inf never come out,
    +inf logits share the draw; a row with nothing to draw returns -1."""
    g = torch.Generator().manual_seed(0)
    B = 24
    x = torch.randn(B, V, generator=g) * 4
    x[:, ::5] = float("-inf")  # excluded tokens (a grammar's mask, top-k)
    x[:, 1::7] = float("nan")
    t = torch.rand(B, generator=g) * 2 + 1e-5
    t[0] = 1e-5  # the smallest temperature a row is drawn at: the argmax
    u = torch.rand(B, generator=g)
    u[1], u[2] = 0.0, 1.0 - 2 ** -24
    got = lib.sample_rows(x, t, u)
    clean = torch.nan_to_num(x.double(), nan=float("-inf"))
    p = ((clean - clean.amax(-1, keepdim=True)) / t.double()[:, None]).softmax(-1)
    cdf = p.cumsum(-1)
    for r in range(B):
        j = got[r].item()
        assert p[r, j] > 0, (r, j)
        below = cdf[r, j - 1].item() if j else 0.0
        assert below <= u[r].item() + 1e-5 and cdf[r, j].item() >= u[r].item() - 1e-5, (r, j, below, cdf[r, j].item(), u[r])
    assert got[0].item() == clean[0].argmax().item()
    allowed = (p[1] > 0).nonzero().flatten()
    assert got[1].item() == allowed[0].item() and got[2].item() == allowed[-1].item()
    y = torch.full((3, 40), float("-inf"))
    y[0, 3], y[0, 9], y[0, 30] = float("inf"), float("inf"), 1e30  # +inf: the largest float, the rest 0
    y[1, :] = float("nan")
    draws = [lib.sample_rows(y, torch.ones(3), torch.tensor([v, 0.5, 0.5])).tolist() for v in (0.0, 0.49, 0.51, 0.999)]
    assert [d[0] for d in draws] == [3, 3, 9, 9] and all(d[1:] == [-1, -1] for d in draws)
    strided = x[:, :V // 2]  # rows at a stride
    assert torch.equal(lib.sample_rows(strided, t, u), lib.sample_rows(strided.contiguous(), t, u))
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        lib.sample_rows(x[:1], torch.zeros(1), u[:1])
    with pytest.raises(RuntimeError, match="one value per row"):
        lib.sample_rows(x, t[:3], u)


def bf16_attention_lib(bf16: bool = True, build: str = "avx512"):
    """The build (avx512, or avx2 for the float32 prefill's 8-lane version) where the CPU has what the
    attention kernels' math needs (AVX512-BF16 for bf16; AVX-512, or AVX2 and FMA, for the float32
    prefill), else skip."""
    lib = cpu.library(build) if (HAS_AVX512 if build == "avx512" else HAS_AVX2) else None
    if lib is None or not lib.prefill_attention_runs(bf16=bf16):
        pytest.skip(f"CPU without {build.upper()}{' + AVX512-BF16' if bf16 else ''} (or no compiler): prefill chunks "
                    "attend in torch")
    return lib


def test_prefill_attention_runs_only_where_built():
    """A build without the kernels has their names: it says so, and refuses; the avx2 build has the float32
    prefill only."""
    lib = cpu.library("generic")
    if lib is None:
        pytest.skip("no C++ compiler")
    assert not lib.prefill_attention_runs() and not lib.prefill_attention_runs(bf16=False)
    args = torch.randn(2, 2, 16), torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), torch.arange(2), 0, 0.25
    with pytest.raises(RuntimeError, match="needs AVX-512 with AVX512-BF16"):
        lib.prefill_attention(*args)
    with pytest.raises(RuntimeError, match="needs AVX-512, or AVX2 and FMA \\(this build"):
        lib.prefill_attention(*args, bf16=False)
    avx2 = cpu.library("avx2") if HAS_AVX2 else None
    if avx2 is not None:
        assert avx2.prefill_attention_runs(bf16=False) and not avx2.prefill_attention_runs()
        with pytest.raises(RuntimeError, match="needs AVX-512 with AVX512-BF16"):
            avx2.prefill_attention(*args)


@pytest.mark.parametrize("bf16,build", [(True, "avx512"), (False, "avx512"), (False, "avx2")],
                         ids=["bf16", "float32", "float32-avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,L,H,KV,D,window", [
    (70, 70, 4, 2, 64, None),     # a whole prompt, two key blocks, a partial one
    (37, 150, 6, 2, 80, None),    # a chunk after 113 cached tokens; D % 32 == 16
    (100, 100, 4, 1, 64, 30),     # a sliding window inside one prompt
    (20, 300, 4, 4, 128, 50),     # a window that hides the first 230 keys; D past 64 (two passes of P V)
    (1, 33, 2, 1, 16, None),      # one query, the smallest D
    (200, 260, 9, 3, 64, None),   # SmolLM2's heads: 3 rows a position, tiles across positions, blocks off the diagonal
])
def test_prefill_attention_matches_the_torch_path(bf16, build, kv_dtype, n, L, H, KV, D, window):
    """prefill_attention over a chunk's slots gives attention._prefill's result (float32 math): in bf16
    within bf16 rounding (q * scale, K, V and the softmax weights rounded to bf16), in float32 within
    float32 rounding (AVX-512's 16 lanes, AVX2's 8), for every cache dtype (per-head scales), GQA, windows,
    chunks after a prefix, and q as a strided view (the qkv projection's output)."""
    from qtk.runtime.attention import KVCache, PrefillChunk, _bytes, _first_key, _prefill, write_kv

    lib = bf16_attention_lib(bf16, build)
    g = torch.Generator().manual_seed(L)
    quant = kv_dtype not in (torch.float32, torch.bfloat16)
    scales = (torch.rand(KV, 1, 1, generator=g) * 0.02 + 0.01, torch.rand(KV, 1, 1, generator=g) * 0.02 + 0.01) \
        if quant else (None, None)
    S = L + 40
    cache = KVCache(torch.zeros(KV, S, D, dtype=kv_dtype), torch.zeros(KV, S, D, dtype=kv_dtype), *scales)
    slots = torch.randperm(S, generator=g)[:L]
    write_kv(cache, torch.randn(L, KV, D, generator=g) * 2, torch.randn(L, KV, D, generator=g), slots)
    qkv = torch.randn(n, H + 2 * KV, D, generator=g) * 2
    q = qkv[:, :H]  # rows at a stride of H + 2 KV heads
    scale = D ** -0.5
    want = _prefill(q, cache, PrefillChunk(0, n, slots), scale, window)
    flat = (None, None) if not quant else (scales[0].reshape(-1), scales[1].reshape(-1))
    first = _first_key(n, L, window)
    got = lib.prefill_attention(q, _bytes(cache.k), _bytes(cache.v), slots[first:], window or 0, scale, *flat, bf16=bf16)
    assert got.shape == (n, H, D) and got.is_contiguous()
    step = torch.full((n + 7, H, D), float("nan"))  # out: the chunk's rows of a step's output, written in place
    back = lib.prefill_attention(q, _bytes(cache.k), _bytes(cache.v), slots[first:], window or 0, scale, *flat,
                                 bf16=bf16, out=step[5:5 + n])
    assert back.data_ptr() == step[5].data_ptr() and torch.equal(step[5:5 + n], got)
    assert step[:5].isnan().all() and step[5 + n:].isnan().all()
    err = ((got - want).norm() / want.norm()).item()
    # bf16: 2^-9 relative per rounding; float32: the exp2 polynomial's 2e-7 and the sums' order; a wrong mask
    # or block is off by O(1)
    assert err < (8e-3 if bf16 else 2e-6), err
    if window:  # the window is applied: without it the result is another one
        unwindowed = _prefill(q, cache, PrefillChunk(0, n, slots), scale, None)
        assert ((got - unwindowed).norm() / unwindowed.norm()).item() > 0.1


@pytest.mark.parametrize("bf16,build", [(True, "avx512"), (False, "avx512"), (False, "avx2")],
                         ids=["bf16", "float32", "float32-avx2"])
@pytest.mark.parametrize("rise", [0.0, 3.0, 7.5, 12.0, 40.0, 70.0])
def test_prefill_attention_as_the_maximum_rises(bf16, build, rise):
    """Scores that climb by `rise` (base 2) from one block of 64 keys to the next, so that the online softmax's
    running maximum moves and O is rescaled by up to 2^-70 (a kernel that kept the first block's maximum would
    overflow at 2^140): the torch path's result, over a bf16 cache, from the query the kernel sees (q * scale *
    log2 e, in bf16 for the bf16 math). Scores reach 2 x rise: the float32 bound grows with them."""
    from qtk.runtime.attention import KVCache, PrefillChunk, _bytes, _prefill, write_kv

    lib = bf16_attention_lib(bf16, build)
    g = torch.Generator().manual_seed(int(rise * 10))
    n, L, H, KV, D = 40, 192, 4, 2, 64  # three blocks; the queries are the last 40 positions
    scale, log2e = D ** -0.5, 1.4426950408889634
    k = torch.randn(L, KV, D, generator=g) * 0.3
    k[:, :, 0] = (torch.arange(L) // 64).float()[:, None] * rise / log2e / scale  # q . k * scale: rise per block
    q = torch.randn(n, H, D, generator=g) * 0.3
    q[:, :, 0] = 1.0
    cache = KVCache(torch.zeros(KV, L, D, dtype=torch.bfloat16), torch.zeros(KV, L, D, dtype=torch.bfloat16), None, None)
    write_kv(cache, k, torch.randn(L, KV, D, generator=g), torch.arange(L))
    seen = (q * scale * log2e).bfloat16().float() / (scale * log2e) if bf16 else q
    want = _prefill(seen, cache, PrefillChunk(0, n, torch.arange(L)), scale, None)
    got = lib.prefill_attention(q, _bytes(cache.k), _bytes(cache.v), torch.arange(L), 0, scale, bf16=bf16)
    err = ((got - want).norm() / want.norm()).item()
    assert err < (8e-3 if bf16 else 2e-6 * (1 + 2 * rise / 8)), err


@pytest.mark.parametrize("build", ["avx512", "avx2"])
def test_prefill_attention_refuses_mismatched_operands(build):
    lib = bf16_attention_lib(False, build)
    q, kc = torch.randn(3, 4, 16), torch.zeros(2, 8, 16)
    with pytest.raises(RuntimeError, match="a slot is outside the cache"):
        lib.prefill_attention(q, kc, kc, torch.tensor([0, 1, 8]), 0, 0.25, bf16=False)
    with pytest.raises(RuntimeError, match="slots must be int64 \\[L\\] with L >= n"):
        lib.prefill_attention(q, kc, kc, torch.arange(2), 0, 0.25, bf16=False)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16, got 8"):
        lib.prefill_attention(torch.randn(3, 4, 8), kc[..., :8].contiguous(), kc[..., :8].contiguous(), torch.arange(3), 0,
                              0.25, bf16=False)
    with pytest.raises(RuntimeError, match="q must be float32"):
        lib.prefill_attention(q.bfloat16(), kc, kc, torch.arange(3), 0, 0.25, bf16=False)
    with pytest.raises(RuntimeError, match="scales go with \\(and only with\\) an INT8 / FP8 cache"):
        lib.prefill_attention(q, kc, kc, torch.arange(3), 0, 0.25, torch.ones(1), torch.ones(1), bf16=False)
    with pytest.raises(RuntimeError, match="heads % kv_heads == 0"):
        lib.prefill_attention(torch.randn(3, 3, 16), kc, kc, torch.arange(3), 0, 0.25, bf16=False)
    with pytest.raises(RuntimeError, match="out must be contiguous float32 of q's shape"):
        lib.prefill_attention(q, kc, kc, torch.arange(3), 0, 0.25, bf16=False, out=torch.empty(3, 4, 32)[..., :16])


@pytest.mark.parametrize("B,H,KV,D,lens,window,softcap,sinks", [
    (16, 9, 3, 64, [256 + 7 * i for i in range(16)], 0, 0.0, False),  # a decode batch: items of one KV head
    (3, 4, 2, 80, [1, 17, 40], 0, 0.0, False),      # D % 32 == 16, a context of one key, odd lengths
    (2, 8, 1, 128, [33, 70], 20, 0.0, True),        # a window, sinks, 8 query heads per KV head
    (4, 16, 2, 64, [5, 16, 31, 100], 0, 30.0, False),  # softcap; 8 heads per KV head in passes of 8
    (1, 9, 3, 64, [300], 0, 0.0, False),            # one sequence: its heads split over the threads
])
def test_bf16_decode_attention_matches_the_float32_kernel(B, H, KV, D, lens, window, softcap, sinks):
    """paged_decode_attention_bf16 over a bf16 cache gives paged_decode_attention's result (float32
    math) within bf16 rounding of q and the softmax weights, through shuffled block tables, with
    windows, softcap, sinks, GQA and any D % 16 == 0; a wrong key, mask or lane order is off by O(1)."""
    lib = bf16_attention_lib()
    g = torch.Generator().manual_seed(B * 100 + D)
    bs, lens = 16, torch.tensor(lens)
    nblk = int((lens.max() + bs - 1) // bs)
    S = B * nblk * bs + 64
    k, v = torch.randn(KV, S, D, generator=g).bfloat16(), torch.randn(KV, S, D, generator=g).bfloat16()
    tables = torch.randperm(S // bs, generator=g)[:B * nblk].view(B, nblk).contiguous()
    qkv = torch.randn(B, H + 2 * KV, D, generator=g) * 2
    q = qkv[:, :H]  # heads of the qkv projection's output: rows at a stride
    sk = torch.randn(H, generator=g) if sinks else None
    want = lib.paged_decode_attention(q, k, v, tables, lens, bs, D ** -0.5, None, None, window, softcap, sk)
    got = lib.paged_decode_attention_bf16(q, k, v, tables, lens, bs, D ** -0.5, window, softcap, sk)
    assert got.shape == (B, H, D)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 8e-3, err
    if window:  # the window is applied: without it the result is another one
        unwindowed = lib.paged_decode_attention(q, k, v, tables, lens, bs, D ** -0.5, None, None, 0, softcap, sk)
        assert ((got - unwindowed).norm() / unwindowed.norm()).item() > 0.1


def test_bf16_decode_attention_refuses_what_it_does_not_read():
    lib = bf16_attention_lib()
    q, kc, tables, lens = torch.randn(1, 4, 16), torch.zeros(2, 16, 16).bfloat16(), torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(RuntimeError, match="caches must be contiguous bf16"):
        lib.paged_decode_attention_bf16(q, kc.float(), kc.float(), tables, lens, 16, 0.25)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16, got 8"):
        lib.paged_decode_attention_bf16(q[..., :8].contiguous(), kc[..., :8].contiguous(), kc[..., :8].contiguous(), tables, lens, 16, 0.25)
    with pytest.raises(RuntimeError, match="context longer than its block table"):
        lib.paged_decode_attention_bf16(q, kc, kc, tables, torch.tensor([17]), 16, 0.25)
    with pytest.raises(RuntimeError, match="block table points outside the cache"):
        lib.paged_decode_attention_bf16(q, kc, kc, torch.tensor([[1]]), lens, 16, 0.25)
    generic = cpu.library("generic")
    if generic is not None:
        assert not generic.prefill_attention_runs()
        with pytest.raises(RuntimeError, match="needs AVX-512 with AVX512-BF16"):
            generic.paged_decode_attention_bf16(q, kc, kc, tables, lens, 16, 0.25)


def test_bf16_linear_runs_only_with_the_bf16_dot_product():
    """Builds without AVX-512 have the bf16 layer kernel's name but not the kernel: they say so, and refuse."""
    lib = cpu.library("generic")
    if lib is None:
        pytest.skip("no C++ compiler")
    assert not lib.bf16_linear_runs()
    w = cpu.pack_bf16(torch.randn(16, 32).bfloat16().float())
    with pytest.raises(RuntimeError, match="needs AVX-512 with AVX512-BF16"):
        lib.bf16_linear(torch.randn(2, 32), w.codes, None, 16)


@pytest.mark.parametrize("M", [1, 3, 16, 21, 40])  # row tiles of 16 and every remainder kind
@pytest.mark.parametrize("N,K", [(384, 256), (24, 96), (13, 130), (8, 2)])  # odd block counts, n % 8 != 0, K % 32 != 0
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_is_the_float32_sum_of_bf16_products(M, N, K, x_dtype):
    """bf16_linear(x, codes) is x rounded to bf16 times the bf16 weight with float32 sums, plus the
    bias: within float32 summation-order error of that, y float32; with bf16_out, y rounded to bf16
    (to nearest even) from it."""
    lib = bf16_attention_lib()
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = torch.randn(N, K, generator=g).bfloat16().float()
    x = torch.randn(M, K, generator=g).to(x_dtype)
    bias = torch.randn(N, generator=g)
    packed = cpu.pack_bf16(w)
    exact = x.bfloat16().double() @ w.double().T + bias.double()
    got = lib.bf16_linear(x, packed.codes, bias, N)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), exact, atol=1e-5 * K ** 0.5, rtol=1e-5)
    assert not torch.equal(got, x.float() @ w.T + bias) or x_dtype == torch.bfloat16  # x was rounded
    rounded = lib.bf16_linear(x, packed.codes, None, N, True)
    assert rounded.dtype == torch.bfloat16
    near = (exact - bias.double()).float()
    # one bf16 rounding of a float32 that may itself be a few float32 steps away from the exact sum
    assert ((rounded.float() - near).abs() <= near.abs() * 2 ** -8 + 1e-5).all()
    if M > 1:  # strided rows: a view of every other row, and bf16 rows of a wider matrix
        wide = torch.randn(M, K + 2, generator=g).to(x_dtype)[:, :K]
        torch.testing.assert_close(lib.bf16_linear(wide, packed.codes, bias, N), lib.bf16_linear(wide.contiguous(), packed.codes, bias, N), atol=0, rtol=0)


def test_bf16_linear_refuses_mismatched_operands():
    lib = bf16_attention_lib()
    packed = cpu.pack_bf16(torch.randn(16, 32).bfloat16().float())
    with pytest.raises(RuntimeError, match="K must be even"):
        lib.bf16_linear(torch.randn(2, 31), cpu.pack_bf16(torch.randn(16, 31).bfloat16().float()).codes, None, 16)
    with pytest.raises(RuntimeError, match="codes must be int16 \\[N/8, K, 8\\]"):
        lib.bf16_linear(torch.randn(2, 64), packed.codes, None, 16)
    with pytest.raises(RuntimeError, match="codes hold 2 column blocks for n=24"):
        lib.bf16_linear(torch.randn(2, 32), packed.codes, None, 24)
    with pytest.raises(RuntimeError, match="bias must be float32 \\[16\\]"):
        lib.bf16_linear(torch.randn(2, 32), packed.codes, torch.zeros(8), 16)
    with pytest.raises(RuntimeError, match="x must be a float32 or bf16 CPU matrix"):
        lib.bf16_linear(torch.randn(2, 32).half(), packed.codes, None, 16)


@pytest.mark.parametrize("bits,group,asym", [(4, 32, True), (4, 8, False), (4, None, True), (8, 64, True),
                                             (8, None, False), (8, 2, True)])
@pytest.mark.parametrize("M", [1, 7, 8, 9, 13, 40])  # row tiles of 8 (QR) and every remainder kind
def test_woq_bf16_linear_is_the_float32_sum_of_x_in_bf16_times_the_codes(bits, group, asym, M):
    """woq_bf16_linear: x rounded to bf16 times the dequantized weight, float32 sums (the codes less their
    zeros exact in bf16, the scale once per group), plus the bias; bf16 x alike; bf16_out rounds y to bf16;
    N not a multiple of 16 nor of 8 (a last tile of one block, padded columns); rows of a wider matrix."""
    lib = bf16_attention_lib()
    k = 256
    for n in (72, 53):
        codes, scale, zero = random_layer(n, k, group, bits, asym, seed=M + n)
        if bits == 4 and zero is not None:
            zero = zero.clamp(-8, 7)
        w = cpu.pack(codes, scale, zero, bits)
        zeros = cpu.code_zeros(w)
        bias = torch.randn(n)
        x = torch.randn(M, k)
        exact = x.bfloat16().double() @ dequant(codes, scale, zero).t() + bias.double()
        got = lib.woq_bf16_linear(x, w.codes, w.scales, zeros, bias, bits, n)
        assert got.shape == (M, n) and got.dtype == torch.float32
        assert rel_err(got, exact) < 1e-5, (n, M)
        assert rel_err(got, x.double() @ dequant(codes, scale, zero).t() + bias.double()) > 1e-5  # x was rounded
        assert torch.equal(lib.woq_bf16_linear(x.bfloat16(), w.codes, w.scales, zeros, bias, bits, n), got)
        rounded = lib.woq_bf16_linear(x, w.codes, w.scales, zeros, bias, bits, n, True)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
        wide = torch.randn(M, k + 6)[:, :k]
        assert torch.equal(lib.woq_bf16_linear(wide, w.codes, w.scales, zeros, bias, bits, n),
                           lib.woq_bf16_linear(wide.contiguous(), w.codes, w.scales, zeros, bias, bits, n))


@pytest.mark.parametrize("threads", [1, 2])
def test_woq_bf16_linear_blocks_long_rows_the_same(threads):
    """K = 4096: a thread decodes its column tiles in groups (64 KB a tile: 4 at once, an odd one left over)
    and multiplies each group by x in chunks of 32 rows (4 row tiles of 8, then 4 rows); the sums are those of
    one unblocked pass."""
    lib = bf16_attention_lib()
    n, k, M = 200, 4096, 100
    codes, scale, zero = random_layer(n, k, 128, 4, True, seed=5)
    w = cpu.pack(codes, scale, zero.clamp(-8, 7), 4)
    x = torch.randn(M, k)
    exact = x.bfloat16().double() @ dequant(codes, scale, zero.clamp(-8, 7)).t()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = lib.woq_bf16_linear(x, w.codes, w.scales, cpu.code_zeros(w), None, 4, n)
    finally:
        torch.set_num_threads(before)
    assert rel_err(got, exact) < 1e-5


def test_woq_bf16_linear_refuses_what_it_does_not_read():
    lib = bf16_attention_lib()
    codes, scale, zero = random_layer(16, 64, 32, 4, True)
    w = cpu.pack(codes, scale, zero.clamp(-8, 7), 4)
    zeros, x = cpu.code_zeros(w), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="int4 needs zeros"):
        lib.woq_bf16_linear(x, w.codes, w.scales, None, None, 4, 16)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        lib.woq_bf16_linear(x, w.codes, w.scales, zeros, None, 16, 16)
    with pytest.raises(RuntimeError, match="codes \\(kernels.cpu.pack\\) do not match K=128"):
        lib.woq_bf16_linear(torch.randn(2, 128), w.codes, w.scales, zeros, None, 4, 16)
    with pytest.raises(RuntimeError, match="zeros must be int32 shaped as scales"):
        lib.woq_bf16_linear(x, w.codes, w.scales, zeros.float(), None, 4, 16)
    odd = cpu.pack(*random_layer(16, 64, 1, 8, False)[:2], None, 8)  # groups of one k: no pairs
    with pytest.raises(RuntimeError, match="64 groups do not divide K=64 into multiples of 2"):
        lib.woq_bf16_linear(x, odd.codes, odd.scales, None, None, 8, 16)
    generic = cpu.library("generic")
    if generic is not None:
        with pytest.raises(RuntimeError, match="needs AVX-512 with AVX512-BF16"):
            generic.woq_bf16_linear(x, w.codes, w.scales, zeros, None, 4, 16)


def test_code_zeros_are_the_stored_codes_zeros():
    """int4: 8 + the zero (codes stored as q + 8), symmetric too; asymmetric int8: the zero; symmetric
    int8: None; a zero that is not a whole code is refused."""
    codes, scale, zero = random_layer(16, 64, 32, 4, True)
    zero = zero.clamp(-8, 7)
    z = cpu.code_zeros(cpu.pack(codes, scale, zero, 4))
    assert z.dtype == torch.int32 and torch.equal(z.reshape(2, 2, 8).transpose(1, 2).reshape(16, 2), (zero + 8).int())
    assert torch.equal(cpu.code_zeros(cpu.pack(codes, scale, None, 4)), torch.full((2, 2, 8), 8, dtype=torch.int32))
    assert cpu.code_zeros(cpu.pack(codes, scale, None, 8)) is None
    with pytest.raises(ValueError, match="not whole codes"):
        cpu.code_zeros(cpu.pack(codes, scale, zero + 0.5, 8))


@pytest.mark.parametrize("T,I", [(1, 8), (3, 37), (5, 1536)])
def test_gelu_tanh_and_mul_matches_torch(lib, T, I):
    """Gemma's GeGLU: gelu(gate, approximate="tanh") * up, in and out of whole vectors."""
    x = torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(T)) * 4
    want = torch.nn.functional.gelu(x[:, :I], approximate="tanh") * x[:, I:]
    assert torch.allclose(lib.gelu_tanh_and_mul(x), want, rtol=1e-5, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_glu_ops_take_bf16_rows(lib, op):
    """bf16 rows in (a bf16 matmul's output), bf16 out: the float32 op's result rounded to bf16, as
    torch rounds (to nearest even), within one bf16 step where the two activations' last bits differ."""
    x = (torch.randn(5, 2 * 700, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()  # a scalar tail too
    got = getattr(lib, op)(x)
    want = getattr(lib, op)(x.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (5, 700)
    step = want.float().abs() * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.skipif(not HAS_AVX512, reason="CPU without AVX-512 + VNNI")
def test_element_wise_ops_on_16_lanes_equal_the_8_lane_ones():
    """The avx512 build runs the GLUs and the norms' row loops on 16 lanes, with the avx2 build's math lane by
    lane: the GLUs' same bits, float32 and bf16, in whole vectors of 16 and in the 8-lane and scalar tails; the
    residual's same sums; the norms within float32 rounding (the compiler sums a row's squares in 16 lanes
    there, in 8 here)."""
    wide, narrow = cpu.library("avx512"), cpu.library("avx2")
    if wide is None or narrow is None:
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2 * 700, generator=g) * 4  # 700 = 43 x 16 + 8 + 4
    x[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 200.0])
    for op in ("silu_and_mul", "gelu_tanh_and_mul"):
        for rows in (x, x.bfloat16()):
            assert torch.equal(getattr(wide, op)(rows), getattr(narrow, op)(rows)), (op, rows.dtype)
    w, res, a = torch.randn(700, generator=g), torch.randn(9, 700, generator=g), torch.randn(9, 700, generator=g)
    close = lambda a, b, bf16: rel_err(a.float(), b.float()) < (2 ** -8 if bf16 else 1e-6)  # noqa: E731
    for bf16_out in (False, True):
        assert close(wide.rms_norm(res, w, 1e-5, bf16_out), narrow.rms_norm(res, w, 1e-5, bf16_out), bf16_out)
        for added in (a, a.bfloat16()):
            r1, r2 = res.clone(), res.clone()
            y1, y2 = wide.add_rms_norm_(r1, added, w, 1e-5, bf16_out), narrow.add_rms_norm_(r2, added, w, 1e-5, bf16_out)
            assert torch.equal(r1, r2) and close(y1, y2, bf16_out)


def test_fused_forward_equals_the_torch_forward():
    """The runtime's fused CPU forward (backend "cpu") against its torch forward on a tiny model:
    the same logits at every step, float32 and INT8 KV."""
    from tests.test_runtime import hf_model
    from qtk.runtime.block_manager import BlockManager
    from qtk.runtime.model_runner import ModelRunner
    from qtk.runtime.models.native import NativeModel
    from qtk.runtime.scheduler import Scheduler, SchedulerConfig
    from qtk.runtime.sequence import Sequence

    if cpu.ops() is None:
        pytest.skip("no C++ compiler")
    model = NativeModel(hf_model("qwen3"))
    assert model.cpu_ops is not None
    for kv in (None, torch.int8):
        runs = []
        for backend in ("cpu", "torch"):
            scales = None if kv is None else [(torch.full((1, 1, 1), 0.05), torch.full((1, 1, 1), 0.05))] * len(model.layers)
            runner = ModelRunner(model, 32, 4, kv, scales, attention_backend=backend)
            sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), BlockManager(32, 4))
            for p in ([5, 6, 7, 8, 9, 10, 11], [20, 21]):
                sched.add(Sequence(p, block_size=4))
            out = []
            for _ in range(8):
                batch = sched.schedule()
                logits, _ = runner.run(batch)
                out.append(logits)
                sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
                sched.finish_step(batch, {s.seq_id: int(r.argmax()) for s, r in zip(sampling, logits)})
            runs.append(out)
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_bench_kernels_cpu_records_each_shape(tmp_path, monkeypatch):
    """`qtk bench kernels --device cpu` on a tiny stand-in model: every shape and M gets its times,
    GB/s against copy and a plain read, and the per-token sums as separate and as joined layers."""
    from qtk.bench import kernels_cpu as bench_cpu

    if cpu.ops() is None:
        pytest.skip("qtk's CPU kernel is not built here")
    monkeypatch.setitem(bench_cpu.SHAPES, "tiny", (2, [("q", 64, 16, 2, 0), ("qk", 64, 32, 0, 1)], (64, 40)))
    monkeypatch.setattr(bench_cpu, "CACHE_BYTES", 1 << 16)
    result, summary = bench_cpu.run("tiny", [1, 3], tmp_path, repeats=2)
    assert [(r["layer"], r["m"]) for r in result["rows"]] == [("q", 1), ("q", 3), ("qk", 1), ("qk", 3)]
    for r in result["rows"]:
        assert all(r["us"][a] > 0 for a in ("fp32", "int4", "int8", "deq+mm", "read"))
        assert r["gbps"]["int4"] == pytest.approx(r["weight_bytes"]["int4"] / r["us"]["int4"] / 1e3)
    t, q1, qk1 = result["decoder_ms_per_token_m1"], result["rows"][0], result["rows"][2]
    assert t["int4"] == pytest.approx(2 * 2 * q1["us"]["int4"] / 1e3)
    assert t["int4_engine"] == pytest.approx(2 * qk1["us"]["int4"] / 1e3)
    tag = result["capability"].lower()  # with the build named where QTK_CPU_KERNEL forces another
    path = tmp_path / f"kernels-cpu-tiny-{tag if tag == result['variant'] else tag + '-' + result['variant'] + '-build'}.json"
    assert json.loads(path.read_text())["rows"] == result["rows"]
    assert "| q | 64 x 16 | 1 |" in summary and result["copy_gbps"] > 0


def test_weights_move_onto_huge_pages_in_place():
    """onto_huge_pages moves each tensor into one advised buffer: the same values, every holder of a tensor sees
    the move (a layer's codes held by two runtimes), one line each, inference tensors too."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("madvise is Linux's")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (6, 9, 8), dtype=torch.int32, generator=g)
    scales = torch.rand(6, 3, 8, generator=g)
    with torch.inference_mode():
        bias = torch.randn(45)
    held = {"a": codes, "b": codes}  # one tensor, two holders
    before = [t.clone() for t in (codes, scales, bias)]
    moved = cpu.onto_huge_pages([codes, scales, codes, bias, None])
    assert moved == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in before)
    for t, b in zip((codes, scales, bias), before):
        assert torch.equal(t, b) and t.is_contiguous() and t.data_ptr() % 64 == 0
    assert held["a"].data_ptr() == held["b"].data_ptr() == codes.data_ptr()
    storages = {t.untyped_storage().data_ptr() for t in (codes, scales, bias)}
    assert len(storages) == 1  # one buffer
    assert cpu.onto_huge_pages([]) == 0
