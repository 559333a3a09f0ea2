"""What the compute device is fast at: the one place qtk asks, so every fast path chooses alike.

On CUDA, bf16 is native. On a CPU it depends on the chip: with AVX512-BF16 or AMX (x86) or the
BF16 extension (Arm) a bf16 matmul runs on hardware units and is 2-3x faster than float32; without
them (AVX2-only x86, common on AMD EPYC and desktop CPUs) torch emulates it and it ran 80x slower
than float32 (benchmarks/cpu_dtype.py; figures in benchmarks/results/cpu_dtype.md). So
`--dtype auto`, the default of every command, is bf16 where native and float32 elsewhere; except
qtk's runtime on a CPU, float32 wherever qtk's CPU kernels are built (choose_dtype's
`kernels_built`, which the runtime passes: this module imports no other part of qtk but errors).

The same holds for int8 dot products (AVX512-VNNI, AVX-VNNI, AMX): torch._int_mm ran 20x slower
than a float32 matmul on an AVX2-only CPU, so W8A8's integer GEMM is used on CPUs that have them.

QTK_CPU_BF16=0 makes detection answer "no native bf16" (to run the whole suite as an AVX2 CPU
would, on any machine); QTK_CPU_BF16=1 answers "native" (only to test the bf16 path's logic: it
is slow on a CPU that lacks the units). QTK_CPU_VNNI=0|1 does the same for int8 dot products.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)
OVERRIDE = "QTK_CPU_BF16"
VNNI_OVERRIDE = "QTK_CPU_VNNI"


@functools.lru_cache(maxsize=None)
def _cpu_bf16_hardware() -> tuple[bool, str]:
    """(native, what the CPU has) from torch's cpuinfo probes."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        found = [name for name, probe in (("AVX512-BF16", torch.cpu._is_avx512_bf16_supported),
                                          ("AMX", torch.cpu._is_amx_tile_supported)) if probe()]
        if found:
            return True, " and ".join(found)
        return False, f"no AVX512-BF16 or AMX (torch CPU capability {torch.backends.cpu.get_cpu_capability()})"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return native, f"{platform.machine()} {'with' if native else 'without'} bf16 instructions"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls on hardware units (QTK_CPU_BF16=0|1 overrides)."""
    return cpu_bf16_reason()[0]


def cpu_bf16_reason() -> tuple[bool, str]:
    return _forced(OVERRIDE) or _cpu_bf16_hardware()


def cpu_has_int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI or AMX; QTK_CPU_VNNI=0|1 overrides)."""
    forced = _forced(VNNI_OVERRIDE)
    if forced:
        return forced[0]
    return torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


def _forced(var: str) -> tuple[bool, str] | None:
    forced = os.environ.get(var)
    if forced in ("0", "1"):
        return forced == "1", f"{var}={forced}"
    if forced not in (None, ""):
        raise InputError(f"{var} must be 0 or 1 (or unset), got {forced!r}")
    return None


def native_bf16(device: torch.device | str) -> bool:
    """bf16 matmuls are fast on `device` (CUDA always; a CPU only with the hardware units)."""
    return torch.device(device).type != "cpu" or cpu_has_native_bf16()


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def check_device(device: torch.device | str, present: bool = True) -> torch.device:
    """`device` as a torch.device: cpu or cuda[:N]; with `present`, one this machine has (CUDA and
    that GPU there)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"device must be cpu or cuda[:N], got {device!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise InputError(f"device must be cpu or cuda[:N], got {device!r}")
    if d.type == "cuda" and present:
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r}: this machine has no CUDA GPU torch can use; pass --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs, numbered from 0")
    return d


def choose_dtype(requested: str | torch.dtype | None, device: torch.device | str = "cpu",
                 kernels_built: Callable[[], bool] | None = None) -> DtypeChoice:
    """The compute dtype for `requested` ("auto", "bfloat16", "float32" or a torch dtype) on `device`,
    with the reason; logged once per call. An explicit bf16 on a CPU without bf16 units is kept,
    with a warning.

    kernels_built: given by qtk's runtime (serve, generate, eval, lm-eval, bench engine), whether
    qtk's CPU kernels are built (kernels.cpu.built; asked only for "auto" on a CPU with bf16 units,
    as it may build them). There "auto" on a CPU is float32 whenever they are, bf16 units or not:
    its fused decoder forward and its int4 / int8 / W8A8 kernels take float32 activations, and on
    a 2-core Zen 4 with AVX512-BF16 the engine ran 1.25-3.3x faster in float32 than in bf16
    (benchmarks/results/cpu_kernels.md).
    Calibration (quantize) keeps bf16 where native: there bf16 matmuls are 2-2.5x faster."""
    device = torch.device(device)
    if isinstance(requested, torch.dtype):
        requested = str(requested).removeprefix("torch.")
    requested = requested or "auto"
    if requested not in DTYPE_CHOICES:
        raise InputError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if device.type != "cpu":
        native, why = True, f"{device.type} runs bf16 natively"
    else:
        native, why = cpu_bf16_reason()
        why = f"CPU: {why}"
    if requested == "auto" and kernels_built is not None and device.type == "cpu" and native and kernels_built():
        choice = DtypeChoice(torch.float32, "auto: qtk's CPU runtime kernels run float32 activations "
                                            "(faster than bf16 even with bf16 units; --dtype bfloat16 to override)")
        log.info("dtype %s (%s)", choice.name, choice.reason)
        return choice
    if requested == "auto":
        choice = DtypeChoice(torch.bfloat16 if native else torch.float32, f"auto: {why}")
        log.info("dtype %s (%s)", choice.name, choice.reason)
        return choice
    choice = DtypeChoice(DTYPES[requested], f"requested ({why})")
    if choice.dtype == torch.bfloat16 and not native:
        log.warning("dtype bfloat16 was requested, but this CPU has no bf16 matmul units (%s): bf16 is emulated "
                    "there and runs many times slower than float32; --dtype auto picks float32", why)
    return choice


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's; platform.processor() is "x86_64" or empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
