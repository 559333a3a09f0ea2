"""qtk's CPU kernels: weight-only int4/int8 layers with float32 activations (csrc/cpu_woq.cpp) and,
on CPUs with AVX512-VNNI, W8A8 int8 layers (csrc/cpu_w8a8.cpp).

Why qtk carries its own: on an AVX2-only CPU nothing in torch or the libraries we measured reads
the 4-bit codes faster than a float32 matmul reads float32 weights (benchmarks/results/
cpu_kernel_survey.md): torch._weight_int4pack_mm_for_cpu took ~23x the float32 matmul's time with
float32 activations, and vLLM's CPU build has no W4A16 kernel below AVX-512. The kernel here
decodes the codes in registers and streams them once per 4 rows of x, so a decode step reads
about an eighth of the float32 bytes.

The extension is compiled on first use with torch.utils.cpp_extension (g++ and ninja; about a
minute) into qtk's cache, one build per variant, torch installation and source (the sources are
copied into the build, so checkouts of one version share it):
    avx512   -mavx512f/bw/vl/dq -mavx512vnni: CPUs with AVX-512 and AVX512-VNNI (Intel from Cascade
             Lake, AMD from Zen 4): the int4 gemv on VNNI (x as 24-bit integers: three int8 limbs per
             value; off with QTK_CPU_VNNI=0), the int8 / bf16 gemv on 16 lanes from 4 rows, and the W8A8
             kernel;
             where the CPU also has AVX512-BF16 (checked at run time), the bf16 kernels: layers for a
             decode batch, and a bf16 checkpoint's weight-only int4 / int8 layers for many rows
             (cpu_bf16_linear.cpp), prefill and decode attention (cpu_attention.cpp); the float32
             prefill attention and the fused element-wise ops (GLUs, norms: cpu_layers.cpp) on 16 lanes
    avx2     -mavx2 -mfma: other CPUs whose torch capability is AVX2 or AVX512 (Skylake-SP); the float32
             prefill attention on 8 lanes
    generic  portable C++ loops (-O3, whatever the compiler vectorizes): any other CPU
QTK_CPU_KERNEL=avx512|avx2|generic|off overrides the choice (off: the reference path, a float32
matmul on weights decoded once; avx512 is refused on a CPU without it). Without a compiler the
reference path runs, with one warning. AMX has no build of its own: every AMX CPU has AVX-512 and
VNNI and runs the avx512 build (no AMX machine was available to write and measure tile kernels on).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import write_file
from ..device import cpu_has_int8_dot
from ..errors import InputError
from ..paths import cache_dir

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_woq.cpp", "cpu_w8a8.cpp", "cpu_layers.cpp",
                                                                 "cpu_attention.cpp", "cpu_bf16_linear.cpp", "cpu_decode.cpp",
                                                                 "cpu_bindings.cpp", "cpu_kv.h", "cpu_act_quant.h", "cpu_glu.h",
                                                                 "cpu_ops.h")]
OVERRIDE = "QTK_CPU_KERNEL"
VARIANTS = {
    "avx512": ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mavx512vnni", "-DQTK_LIB=qtk_cpu_avx512"],
    "avx2": ["-O3", "-fopenmp", "-mavx2", "-mfma", "-DQTK_LIB=qtk_cpu_avx2"],
    "generic": ["-O3", "-fopenmp", "-DQTK_LIB=qtk_cpu_generic"],
}  # -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, and runs serially without it
LANES = 8  # output columns per packed block (one AVX2 register)
STALE_LOCK_S = 600  # a build takes 1-2 minutes: a lock file older than this is a killed build's



def variant() -> str | None:
    """The kernel build for this CPU (QTK_CPU_KERNEL overrides), or None for the reference path."""
    return _variant(os.environ.get(OVERRIDE, ""))


@functools.lru_cache(maxsize=None)
def _variant(forced: str) -> str | None:  # cached: the runtime asks once per layer and step
    if forced:
        if forced not in (*VARIANTS, "off"):
            raise InputError(f"{OVERRIDE} must be one of {', '.join(VARIANTS)}, off (or unset), got {forced!r}")
        if forced == "avx512" and not _has_avx512():
            raise InputError(f"{OVERRIDE}=avx512 needs a CPU with AVX-512 (F, BW, VL, DQ) and AVX512-VNNI; this one "
                             f"has {torch.backends.cpu.get_cpu_capability()} (use avx2 or generic)")
        return None if forced == "off" else forced
    if _has_avx512():
        return "avx512"
    return "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "generic"


def _has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ (torch's AVX512 capability) and AVX512-VNNI: Intel from Cascade Lake, AMD
    from Zen 4. Skylake-SP (AVX-512 without VNNI) runs the avx2 build."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_vnni_supported()


@functools.lru_cache(maxsize=None)
def library(name: str):
    """The kernel build `name` as a Python module (compiled and loaded on first call), or None if it
    cannot be built. Its functions are also torch operators, torch.ops.qtk_cpu_<name>.*; the
    module's are plain pybind11 calls: ~1 us each from Python against ~4.5 us through torch.ops,
    and a decode step makes ~10 per layer."""
    from torch.utils import cpp_extension

    flags = VARIANTS[name]
    sources = {p.name: p.read_bytes() for p in SOURCES}
    # what ninja's commands hold besides the sources (torch's and Python's headers, by path): two
    # environments with one torch version get a build each instead of rebuilding each other's
    env = [" ".join(flags), torch.__version__, os.path.dirname(torch.__file__), sysconfig.get_paths()["include"]]
    tag = hashlib.sha256(b"".join(sources.values()) + "\n".join(env).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / f"cpu_woq-{name}-{tag}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(build / "lock")
        module = cpp_extension.load(name=f"qtk_cpu_woq_{name}", sources=_copy_sources(build / "src", sources),
                                    extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build),
                                    is_python_module=True, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, ninja or writable cache, or a failed build
        log.warning("qtk's %s CPU kernel could not be built (%s); weight-only layers run as float32 matmuls "
                    "on decoded weights instead (the fast path needs g++, ninja and a writable cache, $QTK_CACHE or "
                    "~/.cache/qtk)", name,
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None

    @torch.library.register_fake(f"qtk_cpu_{name}::woq_linear")
    def _(x, codes, scales, zs, bias, bits, n):  # shapes for torch.compile
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake(f"qtk_cpu_{name}::w8a8_linear")
    def _(x, codes, colsum, scales, static_scale, bias, n):
        return x.new_empty(*x.shape[:-1], n)

    module.torch_ops = getattr(torch.ops, f"qtk_cpu_{name}")  # what torch.compile traces
    set_int4_limbs(module)
    return module


def set_int4_limbs(module) -> None:
    """The int4 gemv on VNNI (the avx512 build: x as 24-bit limbs) unless QTK_CPU_VNNI=0, read when a build
    is loaded."""
    module.set_int4_limb_rows(-1 if cpu_has_int8_dot() else 0)


def _copy_sources(src: Path, sources: dict[str, bytes]) -> list[str]:
    """The sources written into the build directory, once (its name holds their hash). ninja's
    commands name the files they compile, so two checkouts of one version (git worktrees, copies)
    compiling their own files would rebuild each other's build at every first call."""
    src.mkdir(exist_ok=True)
    paths = []
    for name, data in sources.items():
        path = src / name
        if not path.exists():  # written whole: a concurrent build sees all of it or none
            write_file(path, data)
        if path.suffix == ".cpp":  # headers are written beside them, not compiled
            paths.append(str(path))
    return paths


def _drop_stale_lock(lock: Path) -> None:
    """Remove the lock of a build that was killed (SIGKILL, out of memory): cpp_extension waits for
    it to go away, and would wait forever."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f minutes ago by a CPU kernel build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)


def ops():
    """The kernel library this CPU uses, or None (reference path)."""
    name = variant()
    return None if name is None else library(name)


def built() -> bool:
    """Whether this CPU runs qtk's kernels (built now if need be): device.choose_dtype asks it for
    the runtime's "auto"."""
    return ops() is not None


@dataclass(frozen=True)
class PackedWOQ:
    """A weight-only layer in the kernel's layout (csrc/cpu_woq.cpp): codes [N/8, K/8, 8] int32
    words of 8 unsigned nibbles u = q + 8 (int4), [N/8, K, 8] int8, or [N/8, K, 8] bf16 bits (a
    float layer, bits 16), scales [N/8, G, 8], and zs = scale * zero of the stored codes
    [N/8, G, 8] (int4 always; int8 when asymmetric)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zs: torch.Tensor | None
    bits: int
    n: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zs) if t is not None)

    @staticmethod
    def cat(parts: list[PackedWOQ]) -> PackedWOQ:
        """Layers reading the same input side by side (outputs concatenated): each n % 8 == 0."""
        if len({(p.bits, p.scales.shape[1], p.zs is None, p.codes.shape[1:]) for p in parts}) != 1 or \
                any(p.n % LANES for p in parts):
            raise ValueError("only layers of one layout and whole 8-column blocks can be joined")
        zs = None if parts[0].zs is None else torch.cat([p.zs for p in parts])
        return PackedWOQ(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zs,
                         parts[0].bits, sum(p.n for p in parts))


def supports(k: int, group: int | None, bits: int) -> bool:
    """Whether the kernel takes a layer with input size k, codes in groups of `group` (None: one
    group per row) and `bits`."""
    gs = k if group is None else group
    return bits in (4, 8) and k % gs == 0 and (bits == 8 or gs % 8 == 0)


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> PackedWOQ:
    """codes int8 [N, K] (signed: int4 in -8..7), scale [N, G], zero [N, G] in the codes' domain or
    None (symmetric) -> the kernel's layout. N is padded to a multiple of 8 with zero columns."""
    n, k = codes.shape
    g = scale.reshape(n, -1).shape[1]
    if not supports(k, k // g if k % g == 0 else None, bits) or k % g:
        raise ValueError(f"{g} groups do not divide K={k} (int4: into multiples of 8)")
    pad = (-n) % LANES
    s = scale.float().reshape(n, g)
    z = None if zero is None else zero.float().reshape(n, g)
    if bits == 4:
        u = codes.to(torch.int32) + 8  # 0..15
        z = (torch.zeros_like(s) if z is None else z) + 8
    else:
        u = codes.to(torch.int8)
    if pad:
        u = torch.cat([u, u.new_full((pad, k), 8 if bits == 4 else 0)])
        s = torch.cat([s, s.new_zeros(pad, g)])
        z = None if z is None else torch.cat([z, z.new_zeros(pad, g)])
    nb = (n + pad) // LANES
    blocks = u.reshape(nb, LANES, k).transpose(1, 2)  # [N/8, K, 8]
    if bits == 4:  # word (nb, kb, j): u[8kb + i, 8nb + j] in bits 4i..4i+3
        octets = blocks.reshape(nb, k // 8, 8, LANES).to(torch.int64)
        shifts = torch.arange(0, 32, 4, dtype=torch.int64).reshape(1, 1, 8, 1)
        words = (octets << shifts).sum(2)  # < 2^32
        packed = (words - (words >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).contiguous()
    else:
        packed = blocks.contiguous()
    by_block = lambda t: t.reshape(nb, LANES, g).transpose(1, 2).contiguous()  # noqa: E731  [N/8, G, 8]
    return PackedWOQ(packed, by_block(s), None if z is None else by_block(z * s), bits, n)


def pack_bf16(weight: torch.Tensor) -> PackedWOQ | None:
    """A float weight [N, K] whose values are all bf16 numbers (a bf16 checkpoint's, upcast) in the
    kernel's layout as bf16 (bits 16, unit scales): half the bytes of float32, the same products.
    None where some value is not a bf16 number (the weight would change)."""
    w = weight.detach()
    b = w.to(torch.bfloat16)
    if not torch.equal(b.float(), w.float()):
        return None
    n, k = w.shape
    pad = (-n) % LANES
    if pad:
        b = torch.cat([b, b.new_zeros(pad, k)])
    nb = (n + pad) // LANES
    codes = b.view(torch.int16).reshape(nb, LANES, k).transpose(1, 2).contiguous()  # [N/8, K, 8]
    return PackedWOQ(codes, torch.ones(nb, 1, LANES), None, 16, n)


def code_zeros(w: PackedWOQ) -> torch.Tensor | None:
    """The zeros of a weight-only layer's stored codes as int32 [N/8, G, 8] (zs / scales: 8 + the zero
    for int4, whose codes are q + 8; 0 where a scale is 0), what woq_bf16_linear subtracts from the codes
    before its bf16 products; None for symmetric int8 (no zs). ValueError where a zero is not a whole code
    (the codes less it would not be exact in bf16)."""
    if w.zs is None:
        return None
    nonzero = w.scales != 0
    z = torch.where(nonzero, torch.round(w.zs / torch.where(nonzero, w.scales, 1)), 0)
    if not torch.equal(z * w.scales, w.zs) or z.abs().max() > 128:  # |code - zero| <= 256: exact in bf16
        raise ValueError("the layer's zeros are not whole codes")
    return z.to(torch.int32).contiguous()


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's madvise advice


def onto_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Move CPU tensors, in place (Tensor.set_: every holder of each tensor sees the move), into one buffer that
    Linux may back with 2 MB pages (madvise MADV_HUGEPAGE, asked before the buffer is written) -> the bytes
    moved; 0 where there is nothing to move or the buffer could not be advised (not Linux). A decode step
    streams every weight once: on 4 KB pages it walks a page table entry per 4 KB, and qtk's int4 kernel at
    one row streamed SmolLM2's layers 6-20% faster from 2 MB pages on 2 Zen 4 cores (the kernel's software
    prefetches do not cross a missing translation). Each tensor starts on a 64-byte line."""
    import ctypes
    import sys

    unique = list({id(t): t for t in tensors if t is not None and t.device.type == "cpu" and t.numel()}.values())
    if not unique or not sys.platform.startswith("linux"):
        return 0
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in unique]
    total = sum(sizes)
    advised = -(-total // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, from the first boundary in the buffer
    buf = torch.empty(advised + HUGE_PAGE, dtype=torch.uint8)  # not written yet: no page is backed
    start = -buf.data_ptr() % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(buf.data_ptr() + start, advised, MADV_HUGEPAGE) != 0:
        return 0
    storage, offset = buf.untyped_storage(), start
    with torch.no_grad():
        for t, size in zip(unique, sizes):
            n = t.numel() * t.element_size()
            buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t.contiguous())
            with torch.inference_mode(t.is_inference()):
                t.set_(storage, offset // t.element_size(), t.shape, t.contiguous().stride())
            offset += size
    return total


def woq_linear(x: torch.Tensor, w: PackedWOQ, bias: torch.Tensor | None, lib) -> torch.Tensor:
    """y = x @ dequant(W)^T + bias for float32 x [..., K]; lib: a kernel library (ops(), library(name))."""
    op = lib.torch_ops.woq_linear if torch.compiler.is_compiling() else lib.woq_linear
    return op(x, w.codes, w.scales, w.zs, bias, w.bits, w.n)


W8A8_COLS = 16  # output columns per block of the W8A8 layout (one AVX-512 register of int32 sums)


@dataclass(frozen=True)
class PackedW8A8:
    """An int8 W8A8 layer in csrc/cpu_w8a8.cpp's layout: codes int8 [N16/16, K4/4, 16, 4] (4 consecutive
    k of a column per dword), colsum int32 [N16] = 128 * sum_k q_w[n, k], scales float32 [N16]."""

    codes: torch.Tensor
    colsum: torch.Tensor
    scales: torch.Tensor
    n: int

    @staticmethod
    def cat(parts: list[PackedW8A8]) -> PackedW8A8:
        """Layers reading the same input side by side (outputs concatenated): each n % 16 == 0."""
        if len({p.codes.shape[1:] for p in parts}) != 1 or any(p.n % W8A8_COLS for p in parts):
            raise ValueError("only layers of one input size and whole 16-column blocks can be joined")
        return PackedW8A8(torch.cat([p.codes for p in parts]), torch.cat([p.colsum for p in parts]),
                          torch.cat([p.scales for p in parts]), sum(p.n for p in parts))


def pack_w8a8(codes: torch.Tensor, scale: torch.Tensor) -> PackedW8A8:
    """int8 weight codes [N, K] and their per-channel (or per-tensor) scale -> the W8A8 kernel's layout."""
    n, k = codes.shape
    pad_n, pad_k = (-n) % W8A8_COLS, (-k) % 4
    q = torch.nn.functional.pad(codes.to(torch.int8), (0, pad_k, 0, pad_n))
    n16, k4 = n + pad_n, k + pad_k
    blocks = q.reshape(n16 // W8A8_COLS, W8A8_COLS, k4 // 4, 4).transpose(1, 2).contiguous()
    colsum = torch.nn.functional.pad(128 * codes.to(torch.int32).sum(1), (0, pad_n)).to(torch.int32)
    s = scale.float().reshape(-1).expand(n) if scale.numel() == 1 else scale.float().reshape(n)
    return PackedW8A8(blocks, colsum.contiguous(), torch.nn.functional.pad(s, (0, pad_n)).contiguous(), n)


def w8a8_linear(x: torch.Tensor, w: PackedW8A8, static_scale: torch.Tensor | None, bias: torch.Tensor | None,
                lib) -> torch.Tensor:
    """y = (q_x @ q_w^T) * s_x * s_w + bias for float32 x [..., K], x quantized to int8 in the call
    per token (static_scale None) or with the static per-tensor scale, as quantize_activation does."""
    op = lib.torch_ops.w8a8_linear if torch.compiler.is_compiling() else lib.w8a8_linear
    return op(x, w.codes, w.colsum, w.scales, static_scale, bias, w.n)
