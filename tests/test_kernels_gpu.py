"""The compiled kernels on a real GPU (skipped without CUDA): QuantLinear dispatch against the
reference at decode and prefill sizes, CUDA-graph capture and torch.compile of a quantized layer,
and the two FP8 backends against each other."""
from __future__ import annotations

import pytest
import torch
from test_kernels import quant_linear, rel_err

from qtk.kernels import dispatch, reference
from qtk.kernels.fp8 import Fp8Backend, fp8_gemm, fp8_supported, scaled_mm_applies

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def cuda_layer(scheme, group, dtype, n=1000, k=768):
    return quant_linear(scheme, n=n, k=k, group=group, dtype=dtype).cuda()


@pytest.mark.parametrize("scheme,group", [("w4a16", 32), ("w4a16_asym", 64), ("w4a16", 128), ("w4a16", -1),
                                          ("w8a16", None), ("w8a8", None), ("fp8", None), ("fp8_static", None)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 37, 300])
def test_quant_linear_on_gpu(scheme, group, dtype, m):
    torch.manual_seed(0)
    layer = cuda_layer(scheme, group, dtype)
    x = torch.randn(m, 768, device="cuda", dtype=dtype)
    y = layer(x)
    runtime = dispatch.runtime_for(layer, x)
    fp8_here = fp8_supported(x.device)
    expected = {"w8a8": dispatch.W8A8, "fp8": dispatch.W8A8 if fp8_here else type(None),
                "fp8_static": dispatch.W8A8 if fp8_here else type(None)}.get(scheme, dispatch.WOQTriton)
    assert type(runtime) is expected
    assert rel_err(y, reference.quant_linear_ref(x, layer)) < TOL[dtype]


def test_cuda_graph_capture():
    layer = cuda_layer("w4a16_asym", 128, torch.bfloat16, n=768)
    w8 = cuda_layer("w8a8", None, torch.bfloat16, n=768)
    x = torch.randn(2, 768, device="cuda", dtype=torch.bfloat16)
    eager = w8(layer(x))  # builds the runtimes and compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8(layer(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    assert torch.equal(out, w8(layer(x)))


def test_torch_compile_fullgraph_on_gpu():
    layer = cuda_layer("w4a16", 64, torch.float16)
    x = torch.randn(5, 768, device="cuda", dtype=torch.float16)
    eager = layer(x)
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), eager)


@pytest.mark.parametrize("m", [1, 64])
def test_fp8_backends_agree(m):
    if not fp8_supported(torch.device("cuda")):
        pytest.skip("FP8 needs sm_89+")
    a = (torch.randn(m, 512, device="cuda") * 50).to(torch.float8_e4m3fn)
    w = (torch.randn(256, 512, device="cuda") * 50).to(torch.float8_e4m3fn)
    sa, sw = torch.rand(m, 1, device="cuda") * 0.01, torch.rand(256, 1, device="cuda") * 0.01
    if not scaled_mm_applies(m, 256, 512, sa, sw, torch.bfloat16, a.device):
        pytest.skip("torch._scaled_mm takes no row-wise scales here")
    ref = reference.scaled_mm_ref(a, w, sa, sw, None, torch.bfloat16)
    for backend in (Fp8Backend.TRITON, Fp8Backend.SCALED_MM):
        assert rel_err(fp8_gemm(a, w, sa, sw, None, torch.bfloat16, backend=backend), ref) < 1e-2
