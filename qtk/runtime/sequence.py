"""Sequence: one generation passing through the engine (tokens, status, block table, progress)."""
from __future__ import annotations

import itertools
import time
from enum import Enum

from .sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV blocks freed; recomputed on readmission)
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """Token ids (prompt, then generated), the KV blocks holding them, and how many are computed.

    num_computed_tokens counts tokens whose K/V are in the cache: a prompt is computed in chunks,
    then one token per decode step. A cached prefix (prefix caching) counts as computed at
    admission. block_hashes[i] is the prefix-cache hash of full block i (the chain over the
    tokens up to its end, with cache_salt).

    spec_token_ids (speculative decoding) are draft tokens proposed to follow token_ids: the next
    step computes them after the last token, and keeps those the target model agrees with."""

    def __init__(self, token_ids: list[int], params: SamplingParams | None = None, block_size: int = 16,
                 cache_salt: str | None = None, request_id: str | None = None):
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params or SamplingParams()
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at admission
        self.text = ""  # the generated text so far (the engine's detokenizer appends to it)
        self.logprobs: list[dict[int, float]] = []  # per generated token, when params.logprobs is set
        self.prompt_logprobs: list[dict[int, float]] = []  # per prompt token after the first (prompt_logprobs)
        self.prompt_rows: list | None = None  # [n, vocab] log-softmax chunks of the prompt (LLM.prompt_log_probs)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # first admission (the queue time ends)
        self.grammar = None  # its structured-outputs matcher (params.structured_outputs), fed each token
        self.spec_token_ids: list[int] = []  # drafts for the next step to verify (speculative decoding)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next step may compute: the known ones not in the cache, then the drafts."""
        return len(self.token_ids) + len(self.spec_token_ids) - self.num_computed_tokens

    def step_token_ids(self, start: int, n: int) -> list[int]:
        """The ids at positions [start, start + n) of its tokens followed by its drafts."""
        if start + n <= len(self.token_ids):
            return self.token_ids[start:start + n]
        return (self.token_ids + self.spec_token_ids)[start:start + n]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logits are wanted (prompt logprobs or rows): every position is computed,
        none taken from the prefix cache."""
        return self.params.prompt_logprobs is not None or self.prompt_rows is not None

    @property
    def is_prefill(self) -> bool:
        """Prompt tokens remain to be computed (a chunked prefill in progress)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preempted: the KV blocks are gone; everything is recomputed on readmission (the
        generated tokens so far are kept and recomputed with the prompt)."""
        self.status = Status.WAITING
        self.block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.spec_token_ids = []

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={len(self)} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, blocks={self.block_table})")
