"""How far a checkpoint's perplexity moves under float rounding alone: the noise floor against which
"the kernel's perplexity equals the reference path's" is judged.

    python benchmarks/ppl_noise_floor.py CKPT [CKPT ...] [--windows 4] [--eps 1e-7] [--seeds 3]

For each checkpoint, on the same evaluation windows (qtk eval's, 2048 tokens), float32, one engine:
  fused      the engine as `qtk eval` runs it (qtk's fused C++ forward on CPU)
  torch      the same weights and kernels through the torch forward (the fused ops switched off)
  noise s    the torch forward with every RMSNorm output multiplied by (1 + eps * N(0, 1)), seed s:
             perturbations the size of float32 rounding (eps = 1e-7, half an ulp)
A weight-only checkpoint barely moves: its linears are smooth in x. One whose activations are
quantized per token (W8A8) moves by the spread of the `noise` rows, because a 1e-7 change flips
activation codes at rounding ties; the fused and torch forwards differ by exactly such changes.
Writes OUT/ppl-noise-floor.json (command, commit, CPU, figures) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from qtk import LLM
from qtk.evals.perplexity import engine_perplexity, eval_windows
from qtk.kernels import cpu as cpu_kernels
from qtk.kernels.bench import git_commit
from qtk.device import cpu_name


def measure(model: str, windows: int, eps: float, seeds: int) -> dict:
    llm = LLM(model, dtype="float32", max_model_len=2049)
    runtime = llm.model
    w = eval_windows(llm.tokenizer, seq_len=2048)[:windows]
    ppl = lambda: engine_perplexity(llm, w, progress=False).ppl  # noqa: E731
    rows = {"fused": ppl()}
    fused_ops, runtime.cpu_ops = runtime.cpu_ops, None
    rows["torch"] = ppl()
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        hook = lambda mod, inp, out: out * (1 + eps * torch.randn(out.shape, generator=g))  # noqa: E731
        norms = [n for layer in runtime.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        handles = [n.register_forward_hook(hook) for n in norms]
        rows[f"noise {seed}"] = ppl()
        for h in handles:
            h.remove()
    runtime.cpu_ops = fused_ops
    noise = [v for k, v in rows.items() if k.startswith("noise")]
    return {"model": model, "ppl": rows, "fused_vs_torch": rows["fused"] / rows["torch"] - 1,
            "noise_spread": (max(noise) - min(noise)) / rows["torch"] if noise else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--eps", type=float, default=1e-7)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    results = [measure(m, a.windows, a.eps, a.seeds) for m in a.models]
    record = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "cpu": cpu_name(),
              "capability": torch.backends.cpu.get_cpu_capability(), "kernel_build": cpu_kernels.variant(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "windows": a.windows, "eps": a.eps,
              "results": results}
    out = Path(a.out) / "ppl-noise-floor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    for r in results:
        cells = "  ".join(f"{k} {v:.4f}" for k, v in r["ppl"].items())
        print(f"{r['model']}: {cells}  | fused/torch {r['fused_vs_torch']:+.3%}, "
              f"noise spread {r['noise_spread']:.3%}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
