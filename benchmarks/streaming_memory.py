"""Peak memory and time of `qtk quantize` streaming a model block by block, against the same recipe with the
model loaded whole and against llm-compressor, on random-weight models of a large model's shapes.

    python benchmarks/streaming_memory.py [--shape llama3-8b] [--layers 4,8,16,32] [--methods rtn,gptq]
                                          [--whole 4,8] [--peer 4,8] [--num-samples 16] [--name NAME]
    python benchmarks/streaming_memory.py --shape 14b --layers 0 --methods rtn --read-back   # bigger than memory

Each run is its own process; its peak resident memory is the kernel's account of it (os.wait4's ru_maxrss:
anonymous and file-backed pages, so the safetensors pages a read maps count too). The models are written by
benchmarks/shaped_model.py one block at a time into --work (reused when there). `--whole`: the layer counts also
run with the model loaded whole (transformers' from_pretrained, as qtk did before streaming); `--peer`: those
llm-compressor runs (scripts/peer_env.sh; from_pretrained then oneshot). Calibration (gptq): --num-samples x 512
tokens of the built-in text, the same ids for every run. `--layers 0`: the depth of the model it is shaped as.
`--read-back`: the last streamed checkpoint is then read back by `qtk inspect` and decoded on qtk's runtime
(`qtk generate`, a few greedy tokens: random weights, so the text means nothing; that it runs is the check).
Writes benchmarks/results/NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import shaped_model  # noqa: E402

from qtk.bench import git_commit  # noqa: E402
from qtk.device import cpu_name  # noqa: E402

QTK = """
import sys, json, torch
from pathlib import Path
from qtk import pipeline
from qtk.recipe import build
method, model, out, samples, whole = sys.argv[1:6]
calibration = {"num_samples": int(samples), "seq_len": 512} if method != "rtn" else {}
recipe = build(method=method, group_size=128, calibration=calibration)
if whole == "whole":  # the model loaded whole by transformers, as before streaming
    job = pipeline.prepare(model, recipe, Path(out), True)
    report = pipeline.write(job, job.load(), job.recipe, Path(out), True, torch.bfloat16, False)
else:
    report = pipeline.quantize(model, recipe, out, force=True, progress=False)
    assert report["streamed"]
print(json.dumps({"seconds": report["seconds"], "blocks": report["blocks"]}))
"""


def measured(cmd: list[str]) -> tuple[int, str, str, float, float]:
    """(exit code, stdout, stderr, peak RSS in GiB, wall seconds) of one process (its output through files:
    a pipe left unread would stall it)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read(), usage.ru_maxrss / 2**20, wall


def run(cmd: list[str]) -> tuple[dict, float, float]:
    """(the JSON its last stdout line prints, peak RSS in GiB, wall seconds) of one process."""
    code, out, err, rss, wall = measured(cmd)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({code}):\n{err[-3000:]}")
    last = [line for line in out.splitlines() if line.startswith("{")][-1]
    return json.loads(last), rss, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(shaped_model.SHAPES), default="llama3-8b")
    ap.add_argument("--layers", default="4,8,16,32")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--gptq-layers", default="4", help="the layer counts gptq runs at (it takes minutes a block)")
    ap.add_argument("--whole", default="", help="layer counts also run with the model loaded whole")
    ap.add_argument("--peer", default="", help="layer counts also run by llm-compressor")
    ap.add_argument("--compare-methods", default="rtn", help="the methods --whole and --peer run")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--work", default="build/shaped")
    ap.add_argument("--keep", action="store_true", help="keep the models written (else each is removed after)")
    ap.add_argument("--read-back", action="store_true", help="inspect and decode the last streamed checkpoint")
    ap.add_argument("--name", default=None)
    ap.add_argument("--append", action="store_true", help="keep the rows already in the results file of --name")
    args = ap.parse_args()
    counts = [int(n) or shaped_model.SHAPES[args.shape][-1] for n in args.layers.split(",")]
    whole = {int(n) for n in args.whole.split(",") if n}
    peer = {int(n) for n in args.peer.split(",") if n}
    gptq_at = {int(n) for n in args.gptq_layers.split(",") if n}
    name = args.name or f"streaming-memory-{args.shape}"
    record = {"command": "python benchmarks/streaming_memory.py " + " ".join(sys.argv[1:]), "shape": args.shape, "cpu": cpu_name(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
              "num_samples": args.num_samples, "seq_len": 512, "memory_gib": os.sysconf("SC_PAGE_SIZE")
              * os.sysconf("SC_PHYS_PAGES") / 2**30, "rows": []}
    previous = ROOT / "benchmarks/results" / f"{name}.json"
    if args.append and previous.is_file():  # the rows of an earlier run of the same name first
        record["rows"] = json.loads(previous.read_text())["rows"] + record["rows"]
    ids_file = Path(args.work) / "calib_ids.pt"
    for layers in counts:
        model = Path(args.work) / f"{args.shape}-{layers}"
        if not (model / "config.json").is_file():  # in a process of its own: a child's peak RSS (ru_maxrss) starts
            t0 = time.perf_counter()                 # at its parent's high-water mark, kept across vfork and exec
            subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); import shaped_model; "
                            f"from pathlib import Path; shaped_model.write(Path({str(model)!r}), {args.shape!r}, {layers})"],
                           check=True, cwd=ROOT)
            print(f"wrote {model} in {time.perf_counter() - t0:.0f} s", flush=True)
        size = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        for method in args.methods.split(","):
            if method == "gptq" and layers not in gptq_at:
                continue
            apart = method in args.compare_methods.split(",")
            engines = ["qtk streamed"] + ["qtk whole"] * (apart and layers in whole) + ["llm-compressor"] * (
                apart and layers in peer)
            for engine in engines:
                out = Path(args.work) / f"out-{args.shape}-{layers}-{method}"
                if engine == "llm-compressor":
                    if not ids_file.is_file():
                        make_ids(model, ids_file, args.num_samples)
                    cmd = ["bash", str(ROOT / "scripts/peer_env.sh"), "python", str(ROOT / "benchmarks/peer_quantize.py"),
                           method, str(model), str(ids_file), str(out), "--group-size", "128"]
                else:
                    cmd = [sys.executable, "-c", QTK, method, str(model), str(out), str(args.num_samples),
                           "whole" if engine == "qtk whole" else "streamed"]
                got, rss, wall = run(cmd)
                row = {"engine": engine, "method": method, "layers": layers, "model_gib": size / 2**30,
                       "peak_rss_gib": rss, "quantize_seconds": got["seconds"], "wall_seconds": wall,
                       "seconds_per_block": got["seconds"] / layers}
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                write(record, ROOT / "benchmarks/results", name)
                if args.read_back and engine == "qtk streamed" and layers == counts[-1]:
                    record["read_back"] = read_back(out)
                    write(record, ROOT / "benchmarks/results", name)
                subprocess.run(["rm", "-rf", str(out)])
        if not args.keep:
            subprocess.run(["rm", "-rf", str(model)])


def read_back(out: Path) -> dict:
    """`qtk inspect` and `qtk generate` (4 greedy tokens) on the checkpoint: exit codes, peak RSS, output."""
    cli = [sys.executable, "-c", "import sys, json; from qtk.cli import main; main(sys.argv[1:])"]
    found = {}
    for what, extra in (("inspect", []), ("generate", ["--prompt", "The capital of France is", "--max-tokens", "4"])):
        code, stdout, stderr, rss, wall = measured(cli + [what, str(out), *extra])
        found[what] = {"exit_code": code, "peak_rss_gib": rss, "seconds": wall, "stdout": stdout[-2000:],
                       "stderr_tail": stderr[-1000:]}
        print(what, json.dumps({k: v for k, v in found[what].items() if k != "stdout"}), flush=True)
    return found


def make_ids(model: Path, path: Path, n: int) -> None:
    """The calibration ids every run uses (qtk draws the same from the built-in text with seed 0)."""
    import torch
    from transformers import AutoTokenizer

    from qtk.data import calibration_ids

    torch.save(calibration_ids(AutoTokenizer.from_pretrained(model), "builtin", n, 512, 0, False), path)


def write(record: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Streamed quantize: peak memory by depth, {record['shape']} shapes ({record['date']}, commit "
             f"{record['commit'][:8]}, {record['cpu']}, {record['memory_gib']:.0f} GiB of memory)", "",
             "Random-weight models of the shape (benchmarks/shaped_model.py), bf16 on disk; each run its own process, "
             "peak RSS from the kernel (file-backed pages included). W4A16 g128; gptq on "
             f"{record['num_samples']} x {record['seq_len']} tokens of the built-in text. Quantize seconds: the "
             "calibration loop (qtk: the block-by-block driver; llm-compressor: oneshot), model load and save "
             "excluded on both (llm-compressor's RTN computes its scales in oneshot and rounds and packs the weights "
             "while saving, so its quantize seconds leave that out); wall: the whole process. GPTQ's peak is its "
             "algorithm's: the down projection's Hessian (intermediate x intermediate in float32, 0.8 GiB at 14336) "
             "and the inverse Cholesky's copies of it.", "", f"    {record.get('command', '')}", "",
             "| engine | method | layers | model GiB | peak RSS GiB | quantize s | s per block | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['engine']} | {r['method']} | {r['layers']} | {r['model_gib']:.1f} | {r['peak_rss_gib']:.2f} "
                     f"| {r['quantize_seconds']:.0f} | {r['seconds_per_block']:.1f} | {r['wall_seconds']:.0f} |")
    for what, r in record.get("read_back", {}).items():
        lines += ["", f"Read back, `qtk {what}` on the last streamed checkpoint: exit code {r['exit_code']}, peak RSS "
                  f"{r['peak_rss_gib']:.2f} GiB, {r['seconds']:.0f} s.", "", "```", r["stdout"].strip()[-1500:], "```"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
