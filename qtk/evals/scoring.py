"""Scoring a model on the gates' tasks, and the baseline's cache.

run_task runs one gate's task on an engine; score_model runs every gate's task on one model (each
task once), the baseline's results read from and written to the cache under ~/.cache/qtk/gates
($QTK_CACHE/gates). A cache entry's key holds everything its numbers depend on: the model's
content hash, the task and its arguments, the sha256 of every file the task reads (a tasks file,
a request log, a dataset, a needle filler), the engine settings with the dtype as resolved on this
machine, the seed and qtk's version. Entries are written whole (a temporary file renamed over
the entry); one that cannot be read is recomputed, with a warning. A result's tensors (the kld
task's baseline log-probabilities) go to a safetensors file beside the entry, written first: an
entry names its tensors file, so a reader never finds the numbers without the tensors.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import write_file, write_files
from ..runtime.config import EngineConfig
from .tasks import TASKS, Gate, input_files

log = logging.getLogger(__name__)

CACHE_VERSION = 6  # bump when a task's metrics change: cached baselines are recomputed


def run_task(llm, gate: Gate, seed: int = 0, reference: dict | None = None) -> dict:
    """The gate's task on one engine: {metric: value}, the default metric first (keys starting
    with "_" carry data, not metrics). `reference`: the baseline's result, for tasks that compare
    (replay)."""
    return TASKS[gate.kind].run(llm, gate, seed, reference)


# -- the baseline's cache ------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model: str) -> str:
    """sha256 over every file of the model (names and contents), file hashes cached by size and
    mtime so a rerun does not read the weights again."""
    from ..loading import resolve
    from ..paths import cache_dir

    root = Path(resolve(model))
    files = sorted(p for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file())
    cache_path = cache_dir() / "file_hashes.json"
    cache = _read_json(cache_path) or {}
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        key = f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key] = file_sha256(p)
        h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0{cache[key]}\n".encode())
    _write_json(cache_path, cache)
    return h.hexdigest()


def _cache_key(fingerprint: str, gate: Gate, engine_args: dict, seed: int) -> str:
    from ..device import choose_dtype
    from ..kernels import cpu as cpu_kernels
    from ..version import __version__

    dtype = choose_dtype(engine_args.get("dtype"), engine_args.get("device", "cpu"), kernels_built=cpu_kernels.built)
    engine = {**engine_args, "dtype": dtype.name}
    files = {f: file_sha256(Path(f)) for f in input_files(gate)}
    if gate.kind == "lm-eval":  # lm-eval's own version and qtk's local task data score the task too
        import importlib.metadata

        from .lm_eval_adapter import TASKS_DIR

        files.update({f.name: file_sha256(f) for f in sorted(TASKS_DIR.iterdir()) if f.is_file()})
        files["lm_eval"] = importlib.metadata.version("lm_eval")
    spec = json.dumps({"model": fingerprint, "task": gate.task, "args": gate.args, "files": files, "engine": engine,
                       "seed": seed, "qtk": __version__, "metrics": CACHE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def _read_json(path: Path) -> dict | None:
    """A cache file's dict; None when it is missing, and when it cannot be read (with a warning:
    it is recomputed and rewritten)."""
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable cache entry %s (%s): recomputing it", path, e)
        return None
    if not isinstance(value, dict):
        log.warning("ignoring the cache entry %s (not a JSON object): recomputing it", path)
        return None
    return value


def _write_json(path: Path, value: dict) -> None:
    write_file(path, json.dumps(value))


def _write_entry(path: Path, metrics: dict) -> None:
    """A cache entry: its tensors to PATH.safetensors, then the rest to PATH (JSON) naming them."""
    tensors = {k: v.contiguous() for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    if tensors:
        tensor_file = path.with_suffix(".safetensors")
        with write_files(path.parent, [tensor_file.name]) as staging:
            save_file(tensors, staging / tensor_file.name)
    _write_json(path, {**{k: v for k, v in metrics.items() if k not in tensors},
                       **({"_tensors": sorted(tensors)} if tensors else {})})


def _read_entry(path: Path) -> dict | None:
    """A cache entry with its tensors; None when missing or unreadable (with a warning)."""
    value = _read_json(path)
    names = (value or {}).pop("_tensors", [])
    if not names:
        return value
    tensor_file = path.with_suffix(".safetensors")
    try:
        tensors = load_file(tensor_file)
    except (OSError, SafetensorError) as e:
        log.warning("ignoring the cache entry %s: its tensors %s cannot be read (%s): recomputing it", path,
                    tensor_file, e)
        return None
    if set(names) - set(tensors):
        log.warning("ignoring the cache entry %s: %s lacks %s: recomputing it", path, tensor_file,
                    sorted(set(names) - set(tensors)))
        return None
    return {**value, **{k: tensors[k] for k in names}}


def score_model(engine: EngineConfig, gates: list[Gate], seed: int, label: str, cache: bool,
                echo=print, reference: dict[str, dict] | None = None,
                stop: Callable[[Gate, dict], bool] | None = None) -> dict[str, dict]:
    """{gate name: metrics} for engine.model, each task once (gates sharing a task share its run);
    cached results are used when `cache` (the baseline); `reference` is the baseline's results,
    given when scoring the candidate. With `stop`, the gates after the first one it says yes to
    (gate, its metrics) are not run: a candidate already failed need not finish."""
    from ..paths import cache_dir

    model = engine.model
    engine_args = {k: v for k, v in asdict(engine).items() if k != "model"}  # what the cache key holds
    gates_cache = cache_dir() / "gates"
    fingerprint = model_fingerprint(model) if cache else None
    results, llm = {}, None
    by_task: dict[str, dict] = {}
    for gate in gates:
        task_key = json.dumps([gate.task, gate.args], sort_keys=True)
        if task_key in by_task:
            results[gate.name] = by_task[task_key]
            if stop is not None and stop(gate, results[gate.name]):
                break
            continue
        path = gates_cache / f"{_cache_key(fingerprint, gate, engine_args, seed)}.json" if cache else None
        metrics = _read_entry(path) if path is not None else None
        if metrics is not None:
            echo(f"[{label}] {gate.task}: cached ({_brief(metrics)})")
        else:
            if llm is None:
                from ..runtime.engine import LLM

                echo(f"[{label}] loading {model}")
                llm = LLM(config=engine)
            echo(f"[{label}] {gate.task} ...")
            t0 = time.perf_counter()
            metrics = run_task(llm, gate, seed, None if reference is None else reference[gate.name])
            echo(f"[{label}] {gate.task}: {_brief(metrics)} ({time.perf_counter() - t0:.0f} s)")
            if path is not None:
                _write_entry(path, metrics)
        by_task[task_key] = results[gate.name] = metrics
        if stop is not None and stop(gate, metrics):
            break
    return results


def _brief(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.startswith("_"))[:200]
