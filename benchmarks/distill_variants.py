"""The default recipe's scale distillation varied, from one block-wise result: KL divergence from the
unquantized model and top-1 agreement on text no calibration sample comes from.

    python benchmarks/distill_variants.py [--variants 64:1e-3,128:1e-3,64:2e-3] [--heldout FILE.txt]
                                          [--name NAME]

The default recipe (qtk/assets/recipes) runs once up to its distillation (rotation, mixed precision,
AWQ + GPTQ block by block, its calibration ids); each variant (samples:lr) then distills from that same
state, restored before each, in this process. Measured with the model's own forward in float32 (the
weights as the checkpoint stores them, bf16) against the float32 unquantized model, on 8 windows of 512
tokens of the built-in text's evaluation split (the kld gate's windows) and of --heldout. Writes
benchmarks/results/NAME.json and prints each row.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtk import pipeline  # noqa: E402
from qtk.bench import git_commit  # noqa: E402
from qtk.calibrate import quantize_model  # noqa: E402
from qtk.device import cpu_name  # noqa: E402
from qtk.distill import distill_scales  # noqa: E402
from qtk.evals.kld import kl_divergence  # noqa: E402
from qtk.evals.perplexity import eval_windows  # noqa: E402
from qtk.recipe import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", default="64:1e-3,128:1e-3,64:2e-3", help="samples:lr, comma-separated")
    ap.add_argument("--heldout", default=None, help="a text no calibration source contains (e.g. WikiText-2's test split)")
    ap.add_argument("--name", default="distill-variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    recipe = build()
    job = pipeline.prepare(args.model, recipe, ROOT / "build" / "distill-variants-unused", True)
    model = job.load()
    recipe, _ = pipeline.mix_precision(model, job.recipe, job.ids, False)
    quantize_model(model, recipe, job.ids, progress=False)
    model.to(torch.bfloat16)  # the weights as written
    teacher = job.teacher()
    texts = {"builtin": "builtin", **({"heldout": args.heldout} if args.heldout else {})}
    windows = {k: eval_windows(job.tokenizer, v, 512, 8) for k, v in texts.items()}
    with torch.no_grad():
        want = {k: teacher(w).logits.float().log_softmax(-1)[:, :-1] for k, w in windows.items()}

    def measured() -> dict:
        model.float()
        out = {}
        with torch.no_grad():
            for k, w in windows.items():
                got = model(w).logits.float().log_softmax(-1)[:, :-1]
                kl, agree = kl_divergence(want[k].flatten(0, 1), got.flatten(0, 1))
                out[k] = {"kld": float(kl.mean()), "top1_agreement": float(agree.float().mean())}
        model.to(torch.bfloat16)
        return out

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record = {"command": "python benchmarks/distill_variants.py " + " ".join(sys.argv[1:]), "model": args.model,
              "cpu": cpu_name(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "texts": texts,
              "rows": [{"variant": "not distilled", **measured()}]}
    print(json.dumps(record["rows"][-1]), flush=True)
    for variant in args.variants.split(","):
        samples, lr = variant.split(":")
        model.load_state_dict(state)
        report = distill_scales(model, teacher, job.ids, replace(recipe.distill, samples=int(samples), lr=float(lr)),
                                progress=False)
        record["rows"].append({"variant": f"{samples} samples, lr {lr}", **measured(), "seconds": report["seconds"]})
        print(json.dumps(record["rows"][-1]), flush=True)
        (ROOT / "benchmarks/results" / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
