"""Reasoning parsers: a thinking model's chain of thought, split from its answer
(`qtk serve --reasoning-parser NAME`, vLLM's flag). The thought goes out in the message's
`reasoning` field (vLLM's current name; `reasoning_content`, DeepSeek's and older vLLM's, carries
the same text for the clients that read that one), the answer in `content`.

Both syntaxes put the thought before a closing `</think>`:
- qwen3 (Qwen3, QwQ): a text that starts `<think>` is thought up to `</think>`; one that does not
  is all answer (thinking switched off, e.g. chat_template_kwargs {"enable_thinking": false}).
- deepseek_r1 (DeepSeek-R1 and its distills, and models whose chat template opens `<think>` in the
  prompt, as Qwen3's 2507 thinking models: vLLM advises this parser for them too): everything up
  to `</think>` is thought, all of it while `</think>` has not come.
`split(text, final)` reads the whole text made so far and gives (thought, answer), each growing
only at its end as text grows (a possible tag still being written is held back until the next
tokens decide), so a stream sends the deltas of each and a non-streamed answer is the same split of
the final text.
"""
from __future__ import annotations

from .tool_calls import partial_suffix

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, name: str, thought_without_start: bool):
        self.name = name
        self.thought_without_start = thought_without_start  # deepseek_r1: no <think>, still thought

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if not final and len(body) < len(START) and START.startswith(body):
            return "", ""  # may become <think>
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        end = body.find(END)
        if end >= 0 and (opened or self.thought_without_start):
            return body[:end], body[end + len(END):]
        if not (opened or self.thought_without_start):
            return "", text  # qwen3 without <think>: all answer
        keep = 0 if final else partial_suffix(body, END)
        return body[:len(body) - keep], ""


PARSERS = {"qwen3": lambda: ThinkParser("qwen3", thought_without_start=False),
           "deepseek_r1": lambda: ThinkParser("deepseek_r1", thought_without_start=True)}
