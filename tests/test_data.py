"""Calibration / evaluation text and the perplexity protocol (docs/benchmarks.md)."""
from __future__ import annotations

import hashlib
import json
import math
import sys
import types

import pytest
import torch

from qtk import data
from qtk.evals.perplexity import eval_windows, perplexity


def test_builtin_splits_are_disjoint():
    topics = data.builtin_topics()
    calib, evals = data.builtin_texts("calibration"), data.builtin_texts("evaluation")
    assert (len(calib), len(evals)) == (59, 20) and len(topics) == 79
    assert not set(calib) & set(evals)
    assert sorted(calib + evals) == sorted(topics.values())
    with pytest.raises(ValueError, match="split must be one of"):
        data.builtin_texts("train")


# sha256 over each topic's name and text (sorted by name, each followed by a NUL), of CPython 3.11.7's
# pydoc_data.topics: the text every recorded perplexity and calibration on the built-in corpus read
CORPUS_SHA256 = "6c7d68cee92383c2d38e91c095bc7f45b93d936d39b8d4c5fe1b718baf09dc63"


def _corpus_sha256(topics: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(topics):
        h.update(name.encode() + b"\0" + topics[name].encode() + b"\0")
    return h.hexdigest()


def test_builtin_corpus_is_the_shipped_text_whatever_the_python(monkeypatch):
    """Python versions ship different pydoc_data.topics (3.12's evaluation split scored 0.9% lower
    perplexity than 3.11's); the corpus is qtk's own copy, so a different interpreter's text changes nothing."""
    expected = data.builtin_texts("evaluation")
    assert _corpus_sha256(data.builtin_topics()) == CORPUS_SHA256
    other = types.ModuleType("pydoc_data.topics")
    other.topics = {"other": "another Python's text"}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", other)
    data.builtin_topics.cache_clear()
    try:
        assert data.builtin_texts("evaluation") == expected
        assert _corpus_sha256(data.builtin_topics()) == CORPUS_SHA256
    finally:
        data.builtin_topics.cache_clear()


def test_token_stream_separates_texts_with_eos(tokenizer):
    ids = data.token_stream(tokenizer, ["hello world", "again"])
    hello = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    again = tokenizer("again", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert ids.dtype == torch.long and ids.tolist() == hello + [eos] + again + [eos]
    chat = data.token_stream(tokenizer, ["hello world"], chat_template=True)
    assert len(chat) > len(hello) + 1 and tokenizer.decode(chat).count("hello world") == 1


def test_calibration_ids_deterministic_per_seed(tokenizer):
    a = data.calibration_ids(tokenizer, num_samples=8, seq_len=128, seed=0)
    b = data.calibration_ids(tokenizer, num_samples=8, seq_len=128, seed=0)
    c = data.calibration_ids(tokenizer, num_samples=8, seq_len=128, seed=1)
    assert a.shape == (8, 128) and torch.equal(a, b) and not torch.equal(a, c)
    # rows are distinct, non-overlapping windows of the calibration stream, in stream order
    stream = data.token_stream(tokenizer, data.builtin_texts("calibration"))
    windows = stream[: len(stream) // 128 * 128].view(-1, 128)
    starts = [next(i for i in range(len(windows)) if torch.equal(windows[i], row)) for row in a]
    assert starts == sorted(set(starts))
    # and none of them comes from the evaluation text
    evals = data.token_stream(tokenizer, data.builtin_texts("evaluation"))
    assert len(stream) == 83378 and len(evals) == 29731


def test_too_short_source_fails_with_clear_message(tokenizer, tmp_path):
    f = tmp_path / "small.txt"
    f.write_text("just a few words of calibration text. " * 10)
    n = len(data.token_stream(tokenizer, [f.read_text()]))
    with pytest.raises(ValueError, match=rf"has {n} calibration tokens, enough for {n // 32} samples of 32; "
                                         r"asked for 64 \(lower --num-samples or --seq-len\)"):
        data.calibration_ids(tokenizer, str(f), num_samples=64, seq_len=32)


def test_too_short_source_fails_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    from qtk import pipeline
    from qtk.recipe import CalibrationArgs, from_flags

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the calibration data was checked")

    monkeypatch.setattr(pipeline, "load_model", no_load)
    f = tmp_path / "small.txt"
    f.write_text("too short")
    recipe = from_flags("rtn", group_size=32, kv_cache="fp8", calibration=CalibrationArgs(dataset=str(f)))
    with pytest.raises(ValueError, match="calibration tokens, enough for 0 samples of 256"):
        pipeline.quantize(str(tiny_dir), recipe, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_txt_and_jsonl_inputs(tmp_path, tokenizer):
    txt = tmp_path / "a.txt"
    txt.write_text("one long text\nwith two lines\n")
    assert data.load_texts(str(txt), "calibration") == ["one long text\nwith two lines\n"]
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n')
    assert data.load_texts(str(jl), "evaluation") == ["first", "second"]
    ids = data.calibration_ids(tokenizer, str(txt), num_samples=2, seq_len=3)
    assert ids.shape == (2, 3)


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', r"a.jsonl:3: not valid JSON"),
    ('{"text": "ok"}\n["text"]\n', r"a.jsonl:2: each line must be a JSON object with a string 'text' field"),
    ('{"content": "no text key"}\n', r"a.jsonl:1: each line must be a JSON object"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    jl = tmp_path / "a.jsonl"
    jl.write_text(content)
    with pytest.raises(ValueError, match=message):
        data.load_texts(str(jl), "calibration")


def test_bad_file_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file .*nope.txt not found"):
        data.load_texts(str(tmp_path / "nope.txt"), "calibration")
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="must be .txt or .jsonl"):
        data.load_texts(str(tmp_path / "a.csv"), "calibration")


def test_hf_offline_is_a_clear_error(monkeypatch):
    import datasets

    calls = []

    def offline(repo, config=None, **kw):
        calls.append((repo, config))
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "get_dataset_split_names", offline)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"could not load the Hugging Face dataset 'wikitext': "
                                           r"Couldn't reach .*Offline\? Use --dataset builtin"):
        data.load_texts("hf:wikitext:wikitext-2-raw-v1", "evaluation")
    assert calls == [("wikitext", "wikitext-2-raw-v1")]


class FakeSet:
    def __init__(self, columns):
        self.column_names = columns

    def __getitem__(self, key):
        return ["a", "", "b"]


def fake_hub(monkeypatch, splits, columns=("text", "label")):
    """datasets' loader over a dataset with these splits; the splits loaded are recorded."""
    import datasets

    loaded = []

    def load(repo, config=None, split=None):
        if split not in splits:  # as datasets says it
            raise ValueError(f'Unknown split "{split}". Should be one of {list(splits)}.')
        loaded.append(split)
        return FakeSet(list(columns))

    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda repo, config=None: list(splits))
    monkeypatch.setattr(datasets, "load_dataset", load)
    return loaded


def test_hf_texts_column_and_empty_rows(monkeypatch):
    fake_hub(monkeypatch, ["train", "test"])
    assert data.load_texts("hf:some/set", "calibration") == ["a", "b"]
    fake_hub(monkeypatch, ["train", "test"], columns=["content"])
    with pytest.raises(ValueError, match="dataset 'some/set' has no 'text' column"):
        data.load_texts("hf:some/set", "calibration")


def test_hf_evaluation_reads_test_else_validation_and_says_which(monkeypatch, caplog):
    """As lm-eval picks: the test split, else validation; a dataset with neither is named, not blamed
    on the network."""
    caplog.set_level("INFO", logger="qtk.data")
    loaded = fake_hub(monkeypatch, ["train", "validation", "test"])
    data.load_texts("hf:some/set", "evaluation")
    assert loaded == ["test"]
    loaded = fake_hub(monkeypatch, ["train", "validation"])
    data.load_texts("hf:some/set", "evaluation")
    assert loaded == ["validation"]
    assert "evaluation text: hf:some/set, split validation" in caplog.text
    fake_hub(monkeypatch, ["train"])
    with pytest.raises(ValueError) as e:
        data.load_texts("hf:some/set", "evaluation")
    assert str(e.value) == ("dataset 'some/set' has no test or validation split for evaluation (its splits: "
                            "['train']); choose another dataset or a local .txt/.jsonl file")


# --- perplexity ----------------------------------------------------------------------------

def test_eval_windows(tokenizer):
    w = eval_windows(tokenizer, seq_len=1000)
    assert w.shape == (29, 1000)  # 29731 evaluation tokens
    stream = data.token_stream(tokenizer, data.builtin_texts("evaluation"))
    assert torch.equal(w.flatten(), stream[:29000])
    assert eval_windows(tokenizer, seq_len=1000, limit=3).shape == (3, 1000)
    with pytest.raises(ValueError, match="fewer than one window of 40000; lower --seq-len"):
        eval_windows(tokenizer, seq_len=40000)


def test_perplexity_protocol_by_hand(tiny_llama):
    model = tiny_llama()
    windows = torch.randint(0, 256, (5, 33), generator=torch.Generator().manual_seed(4))
    res = perplexity(model, windows, batch_size=2, progress=False, dataset="random")
    nll = []
    per_window = []
    with torch.no_grad():
        for w in windows:  # one window at a time, token by token: -log p(w[t] | w[:t]) for t >= 1
            logp = torch.log_softmax(model(w[None]).logits[0].double(), dim=-1)
            nll += [-logp[t - 1, w[t]].item() for t in range(1, len(w))]
            per_window.append(sum(nll[-32:]))
    assert res.window_nll == pytest.approx(per_window, rel=1e-5)  # what the bootstrap resamples
    assert res.scored_tokens == len(nll) == 5 * 32
    assert (res.windows, res.seq_len, res.dataset) == (5, 33, "random")
    assert res.nll == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert 200 < res.ppl < 300  # a random model over 256 tokens is close to uniform
    assert perplexity(model, windows, batch_size=5, progress=False).ppl == pytest.approx(res.ppl, rel=1e-6)
    assert json.loads(json.dumps(res.to_dict()))["scored_tokens"] == 160
    assert str(res).startswith(f"ppl {res.ppl:.4f} on random (5 windows x 33 tokens, 160 scored)")


def test_increase_stderr_is_the_paired_bootstrap_over_windows():
    """other / base - 1 resampled by window, both models on the same draw: a constant ratio has no
    spread however different the windows are; disagreeing windows give the draws' spread."""
    import numpy as np

    from qtk.evals import bootstrap
    from qtk.evals.perplexity import PerplexityResult, increase_stderr

    def result(*nll):
        return PerplexityResult(math.exp(sum(nll) / (8 * len(nll))), sum(nll) / (8 * len(nll)), 8 * len(nll),
                                len(nll), 9, "t", nll)

    base = result(8.0, 16.0, 24.0, 12.0)
    assert increase_stderr(base, result(*(1.1 * v for v in base.window_nll))) > 0  # ratio of nll, not of ppl
    assert increase_stderr(base, result(*(v + 8 * 0.1 for v in base.window_nll))) == pytest.approx(0, abs=1e-12)
    other = result(9.0, 16.0, 30.0, 12.5)
    idx = bootstrap.draws(4, "ppl increase")
    b = np.exp(np.array(base.window_nll)[idx].sum(1) / 32)
    o = np.exp(np.array(other.window_nll)[idx].sum(1) / 32)
    assert increase_stderr(base, other) == pytest.approx((o / b - 1).std(ddof=1))
    with pytest.raises(ValueError, match="same windows"):
        increase_stderr(base, result(9.0))
