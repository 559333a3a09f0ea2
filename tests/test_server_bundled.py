"""`qtk serve` on the bundled model, through loopback HTTP.

Structured outputs: prompts of qtk's JSON set (two per category) with response_format
json_schema, greedy and sampled, through the openai client: every answer parses and validates;
the same prompts without it report how often the model manages alone.

A soak: a few hundred mixed requests (completions and
chat, random prompt and output lengths, some streamed, some left mid-way by their client, some
with a JSON schema, some sampled) sent faster than the CPU serves them, into a queue capped by
--max-queue. Asserted: no 5xx but 503s, every 503 with Retry-After (and the client that waits and
retries is served), every schema-constrained answer valid, no KV block held once it drains, and
every greedy answer the same as the same request sent alone afterwards (where they part, a
near-tie: each side's token among the other's top 5, as vLLM's check_logprobs_close accepts)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import jsonschema
import pytest
from serving import serving

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
CONCURRENCY = 48  # clients at once; the engine runs at most 8 sequences, so a queue builds
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(bundled_dir):
    from qtk import LLM
    from qtk.runtime.async_engine import AsyncLLM

    engine = AsyncLLM(LLM(str(bundled_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                          kv_cache_memory=2**28))
    with serving(engine, "m", max_queue=12) as running:
        yield running


def test_structured_outputs_always_valid(server):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from qtk.evals.json_validity import load_prompts, parse_answer

    client = OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=600)
    prompts = load_prompts(limit=12)

    def ask(job):
        p, mode = job
        kw = dict(temperature=0) if mode != "sampled" else dict(temperature=0.8, seed=1)
        if mode != "alone":
            kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": p["schema"]}}
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p["prompt"]}],
                                           max_tokens=256, **kw)
        return p, mode, r.choices[0]

    jobs = [(p, mode) for mode in ("greedy", "sampled", "alone") for p in prompts]
    with ThreadPoolExecutor(8) as pool:  # the server's max_queue is 12: stay under it
        answers = list(pool.map(ask, jobs))
    alone_valid = 0
    for p, mode, choice in answers:
        if mode == "alone":
            try:
                jsonschema.validate(parse_answer(choice.message.content), p["schema"])
                alone_valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
            continue
        assert choice.finish_reason == "stop", (p["id"], mode, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), p["schema"])
    print(f"\nstructured outputs: {2 * len(prompts)}/{2 * len(prompts)} valid (greedy and sampled); "
          f"the model alone: {alone_valid}/{len(prompts)} valid")


def make_requests(seed: int = 0) -> list[dict]:
    """Each: the endpoint, the body, and how the client behaves (stream, leave after k chunks)."""
    from qtk.data import builtin_texts

    rng = random.Random(seed)
    words = " ".join(builtin_texts("evaluation")).split()
    out = []
    for i in range(NUM_REQUESTS):
        start = rng.randrange(len(words) - 200)
        text = " ".join(words[start:start + rng.randint(3, 80)])
        kind = rng.choices(["greedy", "schema", "sampled", "leave"], [0.65, 0.1, 0.15, 0.1])[0]
        body = {"max_tokens": rng.randint(1, 16), "temperature": 0, "logprobs": 5}
        chat = rng.random() < 0.4 or kind == "schema"
        if kind == "schema":
            body.update(max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": SCHEMA}})
            text = f"Describe a city from this text as JSON (city, population, capital): {text[:200]}"
        if kind == "sampled":
            body.update(temperature=0.8, seed=i)
        if kind == "leave":
            body.update(max_tokens=200, ignore_eos=True)
        if chat:
            body.update(messages=[{"role": "user", "content": text}], logprobs=True, top_logprobs=5)
        else:
            body["prompt"] = text
        out.append({"id": i, "kind": kind, "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
                    "stream": kind == "leave" or rng.random() < 0.3, "body": body})
    return out


def tokens(endpoint: str, choice: dict) -> list[tuple[str, set[str]]]:
    """(token text, top-5 token texts) per generated token, from one choice (or a stream chunk's)."""
    lp = choice.get("logprobs") or {}
    if endpoint == "/v1/chat/completions":
        return [(e["token"], {t["token"] for t in e["top_logprobs"]}) for e in lp.get("content") or []]
    return [(t, set(top)) for t, top in zip(lp.get("tokens") or [], lp.get("top_logprobs") or [])]


async def send(client: httpx.AsyncClient, url: str, req: dict, log: dict) -> dict | None:
    """One request as a patient client sends it: on a 503 it waits Retry-After and tries again.
    The reply's text and tokens, or None for a client that leaves mid-stream."""
    body = {**req["body"], "stream": req["stream"]}
    while True:
        if not req["stream"]:
            r = await client.post(url + req["endpoint"], json=body)
            log["status"].append(r.status_code)
            if r.status_code == 503:
                log["retry_after"].append(r.headers.get("retry-after"))
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return {"text": text, "tokens": tokens(req["endpoint"], choice), "finish": choice["finish_reason"]}
        async with client.stream("POST", url + req["endpoint"], json=body) as r:
            log["status"].append(r.status_code)
            if r.status_code == 503:
                log["retry_after"].append(r.headers.get("retry-after"))
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            assert r.status_code == 200
            text, toks, finish, n = "", [], None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                n += 1
                if req["kind"] == "leave" and n >= 4:
                    return None  # the client goes; closing the stream aborts its request
                for choice in chunk["choices"]:
                    text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    toks += tokens(req["endpoint"], choice)
                    finish = choice["finish_reason"] or finish
            return {"text": text, "tokens": toks, "finish": finish}


def test_soak(server):
    url, engine = server
    requests = make_requests()
    log = {"status": [], "retry_after": []}

    async def soak():
        limit = asyncio.Semaphore(CONCURRENCY)
        # an idle connection is dropped by the client before uvicorn's keep-alive (5 s) closes it: at equal
        # timeouts a retry reused a connection as the server closed it (httpx.ReadError before any response)
        limits = httpx.Limits(max_connections=CONCURRENCY, keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            async def one(req):
                async with limit:
                    return await send(client, url, req, log)
            return await asyncio.gather(*(one(r) for r in requests))

    t0 = time.perf_counter()
    replies = asyncio.run(soak())
    soak_s = time.perf_counter() - t0

    statuses = log["status"]
    assert not [s for s in statuses if s >= 500 and s != 503], statuses
    assert statuses.count(503) > 0, "the soak never filled the queue: raise CONCURRENCY"
    assert all(r is not None and float(r) > 0 for r in log["retry_after"])

    bm = engine.llm.block_manager
    deadline = time.time() + 5
    while time.time() < deadline and (engine.llm.has_unfinished_requests() or bm.num_free_blocks != bm.num_blocks):
        time.sleep(0.05)
    assert not engine.llm.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks  # nothing leaked

    for req, reply in zip(requests, replies):
        if req["kind"] == "schema":
            jsonschema.validate(json.loads(reply["text"]), SCHEMA)

    async def alone():  # the greedy ones again, one at a time
        async with httpx.AsyncClient(timeout=600) as client:
            return [await send(client, url, {**r, "stream": False}, {"status": [], "retry_after": []})
                    if r["kind"] in ("greedy", "schema") else None for r in requests]

    t0 = time.perf_counter()
    references = asyncio.run(alone())
    alone_s = time.perf_counter() - t0
    same, tied = 0, 0
    for req, reply, ref in zip(requests, replies, references):
        if ref is None:
            continue
        got, want = reply["tokens"], ref["tokens"]
        parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a[0] != b[0]), None)
        if parted is None:
            assert [t for t, _ in got] == [t for t, _ in want] and reply["text"] == ref["text"], req
            same += 1
            continue
        (a, a_top), (b, b_top) = got[parted], want[parted]
        if req["kind"] == "schema":  # the grammar chose among its tokens, maybe none of the model's top 5:
            jsonschema.validate(json.loads(ref["text"]), SCHEMA)  # both replies valid is what holds
        else:  # many-row steps multiply in bf16 where the CPU has the units, a few rows in float32
            assert a in b_top and b in a_top, (req, parted, a, b)  # a near-tie, nothing worse
        tied += 1
    print(f"\nsoak: {len(requests)} requests in {soak_s:.1f} s, {statuses.count(503)} answered 503 and retried, "
          f"{sum(r['kind'] == 'leave' for r in requests)} left mid-stream; greedy alone in {alone_s:.1f} s: "
          f"{same} identical, {tied} parted at a near-tie")


def test_serve_smoke_script_passes(server):
    """scripts/serve_smoke.py (what the GPU check sends `qtk serve --device cuda`) passes here: a chat,
    the same chat streamed (the same greedy tokens), and a json_schema answer of the schema."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "serve_smoke.py"
    spec = importlib.util.spec_from_file_location("serve_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    with httpx.Client(timeout=600) as client:
        assert smoke.run(client, server[0], None)
