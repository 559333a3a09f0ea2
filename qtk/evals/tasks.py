"""qtk's eval tasks by name: the one table `qtk eval --task` and the gates (gates.py, scoring.py) read.

Each task has its options (a gates file's `args:`, checked by gate_args.py when the file loads),
its metrics with their directions (the default first), what a gate scores (`run`: the metrics of
one engine), what `qtk eval --task` prints and writes (`show`: the task's full result) and the
packages beyond qtk's core it imports (`needs`, checked before any model runs: qtk/optional.py).
A task is written KIND, or KIND:TARGET for the kinds that take a target (lm-eval's tasks, a file).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..data import read_text
from ..errors import InputError, NotFoundError
from ..optional import dataset_needs
from ..runtime.config import EngineConfig
from . import bootstrap
from .gate_args import FILE_ARGS, boolean, integer, integers, source

HIGHER, LOWER = False, True  # values of lower_is_better


@dataclass(frozen=True)
class Gate:
    name: str
    task: str  # KIND or KIND:TARGET, e.g. ppl | lm-eval:TASK[,TASK] | tasks:FILE.jsonl
    args: dict
    metric: str | None
    thresholds: dict  # of gates.THRESHOLDS
    weight: float | None

    @property
    def kind(self) -> str:
        return self.task.split(":", 1)[0]


@dataclass(frozen=True)
class Task:
    args: dict[str, Callable]  # option -> its check (gate_args.py): where, value, the gates file's folder -> value
    metrics: dict[str, bool]  # metric -> lower is better, the default first ({}: the run says, lm-eval)
    run: Callable[..., dict]  # (llm, gate, seed, reference) -> {metric: value}; "_" keys carry data
    show: Callable[..., dict]  # (engine config, target, args, seed, echo) -> the result `qtk eval --json` writes
    target: str | None = None  # what follows KIND: (how the help writes it); None: the task takes none
    target_is_file: bool = False  # the target is a file (relative to the gates file in one)
    needs: Callable[[dict, str], dict[str, str]] | None = None  # (args, where) -> {import name: why} (optional.py)


def _llm(engine: EngineConfig, **overrides):
    """The engine `qtk eval --task` runs (the runtime is imported here: `qtk --help` loads no torch)."""
    from ..runtime.engine import LLM

    return LLM(config=replace(engine, **overrides))


# -- perplexity ----------------------------------------------------------------------------------
def _ppl(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    from .perplexity import engine_perplexity, eval_windows

    a = gate.args
    windows = eval_windows(llm.tokenizer, a.get("dataset", "builtin"), a.get("seq_len", 1024), a.get("limit", 8))
    r = engine_perplexity(llm, windows, batch_size=a.get("batch_size", 4), progress=False,
                          dataset=a.get("dataset", "builtin"))
    return {"ppl": r.ppl, "nll": r.nll, "_units": r.units()}


def _show_ppl(engine, target, a, seed, echo) -> dict:
    from .perplexity import engine_perplexity, eval_windows

    if a["batch_size"] < 1 or a["seq_len"] < 2:
        raise InputError("--batch-size must be at least 1 and --seq-len at least 2")
    llm = _llm(engine, max_model_len=a["seq_len"] + 1, max_num_batched_tokens=a["batch_size"] * a["seq_len"],
               enable_prefix_caching=False)
    windows = eval_windows(llm.tokenizer, a["dataset"], a["seq_len"], a["limit"])
    res = engine_perplexity(llm, windows, batch_size=a["batch_size"], dataset=a["dataset"])
    echo(f"{engine.model}: {res}")
    return res.to_dict()


def _ppl_needs(args: dict, where: str) -> dict[str, str]:
    return dataset_needs(args.get("dataset"), f"{where}: dataset")


# -- KL divergence from the baseline (kld.py) ----------------------------------------------------
def _kld(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    """The baseline (no reference) keeps its log-probabilities under "_log_probs" (a tensor: the
    gates' cache stores it beside the numbers); the candidate is compared with them."""
    from . import kld
    from .perplexity import eval_windows

    a = gate.args
    windows = eval_windows(llm.tokenizer, a.get("dataset", "builtin"), a.get("seq_len", 512), a.get("limit", 8))
    if reference is None:
        metrics, log_probs = kld.baseline(llm, windows, a.get("batch_size", 1))
        return {**metrics, "_log_probs": log_probs}
    return kld.compare(llm, windows, reference["_log_probs"], a.get("batch_size", 1)).metrics()


def _show_kld(engine, target, a, seed, echo) -> dict:
    raise InputError("the kld task compares two models: add --baseline BASE (qtk eval MODEL --baseline BASE "
                     "--task kld), or gate on it (evals/gates/default.yaml has kld gates)")


# -- needle in a haystack ------------------------------------------------------------------------
def _needle(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    from .needle import needle

    a = gate.args
    filler = a.get("filler", "builtin")
    r = needle(llm, a.get("lengths"), a.get("depths"), a.get("samples", 1), seed,
               None if filler == "builtin" else read_text(Path(filler), "needle filler"))
    cells = {n: [float(r.cells[n, d]) for d in r.depths] for n in r.lengths}
    units = {"accuracy": bootstrap.units("mean", [v for n in r.lengths for v in cells[n]]),
             **{f"accuracy@{n}": bootstrap.units("mean", cells[n]) for n in r.lengths}}
    return {"accuracy": r.accuracy, **{f"accuracy@{n}": v for n, v in r.by_length().items()}, "_cells": r.to_dict(),
            "_units": units}


def _show_needle(engine, target, a, seed, echo) -> dict:
    from .needle import needle

    filler = None if a["filler"] == "builtin" else Path(a["filler"])
    if filler is not None and not filler.is_file():
        raise NotFoundError(f"needle filler text {filler} not found")
    text = read_text(filler, "needle filler text") if filler else None
    res = needle(_llm(engine), a["lengths"], a["depths"], seed=seed, filler=text)
    echo(f"{engine.model}: {res}")
    return res.to_dict(answers=True)


# -- JSON validity -------------------------------------------------------------------------------
def _json(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    from .json_validity import json_validity, load_prompts

    a = gate.args
    ds = a.get("dataset", "builtin")
    prompts = load_prompts(None if ds == "builtin" else ds, a.get("limit"))
    out, units = {}, {}
    for constrained in ([False, True] if a.get("constrained", False) else [False]):
        r = json_validity(llm, prompts, constrained, a.get("max_tokens", 256))
        prefix = "constrained_" if constrained else ""
        out[f"{prefix}valid_rate"] = r.overall.valid_rate
        out[f"{prefix}parse_rate"] = r.overall.parse_rate
        out[f"{prefix}finished_valid_rate"] = r.overall.finished_valid_rate
        out[f"{prefix}truncated_rate"] = r.overall.truncated / max(r.overall.n, 1)
        cut = [x["finish_reason"] == "length" for x in r.answers]
        units.update({f"{prefix}valid_rate": bootstrap.units("mean", [int(x["valid"]) for x in r.answers]),
                      f"{prefix}parse_rate": bootstrap.units("mean", [int(x["parsed"]) for x in r.answers]),
                      f"{prefix}finished_valid_rate": bootstrap.units(
                          "ratio", [[int(x["valid"] and not c), int(not c)] for x, c in zip(r.answers, cut)]),
                      f"{prefix}truncated_rate": bootstrap.units("mean", [int(c) for c in cut])})
    return {**out, "_units": units}


def _show_json(engine, target, a, seed, echo) -> dict:
    from .json_validity import json_validity, load_prompts

    prompts = load_prompts(None if a["dataset"] == "builtin" else a["dataset"], a["limit"])
    llm = _llm(engine)
    results = []
    for constrained in (False, True):
        res = json_validity(llm, prompts, constrained)
        echo(f"{engine.model}: {res}")
        results.append(res.to_dict(answers=True))
    return {"dataset": a["dataset"], "results": results}


def _json_needs(args: dict, where: str) -> dict[str, str]:
    return {"jsonschema": where, **({"llguidance": f"{where}, constrained"} if args.get("constrained") else {})}


# -- lm-eval's tasks, through qtk's runtime ------------------------------------------------------
def _lm_eval(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    """TASK/METRIC values, and "_higher_is_better" {TASK/METRIC: bool}: lm-eval's own direction
    of each metric, kept with the results (and the cache) for the verdict."""
    from .lm_eval_adapter import run_lm_eval

    res = run_lm_eval(llm, gate.task.split(":", 1)[1].split(","), limit=gate.args.get("limit"), seed=seed,
                      num_fewshot=gate.args.get("num_fewshot"))
    metrics = {f"{task}/{m}": v for task, values in res["results"].items() for m, v in values.items()}
    higher = {f"{task}/{m}": h for task, values in res["higher_is_better"].items() for m, h in values.items()
              if isinstance(h, bool)}
    return {**metrics, "_higher_is_better": higher, "_units": res["units"]}


def _show_lm_eval(engine, target, a, seed, echo) -> dict:
    from .lm_eval_adapter import run_lm_eval

    res = run_lm_eval(_llm(engine), target.split(","), limit=a["limit"], seed=seed)
    for name, metrics in res["results"].items():
        echo(f"{engine.model}: {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    return res


def _lm_eval_needs(args: dict, where: str) -> dict[str, str]:
    return {"lm_eval": where}


# -- a team's own cases (user_tasks.py) ----------------------------------------------------------
def _user_tasks(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    from .user_tasks import load_cases, run_cases

    res = run_cases(llm, load_cases(gate.task.split(":", 1)[1], gate.args.get("limit")))
    return {"accuracy": res["accuracy"],
            "_units": {"accuracy": bootstrap.units("mean", [int(x["matched"]) for x in res["answers"]])}}


def _show_user_tasks(engine, target, a, seed, echo) -> dict:
    from .user_tasks import load_cases, run_cases

    cases = load_cases(target, a["limit"])
    res = run_cases(_llm(engine), cases)
    echo(f"{engine.model}: {sum(x['matched'] for x in res['answers'])}/{len(cases)} matched ({res['accuracy']:.1%})")
    return res


# -- a request log replayed on both models (replay.py) -------------------------------------------
def _replay(llm, gate: Gate, seed: int, reference: dict | None) -> dict:
    from .replay import load_requests, replay

    cases = load_requests(gate.task.split(":", 1)[1], gate.args.get("limit"))
    return replay(llm, cases, gate.args.get("max_tokens", 128), None if reference is None else reference["_responses"])


def _show_replay(engine, target, a, seed, echo) -> dict:
    from .replay import load_requests, replay

    cases = load_requests(target, a["limit"])
    llm = _llm(engine)
    responses = replay(llm, cases)["_responses"]
    echo(f"{engine.model}: replayed {len(cases)} requests greedily (agreement needs a second model: "
         "--baseline BASE --gates FILE)")
    return {"responses": [{"where": c["where"], "text": llm.tokenizer.decode(r, skip_special_tokens=True),
                           "token_ids": r} for c, r in zip(cases, responses)]}


TASKS = {
    "ppl": Task({"seq_len": integer(2), "limit": integer(1), "dataset": source(hub=True), "batch_size": integer(1)},
                {"ppl": LOWER, "nll": LOWER}, _ppl, _show_ppl, needs=_ppl_needs),
    "kld": Task({"seq_len": integer(2), "limit": integer(1), "dataset": source(hub=True), "batch_size": integer(1)},
                {"kld": LOWER, "kld_median": LOWER, "kld_p99": LOWER, "kld_max": LOWER, "top1_agreement": HIGHER},
                _kld, _show_kld, needs=_ppl_needs),
    "needle": Task({"lengths": integers(16), "depths": integers(0, 100), "samples": integer(1),
                    "filler": source(hub=False)},
                   {"accuracy": HIGHER}, _needle, _show_needle),  # and accuracy@LENGTH
    "json": Task({"limit": integer(1), "constrained": boolean, "dataset": source(hub=False), "max_tokens": integer(1)},
                 {"valid_rate": HIGHER, "parse_rate": HIGHER, "finished_valid_rate": HIGHER, "truncated_rate": LOWER,
                  "constrained_valid_rate": HIGHER, "constrained_parse_rate": HIGHER,
                  "constrained_finished_valid_rate": HIGHER, "constrained_truncated_rate": LOWER},
                 _json, _show_json, needs=_json_needs),
    "lm-eval": Task({"limit": integer(1), "num_fewshot": integer(0)}, {}, _lm_eval, _show_lm_eval, "TASK[,TASK]",
                    needs=_lm_eval_needs),
    "tasks": Task({"limit": integer(1)}, {"accuracy": HIGHER}, _user_tasks, _show_user_tasks, "FILE.jsonl",
                  target_is_file=True),
    "replay": Task({"limit": integer(1), "max_tokens": integer(1)},
                   {"agreement": HIGHER, "first_divergence": HIGHER, "top1_agreement": HIGHER},
                   _replay, _show_replay, "LOG.jsonl", target_is_file=True),
}
_NAMES = [kind if t.target is None else f"{kind}:{t.target}" for kind, t in TASKS.items()]
TASKS_HELP = ", ".join(_NAMES[:-1]) + " or " + _NAMES[-1]  # ppl, needle, ... or replay:LOG.jsonl


def lookup(task: str) -> Task | None:
    """The task `task` names (KIND, or KIND:TARGET where the kind takes a target); None if none."""
    kind, colon, target = task.partition(":")
    found = TASKS.get(kind)
    if found is None or (found.target is not None) != bool(colon) or (colon and not target):
        return None
    return found


def task_needs(task: str, args: dict, where: str) -> dict[str, str]:
    """The packages a task needs beyond qtk's core (task: ppl, json, lm-eval:TASK, ...; args: its
    options), for optional.require."""
    found = lookup(task)
    return found.needs(args, where) if found is not None and found.needs is not None else {}


def input_files(gate: Gate) -> list[str]:
    """The files a gate's scores depend on: its tasks/replay file and any file option."""
    files = [gate.task.split(":", 1)[1]] if TASKS[gate.kind].target_is_file else []
    for name in FILE_ARGS:
        value = gate.args.get(name)
        if isinstance(value, str) and value != "builtin" and not value.startswith("hf:"):
            files.append(value)
    return files
