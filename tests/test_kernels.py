"""qtk.kernels on CPU: the run-time layout, dispatch (torch's CPU int ops vs the reference),
the custom ops (schema, fake tensors, torch.compile), input checks and the benchmark's guard.
The Triton kernels themselves: tests/test_kernels_interp.py (interpreter) and
tests/test_kernels_aot.py (compiled for sm_80 / sm_90)."""
from __future__ import annotations

import pytest
import torch

from qtk.kernels import act_quant, dispatch, reference, w4a16, w8a8
from qtk.kernels import cpu as cpu_kernels
from qtk.kernels.layout import dequant_woq, pack_woq, unpack_woq
from qtk.quant import quantize_weight
from qtk.quant_linear import QuantLinear
from qtk.schemes import preset


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def quant_linear(scheme_name, n=48, k=128, group=None, dtype=torch.float32, bias=True, static_absmax=3.0):
    """A QuantLinear of a random Linear, RTN-quantized with the preset (and group size)."""
    scheme = preset(scheme_name, group)
    w = torch.randn(n, k) * 0.05
    q, scale, zp = quantize_weight(w, scheme.weights)
    input_scale = None
    act = scheme.input_activations
    if act is not None and not act.dynamic:
        input_scale = torch.tensor([static_absmax / (448.0 if act.type == "float" else 127.0)])
    b = torch.randn(n) if bias else None
    return QuantLinear.from_codes(q, scale, zp, scheme, bias=b, input_scale=input_scale, dtype=dtype)


def rel_err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# -- run-time layout -------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group,asym", [(4, 32, False), (4, 64, True), (4, 128, True), (4, None, True),
                                             (8, None, False), (8, 64, True)])
def test_pack_woq_matches_checkpoint_dequant(bits, group, asym):
    """Repacking a checkpoint-layout QuantLinear keeps every dequantized weight bit-exact."""
    name = {4: "w4a16_asym" if asym else "w4a16", 8: "w8a16"}[bits]
    scheme = preset(name, group if group else -1)
    if bits == 8 and asym:
        from dataclasses import replace
        scheme = replace(scheme, weights=replace(scheme.weights, symmetric=False))
    w = torch.randn(40, 256)
    q, scale, zp = quantize_weight(w, scheme.weights)
    layer = QuantLinear.from_codes(q, scale, zp, scheme, dtype=torch.bfloat16)
    rt = pack_woq(layer.codes(), layer.weight_scale, layer.zero_point(), bits, group)
    assert rt.qweight.shape == (256 * bits // 32, 40) and rt.qweight.dtype == torch.int32
    assert (rt.zeros is None) == (not asym)
    assert torch.equal(dequant_woq(rt.qweight, rt.scales, rt.zeros, bits, group, 256),
                       layer.dequantized_weight(torch.float32).t())


def test_unpack_woq_round_trip_odd_k():
    codes = torch.randint(-8, 8, (5, 77), dtype=torch.int8)
    rt = pack_woq(codes, torch.ones(5, 1), None, 4, None)
    assert rt.qweight.shape == (10, 5)
    assert torch.equal(unpack_woq(rt.qweight, 4, 77), (codes.long() + 8).t())


def test_symmetric_int4_layout_is_gptq_qweight():
    """Word r of column n holds rows 8r..8r+7, lowest nibble first: GPTQ's qweight [K/8, N]."""
    codes = torch.randint(-8, 8, (3, 16), dtype=torch.int8)
    qweight = pack_woq(codes, torch.ones(3, 1), None, 4, None).qweight
    u = (codes.long() + 8).t()  # [K, N]
    expected = sum(u[j::8] << (4 * j) for j in range(8))
    assert torch.equal(qweight.long() & 0xFFFFFFFF, expected)


# -- dispatch on CPU ---------------------------------------------------------------------------

@pytest.fixture(params=["units", "no units"])
def cpu_units(request, monkeypatch):
    """Run as a CPU with bf16 and int8 dot-product units, then as one without (AVX2): the torch CPU ops
    run on either (slowly where emulated), so both sides of each dispatch rule are checked anywhere."""
    on = request.param == "units"
    monkeypatch.setenv("QTK_CPU_BF16", "1" if on else "0")
    monkeypatch.setenv("QTK_CPU_VNNI", "1" if on else "0")
    return on


def int8_dot_runtime():
    """W8A8 int8 on a CPU with int8 dot products: qtk's VNNI kernel where its build has one (the
    avx512 build), else torch._int_mm."""
    lib = cpu_kernels.ops()
    return dispatch.CpuW8A8Vnni if lib is not None and lib.compiled_vnni() else dispatch.CpuW8A8Int


# (scheme, group, x dtype, runtime on a CPU with bf16/int8 units, runtime without them (AVX2)).
# CpuWOQ is qtk's own kernel (kernels/cpu.py); with QTK_CPU_KERNEL=off (or no compiler) it is Dense,
# the reference's float32 matmul on a decoded weight. I8: int8_dot_runtime().
W, D, I8 = dispatch.CpuWOQ, dispatch.Dense, "int8 dot"
DISPATCH = [
    ("w4a16", 32, torch.bfloat16, dispatch.CpuInt4, W),
    ("w4a16_asym", 64, torch.bfloat16, dispatch.CpuInt4, W),
    ("w4a16", 128, torch.bfloat16, dispatch.CpuInt4, W),
    ("w4a16", -1, torch.bfloat16, W, W),  # per channel: torch's int4 op needs groups
    ("w4a16", 32, torch.float32, W, W),
    ("w4a16_asym", 32, torch.float16, W, W),
    ("w8a16", None, torch.bfloat16, dispatch.CpuInt8, W),
    ("w8a16", None, torch.float32, W, W),
    ("w8a8", None, torch.float32, I8, dispatch.CpuW8A8Woq),
    ("w8a8", None, torch.bfloat16, I8, dispatch.CpuW8A8Woq),
    ("fp8", None, torch.bfloat16, D, D),
    ("fp8_static", None, torch.float32, D, D),
]


@pytest.mark.parametrize("kernel", ["auto", "off"])
@pytest.mark.parametrize("scheme,group,dtype,with_units,without", DISPATCH)
def test_cpu_dispatch_agrees_with_reference(scheme, group, dtype, with_units, without, kernel, cpu_units,
                                            monkeypatch):
    monkeypatch.setenv("QTK_CPU_KERNEL", "" if kernel == "auto" else kernel)
    layer = quant_linear(scheme, group=group, dtype=dtype)
    x = torch.randn(2, 5, 128).to(dtype)
    y = layer(x)
    expected = with_units if cpu_units else without
    expected = int8_dot_runtime() if expected == I8 else expected
    if expected in (W, dispatch.CpuW8A8Woq) and (kernel == "off" or cpu_kernels.ops() is None):
        expected = D
    assert type(dispatch.runtime_for(layer, x.reshape(-1, 128))) is expected
    ref = reference.quant_linear_ref(x, layer)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    assert rel_err(y, ref) < (1.5e-2 if dtype == torch.bfloat16 else 1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dynamic", [False, True])
def test_per_tensor_w8a8_on_cpu(cpu_units, dynamic):
    """Static and dynamic per-tensor activation scales (per token is in the dispatch table)."""
    from dataclasses import replace

    scheme = preset("w8a8")
    scheme = replace(scheme, input_activations=replace(scheme.input_activations, strategy="tensor", dynamic=dynamic))
    w = torch.randn(32, 64) * 0.05
    q, scale, zp = quantize_weight(w, scheme.weights)
    static = None if dynamic else torch.tensor([2.0 / 127])
    layer = QuantLinear.from_codes(q, scale, zp, scheme, input_scale=static, dtype=torch.float32)
    x = torch.randn(7, 64)
    without = dispatch.CpuW8A8Woq if cpu_kernels.ops() else dispatch.Dense
    assert isinstance(dispatch.runtime_for(layer, x), int8_dot_runtime() if cpu_units else without)
    assert rel_err(layer(x), reference.quant_linear_ref(x, layer)) < 1e-5


def test_int8_cpu_op_needs_k_multiple_of_16(monkeypatch):
    """torch._weight_int8pack_mm is wrong (or crashes) for K % 16 != 0: qtk's kernel runs then."""
    monkeypatch.setenv("QTK_CPU_BF16", "1")
    layer = quant_linear("w8a16", k=40, dtype=torch.bfloat16)
    x = torch.randn(3, 40).bfloat16()
    assert isinstance(dispatch.runtime_for(layer, x), dispatch.CpuWOQ if cpu_kernels.ops() else dispatch.Dense)
    assert rel_err(layer(x), reference.quant_linear_ref(x, layer)) < 1e-2


def test_act_order_on_cpu(cpu_units):
    """g_idx layers are served with columns sorted by group (x gathered the same way)."""
    n, k, g = 32, 128, 32
    layer = quant_linear("w4a16", n=n, k=k, group=g, dtype=torch.bfloat16)
    layer.register_buffer("weight_g_idx", (torch.randperm(k) // g).to(torch.int32))
    x = torch.randn(4, k).bfloat16()
    rt = dispatch.runtime_for(layer, x)
    expected = dispatch.CpuInt4 if cpu_units else dispatch.CpuWOQ if cpu_kernels.ops() else None
    assert isinstance(rt, expected) and rt.perm is not None if expected else isinstance(rt, dispatch.Dense)
    assert rel_err(layer(x), reference.quant_linear_ref(x, layer)) < 1.5e-2


def test_runtime_cache_is_not_state_and_follows_the_weights():
    layer = quant_linear("w4a16", group=32, dtype=torch.bfloat16)
    keys = list(layer.state_dict())
    x = torch.randn(3, 128).bfloat16()
    y0 = layer(x)
    assert list(layer.state_dict()) == keys and hasattr(layer, "_qtk_runtime")
    other = quant_linear("w4a16", group=32, dtype=torch.bfloat16)
    layer.load_state_dict(other.state_dict())
    y1 = layer(x)
    assert not torch.equal(y0, y1)
    assert rel_err(y1, other(x)) == 0
    layer.float()  # .to() replaces the tensors: an fp32 runtime (the reference) is rebuilt
    assert rel_err(layer(x.float()), reference.quant_linear_ref(x.float(), layer)) < 1e-6


def test_prepare_builds_every_runtime(monkeypatch):
    monkeypatch.setenv("QTK_CPU_BF16", "1")
    monkeypatch.setenv("QTK_CPU_VNNI", "1")
    model = torch.nn.Sequential(quant_linear("w4a16", group=64, dtype=torch.bfloat16),
                                quant_linear("w8a8", k=48, dtype=torch.bfloat16))
    dispatch.prepare(model, "cpu", torch.bfloat16)
    assert isinstance(model[0]._qtk_runtime.runtime, dispatch.CpuInt4)
    assert isinstance(model[1]._qtk_runtime.runtime, int8_dot_runtime())


# -- custom ops ----------------------------------------------------------------------------------

def op_samples():
    w = pack_woq(torch.randint(-8, 8, (24, 64), dtype=torch.int8), torch.rand(24, 2) + 0.1,
                 torch.randint(-8, 8, (24, 2), dtype=torch.int8), 4, 32, torch.bfloat16)
    a = torch.randn(3, 64).bfloat16()
    woq = (a, w.qweight, w.scales, w.zeros, torch.randn(24).bfloat16(), 4, 32)
    aq = (torch.randn(5, 40).half(), torch.int8, None)
    aq_static = (torch.randn(5, 40).bfloat16(), torch.float8_e4m3fn, torch.tensor([0.01]))
    mm = (torch.randint(-128, 128, (5, 64), dtype=torch.int8), torch.randint(-128, 128, (24, 64), dtype=torch.int8),
          torch.rand(5, 1), torch.rand(24, 1).bfloat16(), None, torch.bfloat16)
    return [(torch.ops.qtk.woq_gemm, woq), (torch.ops.qtk.act_quant, aq), (torch.ops.qtk.act_quant, aq_static),
            (torch.ops.qtk.scaled_mm, mm)]


@pytest.mark.parametrize("index", range(4))
def test_custom_op_opcheck(index):
    op, args = op_samples()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_custom_ops_compile_fullgraph():
    """torch.compile captures all three ops in one graph (fake kernels give the shapes)."""
    (_, woq), (_, aq), _, (_, mm) = op_samples()

    def f(woq, aq, mm):
        y = torch.ops.qtk.woq_gemm(*woq)
        q, s = torch.ops.qtk.act_quant(*aq)
        return y, q, s, torch.ops.qtk.scaled_mm(*mm)

    eager = f(woq, aq, mm)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(woq, aq, mm)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("scheme,group", [("w4a16", 32), ("w8a8", None)])
def test_quant_linear_compiles_fullgraph(scheme, group):
    layer = quant_linear(scheme, group=group, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 128).bfloat16()
    eager = layer(x)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), eager)


def test_cpu_ops_are_the_reference_twins():
    (_, woq), (_, aq), _, (_, mm) = op_samples()
    assert torch.equal(torch.ops.qtk.woq_gemm(*woq), reference.woq_gemm_ref(*woq))
    assert torch.equal(torch.ops.qtk.scaled_mm(*mm), reference.scaled_mm_ref(*mm))


# -- input checks -------------------------------------------------------------------------------

def woq_args(**over):
    w = pack_woq(torch.randint(-8, 8, (24, 64), dtype=torch.int8), torch.rand(24, 2) + 0.1, None, 4, 32,
                 torch.float16)
    args = dict(a=torch.randn(3, 64).half(), qweight=w.qweight, scales=w.scales, zeros=None, bias=None, bits=4,
                group_size=32)
    return {**args, **over}


@pytest.mark.parametrize("over,match", [
    (dict(a=torch.randn(3, 64)), "A must be one of"),
    (dict(a=torch.randn(64, 3).half().t()), "A must be contiguous along dim 1"),
    (dict(a=torch.randn(3, 64, 1).half()), "A must be 2-D"),
    (dict(a=torch.randn(3, 72).half()), "qweight must have 9 rows"),
    (dict(qweight=torch.zeros(8, 24, dtype=torch.int64)), "qweight must be one of"),
    (dict(scales=torch.ones(3, 24).half()), "scales must have 2 rows"),
    (dict(zeros=torch.zeros(2, 24, dtype=torch.int32)), "zeros must be one of"),
    (dict(bias=torch.zeros(25).half()), r"bias must be \[24\]"),
    (dict(bits=3), "bits must be one of"),
    (dict(group_size=48), "group_size 48 does not divide K=64"),
])
def test_woq_gemm_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        w4a16.woq_gemm(**woq_args(**over))
    with pytest.raises(ValueError, match=match):  # the custom op checks the same, eager and fake
        torch.ops.qtk.woq_gemm(*woq_args(**over).values())


@pytest.mark.parametrize("over,match", [
    (dict(a_q=torch.zeros(4, 32, dtype=torch.float16)), "A_q must be one of"),
    (dict(w_q=torch.zeros(8, 32, dtype=torch.float8_e4m3fn)), "W_q must be one of"),
    (dict(w_q=torch.zeros(8, 16, dtype=torch.int8)), "W_q must have 32 columns"),
    (dict(a_scale=torch.ones(3, 1)), r"a_scale must be \[4, 1\]"),
    (dict(a_scale=torch.ones(4, 1).half()), "a_scale must be float32"),
    (dict(w_scale=torch.ones(7, 1)), r"w_scale must be \[8, 1\]"),
    (dict(out_dtype=torch.float32), "out_dtype must be float16 or bfloat16"),
])
def test_scaled_mm_rejects(over, match):
    args = dict(a_q=torch.zeros(4, 32, dtype=torch.int8), w_q=torch.zeros(8, 32, dtype=torch.int8),
                a_scale=torch.ones(4, 1), w_scale=torch.ones(8, 1), bias=None, out_dtype=torch.bfloat16)
    args.update(over)
    with pytest.raises(ValueError, match=match):
        w8a8.scaled_mm(**args)
    with pytest.raises(ValueError, match=match):
        torch.ops.qtk.scaled_mm(*args.values())


def test_act_quant_rejects():
    with pytest.raises(ValueError, match="torch.int8 or torch.float8_e4m3fn"):
        act_quant.act_quant(torch.randn(2, 8), torch.int16)
    with pytest.raises(ValueError, match="X must be 2-D"):
        act_quant.act_quant(torch.randn(2, 8, 2), torch.int8)
    with pytest.raises(ValueError, match="static_scale must hold one value"):
        act_quant.act_quant(torch.randn(2, 8), torch.int8, torch.ones(2))


# -- benchmark -------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_bench_needs_cuda(tmp_path):
    from qtk.kernels import bench

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.run("llama3-8b", [1], str(tmp_path), "bf16")
    assert not list(tmp_path.iterdir())
