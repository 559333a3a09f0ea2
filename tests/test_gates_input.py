"""Quality gates on bad and tricky input: every mistake in a gates file, a tasks file or a request
log is an error naming where it is (exit 2) before any model runs; metric directions (lm-eval's
own among them); the baseline cache keyed by the contents of every file a task reads and by the
resolved dtype, and robust to a corrupt entry; outputs checked before scoring, written whole and
as standard JSON; the numeric edge cases (an overflowing perplexity, repeated needle cells, a
JSON run cut off everywhere, a replayed answer that filled the context)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from qtk.cli import main
from qtk.errors import InputError, QtkError
from qtk.evals.gates import GatesFile, check_directions, load_gates, recovery, verdict
from qtk.evals.tasks import Gate
from qtk.runtime.config import EngineConfig

NEEDLE = "task: needle, args: {lengths: [32], depths: [0]}"


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from qtk import LLM

    return LLM(str(tiny_dir), dtype="float32", max_model_len=64, kv_cache_memory=2**22, block_size=8)


# -- gates files --------------------------------------------------------------------------------
@pytest.mark.parametrize("gate, message", [
    ("{task: ppl, max_increase_pct: ten}", "max_increase_pct must be a number, got 'ten'"),
    ("{task: ppl, min_recovery_pct: null}", "min_recovery_pct must be a number, got None"),
    ("{task: ppl, min: true}", "min must be a number"),
    ("{task: ppl, weight: heavy}", "weight must be a number"),
    ("{task: ppl, weight: 0}", "weight must be > 0"),
    ("{task: ppl, weight: -1}", "weight must be > 0"),
    ("{task: ppl, args: [seq_len], max_increase_pct: 5}", "args must be a mapping"),
    ("{task: ppl, args: {seq_len: '64'}, max_increase_pct: 5}", "args.seq_len must be an integer >= 2, got '64'"),
    ("{task: ppl, args: {limit: 0}, max_increase_pct: 5}", "args.limit must be an integer >= 1"),
    ("{task: needle, args: {lengths: 64}, min: 0}", "args.lengths must be a non-empty list"),
    ("{task: needle, args: {lengths: [64, 8]}, min: 0}", "args.lengths must be an integer >= 16, got 8"),
    ("{task: needle, args: {depths: [0, 120]}, min: 0}", r"args.depths must be an integer in \[0, 100\]"),
    ("{task: needle, args: {samples: 0}, min: 0}", "args.samples must be an integer >= 1"),
    ("{task: needle, args: {filler: nope.txt}, min: 0}", "args.filler: file .*nope.txt not found"),
    ("{task: ppl, args: {dataset: nope.txt}, max_increase_pct: 5}", "args.dataset: file .*nope.txt not found"),
    ("{task: json, args: {constrained: 'yes'}, min: 0}", "args.constrained must be true or false"),
    ("{task: 'replay:nope.jsonl', min: 0}", "file .*nope.jsonl not found"),
    ("{task: needle, max_increase_pct: 10}", "max_increase_pct bounds a lower-is-better metric"),
    ("{task: json, metric: valid_rate, max_increase_pct: 10}", "higher valid_rate is better"),
    ("{task: 'lm-eval:qtk_mc', metric: qtk_mc/acc, max_increase_pct: 10}", "higher qtk_mc/acc is better"),
    ("{task: 'lm-eval:qtk_mc', metric: qtk_mc/acc_stderr, weight: 1}", "no known direction"),
    ("{task: 'lm-eval:qtk_local', metric: qtk_mcq/acc, min: 0}", "not one of the gate's lm-eval tasks"),
    ("{task: needle, args: {lengths: [32, 64]}, metric: accuracy@128, min: 0}", "names no haystack length"),
    ("{task: needle, metric: accuracy@long, min: 0}", "names no haystack length"),
    ("{task: ppl, metric: [ppl], min: 0}", "metric must be a name"),
])
def test_bad_gates_are_named(tmp_path, gate, message):
    with pytest.raises(QtkError, match=message) as e:
        load_gates(write(tmp_path / "g.yaml", f"gates:\n  a: {gate}\nsoft: {{min_score_pct: 90}}\n"))
    assert "gate 'a'" in str(e.value)


@pytest.mark.parametrize("soft, message", [("90", "soft must be a mapping"),
                                           ("{min_score_pct: high}", "soft.min_score_pct must be a number")])
def test_bad_soft_section_is_named(tmp_path, soft, message):
    with pytest.raises(InputError, match=message):
        load_gates(write(tmp_path / "g.yaml", f"gates:\n  a: {{{NEEDLE}, weight: 1}}\nsoft: {soft}\n"))


def test_gate_files_are_read_from_the_gates_files_folder(tmp_path, monkeypatch):
    (tmp_path / "gd").mkdir()
    (tmp_path / "cwd").mkdir()
    for folder in ("gd", "cwd"):  # the same names in the working folder must not win
        (tmp_path / folder / "cases.jsonl").write_text('{"prompt": "A", "answer": "b"}\n')
        (tmp_path / folder / "text.txt").write_text("Some text. " * 50)
    monkeypatch.chdir(tmp_path / "cwd")
    g = load_gates(write(tmp_path / "gd" / "g.yaml", "gates:\n"
                         "  t: {task: 'tasks:cases.jsonl', min: 0}\n"
                         "  p: {task: ppl, args: {dataset: text.txt}, max_increase_pct: 5}\n"
                         "  n: {task: needle, args: {filler: text.txt, lengths: [64, 32, 64], depths: [0, 0]}, min: 0}\n"
                         "  hub: {task: ppl, args: {dataset: 'hf:wikitext'}, max_increase_pct: 5}\n"
                         "  mc: {task: 'lm-eval:qtk_local', metric: qtk_mc/acc, min_recovery_pct: 90}\n"))
    gd = (tmp_path / "gd").resolve()
    t, p, n, hub, mc = g.gates
    assert t.task == f"tasks:{gd / 'cases.jsonl'}" and p.args["dataset"] == str(gd / "text.txt")
    assert n.args == {"filler": str(gd / "text.txt"), "lengths": [32, 64], "depths": [0]}  # each cell once
    assert hub.args["dataset"] == "hf:wikitext" and mc.metric == "qtk_mc/acc"  # a subtask of the group


# -- directions and the verdict -----------------------------------------------------------------
def test_metric_directions_in_the_verdict():
    gates = GatesFile([Gate("trunc", "json", {}, "truncated_rate", {"min_recovery_pct": 90.0}, None),
                       Gate("soft_trunc", "json", {}, "constrained_truncated_rate", {}, 1.0),
                       Gate("lam", "lm-eval:lambada", {}, "lambada/perplexity", {"min_recovery_pct": 90.0}, None),
                       Gate("ter", "lm-eval:wmt", {}, "wmt/ter", {"max_increase_pct": 10.0}, None)], 90.0, "g.yaml")
    base = {"trunc": {"truncated_rate": 0.0}, "soft_trunc": {"constrained_truncated_rate": 0.5},
            "lam": {"lambada/perplexity": 5.0, "_higher_is_better": {"lambada/perplexity": False}},
            "ter": {"wmt/ter": 40.0}}  # no direction from the run: known by name
    cand = {"trunc": {"truncated_rate": 0.75}, "soft_trunc": {"constrained_truncated_rate": 0.0},
            "lam": {"lambada/perplexity": 50.0}, "ter": {"wmt/ter": 50.0}}
    v = verdict(gates, base, cand)
    assert [r.passed for r in v.rows] == [False, None, False, False]
    assert v.rows[2].recovery_pct == pytest.approx(10.0) and v.soft_score_pct == 100.0  # less truncation: a gain


@pytest.mark.parametrize("gate, results, message", [
    (Gate("x", "lm-eval:t", {}, "t/score", {"min_recovery_pct": 90.0}, None), {"t/score": 1.0}, "no known direction"),
    (Gate("x", "lm-eval:t", {}, "t/score", {"max_increase_pct": 5.0}, None),
     {"t/score": 1.0, "_higher_is_better": {"t/score": True}}, "max_increase_pct bounds a lower-is-better"),
])
def test_lm_eval_directions_known_only_after_the_baseline_ran(gate, results, message):
    gates = GatesFile([gate], None, "g.yaml")
    check_directions(GatesFile([Gate("x", "lm-eval:t", {}, "t/score", {"min": 0.5}, None)], None, "g"), {"x": results})
    with pytest.raises(InputError, match=message):
        check_directions(gates, {"x": results})
    with pytest.raises(InputError, match=message):
        verdict(gates, {"x": results}, {"x": results})


def test_lm_eval_results_keep_lm_evals_directions(tiny_dir):
    from qtk import LLM
    from qtk.evals.scoring import run_task

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    out = run_task(llm, Gate("l", "lm-eval:qtk_local", {"limit": 2}, None, {"min": 0.0}, None))
    assert out["_higher_is_better"]["qtk_paragraphs/bits_per_byte"] is False
    assert out["_higher_is_better"]["qtk_mc/acc"] is True and "qtk_mc/acc" in out


def test_overflowing_perplexity_fails_its_gate():
    from qtk.evals.perplexity import exp_nll

    assert exp_nll(800.0) == math.inf and exp_nll(1.0) == pytest.approx(math.e)
    gates = GatesFile([Gate("ppl", "ppl", {}, None, {"max_increase_pct": 10.0}, None)], None, "g.yaml")
    v = verdict(gates, {"ppl": {"ppl": 12.0}}, {"ppl": {"ppl": math.inf}})
    assert not v.passed and v.rows[0].recovery_pct == 0.0
    assert recovery(math.inf, math.inf, True) == 100.0


def test_default_gates_fail_a_constrained_run_cut_off_everywhere():
    from qtk.evals.json_validity import Tally

    cut = Tally()
    for _ in range(30):
        cut.add(parsed=False, valid=False, truncated=True)
    gate = next(g for g in load_gates("default").gates if g.name == "json_constrained")
    metric = gate.metric
    v = verdict(GatesFile([gate], None, "default"), {gate.name: {metric: 1.0}}, {gate.name: {metric: cut.finished_valid_rate}})
    assert not v.passed


def test_repeated_needle_cells_count_once(tokenizer):
    import re

    from qtk.evals.needle import needle

    class FindsEarlyKeys:  # retrieves a key in the first half of the prompt
        max_model_len = 4096

        def __init__(self):
            self.tokenizer = tokenizer

        def generate(self, prompts, params):
            texts = [tokenizer.decode(p) for p in prompts]
            keys = [re.search(r"pass key is (\d{5})", t) for t in texts]
            return [SimpleNamespace(outputs=[SimpleNamespace(text=k.group(1) if k.start() < len(t) / 2 else "no")])
                    for t, k in zip(texts, keys)]

    r = needle(FindsEarlyKeys(), lengths=[64, 64], depths=[0, 0, 100])
    assert r.lengths == [64] and r.depths == [0, 100] and r.cells == {(64, 0): 1.0, (64, 100): 0.0}
    assert r.accuracy == 0.5 and len(r.answers) == 2


def test_default_needle_lengths_fit_the_filler_and_longer_ones_name_lengths(tokenizer, tiny_dir, caplog):
    """A long context (128k) would have the default haystacks outgrow the filler text: they stop
    at what the filler holds, and the log says so; lengths given past it name --lengths and the maximum."""
    import logging

    from qtk.data import builtin_texts
    from qtk.evals.needle import needle

    class LongContext:
        max_model_len = 131072

        def __init__(self):
            self.tokenizer = tokenizer

        def generate(self, prompts, params):
            return [SimpleNamespace(outputs=[SimpleNamespace(text="no")]) for _ in prompts]

    filler = "One more sentence of filler text. " * 100
    available = len(tokenizer(filler, add_special_tokens=False).input_ids) - 1
    assert 512 < available < 1024
    with caplog.at_level(logging.INFO, logger="qtk.evals.needle"):
        r = needle(LongContext(), depths=[50], filler=filler)
    assert r.lengths == [256, 512]
    assert (f"the filler text has {available + 1} tokens, so the default haystack lengths stop at 512 (the context "
            "would take 65536)") in caplog.text
    with pytest.raises(InputError, match=rf"--lengths 1024 is longer .* up to {available}, or a longer filler"):
        needle(LongContext(), lengths=[256, 1024], depths=[50], filler=filler)
    builtin = len(tokenizer("\n\n".join(builtin_texts("evaluation")), add_special_tokens=False).input_ids) - 1
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "needle", "--lengths", "64,100000"])
    assert r.exit_code == 2 and f"give --lengths (a gates file: args.lengths) up to {builtin}" in r.output


def test_default_needle_lengths_tokenize_the_filler_once(tokenizer):
    """The default lengths (which stop at the filler's size) and the cases read one tokenization of
    the filler text, and the prompts are build_cases' own for those lengths."""
    from qtk.data import builtin_texts
    from qtk.evals.needle import _fitting_default_lengths, build_cases, filler_tokens, needle

    filler = "\n\n".join(builtin_texts("evaluation"))
    fillers = []

    class Counting:  # the tokenizer, counting the calls that tokenize the filler text
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **kwargs):
            fillers.append(text == filler)
            return tokenizer(text, **kwargs)

    class Engine:
        max_model_len = 2048
        tokenizer = Counting()
        prompts = []

        def generate(self, prompts, params):
            self.prompts += prompts
            return [SimpleNamespace(outputs=[SimpleNamespace(text="no")]) for _ in prompts]

    engine = Engine()
    r = needle(engine, depths=[0, 100], samples=2, seed=4)
    assert sum(fillers) == 1
    lengths = _fitting_default_lengths(2048, len(filler_tokens(tokenizer, None)))
    assert r.lengths == lengths == [256, 512, 1024]
    assert engine.prompts == [c.prompt for c in build_cases(tokenizer, lengths, [0, 100], samples=2, seed=4)]


def test_needle_depth_holds_where_no_sentence_ends_after_it(tokenizer):
    """A haystack with no sentence end after d% puts the needle at the last one before it (or at
    d%), never at the haystack's end, where it would score the 100% cell's recency as d%'s."""
    from qtk.evals.needle import NEEDLE, _sentence_end, build_cases

    text = "One sentence ends here. " + "then words run on without any end " * 20
    assert _sentence_end(text, len(text) // 2) == len("One sentence ends here.")
    assert _sentence_end("no end at all in this text", 10) == 10
    assert (_sentence_end(text, 0), _sentence_end(text, len(text))) == (0, len(text))
    filler = "一二三四五六七八九十" * 400  # no sentence end [.!?] + space anywhere
    for c in build_cases(tokenizer, [64], [25, 50, 75], filler=filler):
        body = tokenizer.decode(c.prompt)
        hay = body[body.index("the pass key.") + len("the pass key."):body.index("What is the pass key?")]
        at = hay.index(NEEDLE.format(key=c.key))
        assert 0.1 < at / len(hay) < 0.9, (c.depth, at, len(hay))
    with pytest.raises(InputError, match="at least one haystack length and one depth"):
        build_cases(tokenizer, [64], [])


# -- tasks files and request logs ---------------------------------------------------------------
@pytest.mark.parametrize("kind, row, message", [
    ("tasks", {"prompt": "Hi", "answer": "x", "max_tokens": "8"}, "max_tokens must be an integer >= 1"),
    ("tasks", {"prompt": "Hi", "answer": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("tasks", {"messages": "Hi", "answer": "x"}, "messages must be a non-empty list"),
    ("tasks", {"messages": [{"role": "user"}], "answer": "x"}, r"messages\[0\] must be an object"),
    ("tasks", {"prompt": 42, "answer": "x"}, "prompt must be non-empty text"),
    ("replay", {"messages": [{"content": "Hi"}]}, r"messages\[0\] must be an object with string role"),
    ("replay", {"messages": "Hi"}, "messages must be a list"),
    ("replay", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens must be an integer >= 1"),
    ("replay", {"prompt": {"text": "Hi"}}, "prompt must be text, token ids"),
    ("replay", {"prompt": [1, "x"]}, "prompt must be non-empty text or a list of token ids"),
    ("replay", {"request": {"prompt": []}}, "prompt must be text, token ids"),
    ("replay", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     r"messages\[0\] must be an object with string role and content"),
])
def test_bad_case_lines_are_named(tmp_path, kind, row, message):
    from qtk.evals.replay import load_requests
    from qtk.evals.user_tasks import load_cases

    path = tmp_path / "cases.jsonl"
    path.write_text('{"prompt": "fine", "answer": "ok"}\n' + json.dumps(row) + "\n")
    with pytest.raises(InputError, match=f"cases.jsonl:2: {message}"):
        (load_cases if kind == "tasks" else load_requests)(path)


def test_a_tasks_file_without_cases_is_an_error(tmp_path):
    """An accuracy over no cases is 0 for both models: 100% recovery, a gate passed on nothing."""
    from qtk.evals.user_tasks import load_cases

    path = tmp_path / "cases.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InputError, match="cases.jsonl: no cases"):
        load_cases(path)


@pytest.mark.parametrize("prompt, message", [("word " * 100, "the prompt has 101 tokens"),
                                             ([1, 2, 10**7], "token id 10000000")])
def test_prompts_that_cannot_run_are_named_before_any_runs(tmp_path, tiny_llm, prompt, message):
    from qtk.evals.replay import load_requests, replay

    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    with pytest.raises(InputError, match=f"log.jsonl:2: {message}"):
        replay(tiny_llm, load_requests(path))


def test_replay_of_an_answer_that_filled_the_context(tiny_llm):
    from qtk.evals.replay import replay

    cases = [{"prompt": list(range(1000, 1060)), "max_tokens": 16}]  # 60 of the 64 tokens of context
    base = replay(tiny_llm, cases, max_tokens=16)
    assert len(cases[0]["prompt"]) + len(base["_responses"][0]) == tiny_llm.max_model_len
    again = replay(tiny_llm, cases, max_tokens=16, reference=base["_responses"])
    assert (again["agreement"], again["top1_agreement"]) == (1.0, 1.0)


# -- the baseline's cache -----------------------------------------------------------------------
def test_cache_key_follows_file_contents_and_the_resolved_dtype(tmp_path, monkeypatch):
    import qtk.device
    import qtk.kernels.cpu
    from qtk.evals.scoring import _cache_key

    cases = tmp_path / "cases.jsonl"
    cases.write_text('{"prompt": "A", "answer": "b"}\n')
    text = tmp_path / "text.txt"
    text.write_text("one")
    g = load_gates(write(tmp_path / "g.yaml", "gates:\n  t: {task: 'tasks:cases.jsonl', min: 0}\n"
                         "  p: {task: ppl, args: {dataset: text.txt}, max_increase_pct: 5}\n")).gates
    engine = {"dtype": "float32", "device": "cpu"}
    keys = [_cache_key("f" * 64, gate, engine, 0) for gate in g]
    assert keys == [_cache_key("f" * 64, gate, engine, 0) for gate in g]
    cases.write_text('{"prompt": "A", "answer": "c"}\n')
    text.write_text("two")
    assert all(k != _cache_key("f" * 64, gate, engine, 0) for k, gate in zip(keys, g))
    monkeypatch.setattr(qtk.device, "cpu_bf16_reason", lambda: (False, "no bf16 units"))
    auto_fp32 = _cache_key("f" * 64, g[0], {**engine, "dtype": "auto"}, 0)
    assert auto_fp32 == _cache_key("f" * 64, g[0], engine, 0)
    monkeypatch.setattr(qtk.device, "cpu_bf16_reason", lambda: (True, "bf16 units"))
    monkeypatch.setattr(qtk.kernels.cpu, "built", lambda: True)  # the runtime's auto: float32
    assert _cache_key("f" * 64, g[0], {**engine, "dtype": "auto"}, 0) == auto_fp32
    monkeypatch.setattr(qtk.kernels.cpu, "built", lambda: False)  # bf16 there
    assert _cache_key("f" * 64, g[0], {**engine, "dtype": "auto"}, 0) != auto_fp32


def test_a_corrupt_cache_entry_is_recomputed(tmp_path, monkeypatch, tiny_dir, caplog):
    import qtk.evals.scoring as scoring
    import qtk.runtime.engine

    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(qtk.runtime.engine, "LLM", lambda *a, **kw: object())
    runs = []
    monkeypatch.setattr(scoring, "run_task", lambda llm, gate, seed, ref: runs.append(gate) or {"accuracy": 0.5})
    gates = [Gate("n", "needle", {}, None, {"min": 0.0}, None)]
    engine = EngineConfig(str(tiny_dir), dtype="float32", device="cpu")
    assert scoring.score_model(engine, gates, 0, "b", cache=True, echo=lambda s: None) == \
        {"n": {"accuracy": 0.5}}
    (entry,) = (tmp_path / "cache" / "gates").iterdir()
    entry.write_text("")  # a write cut short
    assert scoring.score_model(engine, gates, 0, "b", cache=True, echo=lambda s: None) == \
        {"n": {"accuracy": 0.5}}
    assert len(runs) == 2 and "unreadable cache entry" in caplog.text
    assert json.loads(entry.read_text()) == {"accuracy": 0.5}
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary file left
    scoring.score_model(engine, gates, 0, "b", cache=True, echo=lambda s: None)
    assert len(runs) == 2  # read from the cache


# -- outputs ------------------------------------------------------------------------------------
def test_report_is_written_whole_and_as_standard_json(tmp_path, monkeypatch):
    import qtk.evals.report as report

    gates = GatesFile([Gate("needle", "needle", {}, None, {"min_recovery_pct": 85.0}, None)], None, "g.yaml")
    out = tmp_path / "r"
    report.write_report(out, verdict(gates, {"needle": {"accuracy": 0.0}}, {"needle": {"accuracy": 0.4}}),
                        "b", "c", "g.yaml")
    text = (out / "report.json").read_text()
    row = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))["rows"][0]
    assert row["recovery_pct"] is None  # infinite: 0.4 against 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(folder, v):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "_pictures", broken)
    with pytest.raises(RuntimeError):
        report.write_report(out, verdict(gates, {"needle": {"accuracy": 1.0}}, {"needle": {"accuracy": 0.0}}),
                            "b", "c", "g.yaml")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous report, untouched


def test_a_json_write_cut_short_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    """--json's file and a baseline cache entry: a write that fails partway (a full disk) raises,
    keeps the previous file and removes its temporary file."""
    import errno
    from pathlib import Path

    import qtk.evals.report as report
    import qtk.evals.scoring as scoring

    real = Path.write_text

    def cut_short(self, text, *args, **kwargs):
        real(self, text[:len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    for write_json in (report.write_json, scoring._write_json):
        folder = tmp_path / write_json.__module__
        write_json(folder / "out.json", {"before": 1})
        monkeypatch.setattr(Path, "write_text", cut_short)
        with pytest.raises(OSError, match="No space left"):
            write_json(folder / "out.json", {"after": 2})
        monkeypatch.setattr(Path, "write_text", real)
        assert [p.name for p in folder.iterdir()] == ["out.json"]
        assert json.loads((folder / "out.json").read_text()) == {"before": 1}


@pytest.fixture
def gates_file(tmp_path):
    (tmp_path / "cases.jsonl").write_text('{"prompt": "Hi", "answer": "x", "max_tokens": 2}\n')
    return write(tmp_path / "g.yaml", "gates:\n  a: {task: 'tasks:cases.jsonl', min: 0}\n")


@pytest.mark.parametrize("flags, message", [
    (["--report", "{file}/out"], "--report"),
    (["--json", "{tmp}"], "is a directory"),
    (["--json", "{file}/v.json"], "--json"),
    (["--limit", "3"], "--gates ignores --limit"),
    (["--task", "needle", "--seq-len", "64"], "--gates ignores --task, --seq-len"),
])
def test_cli_gates_output_and_flag_mistakes_exit_2_before_any_model_runs(tmp_path, tiny_dir, gates_file, flags,
                                                                         message):
    (tmp_path / "afile").write_text("")
    flags = [f.format(file=tmp_path / "afile", tmp=tmp_path) for f in flags]
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tiny_dir), "--gates", gates_file,
                                  "--dtype", "float32", "--no-cache", *flags])
    assert r.exit_code == 2 and message in r.output and "[baseline]" not in r.output, r.output


def test_one_task_table_names_the_tasks():
    from qtk.evals.tasks import TASKS_HELP, lookup

    assert TASKS_HELP == "ppl, kld, needle, json, lm-eval:TASK[,TASK], tasks:FILE.jsonl or replay:LOG.jsonl"
    assert all(lookup(t) is not None for t in ("ppl", "kld", "needle", "json", "lm-eval:a,b", "tasks:f", "replay:f"))
    assert all(lookup(t) is None for t in ("nope", "ppl:x", "lm-eval", "lm-eval:", "tasks:", "replay"))


def test_cli_task_mode_flags_and_replay_alone(tmp_path, tiny_dir):
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--report", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--report: only with --gates" in r.output
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt": "Hello", "max_tokens": 3}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}) + "\n")
    out = tmp_path / "replay.json"
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", f"replay:{log}", "--dtype", "float32",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    responses = json.loads(out.read_text())["responses"]
    assert [len(x["token_ids"]) for x in responses] == [3, 2] and responses[1]["where"] == f"{log}:2"
