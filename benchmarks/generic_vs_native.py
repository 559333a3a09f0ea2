"""Decode throughput of the generic runtime path (transformers' modeling code with qtk's paged
attention, runtime/models/generic.py) against the native one (runtime/models/llama.py) on the
same Llama-family model, each built as the engine builds it (runtime.models.build).

    python benchmarks/generic_vs_native.py [--model smollm2-135m] [--batch 8] [--steps 32] [--threads 2]

A batch of `batch` sequences of `prompt_len` random tokens is prefilled in one step, then `steps`
steps of `batch` greedy decodes are timed (the median of `repeats` runs): tokens/s = batch * steps
/ seconds. Prints one JSON line per path ({"path", "model", "batch", "tokens_per_s", ...}).
`decode_tokens_per_s` is the function to call from elsewhere.
"""
from __future__ import annotations

import argparse
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
    runtime = build(hf_model, "transformers" if generic else "auto")
    vocab = hf_model.config.vocab_size
    _decode_seconds(runtime, vocab, batch, prompt_len, 2)  # warm-up: kernels, buffers
    seconds = statistics.median(_decode_seconds(runtime, vocab, batch, prompt_len, steps) for _ in range(repeats))
    return {"path": type(runtime).__name__, "model": model, "dtype": str(dtype).removeprefix("torch."),
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
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for generic in (False, True):
        print(json.dumps(decode_tokens_per_s(a.model, generic, a.batch, a.prompt_len, a.steps, a.repeats)))


if __name__ == "__main__":
    main()
