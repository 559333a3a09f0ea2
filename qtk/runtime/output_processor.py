"""OutputProcessor: each step's new tokens as RequestOutputs (vLLM v1's OutputProcessor).

For every sequence that got a token: its stop check (EOS, a stop token, a stop string, a complete
grammar, the length), its text (incremental detokenization, with the text that may begin a stop
string held back until the next tokens decide), its logprobs, and a snapshot of its request's
RequestOutput. A finished sequence is handed back to the engine to free its blocks.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, fast_backend, find_stop, held_back
from .sequence import Sequence
from .structured_outputs import short

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    logprobs: list[dict[int, float]] | None = None  # per token: the sampled one's and the top-k's


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first token, as vLLM
    queue_time: float | None = None  # seconds from add_request to the first scheduled step
    error: str | None = None  # the request failed inside the engine (the engine goes on)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finish_reason is not None for o in self.outputs)

    def snapshot(self) -> RequestOutput:
        """A copy the engine will not change afterwards (lists copied, entries shared). Built field by
        field: dataclasses.replace took 3x as long, for every request at every step."""
        outs = [CompletionOutput(index=o.index, text=o.text, token_ids=list(o.token_ids), finish_reason=o.finish_reason,
                                 logprobs=None if o.logprobs is None else list(o.logprobs)) for o in self.outputs]
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, outputs=outs,
                             prompt_logprobs=self.prompt_logprobs, queue_time=self.queue_time, error=self.error)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self._backend = fast_backend(tokenizer)  # decoding in Rust where it gives the same text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, tuple[RequestOutput, list[Sequence]]] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add(self, out: RequestOutput, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._detok[s.seq_id] = IncrementalDetokenizer(self.tokenizer, out.prompt_token_ids,
                                                           s.params.skip_special_tokens, self._backend)
        self.requests[out.request_id] = (out, seqs)

    def pop(self, request_id: str) -> list[Sequence]:
        """Forget a request (aborted, failed); its sequences, for the engine to free (none for an
        unknown or finished one)."""
        _, seqs = self.requests.pop(request_id, (None, []))
        for s in seqs:
            self._detok.pop(s.seq_id, None)
        return seqs

    def process(self, sampled: list[Sequence], free: Callable[[Sequence], None],
                counts: list[int] | None = None) -> list[RequestOutput]:
        """A snapshot of every request that got a token (its text and tokens so far; `finished` once
        every completion has a finish_reason); free(seq) for each sequence that ended. counts: the
        new tokens of each sequence (1 each if not given; several where a step kept drafts)."""
        updated: dict[str, RequestOutput] = {}
        for seq, count in zip(sampled, counts or [1] * len(sampled)):
            if seq.request_id not in self.requests:
                continue  # a sibling (n > 1) of a request aborted or failed in this step
            try:
                out = self._update(seq, self._stop_reason_over(seq, count), free)
            except Exception as e:  # this request's failure (its text, its stop check): it alone ends
                log.exception("request %s failed", seq.request_id)
                out = self.requests[seq.request_id][0].snapshot()
                out.error = f"{type(e).__name__}: {e}"
                for s in self.pop(seq.request_id):
                    free(s)
                updated[seq.request_id] = out
                continue
            updated[seq.request_id] = out
            if out.finished:
                del self.requests[seq.request_id]
        return [out.snapshot() for out in updated.values()]

    def _stop_reason_over(self, seq: Sequence, count: int) -> str | None:
        """stop_reason after each of seq's `count` new tokens in turn, as if they came one step each:
        the first stop ends it, and the tokens after it (and their logprobs) are dropped."""
        if count == 1:
            return self.stop_reason(seq)
        later = seq.token_ids[len(seq) - count + 1:]
        del seq.token_ids[len(seq) - count + 1:]
        reason = self.stop_reason(seq)
        for token in later:
            if reason is not None:
                break
            seq.token_ids.append(token)
            reason = self.stop_reason(seq)
        if seq.params.logprobs is not None:
            del seq.logprobs[seq.num_generated_tokens:]
        return reason

    def stop_reason(self, seq: Sequence) -> str | None:
        """After seq got a new token: "stop" (EOS, a stop token, a stop string: the text ends
        before it; or its grammar is complete), "length", or None; the token's text is added to
        seq.text unless it stops."""
        p = seq.params
        last = seq.token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_error():
            raise RuntimeError(f"structured outputs: token {last} broke the grammar: {short(seq.grammar.get_error())}")
        may_stop = seq.num_generated_tokens >= p.min_tokens
        if may_stop and ((last in self.eos_token_ids and not p.ignore_eos) or last in p.stop_token_ids):
            return "stop"
        at_length = (p.max_tokens is not None and seq.num_generated_tokens >= p.max_tokens) or len(seq) >= self.max_model_len
        complete = seq.grammar is not None and seq.grammar.is_stopped()  # only EOS could follow
        delta = self._detok[seq.seq_id].step(seq.token_ids, final=at_length or complete)
        seq.text += delta
        # as vLLM: the text of the first min_tokens tokens is never searched for a stop string
        hit = find_stop(seq.text, p.stop, len(delta)) if seq.num_generated_tokens > p.min_tokens else None
        if hit is not None:
            where, stop = hit
            seq.text = seq.text[:where + len(stop) if p.include_stop_str_in_output else where]
            return "stop"
        if complete:
            return "stop"
        return "length" if at_length else None

    def _update(self, seq: Sequence, reason: str | None, free: Callable[[Sequence], None]) -> RequestOutput:
        """seq's completion after its new token; a finished seq is freed. Text that may be the
        start of a stop string is held back until the next tokens decide."""
        out, seqs = self.requests[seq.request_id]
        if out.queue_time is None and seqs[0].first_scheduled_time is not None:
            out.queue_time = seqs[0].first_scheduled_time - seqs[0].arrival_time
        completion = out.outputs[seqs.index(seq)]
        completion.token_ids = seq.generated_token_ids
        completion.finish_reason = reason
        hold = 0 if reason is not None or seq.params.include_stop_str_in_output else held_back(seq.text, seq.params.stop)
        completion.text = seq.text[:len(seq.text) - hold]
        if seq.params.logprobs is not None:
            completion.logprobs = seq.logprobs
        if (seq.params.prompt_logprobs is not None and out.prompt_logprobs is None
                and len(seq.prompt_logprobs) >= seq.num_prompt_tokens - 1):  # with the first token (a stream's echo)
            out.prompt_logprobs = [None, *seq.prompt_logprobs]
        if reason is not None:
            free(seq)
            self._detok.pop(seq.seq_id, None)
        return out
