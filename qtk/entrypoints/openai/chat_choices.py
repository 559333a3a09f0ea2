"""A chat request's choices as the messages (and stream deltas) OpenAI's clients read.

A choice's text becomes:
- for a forced tool call (tool_choice naming a function, or "required": the grammar made the JSON,
  protocol.py's ChatCompletionRequest.forced_tools) tool_calls: a named function's arguments
  stream as they are made, "required" calls (a JSON list) are sent whole once the list is complete;
- otherwise the thought (`reasoning`, with --reasoning-parser: reasoning.py), the answer
  (`content`) and, with tool_choice "auto" and --tool-call-parser, the calls the model wrote in
  its answer (tool_calls.py), each call sent once complete.
The finish_reason is "tool_calls" where the model chose the calls ("required", "auto"), the
engine's own ("stop", "length") for a named function, as vLLM reports them.
"""
from __future__ import annotations

import json
import uuid

from ...runtime.output_processor import CompletionOutput
from .protocol import ChatCompletionRequest, NamedToolChoice
from .reasoning import ThinkParser
from .tool_calls import HermesToolParser


class ChatChoices:
    def __init__(self, body: ChatCompletionRequest, tool_parser: HermesToolParser | None = None,
                 reasoning_parser: ThinkParser | None = None):
        choice = body.tool_choice
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.required = choice == "required" and bool(body.tools)
        self.tool_parser = tool_parser  # "auto": given only when the request has tools and leaves the choice to the model
        self.reasoning_parser = reasoning_parser  # given only when no grammar shapes the text
        self.parallel = body.parallel_tool_calls  # "auto": false keeps the first call only
        self.ids: dict[int, str] = {}  # choice index -> its named call's id (the same in every chunk)
        self.sent: dict[int, tuple[int, int, int]] = {}  # choice index -> (thought chars, content chars, calls) sent

    def _id(self, index: int) -> str:
        return self.ids.setdefault(index, _call_id())

    @staticmethod
    def _required_calls(text: str) -> list[dict] | None:
        try:
            calls = json.loads(text)
        except (ValueError, RecursionError):  # cut short by max_tokens, or nested past Python's stack
            return None
        return [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]

    def _answer(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        """(thought, content, calls) of the text so far."""
        thought, answer = self.reasoning_parser.split(text, final) if self.reasoning_parser else ("", text)
        if self.tool_parser is None:
            return thought, answer, []
        parsed = self.tool_parser.parse(answer, final)
        return thought, parsed.content, parsed.calls if self.parallel else parsed.calls[:1]

    def message(self, c: CompletionOutput) -> dict:
        """{"message", "finish_reason"} of a finished choice."""
        if self.name is not None:
            call = {"id": self._id(c.index), "type": "function", "function": {"name": self.name, "arguments": c.text}}
            return {"message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "finish_reason": c.finish_reason}
        if self.required:
            calls = self._required_calls(c.text)
            if calls is None:  # never a complete list: the text as made
                return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            return {"message": {"role": "assistant", "content": None, "tool_calls": calls},
                    "finish_reason": "tool_calls" if c.finish_reason == "stop" else c.finish_reason}
        thought, content, calls = self._answer(c.text, final=True)
        # null: no answer after the thought (vLLM's `content or None`: whitespace is kept, as streamed),
        # or only whitespace beside tool calls
        empty = not content.strip() if calls else not content and thought
        message = {"role": "assistant", "content": None if empty else content}
        if thought:
            message["reasoning"] = message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = [_tool_call(**call) for call in calls]
        return {"message": message, "finish_reason": "tool_calls" if calls else c.finish_reason}

    def delta(self, c: CompletionOutput, sent: int) -> tuple[dict, str | None]:
        """The stream's delta for choice c, of which `sent` characters went out before, and its
        finish_reason."""
        if self.name is not None:
            new = c.text[sent:]
            if not new:
                return {}, c.finish_reason
            call = {"index": 0, "function": {"arguments": new}}
            if c.index not in self.ids:
                call = {"index": 0, "id": self._id(c.index), "type": "function",
                        "function": {"name": self.name, "arguments": new}}
            return {"tool_calls": [call]}, c.finish_reason
        if self.required:
            if c.finish_reason is None:
                return {}, None
            done = self.message(c)
            calls = done["message"].get("tool_calls")
            if calls is None:
                return {"content": c.text}, c.finish_reason
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, done["finish_reason"]
        thought, content, calls = self._answer(c.text, final=c.finish_reason is not None)
        t_sent, c_sent, n_sent = self.sent.get(c.index, (0, 0, 0))
        delta = {}
        if len(thought) > t_sent:
            delta["reasoning"] = delta["reasoning_content"] = thought[t_sent:]
        if len(content) > c_sent:
            delta["content"] = content[c_sent:]
        if len(calls) > n_sent:
            delta["tool_calls"] = [{"index": n_sent + i, **_tool_call(**call)} for i, call in enumerate(calls[n_sent:])]
        self.sent[c.index] = (len(thought), len(content), len(calls))
        return delta, ("tool_calls" if c.finish_reason is not None and calls else c.finish_reason)


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
