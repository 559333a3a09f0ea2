"""Quality gates: one verdict on whether a candidate checkpoint is still good enough to ship.

    qtk eval CANDIDATE --baseline BASE --gates default [--report DIR] [--json OUT]

Both models run the same tasks on qtk's runtime (what `qtk serve` would serve), with the same
data, seeds and engine settings; each gate compares one metric of the candidate with the
baseline's. A gates file (YAML; evals/gates/default.yaml is the default, commented):

    gates:
      ppl:                          # a name of your choosing
        task: ppl                   # ppl | kld | needle | json | lm-eval:TASK[,TASK] | tasks:FILE.jsonl | replay:LOG.jsonl
        args: {seq_len: 1024, limit: 8}       # the task's options (tasks.py)
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

Hard thresholds: max_increase_pct (lower-is-better metrics only), min_recovery_pct (recovery =
candidate / baseline for a higher-is-better metric, baseline / candidate for a lower-is-better
one), min and max (absolute). A gate with a threshold is hard; one with a weight (> 0) also counts
in the soft score (recovery capped at 100%, so a gain on one metric does not hide a loss on
another). Each row also carries the standard errors of both values and of the recovery, by a paired
bootstrap over the task's units (bootstrap.py). A metric's direction is known from its name for qtk's tasks and taken from lm-eval's
own `higher_is_better` for lm-eval's; a relative threshold or a weight on a metric without one
(a stderr) is an error, before any model runs where the direction is known then, else once the
baseline has run.

File paths in a gates file (tasks:FILE, replay:FILE, a ppl or json `dataset`, a needle `filler`)
are relative to the gates file unless absolute.

Baseline scores are cached under ~/.cache/qtk/gates ($QTK_CACHE/gates) by the baseline's content
hash (every file of the model), the task, its arguments and the contents of the files it reads,
the engine settings (the dtype as resolved on this machine) and qtk's version, so a rerun against
a new candidate only computes the candidate (scoring.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..assets import eval_data
from ..errors import InputError, NotFoundError
from . import bootstrap
from .gate_args import check_args
from .tasks import HIGHER, LOWER, TASKS, TASKS_HELP, Gate, lookup, task_needs

GATE_KEYS = {"task", "args", "metric", "max_increase_pct", "min_recovery_pct", "min", "max", "weight"}
THRESHOLDS = ("max_increase_pct", "min_recovery_pct", "min", "max")
RELATIVE = ("max_increase_pct", "min_recovery_pct", "weight")  # what needs the metric's direction
# lm-eval metrics by name, for checks before a run; a run's own higher_is_better decides after it
LM_EVAL_LOWER = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter", "brier_score", "nll"}
LM_EVAL_HIGHER = {"acc", "acc_norm", "exact_match", "f1", "mcc", "bleu", "chrf", "em", "rouge1", "rouge2", "rougeL"}


@dataclass
class GatesFile:
    gates: list[Gate]
    min_score_pct: float | None
    path: str


def load_gates(spec: str) -> GatesFile:
    """A gates file by path, or by the name of one qtk ships (default, ci). Every key and value
    is checked: a mistake is an InputError naming it and what is allowed."""
    path = _gates_path(spec)
    doc = _read_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("gates"), dict) or not doc["gates"]:
        raise InputError(f"{path}: needs a `gates:` mapping of gate names to gates")
    unknown = set(doc) - {"gates", "soft"}
    if unknown:
        raise InputError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: gates, soft")
    min_score = _soft(path, doc.get("soft"))
    gates = [_gate(path, str(name), g) for name, g in doc["gates"].items()]
    if any(g.weight for g in gates) and min_score is None:
        raise InputError(f"{path}: gates have weights but soft.min_score_pct is not set")
    return GatesFile(gates, min_score, str(path))


def gates_needs(gates: GatesFile) -> dict[str, str]:
    """Every gate's task_needs (the packages beyond qtk's core), the first gate asking named."""
    needs: dict[str, str] = {}
    for g in gates.gates:
        for module, why in task_needs(g.task, g.args, f"gate {g.name} ({g.task})").items():
            needs.setdefault(module, why)
    return needs


def _gates_path(spec: str) -> Path:
    path = Path(spec)
    if path.exists():
        return path
    shipped = eval_data("gates", f"{spec}.yaml")
    if not shipped.exists():
        names = sorted(p.stem for p in eval_data("gates").glob("*.yaml"))
        raise NotFoundError(f"gates file {spec} not found (a path, or one of qtk's: {', '.join(names)})")
    return shipped


def _read_yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the gates file ({e})") from e


def _soft(path: Path, soft) -> float | None:
    """soft.min_score_pct, or None."""
    if soft is None:
        return None
    if not isinstance(soft, dict):
        raise InputError(f"{path}: soft must be a mapping, e.g. soft: {{min_score_pct: 90}}, got {soft!r}")
    if set(soft) - {"min_score_pct"}:
        raise InputError(f"{path}: unknown key(s) under soft: {sorted(set(soft) - {'min_score_pct'})}; "
                         "allowed: min_score_pct")
    if soft.get("min_score_pct") is None:
        return None
    return _number(f"{path}: soft.min_score_pct", soft["min_score_pct"])


def _number(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where} must be a number, got {value!r}")
    return float(value)


def _gate(path: Path, name: str, g) -> Gate:
    where = f"{path}: gate {name!r}"
    if not isinstance(g, dict) or "task" not in g:
        raise InputError(f"{where}: needs at least `task:` ({TASKS_HELP})")
    unknown = set(g) - GATE_KEYS
    if unknown:
        raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(GATE_KEYS)}")
    task = _task(where, path, g["task"])
    kind = task.split(":", 1)[0]
    args = check_args(where, kind, TASKS[kind].args, g.get("args"), path.parent.resolve())
    thresholds = {k: _number(f"{where}: {k}", g[k]) for k in THRESHOLDS if k in g}
    weight = _weight(where, g.get("weight"))
    if not thresholds and weight is None:
        raise InputError(f"{where}: give a threshold ({', '.join(THRESHOLDS)}) or a weight, or it gates nothing")
    metric = g.get("metric")
    if metric is not None:
        if not isinstance(metric, str):
            raise InputError(f"{where}: metric must be a name, got {metric!r}")
        _check_metric(where, kind, task, metric, args)
    gate = Gate(name, task, args, metric, thresholds, weight)
    _check_direction(where, gate, metric or next(iter(TASKS[kind].metrics), None), {})
    return gate


def _task(where: str, path: Path, task) -> str:
    """The task, a tasks:/replay: file resolved against the gates file's folder."""
    task = str(task)
    kind = task.split(":", 1)[0]
    if lookup(task) is None:
        raise InputError(f"{where}: unknown task {task!r}; tasks: {TASKS_HELP}")
    if not TASKS[kind].target_is_file:
        return task
    file = Path(task.split(":", 1)[1]).expanduser()
    file = (file if file.is_absolute() else path.parent / file).resolve()
    if not file.is_file():
        raise NotFoundError(f"{where}: file {file} not found (a relative path is read from the gates file's folder)")
    return f"{kind}:{file}"


def _weight(where: str, weight) -> float | None:
    if weight is None:
        return None
    weight = _number(f"{where}: weight", weight)
    if weight <= 0:
        raise InputError(f"{where}: weight must be > 0 (its share of the soft score), got {weight:g}")
    return weight


def _check_metric(where: str, kind: str, task: str, metric: str, args: dict) -> None:
    """A metric the task will report, checked before any model runs."""
    if kind == "lm-eval":
        return _check_lm_eval_metric(where, task.split(":", 1)[1].split(","), metric)
    if kind == "needle" and metric.startswith("accuracy@"):
        length = metric.removeprefix("accuracy@")
        if not length.isdigit() or ("lengths" in args and int(length) not in args["lengths"]):
            raise InputError(f"{where}: metric {metric!r} names no haystack length of this gate "
                             f"({args.get('lengths', 'the default lengths')}); write accuracy@LENGTH")
        return
    if metric not in TASKS[kind].metrics:
        raise InputError(f"{where}: task {kind} has no metric {metric!r}; it has {', '.join(TASKS[kind].metrics)}"
                         + (", accuracy@LENGTH" if kind == "needle" else ""))
    if metric.startswith("constrained_") and not args.get("constrained"):
        raise InputError(f"{where}: metric {metric} needs args: {{constrained: true}}")


def _check_lm_eval_metric(where: str, tasks: list[str], metric: str) -> None:
    """TASK/METRIC with TASK one of the gate's tasks or a task under one of its groups."""
    task, _, name = metric.partition("/")
    if not task or not name:
        raise InputError(f"{where}: an lm-eval metric is TASK/METRIC with TASK one of {tasks} (or a subtask of "
                         f"one of their groups), got {metric!r}")
    if task in tasks:
        return
    from .lm_eval_adapter import tasks_under

    under = tasks_under(tasks)
    if task not in under:
        raise InputError(f"{where}: metric {metric!r}: {task!r} is not one of the gate's lm-eval tasks or their "
                         f"subtasks ({', '.join(sorted(under))})")


def lower_is_better(gate: Gate, metric: str, results: dict) -> bool | None:
    """The metric's direction: qtk's table for qtk's tasks (tasks.TASKS); for lm-eval's, the run's own
    higher_is_better (`results`: the task's metrics, "_higher_is_better" among them), else
    the metric's name when it is a well-known one; None where it is not known."""
    if gate.kind == "needle" and metric.startswith("accuracy@"):
        return HIGHER
    if gate.kind != "lm-eval":
        return TASKS[gate.kind].metrics.get(metric)
    key = metric.split(",")[0]  # TASK/NAME,FILTER -> TASK/NAME
    higher = results.get("_higher_is_better", {}).get(key)
    if higher is not None:
        return not higher
    name = key.rsplit("/", 1)[-1]
    return LOWER if name in LM_EVAL_LOWER else HIGHER if name in LM_EVAL_HIGHER else None


def _check_direction(where: str, gate: Gate, metric: str | None, results: dict) -> None:
    """Relative thresholds need the metric's direction, and max_increase_pct a lower-is-better
    metric. Before a run, an lm-eval metric of unknown direction passes (checked after the
    baseline ran, with its higher_is_better)."""
    relative = [k for k in RELATIVE if k in gate.thresholds or (k == "weight" and gate.weight)]
    if not relative or metric is None:
        return
    lower = lower_is_better(gate, metric, results)
    known_now = results or gate.kind != "lm-eval" or metric.split(",")[0].endswith("_stderr")
    if lower is None and known_now:
        raise InputError(f"{where}: metric {metric} has no known direction (higher or lower is better), so "
                         f"{', '.join(relative)} cannot judge it; use min or max")
    if lower is HIGHER and "max_increase_pct" in gate.thresholds:
        raise InputError(f"{where}: max_increase_pct bounds a lower-is-better metric, but higher {metric} is "
                         "better; use min_recovery_pct (or min)")


def check_directions(gates: GatesFile, base: dict[str, dict]) -> None:
    """Every gate's thresholds against its metric's direction, with the baseline's results (an
    lm-eval metric's direction is known once lm-eval ran): an InputError before the candidate runs."""
    for g in gates.gates:
        _check_direction(f"{gates.path}: gate {g.name!r}", g, _metric(g, base[g.name]), base[g.name])


def _metric(g: Gate, results: dict) -> str:
    metric = g.metric or next(k for k in results if not k.startswith("_"))
    if metric not in results:
        known = [k for k in results if not k.startswith("_")]
        raise InputError(f"gate {g.name!r}: task {g.task} has no metric {metric!r}; it has {known}")
    return metric


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
    # standard errors by a paired bootstrap over the task's units (bootstrap.py); None where the
    # task gave no units for the metric
    baseline_se: float | None = None
    candidate_se: float | None = None
    recovery_se_pct: float | None = None


@dataclass
class Verdict:
    rows: list[Row]
    soft_score_pct: float | None
    min_score_pct: float | None
    baseline: dict = field(repr=False, default_factory=dict)
    candidate: dict = field(repr=False, default_factory=dict)
    soft_score_se_pct: float | None = None

    @property
    def soft_passed(self) -> bool:
        return self.soft_score_pct is None or self.min_score_pct is None or self.soft_score_pct >= self.min_score_pct

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows) and self.soft_passed

    def cells(self) -> list[list[str]]:
        """The table's rows as text (the CLI's table and report.md): value ± standard error."""
        lines = [[r.gate, r.metric, with_se(r.baseline, r.baseline_se), with_se(r.candidate, r.candidate_se),
                  # a lower-is-better metric the baseline scores 0 on (kld): no ratio to speak of
                  "-" if r.baseline == 0 and r.recovery_pct == 0 else with_se(r.recovery_pct, r.recovery_se_pct, "%"),
                  r.threshold,
                  {True: "pass", False: "FAIL", None: "soft"}[r.passed]] for r in self.rows]
        if self.soft_score_pct is not None:
            lines.append(["soft score", "weighted recovery", "", "",
                          with_se(self.soft_score_pct, self.soft_score_se_pct, "%"),
                          f">= {self.min_score_pct:g}%", "pass" if self.soft_passed else "FAIL"])
        return lines

    def table(self) -> str:
        head = ["gate", "metric", "baseline", "candidate", "recovery", "threshold", "verdict"]
        lines = self.cells()
        widths = [max(len(x) for x in col) for col in zip(head, *lines)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*ln) for ln in lines]
                         + ["", TABLE_NOTE])


TABLE_NOTE = ("± one standard error, by a paired bootstrap over the task's windows, prompts or questions "
              "(both models resampled alike)")


def with_se(value: float, se: float | None, unit: str = "") -> str:
    """`value ± se` with the value to 4 significant digits (a percentage to 0.1)."""
    text = f"{value:.1f}{unit}" if unit else f"{value:.4g}"
    if se is None:
        return text
    return text + (f" ± {se:.1f}" if unit else f" ± {se:.2g}")


def recovery(baseline: float, candidate: float, lower_is_better: bool) -> float:
    """Candidate relative to baseline in percent (100 = as good, above = better)."""
    good, bad = (baseline, candidate) if lower_is_better else (candidate, baseline)
    if good == bad:  # inf against inf too (two overflowed perplexities)
        return 100.0
    if bad == 0:
        return 100.0 if good == 0 else math.inf
    return 100.0 * good / bad


def _resampled(g: Gate, metric: str, base: dict, cand: dict, lower: bool):
    """(baseline, candidate, recovery) on each bootstrap resample of the gate's task's units,
    the same draws for both models and for every gate of one task; None without units."""
    ub, uc = base.get("_units", {}).get(metric), cand.get("_units", {}).get(metric)
    if ub is None or uc is None or len(ub["values"]) != len(uc["values"]) or not ub["values"]:
        return None
    idx = bootstrap.draws(len(ub["values"]), f"{g.task} {sorted(g.args.items())}")
    rb, rc = bootstrap.replicates(ub, idx), bootstrap.replicates(uc, idx)
    return rb, rc, np.array([recovery(x, y, lower) for x, y in zip(rb, rc)])


def compare_metrics(g: Gate, base: dict, cand: dict) -> list[dict]:
    """Every metric of one task on both models (`qtk eval MODEL --baseline BASE --task T`), each
    value with its standard error where the task gave units; lm-eval's own *_stderr metrics are
    left out (these replace them)."""
    rows = []
    for metric in [k for k in base if not k.startswith("_") and "_stderr" not in k and k in cand]:
        b, c = float(base[metric]), float(cand[metric])
        reps = _resampled(g, metric, base, cand, bool(lower_is_better(g, metric, base)))
        se_b, se_c = (bootstrap.stderr(reps[0]), bootstrap.stderr(reps[1])) if reps is not None else (None, None)
        rows.append({"metric": metric, "baseline": b, "candidate": c, "baseline_se": se_b, "candidate_se": se_c,
                     "baseline_text": with_se(b, se_b), "candidate_text": with_se(c, se_c)})
    return rows


def verdict(gates: GatesFile, base: dict[str, dict], cand: dict[str, dict]) -> Verdict:
    check_directions(gates, base)
    rows, num, den = [], 0.0, 0.0
    soft_reps, soft_known = 0.0, True  # the soft score on each resample
    for g in gates.gates:
        metric = _metric(g, base[g.name])
        b, c = float(base[g.name][metric]), float(cand[g.name][metric])
        lower = bool(lower_is_better(g, metric, base[g.name]))
        rec = recovery(b, c, lower)
        reps = _resampled(g, metric, base[g.name], cand[g.name], lower)
        ses = [bootstrap.stderr(x) for x in reps] if reps is not None else [None] * 3
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
                        all(checks) if hard else None, g.weight, max(floors) if floors else None, *ses))
        if g.weight:
            num += g.weight * min(rec, 100.0)
            den += g.weight
            soft_known = soft_known and reps is not None
            soft_reps = soft_reps + g.weight * np.minimum(reps[2], 100.0) if reps is not None else soft_reps
    score = num / den if den else None
    score_se = bootstrap.stderr(soft_reps / den) if den and soft_known else None
    return Verdict(rows, score, gates.min_score_pct, base, cand, score_se)
