"""vLLM's side of `qtk bench engine` and of the vLLM-loads-qtk's-checkpoints test. Runs in vLLM's
own venv (scripts/peer_env.sh vllm ...): it imports neither qtk nor the test env's packages.

    python benchmarks/vllm_peer.py JOB.json OUT.json

JOB: {"model": DIR, "dtype": "float32", "max_model_len": N, "threads": T (optional), "tasks": [TASK, ...]}
where a TASK is
    {"kind": "generate", "name": ..., "prompts": [[token ids], ...], "max_tokens": N,
     "ignore_eos": true, "logprobs": K | null}      -> tokens, seconds, output ids (and top logprobs)
    {"kind": "ppl", "name": ..., "windows": [[token ids], ...]}
                                                    -> summed NLL and token count (prompt logprobs)
OUT gets {"startup_s": process start to the first token of a 1-token request, "omp_threads_bind":
the CPUs of the worker's OpenMP threads ("auto": vLLM's choice), "tasks": {name: result}}, or
{"error": vLLM's own message} when vLLM refuses the model (e.g. a scheme its CPU build has no
kernel for), so the caller can record vLLM's reason instead of failing.
"""
import json
import math
import sys
import time
import traceback

T0 = time.perf_counter()


def run(job):
    import os

    # the KV cache on CPU: the same bytes as qtk's (2 GiB by default), not a fraction of the RAM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    if job.get("threads"):  # the worker's OpenMP threads on T CPUs, as many as qtk's torch threads; vLLM's
        # "auto" keeps one core of the node for its scheduler process (1 thread of 2 on a 2-core machine)
        cpus = sorted(os.sched_getaffinity(0))[:job["threads"]]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(job["model"], dtype=job.get("dtype", "float32"), max_model_len=job.get("max_model_len", 2048),
              enforce_eager=job.get("enforce_eager", False), gpu_memory_utilization=job.get("memory_utilization", 0.5),
              seed=0)
    first = job["tasks"][0]["prompts"][0] if job["tasks"] and "prompts" in job["tasks"][0] else [1, 2, 3]
    llm.generate([TokensPrompt(prompt_token_ids=first)], SamplingParams(max_tokens=1), use_tqdm=False)
    out = {"startup_s": time.perf_counter() - T0,
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), "tasks": {}}
    for task in job["tasks"]:
        if task["kind"] == "generate":
            params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0,
                                    ignore_eos=task.get("ignore_eos", False), logprobs=task.get("logprobs"))
            prompts = [TokensPrompt(prompt_token_ids=p) for p in task["prompts"]]
            t = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            outs = [r.outputs[0] for r in res]
            out["tasks"][task["name"]] = {
                "seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs),
                "token_ids": [list(o.token_ids) for o in outs],
                "logprobs": None if task.get("logprobs") is None else
                [[{str(t): lp.logprob for t, lp in step.items()} for step in o.logprobs] for o in outs]}
        elif task["kind"] == "ppl":
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=w) for w in task["windows"]], params, use_tqdm=False)
            nll, n = 0.0, 0
            for r, w in zip(res, task["windows"]):
                for tok, entry in zip(w[1:], r.prompt_logprobs[1:]):
                    nll -= entry[tok].logprob
                    n += 1
            out["tasks"][task["name"]] = {"seconds": time.perf_counter() - t, "nll": nll, "tokens": n,
                                          "ppl": math.exp(nll / n)}
    return out


if __name__ == "__main__":  # vLLM spawns worker processes: everything runs under this guard
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:  # vLLM's refusal is the result: record its reason
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(out_path, "w") as f:
        json.dump(result, f)
