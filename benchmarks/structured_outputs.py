"""What structured outputs cost per decode step: the sampler's time for a batch of B rows with 0,
B/2 or all B rows under a JSON-schema grammar (mask fill, bias, choice, token consumption),
against the model step the engine runs for the same batch. The matchers sit mid-document: each
has consumed the first tokens of a valid answer to its schema, as in a real decode.

    python benchmarks/structured_outputs.py [--model smollm2-135m] [--repeats 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qtk import LLM
from qtk.evals.json_validity import load_prompts
from qtk.runtime.sampling_params import SamplingParams
from qtk.runtime.sequence import Sequence
from qtk.runtime.structured_outputs import StructuredOutputsParams


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32")
    schemas = [p["schema"] for p in load_prompts()]
    V = llm.model.embed_tokens.weight.shape[0]
    prefix = llm.tokenizer('{"name":"Ann', add_special_tokens=False).input_ids[:2]  # '{"' then a key start
    rows = []
    for batch in (1, 16, 64):
        logits = torch.randn(batch, V)
        for guided in sorted({0, batch // 2, batch}):
            def fresh():
                seqs = []
                for i in range(batch):
                    s = Sequence([1, 2, 3], SamplingParams(temperature=0))
                    if i < guided:
                        s.grammar = llm.grammars.matcher(StructuredOutputsParams(json=schemas[i % len(schemas)]))
                        s.grammar.consume_tokens(prefix[:1])  # '{' (every schema here is an object)
                    seqs.append(s)
                return seqs

            seqs = fresh()

            def step():  # the sampler's work for one step; the matchers are rolled back after it
                llm.sampler(logits, seqs)
                for s in seqs[:guided]:
                    s.grammar.rollback(1)

            rows.append({"batch": batch, "grammar_rows": guided, "sampler_ms": timed(step, args.repeats) * 1e3})
        llm.generate([[1] * 32] * batch, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm
        t = time.perf_counter()
        llm.generate([[1] * 32] * batch, SamplingParams(max_tokens=17, temperature=0, ignore_eos=True))
        decode_ms = (time.perf_counter() - t) / 17 * 1e3  # prefill amortized: an upper bound on a step
        for r in rows:
            if r["batch"] == batch:
                r["engine_step_ms"] = decode_ms
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
