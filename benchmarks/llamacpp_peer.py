"""llama.cpp's side of `qtk bench engine`: batch-1 decode on a GGUF file, in llama-cpp-python's own
venv (scripts/peer_env.sh llamacpp ...).

    python benchmarks/llamacpp_peer.py JOB.json OUT.json
JOB: {"gguf": FILE, "prompt": [token ids], "max_tokens": N, "threads": T (default: all cores)}
OUT: {"tokens", "seconds" (decode of the output tokens after the prompt), "prompt_s",
"load_s"}, or {"error": why}.
"""
import json
import os
import sys
import time
import traceback


def run(job):
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(job["gguf"], n_ctx=2048, n_threads=job.get("threads") or os.cpu_count(), verbose=False)
    load_s = time.perf_counter() - t
    llm.reset()
    t = time.perf_counter()
    llm.eval(job["prompt"])
    prompt_s = time.perf_counter() - t
    t = time.perf_counter()
    n = 0
    for _ in range(job["max_tokens"]):  # greedy, EOS ignored: decode exactly max_tokens tokens
        token = llm.sample(top_k=1, temp=0.0)
        llm.eval([token])
        n += 1
    return {"tokens": n, "seconds": time.perf_counter() - t, "prompt_s": prompt_s, "load_s": load_s}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
