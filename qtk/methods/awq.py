"""AWQ (Lin et al., 2023): activation-aware per-channel weight scales, then a clipping search.

Per smoothing pair prev -> linears of a block, in execution order (AutoAWQ's search):
    x_mean = mean |x| per input channel, w_mean = mean over rows of |W| / max|W| of its group
    s(r)   = x_mean^r / w_mean^(1-r),  r = 0, 1/n, ..., (n-1)/n          (duo scaling)
    loss   = || inspect(x; Q(W s) / s) - inspect(x; W) ||^2             (inspect: attention, mlp, the linear)
    keep the best s only when it beats s = 1; W <- W s, prev <- prev / s  (fold.py)
Then per targeted linear but q/k, per output row and group, the range of W shrinks by the factor
in [0.5, 1] that minimises that group's output error (AutoAWQ's auto_clip), kept for a row only
if the row's whole output error drops too; the clipped float weight goes on to the weight
quantizer (rtn or gptq).

The losses of a single Linear are exact quadratic forms in the input Gram matrix G = X^T X
(error = sum (dW G) * dW) over GRAM_TOKENS random tokens, at no per-candidate cost in tokens; the
attention loss runs on the sequences of the first LOSS_TOKENS tokens, the mlp loss on LOSS_TOKENS
random tokens.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import distributed
from ..arch import SmoothPair
from ..quant import dequantize, dequantize_weight, grouped, qparams, quantize, quantize_weight
from ..schemes import QuantArgs
from .fold import fold_scale, folds
from .gptq import HessianSum

log = logging.getLogger(__name__)

LOSS_TOKENS = 4096  # tokens the attention / mlp losses run on (whole sequences for attention)
GRAM_TOKENS = 8192  # random tokens behind the Gram matrices (x_mean uses every token)
CLIP_GRID, CLIP_MAX_SHRINK = 20, 0.5  # clip factors 1, 0.95, ..., 0.5
NO_CLIP = ("q_proj", "k_proj")  # their error shows in attention scores, not in their outputs (AutoAWQ)

Loss = Callable[[dict[str, torch.Tensor]], float]  # {linear name: candidate weight} -> output MSE


# --- the math, over tensors ---------------------------------------------------------------

def fake_quant(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """RTN quantize-dequantize of a weight [out, in] with the scheme's grid."""
    q, scale, zp = quantize_weight(w, args)
    return dequantize_weight(q, scale, zp, args, w.dtype)


def group_size(args: QuantArgs, in_features: int) -> int:
    return args.group_size if args.strategy == "group" else in_features


def weight_mean(weights: list[torch.Tensor], gs: int) -> torch.Tensor:
    """AutoAWQ's w_mean [in]: |W| normalised by its group's absmax, averaged over all rows."""
    w = torch.cat(weights, dim=0).abs().float()  # [sum out, in]
    g = grouped(w, gs)  # [rows, in/g, g]
    return (g / (g.amax(dim=-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(dim=0)


def candidate_scale(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    # AWQ: s = x_mean^r / w_mean^(1-r), normalised so that max(s) * min(s) = 1
    s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4) if duo else x_mean.pow(ratio)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scale(x_mean: torch.Tensor, w_mean: torch.Tensor, weights: dict[str, torch.Tensor],
                 args: QuantArgs, loss: Loss, grid: int = 20, duo: bool = True, coarse: int = 1):
    """(s [in], its loss, the identity's loss): the grid's best scale, or s = 1 if none beats it.

    weights: the pair's float weights [out_k, in]; a candidate s turns them into Q(W s) / s.
    coarse > 1: the ratios i/grid are tried at every coarse-th i first, then at every i within
    coarse - 1 of the best of those (the whole grid's pick wherever loss(r) has one valley, which
    is the usual shape; 11 losses instead of 20 at grid 20, coarse 4)."""

    def scaled(s):
        return {n: fake_quant(w * s, args) / s for n, w in weights.items()}

    ones = torch.ones_like(x_mean)
    identity = loss(scaled(ones))
    tried: dict[int, tuple[float, torch.Tensor]] = {}

    def attempt(i):
        if i not in tried:
            s = candidate_scale(x_mean, w_mean, i / grid, duo)
            tried[i] = (loss(scaled(s)), s)
        return tried[i][0]

    best_coarse = min(range(0, grid, coarse), key=attempt)
    for i in range(max(0, best_coarse - coarse + 1), min(grid, best_coarse + coarse)):
        attempt(i)
    best_i = min(tried, key=lambda i: (tried[i][0], i))
    best, best_s = tried[best_i]
    if not best < identity:
        best, best_s, best_i = identity, ones, None
    log.debug("awq ratio %s loss %.4g (identity %.4g, %d of %d ratios tried)", None if best_i is None else best_i / grid,
              best, identity, len(tried), grid)
    return best_s, best, identity


def gram_loss(weights: dict[str, torch.Tensor], gram: torch.Tensor, tokens: int) -> Loss:
    """Output MSE of the linears on inputs X from G = X^T X: sum over rows of dW G dW^T."""
    rows = sum(w.shape[0] for w in weights.values())

    def loss(w_hats):
        err = sum((((w_hats[n] - w) @ gram) * (w_hats[n] - w)).sum() for n, w in weights.items())
        return err.item() / (tokens * rows)

    return loss


def clip_weight(w: torch.Tensor, gram: torch.Tensor, args: QuantArgs, grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK) -> torch.Tensor:
    """w [out, in] clamped, per row and group, to the shrunk range whose quantization error
    dW_g G_g dW_g^T on the group's inputs (G_g: the diagonal block of G = X^T X) is smallest."""
    gs = group_size(args, w.shape[1])
    wg = grouped(w.float(), gs)  # [out, ng, g]
    ng = wg.shape[1]
    # G [in, in] -> [ng, g, ng, g] -> diagonal blocks [ng, g, g]
    g_blocks = gram.reshape(ng, gs, ng, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, ng]
    if args.symmetric:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    best_err = torch.full_like(lo, float("inf"))
    best_f = torch.ones_like(lo)
    for i in range(int(max_shrink * grid) + 1):
        f = 1 - i / grid
        d = (_fake_quant_range(wg, lo * f, hi * f, args) - wg).transpose(0, 1)  # [ng, out, g]
        err = ((d @ g_blocks) * d).sum(dim=-1).transpose(0, 1)  # [out, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_f = torch.where(better, torch.full_like(best_f, f), best_f)
    clipped = torch.maximum(torch.minimum(wg, (hi * best_f)[..., None]), (lo * best_f)[..., None]).reshape(w.shape)
    # the group errors leave out cross-group terms: keep a row's clip only if its whole output error drops
    keep = row_error(clipped, w, gram, args) < row_error(w.float(), w, gram, args)
    return torch.where(keep[:, None], clipped, w.float()).to(w.dtype)


def row_error(w_new: torch.Tensor, w: torch.Tensor, gram: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Per output row, the squared output error of RTN(w_new) against w: dW G dW^T, [out]."""
    d = fake_quant(w_new, args) - w.float()
    return ((d @ gram) * d).sum(dim=1)


def _fake_quant_range(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    # wg [out, ng, g] quantized on the grid of the range [lo, hi] ([out, ng]), values outside clamp
    scale, zp = qparams(lo, hi, args)
    zp = None if args.symmetric else zp[..., None]
    q = quantize(wg, scale[..., None], zp, args)
    return dequantize(q, scale[..., None], zp, wg.dtype)


# --- walking a block ----------------------------------------------------------------------

@dataclass
class PairStats:
    """What one calibration forward leaves for a pair: input statistics and loss inputs."""

    abs_sum: torch.Tensor | None = None  # [in] sum of |x| over all tokens
    tokens: int = 0
    gram: torch.Tensor | None = None  # [in, in] X^T X over sampled tokens
    gram_tokens: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)  # random tokens [n, in] (mlp loss)
    calls: list[tuple] = field(default_factory=list)  # (args, kwargs) of the inspect module (attention loss)
    hessian: HessianSum | None = None  # every token's x x^T, for GPTQ after AWQ (keep_hessians)

    def add(self, x: torch.Tensor, sampled: torch.Tensor) -> None:
        # x [tokens, in], sampled [n, in] a random subset of its rows
        self.abs_sum = x.abs().sum(0) if self.abs_sum is None else self.abs_sum + x.abs().sum(0)
        self.tokens += x.shape[0]
        self.gram = sampled.T @ sampled if self.gram is None else self.gram.addmm_(sampled.T, sampled)
        self.gram_tokens += sampled.shape[0]

    @property
    def x_mean(self) -> torch.Tensor:
        return self.abs_sum / self.tokens

    def sum_over_ranks(self, width: int, device) -> None:
        """Every rank's statistics added up in place (data-parallel calibration, distributed.py); the
        sampled tokens and kept calls stay each rank's own (their losses are summed instead)."""
        self.abs_sum = distributed.sum_(torch.zeros(width, device=device) if self.abs_sum is None else self.abs_sum)
        self.gram = distributed.sum_(torch.zeros(width, width, device=device) if self.gram is None else self.gram)
        self.tokens, self.gram_tokens = (int(n) for n in distributed.sum_floats(self.tokens, self.gram_tokens))
        if self.gram_tokens == 0:  # no rank saw a token here
            self.abs_sum = self.gram = None
        if self.hessian is not None:
            if self.hessian.upper is None:
                self.hessian.upper = torch.zeros(width, width, device=device)
            distributed.sum_(self.hessian.upper)
            self.hessian.tokens = int(distributed.sum_floats(self.hessian.tokens)[0])


def loss_kind(block, pair: SmoothPair) -> str:
    """gram: the inspected module is the pair's own linear(s); sequences: attention needs whole
    sequences and its kwargs; tokens: a token-wise module (the mlp) on sampled tokens."""
    if pair.inspect is None or pair.inspect in pair.linears:
        return "gram"
    return "sequences" if pair.inspect == block.attention else "tokens"


def observe(block, pairs: list[SmoothPair], keep_hessians: bool = False) -> dict[SmoothPair, PairStats]:
    """One forward of the block on the calibration inputs (as far as the last pair's input),
    collecting every pair's statistics; with keep_hessians also each input's full Hessian.

    The tokens sampled from a batch are drawn with a generator seeded by the batch's first sample,
    and the attention loss keeps the first sequences of all samples, so processes that share the
    batches (distributed.py) sample what one process does."""
    stats = {p: PairStats(hessian=HessianSum() if keep_hessians else None) for p in pairs}
    by_input = {p.linears[0]: p for p in pairs}  # a pair's linears share their input
    inputs = block.inputs
    seq_len = inputs.hidden[0].shape[1]
    n_seqs = max(1, math.ceil(LOSS_TOKENS / seq_len))  # whole sequences for the attention loss
    per_batch = math.ceil(LOSS_TOKENS / inputs.total)
    gram_per_batch = math.ceil(GRAM_TOKENS / inputs.total)
    gen = torch.Generator()
    batch = {"first": 0, "n": -1}  # the batch being fed: its first sample's index among all samples

    def next_batch(*_):
        batch["n"] += 1
        batch["first"] = inputs.first_sample(batch["n"])
        gen.manual_seed(batch["first"])

    def on_input(name, x):
        pair = by_input[name]
        x = x.detach().reshape(-1, x.shape[-1])
        sampled = x[torch.randperm(x.shape[0], generator=gen)[:max(per_batch, gram_per_batch)].to(x.device)]
        stats[pair].add(x.float(), sampled[:gram_per_batch].float())
        if stats[pair].hessian is not None:
            stats[pair].hessian.add(x)
        if loss_kind(block, pair) == "tokens":
            stats[pair].samples.append(sampled[:per_batch])  # in the block's dtype: the mlp runs on them

    def keep_call(pair):
        def hook(_, args, kwargs):
            if batch["first"] < n_seqs:  # the batch holds some of the first n_seqs sequences
                args, kwargs = first_sequences(args, dict(kwargs), n_seqs - batch["first"])
                stats[pair].calls.append((args, kwargs))
        return hook

    handles = [block.layer.register_forward_pre_hook(next_batch)]
    handles += [block.linear(p.inspect).register_forward_pre_hook(keep_call(p), with_kwargs=True)
                for p in pairs if loss_kind(block, p) == "sequences"]
    try:
        with block.hooks(list(by_input), on_input):
            block.feed(until=list(by_input)[-1])
    finally:
        for h in handles:
            h.remove()
    if distributed.active():
        for p in pairs:
            stats[p].sum_over_ranks(block.linear(p.linears[0]).in_features, block.device)
    return stats


def first_sequences(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """A module call (hidden [B, L, ...] first) cut to its first n sequences: every tensor argument
    (or tuple of them, e.g. rotary (cos, sin)) with at least 2 dims and B rows is cut; the rest
    (cache positions, flags) is kept as is."""
    batch = args[0].shape[0] if args else kwargs["hidden_states"].shape[0]
    if n >= batch:
        return args, kwargs

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == batch:
            return v[:n]
        if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            return tuple(cut(t) for t in v)
        return v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _forward(module, calls) -> list[torch.Tensor]:
    outs = []
    for args, kwargs in calls:
        y = module(*args, **kwargs)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


@contextlib.contextmanager
def _weights(block, w_hats: dict[str, torch.Tensor]):
    """Temporarily give the named linears the candidate weights."""
    saved = {n: block.linear(n).weight.data for n in w_hats}
    try:
        for n, w in w_hats.items():
            block.linear(n).weight.data = w.to(saved[n].dtype)
        yield
    finally:
        for n, w in saved.items():
            block.linear(n).weight.data = w


def module_loss(block, module_name: str, calls: list[tuple]) -> Loss:
    """Output MSE of a module (attention, mlp) against its float output on the given calls (summed
    over every rank's calls: distributed.py)."""
    module = block.linear(module_name)
    ref = _forward(module, calls)
    numel = sum(r.numel() for r in ref)

    def loss(w_hats):
        with _weights(block, w_hats):
            out = _forward(module, calls)
        err = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(out, ref))
        err, total = distributed.sum_floats(err, numel)
        return err / total

    return loss


def pair_loss(block, pair: SmoothPair, st: PairStats, weights: dict[str, torch.Tensor]) -> Loss:
    kind = loss_kind(block, pair)
    if kind == "gram":
        return gram_loss(weights, st.gram, st.gram_tokens)
    calls = st.calls if kind == "sequences" else [((torch.cat(st.samples),), {})] if st.samples else []
    return module_loss(block, pair.inspect, calls)


@torch.no_grad()
def smooth_block(block, recipe) -> None:
    """METHODS["awq"]: scale search per pair, folding, then the clipping search.

    When GPTQ follows, the observing forward also sums every input's Hessian, scaled with each
    fold (the linears read x / s), and leaves them in block.hessians: GPTQ then needs no forward
    of its own. Those Hessians are of the inputs before the clipping search, which changes the
    inputs of o_proj, gate/up and down_proj slightly (through v, o, up, gate); measured on SmolLM2
    it changes nothing visible (see benchmarks/results/cpu_dtype.md)."""
    args, awq = recipe.scheme.weights, recipe.awq
    pairs = [p for p in block.pairs if any(n in block.targets for n in p.linears)]
    stats = observe(block, pairs, keep_hessians=recipe.weights == "gptq")
    unseen = [p for p in pairs if stats[p].gram is None]  # an expert no calibration token reached
    if unseen:
        log.info("awq %s: no calibration token reached %s: no scales for them", block.name,
                 ", ".join(n for p in unseen for n in p.linears))
        pairs = [p for p in pairs if p not in unseen]
    for pair in pairs:
        if not folds(block, pair):
            log.debug("awq %s: %s -> %s does not fold (GQA), skipped", block.name, pair.prev, pair.linears)
            continue
        st = stats[pair]
        weights = {n: block.linear(n).weight.detach().float() for n in pair.linears if n in block.targets}
        w_mean = weight_mean(list(weights.values()), group_size(args, st.gram.shape[0]))
        coarse = 1 if loss_kind(block, pair) == "gram" else awq.coarse
        s, err, identity = search_scale(st.x_mean, w_mean, weights, args, pair_loss(block, pair, st, weights),
                                        awq.grid, awq.duo_scaling, coarse)
        log.debug("awq %s %s: loss %.4g (identity %.4g)", block.name, pair.prev, err, identity)
        fold_scale(block, pair, s)
        st.gram = st.gram / s[:, None] / s[None, :]  # the linears now read x / s
        if st.hessian is not None:
            st.hessian.scale_inputs(s)
    # a pair led by a MoE router observed every token: its experts' Hessians only if they see every token too
    routed = any(p.linears[0] not in block.targets for p in pairs)
    if recipe.weights == "gptq" and (recipe.calibration.calibrate_all_experts or not routed):
        block.hessians = [(tuple(n for n in p.linears if n in block.targets), stats[p].hessian.H) for p in pairs]
    if awq.clip:
        for pair in pairs:
            for name in pair.linears:
                if name in block.targets and name.rsplit(".", 1)[-1] not in NO_CLIP:
                    w = block.linear(name).weight
                    w.copy_(clip_weight(w.detach(), stats[pair].gram, args))
