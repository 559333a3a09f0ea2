"""Unaided JSON over the whole prompt set, answer by answer against the baseline's: which of its
schema-valid answers each model keeps, which it gains, and how many answers are the same text.

    python benchmarks/json_kept.py BASELINE MODEL[@kv=int8|fp8] ... [--limit 120] [--name NAME]

The json task as the gates run it (greedy, chat template, 256 tokens at most, qtk's runtime), without
structured outputs, on the first --limit prompts spread over the six categories (all 120 by default;
the default gates take 30). A model written NAME@kv=int8 runs with that KV cache. The gates' soft JSON
item is the ratio of two small counts; this says whether a quantized model lost the baseline's valid
answers (the same prompts now invalid) or traded some for others. Writes benchmarks/results/NAME.json
with the commit, the CPU and every answer's validity, and prints one row a model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from qtk.bench import git_commit  # noqa: E402
from qtk.device import cpu_name  # noqa: E402
from qtk.evals.json_validity import json_validity, load_prompts  # noqa: E402
from qtk.runtime.config import EngineConfig  # noqa: E402
from qtk.runtime.engine import LLM  # noqa: E402


def run(spec: str, prompts: list[dict]) -> dict:
    """One model's unaided answers: {id: valid}, texts and the time it took."""
    model, _, kv = spec.partition("@kv=")
    llm = LLM(config=EngineConfig(model, **({"kv_cache_dtype": kv} if kv else {})))
    t0 = time.perf_counter()
    r = json_validity(llm, prompts, constrained=False)
    return {"model": spec, "seconds": round(time.perf_counter() - t0, 1),
            "valid": {a["id"]: a["valid"] for a in r.answers}, "texts": {a["id"]: a["text"] for a in r.answers},
            "parsed": r.overall.parsed, "truncated": r.overall.truncated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--name", default="json-kept")
    args = ap.parse_args()
    prompts = load_prompts(None, args.limit)
    gate_ids = [p["id"] for p in load_prompts(None, 30)]  # the default gates' 30
    base = run(args.baseline, prompts)
    want = {i for i, v in base["valid"].items() if v}
    rows = []
    print(f"{'model':40} {'valid':>6} {'kept':>9} {'gained':>6} {'same text':>9} {'gate 30':>7}")
    for spec in [args.baseline, *args.models]:
        r = base if spec == args.baseline else run(spec, prompts)
        got = {i for i, v in r["valid"].items() if v}
        row = {"model": spec, "valid": len(got), "kept": len(got & want), "of": len(want),
               "gained": sorted(got - want), "lost": sorted(want - got),
               "same_text": sum(r["texts"][i] == base["texts"][i] for i in r["texts"]),
               "gate_30_valid": sum(i in got for i in gate_ids), "parsed": r["parsed"],
               "truncated": r["truncated"], "seconds": r["seconds"]}
        rows.append(row)
        print(f"{spec:40} {row['valid']:>6} {row['kept']:>4} of {row['of']:<2} {len(row['gained']):>6} "
              f"{row['same_text']:>9} {row['gate_30_valid']:>7}", flush=True)
    out = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    out.write_text(json.dumps({"commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                               "cpu": cpu_name(),
                               "capability": torch.backends.cpu.get_cpu_capability(), "prompts": len(prompts),
                               "baseline": args.baseline, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
