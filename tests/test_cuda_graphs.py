"""The decode step's CUDA graphs (qtk.runtime.cuda_graphs).

Without a GPU the graphs' buffer logic runs with an eager stand-in for the capture: the same step
function over the same static buffers, replayed by calling it, with the Triton kernels in the
exact interpreter. The graph runner must then give the eager runner's logits and leave exactly
the eager runner's KV cache (a padding row that kept a slot of an earlier step would overwrite a
sequence's K/V). With a GPU (marked gpu), the real capture: the engine's greedy tokens with graphs
equal those with enforce_eager.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qtk.runtime.block_manager import BlockManager
from qtk.runtime.cuda_graphs import capture_sizes
from qtk.runtime.model_runner import ModelRunner
from qtk.runtime.models.native import NativeModel
from qtk.runtime.scheduler import Scheduler, SchedulerConfig
from qtk.runtime.sequence import Sequence

triton = pytest.importorskip("triton")

from test_kernels_interp import exact_interpretation  # noqa: E402
from test_paged_attention_triton import kv_scales  # noqa: E402
from test_runtime import hf_model  # noqa: E402


def test_capture_sizes_are_vllms_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(1024)[-1] == 512


class EagerRecord:
    """cuda_record's stand-in: 'capturing' keeps the step; a replay runs it on the static buffers."""

    def __init__(self):
        self.replays = 0

    def __call__(self, step, pool):
        def replay():
            self.replays += 1
            step()
        return replay, pool


def run_steps(runner, prompts, steps, num_blocks, bs, finish_after):
    """Greedy-free stepping (fixed next tokens) -> logits per step; sequence i stops after
    finish_after[i] sampled tokens, so the batch shrinks within one captured size."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(num_blocks, bs))
    seqs = [Sequence(p, block_size=bs) for p in prompts]
    for s in seqs:
        sched.add(s)
    rows = []
    for _ in range(steps):
        batch = sched.schedule()
        if not batch.seqs:
            break
        out, _ = runner.run(batch)
        rows.append(out)
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        sched.finish_step(batch, {s.seq_id: 7 + seqs.index(s) for s in sampling})
        for s in sampling:
            if s.num_generated_tokens >= finish_after[seqs.index(s)]:
                sched.finish(s)
    return rows


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_graph_steps_give_the_eager_logits_and_cache(kv_dtype):
    model = NativeModel(hf_model("llama"))
    num_blocks, bs = 32, 4
    scales = kv_scales(model, kv_dtype)
    eager = ModelRunner(model, num_blocks, bs, kv_dtype, scales, attention_backend="triton")
    graphed = ModelRunner(model, num_blocks, bs, kv_dtype, scales, attention_backend="triton")
    record = EagerRecord()
    # 5 sequences decode in the size-8 graph, then 4, 3 (rows 3..7 were real a step before), then 2
    prompts = [list(range(10, 17)), list(range(50, 53)), list(range(90, 95)), [5, 6], list(range(30, 39))]
    finish_after = [6, 3, 5, 2, 4]
    with exact_interpretation():
        assert graphed.capture_graphs(max_num_seqs=8, max_model_len=40, record=record) is None
        assert sorted(graphed.graphs.replays) == [1, 2, 4, 8]
        ref = run_steps(eager, prompts, 8, num_blocks, bs, finish_after)
        got = run_steps(graphed, prompts, 8, num_blocks, bs, finish_after)
    assert record.replays >= 5  # the decode steps went through the graphs
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for a, b in zip(eager.kv_caches, graphed.kv_caches):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            if kv_dtype is None:
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
            else:  # codes: a rounding tie may move one step
                assert (y.float() - x.float()).abs().max() <= 1


def test_graphs_are_not_captured_where_they_cannot_replay():
    cpu = ModelRunner(NativeModel(hf_model("llama")), 8, 4, attention_backend="torch")
    assert "attention backend" in cpu.capture_graphs(4, 16, record=EagerRecord())
    windowed = hf_model("mistral", sliding_window=8)
    runner = ModelRunner(NativeModel(windowed), 8, 4, attention_backend="triton")
    assert "sliding window 8 < max_model_len 16" in runner.capture_graphs(4, 16, record=EagerRecord())
    assert cpu.graphs is None and runner.graphs is None
    # RoPE frequencies are fixed at load for every scaling type: dynamic and longrope are captured too
    dynamic = hf_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    runner = ModelRunner(NativeModel(dynamic), 8, 4, attention_backend="triton")
    assert runner.capture_graphs(4, 16, record=EagerRecord()) is None and runner.graphs is not None


def test_a_failed_capture_leaves_an_eager_engine(tiny_dir, caplog, monkeypatch):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32")
    expected = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids

    def broken(*args, **kwargs):
        llm.runner.graphs = object()  # half-built when it failed
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(llm.runner, "capture_graphs", broken)
    assert llm.runner.try_capture_graphs(8, llm.max_model_len) == "off: the capture failed"
    assert llm.runner.graphs is None and "runs eagerly" in caplog.text
    assert llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids == expected


def gpu_engine():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"
    spec = importlib.util.spec_from_file_location("gpu_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_with_cuda_graphs_gives_the_eager_tokens(tmp_path):
    """Greedy tokens of a tiny random bf16 Llama (no download: gpu_engine's word-level tokenizer),
    with graphs and eagerly, for batches that pad (3 of a size-4 graph) and shrink as requests end."""
    from qtk import LLM, SamplingParams

    path = gpu_engine().build_model("tiny", tmp_path / "tiny", "cuda")
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 117))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 9, 16)]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=eager)
        assert (llm.runner.graphs is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


@pytest.mark.slow
def test_the_gpu_engine_benchmark_runs_every_part_on_a_tiny_model(tmp_path):
    """benchmarks/gpu_engine.py end to end on the CPU (its figures mean nothing there): the parts
    it records hold what they say."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"
    subprocess.run([sys.executable, str(script), "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    res = json.loads((tmp_path / "gpu_engine-tiny.json").read_text())
    assert set(res["batch1"]) == {"bf16-eager", "w4a16-eager"}
    assert all(r["steps"] == 16 and r["tpot_ms"] > 0 for r in res["batch1"].values())
    assert res["batch1"]["w4a16-eager"]["step_bytes"] < res["batch1"]["bf16-eager"]["step_bytes"] / 2.5
    assert res["kv_tokens"]["fp8"] == 2 * res["kv_tokens"]["bf16"]
    requests = gpu_engine().offline_requests(8, 1024)
    assert res["offline_qtk"]["tokens"] == res["offline_hf"]["tokens"] == sum(o // 20 for _, o in requests)
