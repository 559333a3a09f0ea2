"""The benchmarks' bookkeeping, with fakes standing in for the engines: the same work and the same
threads for every engine, the same span timed, labels that say what ran (docs/benchmarks.md)."""
from __future__ import annotations

import asyncio
import importlib.util
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from qtk.errors import InputError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llamacpp_peer_times_the_prompt_and_every_output_token_after_a_warm_up(monkeypatch):
    """llama.cpp's batch-1 seconds cover the prompt's evaluation, as qtk's, vLLM's and transformers'
    do: N tokens are the prompt's forward and N - 1 decode steps, after one warm-up request, on the
    threads asked for (prompt batches included)."""
    calls = []

    class Llama:
        def __init__(self, path, n_ctx, n_threads, n_threads_batch=None, verbose=True):
            calls.append(("init", n_threads, n_threads_batch))

        def reset(self):
            calls.append(("reset",))

        def eval(self, tokens):
            calls.append(("eval", len(tokens)))
            time.sleep(0.05 if len(tokens) > 1 else 0.0)  # the prompt costs 50 ms, a decode step nothing

        def sample(self, top_k, temp):
            return 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    peer = load_script("llamacpp_peer")
    res = peer.run({"gguf": "x.gguf", "prompt": list(range(16)), "max_tokens": 4, "threads": 3})
    assert calls[0] == ("init", 3, 3) and res["threads"] == 3
    warm = calls.index(("reset",))
    assert calls[1:warm] == [("eval", 16), ("eval", 1)]  # a warm-up request before the timed one
    assert calls[warm + 1:] == [("eval", 16)] + [("eval", 1)] * 3
    assert res["tokens"] == 4 and res["seconds"] >= 0.05 and res["seconds"] == pytest.approx(
        res["prompt_s"] + res["decode_s"])


def test_vllm_peer_binds_its_workers_threads_to_the_count_asked_for(monkeypatch):
    """vLLM's CPU build binds its worker's OpenMP threads itself ("auto": all cores of a node but
    one, kept for its scheduler: 1 thread on a 2-core machine). With "threads" in the job it gets as
    many CPUs as qtk's torch threads; a binding set by the caller wins; the binding is recorded."""
    seen = []

    class LLM:
        def __init__(self, model, **kw):
            seen.append(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))

        def generate(self, prompts, params, use_tqdm=False):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * params.max_tokens)])
                    for _ in prompts]

    class SamplingParams:
        def __init__(self, max_tokens, **kw):
            self.max_tokens = max_tokens

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=lambda **kw: kw))
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):  # restored after the test
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    peer = load_script("vllm_peer")
    task = {"kind": "generate", "name": "t", "prompts": [[1, 2]], "max_tokens": 3}
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))

    out = peer.run({"model": "m", "threads": 2, "tasks": [task]})
    assert seen[-1] == cpus and out["omp_threads_bind"] == cpus and out["tasks"]["t"]["tokens"] == 3
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-5")
    assert peer.run({"model": "m", "threads": 2, "tasks": [task]})["omp_threads_bind"] == "0-5"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert peer.run({"model": "m", "tasks": [task]})["omp_threads_bind"] == "auto" and seen[-1] is None


def test_bench_engine_gives_every_peer_qtks_threads_and_labels_what_ran(monkeypatch, tmp_path):
    """`qtk bench engine` with every engine faked: vLLM and llama.cpp are told torch's thread count
    (what the JSON's "threads" says), llama.cpp's batch-1 rate is over the whole span it reports,
    and transformers' one-at-a-time row counts the requests it ran (fewer than --sequential here)."""
    from qtk import loading
    from qtk.bench import engine as bench
    from qtk.runtime import engine

    jobs = {}

    def run_peer(kind, script, job, timeout=1800):
        jobs[kind] = job
        if kind == "vllm":
            return {"startup_s": 9.0, "omp_threads_bind": "0", "tasks": {
                t["name"]: {"tokens": len(t["prompts"]) * t["max_tokens"], "seconds": 1.0} for t in job["tasks"]}}
        return {"tokens": job["max_tokens"], "seconds": 2.0, "prompt_s": 0.5, "decode_s": 1.5,
                "threads": job["threads"]}

    monkeypatch.setattr(engine, "LLM", lambda *a, **k: types.SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (None, types.SimpleNamespace(pad_token_id=0)))
    monkeypatch.setattr(loading, "resolve", lambda m: m)
    monkeypatch.setattr(bench, "token_prompts", lambda tok, spec, n: [[1, 2, 3]] * n)
    monkeypatch.setattr(bench, "text_prompt", lambda tok, n: list(range(n)))
    monkeypatch.setattr(bench, "qtk_generate", lambda llm, prompts, m: (len(prompts) * m, 1.0))
    monkeypatch.setattr(bench, "qtk_startup", lambda *a: 1.0)
    monkeypatch.setattr(bench, "hf_generate", lambda model, prompts, m, batch, pad: (len(prompts) * m, 1.0))
    monkeypatch.setattr(bench, "run_peer", run_peer)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e9)
    monkeypatch.setattr(bench, "roofline", lambda llm, model, r, context, bw: {
        **bench.limit_row(10**8, 10**6, r["tok_s"], bw), "kv_elements_per_token": 1000})
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"\0" * 10**6)
    res, text = bench.run("m", num_prompts=4, output_len=5, batch1_output_len=8, dtype="float32",
                          peers=("transformers", "vllm", "llama.cpp"), sequential=16, gguf=str(gguf),
                          out=tmp_path, name="t")
    threads = torch.get_num_threads()
    assert res["threads"] == threads and jobs["vllm"]["threads"] == threads and jobs["llamacpp"]["threads"] == threads
    e = res["engines"]
    assert e["llama.cpp"]["batch1"] == {"tokens": 8, "seconds": 2.0, "tok_s": 4.0}
    assert e["llama.cpp"]["threads"] == threads
    assert e["vllm"]["omp_threads_bind"] == "0"
    assert e["transformers"]["sequential"]["requests"] == 4 and e["transformers"]["sequential"]["tokens"] == 4 * 5
    assert json.loads((tmp_path / "t.json").read_text())["engines"] == e
    assert (res["prompts"], res["prompt_tokens"]) == ("builtin", 12)
    # the roofline: bytes per step over the bandwidth; llama.cpp's from its file and a float16 cache
    roof = res["roofline"]
    assert roof["qtk"]["limit_tok_s"] == round(1e9 / (10**8 + 10**6), 1)
    assert roof["llama.cpp"]["kv_bytes"] == 1000 * 2 * roof["context"] == 1000 * 2 * (128 + 4)
    assert roof["llama.cpp"]["fraction"] == round(4.0 / (1e9 / (10**6 + roof["llama.cpp"]["kv_bytes"])), 3)
    assert "batch-1 roofline" in text
    with pytest.raises(InputError, match="--prompts 'fixed:x': give builtin, fixed:N, random:LO-HI, conversation or edit"):
        bench.run("m", prompt_set="fixed:x", out=tmp_path)  # before the model loads


def test_prompt_sets_have_the_lengths_they_name(bundled_dir):
    """fixed:N and random:LO-HI: windows of the built-in text of N (LO..HI) tokens, seeded; the same
    windows sent to a server as one user message each; conversation: multi-turn chats with long
    histories ending in a question, through the chat template for the engine."""
    from qtk.bench import serve as bench_serve
    from qtk.bench.prompts import PromptSet, conversations, token_prompts
    from qtk.loading import load_tokenizer

    tok = load_tokenizer(bundled_dir)
    fixed = token_prompts(tok, PromptSet.parse("fixed:300"), 5)
    assert [len(p) for p in fixed] == [300] * 5 and len({tuple(p) for p in fixed}) == 5
    spread = [len(p) for p in token_prompts(tok, PromptSet.parse("random:100-900"), 32, seed=3)]
    assert min(spread) >= 100 and max(spread) <= 900 and max(spread) - min(spread) > 400
    assert spread == [len(p) for p in token_prompts(tok, PromptSet.parse("random:100-900"), 32, seed=3)]
    convs = conversations(tok, PromptSet.parse("conversation"), 16)
    assert all(len(c) >= 3 and c[-1]["role"] == "user" and c[-2]["role"] == "assistant" for c in convs)
    lengths = [len(p) for p in token_prompts(tok, PromptSet.parse("conversation"), 16)]
    assert min(lengths) > 100 and max(lengths) > 1000
    served = bench_serve.load_prompts("fixed:300", 5, str(bundled_dir))
    assert [c[0]["content"] for c in served] == [tok.decode(p) for p in fixed]
    assert bench_serve.load_prompts("builtin", 2)[0] == [{"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(InputError, match="--dataset 'random:9-3': lengths must be positive, LO <= HI"):
        bench_serve.load_prompts("random:9-3", 2)
    with pytest.raises(InputError, match="prompts of 99999 tokens: the built-in text has"):
        token_prompts(tok, PromptSet.parse("fixed:99999"), 1)


def test_bench_serve_sleeps_between_arrivals_not_after_the_last(monkeypatch):
    """Poisson arrivals: a gap between consecutive requests, none after the last one, which would
    only add idle time to the wall clock the throughput is divided by."""
    from qtk.bench import serve as bench_serve

    async def one_request(client, url, body):
        return bench_serve.Result(ok=True, ttft=0.01, e2e=0.02, tokens=body["max_tokens"])

    gaps, sleep = [], asyncio.sleep

    async def recording_sleep(delay, *a, **k):
        if delay > 0:  # an arrival gap (the event loop's own sleep(0)s are not)
            gaps.append(delay)
        await sleep(0)

    monkeypatch.setattr(bench_serve, "one_request", one_request)
    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    convs = bench_serve.load_prompts("builtin", 3)
    results, wall, _ = asyncio.run(bench_serve._run("http://127.0.0.1:9", "m", convs, 4, 5.0, None, None, 0))
    assert len(results) == 3 and len(gaps) == 2
    gaps.clear()
    asyncio.run(bench_serve._run("http://127.0.0.1:9", "m", convs, 4, float("inf"), None, None, 0))
    assert gaps == []


def test_bench_serve_times_a_reasoning_models_thought_and_tool_calls_as_tokens(monkeypatch):
    """A server with a reasoning parser streams the thought first (reasoning_content, vLLM's newer
    reasoning), then content, then a tool call: TTFT ends at the first of any of them and every
    chunk that carries one is an inter-token gap; the role-only chunk and the usage chunk are not."""
    import httpx

    from qtk.bench import serve as bench_serve

    now = [0.0]
    monkeypatch.setattr(bench_serve, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Let"}, {"reasoning": " me"},
              {"reasoning": " see", "reasoning_content": " see"}, {"content": "Yes"},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]

    async def stream():
        for i, delta in enumerate(deltas):
            now[0] = 0.1 * (i + 1)  # chunk i arrives at 0.1 (i + 1) s
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n".encode()
        now[0] = 1.0
        yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 5}})}\n\ndata: [DONE]\n\n".encode()

    async def measure():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream()))
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await bench_serve.one_request(client, "/v1/chat/completions", {})

    res = asyncio.run(measure())
    assert res.ok and res.tokens == 5
    assert res.ttft == pytest.approx(0.2) and res.e2e == pytest.approx(1.0)
    assert res.itl == pytest.approx([0.1] * 4)


def test_git_commit_says_when_the_tree_is_not_heads(tmp_path):
    """A result measured with uncommitted changes must not carry HEAD's hash alone."""
    from qtk.bench import git_commit

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
    assert git_commit(tmp_path / "nowhere") == "unknown"


def test_kernels_limit_fraction_is_against_the_peak_of_each_kernels_math(monkeypatch):
    """A weight-only kernel runs bf16 math, W8A8 int8 and FP8 their own (twice bf16's dense ops on
    an H100): at a compute-bound M each row's fraction of the limit is FLOPs / its math's peak, and a
    math whose peak is unknown gets no fraction (None, "-" in the table), never bf16's."""
    from qtk.bench import kernels_gpu as bench

    dense = torch.randn(64, 64)
    monkeypatch.setattr(bench, "cases", lambda n, k, dtype, device: [
        bench.Case(name, lambda x: x @ dense, 64 * 64, dense, math)
        for name, math in (("w4a16_g128", "bf16"), ("w8a8_int8", "int8"), ("fp8_triton", "fp8"))])
    monkeypatch.setattr(bench, "median_us", lambda fn, graph=False: 100.0)
    peaks = {"bf16": 1e12, "int8": 2e12}  # op/s; no fp8 peak here
    rows = bench.bench_shape("t", 64, 64, [4096], torch.float32, "cpu", hbm=1e18, peaks=peaks)
    fraction = {r.kernel: r.limit_fraction for r in rows}
    flops_us = 2 * 4096 * 64 * 64 * 1e6
    assert fraction["w4a16_g128"] == pytest.approx(flops_us / 1e12 / 100)
    assert fraction["w8a8_int8"] == pytest.approx(flops_us / 2e12 / 100)
    assert fraction["fp8_triton"] is None
    assert bench.table(rows).splitlines()[3].split()[8] == "-"  # the fp8 row's limit column
    with pytest.raises(ValueError, match="int4"):
        bench.matmul_peak("cpu", "int4")


def ppl_result(*window_ppl: float, seq_len: int = 9):
    """A PerplexityResult over len(window_ppl) windows, each window at its own perplexity."""
    from qtk.evals.perplexity import PerplexityResult

    nll = tuple((seq_len - 1) * math.log(p) for p in window_ppl)
    mean = sum(nll) / ((seq_len - 1) * len(nll))
    return PerplexityResult(math.exp(mean), mean, (seq_len - 1) * len(nll), len(nll), seq_len, "t", nll)


def test_compare_llmcompressor_records_the_cpu_it_ran_on(monkeypatch, tmp_path):
    """The JSON's device is the CPU's model name (platform.processor() is "x86_64" or empty on
    Linux) and its commit is the benchmarks' git_commit, with the same method rows as the table."""
    from qtk.bench import git_commit
    from qtk.device import cpu_name

    cmp = load_script("compare_llmcompressor")
    monkeypatch.setattr(cmp, "load_model", lambda *a, **k: (None, None))
    drawn = []
    monkeypatch.setattr(cmp, "calibration_samples",
                        lambda path, tok, c, device: drawn.append(c.dataset) or torch.zeros(2, 4, dtype=torch.long))
    monkeypatch.setattr(cmp, "eval_windows", lambda *a, **k: torch.zeros(3, 8, dtype=torch.long))
    monkeypatch.setattr(cmp, "perplexity", lambda *a, **k: ppl_result(10.0, 10.0, 10.0))
    monkeypatch.setattr(cmp, "run_qtk", lambda *a: 1.0)
    monkeypatch.setattr(cmp, "run_peer", lambda *a: 2.0)
    monkeypatch.setattr(cmp, "ppl_of", lambda path, *windows: [ppl_result(11.0, 11.0, 11.0), ppl_result(12.5, 12.5, 12.5)]
                        [:len([w for w in windows if w is not None])])
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("text unlike the calibration data\n")
    monkeypatch.setattr(sys, "argv", ["compare_llmcompressor.py", "--methods", "rtn", "--dtype", "float32",
                                      "--eval-seq-len", "8", "--work", str(tmp_path / "work"),
                                      "--out", str(tmp_path), "--heldout", str(heldout), "--dataset", "builtin+self"])
    cmp.main()
    assert drawn == ["builtin+self"]  # drawn once, both sides calibrate on the same ids
    rec = json.loads((tmp_path / "compare_llmcompressor.json").read_text())
    assert rec["device"] == cpu_name() and rec["git_commit"] == git_commit()
    assert rec["evaluation"]["scored_tokens"] == 3 * 7
    assert [r["method"] for r in rec["rows"]] == ["rtn"] and rec["rows"][0]["peer_seconds"] == 2.0
    assert rec["heldout"]["sha256"] == hashlib.sha256(heldout.read_bytes()).hexdigest()
    assert rec["rows"][0]["qtk_heldout_ppl"] == pytest.approx(12.5) == rec["rows"][0]["peer_heldout_ppl"]
    assert rec["calibration"]["dataset"] == "builtin+self"
    md = (tmp_path / "compare_llmcompressor.md").read_text()
    assert "| +25.0% ± 0.0 | +25.0% ± 0.0 |" in md and "(builtin+self, seed 0)" in md  # held-out vs 10.0


def test_quality_table_reuses_a_checkpoint_only_if_the_same_command_wrote_it(monkeypatch, tmp_path):
    """Each row is quantized as a user runs it (the recipe's own samples unless --num-samples): a kept
    checkpoint is reused only when the same command wrote it, not under a label it does not match."""
    qt = load_script("quality_table")
    runs = []
    monkeypatch.setattr(qt, "ROOT", tmp_path)
    monkeypatch.setattr(qt, "subprocess", types.SimpleNamespace(run=lambda cmd, check: runs.append(cmd)))
    out = tmp_path / "build" / "quality" / "gptq"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # a checkpoint nobody recorded the command of
    assert qt.quantize("gptq", ["--method", "gptq"], None, False) == out and len(runs) == 1
    assert "--num-samples" not in runs[0]  # the recipe's own count, as `qtk quantize` runs it
    assert qt.quantize("gptq", ["--method", "gptq"], None, False) == out and len(runs) == 1  # reused
    assert qt.quantize("gptq", ["--method", "gptq"], 64, False) == out and len(runs) == 2  # another command
    assert runs[1][runs[1].index("--num-samples") + 1] == "64"
    assert qt.quantize("gptq", ["--method", "gptq"], 64, True) == out and len(runs) == 3  # --requantize


def test_cpu_core_peak_compiles_runs_and_records_every_figure(tmp_path, capsys, monkeypatch):
    """benchmarks/cpu_core_peak.py: its micro-kernels build with g++ and each gives a positive rate into the JSON;
    without g++ it says what to install and exits 2."""
    import shutil

    import torch

    peak = load_script("cpu_core_peak")
    if shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs g++ and an AVX2 CPU")
    monkeypatch.setattr("sys.argv", ["cpu_core_peak.py", "--reps", "200", "--out", str(tmp_path)])
    assert peak.main() == 0
    (written,) = tmp_path.glob("cpu-core-peak-*.json")
    figures = json.loads(written.read_text())
    assert all(figures[k] > 0 for k in ("fma_registers", "fma_6x16_tile", "attention_tiles", "int8_maddubs_6x16"))
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "g++" else real_which(name))
    assert peak.main() == 2 and "needs g++" in capsys.readouterr().err


def test_calibration_data_records_each_dataset_on_both_texts(monkeypatch, tmp_path):
    """benchmarks/calibration_data.py: one row per calibration dataset, each scored on the built-in
    evaluation windows and the held-out file (its sha256 recorded), as increases over the baseline."""
    cd = load_script("calibration_data")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("text unlike the calibration data\n")
    models = iter([None, "builtin", "self"])
    monkeypatch.setattr(cd, "load_model", lambda path, *a, **k: (next(models), None))
    monkeypatch.setattr(cd, "eval_windows", lambda tok, dataset, *a: dataset)
    ppl = {(None, "builtin"): ppl_result(10.0, 10.0), (None, str(heldout)): ppl_result(20.0, 20.0),
           ("builtin", "builtin"): ppl_result(11.0, 11.0), ("builtin", str(heldout)): ppl_result(25.0, 25.0),
           ("self", "builtin"): ppl_result(11.5, 11.5), ("self", str(heldout)): ppl_result(21.0, 25.0)}
    monkeypatch.setattr(cd, "perplexity", lambda model, w, **k: ppl[(model, w)])
    seen = []
    monkeypatch.setattr(cd.pipeline, "quantize", lambda model, recipe, out, **k: seen.append(recipe.calibration.dataset)
                        or {"calibration_samples": recipe.calibration.num_samples, "total_seconds": 1.0})
    monkeypatch.setattr(sys, "argv", ["calibration_data.py", "--heldout", str(heldout), "--datasets", "builtin,self",
                                      "--work", str(tmp_path / "w"), "--out", str(tmp_path)])
    cd.main()
    rec = json.loads((tmp_path / "calibration-data-smollm2-135m.json").read_text())
    assert seen == ["builtin", "self"] and rec["heldout"]["sha256"] == hashlib.sha256(heldout.read_bytes()).hexdigest()
    held = 100 * (math.sqrt(21 * 25) / 20 - 1)  # the geometric mean of its windows' perplexities
    assert [r["increase_pct"] for r in rec["rows"]] == [pytest.approx({"builtin": 10.0, "heldout": 25.0}),
                                                        pytest.approx({"builtin": 15.0, "heldout": held})]
    se = rec["rows"][1]["increase_se_pct"]  # windows that disagree: a spread; windows that agree: none
    assert se["builtin"] == pytest.approx(0, abs=1e-9) and 0 < se["heldout"] < 100 * (25 / 21 - 1) / 2
    assert f"+{held:.1f}% ± {se['heldout']:.1f}" in (tmp_path / "calibration-data-smollm2-135m.md").read_text()
    assert rec["rows"][0]["samples"] == 128  # the default recipe's


def test_calibration_data_scores_written_checkpoints_without_quantizing(monkeypatch, tmp_path):
    """--checkpoints: each checkpoint scored as it is, its row named by its recipe's calibration text
    and seed; nothing is quantized."""
    cd = load_script("calibration_data")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("text unlike the calibration data\n")
    dirs = []
    for name, dataset, seed in [("a", "builtin+self", 0), ("b", "builtin+self+instruct", 1)]:
        d = tmp_path / name
        d.mkdir()
        (d / "recipe.yaml").write_text(f"method: gptq\ncalibration:\n  dataset: {dataset}\n  seed: {seed}\n")
        (d / "qtk_report.json").write_text(json.dumps({"calibration_samples": 128}))
        dirs.append(str(d))
    loaded = []
    monkeypatch.setattr(cd, "load_model", lambda path, *a, **k: (loaded.append(path) or path, None))
    monkeypatch.setattr(cd, "eval_windows", lambda tok, dataset, *a: dataset)
    monkeypatch.setattr(cd, "perplexity", lambda model, w, **k: ppl_result(11.0, 11.0) if str(model).endswith("/b")
                        else ppl_result(10.0, 10.0))
    monkeypatch.setattr(cd.pipeline, "quantize", lambda *a, **k: pytest.fail("--checkpoints quantized"))
    monkeypatch.setattr(sys, "argv", ["calibration_data.py", "--heldout", str(heldout), "--checkpoints", ",".join(dirs),
                                      "--out", str(tmp_path), "--name", "scored"])
    cd.main()
    rec = json.loads((tmp_path / "scored.json").read_text())
    assert loaded == [cd.BUNDLED, *dirs]
    assert [r["dataset"] for r in rec["rows"]] == ["builtin+self (seed 0)", "builtin+self+instruct (seed 1)"]
    assert rec["rows"][1]["increase_pct"] == pytest.approx({"builtin": 10.0, "heldout": 10.0})
    assert "| builtin+self+instruct (seed 1) | 128 |" in (tmp_path / "scored.md").read_text()

def test_step_bytes_count_each_weight_once_and_speculative_runs_compare_to_plain(tiny_dir):
    """The roofline's bytes: every tensor of the checkpoint once (float ones at the step's width, a
    tied embedding as the output layer); the speculative section: plain and speculative decoding on
    the same requests, identical text, the acceptance measured."""
    from qtk.bench import engine as bench
    from qtk.loading import load_model

    model, _ = load_model(str(tiny_dir))
    numel = sum(p.numel() for p in model.parameters())  # tied: the embedding is counted once
    assert bench.checkpoint_step_bytes(tiny_dir, 4) == 4 * numel
    assert bench.checkpoint_step_bytes(tiny_dir, 2) == 2 * numel
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [5, 6, 5, 6, 5, 6]]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    runs = bench.speculative(str(tiny_dir), "float32", {"kv_cache_memory": 2**22, "max_model_len": 128},
                             [config], prompts, 24, batches=(1, 2), rounds=1)
    assert [r["config"] for r in runs] == [config] and set(runs[0]["batches"]) == {"1", "2"}
    for r in runs[0]["batches"].values():
        assert r["identical"] and r["plain"]["tokens"] == r["speculative"]["tokens"] > 0
        assert 0 <= r["acceptance_rate"] <= 1 and r["mean_accepted_length"] >= 1
    one, two = runs[0]["batches"]["1"], runs[0]["batches"]["2"]
    assert one["plain"]["tokens"] == two["plain"]["tokens"]  # both prompts at each batch size: batch 1 in turn
