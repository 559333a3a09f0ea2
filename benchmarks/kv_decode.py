"""Batched decode over a long context by KV-cache dtype, for a change's before and after: run it from
each checkout (the qtk of the current directory is imported), one after the other on an idle machine.

    cd CHECKOUT && python benchmarks/kv_decode.py [--context 1024] [--seqs 16] [--kv auto,int8,fp8]

For each KV-cache dtype: the bundled model (float32 runtime, prefix caching off), SEQS prompts of
CONTEXT random tokens prefilled, then STEPS greedy decode steps of all SEQS sequences timed; prints and
returns one JSON line per dtype: ms per step and, of it, ms in the layers' paged attention (the
runtime's attention call, its cache store included). An INT8 / FP8 cache without calibrated scales
measures them on built-in text at load, as `qtk serve --kv-cache-dtype` does."""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from qtk import LLM, SamplingParams  # noqa: E402
from qtk.bench.prompts import PromptSet, token_prompts  # noqa: E402
from qtk.device import cpu_name  # noqa: E402
import qtk.runtime.models.native as native  # noqa: E402


def decode_step(kv: str, context: int, seqs: int, steps: int) -> dict:
    engine = LLM("smollm2-135m", dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False, max_num_seqs=seqs)
    params = SamplingParams(max_tokens=steps + 256, temperature=0.0, ignore_eos=True)  # none ends while timed
    for p in token_prompts(engine.tokenizer, PromptSet.parse(f"fixed:{context}"), seqs):
        engine.add_request(p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # the prompts' prefill chunks
    for _ in range(3):
        engine.step()
    spent = [0.0]
    attend = native.paged_attention

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = attend(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    native.paged_attention = timed
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    finally:
        native.paged_attention = attend
    return {"kv_cache_dtype": kv, "step_ms": round(1000 * wall / steps, 1), "attention_ms": round(1000 * spent[0] / steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--seqs", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed")
    ap.add_argument("--kv", default="auto,bfloat16,int8,fp8", help="KV-cache dtypes, comma-separated")
    args = ap.parse_args()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    for kv in args.kv.split(","):
        row = decode_step(kv, args.context, args.seqs, args.steps)
        row.update(tree=os.getcwd(), commit=commit, context=args.context, seqs=args.seqs, cpu=cpu_name(),
                   capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                   date=datetime.date.today().isoformat())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
