"""The sampler: logits of the step's sampling sequences -> one token each, by each one's SamplingParams.

Order, as vLLM applies them: the grammar's mask (structured outputs), logit_bias, penalties (repetition on prompt and output, presence and frequency on
output), min_tokens (EOS and stop tokens masked until then), then greedy argmax or temperature, top-k, top-p, min-p and a draw (inverse CDF, the batch at once). A request with a seed
draws from its own generator, so its tokens are the same alone or in any batch.
"""
from __future__ import annotations

import torch

from .sequence import Sequence
from .structured_outputs import GrammarEngine


def apply_logit_bias(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    bias = seq.params.logit_bias
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        x = logits[seen].double()  # a penalty past float32's range (1e39) must not become inf (0 * inf is NaN)
        y = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        # a penalty lowers a token, never excludes it: where it overflows, the token keeps the lowest
        # finite logit (-inf would leave a grammar that allows only seen tokens nothing to choose)
        lo, hi = torch.finfo(logits.dtype).min, torch.finfo(logits.dtype).max
        logits[seen] = torch.where(torch.isfinite(x), y.clamp(lo, hi), x).to(logits.dtype)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_generated_tokens:
        out = torch.tensor(seq.generated_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] (already divided by the temperature) with the excluded tokens at -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # and always the likeliest token (a top_p below float32's range would drop all)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def finite(logits: torch.Tensor) -> torch.Tensor:
    """Logits with overflow tamed: +inf (a tiny repetition penalty divides) becomes the largest
    float, NaN (inf - inf) is excluded like -inf, so the draw always has a distribution (else
    torch.multinomial fails, and the step with it)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def logprob_entry(logprobs: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """{token: log p} for `token` and the `top` likeliest, from one row of log-probabilities [V]."""
    out = {int(t): float(v) for v, t in zip(*logprobs.topk(top))} if top else {}
    out[token] = float(logprobs[token])
    return out


class Sampler:
    def __init__(self, eos_token_ids: set[int] = frozenset(), grammars: GrammarEngine | None = None):
        self.eos_token_ids = set(eos_token_ids)
        self.grammars = grammars  # structured outputs: masks the rows of sequences with a grammar
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded generator
        self._ops = None  # qtk's CPU kernels (False: none here), looked up on the first draw

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        guided = [(s.grammar, i) for i, s in enumerate(seqs) if s.grammar is not None]
        if guided:  # a copy: logprobs are reported from the model's own logits, as vLLM does
            logits = logits.clone()
            self.grammars.mask(logits, guided)
        tokens = self._choose(logits, seqs)
        if guided:
            self.grammars.accept([(m, tokens[i]) for m, i in guided])
        return tokens

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if all(s.params.greedy and not self.adjusts(s) for s in seqs):  # one argmax for the batch
            return logits.argmax(dim=-1).tolist()
        if not any(s.params.greedy or self.adjusts(s) for s in seqs):  # every row drawn as it is (a served batch)
            return self._draw(logits, seqs).tolist()
        rows = finite(logits)  # a copy: the adjustments below write into it
        for i, seq in enumerate(seqs):  # the per-sequence adjustments, where a sequence has any
            if self.adjusts(seq):
                rows[i] = self.adjust(rows[i], seq)
        drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(drawn) == len(seqs):  # no argmax, no copy
            return self._draw(rows, seqs).tolist()
        out = rows.argmax(dim=-1)  # the greedy sequences' tokens
        if drawn:
            out[drawn] = self._draw(rows[drawn], [seqs[i] for i in drawn])
        return out.tolist()

    def adjust(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """One row of logits [V] (written in place) after seq's logit bias, penalties and min_tokens."""
        p = seq.params
        row = finite(apply_penalties(apply_logit_bias(row, seq), seq))
        if seq.num_generated_tokens < p.min_tokens:  # EOS and stop tokens cannot come yet
            banned = list((set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids))
            if seq.grammar is None or self._leaves_a_choice(row, banned):  # else the grammar wins
                row[banned] = float("-inf")
        return row

    def final_logits(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """A copy of one row of the model's logits [V] as seq's choice sees it: its grammar's mask
        (the matcher's state now), then adjust()."""
        row = finite(row.float())
        if seq.grammar is not None:
            self.grammars.mask(row[None], [(seq.grammar, 0)])
        return self.adjust(row, seq) if self.adjusts(seq) else row

    def probabilities(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distribution [V] (float64) a draw for seq takes from its final logits `row`: temperature,
        then top-k, top-p and min-p."""
        p = seq.params
        scaled = self._scaled(row[None].double(), torch.tensor([p.temperature], dtype=torch.float64))[0]
        if p.top_k or p.top_p < 1.0 or p.min_p > 0.0:
            scaled = filter_logits(scaled, p.top_k, p.top_p, p.min_p)
        if not bool(torch.isfinite(scaled).any()):  # nothing left (a grammar's mask): the likeliest, as _draw
            return torch.nn.functional.one_hot(row.argmax(), row.numel()).double()
        return scaled.softmax(-1)

    def uniform(self, seq: Sequence) -> float:
        """One uniform draw in [0, 1): from seq's own generator when it has a seed."""
        if seq.params.seed is None:
            return float(torch.rand(1))
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return float(torch.rand(1, generator=gen))

    def _draw(self, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row [B, V] of logits (as they come, or as finite() leaves them) by temperature,
        top-k, top-p and min-p, the batch at once by inverse CDF: one uniform u per row, the first token
        whose cumulative probability passes u * total (a token of probability 0 never does).
        torch.multinomial draws an exponential per token (15 ms for 16 x 49,152 on 2 cores, a fifth of a
        served decode step); this draws 16 numbers. A seeded sequence's u comes from its own generator.
        On CPU qtk's kernel (sample_rows) draws from the logits in one call; torch's version of the same
        draw (shift, divide, softmax, cumsum, searchsorted) took 6 ms of that step."""
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
        u = torch.rand(len(seqs), dtype=torch.float32)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                u[i] = self.uniform(s)
        filtered = any(s.params.top_k or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in seqs)
        if filtered:  # the filters work on the temperature-scaled logits; the draw then at temperature 1
            rows = self._scaled(finite(rows), temperature)
            for i, s in enumerate(seqs):
                p = s.params
                if p.top_k or p.top_p < 1.0 or p.min_p > 0.0:
                    rows[i] = filter_logits(rows[i], p.top_k, p.top_p, p.min_p)
            temperature = torch.ones_like(temperature)
        ops = self._kernels(rows)
        if ops is not None:
            tokens = ops.sample_rows(rows, temperature, u)
            excluded = tokens < 0  # no token left with a weight (a grammar's mask): its check fails it
        else:
            cdf = (rows if filtered else self._scaled(finite(rows), temperature)).softmax(dim=-1).cumsum_(dim=-1)
            u = u.to(device=cdf.device, dtype=cdf.dtype)[:, None]
            tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
            excluded = ~torch.isfinite(cdf[:, -1])
        if bool(excluded.any()):
            tokens[excluded] = finite(rows[excluded]).argmax(dim=-1).to(tokens.device)
        return tokens

    @staticmethod
    def _scaled(rows: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """(rows - their max) / temperature, finite: shifted so the largest is 0 before the temperature
        (softmax does not change), a tiny temperature then sends the others to -inf, never the
        likeliest to +inf."""
        rows = (rows - rows.amax(dim=-1, keepdim=True)).div_(temperature.to(device=rows.device, dtype=rows.dtype)[:, None])
        return torch.nan_to_num_(rows, nan=float("-inf"), posinf=torch.finfo(rows.dtype).max, neginf=float("-inf"))

    def _kernels(self, rows: torch.Tensor):
        """qtk's CPU kernels where they run on these rows (float32 on CPU), else None (torch draws)."""
        if rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.stride(-1) != 1:
            return None
        if self._ops is None:
            from ..kernels import cpu as cpu_kernels

            self._ops = cpu_kernels.ops() or False
        return self._ops or None

    @staticmethod
    def adjusts(seq: Sequence) -> bool:
        """Logit bias, penalties or min_tokens change seq's logits before the choice."""
        p = seq.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
                or bool(p.logit_bias) or seq.num_generated_tokens < p.min_tokens)

    @staticmethod
    def _leaves_a_choice(row: torch.Tensor, banned: list[int]) -> bool:
        allowed = torch.isfinite(row)
        allowed[banned] = False
        return bool(allowed.any())

    @staticmethod
    def logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, float]:
        """log p of the sampled token and of the `top` likeliest, under the model's own distribution
        (before penalties and temperature, as vLLM reports them)."""
        return logprob_entry(logits.float().log_softmax(-1), token, top)

    def forget(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
