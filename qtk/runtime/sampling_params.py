"""SamplingParams: how one request samples, with vLLM's names and defaults, validated at construction."""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

from ..errors import InputError
from .structured_outputs import StructuredOutputsParams


SAMPLING_EPS = 1e-5  # temperatures below it are greedy, as in vLLM (dividing by them overflows float32)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 (below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = all tokens
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: the same tokens alone or in any batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token (the sampled one is always given)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else (OpenAI's)
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to match

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # None as vLLM allows: no stop strings
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # ints (numpy's too), never floats or bools: a float top_k failed inside a step
                object.__setattr__(self, name, _integer(name, value))
        object.__setattr__(self, "stop_token_ids", tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids or ()))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real):
                raise InputError(f"{name} must be a number, got {getattr(self, name)!r}")
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be finite, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InputError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            bias = {}
            for t, b in self.logit_bias.items():
                if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b):
                    raise InputError(f"logit_bias values must be finite numbers; token {t!r} has {b!r}")
                bias[_integer("logit_bias token id", t)] = float(b)
            object.__setattr__(self, "logit_bias", bias or None)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.seed is None or -2 ** 63 <= self.seed < 2 ** 64, f"seed must fit in 64 bits, got {self.seed}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (all), 0 (all) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _integer(name: str, value) -> int:
    if isinstance(value, bool):
        raise InputError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer, got {value!r}") from None
