"""Standard errors by the bootstrap, over the units a task measures (windows, prompts, questions,
haystack cells), so a gates table shows when a verdict is within noise.

A task reports beside its metrics the per-unit values each metric aggregates, under "_units":

    {"ppl": {"agg": "exp_ratio", "values": [[nll_sum, tokens], ...]},    # one pair per window
     "accuracy": {"agg": "mean", "values": [1, 0, 1, ...]}}               # one value per cell

and AGGREGATES turns any subset of them back into the metric (the same number the task reports,
computed from all units). The baseline and the candidate run the same units in the same order,
so one draw of unit indices resamples both (a paired bootstrap): the recovery's spread is that
of the difference between the two models on the same data, much smaller than either model's own
spread when both err on the same hard windows.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

REPLICATES = 1000


def _sums(v: np.ndarray) -> np.ndarray:  # v [B, n, 2] -> [B, 2]
    return v.sum(axis=-2)


def _ratio(v: np.ndarray) -> np.ndarray:
    """sum(a) / sum(b) over units of (a, b); 0 where no unit has weight (json: no answer finished)."""
    s = _sums(v)
    return np.divide(s[..., 0], s[..., 1], out=np.zeros(s.shape[:-1]), where=s[..., 1] != 0)


def _exp(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(x)


# name -> f(values [B, n] or [B, n, 2]) -> [B]: each a metric as its task computes it
AGGREGATES = {
    "mean": lambda v: v.mean(axis=-1),
    "ratio": _ratio,  # (a, b) per unit: sum a / sum b (rates over answers that finished)
    "exp_ratio": lambda v: _exp(_ratio(v)),  # (nll, tokens): perplexity
    "bits_per_byte": lambda v: -_ratio(v) / math.log(2),  # lm-eval's (loglikelihood, bytes)
    "weighted_perplexity": lambda v: _exp(-_ratio(v)),  # lm-eval's (loglikelihood, words or bytes)
    "perplexity": lambda v: _exp(-v.mean(axis=-1)),  # lm-eval's loglikelihood per item
}
# over ragged units (a list of values per window, e.g. every token's KL divergence), the
# quantiles of all values of the drawn units together
QUANTILES = {"p50": 50.0, "p99": 99.0, "max": 100.0}


def units(agg: str, values: list) -> dict:
    """A metric's units as a task reports them (agg: a name in AGGREGATES or QUANTILES)."""
    if agg not in AGGREGATES and agg not in QUANTILES:
        raise ValueError(f"unknown aggregate {agg!r}; known: {sorted(AGGREGATES) + sorted(QUANTILES)}")
    return {"agg": agg, "values": values}


def aggregate(u: dict) -> float:
    """The metric from all of its units (what the task reported)."""
    return float(_replicates(u, np.arange(_count(u))[None, :])[0])


def draws(n: int, key: str, replicates: int = REPLICATES) -> np.ndarray:
    """[replicates, n] unit indices drawn with replacement, the same for the same key (a task)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, n, size=(replicates, n))


def replicates(u: dict, idx: np.ndarray) -> np.ndarray:
    """The metric on each resample: idx [B, n] unit indices -> [B]."""
    if _count(u) != idx.shape[1]:
        raise ValueError(f"{_count(u)} units, but draws of {idx.shape[1]}")
    return _replicates(u, idx)


def _count(u: dict) -> int:
    return len(u["values"])


def _replicates(u: dict, idx: np.ndarray) -> np.ndarray:
    if u["agg"] in QUANTILES:
        per_unit = [np.asarray(v, dtype=np.float64) for v in u["values"]]
        q = QUANTILES[u["agg"]]
        return np.array([np.percentile(np.concatenate([per_unit[i] for i in row]), q) for row in idx])
    values = np.asarray(u["values"], dtype=np.float64)
    return AGGREGATES[u["agg"]](values[idx])


def stderr(samples: np.ndarray) -> float | None:
    """The standard deviation of bootstrap replicates (None where they are not finite: an
    overflowed perplexity, an infinite recovery)."""
    finite = samples[np.isfinite(samples)]
    if len(finite) < len(samples):
        return None
    return float(finite.std(ddof=1)) if len(finite) > 1 else 0.0
