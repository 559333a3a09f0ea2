"""--log-requests: an opt-in JSONL of the requests a server answered (the request body and the
response's texts; headers, so the API key, are never seen here), for the gates to replay against
a candidate checkpoint. Lines are appended whole under a lock (requests finish concurrently), and
the file is rotated by size: FILE -> FILE.1 -> ... -> FILE.<backups>, the oldest dropped."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class RequestLog:
    def __init__(self, path: str | Path, max_bytes: int = 64 * 2**20, backups: int = 3):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.backups = max_bytes, backups
        self._lock = threading.Lock()

    def write(self, endpoint: str, request: dict, choices: list[dict], usage: dict | None) -> None:
        line = json.dumps({"time": time.time(), "endpoint": endpoint, "request": request,
                           "response": {"choices": choices, "usage": usage}}, ensure_ascii=False) + "\n"
        with self._lock:
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)

    def _rotate(self) -> None:
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
