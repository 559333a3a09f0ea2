"""A few real requests against a running `qtk serve` (the GPU check's serve part, and usable against
any OpenAI-compatible server): a chat, a streamed chat, and a json_schema-constrained chat. Prints
each answer and its timing; exit 0 when every request got a well-formed answer (the json_schema one
valid JSON of the schema), 1 otherwise.

    python scripts/serve_smoke.py [--url http://127.0.0.1:8000] [--model NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(client: httpx.Client, url: str, body: dict) -> dict:
    t = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    out = r.json()
    print(f"  {1e3 * (time.perf_counter() - t):.0f} ms, usage {out.get('usage')}")
    return out


def stream(client: httpx.Client, url: str, body: dict) -> str:
    t, first, text, chunks = time.perf_counter(), None, [], 0
    with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - t
            text.append(delta)
            chunks += 1
    print(f"  {chunks} chunks, first token {1e3 * (first or 0):.0f} ms, total {1e3 * (time.perf_counter() - t):.0f} ms")
    return "".join(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    args = ap.parse_args()
    try:
        with httpx.Client(timeout=120) as client:
            ok = run(client, args.url, args.model)
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"  {type(e).__name__}: {e}")
        ok = False
    print("serve smoke:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def run(client: httpx.Client, url: str, model: str | None) -> bool:
    ok = True
    model = model or client.get(f"{url}/v1/models").json()["data"][0]["id"]
    messages = [{"role": "user", "content": "Give me three tips for writing clear code."}]
    print("chat:")
    text = chat(client, url, {"model": model, "messages": messages, "max_tokens": 64,
                              "temperature": 0})["choices"][0]["message"]["content"]
    print("  " + repr(text))
    ok &= bool(text.strip())
    print("stream:")
    streamed = stream(client, url, {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0})
    print("  " + repr(streamed))
    ok &= streamed == text  # greedy: the stream carries the same tokens
    print("json_schema:")
    body = {"model": model, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a person called Ada, aged 36, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    content = chat(client, url, body)["choices"][0]["message"]["content"]
    print("  " + repr(content))
    try:
        value = json.loads(content)
        ok &= isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("age"), int)
    except json.JSONDecodeError:
        ok = False
    return ok


if __name__ == "__main__":
    sys.exit(main())
