"""InputProcessor: a request as the engine takes it (vLLM v1's Processor), checked once.

    prompt (text, token ids, {"prompt": ...} / {"prompt_token_ids": ...}) + SamplingParams
        -> EngineRequest(prompt_token_ids, params, cache_salt, grammars)

Every check of a request happens here, before the engine holds anything for it: token ids inside
the vocabulary, a prompt neither empty nor longer than the context, the params within this
engine's limits (logprobs, n, token ids), and the grammar of structured outputs compiled into one
matcher per completion. LLM.add_request runs it; a server runs it through AsyncLLM.process before
its response starts (a bad request is a 400 there) and hands the engine the EngineRequest.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from ..errors import InputError
from .sampling_params import SamplingParams
from .structured_outputs import GrammarEngine


class RequestError(InputError):
    """A request the engine refuses; `field` says which part: "prompt", "params" or
    "structured_outputs" (a server names the request's field from it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # requests share cached KV blocks only under the same salt
    grammars: list | None = None  # structured outputs: one fresh matcher per completion (params.n)


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int, max_num_seqs: int,
                 grammars: GrammarEngine):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the ids a prompt may hold
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.max_num_seqs = max_num_seqs
        self.grammars = grammars

    def process(self, prompt: str | list[int] | dict, params: SamplingParams | None = None) -> EngineRequest:
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt)
        salt = cache_salt(prompt)
        self.check_params(params)
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}", "prompt")
        grammars = None
        if params.structured_outputs is not None:  # a bad schema fails here, before anything is held
            try:
                grammars = self.grammars.matchers(params.structured_outputs, params.n)
            except InputError as e:
                raise RequestError(str(e), "structured_outputs") from e
        return EngineRequest(ids, params, salt, grammars)

    def prompt_ids(self, prompt: str | list[int] | dict) -> list[int]:
        """A prompt as vLLM takes one (text, token ids, {"prompt": text} or {"prompt_token_ids": ids},
        a dict with an optional "cache_salt") as token ids, each checked against the vocabulary: an
        id outside it would fail inside a step, and take the batch's other requests with it."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise RequestError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys "
                                   f"{sorted(prompt)}", "prompt")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"a prompt is text, a list of token ids or a dict holding one; got "
                               f"{type(prompt).__name__}", "prompt")
        ids = []
        for i, t in enumerate(prompt):
            try:
                ids.append(operator.index(t))
            except TypeError:
                raise RequestError(f"token ids are integers; position {i} of the prompt holds {t!r}",
                                   "prompt") from None
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {ids[bad]} (position {bad} of the prompt) is outside this model's "
                               f"vocabulary: ids run from 0 to {self.vocab_size - 1}", "prompt")
        return ids

    def check_params(self, p: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the limits of this model and engine."""
        for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
            if k is not None and k > self.max_logprobs:
                raise RequestError(f"{name}={k} is more than max_logprobs={self.max_logprobs} (an LLM(...) "
                                   "argument)", "params")
        if p.n > self.max_num_seqs:
            raise RequestError(f"n={p.n} is more than max_num_seqs={self.max_num_seqs}, the sequences "
                               "this engine runs at once", "params")
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"{name}: token ids {bad[:8]} are outside this model's vocabulary: ids run "
                                   f"from 0 to {self.vocab_size - 1}", "params")


def cache_salt(prompt) -> str | None:
    """A prompt dict's cache_salt (vLLM's): requests share cached KV blocks only under the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise RequestError(f"cache_salt must be a non-empty string, got {salt!r}", "prompt")
    return salt
