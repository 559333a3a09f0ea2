"""llama.cpp's side of `qtk bench engine`: batch-1 decode on a GGUF file, in llama-cpp-python's own
venv (scripts/peer_env.sh llamacpp ...).

    python benchmarks/llamacpp_peer.py JOB.json OUT.json
JOB: {"gguf": FILE, "prompt": [token ids], "max_tokens": N, "threads": T (default: all cores)}
OUT: {"tokens", "seconds" (the prompt's evaluation and the decode of all N output tokens, the
span qtk's, vLLM's and transformers' batch-1 figures time), "prompt_s", "decode_s", "load_s",
"threads"}, or {"error": why}. One warm-up request first, as llama-bench does.
"""
import json
import os
import sys
import time
import traceback


def run(job):
    from llama_cpp import Llama

    threads = job.get("threads") or os.cpu_count()
    t = time.perf_counter()
    # n_threads_batch too: llama-cpp-python's default for the prompt is every logical CPU
    llm = Llama(job["gguf"], n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t
    llm.eval(job["prompt"])  # warm-up: pages the mmapped weights in, as the other engines' warm-ups do
    llm.eval([llm.sample(top_k=1, temp=0.0)])
    llm.reset()
    t = time.perf_counter()
    llm.eval(job["prompt"])
    prompt_s = time.perf_counter() - t
    n = job["max_tokens"]
    for i in range(1, n + 1):  # greedy, EOS ignored: n tokens, the first from the prompt's logits
        token = llm.sample(top_k=1, temp=0.0)
        if i < n:  # the last token's forward would feed no one
            llm.eval([token])
    seconds = time.perf_counter() - t
    return {"tokens": n, "seconds": seconds, "prompt_s": prompt_s, "decode_s": seconds - prompt_s,
            "load_s": load_s, "threads": threads}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
