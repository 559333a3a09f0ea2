"""Which layers a 4-bit scheme hurts most: each decoder Linear quantized alone (round to nearest),
the rest left as they are, scored by the KL divergence of the model's next-token distributions
from the unquantized model's (qtk/evals/kld.py), on samples of the built-in calibration text (a
choice of layers made on the evaluation text would flatter the gates that judge it; --text
evaluation measures there instead, to compare).

    python benchmarks/layer_sensitivity.py [MODEL] [--scheme w4a16_asym] [--group-size 64]
                                           [--windows 2] [--seq-len 512] [--text calibration|evaluation]
                                           [--out benchmarks/results]

The measurement a mixed-precision choice starts from (keep the few layers that cost the most at
8 bits or unquantized): it prints the layers by KL, the KL summed by layer kind (q, k, v, o, gate,
up, down) and by depth, and each layer's size in parameters, and writes
OUT/layer-sensitivity-MODEL-SCHEME-gG-TEXT.json (command, commit, CPU, date, every layer's figure).
The measurement is qtk/sensitivity.py's, what `qtk quantize --max-bits` ranks by, here in float32:
a layer's figure is its own rounding error's effect on the output distribution, before GPTQ or
AWQ reduce it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from qtk.arch import discover
from qtk.bench import git_commit
from qtk.calibrate import targeted_linears
from qtk.data import calibration_ids
from qtk.device import cpu_name
from qtk.evals.perplexity import eval_windows
from qtk.loading import load_model
from qtk.recipe import from_flags
from qtk.sensitivity import layer_sensitivity


def summary(rows: list[dict]) -> dict:
    """KL summed by layer kind (the Linear's own name) and by block index."""
    kinds, depths = {}, {}
    for r in rows:
        kind = r["layer"].rsplit(".", 1)[-1]
        depth = next((int(p) for p in r["layer"].split(".") if p.isdigit()), -1)
        kinds[kind] = kinds.get(kind, 0.0) + r["kld"]
        depths[depth] = depths.get(depth, 0.0) + r["kld"]
    return {"by_kind": kinds, "by_block": depths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--scheme", default="w4a16_asym")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--text", choices=["calibration", "evaluation"], default="calibration")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    model, tok = load_model(a.model, dtype=torch.float32)
    model.eval()
    windows = (calibration_ids(tok, "builtin", a.windows, a.seq_len, 0) if a.text == "calibration"
               else eval_windows(tok, "builtin", a.seq_len, a.windows))
    t0 = time.perf_counter()
    recipe = from_flags("rtn", a.scheme, group_size=a.group_size)
    arch = discover(model)
    targets = targeted_linears(model, recipe, arch)
    kl = layer_sensitivity(model, arch, targets, recipe.scheme, windows)
    rows = sorted(({"layer": n, "params": targets[n].weight.numel(), "kld": v} for n, v in kl.items()),
                  key=lambda r: -r["kld"])
    total = sum(r["params"] for r in rows)
    print(f"\n{a.model}, {a.scheme} g{a.group_size}, one layer at a time ({windows.numel()} tokens of {a.text} text, "
          f"{time.perf_counter() - t0:.0f} s); the 20 that cost the most:")
    print(f"{'layer':<40} {'KL':>9} {'share of params':>16}")
    for r in rows[:20]:
        print(f"{r['layer']:<40} {r['kld']:>9.5f} {r['params'] / total:>15.2%}")
    s = summary(rows)
    print("\nKL summed by kind: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(s["by_kind"].items(),
                                                                              key=lambda kv: -kv[1])))
    print("KL summed by block: " + ", ".join(f"{k}: {v:.4f}" for k, v in sorted(s["by_block"].items())))
    out = Path(a.out) / f"layer-sensitivity-{Path(a.model).name}-{a.scheme}-g{a.group_size}-{a.text}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(sys.argv), "commit": git_commit(), "cpu": cpu_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "model": a.model, "scheme": a.scheme,
        "group_size": a.group_size, "windows": a.windows, "seq_len": a.seq_len, "text": a.text, "layers": rows, **s},
        indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
