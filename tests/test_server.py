"""`qtk serve` through the real openai client on loopback: completions, chat, streaming (chunks
reassemble to the non-streamed greedy text), n > 1, concurrency, seeds, bad requests as 4xx with
a message, the api key, and a client leaving a stream frees its blocks."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from serving import free_port, serving

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def request_log(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(tiny_dir, request_log):
    from qtk import LLM
    from qtk.runtime.async_engine import AsyncLLM

    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**21, block_size=8))
    with serving(engine, "tiny", api_key=KEY, max_queue=64, log_requests=str(request_log)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server[0] + "/health").status_code == 200
    assert httpx.get(server[0] + "/version").json()["version"]


def test_completion_and_its_stream_agree(client):
    kw = dict(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_stop_string_kept_and_cache_salt(server, client):
    """vLLM's include_stop_str_in_output ends the text after the stop string, streamed too; a
    cache_salt request shares no cached blocks with unsalted ones (the prefix-cache hits stay)."""
    import re

    kw = dict(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:6]
    keep = {"include_stop_str_in_output": True}
    cut = client.completions.create(**kw, stop=[stop], extra_body=keep).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop) + len(stop)]
    chunks = client.completions.create(**kw, stop=[stop], extra_body=keep, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.text

    def hits() -> float:
        text = httpx.get(server[0] + "/metrics").text
        return float(re.search(r"^qtk:prefix_cache_hits_total (\S+)$", text, re.M)[1])
    prompt = "The same long prompt, " * 6
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    before = hits()
    salted = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
    assert hits() == before and salted.usage.completion_tokens == 1
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
    assert hits() > before


def test_chat_stream_n_and_seed(client):
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full.choices[0].message.content
    many = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, n=3, seed=7,
                                         temperature=1.0)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, n=3, seed=7,
                                          temperature=1.0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=2, seed=3,
                                                 temperature=1.0, stream=True))
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]  # each choice finishes once
    assert [c.message.content for c in many.choices] == [c.message.content for c in again.choices]
    lp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_concurrent_requests_equal_the_same_requests_alone(client):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Item {i}: the" for i in range(8)]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                                      temperature=0).choices[0].text, prompts))
    assert together == alone


@pytest.mark.parametrize("body,field", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 500}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "model": "nope"}, "model"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": list(range(300, 450))}, "context length"),
    ({"prompt": "hi", "n": "many"}, "n"),
    ({"prompt": [1, 10 ** 9, 2]}, "vocabulary"),
    ({"prompt": [1, 10 ** 9, 2], "stream": True}, "vocabulary"),  # a 400, not a 200 and an error event
    ({"prompt": "hi", "n": 10 ** 12}, "n"),
    ({"prompt": "a \ud800 b"}, "lone surrogate"),
    ({"prompt": "hi", "stop": ["\udfff"]}, "lone surrogate"),
    ({"prompt": "hi", "temperature": 1e400}, "temperature"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999999": 5}}, "vocabulary"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "!"}, "suffix"),
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens"),  # only echo may ask for no new tokens
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
])
def test_bad_requests_are_4xx_that_name_the_field(server, body, field):
    r = httpx.post(server[0] + "/v1/completions", content=json.dumps({"model": "tiny", **body}),  # ASCII escapes,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # as "\ud800"
    assert 400 <= r.status_code < 500, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field, r.text


def test_malformed_json_and_the_api_key(server):
    url = server[0] + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"Authorization": f"Bearer {KEY}",
                                                       "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}).status_code == 401
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "x", "stream": True})  # refused before streaming
    assert r.status_code == 401 and r.headers["content-type"] == "application/json", r.text
    assert httpx.get(server[0] + "/health").status_code == 200  # outside /v1/: no key asked
    assert httpx.post(url, json={"messages": []}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 400
    for content, message in (([{"type": "text", "text": 5}], "needs a string 'text'"),
                             ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "text parts only"),
                             ("\ud800", "lone surrogate")):
        r = httpx.post(url, content=json.dumps({"messages": [{"role": "user", "content": content}]}),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_client_leaving_a_stream_frees_its_blocks(server):
    url, engine = server
    bm = engine.llm.block_manager
    free = bm.num_free_blocks
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    deadline = time.time() + 2
    while time.time() < deadline and (engine.llm.has_unfinished_requests() or bm.num_free_blocks != free):
        time.sleep(0.02)
    assert not engine.llm.has_unfinished_requests() and bm.num_free_blocks == free


def test_the_first_chunk_of_a_stream_follows_the_first_token(server, monkeypatch):
    """As vLLM's: a stream's first chunk (the chat's assistant role, a completion's text) is sent with
    the first token, not when the request is admitted, so a client's time to first chunk is queueing
    plus prefill. The engine is held before its step: nothing reaches the client until it runs."""
    import threading

    url, engine = server
    gate, step = threading.Event(), engine.llm.step

    def held_step():
        gate.wait(30)
        return step()

    monkeypatch.setattr(engine.llm, "step", held_step)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Once upon a time"})):
        gate.clear()
        lines: list[str] = []

        def read(path=path, body=body, lines=lines):
            with httpx.stream("POST", url + path, json={"model": "tiny", "max_tokens": 3, "ignore_eos": True,
                                                        "stream": True, **body},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.5)
        assert lines == [], path  # admitted, no token yet: no chunk either
        gate.set()
        reader.join(60)
        first = json.loads(lines[0].removeprefix("data: "))["choices"][0]
        assert first.get("delta", {}).get("role") == "assistant" or first.get("text"), first
        assert lines[-1] == "data: [DONE]"


def test_metrics_count_what_was_served(server, client):
    """/metrics in Prometheus' format under vLLM's names (prefix qtk:): the counters move by what a
    request did, and the latency histograms saw it."""
    import re

    def scrape() -> dict[str, float]:
        text = httpx.get(server[0] + "/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r'^(qtk:[\w:]+(?:\{[^}]*\})?) (\S+)$', text, re.M)}

    before = scrape()
    r = client.completions.create(model="tiny", prompt="Count me", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape()
    assert after["qtk:generation_tokens_total"] - before["qtk:generation_tokens_total"] == 5
    assert after["qtk:prompt_tokens_total"] - before["qtk:prompt_tokens_total"] == r.usage.prompt_tokens
    key = 'qtk:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "inter_token_latency_seconds"):
        assert after[f"qtk:{h}_count"] > before.get(f"qtk:{h}_count", 0), h
    assert "qtk:num_requests_running" in after and 0 <= after["qtk:kv_cache_usage_perc"] <= 1
    assert after["qtk:prefix_cache_queries_total"] >= after["qtk:prefix_cache_hits_total"]


def test_log_requests_records_bodies_and_texts_never_the_key(client, request_log):
    import json

    full = client.completions.create(model="tiny", prompt="Log this", max_tokens=4, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "and this"}], max_tokens=4, temperature=0, stream=True))
    text = request_log.read_text()
    assert KEY not in text
    records = [json.loads(line) for line in text.splitlines()]
    comp = [r for r in records if r["request"].get("prompt") == "Log this"][-1]
    chat = [r for r in records if r["request"].get("messages", [{}])[0].get("content") == "and this"][-1]
    assert comp["endpoint"] == "/v1/completions" and comp["response"]["choices"][0]["text"] == full.choices[0].text
    assert chat["response"]["choices"][0]["text"] == streamed and chat["response"]["usage"]["completion_tokens"] == 4


def test_request_log_appends_whole_lines_from_threads_and_rotates(tmp_path):
    import json
    from concurrent.futures import ThreadPoolExecutor

    from qtk.entrypoints.openai.request_log import RequestLog

    log = RequestLog(tmp_path / "r.jsonl", max_bytes=4000, backups=2)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: log.write("/v1/completions", {"prompt": "x" * 50, "i": i}, [{"text": "y"}], None),
                      range(200)))
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]  # every line whole
    assert all(f.stat().st_size <= 4000 for f in files) and len({r["request"]["i"] for r in lines}) == len(lines)


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_dir):
    """`qtk serve` as a process: SIGTERM while a request streams lets that request finish, then
    the server exits 0."""
    import json
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qtk.cli", "serve", str(tiny_dir), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(2**21)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "Go on", "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
        pieces, finish = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
                if len(pieces) == 3:
                    proc.send_signal(signal.SIGTERM)
        assert finish == "length" and len(pieces) >= 60
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_is_checked_once(server, client, monkeypatch):
    """The server runs the engine's InputProcessor once per prompt (ids, params, the grammar
    compiled into matchers) before its response starts, and the engine takes what it made without
    checking it again."""
    _, engine = server
    calls = []
    process = engine.llm.processor.process
    monkeypatch.setattr(engine.llm.processor, "process", lambda *a, **k: calls.append(a) or process(*a, **k))
    client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=2)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   response_format={"type": "json_object"})
    assert len(calls) == 3

def test_an_error_inside_one_request_is_its_500_alone(server, client, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from openai import InternalServerError

    url, engine = server
    bm = engine.llm.block_manager
    free = bm.num_free_blocks
    original = engine.llm.output_processor.stop_reason

    def stop_reason(seq):
        if seq.token_ids[:4] == [7, 7, 7, 7]:
            raise RuntimeError("boom in one request")
        return original(seq)

    monkeypatch.setattr(engine.llm.output_processor, "stop_reason", stop_reason)

    def bad():
        with pytest.raises(InternalServerError, match="boom in one request"):
            client.completions.create(model="tiny", prompt=[7, 7, 7, 7], max_tokens=5)

    def good():
        return client.completions.create(model="tiny", prompt="fine", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(2) as pool:
        f_bad, f_good = pool.submit(bad), pool.submit(good)
        f_bad.result()
        assert f_good.result().usage.completion_tokens == 5
    assert httpx.get(url + "/health").status_code == 200 and engine.dead is None
    assert not engine.llm.has_unfinished_requests() and bm.num_free_blocks == free  # nothing left held


def test_a_client_leaving_a_plain_request_aborts_it(server, monkeypatch):
    """Not streamed: the client times out and goes; its request is aborted, blocks freed."""
    url, engine = server
    bm = engine.llm.block_manager
    free = bm.num_free_blocks
    step = engine.llm.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine.llm, "step", slow_step)
    body = {"model": "tiny", "prompt": "Take your time", "max_tokens": 110, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    deadline = time.time() + 2
    while time.time() < deadline and (engine.llm.has_unfinished_requests() or bm.num_free_blocks != free):
        time.sleep(0.02)
    assert not engine.llm.has_unfinished_requests() and bm.num_free_blocks == free


def test_bench_serve_measures_a_server(server, tmp_path):
    """`qtk bench serve` against the test server: every request completes with the tokens asked
    for, the latencies are ordered as they must be, and the JSON is written."""
    import json

    from click.testing import CliRunner

    from qtk.cli import main

    r = CliRunner().invoke(main, ["bench", "serve", "--url", server[0], "--num-prompts", "6", "--max-concurrency", "2",
                                  "--request-rate", "50", "--max-tokens", "8", "--api-key", KEY, "--out", str(tmp_path),
                                  "--name", "s"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["completed"] == 6 and res["errors"] == 0 and res["output_tokens"] == 6 * 8
    assert 0 < res["ttft_s"]["p50"] <= res["e2e_s"]["p50"] and res["tpot_s"]["p50"] > 0 and res["itl_s"]["p99"] > 0
    bad = CliRunner().invoke(main, ["bench", "serve", "--url", server[0], "--model", "tiny", "--num-prompts", "2",
                                    "--max-tokens", "4", "--out", str(tmp_path), "--name", "nokey"])
    assert bad.exit_code == 0 and "0/2 completed, 2 errors" in bad.output  # no key: each request a 401
    assert "HTTP 401" in json.loads((tmp_path / "nokey.json").read_text())["error_messages"][0]
    lost = CliRunner().invoke(main, ["bench", "serve", "--url", server[0], "--num-prompts", "1"])
    assert lost.exit_code == 2 and "/v1/models" in lost.output  # the model name cannot be found: one clear line


SMALL_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "tag": {"type": "string", "maxLength": 6}},
                "required": ["color", "n", "tag"], "additionalProperties": False}


def test_response_format_json_schema_holds_streamed_and_not(client):
    """The random tiny model writes anything; with response_format every choice parses and
    matches the schema, streamed chunks reassembling to it too."""
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SMALL_SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "A thing as JSON."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=90, n=3, temperature=1.0, seed=1,
                                          response_format=fmt)
    for c in full.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SMALL_SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=90, temperature=0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    comp = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=10, temperature=1.0, seed=2,
                                     extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert comp.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "first step"),  # matches nothing
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "Extra inputs"),
])
def test_bad_structured_outputs_are_400s_that_say_what_is_wrong(server, extra, param, message):
    r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message.lower() in err["message"].lower(), err


def test_logit_bias_reaches_the_sampler(client, tokenizer):
    kw = dict(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    forced = client.completions.create(**kw, logit_bias={"42": 100}).choices[0].text  # clamped to 100 if more
    assert forced == tokenizer.decode([42] * 4) != plain


def test_a_huge_repetition_penalty_keeps_the_grammar(client):
    """A repetition penalty past float32's range (vLLM takes any finite one above 0) where the
    grammar allows only a prompt token (whose logit is negative here): answered, not a 500."""
    for temperature in (0, 1.0):
        for penalty in (1e39, 1e300):
            out = client.completions.create(model="tiny", prompt="x,", max_tokens=4, temperature=temperature, seed=0,
                                            extra_body={"repetition_penalty": penalty,
                                                        "structured_outputs": {"regex": "x"}})
            assert out.choices[0].text == "x" and out.choices[0].finish_reason == "stop"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def test_forced_tool_calls_parse_and_match_their_function(client):
    """A named function and "required" come back as tool_calls whose arguments parse and match the
    function's parameters, streamed or not (the random tiny model would write anything)."""
    import jsonschema

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0, tools=TOOLS,
                                          tool_choice=named)
    call = full.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0,
                                                 tools=TOOLS, tool_choice=named, stream=True))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments

    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        req = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=90, temperature=1.0, seed=seed,
                                             tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        choice = req.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False: one call
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    kw = dict(model="tiny", messages=msgs, max_tokens=90, temperature=1.0, seed=0, tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (t.function.name, t.function.arguments) for t in client.chat.completions.create(**kw).choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_calls_of_a_function_with_an_open_schema_still_pass_an_object(client):
    """parameters {} allows any JSON value, but a call's arguments are a JSON object (OpenAI's shape)."""
    tools = [{"type": "function", "function": {"name": "anything", "parameters": {}}}]
    msgs = [{"role": "user", "content": "Go"}]
    for seed in range(6):
        for choice in ({"type": "function", "function": {"name": "anything"}}, "required"):
            req = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=1.0,
                                                 seed=seed, tools=tools, tool_choice=choice)
            calls = req.choices[0].message.tool_calls
            if req.choices[0].finish_reason != "length":
                assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_tool_history_and_tool_choice_none_answer_in_text(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, tools=TOOLS,
                                         tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize("extra,message", [
    ({"tools": TOOLS}, "auto"),  # OpenAI's default with tools: needs a parser qtk does not have
    ({"tools": TOOLS, "tool_choice": "auto"}, "required"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": "x"}}}],
      "tool_choice": "required"}, "parameters.$defs must be an object"),  # was an AttributeError: a 500
])
def test_tool_requests_qtk_cannot_serve_are_400s(server, extra, message):
    r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice" and message in r.json()["error"]["message"], r.text


def test_unknown_paths_and_methods_answer_in_openai_error_shape(server):
    r = httpx.get(server[0] + "/v1/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.get(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_echo_returns_the_prompt_and_its_logprobs(client):
    """echo puts the prompt (and its logprobs; the first token has none) before each choice;
    max_tokens 0 returns the prompt alone: lm-eval's local-completions scores continuations so."""
    kw = dict(model="tiny", prompt="Hello there, friend", temperature=0, logprobs=1)
    plain = client.completions.create(**kw, max_tokens=3).choices[0]
    echoed = client.completions.create(**kw, max_tokens=3, echo=True)
    prompt_len = echoed.usage.prompt_tokens
    c = echoed.choices[0]
    assert c.text == "Hello there, friend" + plain.text
    assert len(c.logprobs.tokens) == prompt_len + 3 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[prompt_len:] == plain.logprobs.token_logprobs
    assert c.logprobs.text_offset[:2] == [0, len(c.logprobs.tokens[0])]
    alone = client.completions.create(**kw, max_tokens=0, echo=True)
    assert alone.choices[0].text == "Hello there, friend" and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs[:prompt_len]
    for lp, top in zip(c.logprobs.token_logprobs[1:], c.logprobs.top_logprobs[1:]):
        assert lp <= max(top.values()) + 1e-6
    chunks = [ch for ch in client.completions.create(**kw, max_tokens=3, echo=True, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in chunks), []) == c.logprobs.token_logprobs
    assert sum((ch.choices[0].logprobs.text_offset for ch in chunks), []) == c.logprobs.text_offset
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=0, echo=True, logprobs=0)
    assert [len(ch.logprobs.tokens) for ch in ids.choices] == [3, 2]


def test_tokenizer_endpoints(server, tokenizer):
    url = server[0]
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer("Hello there").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128 and r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    msgs = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert chat == list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello there"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"prompt": "x", "messages": msgs})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template


def test_chat_template_kwargs_and_continue_final_message(server, client, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    r = httpx.post(server[0] + "/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                                  "continue_final_message": True}).json()["tokens"]
    assert r == list(tokenizer.apply_chat_template(msgs, continue_final_message=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(r)
    for extra, message in (({"continue_final_message": True}, "add_generation_prompt"),
                           ({"chat_template_kwargs": {"tokenize": False}}, "tokenize")):
        bad = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"messages": msgs, "max_tokens": 3, **extra})
        assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text


def test_lm_eval_local_completions_scores_through_the_server(server, tiny_dir, monkeypatch):
    """lm-eval's own OpenAI-API model (local-completions, remote tokenizer) against `qtk serve`
    gives the log-likelihoods qtk's in-process lm-eval model gives."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (qtk[dev] has it)
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from qtk.evals.lm_eval_adapter import QtkLM

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    api = LocalCompletionsAPI(base_url=server[0] + "/v1/completions", model="tiny", tokenizer_backend="remote",
                              max_length=128)
    pairs = [("The capital of France is", " Paris"), ("One, two,", " three"), ("Hello", " world and more")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    remote = api.loglikelihood(reqs)
    local = QtkLM(pretrained=str(tiny_dir), dtype="float32", device="cpu", max_model_len=128,
                  kv_cache_memory=2**21).loglikelihood(reqs)
    for (a, greedy_a), (b, greedy_b) in zip(remote, local):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}',  # stopped before the closing tag
    'No tools needed: 1 < 2 and <tool is not a tag.',
    '<tool_call>{not json}</tool_call> so this is all text',
    '\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',  # Qwen3 after </think>
    '<tool_call>' + '[' * 5000 + '</tool_call>',  # nested past Python's stack: text, not a 500
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_calls_stream_as_they_complete_and_match_the_whole_parse(text):
    """Fed the text at every length, the stream's deltas reassemble to the non-streamed message."""
    from qtk.runtime.output_processor import CompletionOutput
    from qtk.entrypoints.openai.protocol import ChatCompletionRequest
    from qtk.entrypoints.openai.chat_choices import ChatChoices
    from qtk.entrypoints.openai.tool_calls import HermesToolParser

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    whole = ChatChoices(body, HermesToolParser()).message(CompletionOutput(0, text, [], "stop"))
    calls, content, finish = ChatChoices(body, HermesToolParser()), "", None
    streamed: dict[int, dict] = {}
    for n in range(1, len(text) + 1):
        delta, finish = calls.delta(CompletionOutput(0, text[:n], [], "stop" if n == len(text) else None), 0)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            assert call["index"] not in streamed  # each call once, whole
            streamed[call["index"]] = call["function"]
    msg = whole["message"]
    assert [streamed[i] for i in sorted(streamed)] == [c["function"] for c in msg.get("tool_calls", [])]
    assert content == (msg["content"] or "") and finish == whole["finish_reason"]
    if "tool_calls" in msg:
        assert finish == "tool_calls" and all(json.loads(c["function"]["arguments"]) for c in msg["tool_calls"])
    else:
        assert msg["content"] == text  # no call: all of it is text


def test_auto_tool_choice_reads_the_models_calls(tiny_dir):
    """With --tool-call-parser hermes, tool_choice "auto" (the default with tools) returns the calls
    the model writes in its text (forced here with a regex: the random tiny model would not write
    one), streamed or not; text without a call stays content."""
    from openai import OpenAI

    from qtk import LLM
    from qtk.runtime.async_engine import AsyncLLM

    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=160, kv_cache_memory=2**21, block_size=8))
    with serving(engine, "tiny", tool_call_parser="hermes") as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        regex = "Sure\\.\n" + call.replace("{", "\\{").replace("}", "\\}")
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=90,
                  temperature=0, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}})
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content == "Sure.\n"
        [got] = out.message.tool_calls
        assert got.function.name == "get_weather" and json.loads(got.function.arguments) == {"city": "Paris",
                                                                                             "unit": "c"}
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure.\n"
        streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
            (0, "get_weather", got.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                               temperature=0, tools=TOOLS).choices[0]
        assert plain.message.tool_calls is None and plain.finish_reason == "length"
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=64, kv_cache_memory=2**20, block_size=8))
    with serving(engine, "tiny", chat_template=template) as (url, _):
        ids = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert engine.tokenizer.decode(ids) == "<user>Hi<assistant>"  # --chat-template replaces the model's
    with pytest.raises(Exception, match="no tool-call parser 'nope'"):
        from qtk.entrypoints.openai.api_server import build_app
        build_app(engine, "tiny", tool_call_parser="nope")


def test_echo_alone_keeps_the_engines_checks_and_finish_reason(server, client, tokenizer):
    full = list(range(300, 300 + 128))  # the whole context: not even the one token echo computes fits
    r = httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": full, "max_tokens": 0, "echo": True, "stream": True})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    eos = tokenizer.eos_token_id
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=0, echo=True, logit_bias={str(eos): 100})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == "Hi"  # the computed token was EOS


@pytest.mark.parametrize("kwargs", [{"padding": "max_length", "max_length": 10 ** 9}, {"tokenizer_kwargs": "x"},
                                    {"return_tensors": "pt"}, {"truncation": True, "max_length": 3}])
def test_chat_template_kwargs_are_template_variables_only(server, kwargs):
    """apply_chat_template's own arguments would reach the tokenizer: padding to a billion tokens
    would take the server's memory, return_tensors would hand back tensors."""
    msgs = [{"role": "user", "content": "Hi"}]
    for path, body in (("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}), ("/tokenize", {"messages": msgs})):
        r = httpx.post(server[0] + path, headers={"Authorization": f"Bearer {KEY}"},
                       json={**body, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_tool_edge_cases(server, client):
    import jsonschema

    loc = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    defs_tool = {"type": "function", "function": {"name": "where.is", "strict": True, "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"], "$defs": {"Loc": loc}}}}
    msgs = [{"role": "user", "content": "Where?"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0,
                                         tools=[defs_tool], tool_choice="required", parallel_tool_calls=False)
    [call] = out.choices[0].message.tool_calls  # $defs moved to the root of the list's schema; a dotted name
    schema = {**defs_tool["function"]["parameters"], "additionalProperties": False}
    jsonschema.validate(json.loads(call.function.arguments), schema)
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": loose}}
    named = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=1.0, seed=0,
                                           tools=[strict], tool_choice={"type": "function", "function": {"name": "f"}})
    args = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert set(args) == {"a"}  # strict: no other keys, so the call ends well before max_tokens
    deep = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": deep, "max_tokens": 2, "tools": [strict], "tool_choice": "none"})
    assert r.status_code < 500, r.text  # arguments too deep to parse reach the template as the string sent
    r = httpx.post(server[0] + "/tokenize", json={"messages": [], "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert r.status_code == 400, r.text


REASONING_TEXTS = [
    ("qwen3", "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nIt is 4.", "\nLet me add: 2 + 2 = 4.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4, no thinking.", "", "It is 4, no thinking."),
    ("qwen3", "<think>still thinking when max_tokens", "still thinking when max_tokens", ""),
    ("qwen3", "<think>a</think>\n\n", "a", "\n\n"),  # a whitespace answer is kept, as vLLM's and as streamed
    ("deepseek_r1", "Hmm, 2 + 2.</think>4", "Hmm, 2 + 2.", "4"),
    ("deepseek_r1", "<think>a</think>b </think> c", "a", "b </think> c"),
    ("deepseek_r1", "never closed <", "never closed <", ""),
]


@pytest.mark.parametrize("name,text,thought,answer", REASONING_TEXTS)
def test_reasoning_splits_the_thought_streamed_as_whole(name, text, thought, answer):
    """The thought goes to `reasoning` (and `reasoning_content`), the answer to `content`; fed the
    text at every length, the stream's deltas reassemble to the same split."""
    from qtk.entrypoints.openai.chat_choices import ChatChoices
    from qtk.runtime.output_processor import CompletionOutput
    from qtk.entrypoints.openai.protocol import ChatCompletionRequest
    from qtk.entrypoints.openai.reasoning import PARSERS

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    msg = ChatChoices(body, None, PARSERS[name]()).message(CompletionOutput(0, text, [], "length"))["message"]
    assert (msg.get("reasoning", ""), msg["content"] or "") == (thought, answer)
    assert msg["content"] == (answer or None if thought else answer)  # null only when it all was thought
    assert msg.get("reasoning_content") == msg.get("reasoning")
    replies, got = ChatChoices(body, None, PARSERS[name]()), {"reasoning": "", "content": ""}
    for n in range(1, len(text) + 1):
        delta, _ = replies.delta(CompletionOutput(0, text[:n], [], "length" if n == len(text) else None), 0)
        for key in got:
            got[key] += delta.get(key, "")
    assert (got["reasoning"], got["content"]) == (thought, answer)


def test_reasoning_and_hermes_calls_through_the_server(tiny_dir, monkeypatch):
    """--reasoning-parser qwen3 with --tool-call-parser hermes through the server: the parsers reach
    each request's choices (a grammar-shaped text is read without the thought split: a grammar
    leaves no room for a thought)."""
    from openai import OpenAI

    from qtk import LLM
    from qtk.entrypoints.openai import api_server as server_module
    from qtk.runtime.async_engine import AsyncLLM

    seen = []
    real = server_module.ChatChoices

    def spy(body, tool_parser, reasoning_parser):
        seen.append((tool_parser is not None, None if reasoning_parser is None else reasoning_parser.name))
        return real(body, tool_parser, reasoning_parser)

    monkeypatch.setattr(server_module, "ChatChoices", spy)

    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=160, kv_cache_memory=2**21, block_size=8))
    with serving(engine, "tiny", tool_call_parser="hermes", reasoning_parser="qwen3") as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        text = ('<think>\nParis, so c.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}'
                '\n</tool_call>')
        regex = "".join("\\" + ch if ch in "{}." else ch for ch in text)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Time?"}],
                                             max_tokens=90, temperature=0, tools=TOOLS,
                                             extra_body={"structured_outputs": {"regex": regex}})
        # a grammar shapes this text, so the server does not look for a thought in it: the thought
        # stays in content, and the call after it is still found
        msg = out.choices[0].message
        assert msg.tool_calls[0].function.name == "get_time" and "Paris, so c." in (msg.content or "")
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0).choices[0].message
        assert plain.content and getattr(plain, "reasoning", None) is None  # no <think>: all answer
        assert seen == [(True, None), (False, "qwen3")]


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    from qtk.entrypoints.openai.chat_choices import ChatChoices
    from qtk.runtime.output_processor import CompletionOutput
    from qtk.entrypoints.openai.protocol import ChatCompletionRequest
    from qtk.entrypoints.openai.tool_calls import HermesToolParser

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, parallel_tool_calls=False)
    msg = ChatChoices(body, HermesToolParser()).message(CompletionOutput(0, HERMES_TEXTS[1], [], "stop"))["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]


def test_auto_calls_with_a_lone_surrogate_escape_still_render():
    """A model's JSON may escape half a surrogate pair ("\\ud800"): json.loads makes it a str that
    UTF-8 cannot carry, and the non-streamed response failed to render (a 500 after generating)."""
    from fastapi.responses import JSONResponse

    from qtk.entrypoints.openai.chat_choices import ChatChoices
    from qtk.runtime.output_processor import CompletionOutput
    from qtk.entrypoints.openai.protocol import ChatCompletionRequest
    from qtk.entrypoints.openai.tool_calls import HermesToolParser

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "\\ud800"}}\n</tool_call>'
    whole = ChatChoices(body, HermesToolParser()).message(CompletionOutput(0, text, [], "stop"))
    JSONResponse(whole)  # raised UnicodeEncodeError
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "\ud800"}
    named = text.replace('"get_time"', '"\\ud800"')  # a name UTF-8 cannot carry: no call, all content
    whole = ChatChoices(body, HermesToolParser()).message(CompletionOutput(0, named, [], "stop"))
    assert whole["message"]["content"] == named and "tool_calls" not in whole["message"]


def test_a_failing_prompt_cancels_its_siblings():
    """A request's prompts run together; when one fails the others stop (their engine streams
    close, which aborts their requests) instead of generating on, holding KV blocks."""
    import asyncio

    from qtk.entrypoints.openai.api_server import all_or_none, merged

    closed = []

    async def tokens(name, n, fail_at=None):
        try:
            for i in range(n):
                await asyncio.sleep(0.01)
                if i == fail_at:
                    raise RuntimeError(f"{name} failed")
                yield name, i
        finally:
            closed.append(name)

    async def last(stream):
        out = None
        async for out in stream:
            pass
        return out

    async def main():
        with pytest.raises(RuntimeError, match="b failed"):
            await all_or_none([last(tokens("a", 100)), last(tokens("b", 100, fail_at=3))])
        await asyncio.sleep(0.05)
        assert sorted(closed) == ["a", "b"]
        closed.clear()
        got = [item async for item in merged([("a", tokens("a", 3)), ("b", tokens("b", 2))])]
        assert sorted(got) == [("a", ("a", 0)), ("a", ("a", 1)), ("a", ("a", 2)), ("b", ("b", 0)), ("b", ("b", 1))]
        with pytest.raises(RuntimeError, match="b failed"):
            async for _ in merged([("a", tokens("a", 100)), ("b", tokens("b", 100, fail_at=2))]):
                pass
        await asyncio.sleep(0.05)
        assert "a" in closed  # cancelled with its sibling's failure

    asyncio.run(main())
