"""`qtk bench serve`: load an OpenAI-compatible server (qtk's, vLLM's, anyone's) and measure it by
the serving protocol of docs/benchmarks.md.

Requests are streamed chat completions (EOS ignored, so every request asks for the same work)
sent with Poisson arrivals at --request-rate (exponential gaps; inf: all at once), at most
--max-concurrency in flight. Per request: TTFT (send to the first token), the gaps between
chunks that carry tokens (inter-token latency), TPOT = (end - first token) / (output tokens - 1),
end to end latency; the server's usage chunk gives the token count. A token is any generated text:
content, a reasoning parser's thought (reasoning_content, or vLLM's newer reasoning) or a tool
call, as vLLM's serving benchmark counts the thought (content alone would put a reasoning model's
whole thought into its TTFT). Reported: p50 / p99 of each, request and output-token throughput
over the run's wall time, and errors (anything but a complete stream). Writes JSON and prints a
table.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import InputError
from .engine import record
from .prompts import SPECS, PromptSet, conversations


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


# the delta fields that carry generated tokens (qtk serve and vLLM send a thought in both reasoning fields)
TOKEN_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


def has_tokens(chunk: dict) -> bool:
    """Whether a streamed chat-completion chunk carries generated tokens (not only a role or usage)."""
    return any((c.get("delta") or {}).get(f) for c in chunk.get("choices", []) for f in TOKEN_FIELDS)


def load_prompts(dataset: str, n: int, tokenizer: str | None = None, seed: int = 0) -> list[list[dict]]:
    """n conversations: a prompt set of bench/prompts.py (builtin, fixed:N, random:LO-HI,
    conversation; token windows cut by `tokenizer`, the bundled model's by default), or a FILE:
    .jsonl with "messages" or "prompt" per line, or .txt with one prompt per line (repeated to n)."""
    if dataset.partition(":")[0] in ("builtin", "fixed", "random", "conversation"):
        spec = PromptSet.parse(dataset, "--dataset")
        tok = None
        if spec.kind in ("fixed", "random"):
            from ..loading import load_tokenizer, resolve
            from ..paths import BUNDLED

            tok = load_tokenizer(resolve(tokenizer or BUNDLED))
        return conversations(tok, spec, n, seed)
    path = Path(dataset)
    if not path.is_file():
        raise InputError(f"--dataset {dataset!r}: no such file ({SPECS}, FILE.jsonl or FILE.txt)")
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts = [r["messages"] if "messages" in r else r["prompt"] for r in rows]
    else:
        texts = [line for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise InputError(f"--dataset {dataset!r} has no prompts")
    convs = [t if isinstance(t, list) else [{"role": "user", "content": t}] for t in texts]
    return [convs[i % len(convs)] for i in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    res, t0 = Result(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if has_tokens(chunk):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None and res.tokens > 0
        if not res.ok:
            res.error = "the stream ended without tokens or usage"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(url: str, model: str | None, convs: list[list[dict]], max_tokens: int, rate: float,
               concurrency: int | None, api_key: str | None, seed: int) -> tuple[list[Result], float, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(convs))
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600, limits=limits) as client:
        if model is None:
            try:
                r = await client.get("/v1/models")
            except httpx.TransportError as e:
                raise InputError(f"cannot reach {url} ({e}): is the server running?") from e
            if r.status_code != 200:
                raise InputError(f"GET {url}/v1/models answered HTTP {r.status_code} ({r.text[:200]}); "
                                 "give --model (and --api-key if the server needs one)")
            model = r.json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency or len(convs))
        rng = random.Random(seed)

        async def send(conv):
            async with gate:
                body = {"model": model, "messages": conv, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                return await one_request(client, "/v1/chat/completions", body)

        t0 = time.perf_counter()
        tasks = []
        for i, conv in enumerate(convs):
            if i and rate != float("inf"):  # a gap between arrivals, none after the last (the wall time's)
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(send(conv)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0, model


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out = {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
           "wall_s": round(wall, 3), "request_throughput": round(len(ok) / wall, 3),
           "output_throughput": round(sum(r.tokens for r in ok) / wall, 2),
           "output_tokens": sum(r.tokens for r in ok),
           "error_messages": sorted({r.error for r in results if r.error})[:5]}
    for name, xs in (("ttft_s", [r.ttft for r in ok]), ("tpot_s", tpot), ("itl_s", itl),
                     ("e2e_s", [r.e2e for r in ok])):
        out[name] = {"p50": pct(xs, 50), "p99": pct(xs, 99),
                     "mean": statistics.fmean(xs) if xs else None}
    return out


def run(url: str, model: str | None = None, num_prompts: int = 64, request_rate: float = float("inf"),
        max_concurrency: int | None = None, dataset: str = "builtin", max_tokens: int = 128,
        api_key: str | None = None, seed: int = 0, out: str | Path = "benchmarks/results",
        name: str | None = None, command: str | None = None, tokenizer: str | None = None) -> tuple[dict, str]:
    if num_prompts < 1 or max_tokens < 1 or request_rate <= 0 or (max_concurrency is not None and max_concurrency < 1):
        raise InputError("--num-prompts, --max-tokens, --request-rate and --max-concurrency must be positive")
    convs = load_prompts(dataset, num_prompts, tokenizer, seed)
    results, wall, model = asyncio.run(_run(url, model, convs, max_tokens, request_rate, max_concurrency,
                                            api_key, seed))
    res = {"url": url, "model": model, "num_prompts": num_prompts, "request_rate": str(request_rate),
           "max_concurrency": max_concurrency, "dataset": dataset, "max_tokens": max_tokens,
           "dtype": "-", **summarize(results, wall)}
    res = record(res, out, name or f"serve-{model.replace('/', '_')}-c{max_concurrency or 'inf'}", command)
    return res, table(res)


def table(res: dict) -> str:
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"  # noqa: E731
    lines = [f"{res['url']} {res['model']}: {res['completed']}/{res['requests']} completed, {res['errors']} errors, "
             f"{res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} output tok/s "
             f"(concurrency {res['max_concurrency'] or 'unbounded'}, rate {res['request_rate']})"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        lines.append(f"  {key[:-2]:<5} p50 {ms(res[key]['p50']):>9} ms   p99 {ms(res[key]['p99']):>9} ms")
    return "\n".join(lines)
