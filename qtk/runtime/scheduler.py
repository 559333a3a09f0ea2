"""Iteration-level scheduling (continuous batching with chunked prefill), as in vLLM v1.

Each step spends a token budget (max_num_batched_tokens; with prompt_tokens_per_decode, at least that
many tokens per decoding sequence, up to max_step_tokens):
    1. running sequences that decode: one token each, and the drafts proposed for it (speculative
       decoding: as many as the budget leaves room for);
    2. running sequences still in their prompt: the next chunk of it;
    3. waiting sequences, first come first served, while the budget, max_num_seqs and the KV pool
       allow: a cached prefix first (prefix caching), then a chunk of the rest of the prompt.
So a long prompt is cut into chunks and never stalls the decodes. When the pool cannot give a
running sequence its slots, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (prompt and generated
tokens so far) when it is admitted again. Nothing crashes and no request is lost.

The engine runs the step's Batch, then calls `finish_step` with the sampled tokens: one per sampling
sequence, or, where a step verified drafts, the drafts it kept and the token after them. The KV of the
drafts it rejected stays in slots past the computed tokens, to be overwritten; blocks that hold only
such slots go back to the pool (rollback).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # A step's budget grows with its decodes: max(max_num_batched_tokens, prompt_tokens_per_decode x the
    # decoding sequences), at most max_step_tokens. 0: a fixed budget. (Each decode costs a step about as
    # much as a few prompt tokens, its attention reading its whole context; a fixed small budget under many
    # decodes leaves prompts a shrinking share of each step and first tokens wait.)
    prompt_tokens_per_decode: int = 0
    max_step_tokens: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_tokens_per_decode < 0 or (self.prompt_tokens_per_decode and
                                                 self.max_step_tokens < self.max_num_batched_tokens):
            raise ValueError("prompt_tokens_per_decode must be 0, or positive with max_step_tokens at least "
                             f"max_num_batched_tokens; got {self.prompt_tokens_per_decode} and "
                             f"{self.max_step_tokens} (max_num_batched_tokens {self.max_num_batched_tokens})")

    def budget(self, num_decodes: int) -> int:
        """The token budget of a step whose running sequences include num_decodes decoding ones."""
        grown = min(self.prompt_tokens_per_decode * num_decodes, self.max_step_tokens)
        return max(self.max_num_batched_tokens, grown)


@dataclass
class Batch:
    """One step: each sequence with the number of its tokens the step computes (from
    seq.num_computed_tokens on), the KV block copies to make first, and who was preempted."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def samples(self, i: int) -> bool:
        """The step ends sequence i's known tokens (and its drafts), so its last logits give a new
        token (its last 1 + len(drafts) logits: the verdict on each draft and the token after)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_tokens[i] == len(seq) + len(seq.spec_token_ids)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        budget = self.config.budget(len(decodes))
        for seq in decodes + prefills:
            if seq.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            del seq.spec_token_ids[max(0, n - (len(seq) - seq.num_computed_tokens)):]  # the drafts the budget allows
            n = self._allocate_or_preempt(seq, n, batch)
            if n:
                batch.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            looked_up = not seq.block_table and not seq.scores_prompt
            if looked_up:
                self.bm.lookup_prefix(seq)  # (a cached prefix has no logits to report)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.bm.allocate_slots(seq, n):
                self.bm.free(seq)  # give back a cached prefix it took; it stays first in line
                seq.reset_for_recompute()
                break
            if looked_up:
                self.bm.count_lookup(len(seq), seq.num_cached_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        batch.copies = self.bm.take_copies()
        return batch

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: Batch) -> int:
        """Slots for seq's next n tokens -> the tokens it gets: n; fewer where the pool has no room for its
        drafts (they are dropped before anyone is preempted); 0 if seq itself had to be preempted. The
        most recently admitted others are preempted as needed."""
        while not self.bm.allocate_slots(seq, n):
            if seq.spec_token_ids:
                n -= len(seq.spec_token_ids)
                seq.spec_token_ids.clear()
                continue
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return 0
        return n

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        if seq in batch.seqs:  # already scheduled this step: unschedule it
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_tokens[i]
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def finish_step(self, batch: Batch, sampled: dict[int, int | list[int]]) -> None:
        """After the forward: the computed tokens count, full blocks enter the prefix cache, and
        each sequence whose known tokens are all computed gets its sampled token (seq_id -> token),
        or its tokens (seq_id -> the drafts kept, then one more): a rejected draft's position does
        not count as computed, and blocks past the tokens are given back."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            tokens = sampled.get(seq.seq_id)
            tokens = [tokens] if isinstance(tokens, int) else tokens or []
            rejected = max(0, len(seq.spec_token_ids) - (len(tokens) - 1)) if tokens else 0
            seq.num_computed_tokens += n - rejected
            seq.spec_token_ids = []
            seq.token_ids.extend(tokens)  # before commit: the kept drafts fill blocks it hashes
            self.bm.commit(seq)
            if rejected:
                self.bm.trim(seq)

    def finish(self, seq: Sequence) -> None:
        """seq is done (a stop condition, or aborted): free its blocks and forget it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED
