"""The checks of a gate task's options (a gates file's `args:`; each task's are in tasks.TASKS),
run when the file loads, before any model runs: a wrong type or value is an InputError naming the gate and the
option. A file option (a ppl or json `dataset`, a needle `filler`) is found relative to the gates
file unless absolute, and must exist; the built-in names (builtin, hf:NAME) pass as they are."""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError, NotFoundError


def integer(low: int, high: int | None = None):
    """An integer in [low, high]."""
    def check(where: str, value, base: Path) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise InputError(f"{where} must be an integer {bound}, got {value!r}")
        return value
    return check


def integers(low: int, high: int | None = None):
    """A non-empty list of integers in [low, high], sorted, each once (a repeat would count twice)."""
    one = integer(low, high)

    def check(where: str, value, base: Path) -> list[int]:
        if not isinstance(value, list) or not value:
            raise InputError(f"{where} must be a non-empty list of integers, e.g. [256, 1024], got {value!r}")
        return sorted({one(where, v, base) for v in value})
    return check


def boolean(where: str, value, base: Path) -> bool:
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


def source(hub: bool):
    """builtin, hf:NAME (where the task reads the Hugging Face hub) or a file."""
    def check(where: str, value, base: Path) -> str:
        if value == "builtin" or (hub and isinstance(value, str) and value.startswith("hf:")):
            return value
        return _file(where, value, base)
    return check


FILE_ARGS = ("dataset", "filler")  # the options that may name a file


def check_args(where: str, kind: str, allowed: dict, args, base: Path) -> dict:
    """The task's `args` checked and normalized: `allowed` maps each option to its check (the
    task's row in tasks.TASKS); `base` is the gates file's folder."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise InputError(f"{where}: args must be a mapping of option: value (e.g. {{limit: 8}}), got {args!r}")
    unknown = set(args) - set(allowed)
    if unknown:
        raise InputError(f"{where}: unknown arg(s) {sorted(unknown)} for task {kind}; allowed: {sorted(allowed)}")
    return {name: allowed[name](f"{where}: args.{name}", value, base) for name, value in args.items()}
