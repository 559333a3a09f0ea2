"""The heap between CPU steps: keep what a step frees for the next one.

A CPU step allocates its activations anew (each op returns a new tensor: a 512-token chunk of SmolLM2 writes
a 6 MB float32 [512, 3072] gate/up output in every layer), and glibc's malloc hands memory of that size back
to the kernel when it is freed, unless its history says otherwise: blocks from its mmap threshold up are
mmap'd and unmapped (the threshold starts at 128 KiB and follows the largest mmap'd block freed), and the top
of the heap is trimmed past twice that. Each page of the next step's first write then faults. How often
depends on the order of past allocations, so it differs from run to run: 64 requests of 256 tokens, 128 out,
16 at a time, in-process, the W8A8 checkpoint, 2-core Zen 5: one run 300,000 minor faults and 725 output tok/s,
the next 25 faults and 792 tok/s; the bundled model in float32 (QTK_CPU_BF16=0): 232,000. In a loop of
256-token prefills the W8A8 layer that writes the 6 MB output ran at 1.28 TOP/s (94,000 faults a run) where it
runs at 1.65 without them. vLLM's CPU build runs under tcmalloc for the same reason (its docs preload it);
Intel's PyTorch launcher preloads jemalloc, told never to return memory.

keep_freed_memory() makes glibc keep it, from the engine's construction on: blocks up to 32 MiB (glibc's
largest mmap threshold) come from the heap, and the heap's top is returned only past 1 GiB free. A step
reuses the pages of the one before; the heap holds at most what the largest step used. Where the process set
MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc's own knobs) their choice stands; QTK_CPU_KEEP_HEAP=0
leaves glibc's defaults; other C libraries (musl, macOS) are left as they are.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
OVERRIDE = "QTK_CPU_KEEP_HEAP"
_kept = False


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (the module's docstring), once per process; whether it
    does (False: not glibc, the process's own MALLOC_* settings, or QTK_CPU_KEEP_HEAP=0)."""
    global _kept
    if _kept:
        return True
    if sys.platform != "linux" or os.environ.get(OVERRIDE, "1") == "0":
        return False
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc: musl's mallopt is a stub
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _kept:
        log.debug("glibc's malloc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB",
                  MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _kept
