"""Incremental detokenization: each new token's text, without re-decoding the whole output and
without ever emitting half of a multi-byte character.

As vLLM does it: decode a short window ending at the new token, ids[prefix_offset:], and the same
window without the new tokens, ids[prefix_offset:read_offset]; the new text is the difference. A
window whose text ends in U+FFFD is a multi-byte character still being spelled out by byte
tokens: nothing is emitted until it completes. Starting the window a few tokens back lets the
tokenizer's joining rules (spaces, merges) see their context.
"""
from __future__ import annotations

CONTEXT = 5  # tokens of context before the first new one


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_ids) - CONTEXT, 0)
        self.read_offset = len(prompt_ids)

    def step(self, ids: list[int], final: bool = False) -> str:
        """The text that the tokens after read_offset add (ids: the whole sequence so far); final:
        the sequence ends here, so an unfinished character is emitted as it is."""
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return full[len(prefix):]


def find_stop(text: str, stops: tuple[str, ...], new: int) -> tuple[int, str] | None:
    """(where, which) of the first stop string in text that the last `new` characters complete
    (each string searched only where it could end in them, as vLLM does: an earlier occurrence,
    passed over while min_tokens held stops back, is not found later); None if none."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(len(text) - new - len(s) + 1, 0))) != -1]
    return min(hits, default=None)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin a stop string (not to be shown yet)."""
    for n in range(min(max((len(s) for s in stops), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0
