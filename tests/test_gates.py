"""Quality gates: the gates file is checked key by key (exit 2 on a mistake), the verdict's
arithmetic (hard thresholds relative and absolute, the soft weighted score), the report folder,
the needle eval's cases, and, on the bundled model, the gates passing a sound checkpoint (RTN
w8a16, exit 0) and failing a broken one (a quarter of its packed 4-bit words scrambled, exit 1)."""
from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
import yaml
from click.testing import CliRunner

from qtk.cli import main
from qtk.errors import InputError, NotFoundError
from qtk.evals.gates import GatesFile, load_gates, recovery, verdict
from qtk.evals.tasks import Gate

GOOD = """
gates:
  ppl: {task: ppl, args: {seq_len: 64, limit: 2}, max_increase_pct: 10}
  needle: {task: needle, args: {lengths: [64], depths: [0, 100]}, min_recovery_pct: 80, weight: 1}
  json: {task: json, args: {limit: 4}, metric: valid_rate, weight: 2}
soft: {min_score_pct: 90}
"""


def write(tmp_path, text: str) -> str:
    p = tmp_path / "g.yaml"
    p.write_text(text)
    return str(p)


def test_gates_files_load_and_every_mistake_is_named(tmp_path):
    g = load_gates(write(tmp_path, GOOD))
    assert [x.name for x in g.gates] == ["ppl", "needle", "json"] and g.min_score_pct == 90
    assert {x.name for x in load_gates("default").gates} >= {"perplexity", "needle", "json_constrained"}
    load_gates("ci")
    bad = [("gates:\n  a: {task: ppl, max_increase_pct: 5, colour: red}\n", "unknown key.*colour"),
           ("gates:\n  a: {task: ppx, max_increase_pct: 5}\n", "unknown task 'ppx'"),
           ("gates:\n  a: {task: lm-eval, min: 1}\n", "unknown task 'lm-eval'"),
           ("gates:\n  a: {task: ppl, args: {seqlen: 5}, max_increase_pct: 5}\n", "unknown arg.*seqlen"),
           ("gates:\n  a: {task: ppl}\n", "threshold"),
           ("gates:\n  a: {task: ppl, weight: 1}\n", "min_score_pct"),
           ("gates:\n  a: {task: ppl, max_increase_pct: 5}\nsoft: {min_scor: 3}\n", "under soft"),
           ("gate:\n  a: {task: ppl}\n", "gates:"),
           ("gates: [oops\n", "not valid YAML"),
           ("gates:\n  a: {task: ppl, metric: perplexity, max: 5}\n", "no metric 'perplexity'"),
           ("gates:\n  a: {task: json, metric: constrained_valid_rate, min: 1}\n", "constrained: true"),
           ("gates:\n  a: {task: 'lm-eval:qtk_mc', metric: acc, min: 0.3}\n", "TASK/METRIC")]
    for text, message in bad:
        with pytest.raises(InputError, match=message):
            load_gates(write(tmp_path, text))
    with pytest.raises(NotFoundError, match="default, .*ci|ci, .*default"):
        load_gates(str(tmp_path / "missing.yaml"))


def test_verdict_arithmetic():
    g = load_gates("default")
    gates = GatesFile([Gate("ppl", "ppl", {}, None, {"max_increase_pct": 10.0}, None),
                       Gate("needle", "needle", {}, None, {"min_recovery_pct": 80.0}, 1.0),
                       Gate("json", "json", {}, "valid_rate", {}, 3.0),
                       Gate("strict", "json", {}, "constrained_valid_rate", {"min": 1.0}, None)], 90.0, g.path)
    base = {"ppl": {"ppl": 10.0}, "needle": {"accuracy": 0.8}, "json": {"valid_rate": 0.5},
            "strict": {"constrained_valid_rate": 1.0}}
    cand = {"ppl": {"ppl": 10.9}, "needle": {"accuracy": 0.7}, "json": {"valid_rate": 0.5},
            "strict": {"constrained_valid_rate": 1.0}}
    v = verdict(gates, base, cand)
    assert [r.passed for r in v.rows] == [True, True, None, True] and v.passed
    assert v.rows[0].recovery_pct == pytest.approx(100 * 10 / 10.9) and v.rows[1].recovery_pct == pytest.approx(87.5)
    assert v.soft_score_pct == pytest.approx((87.5 + 3 * 100) / 4)
    cand["ppl"]["ppl"] = 11.1  # +11%: the hard gate fails
    assert not verdict(gates, base, cand).passed
    cand["ppl"]["ppl"] = 10.0
    cand["json"]["valid_rate"] = 0.2  # soft: (87.5 + 3 * 40) / 4 = 51.9% < 90%
    v = verdict(gates, base, cand)
    assert all(r.passed is not False for r in v.rows) and not v.soft_passed and not v.passed
    assert "soft score" in v.table() and "FAIL" in v.table()
    cand["json"]["valid_rate"] = 0.9  # a gain is capped at 100% in the soft score
    assert verdict(gates, base, cand).soft_score_pct == pytest.approx((87.5 + 300) / 4)
    cand["strict"]["constrained_valid_rate"] = 0.99
    assert not verdict(gates, base, cand).passed
    assert recovery(0.0, 0.0, False) == 100.0 and recovery(2.0, 4.0, True) == 50.0


def test_report_folder(tmp_path):
    from qtk.evals.report import write_report

    gates = GatesFile([Gate("ppl", "ppl", {}, None, {"max_increase_pct": 10.0}, None),
                       Gate("needle", "needle", {}, None, {"min_recovery_pct": 80.0}, None)], None, "g.yaml")
    cells = lambda acc: {"accuracy": acc, "lengths": [256, 512], "depths": [0, 100],  # noqa: E731
                         "cells": [{"length": n, "depth": d, "accuracy": acc} for n in (256, 512) for d in (0, 100)]}
    base = {"ppl": {"ppl": 10.0}, "needle": {"accuracy": 1.0, "_cells": cells(1.0)}}
    cand = {"ppl": {"ppl": 12.0}, "needle": {"accuracy": 0.5, "_cells": cells(0.5)}}
    paths = write_report(tmp_path / "r", verdict(gates, base, cand), "base", "cand", "g.yaml")
    names = {p.name for p in paths}
    assert names == {"report.md", "report.json", "metrics.png", "needle.png"}
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "r" / "report.md").read_text()
    assert "# Quality gates: FAIL" in md and "**FAIL**" in md and "![needle](needle.png)" in md
    assert json.loads((tmp_path / "r" / "report.json").read_text())["passed"] is False


def test_report_draws_every_needle_gate_and_escapes_a_pipe_in_a_name(tmp_path, monkeypatch):
    """needle.png holds a baseline/candidate pair of heatmaps per needle gate, not the first
    gate's alone; a | in a gate's name stays inside its report.md cell."""
    import re

    import matplotlib.axes

    from qtk.evals.report import write_report

    drawn, imshow = [], matplotlib.axes.Axes.imshow
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow",
                        lambda ax, grid, **kw: drawn.append(grid) or imshow(ax, grid, **kw))
    cells = lambda n, acc: {"accuracy": acc, "lengths": [n], "depths": [0, 100],  # noqa: E731
                            "cells": [{"length": n, "depth": d, "accuracy": acc} for d in (0, 100)]}
    gates = GatesFile([Gate("short|needle", "needle", {}, None, {"min_recovery_pct": 80.0}, None),
                       Gate("long", "needle", {}, None, {"min_recovery_pct": 80.0}, None)], None, "g.yaml")
    base = {"short|needle": {"accuracy": 1.0, "_cells": cells(64, 1.0)},
            "long": {"accuracy": 0.5, "_cells": cells(512, 0.5)}}
    cand = {"short|needle": {"accuracy": 0.0, "_cells": cells(64, 0.0)},
            "long": {"accuracy": 0.25, "_cells": cells(512, 0.25)}}
    write_report(tmp_path / "r", verdict(gates, base, cand), "base", "cand", "g.yaml")
    assert drawn == [[[1.0, 1.0]], [[0.0, 0.0]], [[0.5, 0.5]], [[0.25, 0.25]]]
    row = next(line for line in (tmp_path / "r" / "report.md").read_text().splitlines() if line.startswith("| short"))
    assert row.startswith(r"| short\|needle | accuracy | 1 | 0 |")
    assert len(re.split(r"(?<!\\)\|", row)) == 9  # the table's 7 cells


def test_cli_gates_bad_input_exits_2(tmp_path, tiny_dir):
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--gates", "ci"])
    assert r.exit_code == 2 and "--baseline" in r.output
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tmp_path / "nope"), "--gates", "ci"])
    assert r.exit_code == 2 and "not found" in r.output
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tiny_dir), "--gates",
                                  write(tmp_path, "gates:\n  a: {task: ppl, max_increase_pct: 5, x: 1}\n")])
    assert r.exit_code == 2 and "unknown key" in r.output
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "nope"])
    assert r.exit_code == 2 and "unknown --task" in r.output


def test_needle_cases_are_deterministic_and_hold_their_key(tokenizer):
    from qtk.evals.needle import build_cases, retrieved

    a = build_cases(tokenizer, [64, 128], [0, 50, 100], samples=2, seed=3)
    b = build_cases(tokenizer, [64, 128], [0, 50, 100], samples=2, seed=3)
    assert a == b and len(a) == 12 and len({c.key for c in a}) > 6
    for c in a:
        text = tokenizer.decode(c.prompt)
        assert f"The pass key is {c.key}." in text and text.count(c.key) == 2
    first, last = (tokenizer.decode(c.prompt) for c in a[:1] + a[4:5])  # depth 0 and 100 of length 64
    assert first.index(a[0].key) < len(first) // 3 and last.index(a[4].key) > len(last) // 2
    assert retrieved("The pass key is 12345.", "12345") and not retrieved("It is 1234 or 12345", "12345")
    with pytest.raises(InputError, match="depths"):
        build_cases(tokenizer, [64], [120])


def test_cli_needle_on_the_tiny_model(tiny_dir, tmp_path):
    out = tmp_path / "n.json"
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "needle", "--lengths", "32,64", "--depths", "0,100",
                                  "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["lengths"] == [32, 64] and len(res["cells"]) == 4 and len(res["answers"]) == 4
    assert res["accuracy"] == sum(a["retrieved"] for a in res["answers"]) / 4  # a random model: likely 0


@pytest.mark.slow
def test_needle_the_bundled_model_must_find(bundled_dir):
    """Haystacks this short, the real model finds every key: the scoring is checked, not only run."""
    from qtk import LLM
    from qtk.evals.needle import needle

    llm = LLM(str(bundled_dir), dtype="float32", max_model_len=512)
    r = needle(llm, lengths=[64, 160], depths=[0, 50, 100], seed=1)
    assert r.accuracy == 1.0 and all(a["retrieved"] for a in r.answers), r.answers
    assert r.by_length() == {64: 1.0, 160: 1.0} and len(r.cells) == 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An RTN w8a16 checkpoint of the bundled model (sound) and an RTN w4a16 one with a quarter
    of its packed weight words scrambled (broken)."""
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("gated")
    for scheme in ("w8a16", "w4a16"):
        r = CliRunner().invoke(main, ["quantize", "smollm2-135m", "--method", "rtn", "--scheme", scheme,
                                      "--output", str(d / scheme)])
        assert r.exit_code == 0, r.output
    broken = d / "scrambled"
    shutil.copytree(d / "w4a16", broken)
    g = torch.Generator().manual_seed(0)
    for f in broken.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("weight_packed"):
                flat = t.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 4]
                flat[idx] = torch.randint(-2**31, 2**31 - 1, (idx.numel(),), generator=g, dtype=torch.int32)
        save_file(tensors, f, metadata={"format": "pt"})
    return d / "w8a16", broken


@pytest.mark.slow
def test_default_gates_pass_a_sound_checkpoint_and_fail_a_broken_one(checkpoints, tmp_path):
    """qtk's default gates (every task: perplexity, needle, JSON unaided and constrained, lm-eval
    tasks) on the bundled model: RTN w8a16 passes (exit 0); a quarter of the packed words scrambled
    fails (exit 1) its perplexity gate, the baseline's perplexity scored once (cached by content hash).
    The broken checkpoint is judged on perplexity alone: its other tasks would only add minutes (a
    quarter of this test's time on a 2-core AVX2 CPU) to a verdict the perplexity gate already gives."""
    sound, broken = checkpoints
    report = tmp_path / "report"
    r = CliRunner().invoke(main, ["eval", str(sound), "--baseline", "smollm2-135m", "--gates", "default",
                                  "--dtype", "float32", "--report", str(report)])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and (report / "report.md").read_text().startswith("# Quality gates: PASS")
    assert (report / "needle.png").exists() and (report / "metrics.png").exists()
    default = yaml.safe_load((resources.files("qtk.assets") / "evals/gates/default.yaml").read_text())
    ppl_only = tmp_path / "ppl.yaml"  # the default perplexity gate, as it stands
    ppl_only.write_text(yaml.safe_dump({"gates": {"perplexity": default["gates"]["perplexity"]}}))
    r = CliRunner().invoke(main, ["eval", str(broken), "--baseline", "smollm2-135m", "--gates", str(ppl_only),
                                  "--dtype", "float32", "--json", str(tmp_path / "v.json")])
    assert r.exit_code == 1, r.output
    assert "[baseline] ppl: cached" in r.output  # the baseline was scored once, by content hash
    rows = json.loads((tmp_path / "v.json").read_text())["rows"]
    assert next(x for x in rows if x["gate"] == "perplexity")["passed"] is False


def test_user_tasks_file_and_its_gate(tiny_dir, tmp_path):
    """A team's own cases: exact and contains matching, chat and completion prompts, checked
    against what the model is known to answer; the file is validated line by line."""
    from qtk import LLM, SamplingParams
    from qtk.evals.user_tasks import load_cases, run_cases

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    said = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    cases = tmp_path / "cases.jsonl"
    cases.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Hello", "answer": said, "max_tokens": 8},
        {"prompt": "Hello", "answer": said[1:4], "match": "contains", "max_tokens": 8},
        {"messages": [{"role": "user", "content": "Hi"}], "answer": "zzz", "max_tokens": 8},
        {"prompt": "Hello", "answer": said + " and more", "max_tokens": 8}]) + "\n")
    res = run_cases(llm, load_cases(cases))
    assert [a["matched"] for a in res["answers"]] == [True, True, False, False] and res["accuracy"] == 0.5
    assert res["answers"][2]["text"] == chat  # the chat case went through the template, as llm.chat does
    for text, message in [('{"prompt": "x"}', "answer"), ('{"prompt": "x", "messages": [], "answer": "a"}',
                          "exactly one"), ('{"prompt": "x", "answer": "a", "match": "regex"}', "exact or contains"),
                          ('{"prompt": "x", "answer": "a", "extra": 1}', "unknown key")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(InputError, match=message):
            load_cases(bad)
    gates = tmp_path / "mine.yaml"  # the task file is found next to the gates file
    gates.write_text("gates:\n  business: {task: 'tasks:cases.jsonl', min_recovery_pct: 100}\n")
    g = load_gates(str(gates)).gates[0]
    assert g.task == f"tasks:{cases}"
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tiny_dir), "--gates", str(gates),
                                  "--dtype", "float32", "--no-cache"])
    assert r.exit_code == 0 and "business" in r.output, r.output
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", f"tasks:{cases}", "--dtype", "float32"])
    assert r.exit_code == 0 and "2/4 matched" in r.output, r.output


@pytest.mark.slow
def test_replaying_served_traffic_tells_sound_from_broken(checkpoints, tmp_path):
    """A request log in `qtk serve --log-requests`'s format (written by its own RequestLog): a
    sound checkpoint agrees with the baseline, a broken one does not. Whole responses identical
    is a coarse measure on 8 requests (RTN w8a16 of the bundled model: 3 of 8 on an Intel Xeon with
    AMX, more on the AMD CPUs; its KL from the baseline 0.0034, top-1 agreement 0.97): the
    agreement gate asks for 2 of 8, the top-1 gate does the fine work."""
    from qtk.entrypoints.openai.request_log import RequestLog

    log = RequestLog(tmp_path / "traffic.jsonl")
    questions = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea.",
                 "What is 12 plus 7?", "Give a synonym for happy.", "Describe a cat in five words."]
    for q in questions:
        log.write("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": q}],
                                            "max_tokens": 24, "temperature": 0.7}, [{"index": 0, "text": "..."}], None)
    log.write("/v1/completions", {"model": "m", "prompt": ["The sun is", "Water boils at"], "max_tokens": 16},
              [{"index": 0, "text": "..."}], None)
    gates = tmp_path / "replay.yaml"
    gates.write_text("gates:\n"
                     "  traffic: {task: 'replay:traffic.jsonl', metric: agreement, min: 0.25}\n"
                     "  traffic_top1: {task: 'replay:traffic.jsonl', metric: top1_agreement, min: 0.9}\n")
    sound, broken = checkpoints
    out = tmp_path / "v.json"
    r = CliRunner().invoke(main, ["eval", str(sound), "--baseline", "smollm2-135m", "--gates", str(gates),
                                  "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = {x["gate"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["traffic_top1"]["candidate"] >= 0.9 and rows["traffic"]["baseline"] == 1.0
    sound_says = {k: round(v["candidate"], 3) for k, v in rows.items()}
    r = CliRunner().invoke(main, ["eval", str(broken), "--baseline", "smollm2-135m", "--gates", str(gates),
                                  "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 1, r.output
    rows = {x["gate"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["traffic"]["candidate"] < 0.25 and rows["traffic_top1"]["candidate"] < 0.9
    print(f"\nreplay: sound {sound_says}, broken {({k: round(v['candidate'], 3) for k, v in rows.items()})}")


def test_replay_reads_logs_and_scores_agreement(tiny_dir, tmp_path):
    from qtk import LLM
    from qtk.evals.replay import load_requests, replay
    from qtk.entrypoints.openai.request_log import RequestLog

    log = RequestLog(tmp_path / "log.jsonl")
    log.write("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                        "max_completion_tokens": 6}, [], None)
    log.write("/v1/completions", {"prompt": ["One", "Two"], "max_tokens": 5}, [], None)
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write(json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}) + "\n")  # a bare request body
    cases = load_requests(tmp_path / "log.jsonl")
    assert [c.get("prompt") for c in cases] == [None, "One", "Two", [5, 6, 7]]
    assert cases[0]["messages"] == [{"role": "user", "content": "Hi"}] and cases[0]["max_tokens"] == 6
    (tmp_path / "bad.jsonl").write_text('{"request": {"input": "x"}}\n')
    with pytest.raises(InputError, match="bad.jsonl:1: not an OpenAI request"):
        load_requests(tmp_path / "bad.jsonl")

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    base = replay(llm, cases)
    again = replay(llm, cases, reference=base["_responses"])
    assert (again["agreement"], again["first_divergence"], again["top1_agreement"]) == (1.0, 1.0, 1.0)
    assert [len(r) for r in base["_responses"]][1:] == [5, 5, 4]  # max_tokens as each request asked
    changed = [r[:-1] + [(r[-1] + 1) % 1000] for r in base["_responses"]]  # every last token differs
    off = replay(llm, cases, reference=changed)
    assert off["agreement"] == 0.0
    assert off["first_divergence"] == pytest.approx(sum((len(r) - 1) / len(r) for r in changed) / len(changed))
    assert off["top1_agreement"] < 1.0
