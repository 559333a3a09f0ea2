"""Where qtk keeps what it makes once and reuses: GGUF conversions, CPU kernel builds, the gates'
baseline cache ($QTK_CACHE, else ~/.cache/qtk)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("QTK_CACHE", Path.home() / ".cache" / "qtk"))
