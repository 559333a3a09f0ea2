"""Kernel dispatch: Triton on CUDA, torch's int4/int8 ops, qtk's C++ CPU kernels or the pure-torch
reference on CPU.

Modules: layout (run-time weight layout), w4a16 (weight-only int4/int8 GEMM), act_quant
(per-token / static activation quantization), w8a8 (int8 and fp8 scaled GEMM), fp8
(torch._scaled_mm or Triton), ops (torch.ops.qtk.* custom ops), cpu (qtk's C++ CPU kernels),
dispatch (which one runs a layer: quant_linear, prepare, dense_weights), reference (pure-torch
twins), bench (GPU benchmark). This file imports none of them: `import qtk.kernels.cpu` loads
that module alone.
"""
