"""AutoRound (SignRound; Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs", 2023; Intel's auto-round): per decoder block, learn each weight's rounding
offset v and each group's clipping of its range (min_scale, max_scale) by signed gradient descent on
the block's output error.

For one group of weights W with range [wmin, wmax] (0 always inside), on qtk's grid (quant.py,
compressed-tensors' convention; codes in [qmin, qmax]):

    asymmetric:  s = (wmax * max_scale - wmin * min_scale) / (qmax - qmin)
                 zp = round(qmin - wmin * min_scale / s)
                 W_hat = (clamp(round(W / s + v) + zp, qmin, qmax) - zp) * s
    symmetric:   s = max(-wmin * min_scale, wmax * max_scale) / ((qmax - qmin) / 2)
                 W_hat = clamp(round(W / s + v), qmin, qmax) * s

round passes gradients straight through; s is rounded to the checkpoint's bf16 as it will be
stored. v starts at 0 and min_scale = max_scale = 1, which is round-to-nearest exactly. (auto-round's
symmetric grid is signed and full-range, absmax / 2^(b-1) with the sign of the larger side, which
a compressed-tensors reader does not expect: qtk learns the same clipping on its own grid.)

The loss is the mean squared error between the block's output with W_hat, run on the outputs of the
blocks already quantized, and the float block's output on the float model's own activations (the
driver carries both chains: Method.float_chain), so each block also makes up for the error the
blocks before it left. Each step takes one calibration batch (8 samples by default), shuffled, no
batch twice in an epoch; the update is p -= lr * sign(grad), with lr = 1 / iters decaying linearly
to 0, min_scale and max_scale clamped to [0, 1] before each forward; the parameters of the step with
the lowest batch loss are kept (measured before that step's update, as auto-round does). Defaults
are auto-round's: 200 iterations, lr 1 / iters for both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import random

import torch
import torch.nn.functional as F

from .. import quant
from ..quant import SCALE_DTYPE
from ..schemes import QuantArgs
from . import gptq, rtn

log = logging.getLogger(__name__)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return (x.round() - x).detach() + x


class Rounding:
    """One Linear's learned rounding: v [out, in] and min_scale / max_scale [out, groups]."""

    def __init__(self, weight: torch.Tensor, args: QuantArgs):
        self.args = args
        self.weight = weight.detach().float()
        g = self._grouped(self.weight)
        self.wmin = g.amin(-1).clamp(max=0)  # 0 is always on the grid (quant.qparams)
        self.wmax = g.amax(-1).clamp(min=0)
        self.v = torch.zeros_like(self.weight, requires_grad=True)
        self.min_scale = torch.ones_like(self.wmin, requires_grad=True)
        self.max_scale = torch.ones_like(self.wmax, requires_grad=True)

    def _grouped(self, w: torch.Tensor) -> torch.Tensor:
        """[out, in] -> [out, groups, size] (a channel is one group)."""
        size = self.args.group_size if self.args.strategy == "group" else w.shape[1]
        return w.reshape(w.shape[0], -1, size)

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero point or None) [out, groups], differentiable in min_scale and max_scale."""
        a = self.args
        lo, hi = self.wmin * self.min_scale, self.wmax * self.max_scale
        if a.symmetric:
            s = torch.maximum(-lo, hi) / ((a.qmax - a.qmin) / 2)
        else:
            s = (hi - lo) / (a.qmax - a.qmin)
        s = s.to(SCALE_DTYPE).float()  # the scale as stored (a differentiable cast)
        s = torch.where(s > 0, s, torch.full_like(s, torch.finfo(SCALE_DTYPE).tiny))
        zp = None if a.symmetric else round_ste(a.qmin - lo / s).clamp(a.qmin, a.qmax)
        return s, zp

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(float codes [out, groups, size] with gradients, scale, zero point)."""
        s, zp = self.qparams()
        x = self._grouped(self.weight) / s[..., None] + self._grouped(self.v)
        q = round_ste(x) + (0 if zp is None else zp[..., None])
        return q.clamp(self.args.qmin, self.args.qmax), s, zp

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_hat [out, in] in `dtype`, differentiable in v, min_scale and max_scale (FakeQuantized)."""
        s, zp = self.qparams()
        w = FakeQuantized.apply(self._grouped(self.weight), self._grouped(self.v), s, zp, self.args.qmin,
                                self.args.qmax, dtype)
        return w.reshape(self.weight.shape)

    def clamp_(self) -> None:
        with torch.no_grad():
            self.min_scale.clamp_(0, 1)
            self.max_scale.clamp_(0, 1)

    def state(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach().clone() for p in (self.v, self.min_scale, self.max_scale))

    def load(self, state) -> None:
        with torch.no_grad():
            for p, value in zip((self.v, self.min_scale, self.max_scale), state):
                p.copy_(value)

    def final(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 codes [out, in], scale, zero point) as quant.quantize_weight shapes them."""
        with torch.no_grad():
            q, s, zp = self.codes()
        return q.reshape(self.weight.shape).to(torch.int8), s, zp


class FakeQuantized(torch.autograd.Function):
    """W_hat = (clamp(round(W / s + v) + zp, qmin, qmax) - zp) * s per group, with round's gradient passed
    straight through, in a few whole-tensor passes (autograd's chain of the same expression took
    about twice as many, each over every weight of the block, at every step). With q the clamped
    code, `inside` where the clamp passed it, and g the gradient of W_hat:

        dv  = g * s * inside
        ds  = sum(g * (q - zp)) - sum(dv * W) / s^2
        dzp = sum(dv) - s * sum(g)                          (sums over each group)

    W [out, groups, size], v the same shape, s and zp [out, groups] (zp None: symmetric)."""

    @staticmethod
    def forward(ctx, w, v, s, zp, qmin: int, qmax: int, dtype: torch.dtype):
        s3 = s.unsqueeze(-1)
        r = torch.div(w, s3).add_(v).round_()
        if zp is not None:
            r.add_(zp.unsqueeze(-1))
        q = r.clamp(qmin, qmax)
        inside = q == r
        if zp is not None:
            q.sub_(zp.unsqueeze(-1))
        ctx.save_for_backward(w, s, q, inside)
        ctx.asymmetric = zp is not None
        return torch.mul(q, s3).to(dtype)

    @staticmethod
    def backward(ctx, g):
        w, s, q, inside = ctx.saved_tensors
        g = g.float()
        dv = torch.mul(g, s.unsqueeze(-1)).mul_(inside)
        ds = torch.linalg.vecdot(g, q) - torch.linalg.vecdot(dv, w) / (s * s)
        dzp = dv.sum(-1) - s * g.sum(-1) if ctx.asymmetric else None
        return None, dv, ds, dzp, None, None, None


@contextlib.contextmanager
def fake_quantized(block, roundings: dict[str, Rounding]):
    """Each named Linear of the block computes with its Rounding's W_hat (gradients reach v and the
    scales; the block's own weights stay frozen)."""
    saved = {}
    for name, r in roundings.items():
        lin = block.linear(name)
        saved[name] = lin.forward
        lin.forward = lambda x, lin=lin, r=r: F.linear(x, r.dequantized(x.dtype), lin.bias)
    frozen = [p for p in block.layer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for name, forward in saved.items():
            block.linear(name).forward = forward
        for p in frozen:
            p.requires_grad_(True)


def tune(block, roundings: dict[str, Rounding], reference: list[torch.Tensor], iters: int, lr: float,
         minmax_lr: float, seed: int = 0) -> tuple[float, float]:
    """SignSGD on the roundings against `reference` (one output per calibration batch); loads the
    best step's parameters. Returns (the first batch loss, the best)."""
    vs = [r.v for r in roundings.values()]
    scales = [p for r in roundings.values() for p in (r.min_scale, r.max_scale)]
    step = 0
    best, first, best_state = float("inf"), None, None
    batches: list[int] = []
    rng = random.Random(seed)
    with fake_quantized(block, roundings), torch.enable_grad():
        while step < iters:
            if not batches:  # each batch once per epoch, in a fresh order
                batches = list(range(len(reference)))
                rng.shuffle(batches)
            b = batches.pop()
            for r in roundings.values():
                r.clamp_()
            h, kw = block.inputs.hidden[b].to(block.device), block.inputs.kwargs[b]
            y = block.layer(h, **kw)
            y = y[0] if isinstance(y, tuple) else y
            loss = F.mse_loss(y.float(), reference[b].detach().to(block.device).float())
            value = loss.item()
            first = value if first is None else first
            if value < best:  # the parameters that gave this loss: before this step's update
                best, best_state = value, {n: r.state() for n, r in roundings.items()}
            loss.backward()
            decay = 1 - step / iters  # LinearLR from 1 to 0 over the iterations
            with torch.no_grad():
                for params, rate in ((vs, lr), (scales, minmax_lr)):
                    for p in params:
                        if p.grad is not None:
                            p.add_(torch.sign(p.grad), alpha=-rate * decay)
                            p.grad = None
            step += 1
    if best_state is not None:
        for n, r in roundings.items():
            r.load(best_state[n])
            r.clamp_()
    return first, best


def quantize_block(block, recipe) -> None:
    """Learn the rounding of each targeted Linear on the block's output, then replace each by its
    QuantLinear; block.errors = each layer's relative output error on this block's inputs."""
    args, scheme = recipe.autoround, recipe.scheme
    if block.reference is None:
        raise RuntimeError("autoround needs the float model's outputs of the block (Method.float_chain)")
    hessians = dict(_hessians(block))
    roundings = {n: Rounding(block.linear(n).weight, scheme.weights) for n in block.targets}
    iters = args.iters
    lr = args.lr if args.lr is not None else 1.0 / max(iters, 1)
    first, best = tune(block, roundings, block.reference, iters, lr, args.minmax_lr or lr, seed=block.index)
    log.debug("%s: autoround loss %.4g -> %.4g over %d steps", block.name, first or 0.0, best, iters)
    for name, r in roundings.items():
        lin = block.linear(name)
        q, s, zp = r.final()
        if name in hessians:
            block.errors[name] = gptq.output_error(lin.weight.data, quant.dequantize_weight(q, s, zp, scheme.weights),
                                                   hessians[name])
        block.replace(name, rtn.to_quant_linear(lin, q, s, zp, scheme))


REPORT_BATCHES = 2  # calibration batches the reported per-layer errors are measured on


def _hessians(block) -> list[tuple[str, torch.Tensor]]:
    """(name, H) for each targeted Linear, for its reported output error (gptq.collect_hessians): a
    smoothing pass's, or H over the first REPORT_BATCHES batches (only the report reads it: a pass
    over every batch cost about a tenth of a block's tuning)."""
    groups = block.hessians
    if groups is None:
        k = REPORT_BATCHES
        inputs = dataclasses.replace(block.inputs, hidden=block.inputs.hidden[:k], kwargs=block.inputs.kwargs[:k])
        groups = gptq.collect_hessians(dataclasses.replace(block, inputs=inputs), block.targets)
    return [(n, H) for names, H in groups for n in names]
