"""Quality gates: one verdict on whether a candidate checkpoint is still good enough to ship.

    qtk eval CANDIDATE --baseline BASE --gates default [--report DIR] [--json OUT]

Both models run the same tasks on qtk's runtime (what `qtk serve` would serve), with the same
data, seeds and engine settings; each gate compares one metric of the candidate with the
baseline's. A gates file (YAML; qtk/evals/data/gates/default.yaml is the default, commented):

    gates:
      ppl:                          # a name of your choosing
        task: ppl                   # ppl | needle | json | lm-eval:TASK[,TASK] | tasks:FILE.jsonl | replay:LOG.jsonl
        args: {seq_len: 1024, limit: 8}       # the task's options (TASK_ARGS below)
        metric: ppl                 # one of the task's metrics (default: its first)
        max_increase_pct: 10        # hard: candidate <= baseline x 1.10 (a lower-is-better metric)
      needle:
        task: needle
        min_recovery_pct: 90        # hard: candidate >= 90% of baseline (a higher-is-better metric)
      json:
        task: json
        weight: 1                   # soft: no threshold of its own, counted in the weighted score
    soft:
      min_score_pct: 95             # the soft gates' weighted mean recovery must reach this

Hard thresholds: max_increase_pct (lower-is-better metrics), min_recovery_pct (higher-is-better;
recovery = candidate / baseline, or baseline / candidate for lower-is-better), min and max
(absolute). A gate with a threshold is hard; one with a weight also counts in the soft score
(recovery capped at 100%, so a gain on one metric does not hide a loss on another).

Baseline scores are cached under ~/.cache/qtk/gates ($QTK_CACHE/gates) by the baseline's content hash (every file
of the model), the task and its arguments, the engine settings and qtk's version, so a rerun
against a new candidate only computes the candidate.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, NotFoundError

DATA = Path(__file__).parent / "data"
GATE_KEYS = {"task", "args", "metric", "max_increase_pct", "min_recovery_pct", "min", "max", "weight"}
THRESHOLDS = ("max_increase_pct", "min_recovery_pct", "min", "max")
TASK_ARGS = {
    "ppl": {"seq_len", "limit", "dataset", "batch_size"},
    "needle": {"lengths", "depths", "samples", "filler"},
    "json": {"limit", "constrained", "dataset", "max_tokens"},
    "lm-eval": {"limit", "num_fewshot"},
    "tasks": {"limit"},  # a team's own cases (user_tasks.py)
    "replay": {"limit", "max_tokens"},  # a request log replayed on both models (replay.py)
}
PREFIXED = ("lm-eval", "tasks", "replay")  # kinds written KIND:WHAT
FILE_KINDS = ("tasks", "replay")  # KIND:FILE, the file found relative to the gates file
LOWER_IS_BETTER = {"ppl", "nll", "word_perplexity", "byte_perplexity", "bits_per_byte"}


@dataclass(frozen=True)
class Gate:
    name: str
    task: str  # ppl | needle | json | lm-eval:TASK[,TASK] | tasks:FILE.jsonl | replay:LOG.jsonl
    args: dict
    metric: str | None
    thresholds: dict  # of THRESHOLDS
    weight: float | None

    @property
    def kind(self) -> str:
        return self.task.split(":", 1)[0]

    @property
    def lower_is_better(self) -> bool:
        return (self.metric or "").rsplit("/", 1)[-1].split(",")[0] in LOWER_IS_BETTER


@dataclass
class GatesFile:
    gates: list[Gate]
    min_score_pct: float | None
    path: str


def load_gates(spec: str) -> GatesFile:
    """A gates file by path, or by the name of one qtk ships (default, ci). Every key is checked:
    an unknown one is an InputError naming it and what is allowed."""
    import yaml

    path = Path(spec)
    if not path.exists():
        shipped = DATA / "gates" / f"{spec}.yaml"
        if not shipped.exists():
            names = sorted(p.stem for p in (DATA / "gates").glob("*.yaml"))
            raise NotFoundError(f"gates file {spec} not found (a path, or one of qtk's: {', '.join(names)})")
        path = shipped
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("gates"), dict) or not doc["gates"]:
        raise InputError(f"{path}: needs a `gates:` mapping of gate names to gates")
    unknown = set(doc) - {"gates", "soft"}
    if unknown:
        raise InputError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: gates, soft")
    soft = doc.get("soft") or {}
    if set(soft) - {"min_score_pct"}:
        raise InputError(f"{path}: unknown key(s) under soft: {sorted(set(soft) - {'min_score_pct'})}; "
                         "allowed: min_score_pct")
    gates = [_gate(path, name, g) for name, g in doc["gates"].items()]
    if any(g.weight for g in gates) and soft.get("min_score_pct") is None:
        raise InputError(f"{path}: gates have weights but soft.min_score_pct is not set")
    return GatesFile(gates, soft.get("min_score_pct"), str(path))


def _gate(path: Path, name: str, g) -> Gate:
    where = f"{path}: gate {name!r}"
    if not isinstance(g, dict) or "task" not in g:
        raise InputError(f"{where}: needs at least `task:` (ppl, needle, json, lm-eval:TASK, tasks:FILE.jsonl or "
                         "replay:LOG.jsonl)")
    unknown = set(g) - GATE_KEYS
    if unknown:
        raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(GATE_KEYS)}")
    task = str(g["task"])
    kind = task.split(":", 1)[0]
    if kind not in TASK_ARGS or (kind in PREFIXED) != (":" in task):
        raise InputError(f"{where}: unknown task {task!r}; tasks: ppl, needle, json, lm-eval:TASK[,TASK], "
                         "tasks:FILE.jsonl, replay:LOG.jsonl")
    if kind in FILE_KINDS:  # relative to the gates file, so a team's gates and files travel together
        file = Path(task.split(":", 1)[1])
        file = file if file.is_absolute() or file.exists() else path.parent / file
        if not file.is_file():
            raise NotFoundError(f"{where}: file {file} not found")
        task = f"{kind}:{file}"
    args = g.get("args") or {}
    if set(args) - TASK_ARGS[kind]:
        raise InputError(f"{where}: unknown arg(s) {sorted(set(args) - TASK_ARGS[kind])} for task {kind}; "
                         f"allowed: {sorted(TASK_ARGS[kind])}")
    metric = g.get("metric")
    if metric is not None:
        _check_metric(where, kind, task, metric, args)
    thresholds = {k: float(g[k]) for k in THRESHOLDS if k in g}
    weight = g.get("weight")
    if not thresholds and not weight:
        raise InputError(f"{where}: give a threshold ({', '.join(THRESHOLDS)}) or a weight, or it gates nothing")
    return Gate(name, task, dict(args), metric, thresholds, None if weight is None else float(weight))


METRICS = {"ppl": ("ppl", "nll"), "needle": ("accuracy",), "tasks": ("accuracy",),
           "json": ("valid_rate", "parse_rate", "finished_valid_rate", "truncated_rate", "constrained_valid_rate",
                    "constrained_parse_rate", "constrained_finished_valid_rate", "constrained_truncated_rate"),
           "replay": ("agreement", "first_divergence", "top1_agreement")}


def _check_metric(where: str, kind: str, task: str, metric: str, args: dict) -> None:
    """A metric the task will report, checked before any model runs."""
    if kind == "lm-eval":
        tasks = task.split(":", 1)[1].split(",")
        if "/" not in metric or metric.split("/", 1)[0] not in tasks:
            raise InputError(f"{where}: an lm-eval metric is TASK/METRIC with TASK one of {tasks}, got {metric!r}")
        return
    known = METRICS[kind]
    if kind == "needle" and metric.startswith("accuracy@"):
        lengths = args.get("lengths")
        if lengths is None or metric.removeprefix("accuracy@") in {str(n) for n in lengths}:
            return
    if metric not in known:
        raise InputError(f"{where}: task {kind} has no metric {metric!r}; it has {', '.join(known)}"
                         + (", accuracy@LENGTH" if kind == "needle" else ""))
    if metric.startswith("constrained_") and not args.get("constrained"):
        raise InputError(f"{where}: metric {metric} needs args: {{constrained: true}}")


# -- running the tasks ---------------------------------------------------------------------------
def run_task(llm, gate: Gate, seed: int = 0, reference: dict | None = None) -> dict[str, float]:
    """The gate's task on one engine: {metric: value}, the default metric first (keys starting
    with "_" carry data, not metrics). `reference`: the baseline's result, for tasks that compare
    (replay)."""
    a = gate.args
    if gate.kind == "ppl":
        from .perplexity import engine_perplexity, eval_windows

        windows = eval_windows(llm.tokenizer, a.get("dataset", "builtin"), a.get("seq_len", 1024), a.get("limit", 8))
        r = engine_perplexity(llm, windows, batch_size=a.get("batch_size", 4), progress=False,
                              dataset=a.get("dataset", "builtin"))
        return {"ppl": r.ppl, "nll": r.nll}
    if gate.kind == "needle":
        from .needle import needle

        filler = Path(a["filler"]).read_text() if a.get("filler") else None
        r = needle(llm, a.get("lengths"), a.get("depths"), a.get("samples", 1), seed, filler)
        return {"accuracy": r.accuracy, **{f"accuracy@{n}": v for n, v in r.by_length().items()},
                "_cells": r.to_dict()}
    if gate.kind == "json":
        from .json_validity import json_validity, load_prompts

        ds = a.get("dataset")
        prompts = load_prompts(None if ds in (None, "builtin") else ds, a.get("limit"))
        out = {}
        for constrained in ([False, True] if a.get("constrained", False) else [False]):
            r = json_validity(llm, prompts, constrained, a.get("max_tokens", 256))
            prefix = "constrained_" if constrained else ""
            out[f"{prefix}valid_rate"] = r.overall.valid_rate
            out[f"{prefix}parse_rate"] = r.overall.parse_rate
            out[f"{prefix}finished_valid_rate"] = r.overall.finished_valid_rate
            out[f"{prefix}truncated_rate"] = r.overall.truncated / max(r.overall.n, 1)
        return out
    if gate.kind == "replay":
        from .replay import load_requests, replay

        cases = load_requests(gate.task.split(":", 1)[1], a.get("limit"))
        return replay(llm, cases, a.get("max_tokens", 128), None if reference is None else reference["_responses"])
    if gate.kind == "tasks":
        from .user_tasks import load_cases, run_cases

        return {"accuracy": run_cases(llm, load_cases(gate.task.split(":", 1)[1], a.get("limit")))["accuracy"]}
    from .lm_eval_adapter import run_lm_eval

    res = run_lm_eval(llm, gate.task.split(":", 1)[1].split(","), limit=a.get("limit"), seed=seed,
                      num_fewshot=a.get("num_fewshot"))
    return {f"{task}/{m}": v for task, metrics in res["results"].items() for m, v in metrics.items()}


def model_fingerprint(model: str) -> str:
    """sha256 over every file of the model (names and contents), file hashes cached by size and
    mtime so a rerun does not read the weights again."""
    from ..models import cache_dir, resolve

    root = Path(resolve(model))
    files = sorted(p for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file())
    cache_path = cache_dir() / "file_hashes.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        key = f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    fh.update(chunk)
            cache[key] = fh.hexdigest()
        h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0{cache[key]}\n".encode())
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache))
    tmp.replace(cache_path)
    return h.hexdigest()


CACHE_VERSION = 2  # bump when a task's metrics change: cached baselines are recomputed


def _cache_key(fingerprint: str, gate: Gate, engine_args: dict, seed: int) -> str:
    from .. import __version__

    spec = json.dumps({"model": fingerprint, "task": gate.task, "args": gate.args, "engine": engine_args,
                       "seed": seed, "qtk": __version__, "metrics": CACHE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def score_model(model: str, gates: list[Gate], engine_args: dict, seed: int, label: str, cache: bool,
                echo=print, reference: dict[str, dict] | None = None) -> dict[str, dict]:
    """{gate name: metrics} for one model, each task once (gates sharing a task share its run);
    cached results are used when `cache` (the baseline); `reference` is the baseline's results,
    given when scoring the candidate."""
    from ..models import cache_dir

    gates_cache = cache_dir() / "gates"
    fingerprint = model_fingerprint(model) if cache else None
    results, llm = {}, None
    by_task: dict[str, dict] = {}
    for gate in gates:
        task_key = json.dumps([gate.task, gate.args], sort_keys=True)
        if task_key in by_task:
            results[gate.name] = by_task[task_key]
            continue
        path = gates_cache / f"{_cache_key(fingerprint, gate, engine_args, seed)}.json" if cache else None
        if path is not None and path.exists():
            metrics = json.loads(path.read_text())
            echo(f"[{label}] {gate.task}: cached ({_brief(metrics)})")
        else:
            if llm is None:
                from ..runtime.engine import LLM

                echo(f"[{label}] loading {model}")
                llm = LLM(model, **engine_args)
            echo(f"[{label}] {gate.task} ...")
            t0 = time.perf_counter()
            metrics = run_task(llm, gate, seed, None if reference is None else reference[gate.name])
            echo(f"[{label}] {gate.task}: {_brief(metrics)} ({time.perf_counter() - t0:.0f} s)")
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(metrics))
        by_task[task_key] = results[gate.name] = metrics
    return results


def _brief(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.startswith("_"))[:200]


# -- the verdict ---------------------------------------------------------------------------------
@dataclass
class Row:
    gate: str
    metric: str
    baseline: float
    candidate: float
    recovery_pct: float  # candidate relative to baseline, 100 = as good
    threshold: str  # as a person reads it
    hard: bool
    passed: bool | None  # None: a soft-only gate (judged in the weighted score)
    weight: float | None = None
    recovery_floor_pct: float | None = None  # the threshold as a recovery, where it is a relative one


@dataclass
class Verdict:
    rows: list[Row]
    soft_score_pct: float | None
    min_score_pct: float | None
    baseline: dict = field(repr=False, default_factory=dict)
    candidate: dict = field(repr=False, default_factory=dict)

    @property
    def soft_passed(self) -> bool:
        return self.soft_score_pct is None or self.min_score_pct is None or self.soft_score_pct >= self.min_score_pct

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows) and self.soft_passed

    def table(self) -> str:
        head = ["gate", "metric", "baseline", "candidate", "recovery", "threshold", "verdict"]
        lines = [[r.gate, r.metric, f"{r.baseline:.4g}", f"{r.candidate:.4g}", f"{r.recovery_pct:.1f}%", r.threshold,
                  {True: "pass", False: "FAIL", None: "soft"}[r.passed]] for r in self.rows]
        if self.soft_score_pct is not None:
            lines.append(["soft score", "weighted recovery", "", "", f"{self.soft_score_pct:.1f}%",
                          f">= {self.min_score_pct:g}%", "pass" if self.soft_passed else "FAIL"])
        widths = [max(len(x) for x in col) for col in zip(head, *lines)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*ln) for ln in lines])


def recovery(baseline: float, candidate: float, lower_is_better: bool) -> float:
    """Candidate relative to baseline in percent (100 = as good, above = better)."""
    good, bad = (baseline, candidate) if lower_is_better else (candidate, baseline)
    if bad == 0:
        return 100.0 if good == 0 else math.inf
    return 100.0 * good / bad


def verdict(gates: GatesFile, base: dict[str, dict], cand: dict[str, dict]) -> Verdict:
    rows, num, den = [], 0.0, 0.0
    for g in gates.gates:
        metric = g.metric or next(k for k in base[g.name] if not k.startswith("_"))
        if metric not in base[g.name]:
            known = [k for k in base[g.name] if not k.startswith("_")]
            raise InputError(f"gate {g.name!r}: task {g.task} has no metric {metric!r}; it has {known}")
        b, c = float(base[g.name][metric]), float(cand[g.name][metric])
        lower = Gate(g.name, g.task, g.args, metric, g.thresholds, g.weight).lower_is_better
        rec = recovery(b, c, lower)
        checks, words = [], []
        t = g.thresholds
        if "max_increase_pct" in t:
            checks.append(c <= b * (1 + t["max_increase_pct"] / 100) + 1e-12)
            words.append(f"<= +{t['max_increase_pct']:g}% ({b * (1 + t['max_increase_pct'] / 100):.4g})")
        if "min_recovery_pct" in t:
            checks.append(rec >= t["min_recovery_pct"] - 1e-9)
            words.append(f"recovery >= {t['min_recovery_pct']:g}%")
        if "min" in t:
            checks.append(c >= t["min"])
            words.append(f">= {t['min']:g}")
        if "max" in t:
            checks.append(c <= t["max"])
            words.append(f"<= {t['max']:g}")
        hard = bool(checks)
        floors = [100.0 / (1 + t["max_increase_pct"] / 100)] if "max_increase_pct" in t else []
        floors += [t["min_recovery_pct"]] if "min_recovery_pct" in t else []
        rows.append(Row(g.name, metric, b, c, rec, "; ".join(words) or f"weight {g.weight:g}", hard,
                        all(checks) if hard else None, g.weight, max(floors) if floors else None))
        if g.weight:
            num += g.weight * min(rec, 100.0)
            den += g.weight
    score = num / den if den else None
    return Verdict(rows, score, gates.min_score_pct, base, cand)
