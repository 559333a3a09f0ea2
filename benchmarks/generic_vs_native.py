"""Decode throughput of the generic runtime path (transformers' modeling code with qtk's paged
attention, runtime/models/generic.py) against the native one (runtime/models/native.py) on the
same model, each built as the engine builds it (runtime.models.build).

    python benchmarks/generic_vs_native.py [--model smollm2-135m] [--batch 8] [--steps 32] [--threads 2]
    python benchmarks/generic_vs_native.py --zoo [--out benchmarks/results]
        # every type of tests/zoo.py (tiny random models): the generic path, and the native one
        # where the type has one; recorded as --name .json
    python benchmarks/generic_vs_native.py --zoo --types gemma3_text,phi3 --sized --method rtn
        # those types at the bundled model's sizes (SIZED: 8 of its 30 layers), W4A16 RTN
        # checkpoints (group 64: 576 is no multiple of 128) read back by qtk's loader, as `qtk serve` runs them

A batch of `batch` sequences of `prompt_len` random tokens is prefilled in one step, then `steps`
steps of `batch` greedy decodes are timed (the median of `repeats` runs): tokens/s = batch * steps
/ seconds. Prints one JSON line per path ({"path", "model", "batch", "tokens_per_s", ...}).
`decode_tokens_per_s` is the function to call from elsewhere.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from qtk.loading import load_model
from qtk.runtime.block_manager import BlockManager
from qtk.runtime.model_runner import ModelRunner
from qtk.runtime.models import build
from qtk.runtime.scheduler import Scheduler, SchedulerConfig
from qtk.runtime.sequence import Sequence

# the bundled model's (SmolLM2-135M) sizes, 8 of its 30 layers: matmuls of a real model's shape
SIZED = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             num_hidden_layers=8, moe_intermediate_size=512, intermediate_size_mlp=1536)


def _decode_seconds(runtime, vocab: int, batch: int, prompt_len: int, steps: int, block_size: int = 16) -> float:
    """Seconds for `steps` decode steps of `batch` sequences after their prompts' prefill."""
    num_blocks = batch * (-(-(prompt_len + steps + 1) // block_size))
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len),
                      BlockManager(num_blocks, block_size, enable_prefix_caching=False))
    runner = ModelRunner(runtime, num_blocks, block_size)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        sched.add(Sequence(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), block_size=block_size))

    def step():
        b = sched.schedule()
        logits, _ = runner.run(b)
        sampling = [s for i, s in enumerate(b.seqs) if b.samples(i)]
        sched.finish_step(b, {s.seq_id: int(row.argmax()) for s, row in zip(sampling, logits)})

    step()  # the prefill
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - t0


def decode_tokens_per_s(model: str = "smollm2-135m", generic: bool = False, batch: int = 8, prompt_len: int = 32,
                        steps: int = 32, repeats: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """Decode tokens/s of `model` on the generic or the native path (CPU, as the engine builds it)."""
    hf_model, _ = load_model(model, dtype=dtype)
    return {"model": model, **model_tokens_per_s(hf_model, generic, batch, prompt_len, steps, repeats)}


def model_tokens_per_s(hf_model, generic: bool = False, batch: int = 8, prompt_len: int = 32, steps: int = 32,
                       repeats: int = 3) -> dict:
    """decode_tokens_per_s of a loaded model (which the build packs: give each path its own copy)."""
    dtype = hf_model.get_input_embeddings().weight.dtype
    runtime = build(hf_model, "transformers" if generic else "auto")
    vocab = hf_model.config.vocab_size
    _decode_seconds(runtime, vocab, batch, prompt_len, 2)  # warm-up: kernels, buffers
    seconds = statistics.median(_decode_seconds(runtime, vocab, batch, prompt_len, steps) for _ in range(repeats))
    return {"path": type(runtime).__name__, "dtype": str(dtype).removeprefix("torch."),
            "batch": batch, "prompt_len": prompt_len, "steps": steps, "threads": torch.get_num_threads(),
            "tokens_per_s": round(batch * steps / seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--zoo", action="store_true", help="Every type of tests/zoo.py instead of --model.")
    p.add_argument("--out", default="benchmarks/results", help="Where --zoo records its JSON.")
    p.add_argument("--name", default="generic_vs_native-zoo", help="--zoo's JSON file name (add the CPU and date).")
    p.add_argument("--types", default=None, help="--zoo: these types only (comma-separated).")
    p.add_argument("--sized", action="store_true", help="--zoo: at SIZED (the bundled model's sizes), not tiny.")
    p.add_argument("--method", choices=["none", "rtn"], default="none",
                   help="--zoo: float32 weights, or a W4A16 RTN checkpoint (group 64) loaded by qtk.")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.zoo:
        return zoo(a)
    for generic in (False, True):
        print(json.dumps(decode_tokens_per_s(a.model, generic, a.batch, a.prompt_len, a.steps, a.repeats)))


def zoo(a) -> None:
    """Per zoo type, the generic path's decode tokens/s and the native path's where there is one."""
    import sys
    from pathlib import Path

    from qtk.bench.engine import record
    from qtk.runtime.models import is_native

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zoo import ZOO, tiny

    sizes = SIZED if a.sized else {}
    rows = {}
    for model_type in a.types.split(",") if a.types else sorted(ZOO):
        make = functools.partial(_model, tiny, model_type, sizes, a.method)
        paths = (False, True) if is_native(tiny(model_type)) else (True,)
        rows[model_type] = {("generic" if g else "native"): model_tokens_per_s(make(), g, a.batch, a.prompt_len,
                                                                             a.steps, a.repeats)["tokens_per_s"]
                            for g in paths}
        print(model_type, json.dumps(rows[model_type]), flush=True)
    models = (f"tests/zoo.py at {sizes}" if sizes else "tests/zoo.py (2 layers, hidden 64)") + (
        ", W4A16 RTN group 64 checkpoints" if a.method == "rtn" else ", float32")
    record({"models": models, "batch": a.batch, "prompt_len": a.prompt_len,
            "steps": a.steps, "threads": torch.get_num_threads(), "decode_tokens_per_s": rows}, a.out,
           a.name, " ".join(["python", *sys.argv]))


def _model(tiny, model_type: str, sizes: dict, method: str):
    """The zoo model at `sizes`: float32, or its W4A16 RTN checkpoint loaded as qtk serves it."""
    import tempfile
    from pathlib import Path

    from zoo import ZOO, saved

    from qtk import pipeline
    from qtk.recipe import from_flags

    types = ZOO[model_type].get("layer_types")
    if sizes and types:  # the zoo's per-layer pattern, repeated over the layers
        n = sizes["num_hidden_layers"]
        sizes = {**sizes, "layer_types": (types * n)[:n]}
    model = tiny(model_type, **sizes)
    if method == "none":
        return model
    with tempfile.TemporaryDirectory() as d:
        src = saved(model, Path(d) / "src")
        pipeline.quantize(src, from_flags("rtn", group_size=64), Path(d) / "q", dtype=torch.float32, progress=False)
        return load_model(str(Path(d) / "q"))[0]


if __name__ == "__main__":
    main()
