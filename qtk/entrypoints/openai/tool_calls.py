"""Tool-call parsers, for tool_choice "auto" (`qtk serve --enable-auto-tool-choice --tool-call-parser
NAME`, vLLM's flags): the model decides whether to call a tool, in the syntax its chat template
taught it, and a parser for that syntax tells calls from text. A parser reads the whole text made
so far: `parse(text, final)` gives the content before the first call and every call complete by
then, so a stream sends content as it comes and each call once it is complete, and a
non-streamed answer is the same parse of the final text (chat_choices.py puts them in messages).
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Parsed:
    content: str  # the text before the first call ("" if only whitespace), the whole text when there is none
    calls: list[dict]  # [{"name": ..., "arguments": JSON text}], complete calls in order
    pending: bool  # a call has started and is not complete yet


class HermesToolParser:
    """Hermes-style calls, as Qwen2.5, Qwen3 and Hermes 2 Pro / 3 write them (vLLM's "hermes"):

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    one tag pair per call; a last call without its closing tag counts when the text is final
    (the model stopped right after the JSON). A first block whose JSON does not parse, or is not
    {"name": str, "arguments": object}, makes the whole answer content, as in vLLM; a broken block
    after good ones ends the calls there."""
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:  # hold back what may be the start of a tag, and whitespace that may precede
            if final:  # one (a call's message has no content then), unless nothing more will come
                return Parsed(text, [], False)
            return Parsed(text[:len(text) - partial_suffix(text, self.START)].rstrip(), [], False)
        before = text[:first] if text[:first].strip() else ""
        calls, pos = [], first
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            if end < 0 and not final:
                return Parsed(before, calls, True)
            call = _call(text[body_start:] if end < 0 else text[body_start:end])
            if call is None:
                if not calls:  # the first block is no call: the whole answer is text
                    return Parsed(text, [], False)
                break  # a broken block after calls: the calls stand, the rest is dropped
            calls.append(call)
            pos = -1 if end < 0 else text.find(self.START, end + len(self.END))
        return Parsed(before, calls, False)


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _utf8(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    # a lone surrogate the model escaped ("\ud800") cannot go out as UTF-8: it stays escaped
    return {"name": obj["name"], "arguments": arguments if _utf8(arguments) else json.dumps(args)}


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS = {HermesToolParser.name: HermesToolParser}
