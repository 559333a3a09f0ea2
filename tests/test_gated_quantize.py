"""`qtk quantize MODEL --gates FILE`: the fewest most sensitive layers kept at 8 bits with which the
checkpoint passes the gates. On a tiny model: a KL limit between the scheme alone's and the whole
budget's is met by a mix found by bisection, whose one-fewer neighbour fails; `qtk eval` agrees with
the verdict the checkpoint records; an impossible limit writes the whole budget's mix and exits 1;
a limit the scheme alone meets keeps no layer; bad gates fail before any work, writing nothing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qtk import gated
from qtk.cli import main
from qtk.evals.gates import Row, Verdict
from qtk.recipe import from_flags

KLD = "gates:\n  kld: {{task: kld, args: {{seq_len: 64, limit: 3}}, max: {limit}}}\n"


def _gates(tmp_path: Path, limit: float) -> Path:
    path = tmp_path / f"kld-{limit:.3e}.yaml"
    path.write_text(KLD.format(limit=repr(float(limit))))
    return path


def _quantize(tiny_dir, out, gates, *extra):
    args = ["quantize", str(tiny_dir), "--method", "gptq", "--scheme", "w4a16", "--group-size", "32",
            "--num-samples", "4", "--seq-len", "64", "-o", str(out), "--gates", str(gates), *extra]
    return CliRunner().invoke(main, args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gates-cache")


@pytest.fixture(autouse=True)
def _cache(cache, monkeypatch):
    monkeypatch.setenv("QTK_CACHE", str(cache))  # the baseline scored once for the module


def _kept(out: Path) -> dict:
    return json.loads((out / "qtk_report.json").read_text())["mixed_precision"]["kept_at_8_bits"]


def test_the_fewest_layers_that_pass(tiny_dir, tmp_path):
    impossible = _gates(tmp_path, 0.0)  # a quantized model's KL is never 0: only the first mix is tried
    r = _quantize(tiny_dir, tmp_path / "all", impossible)
    assert r.exit_code == 1 and "FAIL" in r.output, r.output
    report = json.loads((tmp_path / "all" / "qtk_report.json").read_text())
    assert len(report["gates"]["candidates"]) == 1 and not report["gates"]["passed"]
    assert len(_kept(tmp_path / "all")) == 14  # no budget: every layer may be kept, and all were
    kl_all = report["gates"]["rows"][0]["candidate"]
    assert (tmp_path / "all" / "gates.md").read_text().startswith("# Quality gates: FAIL")

    r = _quantize(tiny_dir, tmp_path / "none", impossible, "--max-bits", "0")  # the scheme alone, gated
    assert r.exit_code == 1, r.output
    report = json.loads((tmp_path / "none" / "qtk_report.json").read_text())
    assert "mixed_precision" not in report and report["gates"]["candidates"][0]["layers_at_8_bits"] == 0
    kl_none = report["gates"]["rows"][0]["candidate"]
    assert kl_all < kl_none / 4

    limit = math.sqrt(kl_all * kl_none)
    r = _quantize(tiny_dir, tmp_path / "mix", _gates(tmp_path, limit))
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    out = tmp_path / "mix"
    report = json.loads((out / "qtk_report.json").read_text())
    tried = {c["layers_at_8_bits"]: c["passed"] for c in report["gates"]["candidates"]}
    mixed = report["mixed_precision"]
    kl, together = mixed["kl_each_layer_alone"], mixed["kept_together"]
    # q/k/v and gate/up read one input (vLLM fuses each into one layer): kept together or not at all
    assert sorted(map(sorted, together)) == sorted(
        sorted(f"model.layers.{i}.{n}" for n in g) for i in range(2)
        for g in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]))
    units = sorted(together + [[n] for n in kl if not any(n in g for g in together)],
                   key=lambda u: sum(kl[n] for n in u), reverse=True)  # 8: four per block
    sizes = [sum(len(u) for u in units[:j]) for j in range(len(units) + 1)]  # layers kept with the j first units
    k = len(_kept(out))
    assert 0 < k < 14 and k in sizes and tried[14] and tried[k] and not tried[0]
    assert tried[sizes[sizes.index(k) - 1]] is False  # bisection ends between failing j - 1 units and passing j
    assert all(passed == (n >= k) for n, passed in tried.items())
    assert len(tried) <= 2 + math.ceil(math.log2(len(units)))
    assert set(_kept(out)) == {n for u in units[:sizes.index(k)] for n in u}  # the most sensitive units
    assert report["mixed_precision"]["bytes_added"] > 0
    assert not (out / ".candidates").exists() and not list(tmp_path.glob(".mix*"))

    # what was written is what was gated: qtk eval reads the same KL and the same verdict
    j = tmp_path / "eval.json"
    r = CliRunner().invoke(main, ["eval", str(out), "--baseline", str(tiny_dir), "--gates",
                                  str(_gates(tmp_path, limit)), "--json", str(j)])
    assert r.exit_code == 0, r.output
    assert json.loads(j.read_text())["rows"][0]["candidate"] == pytest.approx(report["gates"]["rows"][0]["candidate"])
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted(next(iter(groups.values()))["targets"]) == sorted(_kept(out))

    r = _quantize(tiny_dir, tmp_path / "easy", _gates(tmp_path, kl_none * 2))  # the scheme alone passes
    assert r.exit_code == 0, r.output
    assert _kept(tmp_path / "easy") == {}
    assert [c["layers_at_8_bits"] for c in json.loads((tmp_path / "easy" / "qtk_report.json").read_text())
            ["gates"]["candidates"]] == [14, 0]


def test_bad_gates_fail_before_any_work(tiny_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gates:\n  kld: {task: kld, max_increase_pct: oops}\n")
    r = _quantize(tiny_dir, tmp_path / "q", bad)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    r = _quantize(tiny_dir, tmp_path / "q", tmp_path / "missing.yaml")
    assert r.exit_code == 2, r.output
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))


@pytest.mark.parametrize("threshold", [1, 5, 8, 13, 14, 15])
def test_bisection_finds_the_smallest_passing_mix(tiny_dir, tmp_path, monkeypatch, threshold):
    """The search alone (each candidate's calibration and gates replaced by `passes iff k >=
    threshold`): the smallest passing k in at most 2 + ceil(log2 K) tries; none passing -> the whole
    budget's, failed."""
    calls = []

    def fake(job, sens, kept, max_bits, path, gates, base, engine, dtype, seed, progress, echo, whole):
        calls.append(len(kept))
        path.mkdir(parents=True)
        (path / "qtk_report.json").write_text(json.dumps({"mixed_precision": {"kept_at_8_bits": kept}}))
        v = Verdict([Row("g", "m", 1.0, 1.0, 100.0, "", True, len(kept) >= threshold)], None, None)
        return gated.Candidate(len(kept), path, 4.0, 0, v, True, 0.0)

    monkeypatch.setattr(gated, "_candidate", fake)
    monkeypatch.setattr(gated, "measure_sensitivity", lambda model, recipe, ids, progress, max_bits:
                        gated.Sensitivity({f"l{i}": 1.0 / (i + 1) for i in range(14)},
                                          {f"l{i}": (32, 32) for i in range(14)}, recipe.scheme, 2, 0.0))
    monkeypatch.setattr(gated, "score_model", lambda *a, **k: {"g": {}})
    monkeypatch.setattr(gated, "check_directions", lambda *a: None)
    monkeypatch.setattr(gated.Job, "load", lambda self: torch.nn.Module())
    g = _gates(tmp_path, 1.0)
    report, v = gated.quantize_gated(str(tiny_dir), from_flags("gptq", "w4a16", group_size=32), tmp_path / "o",
                                     str(g), None, progress=False, echo=lambda *_: None)
    assert len(calls) <= 2 + math.ceil(math.log2(14)) and calls[:1] == [14]
    kept = report["mixed_precision"]["kept_at_8_bits"]
    if threshold > 14:
        assert calls == [14] and not report["gates"]["passed"] and len(kept) == 14
    else:
        assert report["gates"]["passed"] and len(kept) == threshold
        assert kept == [f"l{i}" for i in range(threshold)]  # the most sensitive first
