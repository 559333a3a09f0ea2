"""The gates' report folder: report.md (the verdict table and the pictures), report.json (every
number), metrics.png (each gate's recovery against its threshold) and needle.png (the needle
heatmaps, length x depth, baseline beside candidate) when a needle gate ran."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .gates import Verdict


def write_report(out: Path, v: Verdict, baseline: str, candidate: str, gates_path: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json"]
    written[0].write_text(json.dumps({"passed": v.passed, "baseline": baseline, "candidate": candidate,
                                      "gates": gates_path, "soft_score_pct": v.soft_score_pct,
                                      "min_score_pct": v.min_score_pct, "rows": [asdict(r) for r in v.rows],
                                      "baseline_metrics": v.baseline, "candidate_metrics": v.candidate},
                                     indent=2, default=str) + "\n")
    pictures = _pictures(out, v)
    written += pictures
    md = [f"# Quality gates: {'PASS' if v.passed else 'FAIL'}", "",
          f"Candidate `{candidate}` against baseline `{baseline}`, gates `{gates_path}`.", "",
          "| gate | metric | baseline | candidate | recovery | threshold | verdict |", "|---|---|---|---|---|---|---|"]
    for r in v.rows:
        md.append(f"| {r.gate} | {r.metric} | {r.baseline:.4g} | {r.candidate:.4g} | {r.recovery_pct:.1f}% | "
                  f"{r.threshold} | {({True: 'pass', False: '**FAIL**', None: 'soft'})[r.passed]} |")
    if v.soft_score_pct is not None:
        md.append(f"| soft score | weighted recovery | | | {v.soft_score_pct:.1f}% | >= {v.min_score_pct:g}% | "
                  f"{'pass' if v.soft_passed else '**FAIL**'} |")
    md += [""] + [f"![{p.stem}]({p.name})" for p in pictures]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return [out / "report.md"] + written


def _pictures(out: Path, v: Verdict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(v.rows)), 3.6))
    names = [f"{r.gate}\n{r.metric}" for r in v.rows]
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
    if needles:
        name, base = needles[0]
        cand = v.candidate[name]["_cells"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, cells, title in ((axes[0], base, "baseline"), (axes[1], cand, "candidate")):
            grid = [[next(c["accuracy"] for c in cells["cells"] if c["length"] == n and c["depth"] == d)
                     for d in cells["depths"]] for n in cells["lengths"]]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(cells["depths"])), [f"{d}%" for d in cells["depths"]])
            ax.set_yticks(range(len(cells["lengths"])), [str(n) for n in cells["lengths"]])
            ax.set_xlabel("needle depth")
            ax.set_title(f"{title}: {cells['accuracy']:.0%} retrieved")
        axes[0].set_ylabel("haystack tokens")
        fig.colorbar(im, ax=axes, label="retrieved")
        paths.append(out / "needle.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths

