"""Incremental detokenization: each new token's text, without re-decoding the whole output and
without ever emitting half of a multi-byte character.

As vLLM does it: decode a short window ending at the new token, ids[prefix_offset:], and the same
window without the new tokens, ids[prefix_offset:read_offset]; the new text is the difference. A
window whose text ends in U+FFFD is a multi-byte character still being spelled out by byte
tokens: nothing is emitted until it completes. Starting the window a few tokens back lets the
tokenizer's joining rules (spaces, merges) see their context.

For a fast tokenizer whose decode is its Rust backend's alone (fast_backend), the same algorithm
runs in the backend (tokenizers' DecodeStream, as vLLM v1's fast detokenizer): 2 us a token against
22 for two transformers decodes, which was most of an engine step's host time at 64 sequences.
"""
from __future__ import annotations

import functools

CONTEXT = 5  # tokens of context before the first new one


@functools.cache
def _decode_stream():
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return DecodeStream


def _fast_tokenizer_base():
    """transformers' base class of tokenizers backed by tokenizers.Tokenizer (renamed in transformers 5)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend
    except ImportError:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast


def fast_backend(tokenizer):
    """The tokenizers.Tokenizer that decodes exactly as tokenizer.decode does, or None. Conservative:
    a fast tokenizer whose class keeps the base class's decode (a subclass may rewrite the text, as
    CPM's does), with no clean_up_tokenization_spaces, and whose special tokens (the ones
    skip_special_tokens drops) the backend marks special too."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if _decode_stream() is None or backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    base, cls = _fast_tokenizer_base(), type(tokenizer)
    if not isinstance(tokenizer, base) or cls.decode is not base.decode or cls._decode is not base._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return backend if set(getattr(tokenizer, "all_special_ids", ())) <= special else None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True, backend=None):
        """backend: fast_backend(tokenizer), to decode in it (None: through tokenizer.decode)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_ids) - CONTEXT, 0)
        self.read_offset = len(prompt_ids)
        self.fed = len(prompt_ids)  # tokens the stream has seen
        self.backend, self.stream = backend, None
        context = prompt_ids[self.prefix_offset:]
        # a prompt that ends inside a character: the stream would emit the prompt's own text with it
        if backend is not None and not backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            self.stream = _primed_stream(backend, context, skip_special_tokens)

    def step(self, ids: list[int], final: bool = False) -> str:
        """The text that the tokens after read_offset add (ids: the whole sequence so far); final:
        the sequence ends here, so an unfinished character is emitted as it is."""
        if self.stream is not None:
            try:
                pieces = [self.stream.step(self.backend, t) for t in ids[self.fed:]]
            except Exception:  # noqa: BLE001 (the stream insists that each text extends the last, which
                # byte-fallback decoders break, vLLM's issue 17448): this sequence goes on the path below,
                # whose offsets are still those of the last emission
                self.stream = None
            else:
                self.fed = len(ids)
                text = "".join(p for p in pieces if p)
                if text:  # the stream emitted: its window moved as the one below would have
                    self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                    return text
                if not final:
                    return ""  # (an unfinished character; or nothing new, as a skipped special token)
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return full[len(prefix):]


def _primed_stream(backend, context: list[int], skip_special_tokens: bool):
    """A DecodeStream that has seen `context` (the prompt's last tokens, whose text it does not emit)."""
    stream_type = _decode_stream()
    try:
        return stream_type(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no ids; feed them, and drop their text
        stream = stream_type(skip_special_tokens=skip_special_tokens)
        for t in context:
            stream.step(backend, t)
        return stream


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
