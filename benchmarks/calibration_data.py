"""Which calibration text generalizes: one recipe calibrated on each dataset, judged on text that no
calibration set contains.

    python benchmarks/calibration_data.py --heldout FILE.txt [--datasets builtin,self,builtin+self]
                                          [--recipe awq-gptq-w4a16] [--heldout-limit 40]
    python benchmarks/calibration_data.py --heldout FILE.txt --checkpoints DIR,DIR,...

Each dataset quantizes the bundled model with the recipe (qtk's default unless --recipe), as
`qtk quantize smollm2-135m --dataset D` does; every checkpoint is then scored by one evaluator
(qtk's loader, transformers' forward) on the same windows: the built-in text's evaluation split
(held out from its calibration split, the same domain) and --heldout, text unlike any calibration
source (e.g. WikiText-2's raw test split; its sha256 is recorded). --checkpoints scores checkpoints
already written (qtk quantize's, each row named by its recipe.yaml's calibration text and seed)
instead of quantizing. Writes benchmarks/results/calibration-data-<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtk import assets, pipeline  # noqa: E402
from qtk.bench import git_commit  # noqa: E402
from qtk.device import cpu_name  # noqa: E402
from qtk.evals.perplexity import eval_windows, increase_stderr, perplexity  # noqa: E402
from qtk.loading import BUNDLED, load_model  # noqa: E402
from qtk.recipe import build, load_yaml  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heldout", required=True, help="a .txt file of text unlike every calibration source")
    ap.add_argument("--datasets", default="builtin,self,builtin+self")
    ap.add_argument("--checkpoints", default=None, help="score these qtk checkpoints (comma-separated) instead")
    ap.add_argument("--recipe", default="awq-gptq-w4a16", help="a recipe of calibration/recipes/ or a YAML path")
    ap.add_argument("--num-samples", type=int, default=None, help="calibration samples (default: the recipe's)")
    ap.add_argument("--eval-seq-len", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="built-in evaluation windows (default: all)")
    ap.add_argument("--heldout-limit", type=int, default=40)
    ap.add_argument("--work", default="build/calibration-data")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--name", default=None, help="results file name without .json / .md "
                    "(default: calibration-data-MODEL)")
    args = ap.parse_args()

    recipe_path = Path(args.recipe) if Path(args.recipe).is_file() else assets.recipe_file(args.recipe)
    base, tok = load_model(BUNDLED)
    windows = {"builtin": eval_windows(tok, "builtin", args.eval_seq_len, args.limit),
               "heldout": eval_windows(tok, args.heldout, args.eval_seq_len, args.heldout_limit)}
    base_results = {k: perplexity(base, w, progress=False) for k, w in windows.items()}
    baseline = {k: r.ppl for k, r in base_results.items()}
    del base
    heldout = Path(args.heldout)
    record = {"command": " ".join(sys.argv), "git_commit": git_commit(), "device": cpu_name(),
              "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "model": BUNDLED, "recipe": str(recipe_path.name),
              "heldout": {"file": heldout.name, "sha256": hashlib.sha256(heldout.read_bytes()).hexdigest(),
                          "windows": len(windows["heldout"])},
              "builtin_windows": len(windows["builtin"]), "eval_seq_len": args.eval_seq_len,
              "baseline_ppl": baseline, "rows": []}
    print(json.dumps(record["baseline_ppl"]), flush=True)
    for dataset, out in candidates(args):
        if out is None:  # quantize it here
            calibration = {"dataset": dataset} | ({"num_samples": args.num_samples} if args.num_samples else {})
            recipe = build(recipe_file=str(recipe_path), calibration=calibration)
            out = Path(args.work) / dataset.replace("/", "_")
            report = pipeline.quantize(BUNDLED, recipe, out, force=True, progress=False)
        else:
            report = json.loads((out / "qtk_report.json").read_text())
        model, _ = load_model(str(out))
        results = {k: perplexity(model, w, progress=False) for k, w in windows.items()}
        ppl = {k: r.ppl for k, r in results.items()}
        row = {"dataset": dataset, "checkpoint": str(out), "samples": report["calibration_samples"], "ppl": ppl,
               "increase_pct": {k: 100 * (ppl[k] / baseline[k] - 1) for k in ppl},
               "increase_se_pct": {k: 100 * increase_stderr(base_results[k], r) for k, r in results.items()},
               "quantize_seconds": report.get("total_seconds")}
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        write(record, Path(args.out), args.name)
    print(table(record))


def candidates(args) -> list[tuple[str, Path | None]]:
    """(calibration text, checkpoint or None to quantize it) for each row."""
    if not args.checkpoints:
        return [(d, None) for d in args.datasets.split(",")]
    rows = []
    for d in args.checkpoints.split(","):
        c = load_yaml(str(Path(d) / "recipe.yaml")).get("calibration", {})
        rows.append((f"{c.get('dataset', 'builtin')} (seed {c.get('seed', 0)})", Path(d)))
    return rows


def write(record: dict, out: Path, name: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = name or f"calibration-data-{record['model']}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(table(record))


def table(r: dict) -> str:
    b, h = r["baseline_ppl"], r["heldout"]
    lines = [f"# Calibration text against held-out text: {r['model']}, {r['recipe']} ({r['date']}, commit "
             f"{r['git_commit'][:8]}, {r['device']})", "",
             f"Perplexity over {r['builtin_windows']} windows x {r['eval_seq_len']} tokens of the built-in text's "
             f"evaluation split (baseline {b['builtin']:.4f}) and {h['windows']} windows of {h['file']} (sha256 "
             f"{h['sha256'][:12]}; baseline {b['heldout']:.4f}), text no calibration source contains. ± is the "
             "standard error of the increase (paired bootstrap over windows).", "",
             "| calibration text | samples | built-in ppl | vs base | held-out ppl | vs base | quantize s |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        p, inc, se = row["ppl"], row["increase_pct"], row.get("increase_se_pct", {})
        pm = {k: f" ± {se[k]:.1f}" if se.get(k) is not None else "" for k in inc}
        lines.append(f"| {row['dataset']} | {row['samples']} | {p['builtin']:.4f} | {inc['builtin']:+.1f}%{pm['builtin']} | "
                     f"{p['heldout']:.4f} | {inc['heldout']:+.1f}%{pm['heldout']} | "
                     f"{'' if row['quantize_seconds'] is None else format(row['quantize_seconds'], '.0f')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
