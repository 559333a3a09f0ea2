"""Structured outputs: a grammar per sequence masks the logits at every step, so the text always
parses (vLLM's StructuredOutputsParams; OpenAI's response_format).

    params = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))

The grammar engine is llguidance (benchmarks/results/grammar_backends.md: every random walk over
six schemas produced valid, schema-conforming JSON where xgrammar 0.2.8 let through raw control
characters and unescaped pattern text; it compiles a schema in about a millisecond, so schemas
per request need no cache; it refuses, with a message, the keywords it cannot enforce, which the
server returns as a 400).

One step, for the rows whose sequence has a grammar (the others are untouched):
  1. each matcher writes its allowed tokens into a row of an int32 bitmask [rows, V/32]
     (bit j of word i allows token 32 i + j), all matchers at once on llguidance's threads;
  2. the bitmask becomes an additive bias (0 allowed, -inf not) through a byte -> 8 floats
     table, added to those logit rows (0.3 ms for 16 rows of 49k tokens on 2 AVX2 cores);
  3. after sampling, each matcher consumes its token. Once the grammar cannot continue (the
     closing brace of a JSON document) the sequence finishes with "stop", without an EOS step.

JSON is compiled with compact separators and no free whitespace by default: a small model
allowed free whitespace can loop on newlines until max_tokens and never close the document. A
schema can override this, as llguidance documents, with "x-guidance": {"whitespace_flexible": true}.
A oneOf whose branches llguidance cannot prove disjoint is refused (a 400) rather than enforced as
anyOf, which xgrammar (vLLM's default) does silently; "x-guidance": {"coerce_one_of": true} in the
schema asks for anyOf, and the 400 says so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import InputError

JSON_DEFAULTS = {"whitespace_flexible": False}
# llguidance's own message names its option, not where a request sets it
ONE_OF_HINT = (' (a schema may carry "x-guidance": {"coerce_one_of": true} to have its oneOf enforced as anyOf, '
               "as xgrammar does: the output then matches at least one branch)")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one of a JSON Schema, any JSON object, a regex, one of
    a list of strings, or a Lark grammar (llguidance's syntax; GBNF is converted)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InputError("structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InputError("structured outputs: choice must be a non-empty list of non-empty strings")

    def grammar_text(self) -> str:
        """The llguidance grammar (a JSON string), or InputError naming what is wrong."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.json_object:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, dict):
                    raise InputError(f"a JSON schema must be an object, got {type(schema).__name__}")
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return grammar_from("choice", json.dumps(list(self.choice)))
            return grammar_from("grammar", self.grammar)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise InputError(f"structured outputs: {e}") from e
        except RecursionError:
            raise InputError("structured outputs: the schema is nested too deeply") from None


def short(error: str, limit: int = 300) -> str:
    """llguidance's message without its internals: the first line, at most `limit` characters.
    A regex's message says what is wrong on a later `error: ...` line (the first is only "regex
    parse error:"), which is kept."""
    lines = [line.strip() for line in error.strip().splitlines()]
    first = lines[0] if lines else "grammar error"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    if reason is not None:
        first = f"{first.rstrip(':')}: {reason[len('error:'):].strip()}"
    return first if len(first) <= limit else first[:limit] + "..."


class GrammarEngine:
    """llguidance for one model: its tokenizer's view (built on first use, about 0.4 s), the
    matchers' thread pool, and the step's mask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], num_threads: int | None = None):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_threads = num_threads
        self._tokenizer = None
        self._executor = None
        # byte b of the bitmask -> the bias of its 8 tokens (bit j set: token j allowed, bias 0)
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        self._bias_table = torch.where(bits.bool(), 0.0, float("-inf"))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
            except ValueError as e:
                raise InputError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {e}") from e
            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
        return self._tokenizer

    def check(self, spec: StructuredOutputsParams) -> str:
        """The grammar for spec, or InputError with llguidance's message (an unsupported keyword,
        an invalid regex): called at the edge so a bad schema is a 400 before anything runs."""
        grammar = spec.grammar_text()
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            hint = ONE_OF_HINT if "coerce_one_of" in error else ""
            raise InputError(f"structured outputs: {short(error)}{hint}")
        probe = self._matcher(grammar)  # some grammars fail only when run: a left-recursive rule, an empty regex
        allowed = probe.compute_bitmask()
        if probe.is_error():
            raise InputError(f"structured outputs: the grammar fails on its first step: {short(probe.get_error())}")
        if not any(allowed) and not probe.is_accepting():
            raise InputError("structured outputs: the grammar matches no text (no token can start it)")
        return grammar

    def _matcher(self, grammar: str):
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InputError(f"structured outputs: {short(m.get_error())}")
        return m

    def matchers(self, spec: StructuredOutputsParams, n: int) -> list:
        """n fresh matchers for spec, checked once (a sequence each: n > 1 completions each get their own)."""
        grammar = self.check(spec)
        return [self._matcher(grammar) for _ in range(n)]

    def matcher(self, spec: StructuredOutputsParams):
        return self.matchers(spec, 1)[0]

    def mask(self, logits: torch.Tensor, rows: list[tuple[object, int]]) -> None:
        """Forbid, in place, every token row's matcher does not allow: rows = [(matcher, row)]."""
        import llguidance.torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, k) for k, (m, _) in enumerate(rows)],
                                                     bitmask)
        index = torch.tensor([r for _, r in rows], dtype=torch.long, device=logits.device)
        bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), self._bias_table)
        bias = bias.view(len(rows), -1)[:, :logits.shape[-1]].to(logits.device, logits.dtype)
        logits.index_add_(0, index, bias)

    def accept(self, pairs: list[tuple[object, int]]) -> None:
        """Each matcher consumes its sampled token (a refused one leaves the matcher in error,
        which the engine reports as that request's failure)."""
        self._executor.consume_token_par(pairs)
