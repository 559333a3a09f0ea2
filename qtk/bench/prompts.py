"""The prompt sets of `qtk bench engine` and `qtk bench serve`, by the prompt lengths traffic has
(docs/benchmarks.md says which figure comes from which):

    builtin         16 short chat questions (~30 tokens with the chat template), repeated
    fixed:N         prompts of N tokens: windows of the built-in text (Python's documentation
                    topics, evaluation split) at seeded offsets
    random:LO-HI    the same, each length drawn uniformly from LO..HI (vLLM's random dataset's
                    input_len with a range ratio, on real text)
    conversation    chats with long histories: 1-8 earlier turns (built-in text passages as user
                    messages and assistant replies) before a last short question (the bundled
                    model's tokenizer and template: 177 to 1748 tokens, mean 822, over 16)
    edit            edits: a prose passage of the built-in text (400 to 1000 characters, its line
                    wraps undone) to be rewritten with one word replaced and nothing else changed
                    (where speculative decoding by prompt lookup pays: the answer copies the prompt)

The engine takes token ids (`token_prompts`: a window's ids as they are; a chat through the
model's chat template); a server takes messages (`conversations`: a window decoded to one user
message, about N tokens as the given tokenizer counts, plus the server's chat template).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..chat_template import prompt_ids
from ..data import builtin_texts, token_stream
from ..errors import InputError

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn leaves falling.",
    "Explain in one sentence why the sky is blue, for a child.", "List three uses of a paperclip.",
    "What is 17 times 23?", "Give me a tip for sleeping better.", "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.", "What does a CPU do?", "Name a famous painting by Van Gogh.",
    "How many legs does a spider have?", "Suggest a name for a pet goldfish.", "What is photosynthesis?",
    "Write one sentence about the ocean.", "Why do leaves change color in the fall?",
    "What is the boiling point of water?",
]
SPECS = "builtin, fixed:N, random:LO-HI, conversation or edit"
FOLLOW_UPS = ["Summarize the above in two sentences.", "What is the main point of this?",
              "Which part of this matters most in practice, and why?", "Give one example of what was described."]


@dataclass(frozen=True)
class PromptSet:
    kind: str  # "builtin" | "fixed" | "random" | "conversation" | "edit"
    lo: int = 0  # fixed / random: prompt tokens, LO..HI
    hi: int = 0

    @staticmethod
    def parse(spec: str, option: str = "--prompts") -> PromptSet:
        """builtin | fixed:N | random:LO-HI | conversation; InputError naming the option otherwise."""
        kind, _, arg = spec.partition(":")
        try:
            if kind in ("builtin", "conversation", "edit") and not arg:
                return PromptSet(kind)
            if kind == "fixed":
                n = int(arg)
                lo, hi = n, n
            elif kind == "random":
                lo, hi = (int(x) for x in arg.split("-"))
            else:
                raise ValueError
        except ValueError:
            raise InputError(f"{option} {spec!r}: give {SPECS}") from None
        if not 1 <= lo <= hi:
            raise InputError(f"{option} {spec!r}: lengths must be positive, LO <= HI")
        return PromptSet(kind, lo, hi)

    def __str__(self) -> str:
        return {"fixed": f"fixed:{self.lo}", "random": f"random:{self.lo}-{self.hi}"}.get(self.kind, self.kind)


def _windows(tokenizer, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """A window of the built-in evaluation text per length, at seeded offsets."""
    stream = token_stream(tokenizer, builtin_texts("evaluation")).tolist()
    if max(lengths) > len(stream):
        raise InputError(f"prompts of {max(lengths)} tokens: the built-in text has {len(stream)}")
    return [stream[(s := rng.randrange(len(stream) - n + 1)):s + n] for n in lengths]


def _chat(rng: random.Random, passages: list[str], i: int) -> list[dict]:
    """One conversation: 1-8 earlier turns of built-in passages, then a short question."""
    messages = []
    for _ in range(rng.randint(1, 8)):
        user, reply = rng.sample(passages, 2)
        messages += [{"role": "user", "content": f"{user}\n\n{rng.choice(FOLLOW_UPS)}"},
                     {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def _passages() -> list[str]:
    """Paragraphs of the built-in evaluation text, 200 to 1500 characters (~50 to ~400 tokens)."""
    paragraphs = (p.strip() for t in builtin_texts("evaluation") for p in t.split("\n\n"))
    return [p for p in paragraphs if 200 <= len(p) <= 1500]


def edit_request(passage: str) -> str:
    """Rewrite `passage` with its first word of 6+ letters replaced, and nothing else changed."""
    word = next((w for w in re.findall(r"\b[A-Za-z]{6,}\b", passage)), "the")
    return (f'Rewrite the following paragraph, replacing the word "{word}" with "element". Change nothing '
            f"else.\n\n{passage}")


def conversations(tokenizer, spec: PromptSet, n: int, seed: int = 0) -> list[list[dict]]:
    """n chats of the set, for a chat endpoint."""
    rng = random.Random(seed)
    if spec.kind == "builtin":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    if spec.kind == "edit":  # prose: passages whose lines wrap text, not code or tables
        passages = [" ".join(p.split()) for p in _passages()
                    if 400 <= len(p) <= 1000 and not re.search(r"::=|>>>|\+--|\.\. |^\s{6,}\S", p, re.M)]
        rng.shuffle(passages)
        return [[{"role": "user", "content": edit_request(passages[i % len(passages)])}] for i in range(n)]
    if spec.kind == "conversation":
        passages = _passages()
        return [_chat(rng, passages, i) for i in range(n)]
    lengths = [rng.randint(spec.lo, spec.hi) for _ in range(n)]
    return [[{"role": "user", "content": tokenizer.decode(w)}] for w in _windows(tokenizer, lengths, rng)]


def token_prompts(tokenizer, spec: PromptSet, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of the set as token ids, for the engine: windows as they are, chats through the
    model's chat template."""
    if spec.kind in ("fixed", "random"):
        rng = random.Random(seed)
        return _windows(tokenizer, [rng.randint(spec.lo, spec.hi) for _ in range(n)], rng)
    return [prompt_ids(tokenizer, conv) for conv in conversations(tokenizer, spec, n, seed)]
