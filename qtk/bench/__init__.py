"""Benchmarks that print and record numbers (`qtk bench`; protocols: docs/benchmarks.md).

Modules: engine (`qtk bench engine`: qtk's runtime against transformers, vLLM and llama.cpp),
serve (`qtk bench serve`: an OpenAI-compatible server under load), kernels_gpu and kernels_cpu
(`qtk bench kernels`: the quantized GEMMs on CUDA, qtk's CPU kernels).
"""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(cwd: Path = Path(__file__).parent) -> str:
    """HEAD's hash, with "-dirty" when tracked files differ from it (the numbers are not HEAD's)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=cwd).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")
