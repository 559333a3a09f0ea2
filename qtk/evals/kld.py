"""KL divergence of a candidate's next-token distributions from the baseline's, as llama.cpp's
perplexity tool reports it (--kl-divergence): perplexity sees only the probability of the token
that came next, so a model whose distributions are broken elsewhere can keep its perplexity.

On the perplexity protocol's windows (the same ids for both models), at every scored position t:

    KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))        p: baseline, q: candidate, v over the vocabulary

reported as the mean over all scored tokens (`kld`), the median and 99th percentile of the KL_t
(`kld_median`, `kld_p99`), the largest (`kld_max`), and `top1_agreement`: the share of positions
where both models' most likely next token is the same.

The baseline's log-probabilities at every position are kept (float16, [windows, positions, vocab]:
the gates cache them with the baseline's other results) and read back in float32, each row
renormalized; float16's rounding moves the mean KL by about 1e-5 (tests/test_kld.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from . import bootstrap


@dataclass(frozen=True)
class KLDivergence:
    per_token: list[torch.Tensor]  # per window: KL_t at each scored position [L - 1]
    top1: list[torch.Tensor]  # per window: whether both argmaxes agree [L - 1] bool

    def metrics(self) -> dict:
        """The task's metrics, and per window the units the bootstrap resamples."""
        kl = [k.double().numpy() for k in self.per_token]
        sums = [[float(k.sum()), len(k)] for k in kl]
        agree = [[int(a.sum()), len(a)] for a in self.top1]
        ragged = [[float(f"{x:.6g}") for x in k] for k in kl]
        units = {"kld": bootstrap.units("ratio", sums), "kld_median": bootstrap.units("p50", ragged),
                 "kld_p99": bootstrap.units("p99", ragged), "kld_max": bootstrap.units("max", ragged),
                 "top1_agreement": bootstrap.units("ratio", agree)}
        return {**{name: bootstrap.aggregate(u) for name, u in units.items()}, "_units": units}


def _window_rows(llm, windows: torch.Tensor, batch_size: int):
    """Each window's log-probabilities at its scored positions [L - 1, vocab] float32, in order,
    `batch_size` windows a batch."""
    for i in range(0, len(windows), batch_size):
        yield from llm.prompt_log_probs(windows[i:i + batch_size].tolist())


def kl_divergence(base: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) per row and whether the argmaxes agree, from log-probabilities base [n, V]
    (any float dtype; renormalized) and cand [n, V], in float64."""
    if base.shape != cand.shape:
        raise InputError(f"the baseline's log-probabilities are {tuple(base.shape)}, the candidate's "
                         f"{tuple(cand.shape)}: the two models must share the tokenizer and vocabulary")
    lp = base.double()  # float64: a sum over the vocabulary of terms of both signs
    lp = lp - lp.logsumexp(-1, keepdim=True)  # float16 rows sum to 1 only to within their rounding
    kl = (lp.exp() * (lp - cand.double())).sum(-1).clamp_min(0.0)  # >= 0; rounding can dip below
    return kl, lp.argmax(-1) == cand.argmax(-1)


def compare(llm, windows: torch.Tensor, base: torch.Tensor, batch_size: int = 1) -> KLDivergence:
    """The candidate `llm` against the baseline's log-probabilities `base` [W, L - 1, V] on the
    same windows [W, L]."""
    if base.shape[:2] != (windows.shape[0], windows.shape[1] - 1):
        raise InputError(f"the baseline scored {base.shape[0]} windows of {base.shape[1] + 1} tokens, this run "
                         f"{windows.shape[0]} of {windows.shape[1]}: the two models must share the tokenizer "
                         "(rerun with --no-cache if the cached baseline is stale)")
    per_token, top1 = [], []
    for base_rows, rows in zip(base, _window_rows(llm, windows, batch_size)):
        kl, agree = kl_divergence(base_rows, rows)
        per_token.append(kl)
        top1.append(agree)
    return KLDivergence(per_token, top1)


def baseline(llm, windows: torch.Tensor, batch_size: int = 1) -> tuple[dict, torch.Tensor]:
    """The baseline's own result (KL 0 from itself, top-1 agreement 1, so its table row reads as
    the others do) and its log-probabilities in float16 for the candidate to be compared with."""
    lp = torch.stack([rows.half() for rows in _window_rows(llm, windows, batch_size)])
    zeros = [torch.zeros(lp.shape[1]) for _ in range(len(lp))]
    return KLDivergence(zeros, [torch.ones(lp.shape[1], dtype=torch.bool) for _ in zeros]).metrics(), lp
