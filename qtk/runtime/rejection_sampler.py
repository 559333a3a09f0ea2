"""RejectionSampler: a sequence's draft tokens checked against the target model's logits of one step.

A step that verifies k drafts d1..dk of a sequence computes, besides its last token, the k drafts
after it, and returns k + 1 rows of logits: row j is the target's next-token distribution after
the last token and d1..dj. Going down the rows:

    greedy     the target's choice at row j is its argmax; d(j+1) is kept while it equals it; at the
               first difference (or after all k) the target's choice is the next token. The output is
               the target's greedy output exactly: each kept draft is what plain decoding would have
               chosen there.
    sampling   the standard rule (Leviathan et al. 2023, Chen et al. 2023): keep d(j+1) with probability
               min(1, p(d) / q(d)), p the target's distribution (after temperature, top-k/p, min-p),
               q the proposer's; on a rejection draw from the residual max(0, p - q), renormalized.
               qtk's proposers propose deterministically (a copied n-gram, a greedy draft), so q is
               one-hot: keep d with probability p(d), else draw from p without d. Every token is then
               distributed as p exactly.

Each row's choice sees the sequence as it would be at that position (the kept tokens appended): its
grammar's mask, penalties and min_tokens, as the Sampler applies them. A grammar consumes each token
kept. One step of one sequence yields 1 to k + 1 tokens.
"""
from __future__ import annotations

import torch

from .sampler import Sampler
from .sequence import Sequence


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, rows: torch.Tensor, seq: Sequence) -> list[int]:
        """rows [1 + len(seq.spec_token_ids), V]: the target's logits at the last token and at each
        draft -> the drafts kept, then the token after them."""
        drafts = seq.spec_token_ids
        if seq.params.greedy and seq.grammar is None and not self.sampler.adjusts(seq):
            choices = rows.argmax(dim=-1).tolist()  # one argmax for every row
            kept = 0
            while kept < len(drafts) and drafts[kept] == choices[kept]:
                kept += 1
            return choices[:kept + 1]
        return self._one_by_one(rows, seq, drafts)

    def _one_by_one(self, rows: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[int]:
        """Row by row, each token appended to seq while the next row is chosen (its penalties and
        min_tokens count it), its grammar fed each; seq's tokens are as they came, after."""
        stops = seq.params.stop_token_ids
        tokens: list[int] = []
        try:
            for j in range(len(drafts) + 1):
                draft = drafts[j] if j < len(drafts) else None
                token = self._choose(rows[j], seq, draft)
                if seq.grammar is not None:
                    self.sampler.grammars.accept([(seq.grammar, token)])
                tokens.append(token)
                seq.token_ids.append(token)
                if token != draft or token in self.sampler.eos_token_ids or token in stops \
                        or (seq.grammar is not None and (seq.grammar.is_stopped() or seq.grammar.is_error())):
                    break
        finally:
            del seq.token_ids[len(seq.token_ids) - len(tokens):]
        return tokens

    def _choose(self, row: torch.Tensor, seq: Sequence, draft: int | None) -> int:
        logits = self.sampler.final_logits(row, seq)
        if seq.params.greedy:
            return int(logits.argmax())
        p = self.sampler.probabilities(logits, seq)
        if draft is not None:
            if self.sampler.uniform(seq) < float(p[draft]):
                return draft
            p[draft] = 0.0  # the residual max(0, p - q) for a one-hot q
            if not bool(p.sum() > 0):  # p was one-hot on the draft: float rounding alone rejected it
                return draft
        cdf = p.cumsum(0)
        u = self.sampler.uniform(seq) * float(cdf[-1])
        return int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).clamp_(max=p.numel() - 1))
