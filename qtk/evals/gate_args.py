"""The options each gate task takes (a gates file's `args:`), checked and normalized when the file
loads, before any model runs: a wrong type or value is an InputError naming the gate and the
option. A file option (a ppl or json `dataset`, a needle `filler`) is found relative to the gates
file unless absolute, and must exist; the built-in names (builtin, hf:NAME) pass as they are."""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError, NotFoundError


def _int(low: int, high: int | None = None):
    """An integer in [low, high]."""
    def check(where: str, value, base: Path) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise InputError(f"{where} must be an integer {bound}, got {value!r}")
        return value
    return check


def _int_list(low: int, high: int | None = None):
    """A non-empty list of integers in [low, high], sorted, each once (a repeat would count twice)."""
    one = _int(low, high)

    def check(where: str, value, base: Path) -> list[int]:
        if not isinstance(value, list) or not value:
            raise InputError(f"{where} must be a non-empty list of integers, e.g. [256, 1024], got {value!r}")
        return sorted({one(where, v, base) for v in value})
    return check


def _bool(where: str, value, base: Path) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where} must be true or false, got {value!r}")
    return value


def _file(where: str, value, base: Path) -> str:
    """A file, relative to the gates file unless absolute: its resolved path."""
    if not isinstance(value, str) or not value:
        raise InputError(f"{where} must be a file path, got {value!r}")
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else base / path).resolve()
    if not path.is_file():
        raise NotFoundError(f"{where}: file {path} not found (a relative path is read from the gates file's folder)")
    return str(path)


def _source(hub: bool):
    """builtin, hf:NAME (where the task reads the Hugging Face hub) or a file."""
    def check(where: str, value, base: Path) -> str:
        if value == "builtin" or (hub and isinstance(value, str) and value.startswith("hf:")):
            return value
        return _file(where, value, base)
    return check


TASK_ARGS = {
    "ppl": {"seq_len": _int(2), "limit": _int(1), "dataset": _source(hub=True), "batch_size": _int(1)},
    "needle": {"lengths": _int_list(16), "depths": _int_list(0, 100), "samples": _int(1), "filler": _source(hub=False)},
    "json": {"limit": _int(1), "constrained": _bool, "dataset": _source(hub=False), "max_tokens": _int(1)},
    "lm-eval": {"limit": _int(1), "num_fewshot": _int(0)},
    "tasks": {"limit": _int(1)},  # a team's own cases (user_tasks.py)
    "replay": {"limit": _int(1), "max_tokens": _int(1)},  # a request log replayed on both models (replay.py)
}
FILE_ARGS = ("dataset", "filler")  # the options that may name a file


def check_args(where: str, kind: str, args, base: Path) -> dict:
    """The task's `args` checked and normalized; `base` is the gates file's folder."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise InputError(f"{where}: args must be a mapping of option: value (e.g. {{limit: 8}}), got {args!r}")
    unknown = set(args) - set(TASK_ARGS[kind])
    if unknown:
        raise InputError(f"{where}: unknown arg(s) {sorted(unknown)} for task {kind}; "
                         f"allowed: {sorted(TASK_ARGS[kind])}")
    return {name: TASK_ARGS[kind][name](f"{where}: args.{name}", value, base) for name, value in args.items()}


def input_files(gate) -> list[str]:
    """The files a gate's scores depend on: its tasks/replay file and any file option."""
    files = [gate.task.split(":", 1)[1]] if gate.kind in ("tasks", "replay") else []
    for name in FILE_ARGS:
        value = gate.args.get(name)
        if isinstance(value, str) and value != "builtin" and not value.startswith("hf:"):
            files.append(value)
    return files
