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


NUCLEUS_WIDTHS = (256, 4096)  # top-p seeks its nucleus among a row's likeliest 256 tokens, then 4096, then all


def filter_rows(rows: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """rows [B, V] of logits (already divided by the temperature), each with its own top-k, top-p and
    min-p (0, 1.0 and 0.0 leave a row alone), in that order; a new tensor, the excluded tokens at -inf.
    The batch at once: a sort per row cost 4-6 ms of 49,152 logits on 2 cores, at 64 sequences as much
    as the decode step. Ties at a cut are kept together (a token as likely as the last one kept is kept)."""
    vocab = rows.shape[-1]
    k = torch.tensor([t if 0 < t < vocab else 0 for t in top_k], device=rows.device)
    if bool((k > 0).any()):
        kth = rows.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).clamp(min=0)[:, None])
        rows = rows.masked_fill(rows < kth.masked_fill((k == 0)[:, None], float("-inf")), float("-inf"))
    if any(p < 1.0 for p in top_p):
        rows = rows.masked_fill(rows < nucleus_threshold(rows, torch.tensor(top_p, dtype=rows.dtype)), float("-inf"))
    if any(m > 0.0 for m in min_p):
        probs = rows.softmax(-1)
        floor = torch.tensor(min_p, dtype=rows.dtype, device=rows.device)[:, None] * probs.amax(-1, keepdim=True)
        rows = rows.masked_fill(probs < floor, float("-inf"))
    return rows


def nucleus_threshold(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p [B, 1]: the least logit each row keeps so that its likeliest tokens reach top_p of the
    probability, the smallest such set (always the likeliest token; -inf where top_p is 1 or nothing
    is left). Looked for among each row's likeliest NUCLEUS_WIDTHS (partial sorts), wider where they
    hold less than top_p, the whole row sorted last (the bundled model writing chat text at
    temperature 1, top_p 0.95: half its nuclei within 123 tokens, a tenth over 2,047)."""
    lse = rows.logsumexp(-1, keepdim=True)
    threshold = torch.full_like(lse, float("-inf"))
    top_p = top_p.to(rows.device)
    rest = ((top_p < 1.0) & torch.isfinite(lse).squeeze(1)).nonzero().squeeze(1)
    for width in dict.fromkeys([min(w, rows.shape[-1]) for w in NUCLEUS_WIDTHS] + [rows.shape[-1]]):
        if rest.numel() == 0:
            break
        vals = (rows if rest.numel() == rows.shape[0] else rows[rest]).topk(width, dim=-1).values  # likeliest first
        probs = (vals - lse[rest]).exp()
        before = probs.cumsum(-1) - probs  # the mass of the likelier tokens
        kept = (before < top_p[rest, None]).sum(-1).clamp_(min=1)
        found = before[:, -1] + probs[:, -1] >= top_p[rest]  # the nucleus lies within these candidates
        if width == rows.shape[-1]:
            found[:] = True  # every token: the sum fell short of top_p only by rounding
        threshold[rest[found]] = vals[found].gather(-1, (kept[found] - 1)[:, None])
        rest = rest[~found]
    return threshold


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] (already divided by the temperature) with the excluded tokens at -inf (filter_rows)."""
    return filter_rows(logits[None], [top_k], [top_p], [min_p])[0]


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
            rows = filter_rows(self._scaled(finite(rows), temperature), [s.params.top_k for s in seqs],
                               [s.params.top_p for s in seqs], [s.params.min_p for s in seqs])
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
