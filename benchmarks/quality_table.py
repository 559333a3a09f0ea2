"""The quality table of docs/quality.md: quantize the bundled model with each scheme qtk writes, gate every
checkpoint against the unquantized model with the default gates, and tabulate perplexity, needle
accuracy, JSON parse and schema-valid rates (unaided), KL divergence from the baseline, size on disk,
the soft score and the verdict.

    python benchmarks/quality_table.py [--gates default] [--docs] [--render] [--only NAME,...]

Each scheme is quantized as a user runs it (its recipe's calibration samples; --num-samples N for
all). Checkpoints go to build/quality/NAME (kept, and reused on a rerun of the same command unless
--requantize); each candidate's gate report (Markdown, JSON, heatmaps) to
benchmarks/results/quality/NAME; the table
to benchmarks/results/quality.md and .json, and with --docs into the README and docs/quality.md
between the quality-table markers. Everything runs through qtk's runtime in float32, one model at a time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "calibration" / "recipes"
BASE = "smollm2-135m"

# (name, label, quantize arguments or None for the baseline's weights, KV cache the runtime serves)
ROWS = [
    ("baseline", "baseline (bf16 weights, float32 compute)", None, "auto"),
    ("default-w4a16", "default recipe (no flags): down_proj input rotated, AWQ + GPTQ w4a16 asym g64, the most "
     "sensitive layers w8a16 (5.1 bits), scales distilled", [], "auto"),
    ("default-int4", "default recipe, int4 everywhere (--max-bits 0)", ["--max-bits", "0"], "auto"),
    ("gptq-w4a16", "GPTQ w4a16 sym g64", ["--recipe", RECIPES / "gptq-w4a16.yaml"], "auto"),
    ("awq-w4a16", "AWQ w4a16 asym g64", ["--recipe", RECIPES / "awq-w4a16.yaml"], "auto"),
    ("smoothquant-w8a8", "SmoothQuant + GPTQ w8a8", ["--recipe", RECIPES / "smoothquant-gptq-w8a8.yaml"], "auto"),
    ("fp8-fp8kv", "FP8 static + FP8 KV (calibrated)", ["--recipe", RECIPES / "fp8-static-fp8kv.yaml"], "fp8"),
    ("int8kv", "INT8 KV (bf16 weights, scales at load)", None, "int8"),
]
MARK_BEGIN, MARK_END = "<!-- quality-table:begin -->", "<!-- quality-table:end -->"


def size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def quantize(name: str, args: list, num_samples: int | None, requantize: bool) -> Path:
    """build/quality/NAME, quantized by `qtk quantize` as a user runs it (the recipe's own number of
    calibration samples unless num_samples is given); a checkpoint the same command wrote is reused
    (the command is kept beside it, in NAME.cmd), anything else is quantized again."""
    out = ROOT / "build" / "quality" / name
    cmd = ["qtk", "quantize", BASE, "--output", str(out), "--force",
           *(["--num-samples", str(num_samples)] if num_samples else []), *map(str, args)]
    line, made_by = " ".join(cmd), out.with_name(name + ".cmd")
    if (out / "config.json").is_file() and not requantize:
        if made_by.is_file() and made_by.read_text() == line:
            print(f"[{name}] reusing {out}", flush=True)
            return out
        print(f"[{name}] {out} was not written by this command: quantizing again", flush=True)
    print("$", line, flush=True)
    subprocess.run(cmd, check=True)
    made_by.write_text(line)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=None,
                    help="calibration samples for every scheme (default: each recipe's own, as a user runs it)")
    ap.add_argument("--gates", default="default", help="gates file (default: qtk's default gates)")
    ap.add_argument("--only", default=None, help="comma-separated row names to run (others are read back)")
    ap.add_argument("--requantize", action="store_true", help="quantize again even where a checkpoint exists")
    ap.add_argument("--docs", action="store_true", help="also write the table into docs/quality.md")
    ap.add_argument("--render", action="store_true", help="only write the tables again from quality.json")
    args = ap.parse_args()
    if args.render:
        saved_path = ROOT / "benchmarks" / "results" / "quality.json"
        if not saved_path.exists():  # a run stopped before its end: its reports are what it left
            saved_path.write_text(json.dumps(rows_from_reports(args), indent=2) + "\n")
        saved = json.loads(saved_path.read_text())
        return write_tables(saved["rows"], Path(saved["gates"]), saved["num_samples"], args.docs)

    from qtk.evals.gates import load_gates, verdict
    from qtk.evals.scoring import score_model
    from qtk.runtime.config import EngineConfig
    from qtk.evals.report import write_report

    gates = load_gates(args.gates)
    engine = EngineConfig(BASE, dtype="float32", device="cpu")
    results_dir = ROOT / "benchmarks" / "results"
    out_json = results_dir / "quality.json"
    previous = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]} if out_json.exists() else {}
    only = set(args.only.split(",")) if args.only else None

    base = score_model(engine, gates.gates, 0, "baseline", cache=True)
    rows = []
    for name, label, qargs, kv in ROWS:
        if only is not None and name not in only:
            if name in previous:
                rows.append(previous[name])
            continue
        t0 = time.perf_counter()
        model = BASE if qargs is None else str(quantize(name, qargs, args.num_samples, args.requantize))
        if name == "baseline":
            cand = base
        else:
            cand = score_model(replace(engine, model=model, kv_cache_dtype=kv), gates.gates, 0, name, cache=False,
                               reference=base)
        v = verdict(gates, base, cand)
        report = results_dir / "quality" / name
        if name != "baseline":
            write_report(report, v, BASE, f"{label} ({model})", str(gates.path))
        metrics = {k: v for m in cand.values() for k, v in m.items() if not k.startswith("_")}
        failed = [r.gate for r in v.rows if r.passed is False] + ([] if v.soft_passed else ["soft score"])
        rows.append(row(name, label, kv, model, metrics, v.passed, failed, v.soft_score_pct,
                        None if name == "baseline" else str(report.relative_to(ROOT)),
                        round(time.perf_counter() - t0, 1)))
        print(f"[{name}] {'PASS' if v.passed else 'FAIL ' + ', '.join(failed)} ({rows[-1]['seconds']:.0f} s)",
              flush=True)

    out_json.write_text(json.dumps({"gates": str(gates.path), "num_samples": args.num_samples, "rows": rows},
                                   indent=2) + "\n")
    write_tables(rows, gates.path, args.num_samples, args.docs)


def row(name: str, label: str, kv: str, model: str, metrics: dict, passed: bool, failed: list, soft, report,
        seconds=None) -> dict:
    from qtk.loading import resolve

    return {"name": name, "label": label, "kv_cache_dtype": kv, "model": model,
            "size_bytes": size_on_disk(Path(resolve(model))),
            "ppl": metrics["ppl"], "needle": metrics["accuracy"],
            "json_parse": metrics["parse_rate"], "json_valid": metrics["valid_rate"],
            "json_constrained_valid": metrics["constrained_valid_rate"],
            "json_constrained_truncated": metrics["constrained_truncated_rate"],
            "mc_acc": metrics["qtk_mc/acc"], "bpb": metrics["qtk_paragraphs/bits_per_byte"],
            "kld": 0.0 if name == "baseline" else metrics.get("kld"),
            "soft_score_pct": soft, "passed": passed, "failed": failed, "report": report, "seconds": seconds}


def rows_from_reports(args) -> dict:
    """The table's rows read back from the gate reports a run left (when it stopped before the end)."""
    rows, gates_path = [], None
    for name, label, qargs, kv in ROWS:
        path = ROOT / "benchmarks" / "results" / "quality" / (name if name != "baseline" else ROWS[1][0]) / "report.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        gates_path = r["gates"]
        flat = lambda ms: {k: v for m in ms.values() for k, v in m.items() if not k.startswith("_")}  # noqa: E731
        if name == "baseline":
            rows.append(row(name, label, kv, BASE, flat(r["baseline_metrics"]), True, [], 100.0, None))
            continue
        failed = [x["gate"] for x in r["rows"] if x["passed"] is False]
        if r["soft_score_pct"] is not None and r["soft_score_pct"] < r["min_score_pct"]:
            failed.append("soft score")
        model = BASE if qargs is None else str(ROOT / "build" / "quality" / name)
        rows.append(row(name, label, kv, model, flat(r["candidate_metrics"]), r["passed"], failed,
                        r["soft_score_pct"], str(path.parent.relative_to(ROOT))))
    return {"gates": gates_path, "num_samples": args.num_samples, "rows": rows}


def write_tables(rows: list[dict], gates_path, num_samples: int | None, docs: bool) -> None:
    table = render(rows, gates_path, num_samples)
    (ROOT / "benchmarks" / "results" / "quality.md").write_text(
        "# Quality of each scheme on the bundled model\n\nWritten by `python benchmarks/quality_table.py`.\n\n"
        + table + "\n")
    print(table)
    if docs:  # the README's quality table and docs/quality.md's, each with links relative to itself
        for doc, reports in ((ROOT / "README.md", "benchmarks/results/quality/"),
                             (ROOT / "docs" / "quality.md", "../benchmarks/results/quality/")):
            text = doc.read_text()
            if MARK_BEGIN not in text or MARK_END not in text:
                sys.exit(f"{doc.relative_to(ROOT)} has no {MARK_BEGIN} ... {MARK_END} block to replace")
            head, rest = text.split(MARK_BEGIN, 1)
            doc.write_text(head + MARK_BEGIN + "\n" + table.replace("](quality/", f"]({reports}")
                           + "\n" + MARK_END + rest.split(MARK_END, 1)[1])


def render(rows: list[dict], gates_path, num_samples: int | None) -> str:
    lines = ["| scheme | KV cache | perplexity | KL (nats) | needle | JSON parse | JSON valid | JSON valid, constrained | "
             "size on disk | soft score | default gates |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "baseline" if r["report"] is None else (
            f"[{'PASS' if r['passed'] else 'FAIL'}]({Path(r['report']).relative_to('benchmarks/results')}/report.md)"
            + ("" if r["passed"] else f": {', '.join(r['failed'])}"))
        kv = {"auto": "float32", "fp8": "FP8 e4m3", "int8": "INT8"}[r["kv_cache_dtype"]]
        kld = "-" if r.get("kld") is None else f"{r['kld']:.3f}"
        soft = "" if r["report"] is None or r.get("soft_score_pct") is None else f"{r['soft_score_pct']:.1f}%"
        lines.append(f"| {r['label']} | {kv} | {r['ppl']:.2f} | {kld} | {r['needle']:.0%} | {r['json_parse']:.0%} | "
                     f"{r['json_valid']:.0%} | {r['json_constrained_valid']:.0%} | {r['size_bytes'] / 1e6:.1f} MB | "
                     f"{soft} | {verdict} |")
    return "\n".join(lines + [
        "",
        f"Perplexity: 8 windows of 1024 tokens of the built-in text; KL: mean over 8 windows of 512 tokens; needle: lengths 256/1024/2048 x depths "
        f"0-100%; JSON: 30 prompts of qtk's set, greedy, 256 tokens at most, unaided and with structured outputs "
        f"(constrained: an answer cut off by max_tokens counts as invalid); gates: "
        f"`{Path(gates_path).relative_to(ROOT) if Path(gates_path).is_relative_to(ROOT) else gates_path}`. "
        + (f"{num_samples} calibration samples of 512 tokens for every scheme" if num_samples else
           "Each recipe's own calibration samples of 512 tokens (128; the FP8 recipe 64), as `qtk quantize` runs it")
        + "; size: the safetensors files."])


if __name__ == "__main__":
    main()
