"""runtime/host_memory.py: glibc keeps a step's freed activations for the next step; each case in a fresh
interpreter (the setting is the process's)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform == "linux" and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# a step's three 6 MB activations (a 512-token chunk's gate/up output is one), allocated, written and freed, in a
# fresh interpreter: where they came from (mmap'd bytes while they live) and what the heap holds free after
STEP = textwrap.dedent("""
    import ctypes, torch
    from qtk.runtime.host_memory import keep_freed_memory
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    kept = keep_freed_memory()
    before = libc.mallinfo2().hblkhd
    step = [torch.empty(512, 3072).fill_(1.0) for _ in range(3)]
    mapped = libc.mallinfo2().hblkhd - before
    del step
    print(kept, mapped, libc.mallinfo2().fordblks)
""")
MB = 1 << 20


def run_step(**env) -> tuple[bool, int, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "QTK_CPU_KEEP_HEAP"))}
    out = subprocess.run([sys.executable, "-c", STEP], env={**environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33+'s malloc only")
def test_a_steps_freed_activations_stay_in_the_heap():
    """With the setting a step's activations come from the heap and stay there when freed, for the next step to
    write without faulting its pages in again (in the engine: 47,000-350,000 faults a run without it,
    benchmarks/results/prefill.md); with glibc's defaults the first are mmap'd and handed back when freed."""
    kept, mapped, free = run_step()
    assert kept and mapped == 0 and free >= 18 * MB, (mapped, free)
    kept, mapped, free = run_step(QTK_CPU_KEEP_HEAP="0")
    assert not kept and mapped >= 18 * MB and free < 18 * MB, (mapped, free)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_process_own_malloc_settings_stand():
    assert run_step(MALLOC_TRIM_THRESHOLD_="131072")[0] is False
    assert run_step(MALLOC_MMAP_THRESHOLD_="131072")[0] is False


def test_the_engine_keeps_freed_memory_on_cpu(monkeypatch):
    """LLM sets it for a CPU engine (after loading, before the first step)."""
    from qtk.runtime import engine

    calls = []
    monkeypatch.setattr(engine, "keep_freed_memory", lambda: calls.append(True) or True)
    engine.LLM("smollm2-135m", max_model_len=64, max_num_seqs=1)
    assert calls == [True]
