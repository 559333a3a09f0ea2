"""The engine's CPU linear layers, swapped in for the model's once at load (pack_linears); drop-in
modules: the transformers model still runs.

A float32 Linear becomes
- where its weights are all bf16 numbers (a bf16 checkpoint's, upcast: most are): a WOQLinear that
  keeps them in bf16 and, by rows of x:
  - a few (batch-1 decode): qtk's kernel with float32 activations, exactly the float32 products at half
    the bytes, 1.6-3x faster than oneDNN's float32 matmul at 1-8 rows;
  - on a CPU with AVX512-BF16, from BF16_DOT_ROWS[0] (batched decode): qtk's bf16 kernel on the same
    copy (csrc/cpu_bf16_linear.cpp; x rounded to bf16, the sums float32), and from BF16_DOT_ROWS[1]
    (prefill chunks) oneDNN's bf16 matmul on its own copy;
  - else oneDNN from many_rows (prefill chunks, batched decode): in bf16 on a CPU with bf16 units
    (x and y rounded to bf16, the sums float32),
    else in float32 (OneDNNMatmul);
- else a PackedLinear: the weight in oneDNN's float32 layout (kernels.dispatch.cpu_packed_weight:
  1.2-2.6x faster than F.linear for the few rows of a decode step).
QuantLinears get their kernel's module (WOQLinear, W8A8Linear), or a packed Dense runtime; a weight-only
one of a bf16 checkpoint, on a CPU with AVX512-BF16, multiplies from QUANT_BF16_ROWS rows in bf16 on
qtk's kernel for its codes (QuantBF16Matmul), as a bf16 checkpoint's float layers do on oneDNN."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .. import hadamard
from ..device import cpu_has_native_bf16
from ..kernels import cpu as cpu_kernels
from ..kernels.dispatch import CpuW8A8Vnni, CpuWOQ, build_runtime, cpu_packed_weight, packed_linear
from ..quant_linear import QuantLinear


# a layer in a decode step sees a few rows, its weight out of cache: up to this many weight elements
# (128 KB float32) F.linear's MKL beats or ties oneDNN's fixed ~15 us per call (1 thread, AVX-512,
# a pool of 64 MB of weights: 256x64 7 against 22 us at 1 row, 17 against 23 at 8; 128x256 19 against
# 26 at 1 row, equal at 4-8; 256x256 oneDNN ahead from 2 rows, 46 against 40)
SMALL_FLOAT = 2 ** 15
# rows from which a layer kept in bf16 multiplies on oneDNN instead of qtk's kernel, by oneDNN's dtype
# (benchmarks/prefill_peak.py's crossover: SmolLM2-135M's 120 decoder layers, weights out of cache, 2-core
# Zen 4: the kernel 12.4 / oneDNN bf16 13.8 ms at 8 rows, 15.5 / 14.5 at 10, 22.1 / 18.2 at 16; oneDNN
# float32 19.9 ms at 8 rows, 25.8 at 16, 31.5 at 20 against the kernel's 35.3)
MANY_ROWS = {torch.bfloat16: 10, torch.float32: 18}
# the float32 crossover on a CPU without AVX-512 (qtk's avx2 build), where oneDNN's float32 matmul and qtk's
# decoded slices (csrc/cpu_woq.cpp rows_min) both multiply in 8-lane FMAs: the same 120 layers, 2-core Zen 1,
# ms per pass, the kernel / oneDNN float32: 16 rows 70.6 / 76.5, 32 rows 117 / 123, 48 rows 166 / 204, 64 rows
# 221 / 228, 96 rows 328 / 331, 128 rows 431 / 419
MANY_ROWS_AVX2 = 96
# rows from which a layer kept in bf16 multiplies in bf16 on qtk's AVX512-BF16 kernel, and from which on
# oneDNN's bf16 matmul takes over (benchmarks/prefill_peak.py's crossover, 2-core Zen 4, SmolLM2-135M's 120
# decoder layers out of cache, ms per pass, float32 kernel / bf16 kernel / oneDNN bf16: 4 rows 7.3 / 6.9 /
# 10.9, 5 rows 8.7 / 6.8 / 11.0, 16 rows 21.6 / 9.8 / 16.9, 64 rows 77 / 36 / 42, 128 rows 145 / 71 / 84,
# 256 rows 285 / 181 / 186; prefill-peak-...-1758ac4.json). Below it the float32 kernel keeps batch 1 and
# small batches' float32 numbers.
BF16_DOT_ROWS = (5, 128)
# rows from which a weight-only int4 / int8 layer of a bf16 checkpoint multiplies in bf16 on qtk's AVX512-BF16
# kernel (csrc/cpu_bf16_linear.cpp woq_bf16_linear), by bits; below, the float32 kernel (the same 120 layers,
# int4 g128 / int8 g128, ms per pass, float32 kernel / bf16 kernel, 2-core Zen 4, commit 3cfe046: int4 8 rows
# 10.7 / 11.3, 10 rows 13.6 / 11.9, 12 rows 15.4 / 12.8, 16 rows 20.0 / 15.1, 128 rows 143 / 73; int8 8 rows
# 11.1 / 12.7, 10 rows 14.0 / 13.9, 12 rows 15.6 / 14.6, 16 rows 20.4 / 17.0)
QUANT_BF16_ROWS = {4: 10, 8: 12}

# The rows a step's layers choose their kernels by, where that is not the rows they are given (numerics_of)
_STEP_ROWS: ContextVar[int | None] = ContextVar("qtk_step_rows", default=None)


@contextmanager
def numerics_of(rows: int) -> Iterator[None]:
    """Within it, every layer picks its kernel, and so its rounding (float32 products, or x rounded to
    bf16), as for a step of `rows` rows, whatever rows it is given: a step that verifies speculative
    drafts computes each token as the plain decode step of the same sequences would, so greedy output
    does not depend on the drafts."""
    token = _STEP_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


def rows_of(x: torch.Tensor) -> int:
    """The rows x's layer chooses its kernel by: x's own, or the step's under numerics_of."""
    rows = _STEP_ROWS.get()
    return x.shape[0] if rows is None else rows


def many_rows(dtype: torch.dtype) -> int:
    """Rows from which a layer kept in bf16 multiplies on oneDNN in `dtype` (MANY_ROWS; float32 on
    a CPU without AVX-512 running qtk's avx2 build: MANY_ROWS_AVX2)."""
    if dtype == torch.float32 and cpu_kernels.variant() == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        return MANY_ROWS_AVX2
    return MANY_ROWS[dtype]


class PackedLinear(nn.Module):
    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.packed = packed  # not a parameter: nothing saves or trains it
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = packed_linear(x.reshape(-1, shape[-1]).contiguous(), self.packed, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def direct(self):
        """The matmul itself, for float32 [T, K] contiguous x: oneDNN's, or F.linear on the weight
        unpacked once for a layer of at most SMALL_FLOAT weights (MoE experts, tiny models)."""
        packed, bias = self.packed, self.bias
        if self.in_features * self.out_features <= SMALL_FLOAT:
            weight = packed.to_dense()  # [N, K] back from oneDNN's layout
            return lambda x: F.linear(x, weight, bias)
        return lambda x: packed_linear(x, packed, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


@dataclass(frozen=True)
class OneDNNMatmul:
    """y = x W^T + b for float32 x [T, K] on oneDNN, W reordered once: in bf16 (x rounded to bf16,
    float32 sums, y rounded to bf16 and returned in float32) or float32; for T >= rows."""

    packed: torch.Tensor  # oneDNN's layout, bf16 or float32 (bf16 [N, K] unpacked where oneDNN has no bf16)
    bias: torch.Tensor | None  # float32
    rows: int

    @property
    def bf16(self) -> bool:
        return self.packed.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.dtype == torch.bfloat16:
            y = self.bf16_product(x).float()
            return y if self.bias is None else y.add_(self.bias)
        return packed_linear(x, self.packed, self.bias)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in bf16 (no bias) for a bf16 weight: x rounded to bf16, float32 sums, y bf16."""
        xb = x.to(torch.bfloat16)
        return packed_linear(xb, self.packed, None) if self.packed.is_mkldnn else F.linear(xb, self.packed)

    @staticmethod
    def of(weight: torch.Tensor, bias: torch.Tensor | None) -> OneDNNMatmul | None:
        """A float weight [N, K] for oneDNN in the CPU's fastest dtype for many rows: bf16 where it has
        bf16 units, else float32 (None where oneDNN is not there). QTK_CPU_BF16=1 on a CPU whose oneDNN
        has no bf16 (AVX2 only) keeps the bf16 weight unpacked, for torch's bf16 matmul (emulated, slow:
        for tests of the bf16 path's numbers)."""
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if not torch.backends.mkldnn.is_available():
            return None
        w = weight.detach().to(dtype).contiguous()
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        except (AttributeError, RuntimeError):
            if dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return None
            packed = w
        return OneDNNMatmul(packed, bias, many_rows(dtype))


@dataclass(frozen=True)
class BF16Dot:
    """y = x W^T + b on qtk's AVX512-BF16 kernel (csrc/cpu_bf16_linear.cpp) for lo <= T < hi rows of
    float32 or bf16 x [T, K]: x rounded to bf16, float32 sums, y float32 (or rounded to bf16); it reads
    the WOQLinear's own bf16 copy (codes)."""

    codes: torch.Tensor  # int16 [N/8, K, 8] (kernels.cpu.pack_bf16)
    bias: torch.Tensor | None  # float32
    n: int
    op: object  # the kernel build's bf16_linear
    lo: int = BF16_DOT_ROWS[0]
    hi: int = BF16_DOT_ROWS[1]

    def __call__(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        return self.op(x, self.codes, self.bias, self.n, bf16_out)

    @staticmethod
    def of(w: cpu_kernels.PackedWOQ, bias: torch.Tensor | None, lib) -> BF16Dot | None:
        """The kernel for a bf16 layer where this CPU and build run it (AVX512-BF16; QTK_CPU_BF16 not 0)
        and K is even (pairs of bf16), else None."""
        runs = getattr(lib, "bf16_linear_runs", None)
        if w.bits != 16 or w.codes.shape[1] % 2 or runs is None or not runs() or not cpu_has_native_bf16():
            return None
        return BF16Dot(w.codes, bias, w.n, lib.bf16_linear)


@dataclass(frozen=True)
class QuantBF16Matmul:
    """y = x dequant(W)^T + b for a weight-only int4 / int8 layer on qtk's AVX512-BF16 kernel
    (csrc/cpu_bf16_linear.cpp woq_bf16_linear), for T >= rows of float32 or bf16 x [T, K]: x rounded
    to bf16, the codes less their zeros exact in bf16, float32 sums scaled once per group, y float32
    (or rounded to bf16). The float32 kernel's sum with x rounded to bf16, from the same packed codes."""

    w: cpu_kernels.PackedWOQ
    zeros: torch.Tensor | None  # int32, shaped as w.scales: the stored codes' zero (w.zs / w.scales)
    bias: torch.Tensor | None  # float32
    op: object  # the kernel build's woq_bf16_linear
    rows: int
    bf16 = True

    def __call__(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        w = self.w
        return self.op(x, w.codes, w.scales, self.zeros, self.bias, w.bits, w.n, bf16_out)

    @staticmethod
    def of(w: cpu_kernels.PackedWOQ, bias: torch.Tensor | None, lib) -> QuantBF16Matmul | None:
        """The kernel for a weight-only layer of a bf16 checkpoint (bf16_checkpoint: a bf16 model's
        activations are bf16, as vLLM runs it) where this CPU and build run it (AVX512-BF16;
        QTK_CPU_BF16 not 0), else None: zeros that are not whole codes keep the float32 kernel."""
        runs = getattr(lib, "bf16_linear_runs", None)
        if w.bits not in QUANT_BF16_ROWS or runs is None or not runs() or not cpu_has_native_bf16():
            return None
        k, groups = w.codes.shape[1] * (8 if w.bits == 4 else 1), w.scales.shape[1]
        if k % groups or (k // groups) % 2:
            return None
        try:
            zeros = cpu_kernels.code_zeros(w)
        except ValueError:
            return None
        return QuantBF16Matmul(w, zeros, bias, lib.woq_bf16_linear, QUANT_BF16_ROWS[w.bits])


class KernelLinear(nn.Module):
    """A layer one of qtk's CPU kernels runs straight from the module (no dispatch on each call),
    from its runtime (kernels/dispatch.py)."""

    def __init__(self, runtime: CpuWOQ | CpuW8A8Vnni, in_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, runtime.w.n
        self.runtime = runtime

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.runtime(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)


class WOQLinear(KernelLinear):
    """qtk's weight-only CPU kernel straight from the module:
    - weight-only QuantLinears, and several that read the same input (q/k/v, gate/up) joined into
      one: one call per step instead of three, and more columns to share among threads;
    - a float32 Linear whose weight holds only bf16 numbers (a bf16 checkpoint's, upcast), kept in
      bf16: exactly the float32 products at half the bytes (kept_in_bf16); on qtk's bf16 kernel for
      dot.lo <= rows < dot.hi (`dot`, where the CPU has AVX512-BF16), and from many.rows rows on
      oneDNN's matmul on its own copy (`many`). The lm_head gets no `many` and runs every row in
      float32 (a perplexity's many rows take the float32 kernel's tiles); its `dot` is for the
      runtime, which takes it for the logits of a decode batch whose step ran in bf16 (NativeModel.logits).
    A weight-only layer of a bf16 checkpoint, on a CPU with AVX512-BF16, multiplies from many.rows rows on
    qtk's bf16 kernel for its codes (`many`, a QuantBF16Matmul)."""

    def __init__(self, runtime: CpuWOQ, in_features: int, many: OneDNNMatmul | QuantBF16Matmul | None = None,
                 dot: BF16Dot | None = None):
        super().__init__(runtime, in_features)
        self.many = many
        self.dot = dot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.direct()(x.reshape(-1, shape[-1]).float().contiguous()).to(x.dtype)  # the kernel by rows
        return y.view(*shape[:-1], self.out_features)

    @property
    def kernel_rows(self) -> int | None:
        """Rows below which direct() calls the weight-only kernel (None: at any number of rows)."""
        if self.many is None:
            return None
        return self.dot.lo if self.dot is not None else self.many.rows

    def direct(self):
        """The kernel call itself, for float32 [T, K] contiguous x (the runtime's fused forward)."""
        w, bias, op = self.runtime.w, self.runtime.bias, self.runtime.lib.woq_linear
        few = lambda x: op(x, w.codes, w.scales, w.zs, bias, w.bits, w.n)  # noqa: E731
        many, dot = self.many, self.dot
        if many is None:
            return few
        if dot is not None:
            return lambda x: (few if (r := rows_of(x)) < dot.lo else dot if r < dot.hi else many)(x)
        return lambda x: many(x) if rows_of(x) >= many.rows else few(x)

    @property
    def weights(self) -> str:
        many, dot = self.many, self.dot
        if self.runtime.w.bits != 16:
            bf16 = "" if many is None else f", qtk bf16 dot products from {many.rows} rows"
            return f"int{self.runtime.w.bits}{bf16}"
        parts = ["bf16"]
        if dot is not None:
            parts.append(f"qtk bf16 dot products from {dot.lo} rows")
        if many is not None:
            parts.append(f"oneDNN {str(many.packed.dtype)[6:]} from {many.rows} rows")
        return ", ".join(parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weights}, qtk CPU kernel"


class W8A8Linear(KernelLinear):
    """W8A8 int8 QuantLinears on qtk's VNNI kernel (kernels/cpu.py, csrc/cpu_w8a8.cpp) straight from
    the module, several that read the same input (q/k/v, gate/up) joined into one where their
    activations are quantized alike (per token, or one static scale): the input is quantized once.
    bf16: a bf16 checkpoint's layer on a CPU with bf16 units, whose steps keep the KV cache and attend
    in bf16 as vLLM runs a bf16 W8A8 model (steps_in_bf16; the int8 products are the same either way)."""

    def __init__(self, runtime: CpuW8A8Vnni, in_features: int, bf16: bool = False):
        super().__init__(runtime, in_features)
        self.bf16 = bf16

    def direct(self):
        """The kernel call itself, for float32 [T, K] contiguous x (the runtime's fused forward)."""
        r = self.runtime
        if r.input_scale is None and not r.per_token:  # dynamic per tensor: the scale comes first
            return r
        w, s, bias, op = r.w, r.input_scale, r.bias, r.lib.w8a8_linear
        return lambda x: op(x, w.codes, w.colsum, w.scales, s, bias, w.n)

    def quantized_input(self):
        """(static scale or None, f) where the op before this layer can hand it its input already quantized
        (cpu_act_quant.h's rows: per token, or with the static scale; the fused norms and GLUs of
        cpu_layers.cpp): f((xq, sx)) = the kernel on those rows, the same y as direct() on the float32 rows;
        None for dynamic per-tensor scales (the whole input's maximum comes first)."""
        r = self.runtime
        if r.input_scale is None and not r.per_token:
            return None
        w, bias, op = r.w, r.bias, r.lib.w8a8_linear_quantized
        return r.input_scale, lambda xq: op(xq[0], xq[1], w.codes, w.colsum, w.scales, bias, w.n)

    def glu_of_quantized(self, act: str):
        """For a joined gate_up layer (its first half of outputs gate's, the second up's): (static scale or
        None, f) with f((xq, sx)) = act(gate) * up [T, I] taken in the kernel's epilogue (act "silu" or
        "gelu_tanh"; csrc/cpu_w8a8.cpp's w8a8_linear_glu_quantized: the bits of the GLU op on this layer's
        output, without the [T, 2I] output in memory); None where quantized_input() is, or I % 32 != 0."""
        entry = self.quantized_input()
        r = self.runtime
        if entry is None or r.w.n % 64 or not hasattr(r.lib, "w8a8_linear_glu_quantized"):
            return None
        w, bias, op = r.w, r.bias, r.lib.w8a8_linear_glu_quantized
        return entry[0], lambda xq: op(xq[0], xq[1], w.codes, w.colsum, w.scales, bias, w.n, act)

    weights = "int8 W8A8"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 W8A8, qtk CPU VNNI kernel"


def bf16_matmul(module: nn.Module | None):
    """(rows, f) for a layer that multiplies many rows in bf16 (a WOQLinear whose `many` is bf16: oneDNN's
    bf16 matmul without bias, or qtk's bf16 kernel for its int4 / int8 codes): f(x) = x W^T (+ b) for
    bf16 or float32 x [T, K], T >= rows, with x rounded to bf16 and float32 sums: y rounded to bf16 on
    oneDNN; y float32 on qtk's bf16 kernel for bf16 weights, which takes below dot.hi rows where the layer
    has it (rows = dot.lo; the rounding of y saves nothing there); on its bf16 kernel for int4 / int8
    codes, y float32 below BF16_DOT_ROWS[1] rows and from there rounded to bf16, as a bf16 weight's y
    (a prefill chunk's [T, 2I] MLP activations in half the bytes: 5-10% of a W4A16 prefill); else None."""
    many = getattr(module, "many", None)
    if isinstance(many, QuantBF16Matmul):  # y rounded to bf16 where oneDNN would take a bf16 weight's rows
        return many.rows, rotating_input(lambda x: many(x, rows_of(x) >= BF16_DOT_ROWS[1]), module)
    if many is None or not many.bf16 or many.bias is not None:
        return None
    onednn = many.bf16_product
    dot = module.dot
    if dot is None:
        return many.rows, rotating_input(onednn, module)
    return dot.lo, rotating_input(lambda x: dot(x) if rows_of(x) < dot.hi else onednn(x), module)


def bf16_mlp(gate_up: nn.Module | None, down: nn.Module | None, glu):
    """(rows, mlp) for a GLU MLP whose gate_up and down projections multiply many rows in bf16
    (bf16_matmul): mlp(x) = down(glu(gate_up(x))) for bf16 or float32 x [T, K], T >= rows, the [T, 2I]
    and [T, I] activations between them in the dtype the projections give (bf16 on oneDNN; glu: qtk's
    fused op, which takes either); else None."""
    gu, dn = bf16_matmul(gate_up), bf16_matmul(down)
    if gu is None or dn is None:
        return None
    return max(gu[0], dn[0]), lambda x: dn[1](glu(gu[1](x)))


def direct(module: nn.Module | None):
    """What a runtime's plan calls for a layer: the kernel call itself for a packed one (PackedLinear,
    KernelLinear; float32 [T, K] contiguous x, rotated first where the module rotates its input online),
    else the module (None stays None)."""
    if isinstance(module, (PackedLinear, KernelLinear)):
        return rotating_input(module.direct(), module)
    return module


def rotating_input(f, module: nn.Module):
    """f(x) for a call that bypasses `module` (its hook): with x rotated first where the module rotates its
    input online (a down projection, hadamard.attach), by qtk's kernel (csrc/cpu_layers.cpp hadamard) where
    it is built, else hadamard.fwht; f itself where it does not."""
    block = hadamard.of(module)
    if block is None or f is None:
        return f
    lib = cpu_kernels.ops()
    if lib is None:
        return hadamard.rotating(f, block)
    op = lib.hadamard
    return lambda x: f(op(x, block))


def kept_in_bf16(weight: torch.Tensor, bias: torch.Tensor | None, many: bool = True) -> WOQLinear | None:
    """A float32 CPU weight [N, K] whose values are all bf16 numbers as a WOQLinear holding them in bf16
    (many: with oneDNN's copy for many rows), or None (some value is not a bf16 number, or qtk's CPU
    kernel is not built)."""
    lib = cpu_kernels.ops()
    packed = None if lib is None else cpu_kernels.pack_bf16(weight)
    if packed is None:
        return None
    bias = None if bias is None else bias.detach().float().contiguous()
    dot = BF16Dot.of(packed, bias, lib)
    onednn = OneDNNMatmul.of(weight, bias) if many else None
    if onednn is not None and dot is not None:
        onednn = replace(onednn, rows=dot.hi)
    return WOQLinear(CpuWOQ(packed, None, bias, lib), weight.shape[1], onednn, dot)


def steps_in_bf16(model: nn.Module) -> bool:
    """Whether the model's steps run in bf16 where they can (a bf16 checkpoint on a CPU with bf16 units,
    QTK_CPU_BF16 not 0): some layer multiplies many rows in bf16 (a float layer's oneDNN bf16 copy, a
    weight-only layer's qtk bf16 kernel), or a W8A8 layer is a bf16 checkpoint's. Its KV cache is then
    bf16 ("auto", model_runner.kv_cache_spec) and its attention bf16 (NativeModel)."""
    return any((isinstance(m, WOQLinear) and m.many is not None and m.many.bf16) or (isinstance(m, W8A8Linear) and m.bf16)
               for m in model.modules())


def bf16_lm_head(model: nn.Module) -> bool:
    """Give a float32 CPU model's lm_head (a plain nn.Linear; run this before pack_linears) to
    a bf16 WOQLinear where its weight is all bf16 numbers and qtk's CPU kernel is built (a tied
    embedding keeps the float32 weight). True if it did."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return False
    kept = kept_in_bf16(head.weight, head.bias, many=False)
    if kept is not None:
        model.lm_head = kept
    return kept is not None


def bf16_checkpoint(model: nn.Module) -> bool:
    """Whether a float32 CPU model was a bf16 checkpoint: its input embedding holds only bf16 numbers
    (a quantized checkpoint keeps it in the model's dtype). Its weight-only layers then multiply many
    rows in bf16 where the CPU has the units (pack_linears' bf16), as its float layers do."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(embed, "weight", None)
    if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
        return False
    return bool(torch.equal(w.detach().bfloat16().float(), w.detach()))


def _fused_kernel(linears: list[nn.Module], bf16: bool = False) -> KernelLinear | None:
    """One WOQLinear for sibling weight-only QuantLinears on CPU that qtk's kernel runs with
    one layout (bf16: with qtk's bf16 kernel for many rows where it runs, QuantBF16Matmul), one
    W8A8Linear for sibling W8A8 ones on its VNNI kernel that quantize their input alike, or None."""
    if not linears or not all(isinstance(m, QuantLinear) and hasattr(m, "weight_scale") for m in linears):
        return None
    dtype = linears[0].weight_scale.dtype
    if linears[0].weight_scale.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    runtimes = [build_runtime(m, torch.device("cpu"), torch.float32) for m in linears]
    first = runtimes[0]
    if all(type(r) is CpuWOQ and r.perm is None for r in runtimes):
        module = WOQLinear
    elif all(type(r) is CpuW8A8Vnni and r.per_token == first.per_token and _same_scale(r.input_scale, first.input_scale)
             for r in runtimes):  # different static scales: each layer quantizes x its own way
        module = W8A8Linear
    else:
        return None
    try:
        w = type(first.w).cat([r.w for r in runtimes]) if len(runtimes) > 1 else first.w
    except ValueError:
        return None
    biases = [r.bias for r in runtimes]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(r.w.n) for r, b in zip(runtimes, biases)])
    runtime = replace(first, w=w, bias=bias)
    if module is WOQLinear:
        bias32 = None if bias is None else bias.float().contiguous()
        return WOQLinear(runtime, linears[0].in_features, QuantBF16Matmul.of(w, bias32, first.lib) if bf16 else None)
    return W8A8Linear(runtime, linears[0].in_features, bf16 and cpu_has_native_bf16())


def _same_scale(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _packed(linears: list[nn.Module]) -> PackedLinear | WOQLinear | None:
    """One module computing the plain float32 CPU Linears side by side (outputs concatenated): their
    weights kept in bf16 where all are bf16 numbers (kept_in_bf16; not a layer of at most SMALL_FLOAT
    weights, which F.linear runs), else a PackedLinear; None when any is something else (a QuantLinear)
    or oneDNN is not there."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else torch.zeros(m.out_features) for m, b in zip(linears, biases)])
    if weight.numel() > SMALL_FLOAT and weight.device.type == "cpu" and weight.dtype == torch.float32:
        kept = kept_in_bf16(weight, bias)
        if kept is not None:
            return kept
    packed = cpu_packed_weight(weight)
    if packed is None:
        return None
    return PackedLinear(packed, bias, linears[0].in_features)


def concatenated(linears: list[nn.Module]) -> nn.Linear | None:
    """Sibling plain Linears as one nn.Linear, outputs side by side (vLLM's QKVParallelLinear and
    MergedColumnParallelLinear): one GEMM where there were three or two. For CUDA, where a decode
    step's small GEMMs are each a launch; None unless all are plain Linears of one dtype and device."""
    if len(linears) < 2 or not all(type(m) is nn.Linear for m in linears):
        return None
    w0 = linears[0].weight
    if any(m.weight.dtype != w0.dtype or m.weight.device != w0.device for m in linears):
        return None
    with torch.no_grad():
        out = nn.Linear(w0.shape[1], sum(m.out_features for m in linears), any(m.bias is not None for m in linears),
                        device="meta", dtype=w0.dtype)
        out.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
        if out.bias is not None:
            out.bias = nn.Parameter(torch.cat([m.bias if m.bias is not None else w0.new_zeros(m.out_features)
                                               for m in linears]), requires_grad=False)
    return out


def pack_linears(model: nn.Module, fuse: dict[str, tuple[str, ...]] | None = None, bf16: bool = False) -> int:
    """Replace every float32 CPU nn.Linear under `model` by a PackedLinear (a tied lm_head gets a
    packed copy; the embedding keeps the plain weight), and mark every QuantLinear so that its
    Dense runtime packs its decoded weight. `fuse` {new name: (names, ...)}: sibling Linears that
    read the same input (q/k/v, gate/up) become one matmul under the new name, the old ones are
    dropped (the runtime's forward splits the output); so do sibling weight-only QuantLinears that
    qtk's CPU kernel runs (WOQLinear), and W8A8 ones on its VNNI kernel (W8A8Linear); on CUDA, plain
    Linears only (concatenated). bf16 (a bf16
    checkpoint, bf16_checkpoint): weight-only QuantLinears multiply many rows in bf16 where the CPU
    has AVX512-BF16 (QuantBF16Matmul). Returns how many modules were packed or fused."""
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, QuantLinear):
            parent.pack_cpu_weight = True
        for new, names in (fuse or {}).items():
            if all(isinstance(getattr(parent, n, None), nn.Module) and hadamard.of(getattr(parent, n)) is None
                   for n in names):  # (a layer rotating its input online is not joined: hadamard.carry)
                siblings = [getattr(parent, n) for n in names]
                on_gpu = isinstance(getattr(siblings[0], "weight", None), torch.Tensor) and siblings[0].weight.is_cuda
                fused = concatenated(siblings) if on_gpu else _packed(siblings) or _fused_kernel(siblings, bf16)
                if fused is not None:
                    for n in names:
                        delattr(parent, n)
                    setattr(parent, new, fused)
                    count += 1
        for name, child in list(parent.named_children()):
            packed = _packed([child]) if type(child) is nn.Linear else _fused_kernel([child], bf16) if isinstance(
                child, QuantLinear) else None
            if packed is not None:
                setattr(parent, name, hadamard.carry(child, packed))
                count += 1
    return count


def kernel_weights(model: nn.Module) -> list[torch.Tensor]:
    """The tensors qtk's CPU kernels read from memory at every step (codes, scales, zeros, biases of each
    KernelLinear), for kernels/cpu.onto_huge_pages."""
    tensors = []
    for m in model.modules():
        if isinstance(m, KernelLinear):
            w = m.runtime.w
            tensors += [w.codes, w.scales, getattr(w, "zs", None), getattr(w, "colsum", None), m.runtime.bias]
    return [t for t in tensors if t is not None]


def kernel_summary(model: nn.Module) -> str:
    """Which kernel runs the linear layers, counted: "120 WOQLinear int4 (qtk_cpu_avx2), 1 WOQLinear bf16 (...)"."""
    from collections import Counter

    def named(kind: str, runtime) -> str:
        lib = getattr(runtime, "lib", None)
        return kind if lib is None else f"{kind} ({lib.__name__.rsplit('.', 1)[-1]})"

    kinds = Counter()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            cached = getattr(m, "_qtk_runtime", None)
            kinds[named(type(cached.runtime).__name__, cached.runtime) if cached else "not built yet"] += 1
        elif isinstance(m, KernelLinear):
            kinds[named(f"{type(m).__name__} {m.weights}", m.runtime)] += 1
        elif isinstance(m, PackedLinear):
            kinds["PackedLinear (oneDNN float32)"] += 1
        elif type(m) is nn.Linear:
            kinds["nn.Linear"] += 1
    return ", ".join(f"{n} {k}" for k, n in kinds.most_common()) or "none"
