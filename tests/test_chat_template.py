"""qtk.chat_template is what `qtk serve` applies: the same messages give the same prompt through
the function as through the server's /tokenize (tools, template variables, a continued last
message), and the engine's chat() runs that prompt."""
from __future__ import annotations

import httpx
import pytest
from serving import serving

from qtk.chat_template import ChatTemplateError, prompt_ids, render

# a template that reads what the server passes: the tools, a variable, the generation prompt
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}[{{ m.tool_calls[0].function.name }}"
            "({{ m.tool_calls[0].function.arguments.city }})]{% endif %}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CASES = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, {}),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"}]}, {}),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
      "add_generation_prompt": False, "continue_final_message": True},
     {"add_generation_prompt": False, "continue_final_message": True}),
    ({"messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL]}, {"tools": [TOOL]}),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " you"}]}],
      "chat_template_kwargs": {"enable_thinking": False}}, {"variables": {"enable_thinking": False}}),
    ({"messages": [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                   {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]}, {}),
]


@pytest.fixture(scope="module")
def served(tiny_dir):
    from qtk import LLM
    from qtk.runtime.async_engine import AsyncLLM

    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**21, block_size=8))
    with serving(engine, "tiny", chat_template=TEMPLATE) as running:
        yield running


@pytest.mark.parametrize("body,kwargs", CASES)
def test_the_function_gives_the_servers_prompt(served, body, kwargs):
    url, engine = served
    tok = engine.tokenizer
    r = httpx.post(url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    # the messages as a template reads them: text parts joined, a call's arguments as an object
    messages = []
    for m in body["messages"]:
        msg = {**m, "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
        if "tool_calls" in m:
            msg["tool_calls"] = [{**c, "function": {"name": c["function"]["name"], "arguments": {"city": "Oslo"}}}
                                 for c in m["tool_calls"]]
        messages.append(msg)
    ids = prompt_ids(tok, messages, **kwargs)
    assert r.json()["tokens"] == ids
    text = render(tok, messages, **kwargs)
    assert tok.decode(ids) == text and ("<tools>get_weather;</tools>" in text) == ("tools" in kwargs)


def test_the_engines_chat_runs_the_servers_prompt(served, tiny_dir):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64, kv_cache_memory=2**20, block_size=8)
    llm.tokenizer.chat_template = TEMPLATE  # what --chat-template did to the server's
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [out] = llm.chat(msgs, SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == httpx.post(served[0] + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert llm.tokenizer.decode(out.prompt_token_ids) == "<system>Be brief.</system><user>Hi</user><assistant>"


def test_what_the_template_refuses_is_an_input_error_naming_the_field(tokenizer):
    with pytest.raises(ChatTemplateError, match="may not set padding") as e:
        render(tokenizer, [{"role": "user", "content": "Hi"}], variables={"padding": "max_length"})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(ChatTemplateError, match="refused these messages") as e:  # both flags: transformers refuses
        render(tokenizer, [{"role": "assistant", "content": "Hi"}], continue_final_message=True)
    assert e.value.param == "messages"
