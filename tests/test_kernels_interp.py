"""Every Triton kernel under the Triton interpreter against its pure-torch twin, on fresh random inputs.

triton picks compile-or-interpret when @triton.jit runs, i.e. when triton.language and qtk's
kernel modules are imported, so setting TRITON_INTERPRET=1 later changes nothing by itself.
`interpreted(mp)` switches a running session over instead: while a test runs, launching a
JITFunction (kernel[grid](...)) or calling one from a kernel (qtk's helpers, tl.zeros, ...)
goes through an InterpretedFunction of the same Python function, with TRITON_INTERPRET=1 set
for the code that reads it at run time. The rest of the session keeps the compiled kernels.
The interpreter keeps bf16 as raw uint16 bits: its tl.dot multiplies the bits, and its fp32 ->
bf16 / fp8 casts truncate instead of rounding to nearest even (and do not saturate);
`exact_interpreter` substitutes torch's conversions for these, so the kernels are measured,
not the interpreter. Shapes are small and blocks large: a program instance costs about 1 ms.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
import triton.language as tl

from qtk.kernels import act_quant, fp8, reference, w4a16, w8a8
from qtk.kernels.layout import pack_woq

OUTER_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the whole session interprets already


def interpreted(mp: pytest.MonkeyPatch) -> None:
    """Run every JITFunction through the interpreter while `mp` is active."""
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    twins: dict = {}

    def twin(fn: JITFunction) -> interpreter.InterpretedFunction:
        # keyed by id: hashing a JITFunction walks its globals, which the interpreter has patched
        if id(fn) not in twins:
            twins[id(fn)] = interpreter.InterpretedFunction(fn.fn)
        return twins[id(fn)]

    def call(self, *args, **kwargs):
        # as InterpretedFunction.__call__, but undoing its patches of triton.language afterwards:
        # left in place they break every later compile in the session
        scope = interpreter._patch_lang(self.fn)
        try:
            return twin(self).rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    mp.setenv("TRITON_INTERPRET", "1")
    mp.setattr(JITFunction, "__getitem__", lambda self, grid: twin(self)[grid])
    mp.setattr(JITFunction, "__call__", call)


def _torch_cast(data: np.ndarray, dst: torch.dtype, bits: type) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(dst).view(
        torch.int16 if bits is np.uint16 else torch.uint8).numpy().view(bits)


def exact_interpreter(mp: pytest.MonkeyPatch) -> None:
    """Round-to-nearest-even fp32 -> bf16/fp8 casts and a float tl.dot on bf16/fp8 operands."""
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    to_f32 = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn}
    bits_of = {tl.bfloat16: np.uint16, tl.float8e4nv: np.uint8}

    def as_f32(h):
        if h.dtype.scalar in to_f32:  # raw bits -> float32 values
            t = torch.from_numpy(np.ascontiguousarray(h.data)).view(to_f32[h.dtype.scalar]).float()
            return ti.TensorHandle(t.numpy(), tl.float32)
        return h

    def narrowing(orig):
        def cast(self, src, dst_type, *rest):
            if src.dtype.scalar == tl.float32 and dst_type.scalar in to_f32:
                data = _torch_cast(src.data, to_f32[dst_type.scalar], bits_of[dst_type.scalar])
                return ti.TensorHandle(data, dst_type.scalar)
            return orig(self, src, dst_type, *rest)
        return cast

    orig_dot = builder.create_dot

    def create_dot(self, a, b, d, *rest):
        if a.dtype.scalar in to_f32 or b.dtype.scalar in to_f32:
            a, b = as_f32(a), as_f32(b)
        return orig_dot(self, a, b, d, *rest)

    mp.setattr(builder, "cast_impl", narrowing(builder.cast_impl))
    mp.setattr(builder, "create_fp_to_fp", narrowing(builder.create_fp_to_fp))
    mp.setattr(builder, "create_dot", create_dot)


def language_state() -> dict:
    """What the interpreter patches: the attributes of triton.language and its tensor and dtype."""
    return {(id(obj), name): value for obj in (tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype)
            for name, value in vars(obj).items()}


@contextlib.contextmanager
def exact_interpretation():
    """Kernels run in the (exact) interpreter inside; triton.language is left as it was found
    (later compiles in the session depend on it)."""
    before = language_state()
    with pytest.MonkeyPatch.context() as mp:
        if not OUTER_INTERPRET:
            interpreted(mp)
        exact_interpreter(mp)
        yield
    if not OUTER_INTERPRET:  # an interpreting session leaves the patches itself (nested jit calls)
        after = language_state()
        assert [k for k in before if before[k] is not after.get(k)] == [], "triton.language left patched"


@pytest.fixture(autouse=True)
def interpreter():
    """Every test in this file runs its kernels in the exact interpreter."""
    with exact_interpretation():
        yield


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(1234)


def assert_close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """max |y - ref| <= tol * max |ref| (both finite)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all()
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * scale + 1e-6, f"max error {err:.3g} > {tol} * {scale:.3g}"


# tolerances: the kernel rounds the dequantized weight to A's dtype before tl.dot, the twin does not
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def random_woq(n, k, group, bits, asym, dtype):
    """Random codes, positive scales and zero points -> run-time layout."""
    half = 1 << (bits - 1)
    groups = 1 if group is None else k // group
    codes = torch.randint(-half, half, (n, k), dtype=torch.int8)
    scale = torch.rand(n, groups) * 0.02 + 0.002
    zp = torch.randint(-half, half, (n, groups), dtype=torch.int8) if asym else None
    return pack_woq(codes, scale, zp, bits, group, dtype)


# (M, N, K, group, bits, asym, dtype, bias, config); config (gemv, bm, bn, bk, split_k) or None
WOQ_CASES = [
    (1, 96, 256, 32, 4, False, torch.float16, False, None),
    (3, 33, 256, 64, 4, True, torch.bfloat16, True, None),
    (2, 50, 256, 128, 4, True, torch.float16, True, (True, 2, 32, 64, 2)),
    (1, 33, 100, None, 4, True, torch.bfloat16, True, None),
    (4, 40, 96, 32, 8, False, torch.bfloat16, False, None),
    (3, 17, 77, None, 8, True, torch.float16, True, (True, 4, 16, 32, 3)),
    (17, 40, 256, 64, 4, False, torch.float16, True, None),
    (33, 40, 256, 128, 4, True, torch.bfloat16, True, (False, 32, 32, 64, 2)),
    (5, 33, 128, 32, 4, True, torch.bfloat16, False, None),
    (33, 24, 100, None, 4, False, torch.float16, True, None),
    (19, 64, 192, 64, 8, True, torch.bfloat16, True, None),
    (65, 48, 128, None, 8, False, torch.float16, False, (False, 64, 32, 32, 1)),
    (256, 40, 256, 64, 4, True, torch.bfloat16, True, None),  # W^T decoded, then torch.mm
    (300, 33, 96, None, 8, False, torch.float16, False, None),
]


@pytest.mark.parametrize("m,n,k,group,bits,asym,dtype,bias,cfg", WOQ_CASES)
def test_woq_gemm(m, n, k, group, bits, asym, dtype, bias, cfg):
    w = random_woq(n, k, group, bits, asym, dtype)
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    config = None if cfg is None else w4a16.WOQConfig(*cfg[1:], gemv=cfg[0])
    y = w4a16.woq_gemm(a, w.qweight, w.scales, w.zeros, b, bits, group, config=config)
    ref = reference.woq_gemm_ref(a, w.qweight, w.scales, w.zeros, b, bits, group)
    assert_close(y, ref, TOL[dtype])


@pytest.mark.parametrize("group,bits,asym,dtype", [(64, 4, True, torch.bfloat16), (32, 4, False, torch.float16),
                                                    (None, 8, True, torch.bfloat16), (None, 4, False, torch.float16)])
def test_woq_dequant_is_the_layout_twin(group, bits, asym, dtype):
    """The kernel's W^T is layout.dequant_woq's, rounded once to dtype (tails in K and N too)."""
    from qtk.kernels.layout import dequant_woq

    k = 192 if group else 100
    w = random_woq(150, k, group, bits, asym, dtype)
    wt = w4a16.woq_dequant(w.qweight, w.scales, w.zeros, bits, group, k, dtype)
    assert wt.shape == (k, 150) and wt.dtype == dtype
    assert torch.equal(wt, dequant_woq(w.qweight, w.scales, w.zeros, bits, group, k).to(dtype))


def test_woq_gemm_strided_rows():
    """A may be a row slice of a wider buffer (stride(0) > K)."""
    w = random_woq(40, 128, 64, 4, True, torch.float16)
    buf = torch.randn(3, 160).half()
    a = buf[:, 16:144]
    y = w4a16.woq_gemm(a, w.qweight, w.scales, w.zeros, None, 4, 64)
    assert_close(y, reference.woq_gemm_ref(a, w.qweight, w.scales, w.zeros, None, 4, 64), TOL[torch.float16])


# (M, K, out dtype, static scale, x dtype, block_k override)
ACT_CASES = [
    (5, 100, torch.int8, False, torch.float16, None),
    (3, 300, torch.int8, False, torch.bfloat16, 64),
    (4, 64, torch.int8, True, torch.bfloat16, None),
    (7, 130, torch.float8_e4m3fn, False, torch.bfloat16, None),
    (2, 96, torch.float8_e4m3fn, True, torch.float16, 32),
    (3, 48, torch.int8, False, torch.float32, None),
]


@pytest.mark.parametrize("m,k,out,static,dtype,block_k", ACT_CASES)
def test_act_quant(m, k, out, static, dtype, block_k):
    x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
    x[0, :] = 0  # an all-zero token gets the eps scale
    qmax = 448.0 if out == torch.float8_e4m3fn else 127.0
    s = (x.float().abs().amax() / qmax * 0.7).reshape(1) if static else None  # static clips some values
    q, scale = act_quant.act_quant(x, out, s, block_k=block_k)
    q_ref, scale_ref = reference.act_quant_ref(x, out, s)
    assert q.dtype == out and scale.dtype == torch.float32
    assert torch.equal(scale.reshape(scale_ref.shape), scale_ref)
    assert torch.equal(q.float(), q_ref.float())


# (M, N, K, per-token activations, per-channel weights, bias, out dtype, split_k)
MM_CASES = [
    (5, 33, 100, True, True, True, torch.bfloat16, 1),
    (17, 40, 256, False, True, False, torch.float16, 2),
    (1, 24, 64, True, False, True, torch.float16, 1),
    (33, 20, 130, True, True, True, torch.bfloat16, 3),
]


def random_scaled_operands(m, n, k, per_token, per_channel, bias, out, code_dtype):
    if code_dtype == torch.int8:
        a_q = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        w_q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    else:
        a_q = (torch.randn(m, k) * 100).clamp(-448, 448).to(code_dtype)
        w_q = (torch.randn(n, k) * 100).clamp(-448, 448).to(code_dtype)
    a_scale = torch.rand(m, 1) * 0.01 + 1e-3 if per_token else torch.tensor([0.004])
    w_scale = (torch.rand(n, 1) * 0.01 + 1e-3).to(out) if per_channel else torch.tensor([0.003])
    b = torch.randn(n).to(out) if bias else None
    return a_q, w_q, a_scale, w_scale, b


@pytest.mark.parametrize("m,n,k,per_token,per_channel,bias,out,split", MM_CASES)
def test_int8_gemm(m, n, k, per_token, per_channel, bias, out, split):
    ops = random_scaled_operands(m, n, k, per_token, per_channel, bias, out, torch.int8)
    cfg = w8a8.MMConfig(16 if m <= 16 else 32, 32, 64, split)
    y = w8a8.int8_gemm(*ops, out_dtype=out, config=cfg)
    assert_close(y, reference.scaled_mm_ref(*ops, out), 1e-3 if out == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("m,n,k,per_token,per_channel,bias,out,split", MM_CASES[:2] + [
    (20, 16, 64, False, False, False, torch.float16, 2)])
def test_fp8_gemm_triton(m, n, k, per_token, per_channel, bias, out, split):
    ops = random_scaled_operands(m, n, k, per_token, per_channel, bias, out, torch.float8_e4m3fn)
    cfg = w8a8.MMConfig(16 if m <= 16 else 32, 32, 64, split)
    y = fp8.fp8_gemm(*ops, out_dtype=out, backend=fp8.Fp8Backend.TRITON, config=cfg)
    assert_close(y, reference.scaled_mm_ref(*ops, out), 2e-3 if out == torch.bfloat16 else 5e-4)


def test_fp8_auto_falls_back_to_triton_off_gpu():
    """AUTO never picks torch._scaled_mm without an sm_89+ GPU; SCALED_MM then refuses."""
    ops = random_scaled_operands(3, 16, 32, True, True, False, torch.bfloat16, torch.float8_e4m3fn)
    y = fp8.fp8_gemm(*ops, out_dtype=torch.bfloat16)
    assert_close(y, reference.scaled_mm_ref(*ops, torch.bfloat16), 2e-3)
    with pytest.raises(ValueError, match="_scaled_mm"):
        fp8.fp8_gemm(*ops, out_dtype=torch.bfloat16, backend=fp8.Fp8Backend.SCALED_MM)


def test_w8a8_pipeline():
    """act_quant then int8_gemm equals the reference QuantLinear math on the same operands."""
    x = torch.randn(6, 80).to(torch.bfloat16)
    w_q = torch.randint(-127, 128, (24, 80), dtype=torch.int8)
    w_scale = (torch.rand(24, 1) * 0.01).to(torch.bfloat16)
    q, s = act_quant.act_quant(x, torch.int8)
    y = w8a8.int8_gemm(q, w_q, s, w_scale, None, torch.bfloat16)
    q_ref, s_ref = reference.act_quant_ref(x, torch.int8)
    ref = ((q_ref.float() * s_ref) @ (w_q.float() * w_scale.float()).t()).to(torch.bfloat16)
    assert_close(y, ref, 1e-2)


def test_gemms_take_empty_operands():
    """M = 0 or N = 0 launches nothing and K = 0 writes the bias (no split of zero tiles)."""
    w = random_woq(40, 64, 32, 4, False, torch.float16)
    no_cols = torch.zeros(8, 0, dtype=torch.int32), torch.zeros(2, 0).half()
    for cfg in (None, w4a16.WOQConfig(16, 32, 32)):
        y = w4a16.woq_gemm(torch.randn(0, 64).half(), w.qweight, w.scales, None, None, 4, 32, config=cfg)
        assert y.shape == (0, 40)
        assert w4a16.woq_gemm(torch.randn(8, 64).half(), *no_cols, None, None, 4, 32, config=cfg).shape == (8, 0)
    w_q = torch.randint(-128, 128, (24, 64), dtype=torch.int8)
    for a_scale in (torch.rand(0, 1), torch.tensor([0.01])):
        assert w8a8.int8_gemm(w_q[:0], w_q, a_scale, torch.rand(24), None, torch.float16).shape == (0, 24)
    assert w8a8.int8_gemm(w_q[:3], w_q[:0], torch.rand(3, 1), torch.rand(0), None, torch.float16).shape == (3, 0)
    a_fp8 = torch.zeros(0, 64).to(torch.float8_e4m3fn)
    assert fp8.fp8_gemm(a_fp8, w_q.float().to(torch.float8_e4m3fn), torch.rand(0, 1), torch.rand(24), None,
                        torch.bfloat16).shape == (0, 24)
    bias = torch.randn(24).half()
    y = w8a8.int8_gemm(w_q[:3, :0], w_q[:, :0], torch.rand(3, 1), torch.rand(24), bias, torch.float16)
    assert torch.equal(y, bias.expand(3, 24))
    for cfg in (None, w4a16.WOQConfig(16, 32, 32)):
        y = w4a16.woq_gemm(torch.randn(3, 0).half(), torch.zeros(0, 24, dtype=torch.int32), torch.rand(1, 24).half(),
                           None, bias, 4, None, config=cfg)
        assert torch.equal(y, bias.expand(3, 24))


def test_act_quant_op_checks_operands_in_every_mode():
    """torch.ops.qtk.act_quant refuses what the Triton launcher refuses, on CPU and in fake mode too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qtk.kernels import ops  # noqa: F401  registers torch.ops.qtk.*

    bad = [((torch.randn(64, 5).t(), torch.int8, None), "contiguous along dim 1"),
           ((torch.randn(5, 64).double(), torch.int8, None), "X must be one of"),
           ((torch.randn(5, 64), torch.int8, torch.rand(3)), "one value")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            act_quant.act_quant(*args)
        with pytest.raises(ValueError, match=msg):
            torch.ops.qtk.act_quant(*args)
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=msg):
            torch.ops.qtk.act_quant(*args)


def test_fp8_codes_refused_before_sm89(monkeypatch):
    """Triton has no e4m3 type before sm_89: FP8 activation codes there are a ValueError, not a
    compile error on the first call (fake CUDA tensors stand in for a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="sm_89"):
            act_quant.act_quant(x, torch.float8_e4m3fn)


# -- a checkpoint-layout QuantLinear through the runtime dispatch builds for a GPU ----------------

@pytest.mark.parametrize("scheme,group,act_order,dtype", [
    ("w4a16_asym", 32, True, torch.bfloat16),
    ("w4a16", 128, False, torch.float16),
    ("w8a16", None, False, torch.bfloat16),
])
def test_quant_linear_woq_runtime(scheme, group, act_order, dtype):
    from test_kernels import quant_linear

    from qtk.kernels import dispatch

    layer = quant_linear(scheme, n=40, k=256, group=group, dtype=dtype)
    if act_order:
        layer.register_buffer("weight_g_idx", (torch.randperm(256) // group).to(torch.int32))
    rt = dispatch.build_runtime(layer, torch.device("cuda"), dtype)
    assert isinstance(rt, dispatch.WOQTriton) and (rt.w.perm is not None) == act_order
    x = torch.randn(3, 256).to(dtype)
    xs = x if rt.w.perm is None else x.index_select(1, rt.w.perm)
    for m in (1, 3):  # the GEMV path, then the tiled path with a forced config
        cfg = None if m == 1 else w4a16.WOQConfig(16, 32, 32)
        y = w4a16.woq_gemm(xs[:m], rt.w.qweight, rt.w.scales, rt.w.zeros, rt.bias, rt.w.bits, rt.w.group_size,
                           config=cfg)
        assert_close(y, reference.quant_linear_ref(x[:m], layer), TOL[dtype])


@pytest.mark.parametrize("static", [False, True])
def test_quant_linear_w8a8_runtime(static):
    from test_kernels import quant_linear

    from qtk.kernels import dispatch

    layer = quant_linear("w8a8", n=40, k=96, dtype=torch.bfloat16)
    if static:  # the same layer with a static per-tensor input scale
        from dataclasses import replace

        act = replace(layer.scheme.input_activations, strategy="tensor", dynamic=False)
        layer.scheme = replace(layer.scheme, input_activations=act)
        layer.register_buffer("input_scale", torch.tensor([2.5 / 127]).bfloat16())
    rt = dispatch.build_runtime(layer, torch.device("cuda"), torch.bfloat16)
    assert type(rt) is dispatch.W8A8
    x = torch.randn(5, 96).bfloat16()
    q, s = act_quant.act_quant(x, rt.weight.dtype, rt.input_scale_for(x))
    y = w8a8.scaled_mm(q, rt.weight, s, rt.w_scale, rt.bias, x.dtype)
    assert_close(y, reference.quant_linear_ref(x, layer), TOL[torch.bfloat16])


def test_bench_rows_on_tiny_shapes(monkeypatch):
    """The benchmark's cases and figures, with the interpreter standing in for a GPU and a fixed
    clock standing in for do_bench (which needs CUDA)."""
    from qtk.bench import kernels_gpu as bench

    monkeypatch.setattr(bench, "median_us", lambda fn, graph=False: (fn(), 10.0 if graph else 30.0)[1])
    rows = bench.bench_shape("tiny", 128, 48, [1, 17], torch.float16, torch.device("cpu"), hbm=1e12,
                             peaks={"fp16": 1e14, "int8": 2e14})
    assert {r.kernel for r in rows} == {"w4a16_g128", "w4a16_g128_tiled", "w4a16_asym_g128", "w4a16_channel", "w8a16", "w8a8_int8"}
    for r in rows:
        assert r.us == 10.0 and r.us_eager == 30.0 and r.speedup_vs_matmul == 1.0 and r.max_rel_err < 2e-2
        assert r.tflops == pytest.approx(2 * r.m * 48 * 128 / 10.0 * 1e-6)
        assert 0 < r.limit_fraction < 1 and r.gbps > 0
    assert len(bench.table(rows).splitlines()) == len(rows) + 1


ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one unit in the last place, relative


def within_ulp(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element within one unit in the last place of ref's dtype (float32: a few; the fused
    kernels sum in another order than torch's reductions and exp), and in 16-bit dtypes, where the
    rounding hides that order, nearly all of them equal."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    diff = (y.float() - ref.float()).abs()
    assert (diff <= ULP[ref.dtype] * ref.float().abs() + 1e-30).all(), f"max diff {diff.max():.3g}"
    if ref.dtype != torch.float32:
        assert (diff == 0).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_add_rms_norm_is_the_residual_add_then_llama_rms_norm(dtype):
    """kernels/fused.py's norms against transformers' LlamaRMSNorm and `h = h + a`: the sum rounded
    as torch rounds it, written into h; the norm within a unit in the last place."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from qtk.kernels import fused

    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(96) + 0.5).to(dtype)
    h, a = (torch.randn(5, 96) * 3).to(dtype), torch.randn(5, 96).to(dtype)
    with torch.no_grad():
        within_ulp(fused.rms_norm(h, norm.weight, 1e-5), norm(h))
        want_h = h + a
        y = fused.add_rms_norm_(h, a, norm.weight, 1e-5)
        assert torch.equal(h, want_h)
        within_ulp(y, norm(want_h))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_is_rope_on_q_and_k_side_by_side(dtype):
    """RoPE over the q and k heads of a qkv projection's rows (v untouched), each product and sum
    rounded as models.native.rope_'s torch ops round them."""
    from qtk.kernels import fused
    from qtk.runtime.models.native import rope_

    T, H, KV, D = 3, 4, 2, 16
    y = torch.randn(T, (H + 2 * KV) * D).to(dtype)
    angles = torch.rand(T, D // 2) * 6
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want = y.clone().view(T, H + 2 * KV, D)
    rope_(want[:, :H + KV], cos[:, None], sin[:, None])
    fused.rope_(y, cos, sin, H + KV)
    assert torch.equal(y.view(T, H + 2 * KV, D), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_silu_and_mul_is_the_silu_glu(dtype):
    from qtk.kernels import fused
    from qtk.runtime.models.native import GLU

    x = (torch.randn(4, 2 * 1100) * 4).to(dtype)  # two blocks of columns, the second partial
    gate, up = x.chunk(2, dim=-1)
    within_ulp(fused.silu_and_mul(x), GLU["silu"][0](gate, up))
