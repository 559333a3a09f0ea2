"""Calibration activations larger than the memory a quantize may use: `--activations memory` against
`--activations disk` (qtk/spill.py), on a random-weight model of a large model's shape.

    python benchmarks/activations_on_disk.py [--shape llama3-8b] [--layers 2] [--num-samples 96]
                                             [--seq-len 2048] [--limit-gib 2.5] [--dataset FILE.txt] [--name NAME]

Each run is `qtk quantize MODEL --method rtn --kv-cache int8` (KV-cache ranges need the calibration
activations; rounding needs no more, so the run is mostly the activations' traffic) in its own process,
placed in a cgroup (v1 memory controller) capped at --limit-gib where this machine lets one be made,
and once without a cap for the time it costs. Recorded per run: exit code (-9: killed by the cap),
peak RSS from the kernel (os.wait4's ru_maxrss: file-backed pages included, so memory-mapped activations
count while resident), peak anonymous memory (RssAnon, sampled every 0.1 s: what cannot be dropped and
read again from a file), the cgroup's peak charge, wall seconds. Writes benchmarks/results/NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import shaped_model  # noqa: E402

from qtk.bench import git_commit  # noqa: E402
from qtk.device import cpu_name  # noqa: E402

CGROUPS = Path("/sys/fs/cgroup/memory")


def capped(limit: int | None) -> Path | None:
    """A fresh cgroup capped at `limit` bytes (swap included where the kernel accounts it), or None."""
    if limit is None or not (CGROUPS / "cgroup.procs").is_file():
        return None
    group = CGROUPS / f"qtk-activations-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError:
        return None
    return group


def peak_anonymous(pid: int, peak: list[int], done: threading.Event) -> None:
    while not done.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except OSError:
            return
        done.wait(0.1)


def measured(cmd: list[str], group: Path | None) -> dict:
    """One process (in `group` if given): exit code, peak RSS and anonymous memory, the group's peak, wall."""
    if group is not None:  # the shell joins the group, then becomes the command
        cmd = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *cmd]
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        peak, done = [0], threading.Event()
        sampler = threading.Thread(target=peak_anonymous, args=(proc.pid, peak, done), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        sampler.join()
        wall = time.perf_counter() - t0
        out.seek(0)
        log = out.read()
    row = {"exit_code": os.waitstatus_to_exitcode(status), "peak_rss_gib": usage.ru_maxrss / 2**20,
           "peak_anonymous_gib": peak[0] / 2**30, "wall_seconds": wall,
           "log_tail": "\n".join(line for line in log.splitlines() if "calibration activations" in line or
                                 "Error" in line or "Killed" in line)[-800:]}
    if group is not None:
        row["cgroup_peak_gib"] = int((group / "memory.max_usage_in_bytes").read_text()) / 2**30
        group.rmdir()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(shaped_model.SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--limit-gib", type=float, default=2.5)
    ap.add_argument("--dataset", default="builtin", help="calibration text (the built-in one has 83k tokens: 40 "
                    "samples of 2048; a longer FILE.txt for more)")
    ap.add_argument("--work", default="build/shaped")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    name = args.name or f"activations-on-disk-{args.shape}"
    model = Path(args.work) / f"{args.shape}-{args.layers}"
    if not (model / "config.json").is_file():  # in a process of its own: a child's peak RSS starts at its parent's
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); import shaped_model; "
                        f"from pathlib import Path; shaped_model.write(Path({str(model)!r}), {args.shape!r}, {args.layers})"],
                       check=True, cwd=ROOT)
    hidden = shaped_model.SHAPES[args.shape][0]
    record = {"command": "python benchmarks/activations_on_disk.py " + " ".join(sys.argv[1:]), "shape": args.shape,
              "layers": args.layers, "cpu": cpu_name(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
              "num_samples": args.num_samples, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "dataset": args.dataset,
              "activations_gib": args.num_samples * args.seq_len * hidden * 2 / 2**30,  # one block's inputs, bf16
              "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "rows": []}
    limit = int(args.limit_gib * 2**30)
    for place, cap in (("memory", limit), ("disk", limit), ("memory", None), ("disk", None)):
        out = Path(args.work) / f"out-activations-{place}"
        cmd = [sys.executable, "-m", "qtk", "quantize", str(model), "-o", str(out), "--force", "--method", "rtn",
               "--kv-cache", "int8", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--dataset", args.dataset, "--activations", place]
        group = capped(cap)
        if cap is not None and group is None:
            print("no cgroup can be made here: the capped runs are left out", flush=True)
            continue
        row = {"activations": place, "cap_gib": None if cap is None else args.limit_gib, **measured(cmd, group)}
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        write(record, ROOT / "benchmarks/results", name)
        subprocess.run(["rm", "-rf", str(out), str(out.parent / f".{out.name}.qtk-staging")])  # a killed run's too


def write(record: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Calibration activations on disk against in memory, {record['shape']} shape, {record['layers']} blocks "
             f"({record['date']}, commit {record['commit'][:8]}, {record['cpu']}, {record['memory_gib']:.0f} GiB of "
             "memory)", "",
             f"`qtk quantize --method rtn --kv-cache int8` on {record['num_samples']} samples x {record['seq_len']} "
             f"tokens of {record['dataset']} (batches of {record['batch_size']}): each block's inputs take {record['activations_gib']:.2f} GiB "
             "in bf16, and its outputs as much while it runs. Random-weight model of the shape "
             "(benchmarks/shaped_model.py), streamed block by block. Capped runs: in a cgroup whose memory (page "
             "cache included) is capped; exit code -9 is the kernel killing the run (SIGKILL) at the cap. Peak RSS counts the "
             "memory-mapped activations' pages while resident; peak anonymous memory is what cannot be dropped and "
             "read back from a file.", "", f"    {record['command']}", "",
             "| activations | cap GiB | exit code | peak RSS GiB | peak anonymous GiB | cgroup peak GiB | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        cap = "-" if r["cap_gib"] is None else f"{r['cap_gib']:.1f}"
        group = f"{r['cgroup_peak_gib']:.2f}" if "cgroup_peak_gib" in r else "-"
        lines.append(f"| {r['activations']} | {cap} | {r['exit_code']} | {r['peak_rss_gib']:.2f} | "
                     f"{r['peak_anonymous_gib']:.2f} | {group} | {r['wall_seconds']:.0f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
