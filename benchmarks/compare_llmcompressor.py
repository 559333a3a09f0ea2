"""qtk against llm-compressor on the bundled model: same calibration ids, same eval windows.

    python benchmarks/compare_llmcompressor.py [--methods rtn,gptq,awq,smoothquant_gptq_w8a8,fp8,qtk_best]
                                               [--num-samples 64] [--seq-len 512] [--limit N]
                                               [--dataset builtin|self|instruct|builtin+self+instruct]
                                               [--heldout FILE.txt [--heldout-limit 40]]

--heldout scores every checkpoint also on text that no calibration set contains (the calibration
text is the built-in Python documentation; e.g. WikiText-2's raw test split, saved as a .txt file:
`--dataset hf:wikitext:wikitext-2-raw-v1` where the hub is reachable). The file's sha256 is recorded.
--dataset picks the calibration text as `qtk quantize --dataset` does (`self`: text the model
writes, `instruct` its answers to qtk's instructions; `builtin+self+instruct`: a third each); the ids are drawn
once and both sides calibrate on them.

The peer runs in its own venv (scripts/peer_env.sh; it pins an older transformers) on the same
calibration token ids, saved to a file. Both checkpoints are then scored by one evaluator (qtk's
loader, which reads llm-compressor's checkpoints) on the same windows (bench.md protocol).
Quantize wall time: qtk's quantize_model() and the peer's oneshot(), model load and save
excluded on both sides. Writes benchmarks/results/compare_llmcompressor.{json,md}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtk.bench import git_commit  # noqa: E402
from qtk.calibrate import checkpoint_groups, quantize_model  # noqa: E402
from qtk.checkpoint import save_quantized  # noqa: E402
from qtk.device import choose_dtype, cpu_name  # noqa: E402
from qtk.evals.perplexity import eval_windows, increase_stderr, perplexity  # noqa: E402
from qtk.loading import BUNDLED, load_model, resolve  # noqa: E402
from qtk.methods.args import AutoRoundArgs, SmoothQuantArgs  # noqa: E402
from qtk.pipeline import calibration_samples, mix_precision, rotate  # noqa: E402
from qtk.recipe import CalibrationArgs, build, from_flags  # noqa: E402


def qtk_recipes(group_size: int, iters: int = 200) -> dict:
    return {
        "autoround": replace(from_flags("autoround", scheme="w4a16", group_size=group_size),
                             autoround=AutoRoundArgs(iters=iters)),
        "rtn": from_flags("rtn", scheme="w4a16", group_size=group_size),
        "gptq": from_flags("gptq", scheme="w4a16", group_size=group_size),
        "awq": from_flags("awq", scheme="w4a16_asym", group_size=group_size),
        "smoothquant_gptq_w8a8": from_flags("smoothquant", scheme="w8a8", weights="gptq",
                                            smoothquant=SmoothQuantArgs(alpha=0.8)),
        "fp8": from_flags("fp8", scheme="fp8"),
        # qtk's default recipe, its best at 4 bits (calibration/recipes/awq-gptq-w4a16.yaml): the down projections
        # rotated online, AWQ, then GPTQ, the layers int4 hurts most kept at int8 within the recipe's bits per
        # weight; and the same in int4 alone
        # the same methods after the down projections' input is rotated online (SpinQuant's R4, qtk --rotate down)
        "gptq_rotate_down": replace(from_flags("gptq", scheme="w4a16", group_size=group_size), rotate=("down",)),
        "awq_rotate_down": replace(from_flags("awq", scheme="w4a16_asym", group_size=group_size), rotate=("down",)),
        # ... and every rotation: the residual stream, each head's values and the down projections (SpinQuant's R1, R2, R4)
        "gptq_rotate_all": replace(from_flags("gptq", scheme="w4a16", group_size=group_size),
                                   rotate=("residual", "v_o", "down")),
        "qtk_best": build(group_size=group_size),
        "qtk_best_int4": build(group_size=group_size, max_bits=0),
    }


PEER_PYTHON = ["bash", str(ROOT / "scripts/peer_env.sh"), "python"]  # builds the peer venv on first use


def run_qtk(name, recipe, ids, out: Path) -> float:
    model, tok = load_model(BUNDLED, dtype=getattr(torch, recipe.dtype))
    t0 = time.perf_counter()
    rotate(model, recipe)  # as qtk quantize does, before anything measures
    if recipe.max_bits is not None:  # the default recipe's mixed precision, as qtk quantize runs it
        recipe, _ = mix_precision(model, recipe, ids, progress=False)
    quantize_model(model, recipe, ids, progress=False)
    seconds = time.perf_counter() - t0
    groups, ignore = checkpoint_groups(model, recipe)
    save_quantized(model, tok, out, groups, ignore, recipe.kv_cache, force=True)
    return seconds


def run_peer(name, ids_file: Path, out: Path, group_size: int, dtype: str, iters: int = 200) -> float:
    cmd = [*PEER_PYTHON, str(ROOT / "benchmarks/peer_quantize.py"), name, str(resolve(BUNDLED)), str(ids_file),
           str(out), "--group-size", str(group_size), "--dtype", dtype, "--iters", str(iters)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"peer failed on {name}:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["seconds"]


def ppl_of(path, *windows) -> list:
    """Perplexity of the checkpoint at `path` on each set of windows given (PerplexityResults)."""
    model, _ = load_model(str(path))
    return [perplexity(model, w, progress=False) for w in windows if w is not None]


def scored(row: dict, side: str, results: list, baselines: list) -> None:
    """row[side_ppl], row[side_increase_se_pct] (and the held-out pair) from ppl_of's results."""
    for where, r, b in zip(("", "heldout_"), results, baselines):
        row[f"{side}_{where}ppl"] = r.ppl
        row[f"{side}_{where}increase_se_pct"] = 100 * increase_stderr(b, r)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="rtn,gptq,awq,smoothquant_gptq_w8a8,fp8,qtk_best")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dataset", default="builtin", help="calibration text, as qtk quantize --dataset "
                    "(builtin, self, instruct, builtin+self+instruct, a .txt file)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200, help="autoround: steps per block, both sides (auto-round's "
                    "200; its light preset 50)")
    ap.add_argument("--eval-seq-len", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="evaluation windows (default: all)")
    ap.add_argument("--no-peer", default="", help="methods to run on qtk only (e.g. awq: the peer's AWQ takes "
                    "over an hour on 2 CPU cores)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="model dtype while calibrating, both sides (auto: bfloat16 where the CPU has bf16 units, "
                         "float32 elsewhere, as qtk chooses)")
    ap.add_argument("--heldout", default=None, help="a .txt file of text unlike the calibration data, scored too")
    ap.add_argument("--heldout-limit", type=int, default=40, help="held-out windows of --eval-seq-len tokens")
    ap.add_argument("--work", default="build/compare")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--name", default="compare_llmcompressor", help="results file name, without .json / .md")
    args = ap.parse_args()
    args.dtype = choose_dtype(args.dtype).name  # one resolved dtype for both sides

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base, tok = load_model(BUNDLED)
    ids = calibration_samples(resolve(BUNDLED), tok, CalibrationArgs(dataset=args.dataset, num_samples=args.num_samples,
                                                                    seq_len=args.seq_len, seed=0), "cpu")
    ids_file = work / "calib_ids.pt"
    torch.save(ids, ids_file)
    windows = eval_windows(tok, "builtin", args.eval_seq_len, args.limit)
    base_results = [perplexity(base, windows, progress=False)]
    heldout = eval_windows(tok, args.heldout, args.eval_seq_len, args.heldout_limit) if args.heldout else None
    if args.heldout:
        base_results.append(perplexity(base, heldout, progress=False))
    baseline = base_results[0].ppl
    heldout_baseline = base_results[1].ppl if args.heldout else None
    del base
    print(f"baseline ppl {baseline:.4f} ({len(windows)} windows x {args.eval_seq_len})"
          + (f"; held-out {heldout_baseline:.4f} ({len(heldout)} windows)" if args.heldout else ""), flush=True)
    recipes = {k: replace(r, dtype=args.dtype) for k, r in qtk_recipes(args.group_size, args.iters).items()}
    record = {
        "command": " ".join(sys.argv), "git_commit": git_commit(), "device": cpu_name(),
        "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "model": BUNDLED, "dtype": args.dtype, "calibration": {"dataset": args.dataset, "samples": args.num_samples, "seq_len": args.seq_len,
                                          "seed": 0},
        "evaluation": {"windows": len(windows), "seq_len": args.eval_seq_len, "scored_tokens": len(windows) * (args.eval_seq_len - 1)},
        "group_size": args.group_size, "autoround_iters": args.iters, "baseline_ppl": baseline, "rows": [],
    }
    if args.heldout:
        record["heldout"] = {"file": Path(args.heldout).name, "sha256": hashlib.sha256(Path(args.heldout).read_bytes())
                             .hexdigest(), "windows": len(heldout), "seq_len": args.eval_seq_len,
                             "baseline_ppl": heldout_baseline}
    for name in args.methods.split(","):
        row = {"method": name}
        qdir = work / f"qtk-{name}"
        row["qtk_seconds"] = run_qtk(name, recipes[name], ids, qdir)
        scored(row, "qtk", ppl_of(qdir, windows, heldout), base_results)
        if not name.startswith("qtk_best") and name not in args.no_peer.split(","):
            pdir = work / f"peer-{name}"
            try:
                row["peer_seconds"] = run_peer(name, ids_file, pdir, args.group_size, args.dtype, args.iters)
                scored(row, "peer", ppl_of(pdir, windows, heldout), base_results)
            except RuntimeError as e:  # recorded, not hidden: the table shows the peer failed
                row["peer_error"] = str(e)[-2000:]
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        write(record, Path(args.out), args.name)  # after every row: a long run keeps what it measured
    print(table(record))


def write(record: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(table(record))


def table(r: dict) -> str:
    b, h = r["baseline_ppl"], r.get("heldout")
    lines = [f"# qtk vs llm-compressor on {r['model']} ({r['date']}, commit {r['git_commit'][:8]}, {r['device']})", "",
             f"Calibration: {r['calibration']['samples']} x {r['calibration']['seq_len']} tokens "
             f"({r['calibration']['dataset']}, seed 0), "
             f"same ids for both; model in {r.get('dtype', 'float32')} on both sides. Evaluation: {r['evaluation']['windows']} windows x {r['evaluation']['seq_len']} "
             f"tokens of the built-in text held out from calibration. Group size {r['group_size']}. Baseline ppl {b:.4f}."]
    if h:
        lines[-1] += (f" Held-out: {h['windows']} windows x {h['seq_len']} tokens of {h['file']} (sha256 "
                      f"{h['sha256'][:12]}), text unlike the calibration data; baseline ppl {h['baseline_ppl']:.4f}.")
    lines[-1] += " ± is the standard error of an increase (paired bootstrap over windows)."
    head = ["method", "qtk ppl", "peer ppl", "qtk vs base", "peer vs base"]
    head += ["held-out qtk vs base", "held-out peer vs base"] if h else []
    lines += ["", "| " + " | ".join(head + ["qtk s", "peer s", "speedup"]) + " |", "|---" * (len(head) + 3) + "|"]
    for row in r["rows"]:
        q, qs, p, ps = row["qtk_ppl"], row["qtk_seconds"], row.get("peer_ppl"), row.get("peer_seconds")
        cells = [row["method"], f"{q:.4f}", _fmt(p, "{:.4f}"), _increase(row, "qtk", "", b), _increase(row, "peer", "", b)]
        if h:
            cells += [_increase(row, side, "heldout_", h["baseline_ppl"]) for side in ("qtk", "peer")]
        cells += [f"{qs:.1f}", _fmt(ps, "{:.1f}"), _fmt(None if ps is None else ps / qs, "{:.1f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _increase(row: dict, side: str, where: str, baseline: float) -> str:
    """"+12.3% ± 0.4": the side's perplexity against the baseline's, with its standard error where recorded."""
    ppl, se = row.get(f"{side}_{where}ppl"), row.get(f"{side}_{where}increase_se_pct")
    if ppl is None:
        return ""
    return f"{100 * (ppl / baseline - 1):+.1f}%" + ("" if se is None else f" ± {se:.1f}")


def _fmt(v, spec: str) -> str:
    return "" if v is None else spec.format(v)


if __name__ == "__main__":
    main()
