"""Needle in a haystack: can the model still find one fact buried in a long context?

Long context is what weight and KV-cache quantization break first (errors add up over thousands
of positions), so the gates check retrieval where perplexity on short windows cannot see it.

For each haystack length L (tokens of filler) and depth d (0% = the needle opens the haystack,
100% = it closes it), a case is built as the passkey-retrieval test of Mohtashami & Jaggi
(Landmark Attention, 2023) and the needle-in-a-haystack test popularized by G. Kamradt:
  1. filler: L tokens of running text (the built-in corpus's evaluation split, or a given text),
     cut from a seeded offset, so each case reads different text;
  2. the needle, "The pass key is 48213. Remember it. 48213 is the pass key.", a fresh 5-digit
     key per case, inserted at the first sentence end at or after d% of the filler (where none
     follows, the last one before it);
  3. the question after the haystack: "What is the pass key?", through the chat template when the
     model has one.
Every case runs in one batch on qtk's runtime, greedily; a case is retrieved when the first
number in the answer is the key (exact match). Scores: per (length, depth) cell, per length, and
overall. Deterministic for a seed: the same keys, offsets and prompts for every model sharing a
tokenizer, so a baseline and a candidate answer the same questions.
"""
from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field

from ..chat_template import has_template, prompt_ids
from ..errors import InputError

log = logging.getLogger(__name__)

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.")
QUESTION = "What is the pass key? Answer with the number only."
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)


@dataclass(frozen=True)
class NeedleCase:
    length: int  # haystack tokens
    depth: int  # percent
    key: str
    prompt: list[int]  # token ids, question included


@dataclass
class NeedleResult:
    lengths: list[int]
    depths: list[int]
    cells: dict[tuple[int, int], float]  # (length, depth) -> share retrieved
    samples: int
    answers: list[dict] = field(repr=False, default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(self.cells.values()) / len(self.cells)

    def by_length(self) -> dict[int, float]:
        return {n: sum(self.cells[n, d] for d in self.depths) / len(self.depths) for n in self.lengths}

    def to_dict(self, answers: bool = False) -> dict:
        out = {"accuracy": self.accuracy, "lengths": self.lengths, "depths": self.depths, "samples": self.samples,
               "by_length": {str(k): v for k, v in self.by_length().items()},
               "cells": [{"length": n, "depth": d, "accuracy": a} for (n, d), a in self.cells.items()]}
        if answers:
            out["answers"] = self.answers
        return out

    def __str__(self) -> str:
        per = ", ".join(f"{n}: {a:.0%}" for n, a in self.by_length().items())
        return f"needle: {self.accuracy:.1%} retrieved over {len(self.cells)} cells x {self.samples}; by length {per}"


def default_lengths(max_model_len: int) -> list[int]:
    """Doubling from 256 up to what fits the context with the question and the answer."""
    lengths, n = [], 256
    while n <= max_model_len - 128:
        lengths.append(n)
        n *= 2
    return lengths or [max(16, max_model_len - 128)]


def filler_tokens(tokenizer, filler: str | None) -> list[int]:
    """The filler text (the built-in corpus's evaluation split unless given) as token ids."""
    from ..data import builtin_texts

    text = filler if filler is not None else "\n\n".join(builtin_texts("evaluation"))
    return tokenizer(text, add_special_tokens=False).input_ids


def build_cases(tokenizer, lengths: list[int], depths: list[int], samples: int = 1, seed: int = 0,
                filler: str | None = None, stream: list[int] | None = None) -> list[NeedleCase]:
    """stream: filler_tokens(tokenizer, filler), where the caller has it already."""
    for d in depths:
        if not 0 <= d <= 100:
            raise InputError(f"needle depths are percents in [0, 100], got {d}")
    if not lengths or not depths:
        raise InputError(f"the needle needs at least one haystack length and one depth, got lengths {lengths}, "
                         f"depths {depths}")
    if any(n < 16 for n in lengths):
        raise InputError(f"needle haystack lengths must be at least 16 tokens, got {sorted(lengths)}")
    if stream is None:
        stream = filler_tokens(tokenizer, filler)
    if len(stream) < max(lengths) + 1:
        raise InputError(f"--lengths {max(lengths)} is longer than the filler text allows ({len(stream)} tokens): "
                         f"give --lengths (a gates file: args.lengths) up to {len(stream) - 1}, or a longer filler")
    chat = has_template(tokenizer)
    rng = random.Random(seed)
    cases = []
    for n in lengths:
        for d in depths:
            for _ in range(samples):
                key = str(rng.randint(10000, 99999))
                start = rng.randrange(len(stream) - n)
                hay = tokenizer.decode(stream[start:start + n])
                at = _sentence_end(hay, len(hay) * d // 100)
                body = f"{INTRO}\n\n{hay[:at]} {NEEDLE.format(key=key)} {hay[at:]}\n\n{QUESTION}"
                if chat:
                    ids = prompt_ids(tokenizer, [{"role": "user", "content": body}])
                else:
                    ids = tokenizer(body + "\nThe pass key is").input_ids
                cases.append(NeedleCase(n, d, key, list(ids)))
    return cases


def _sentence_end(text: str, at: int) -> int:
    """The first position at or after `at` just past a sentence end; where no sentence ends after
    `at`, the last one before it (else `at` itself), so a needle meant for 25% never lands at 100%."""
    if at <= 0 or at >= len(text):
        return max(0, min(at, len(text)))
    m = re.compile(r"[.!?]\s").search(text, at)
    if m:
        return m.start() + 1
    before = [e.start() + 1 for e in re.finditer(r"[.!?]\s", text[:at])]
    return before[-1] if before else at


def retrieved(answer: str, key: str) -> bool:
    m = re.search(r"\d+", answer)
    return m is not None and m.group() == key


def needle(llm, lengths: list[int] | None = None, depths: list[int] | None = None, samples: int = 1, seed: int = 0,
           filler: str | None = None, max_tokens: int = 16) -> NeedleResult:
    """Every (length, depth, sample) case as one batch on the engine `llm` (qtk.LLM), greedily."""
    from ..runtime.sampling_params import SamplingParams

    stream = filler_tokens(llm.tokenizer, filler)  # once: the default lengths and the cases both read it
    # sorted sets: a repeated cell would count twice
    lengths = sorted(set(lengths or _fitting_default_lengths(llm.max_model_len, len(stream))))
    depths = sorted(set(DEFAULT_DEPTHS if depths is None else depths))
    cases = build_cases(llm.tokenizer, lengths, depths, samples, seed, stream=stream)
    too_long = [c for c in cases if len(c.prompt) + max_tokens > llm.max_model_len]
    if too_long:
        raise InputError(f"a needle prompt of {len(too_long[0].prompt)} tokens (haystack {too_long[0].length}) does "
                         f"not fit max_model_len {llm.max_model_len} with the answer; use shorter lengths")
    outs = llm.generate([c.prompt for c in cases], SamplingParams(max_tokens=max_tokens, temperature=0))
    hits: dict[tuple[int, int], int] = {}
    answers = []
    for c, out in zip(cases, outs):
        text = out.outputs[0].text
        ok = retrieved(text, c.key)
        hits[c.length, c.depth] = hits.get((c.length, c.depth), 0) + ok
        answers.append({"length": c.length, "depth": c.depth, "key": c.key, "answer": text, "retrieved": ok})
    cells = {(n, d): hits[n, d] / samples for n in lengths for d in depths}
    return NeedleResult(lengths, depths, cells, samples, answers)


def _fitting_default_lengths(max_model_len: int, filler_len: int) -> list[int]:
    """default_lengths for the context, without those longer than the filler text (filler_len tokens) provides."""
    lengths, available = default_lengths(max_model_len), filler_len - 1
    fitting = [n for n in lengths if n <= available] or [available]
    if fitting != lengths:
        log.info("needle: the filler text has %d tokens, so the default haystack lengths stop at %d (the context "
                 "would take %d); a longer filler gives longer haystacks", available + 1, fitting[-1], lengths[-1])
    return fitting
