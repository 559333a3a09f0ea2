"""Token-level perplexity (docs/benchmarks.md).

Concatenate the evaluation text, tokenize once, cut into non-overlapping windows of L tokens,
score every token of a window but its first; ppl = exp(mean NLL over all scored tokens).
`engine_perplexity` scores through qtk's runtime (prompt logprobs: what `qtk eval` and the gates
measure is what `qtk serve` runs); `perplexity` through a loaded transformers model (calibration's
own checks and the tests' referee).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..chunked_sdpa import chunked_attention
from ..data import load_texts, token_stream
from ..errors import InputError
from . import bootstrap


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    scored_tokens: int
    windows: int
    seq_len: int
    dataset: str
    window_nll: tuple[float, ...] = ()  # each window's summed NLL (seq_len - 1 tokens scored in each)

    def units(self) -> dict:
        """Per window (NLL sum, tokens scored), what the bootstrap resamples (bootstrap.py)."""
        pairs = [[nll, self.seq_len - 1] for nll in self.window_nll]
        return {"ppl": bootstrap.units("exp_ratio", pairs), "nll": bootstrap.units("ratio", pairs)}

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"ppl {self.ppl:.4f} on {self.dataset} ({self.windows} windows x {self.seq_len} tokens, "
                f"{self.scored_tokens} scored)")


def exp_nll(mean_nll: float) -> float:
    """ppl = exp(mean NLL); inf where that overflows a float (a mean NLL above ~709: a broken model)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def eval_windows(tokenizer, dataset: str = "builtin", seq_len: int = 2048, limit: int | None = None) -> torch.Tensor:
    """The evaluation windows [W, L] (the same ids for every model with this tokenizer)."""
    stream = token_stream(tokenizer, load_texts(dataset, "evaluation"))
    n = len(stream) // seq_len
    if n == 0:
        raise InputError(f"dataset {dataset!r} has {len(stream)} evaluation tokens, fewer than one window of "
                         f"{seq_len}; lower --seq-len")
    if limit is not None:
        n = min(n, limit)
    return stream[: n * seq_len].view(n, seq_len)


def engine_perplexity(llm, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
                      dataset: str = "builtin") -> PerplexityResult:
    """Every window as one request of prompt logprobs (log p of each prompt token after the first)
    through the engine `llm` (qtk.LLM), `batch_size` windows submitted together."""
    from ..runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    window_nll = []
    for i in tqdm(range(0, len(windows), batch_size), desc="ppl", unit="win", disable=not progress):
        group = windows[i:i + batch_size].tolist()
        for ids, out in zip(group, llm.generate(group, params)):
            window_nll.append(-sum(entry[token] for token, entry in zip(ids[1:], out.prompt_logprobs[1:])))
    scored = len(windows) * (windows.shape[1] - 1)
    mean = sum(window_nll) / scored
    return PerplexityResult(exp_nll(mean), mean, scored, len(windows), windows.shape[1], dataset, tuple(window_nll))


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 1, device=None, progress: bool = True,
               dataset: str = "builtin") -> PerplexityResult:
    device = device or next(model.parameters()).device
    window_nll = []
    with chunked_attention(model):
        for i in tqdm(range(0, len(windows), batch_size), desc="ppl", unit="win", disable=not progress):
            ids = windows[i:i + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            window_nll += nll.double().sum(-1).tolist()
    scored = windows[:, 1:].numel()
    mean = sum(window_nll) / scored
    return PerplexityResult(exp_nll(mean), mean, scored, len(windows), windows.shape[1], dataset, tuple(window_nll))


def increase_stderr(base: PerplexityResult, other: PerplexityResult, key: str = "ppl increase") -> float | None:
    """The standard error of other's perplexity relative to base's (other / base - 1) on the same
    windows, by the paired bootstrap over windows (bootstrap.py)."""
    ub, uo = base.units()["ppl"], other.units()["ppl"]
    if len(ub["values"]) != len(uo["values"]) or not ub["values"]:
        raise ValueError("increase_stderr: both results need the same windows, each window's NLL kept")
    idx = bootstrap.draws(len(ub["values"]), key)
    return bootstrap.stderr(bootstrap.replicates(uo, idx) / bootstrap.replicates(ub, idx) - 1)
