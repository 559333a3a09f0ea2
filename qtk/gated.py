"""`qtk quantize MODEL --gates FILE [--max-bits B]`: the fewest layers kept at 8 bits with which
the checkpoint passes the gates against the unquantized model.

Each quantized layer's sensitivity is measured once: the KL divergence it adds when it alone is
rounded to the recipe's scheme, on calibration samples (pipeline.measure_sensitivity). Layers that
read one input (q/k/v, gate/up) are kept together or not at all (vLLM fuses them into one layer of
one scheme): a unit is such a group, or a layer alone. Candidate k keeps the k most sensitive
units at 8 bits; K is as many as fit within the budget B (every unit without one). Each candidate
is calibrated in full, since calibration is sequential (a layer kept at 8 bits changes what every
later block sees), written, and gated against the unquantized model on qtk's runtime, as `qtk eval
CANDIDATE --baseline MODEL --gates FILE` would. Passing is taken to be monotone in k, so k is found
by bisection:

    1. k = K, the whole budget; if it fails, no mix within the budget passes: it is written with
       its table and `qtk quantize` exits 1;
    2. k = 0; if it passes, no layer needs keeping;
    3. between the largest failing k and the smallest passing one, halve until they meet.

A candidate in steps 2 and 3 stops at its first failing hard gate (it cannot pass then), so a
failure costs less than a pass; the checkpoint written has its whole table. The checkpoint's
qtk_report.json says which layers were kept, their KL (why) and the bytes they add, and lists
every candidate tried; gates.md beside it holds the verdict table and the candidates.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .atomic import write_dir
from .evals.gates import GatesFile, Verdict, check_directions, load_gates, verdict
from .evals.report import markdown_table, to_json
from .evals.scoring import score_model
from .pipeline import Job, Sensitivity, measure_sensitivity, prepare, write
from .recipe import Recipe
from .runtime.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """One mix tried: the k most sensitive layers at 8 bits, its checkpoint folder and verdict."""
    kept: int
    path: Path
    bits_per_weight: float | None  # None: the scheme alone, not measured
    bytes: int  # the checkpoint's weight files
    verdict: Verdict
    complete: bool  # every gate ran (a candidate stopped at a failing hard gate did not)
    seconds: float

    @property
    def passed(self) -> bool:
        return self.complete and self.verdict.passed

    def summary(self) -> dict:
        return {"layers_at_8_bits": self.kept, "bits_per_weight": self.bits_per_weight, "bytes": self.bytes,
                "passed": self.passed, "gates_run": [r.gate for r in self.verdict.rows],
                "failed": [r.gate for r in self.verdict.rows if r.passed is False]
                + (["soft score"] if self.complete and not self.verdict.soft_passed else []),
                "soft_score_pct": self.verdict.soft_score_pct if self.complete else None,
                "seconds": self.seconds}


def quantize_gated(model_name: str, recipe: Recipe, output: str | Path, gates_spec: str,
                   max_bits: float | None = None, force: bool = False, dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0, progress: bool = True, echo=print) -> tuple[dict, Verdict]:
    """Write the checkpoint with the fewest layers at 8 bits that passes the gates (or, where none
    within the budget does, the whole budget's); returns its report, whose ["gates"]["passed"]
    says which, and its verdict. max_bits: the budget in bits per quantized weight (None: every layer may be kept;
    0: none, the recipe's scheme alone is gated)."""
    t0 = time.perf_counter()
    output = Path(output)
    gates = load_gates(gates_spec)
    job = prepare(model_name, replace(recipe, max_bits=None), output, force)
    engine = EngineConfig(model_name, device=job.recipe.device)  # the baseline: the model unquantized
    base = score_model(engine, gates.gates, seed, "baseline", cache=True, echo=echo)  # before any calibration:
    check_directions(gates, base)  # a gates file that cannot run fails in minutes, not hours
    units, sens = [], None  # units: layers kept together (q/k/v, gate/up) or alone, most sensitive first
    if max_bits != 0:
        model = job.load()
        sens = measure_sensitivity(model, job.recipe, job.ids, progress, max_bits)
        del model
        units = sens.units(max_bits if max_bits is not None else sens.bits(sens.kl))
        most = [n for u in units for n in u]
        echo(f"sensitivity: {len(sens.kl)} layers measured in {sens.seconds:.0f} s; at most {len(most)} kept "
             f"at 8 bits in {len(units)} groups ({sens.bits(most):.3f} bits per weight"
             + (f", budget {max_bits:g})" if max_bits is not None else ")"))
    with write_dir(output) as final:
        scratch = final / ".candidates"
        tried: list[Candidate] = []

        def attempt(k: int, whole: bool) -> Candidate:
            kept = [n for u in units[:k] for n in u]
            c = _candidate(job, sens, kept, max_bits, scratch / f"keep-{k}", gates, base, engine, dtype,
                           seed, progress, echo, whole)
            tried.append(c)
            bits = "" if c.bits_per_weight is None else f"{c.bits_per_weight:.3f} bits per weight, "
            echo(f"{len(kept)} layers at 8 bits ({bits}{c.bytes / 1e6:.1f} MB): "
                 + ("PASS" if c.passed else f"FAIL ({', '.join(c.summary()['failed'])})"))
            return c

        hi = len(units)  # the fewest units known to pass (once best passes)
        best = attempt(hi, whole=True)
        if best.passed and units:
            low = attempt(0, whole=False)
            if low.passed:
                _drop(best)
                best = low
            else:
                _drop(low)
                lo = 0  # the most units known to fail
                while hi - lo > 1:
                    k = (lo + hi) // 2
                    mid = attempt(k, whole=False)
                    if mid.passed:
                        _drop(best)
                        best, hi = mid, k
                    else:
                        _drop(mid)
                        lo = k
        report = _finish(best, tried, gates, model_name, final, time.perf_counter() - t0)
        shutil.rmtree(scratch)
    return report, best.verdict


def _candidate(job: Job, sens: Sensitivity | None, kept: list[str], max_bits: float | None, path: Path,
               gates: GatesFile, base: dict, engine: EngineConfig, dtype: torch.dtype, seed: int, progress: bool,
               echo, whole: bool) -> Candidate:
    """Calibrate and write the mix keeping `kept` at 8 bits, then gate it (to its first failing
    hard gate unless `whole`)."""
    t0 = time.perf_counter()
    recipe, mixed = (job.recipe, None) if sens is None else sens.keep(job.recipe, kept, max_bits)
    model = job.load()
    write(job, model, recipe, path, False, dtype, progress, mixed)
    del model
    gc.collect()

    def failing(gate, metrics) -> bool:
        one = GatesFile([gate], None, gates.path)
        return verdict(one, {gate.name: base[gate.name]}, {gate.name: metrics}).rows[0].passed is False

    label = f"{len(kept)} at 8 bits"
    cand = score_model(replace(engine, model=str(path)), gates.gates, seed, label, cache=False, echo=echo,
                       reference=base, stop=None if whole else failing)
    complete = len(cand) == len(gates.gates)
    ran = gates if complete else GatesFile([g for g in gates.gates if g.name in cand], None, gates.path)
    v = verdict(ran, {g.name: base[g.name] for g in ran.gates}, cand)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    bits = sens.bits(kept) if sens is not None else None
    return Candidate(len(kept), path, bits, size, v, complete, time.perf_counter() - t0)


def _drop(c: Candidate) -> None:
    """A candidate's checkpoint, once a better one is known: its disk space back."""
    shutil.rmtree(c.path, ignore_errors=True)


def _finish(best: Candidate, tried: list[Candidate], gates: GatesFile, model_name: str, final: Path,
            seconds: float) -> dict:
    """The chosen candidate's files into `final`, its report with the gates' verdict and every
    candidate tried, and gates.md."""
    for entry in best.path.iterdir():
        os.replace(entry, final / entry.name)
    report = json.loads((final / "qtk_report.json").read_text())
    v = best.verdict
    report["gates"] = {"file": gates.path, "baseline": model_name, "passed": best.passed,
                       "soft_score_pct": v.soft_score_pct, "soft_score_se_pct": v.soft_score_se_pct,
                       "rows": [asdict(r) for r in v.rows], "candidates": [c.summary() for c in tried],
                       "seconds": seconds}
    (final / "qtk_report.json").write_text(to_json(report))
    md = [f"# Quality gates: {'PASS' if best.passed else 'FAIL'}", "",
          f"`qtk quantize {model_name} --gates {gates.path}`: {best.kept} layers at 8 bits, against "
          f"`{model_name}` unquantized.", "", *markdown_table(v), "", "## Candidates tried", "",
          "| layers at 8 bits | bits per weight | MB | verdict | failed | seconds |", "|---|---|---|---|---|---|"]
    for c in tried:
        s = c.summary()
        bits = "-" if c.bits_per_weight is None else f"{c.bits_per_weight:.3f}"
        md.append(f"| {c.kept} | {bits} | {c.bytes / 1e6:.1f} | {'PASS' if c.passed else 'FAIL'} | "
                  f"{', '.join(s['failed']) or '-'} | {c.seconds:.0f} |")
    (final / "gates.md").write_text("\n".join(md) + "\n")
    return report
