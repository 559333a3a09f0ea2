"""Batch-1 greedy decode with one of the runtime's CPU decode-step choices on and off, alternated in one
process (VMs drift: a ratio within one run is what holds), the same tokens checked.

    python benchmarks/batch1_decode_ab.py MODEL one-call     # DecodeLayers (csrc/cpu_decode.cpp) vs op by op
    python benchmarks/batch1_decode_ab.py MODEL huge-pages   # kernel weights on 2 MB pages vs 4 KB pages
    python benchmarks/batch1_decode_ab.py MODEL int4-vnni    # the int4 gemv on VNNI (x in int8 limbs) vs float32

MODEL: a qtk checkpoint dir or a name qtk resolves (smollm2-135m: the float32 model). Prints the median
tok/s of each over --rounds rounds of --tokens tokens (EOS ignored).
"""
from __future__ import annotations

import argparse
import statistics
import time

from qtk import LLM
from qtk.kernels import cpu
from qtk.runtime.models.native import NativeModel
from qtk.runtime.sampling_params import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("choice", choices=["one-call", "huge-pages", "int4-vnni"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    if args.choice == "one-call":  # one engine, the step's path switched between runs
        llm = LLM(args.model, dtype="float32")
        one_call = NativeModel._decode_rows

        def op_by_op(self, caches):
            return 0

        runs = {"one call": (llm, one_call), "op by op": (llm, op_by_op)}
    elif args.choice == "int4-vnni":  # one engine, the kernel build's switch flipped between runs
        llm = LLM(args.model, dtype="float32")
        lib = cpu.ops()
        if lib is None or lib.int4_limb_rows() == 0:
            raise SystemExit("this CPU's kernel build has no int4 gemv on VNNI (the avx512 build; QTK_CPU_VNNI unset)")
        runs = {"VNNI limbs": (llm, lambda: lib.set_int4_limb_rows(-1)),
                "float32": (llm, lambda: lib.set_int4_limb_rows(0))}
    else:  # two engines: the second's weights left where packing put them
        on = LLM(args.model, dtype="float32")
        moved = cpu.onto_huge_pages
        cpu.onto_huge_pages = lambda tensors: 0
        off = LLM(args.model, dtype="float32")
        cpu.onto_huge_pages = moved
        runs = {"2 MB pages": (on, None), "4 KB pages": (off, None)}
    rates = {name: [] for name in runs}
    tokens = {}
    for _ in range(args.rounds):
        for name, (llm, choose) in runs.items():
            if args.choice == "one-call":
                NativeModel._decode_rows = choose
            elif choose is not None:
                choose()
            t = time.perf_counter()
            out = llm.generate([PROMPT], params)
            rates[name].append(args.tokens / (time.perf_counter() - t))
            tokens[name] = out[0].outputs[0].token_ids
    for name, r in rates.items():
        print(f"{name}: {statistics.median(r):.1f} tok/s median ({', '.join(f'{x:.1f}' for x in r)})")
    print("same tokens:", len({tuple(t) for t in tokens.values()}) == 1)


if __name__ == "__main__":
    main()
