"""Which kernel runs a QuantLinear, and the run-time tensors it needs, built once per layer.

`runtime_for(layer, x)` picks a Runtime by scheme, device and activation dtype (the first rule
that applies wins) and caches it on the layer as the plain attribute `_qtk_runtime` (not a
buffer: state_dict and checkpoints are unchanged). It is the one cache of anything derived from
a layer's tensors (repacked or decoded weights). It is rebuilt when the layer's tensors are
replaced or modified in place (.to(), load_state_dict, `.data =`), x's device/dtype change, or
`dense_weights()` is entered or left.

    scheme                     CUDA (fp16/bf16 x)               CPU
    int4/int8 weight-only      Triton woq_gemm (repacked)       bf16 x on a CPU with bf16 units:
                                                                torch._weight_int4pack_mm_for_cpu
                                                                (int4, G in 32..256, N % 16 == 0) or
                                                                torch._weight_int8pack_mm (int8 sym per
                                                                channel, K % 16 == 0); else qtk's own
                                                                kernel (CpuWOQ, kernels/cpu.py: float32
                                                                math, AVX2 or portable build) where it
                                                                is built; else reference
    W8A8 int8                  Triton act_quant + scaled_mm     CPU with int8 dot products (VNNI, AMX):
                                                                qtk's VNNI kernel (CpuW8A8Vnni, the avx512
                                                                build: x quantized in the call, VPDPBUSD);
                                                                without that build act_quant twin +
                                                                torch._int_mm + fp32 epilogue; else
                                                                activations quantized as the reference
                                                                does, then qtk's kernel on the int8
                                                                weight (CpuW8A8Woq); else reference
    W8A8 fp8 (sm_89+)          Triton act_quant + fp8_gemm      reference
    anything else              Dense (float32)                  Dense (float32; oneDNN-packed in the runtime)
Dense is the reference's math (reference.quant_linear_ref: activations fake-quantized as the
scheme's kernel sees them, a float32 matmul) on a weight decoded once. Inside `dense_weights()`
(calibration) every weight-only layer is Dense in the activations' dtype instead (float32 for bf16
activations on a CPU without bf16 units). The engine's start-up log names the kernel of each kind of
layer (runtime/packed_linear.kernel_summary).

CPU rows, measured (benchmarks/cpu_dtype.py and `qtk bench kernels --device cpu`; figures in
benchmarks/results/cpu_dtype.md and cpu_kernels.md). On a CPU with AVX512-BF16 torch's int4/int8
weight ops beat the reference by 2-6x for bf16 activations and lose by 10-100x for fp16/fp32,
which they have no fast kernel for; on an AVX2-only CPU (bf16 emulated) they lose in bf16 too.
qtk's CPU kernel reads the codes in float32 math on any x86 CPU: on 2 AVX2 cores, 2.4-4.9x the
float32 matmul at M=1 on SmolLM2's shapes (benchmarks/results/cpu_kernels.md). W8A8:
torch._int_mm took 7.7 ms at M=16 and 1778 ms at M=4096 against Dense's 0.59 and 56 ms on AVX2,
so its integer GEMM runs only where the CPU has int8 dot products. With AVX512-VNNI (2 Zen 4
cores) qtk's W8A8 kernel ran 4.3-6.1x the float32 matmul at M=1 and 2.1-3.8x at M=64-256, and
1.2-6x torch._int_mm at every M measured (1-256): it quantizes x inside the one call, where
_int_mm needs the activation quantization as separate torch ops, and has no fast path below
~16 rows.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..device import cpu_has_int8_dot, cpu_has_native_bf16, native_bf16
from ..quant import quantize_activation
from ..schemes import QuantArgs
from . import cpu as cpu_kernels
from . import ops  # noqa: F401  registers torch.ops.qtk.*
from .common import ACT_DTYPES
from .fp8 import fp8_supported
from .layout import WOQ_BITS, WOQWeights, pack_woq
from .reference import act_quant_ref

CPU_INT4_GROUPS = (32, 64, 128, 256)


def cpu_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight [N, K] reordered once for oneDNN's matmul (None where oneDNN is not
    there). On 2 AVX2 cores, 30 SmolLM2 layers plus its lm_head take 29 against F.linear's 45 ms
    at M=1, 30 against 77 at M=2, 52 against 80 at M=16, 133 against 158 at M=64 (weights out of
    cache, as in decoding; F.linear's MKL sgemm is slow for a few rows)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (AttributeError, RuntimeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class Dense:
    """y = x @ W^T + b on W decoded once into weight.dtype; activations fake-quantized first as the
    scheme's kernel sees them (act, input_scale), in float32, as reference.quant_linear_ref does.
    A layer marked `pack_cpu_weight` (the runtime's, by runtime.packed_linear.pack_linears) keeps a
    float32 CPU weight in oneDNN's layout (cpu_packed_weight) and multiplies there; torch.compile
    cannot trace that layout, so nothing else does."""

    weight: torch.Tensor  # [N, K], strided or oneDNN-packed
    bias: torch.Tensor | None  # [N] in weight.dtype
    act: QuantArgs | None = None
    input_scale: torch.Tensor | None = None  # float32 [1] for static activation scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.weight.dtype)
        if self.act is not None:
            q, s = quantize_activation(x.float(), self.act, self.input_scale)
            xc = (q.float() * s.float()).to(self.weight.dtype)
        if self.weight.is_mkldnn:
            return packed_linear(xc.contiguous(), self.weight, self.bias).to(x.dtype)
        return F.linear(xc, self.weight, self.bias).to(x.dtype)


def reference_runtime(layer, device: torch.device) -> Dense:
    act = layer.scheme.input_activations
    static = None if act is None or act.dynamic else layer.input_scale.float().to(device)
    bias = None if layer.bias is None else layer.bias.float().to(device)
    weight = layer.dequantized_weight(torch.float32).to(device)
    packed = cpu_packed_weight(weight) if getattr(layer, "pack_cpu_weight", False) else None
    return Dense(weight if packed is None else packed, bias, act, static)


def dense_runtime(layer, device: torch.device, dtype: torch.dtype) -> Dense:
    """A weight-only layer as a plain matmul in `dtype` (float32 where bf16 is emulated)."""
    dtype = dtype if native_bf16(device) or dtype != torch.bfloat16 else torch.float32
    bias = None if layer.bias is None else layer.bias.to(device, dtype)
    return Dense(layer.dequantized_weight(dtype).to(device), bias)


@dataclass(frozen=True)
class WOQTriton:
    w: WOQWeights
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if w.perm is not None:
            x = x.index_select(1, w.perm)
        return torch.ops.qtk.woq_gemm(x, w.qweight, w.scales, w.zeros, self.bias, w.bits, w.group_size)


@dataclass(frozen=True)
class CpuInt4:
    packed: torch.Tensor  # torch._convert_weight_to_int4pack_for_cpu of u [N, K]
    scales_and_zeros: torch.Tensor  # [K/G, N, 2]: W = (u - 8) * s + z
    group_size: int
    perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class CpuWOQ:
    """qtk's CPU kernel (kernels/cpu.py): int4/int8 codes decoded in registers, float32 math."""

    w: cpu_kernels.PackedWOQ
    perm: torch.Tensor | None
    bias: torch.Tensor | None  # float32
    lib: object  # the kernel build (kernels.cpu.library)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return cpu_kernels.woq_linear(x.float(), self.w, self.bias, self.lib).to(x.dtype)


@dataclass(frozen=True)
class CpuW8A8Woq:
    """W8A8 int8 on a CPU without int8 dot products: the activations quantized as the scheme says
    (reference math, as Dense), then qtk's CPU kernel on the int8 weight codes: the reference's
    numbers at a quarter of the float32 weight bytes."""

    w: cpu_kernels.PackedWOQ
    act: QuantArgs
    input_scale: torch.Tensor | None  # float32 [1] for static activation scales
    bias: torch.Tensor | None  # float32
    lib: object

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_activation(x.float(), self.act, self.input_scale)
        return cpu_kernels.woq_linear(q.float() * s.float(), self.w, self.bias, self.lib).to(x.dtype)


@dataclass(frozen=True)
class CpuInt8:
    weight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N] in x's dtype
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias


def input_scale_for(x: torch.Tensor, static: torch.Tensor | None, per_token: bool,
                    qmax: float) -> torch.Tensor | None:
    """The activation scale a W8A8 kernel is given: the static one, None for per token (the kernel
    computes it), or the dynamic per-tensor one, as qtk.quant.quantize_activation computes it."""
    if static is not None or per_token:
        return static
    s = (x.float().abs().amax() / qmax).reshape(1)
    return torch.where(s > 0, s, torch.finfo(torch.float32).eps)


@dataclass(frozen=True)
class W8A8:
    weight: torch.Tensor  # int8 / fp8 [N, K]
    w_scale: torch.Tensor  # [N, 1] or [1]
    input_scale: torch.Tensor | None  # fp32 [1] (static) or None (dynamic)
    per_token: bool  # dynamic per token; dynamic per tensor otherwise
    bias: torch.Tensor | None

    def input_scale_for(self, x: torch.Tensor) -> torch.Tensor | None:
        qmax = 448.0 if self.weight.dtype == torch.float8_e4m3fn else 127.0
        return input_scale_for(x, self.input_scale, self.per_token, qmax)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = torch.ops.qtk.act_quant(x, self.weight.dtype, self.input_scale_for(x))
        return torch.ops.qtk.scaled_mm(q, self.weight, s, self.w_scale, self.bias, x.dtype)


@dataclass(frozen=True)
class CpuW8A8Vnni:
    """W8A8 int8 on qtk's VNNI kernel (kernels/cpu.py, csrc/cpu_w8a8.cpp): x quantized per token (or
    with the static scale) inside the call, exact int8 products on VPDPBUSD, scales in the epilogue."""

    w: cpu_kernels.PackedW8A8
    input_scale: torch.Tensor | None  # float32 [1] for static activation scales
    per_token: bool  # dynamic per token; dynamic per tensor when False and input_scale is None
    bias: torch.Tensor | None  # float32
    lib: object

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        s = input_scale_for(xf, self.input_scale, self.per_token, 127.0)
        return cpu_kernels.w8a8_linear(xf, self.w, s, self.bias, self.lib).to(x.dtype)


@dataclass(frozen=True)
class CpuW8A8Int(W8A8):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = act_quant_ref(x, torch.int8, self.input_scale_for(x))
        y = torch._int_mm(q, self.weight.t()).float() * s * self.w_scale.float().reshape(1, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def _act_order(layer) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, bool]:
    """(perm, codes, zero point, ok): with g_idx, columns sorted by group so groups are contiguous."""
    codes, zp = layer.codes(), layer.zero_point()
    if not hasattr(layer, "weight_g_idx"):
        return None, codes, zp, True
    g = layer.weight_g_idx.long()
    perm = torch.argsort(g, stable=True)
    size = layer.scheme.weights.group_size
    ok = size is not None and torch.equal(g[perm], torch.arange(g.numel(), device=g.device) // size)
    return perm, codes[:, perm], zp, ok


def _woq(layer, device: torch.device, dtype: torch.dtype):
    args = layer.scheme.weights
    group = args.group_size if args.strategy == "group" else None
    perm, codes, zp, ok = _act_order(layer)
    n, k = codes.shape
    if not ok or (group is not None and k % group):
        return reference_runtime(layer, device)
    if device.type == "cuda" and dtype in ACT_DTYPES:
        if group is not None and group % 16:  # woq_gemm takes groups of a multiple of 16
            return reference_runtime(layer, device)
        w = pack_woq(codes, layer.weight_scale, zp, args.num_bits, group, dtype, perm)
        return WOQTriton(w, layer.bias)
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_native_bf16():
        if args.num_bits == 4 and group in CPU_INT4_GROUPS and n % 16 == 0:
            u = (codes.to(torch.int32) + 8).contiguous()
            s = layer.weight_scale.float().reshape(n, -1).t()  # [K/G, N]
            z = torch.zeros_like(s) if zp is None else -zp.float().reshape(n, -1).t() * s
            sz = torch.stack([s, z], dim=-1).to(dtype).contiguous()
            return CpuInt4(torch._convert_weight_to_int4pack_for_cpu(u, 1), sz, group, perm, layer.bias)
        if args.num_bits == 8 and group is None and zp is None and perm is None and k % 16 == 0:
            s = layer.weight_scale.reshape(-1).to(dtype).expand(n).contiguous()
            return CpuInt8(codes.contiguous(), s, layer.bias)
    lib = cpu_kernels.ops() if device.type == "cpu" else None
    if lib is not None and cpu_kernels.supports(k, group, args.num_bits):
        scale = layer.weight_scale.float()
        scale = scale.expand(n, 1) if scale.numel() == 1 else scale.reshape(n, -1)
        zero = None if zp is None else (zp.float().expand(n, 1) if zp.numel() == 1 else zp.float().reshape(n, -1))
        packed = cpu_kernels.pack(codes, scale, zero, args.num_bits)
        return CpuWOQ(packed, perm, None if layer.bias is None else layer.bias.float().contiguous(), lib)
    return reference_runtime(layer, device)


def _w8a8(layer, device: torch.device, dtype: torch.dtype):
    scheme = layer.scheme
    w, act = scheme.weights, scheme.input_activations
    if not w.symmetric or w.strategy not in ("channel", "tensor") or hasattr(layer, "weight_g_idx"):
        return reference_runtime(layer, device)
    static = None if act.dynamic else layer.input_scale.float().reshape(1)
    w_scale = layer.weight_scale.reshape(-1, 1) if w.strategy == "channel" else layer.weight_scale.reshape(1)
    per_token = act.dynamic and act.strategy == "token"
    parts = (layer.weight, w_scale.contiguous(), static, per_token, layer.bias)
    if device.type == "cuda" and dtype in ACT_DTYPES and (w.type == "int" or fp8_supported(device)):
        return W8A8(*parts)
    lib = cpu_kernels.ops() if device.type == "cpu" else None
    bias = None if layer.bias is None else layer.bias.float().contiguous()  # qtk's CPU kernels' epilogue
    if device.type == "cpu" and w.type == "int" and cpu_has_int8_dot():
        if lib is not None and lib.compiled_vnni() and w.num_bits == 8:
            return CpuW8A8Vnni(cpu_kernels.pack_w8a8(layer.weight, layer.weight_scale), static, per_token, bias, lib)
        return CpuW8A8Int(*parts)
    n, k = layer.weight.shape
    if lib is not None and w.type == "int" and w.num_bits == 8 and cpu_kernels.supports(k, None, 8):
        scale = layer.weight_scale.float().reshape(-1, 1).expand(n, 1)
        return CpuW8A8Woq(cpu_kernels.pack(layer.weight, scale, None, 8), act, static, bias, lib)
    return reference_runtime(layer, device)


def build_runtime(layer, device: torch.device, dtype: torch.dtype, dense: bool = False):
    """The Runtime for `layer` given activations on `device` in `dtype` (rules in the docstring)."""
    scheme = layer.scheme
    w = scheme.weights
    if dense and scheme.input_activations is None:
        return dense_runtime(layer, device, dtype)
    if scheme.input_activations is None and w.type == "int" and w.num_bits in WOQ_BITS \
            and w.strategy in ("group", "channel", "tensor"):
        return _woq(layer, device, dtype)
    if scheme.input_activations is not None and hasattr(layer, "weight"):
        return _w8a8(layer, device, dtype)
    return reference_runtime(layer, device)


@dataclass(frozen=True)
class _Cached:
    """A runtime and what it was built from: the layer's tensors (held, so identity is safe),
    their stamps, the activations' device and dtype, and the dense mode."""

    sources: tuple
    stamps: tuple
    device: torch.device
    dtype: torch.dtype
    dense: bool
    runtime: object

    def fresh(self, sources: tuple, x: torch.Tensor, dense: bool) -> bool:
        return (x.device == self.device and x.dtype == self.dtype and dense == self.dense
                and len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources))
                and all(_stamp(t) == v for t, v in zip(sources, self.stamps)))


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's in-place version counter and data address: `t.data = new` (a reload) keeps the
    tensor and its counter, and changes only the address."""
    return t._version, t.data_ptr()


class _DenseMode(threading.local):
    layers: list | None = None  # layers given a dense runtime inside dense_weights()


_dense_mode = _DenseMode()


@contextlib.contextmanager
def dense_weights():
    """Weight-only QuantLinears compute x @ dequant(W)^T with a plain matmul in x's dtype (float32
    where bf16 is emulated), each weight decoded once, the decoded weights dropped on exit.

    For calibration, which runs one block over thousands of tokens per batch: there a dense bf16
    matmul is about 3x faster on CPU than the int4 kernel, and the decoded block fits in memory.
    Activation-quantized schemes keep their kernels (their integer matmul is part of the scheme)."""
    saved = _dense_mode.layers
    _dense_mode.layers = []
    try:
        yield
    finally:
        for layer in _dense_mode.layers:
            cached = getattr(layer, "_qtk_runtime", None)
            if cached is not None and cached.dense:
                del layer._qtk_runtime
        _dense_mode.layers = saved


def runtime_for(layer, x: torch.Tensor):
    """The cached Runtime of `layer` for x (rebuilt when stale; trusted as is while compiling)."""
    cached = getattr(layer, "_qtk_runtime", None)
    if cached is not None and torch.compiler.is_compiling():
        return cached.runtime
    dense = _dense_mode.layers is not None and layer.scheme.input_activations is None
    sources = tuple(t for t in (*layer._buffers.values(), *layer._parameters.values()) if t is not None)
    if cached is None or not cached.fresh(sources, x, dense):
        with torch.no_grad():
            runtime = build_runtime(layer, x.device, x.dtype, dense)
        cached = _Cached(sources, tuple(_stamp(t) for t in sources), x.device, x.dtype, dense, runtime)
        layer._qtk_runtime = cached
        if dense:
            _dense_mode.layers.append(layer)
    return cached.runtime


def prepare(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Build every QuantLinear's runtime now (at load time) instead of at its first forward."""
    probe = torch.empty(0, device=device, dtype=dtype)
    for m in module.modules():
        if hasattr(m, "scheme") and hasattr(m, "weight_scale"):
            runtime_for(m, probe)


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Forward of a QuantLinear (see qtk.quant_linear) for any scheme: x [..., K] -> [..., N]."""
    runtime = runtime_for(layer, x)
    y = runtime(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*x.shape[:-1], y.shape[-1])
