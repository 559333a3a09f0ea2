"""vLLM serves what qtk writes: vLLM's CPU build (its own venv) loads qtk's checkpoints of the
bundled model and agrees with qtk's runtime on the same windows and prompts.

    python benchmarks/vllm_referee.py [--out benchmarks/results]   # quantizes, runs both, records
    python benchmarks/vllm_referee.py --dtype bfloat16 --schemes float,w4a16,w4a16_asym
        # vLLM's CPU W4A16 kernel takes bf16 only (AVX-512 CPUs): both engines in bf16

Per checkpoint (w4a16 sym and asym, w8a8, fp8; the float weights as the control):
    perplexity  both engines score the same windows by prompt logprobs; vLLM's within 1% of qtk's
    greedy      chat prompts, 32 tokens, top-5 logprobs: equal tokens, or a near-tie where they part
                (vLLM's check_logprobs_close: each side's token among the other's top 5), and the
                comparison of that prompt stops there
    schemes     the scheme vLLM's own parser gives each layer it builds (fused qkv_proj, gate_up_proj
                included) is the one its shards were written in (benchmarks/vllm_schemes.py): checked
                even where vLLM has no kernel for the checkpoint
Where vLLM refuses a scheme (its CPU W4A16 kernel exists only for AVX-512 CPUs: "no attribute
cpu_gemm_wna16"; its CPU build has no 8-bit weight-only kernel at all: "uint8b128 not supported"),
its own reason is recorded instead. tests/test_vllm_referee.py runs this.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMES = {  # name -> qtk quantize arguments (RTN / plain FP8: the formats are under test, not the methods)
    "w4a16": ["--method", "rtn", "--scheme", "w4a16"],
    "w4a16_asym": ["--method", "rtn", "--scheme", "w4a16_asym"],
    # the default recipe's mixed precision: the most sensitive layers kept at w8a16 beside w4a16_asym,
    # one checkpoint with two config groups
    "mixed": ["--method", "rtn", "--scheme", "w4a16_asym", "--max-bits", "4.75"],
    "w8a8": ["--method", "rtn", "--scheme", "w8a8"],
    "fp8": ["--method", "fp8", "--scheme", "fp8"],
}
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves falling.",
             "Explain in one sentence why the sky is blue, for a child.", "List three uses of a paperclip.",
             "Who wrote Romeo and Juliet?", "What does a CPU do?", "What is photosynthesis?",
             "Why do leaves change color in the fall?"]
NEW_TOKENS, TOP = 32, 5


def close_until_parting(ours: list[dict], theirs: list[dict], ours_ids: list[int], theirs_ids: list[int]) -> dict:
    """check_logprobs_close over one prompt: tokens agreed before they part, and whether the
    parting is a near-tie."""
    for i, (a, b) in enumerate(zip(ours_ids, theirs_ids)):
        if a != b:
            return {"agreed": i, "near_tie": b in ours[i] and a in theirs[i]}
    return {"agreed": min(len(ours_ids), len(theirs_ids)), "near_tie": True}


def referee(model: Path, windows: list[list[int]], prompts: list[list[int]], dtype: str = "float32") -> dict:
    from qtk import LLM, SamplingParams
    from qtk.evals.perplexity import engine_perplexity
    from qtk.bench.engine import run_peer

    import torch

    job = {"model": str(model), "dtype": dtype, "max_model_len": 2048, "enforce_eager": True, "tasks": [
        {"kind": "ppl", "name": "ppl", "windows": windows},
        {"kind": "generate", "name": "greedy", "prompts": prompts, "max_tokens": NEW_TOKENS, "logprobs": TOP}]}
    schemes = run_peer("vllm", "vllm_schemes.py", {"model": str(model)})  # vLLM's parser, no kernel needed
    mismatched = schemes.get("mismatched", schemes.get("error"))
    theirs = run_peer("vllm", "vllm_peer.py", job)
    if "error" in theirs:
        return {"vllm_refused": theirs["error"], "vllm_scheme_mismatches": mismatched}
    llm = LLM(str(model), dtype=dtype, max_model_len=2048)
    ours_ppl = engine_perplexity(llm, torch.tensor(windows), batch_size=len(windows), progress=False).ppl
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0,
                                                logprobs=TOP))
    greedy = theirs["tasks"]["greedy"]
    per_prompt = [close_until_parting(o.outputs[0].logprobs,
                                      [{int(t): lp for t, lp in step.items()} for step in their_lp],
                                      o.outputs[0].token_ids, their_ids)
                  for o, their_ids, their_lp in zip(outs, greedy["token_ids"], greedy["logprobs"])]
    return {"qtk_ppl": ours_ppl, "vllm_ppl": theirs["tasks"]["ppl"]["ppl"],
            "ppl_rel_diff": abs(theirs["tasks"]["ppl"]["ppl"] / ours_ppl - 1),
            "greedy": per_prompt, "exact_prompts": sum(p["agreed"] == NEW_TOKENS for p in per_prompt),
            "vllm_scheme_mismatches": mismatched,
            "vllm_startup_s": theirs["startup_s"]}


def inputs(tokenizer, num_windows: int = 4, seq_len: int = 1024) -> tuple[list[list[int]], list[list[int]]]:
    from qtk.chat_template import prompt_ids
    from qtk.evals.perplexity import eval_windows

    windows = eval_windows(tokenizer, "builtin", seq_len, num_windows).tolist()
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return windows, prompts


def quantize_all(root: Path, source: Path, names: list[str] | None = None) -> dict[str, Path]:
    from click.testing import CliRunner

    from qtk.cli import main

    names = names or ["float", *SCHEMES]
    dirs = {"float": source} if "float" in names else {}
    for name, args in SCHEMES.items():
        if name not in names:
            continue
        out = root / name
        if not (out / "config.json").is_file():
            r = CliRunner().invoke(main, ["quantize", str(source), *args, "-o", str(out)])
            if r.exit_code != 0:
                raise RuntimeError(f"qtk quantize {name} failed: {r.output}")
        dirs[name] = out
    return dirs


def main() -> None:
    from transformers import AutoTokenizer

    from qtk.bench.engine import record
    from qtk.loading import BUNDLED, resolve

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="build/vllm_referee", help="Where the checkpoints go.")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="Both engines' dtype (vLLM's CPU W4A16 kernel takes bfloat16 only).")
    ap.add_argument("--name", default=None, help="results file name without .json (default: vllm_referee, "
                    "vllm_referee-bfloat16)")
    ap.add_argument("--schemes", default=",".join(["float", *SCHEMES]), help="Comma-separated, of: float, "
                    + ", ".join(SCHEMES) + ".")
    args = ap.parse_args()
    names = args.schemes.split(",")
    if unknown := set(names) - {"float", *SCHEMES}:
        ap.error(f"unknown --schemes {sorted(unknown)}")
    source = resolve(BUNDLED)
    windows, prompts = inputs(AutoTokenizer.from_pretrained(source))
    results = {name: referee(d, windows, prompts, args.dtype)
               for name, d in quantize_all(Path(args.work), source, names).items()}
    name = args.name or ("vllm_referee" if args.dtype == "float32" else f"vllm_referee-{args.dtype}")
    res = record({"model": BUNDLED, "dtype": args.dtype, "windows": f"{len(windows)} x {len(windows[0])}",
                  "prompts": len(prompts), "new_tokens": NEW_TOKENS, "checkpoints": results}, args.out, name,
                 " ".join(["python", *sys.argv]))
    print(json.dumps(res["checkpoints"], indent=2))


if __name__ == "__main__":
    main()
