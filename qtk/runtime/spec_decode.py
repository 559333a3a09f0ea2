"""Speculative decoding: drafts proposed for each decoding sequence, verified by the target in one step.

A decode step at small batch reads every weight to make one token per sequence. With speculation,
a proposer guesses the next k tokens of a sequence; the next step computes the sequence's last token
and the k drafts together (one forward, causal over them, as a prompt chunk), and the
RejectionSampler keeps the drafts the target agrees with and adds the target's own next token: 1 to
k + 1 tokens for about the price of one step. Greedy output is exactly plain decoding's; sampled
output has exactly the target's distribution.

    speculative_config = {"method": "ngram", "num_speculative_tokens": 5,
                          "prompt_lookup_min": 2, "prompt_lookup_max": 5}   # vLLM's names
    speculative_config = {"model": "build/default", "num_speculative_tokens": 5}
    speculative_config = {"model": "self-quantized"}

Proposers:
    ngram         prompt lookup: the last n tokens (prompt_lookup_max down to prompt_lookup_min) searched
                  for earlier in the prompt and the output; the tokens that followed their latest
                  earlier occurrence are the drafts. Free to run; it pays where the output copies its
                  input (edits, code, retrieval answers).
    draft_model   a model that shares the target's tokenizer drafts greedily, k decode steps on its own
                  paged cache (DraftModelProposer), every sequence of the step in one batch. "self-
                  quantized" is the target's own 4-bit twin, made at load (round-to-nearest int4,
                  cached): it reads a fraction of the target's bytes per step and agrees with it on
                  most tokens, so the target serves its exact output at nearly the twin's speed.

The number of drafts adapts per sequence (AdaptiveDraftLength): each sequence's acceptance rate,
measured as it goes, sets the k that maximizes the tokens a step yields per unit of its cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import InputError
from .sequence import Sequence

METHODS = ("ngram", "draft_model")
# What verifying one more token adds to a decode step, relative to the step: the bundled model in float32 on
# 2 cores (Intel Xeon, AMX), a batch-1 step of 1 row 13.1 ms, of 4 rows 16.6 ms: +9% a row.
VERIFY_COST_PER_TOKEN = 0.1
SELF_QUANTIZED = "self-quantized"


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: method, model (draft_model: the draft's path or name, or
    "self-quantized"; a model given means draft_model), num_speculative_tokens (the most drafts per
    step), prompt_lookup_min / prompt_lookup_max (ngram: the n-gram lengths searched; vLLM's default 5
    for both when neither is given, the other's value when one is)."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self):
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", method)
        if method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise InputError('speculative_config method draft_model needs "model": the draft\'s path or name, '
                             'or "self-quantized"')
        if method == "ngram" and self.model is not None:
            raise InputError("speculative_config method ngram takes no model (give method draft_model, or leave "
                             "method out, to draft with one)")
        if self.method not in METHODS:
            raise InputError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"speculative_config {name} must be an integer of at least 1, got {value!r}")
        if lo > hi:
            raise InputError(f"speculative_config prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")

    @classmethod
    def parse(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's dict (LLM(speculative_config=...), --speculative-config JSON); unknown keys are
        an InputError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InputError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InputError(f"speculative_config has unknown keys {unknown}; qtk takes {sorted(known)}")
        return cls(**value)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens, for the
    longest n in [min_n, max_n] that occurs earlier; [] if none does."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)  # starts 0 .. total - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))  # the suffix itself is not among them
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


@dataclass
class AdaptiveDraftLength:
    """Per sequence, the number of drafts that maximizes the tokens one step yields per unit of its cost.

    With a per-draft acceptance rate a, k drafts yield 1 + a + a^2 + ... + a^k tokens in expectation
    (the drafts kept, then the target's token); the step costs about 1 + c k plain decode steps (c: what
    one more draft costs, to propose and to verify, relative to a plain step; SpecDecoder.observe
    measures it). a is each sequence's own, kept as counts with a prior (one kept, one rejected), updated
    after each step it verified. Where no k pays (a below c), none is proposed but one now and then
    (after `probe_after` steps, then twice as many each time: 8, 16, 32, ...), so that a sequence whose
    text turns predictable is noticed, at a cost that fades."""

    max_k: int
    cost_per_token: float = VERIFY_COST_PER_TOKEN
    kept: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)
    decay: float = 0.9  # older steps count less: a sequence that starts copying is seen soon
    probe_after: int = 8

    def rate(self, seq_id: int) -> float:
        kept, rejected = self.kept.get(seq_id, 1.0), self.rejected.get(seq_id, 1.0)
        return kept / (kept + rejected)

    def length(self, seq_id: int) -> int:
        a = self.rate(seq_id)
        best_k, best = 0, 1.0  # no drafts: one token for one plain step
        for k in range(1, self.max_k + 1):
            gain = sum(a ** i for i in range(k + 1)) / (1 + self.cost_per_token * k)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self.skipped[seq_id] = skipped = self.skipped.get(seq_id, 0) + 1
            probe = skipped >= self.probe_after and skipped & (skipped - 1) == 0  # 8, 16, 32, ...
            return 1 if probe else 0
        return best_k

    def update(self, seq_id: int, proposed: int, kept: int) -> None:
        self.kept[seq_id] = self.kept.get(seq_id, 1.0) * self.decay + kept
        self.rejected[seq_id] = self.rejected.get(seq_id, 1.0) * self.decay + (kept < proposed)

    def forget(self, seq_id: int) -> None:
        self.kept.pop(seq_id, None)
        self.rejected.pop(seq_id, None)
        self.skipped.pop(seq_id, None)


@dataclass
class SpecDecodeStats:
    """Counters for /metrics, under vLLM's names (spec_decode_num_drafts, ..._num_draft_tokens,
    ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos)."""

    num_drafts: int = 0  # steps of a sequence that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts kept at position i

    def record(self, proposed: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += kept
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for i in range(kept):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: the drafts kept and the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    """The engine's speculation: proposes drafts for the decoding sequences before a step, records
    what the step kept after it. draft: method draft_model's proposer (draft_model.DraftModelProposer)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.lengths = AdaptiveDraftLength(config.num_speculative_tokens)
        self.stats = SpecDecodeStats()
        self.plain_seconds: dict[int, float] = {}  # a step without drafts, by its number of sequences

    def propose(self, seqs: list[Sequence]) -> None:
        """Drafts for each sequence ready to decode (its prompt computed, one token pending), within its
        max_tokens and the model's length; its grammar keeps the prefix of them it allows."""
        c = self.config
        wants = []
        for seq in seqs:
            seq.spec_token_ids = []
            if seq.num_computed_tokens != len(seq) - 1:
                continue
            p = seq.params
            room = self.max_model_len - len(seq)  # the last draft's position stays under max_model_len
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_generated_tokens - 1)
            # a seeded sampled request gets the same drafts run after run: its draws depend on them, and the
            # adaptive length on step timings; so it drafts the configured number
            fixed = p.seed is not None and not p.greedy
            k = min(c.num_speculative_tokens if fixed else self.lengths.length(seq.seq_id), room)
            if k >= 1:
                wants.append((seq, k))
        if self.draft is not None:
            proposed = self.draft.propose(wants)
        else:
            proposed = {seq.seq_id: ngram_lookup(np.asarray(seq.token_ids, dtype=np.int64), c.prompt_lookup_min,
                                                 c.prompt_lookup_max, k) for seq, k in wants}
        for seq, _ in wants:
            drafts = proposed.get(seq.seq_id, [])
            if drafts and seq.grammar is not None:
                drafts = drafts[:seq.grammar.validate_tokens(drafts)]
            seq.spec_token_ids = drafts

    def record(self, seq: Sequence, proposed: int, kept: int) -> None:
        self.stats.record(proposed, kept)
        self.lengths.update(seq.seq_id, proposed, kept)

    def observe(self, propose_seconds: float, step_seconds: float, drafts: list[int]) -> None:
        """A step's times (proposing; its forward and verification) and the drafts of each of its sequences:
        what one more draft position costs, relative to a plain step of as many sequences (the draft
        lengths' c). A step without drafts times the plain step (per number of sequences); one with drafts
        costs its drafting (a draft model: its decode step, DraftModelProposer.step_seconds, per position;
        a shadow catching up pays more once, which drafting every step does not) plus what its forward
        took over the plain step's, spread over its draft positions."""
        k = max(drafts, default=0)
        plain = self.plain_seconds.get(len(drafts))
        if k == 0:
            self.plain_seconds[len(drafts)] = step_seconds if plain is None else 0.8 * plain + 0.2 * step_seconds
            return
        if plain is None:  # not timed yet: the verified drafts' share taken as VERIFY_COST_PER_TOKEN each
            plain = step_seconds / (1 + VERIFY_COST_PER_TOKEN * sum(drafts) / len(drafts))
        drafting = propose_seconds
        if self.draft is not None and self.draft.step_seconds is not None:
            drafting = self.draft.step_seconds * k
        cost = (drafting + max(0.0, step_seconds - plain)) / (plain * k)
        self.lengths.cost_per_token = 0.8 * self.lengths.cost_per_token + 0.2 * cost

    def forget(self, seq: Sequence) -> None:
        self.lengths.forget(seq.seq_id)
        if self.draft is not None:
            self.draft.forget(seq)
