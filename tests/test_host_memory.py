"""runtime/host_memory.py: glibc keeps a step's freed activations for the next step, so their pages do not
fault again; each case in a fresh interpreter (the setting is the process's)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform == "linux" and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# steps of three 6 MB activations, written and freed (a 512-token chunk's gate/up output is one): the minor
# page faults of 20 steps after the first, on one thread
STEPS = textwrap.dedent("""
    import resource, sys, torch
    from qtk.runtime.host_memory import keep_freed_memory
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    def step():
        for t in [torch.empty(512, 3072) for _ in range(3)]:
            t.fill_(1.0)
    step()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
""")


def run_steps(**env) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "QTK_CPU_KEEP_HEAP"))}
    out = subprocess.run([sys.executable, "-c", STEPS], env={**environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_activations_are_reused_without_faults():
    """With the setting a step's pages are the last step's: a tenth of the faults of glibc's defaults, where
    each step's 18 MB is trimmed from the heap and faults in again (4,600 pages a step)."""
    kept, faults = run_steps()
    default, default_faults = run_steps(QTK_CPU_KEEP_HEAP="0")
    assert kept and not default
    assert default_faults > 20 * 3000 and faults < default_faults / 5, (faults, default_faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_process_own_malloc_settings_stand():
    assert run_steps(MALLOC_TRIM_THRESHOLD_="131072")[0] is False
    assert run_steps(MALLOC_MMAP_THRESHOLD_="131072")[0] is False


def test_the_engine_keeps_freed_memory_on_cpu(monkeypatch):
    """LLM sets it for a CPU engine (after loading, before the first step)."""
    from qtk.runtime import engine

    calls = []
    monkeypatch.setattr(engine, "keep_freed_memory", lambda: calls.append(True) or True)
    engine.LLM("smollm2-135m", max_model_len=64, max_num_seqs=1)
    assert calls == [True]
