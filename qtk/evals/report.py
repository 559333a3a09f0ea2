"""The gates' report folder: report.md (the verdict table and the pictures), report.json (every
number), metrics.png (each gate's recovery against its threshold) and needle.png (the needle
heatmaps, length x depth, baseline beside candidate) when a needle gate ran."""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path

from ..atomic import write_file, write_files
from ..errors import OutputError
from .gates import TABLE_NOTE, Verdict

REPORT_FILES = ("report.json", "metrics.png", "needle.png", "report.md")  # moved into place in this order


def to_json(value) -> str:
    """Standard JSON (RFC 8259): a non-finite float (an infinite recovery, an overflowed
    perplexity) is written as null."""
    return json.dumps(_finite(value), indent=2, default=str, allow_nan=False) + "\n"


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def check_output_dir(path: Path) -> None:
    """Create the report folder now (before any model runs) and prove it writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise OutputError(f"--report {path}: cannot write a folder there ({e.strerror or e}); "
                          "give a writable folder") from e


def check_output_file(path: Path) -> None:
    """Create the file's folder now (before any model runs) and prove a file can be written there."""
    if path.is_dir():
        raise OutputError(f"--json {path} is a folder; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise OutputError(f"--json {path}: cannot write there ({e.strerror or e}); give a writable path") from e


def write_json(path: Path, value) -> None:
    """The file whole or not at all (atomic.write_file)."""
    write_file(path, to_json(value))


def write_report(out: Path, v: Verdict, baseline: str, candidate: str, gates_path: str) -> list[Path]:
    """Every file is written into a temporary folder inside `out`, then renamed into place,
    report.md last: a failure while writing leaves the previous report as it was. Report files
    this run does not write (needle.png without a needle gate) are removed."""
    with write_files(out, REPORT_FILES) as staging:
        written = _write_files(staging, v, baseline, candidate, gates_path)
    return [out / "report.md"] + [out / p.name for p in written]


def _write_files(out: Path, v: Verdict, baseline: str, candidate: str, gates_path: str) -> list[Path]:
    """report.json, the pictures and report.md in `out`: [report.json, pictures...]."""
    written = [out / "report.json"]
    written[0].write_text(to_json({"passed": v.passed, "baseline": baseline, "candidate": candidate,
                                   "gates": gates_path, "soft_score_pct": v.soft_score_pct,
                                   "min_score_pct": v.min_score_pct, "soft_score_se_pct": v.soft_score_se_pct,
                                   "rows": [asdict(r) for r in v.rows],
                                   "baseline_metrics": _reported(v.baseline),
                                   "candidate_metrics": _reported(v.candidate)}))
    pictures = _pictures(out, v)
    written += pictures
    md = [f"# Quality gates: {'PASS' if v.passed else 'FAIL'}", "",
          f"Candidate `{candidate}` against baseline `{baseline}`, gates `{gates_path}`.", "",
          *markdown_table(v), ""] + [f"![{p.stem}]({p.name})" for p in pictures]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return written


def markdown_table(v: Verdict) -> list[str]:
    """The verdict's table as Markdown lines, with the note on its standard errors."""
    md = ["| gate | metric | baseline | candidate | recovery | threshold | verdict |", "|---|---|---|---|---|---|---|"]
    for line in v.cells():
        md.append("| " + " | ".join(_cell(x) for x in line[:-1]) + f" | {line[-1].replace('FAIL', '**FAIL**')} |")
    return md + ["", TABLE_NOTE + "."]


def _reported(metrics: dict[str, dict]) -> dict[str, dict]:
    """Each gate's metrics as report.json holds them: without the bootstrap's units and the kld
    task's baseline log-probabilities (data for the computation, not results)."""
    return {gate: {k: v for k, v in m.items() if k not in ("_units", "_log_probs")} for gate, m in metrics.items()}


def _cell(text: str) -> str:
    """A Markdown table cell: a | in a name would end the cell."""
    return text.replace("|", r"\|")


def _pictures(out: Path, v: Verdict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(v.rows)), 3.6))
    names = [f"{r.gate}\n{r.metric}".replace("$", r"\$") for r in v.rows]  # a $ would start mathtext
    colors = ["tab:green" if r.passed else "tab:red" if r.passed is False else "tab:gray" for r in v.rows]
    ax.bar(names, [min(r.recovery_pct, 150) for r in v.rows], color=colors)
    for i, r in enumerate(v.rows):  # the threshold as a recovery, where it is one
        if r.recovery_floor_pct is not None:
            ax.hlines(r.recovery_floor_pct, i - 0.4, i + 0.4, colors="black", linestyles="--")
    ax.axhline(100, color="gray", lw=0.8)
    ax.set_ylabel("candidate vs baseline (%)")
    ax.set_title("recovery per gate (dashed: threshold)")
    fig.tight_layout()
    paths.append(out / "metrics.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    needles = [(name, m["_cells"]) for name, m in v.baseline.items() if isinstance(m, dict) and "_cells" in m]
    if needles:  # one row per needle gate: baseline beside candidate
        fig, axes = plt.subplots(len(needles), 2, figsize=(10, 3.8 * len(needles)), squeeze=False)
        for row, (name, base) in zip(axes, needles):
            cand = v.candidate[name]["_cells"]
            for ax, cells, title in ((row[0], base, "baseline"), (row[1], cand, "candidate")):
                grid = [[next(c["accuracy"] for c in cells["cells"] if c["length"] == n and c["depth"] == d)
                         for d in cells["depths"]] for n in cells["lengths"]]
                im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                ax.set_xticks(range(len(cells["depths"])), [f"{d}%" for d in cells["depths"]])
                ax.set_yticks(range(len(cells["lengths"])), [str(n) for n in cells["lengths"]])
                ax.set_xlabel("needle depth")
                ax.set_title(f"{name}, {title}: {cells['accuracy']:.0%} retrieved".replace("$", r"\$"))
            row[0].set_ylabel("haystack tokens")
        fig.colorbar(im, ax=axes, label="retrieved")
        paths.append(out / "needle.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths

