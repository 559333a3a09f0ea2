"""Scales distilled end to end: the quantized model's step sizes trained against the float model.

Once the block-wise methods (GPTQ, AWQ + GPTQ, AutoRound, ...) have fixed every weight's integer
code, what a compressed-tensors checkpoint still holds in floating point are the scales: one per
group (or output channel) of each quantized Linear, W_hat = (q - zp) * s. This pass trains those
scales on the whole model at once, the codes q and zero points zp fixed, against the unquantized
model's next-token distributions:

    loss = mean over positions t of KL(p_float(. | x_<t) || p_quantized(. | x_<t))

That is EfficientQAT's second phase, E2E-QP (Chen et al., 2024: the quantization step sizes
trained end to end with the quantized weights frozen), with the distillation loss of mlx-lm's DWQ
(the float model as the teacher, KL on its whole distribution) in place of E2E-QP's cross-entropy
on the next token: no labels are needed, and every vocabulary entry's probability teaches. The
block-wise methods each see one block's output; this sees what the gates measure, and corrects
the error the blocks leave when they add up.

Each scale is trained as s = s0 * exp(u), u starting at 0 (the block-wise result exactly), so one
Adam step moves every scale by about the same fraction whatever its size; the forward multiplies by
s rounded to bf16 (straight through), the dtype the checkpoint stores, so what is trained is what
is written. One pass over `samples` calibration samples, one sample a step, the learning rate
cosine-decayed to 0. Teacher and student run in float32, the whole model at once (two copies in
memory: this is for models that fit; the block-wise methods are not).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .methods.args import DistillArgs
from .quant import SCALE_DTYPE
from .quant_linear import QuantLinear

log = logging.getLogger(__name__)


def round_to_stored(s: torch.Tensor) -> torch.Tensor:
    """s rounded to the checkpoint's scale dtype forward, identity backward (straight through)."""
    return (s.to(SCALE_DTYPE).float() - s).detach() + s


@dataclass
class TrainedScales:
    """One QuantLinear's scales under training: W_hat = (q - zp) * s0 * exp(u), s rounded as stored."""
    module: QuantLinear
    codes: torch.Tensor  # q - zp per weight [out, in], int8 (|q - zp| <= 2^bits - 1 fits for <= 7 bits) or float
    columns: torch.Tensor  # the scale column (group) each input column reads
    base: torch.Tensor  # s0 [out, groups], float32
    log_ratio: nn.Parameter  # u, same shape

    @classmethod
    def of(cls, m: QuantLinear) -> TrainedScales:
        w = m.scheme.weights
        q, zp = m.codes(), m.zero_point()
        if hasattr(m, "weight_g_idx"):
            columns = m.weight_g_idx.long()
        elif w.strategy == "group":
            columns = torch.arange(m.in_features, device=q.device) // w.group_size
        else:  # per channel: one scale per row
            columns = torch.zeros(m.in_features, dtype=torch.long, device=q.device)
        codes = q.float() if zp is None else q.float() - zp.float()[:, columns]
        if w.num_bits <= 7:
            codes = codes.to(torch.int8)  # exact, and a quarter of float32's memory
        base = m.weight_scale.detach().float().clone()
        return cls(m, codes, columns, base, nn.Parameter(torch.zeros_like(base)))

    def scale(self) -> torch.Tensor:
        return round_to_stored(self.base * torch.exp(self.log_ratio))

    def weight(self) -> torch.Tensor:
        return self.codes.float() * self.scale()[:, self.columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.module.bias
        return F.linear(x, self.weight().to(x.dtype), None if bias is None else bias.to(x.dtype))

    @torch.no_grad()
    def store(self) -> float:
        """Write the trained scales into the module (as stored); returns the largest relative change."""
        s = self.scale().detach()
        self.module.weight_scale.copy_(s.to(self.module.weight_scale.dtype))
        return float(((s - self.base).abs() / self.base.abs().clamp_min(1e-30)).max()) if s.numel() else 0.0


def trainable(model: nn.Module) -> list[TrainedScales]:
    """Every QuantLinear with integer weights (fp8's per-channel scales are left as they are)."""
    return [TrainedScales.of(m) for m in model.modules()
            if isinstance(m, QuantLinear) and m.scheme.weights.type == "int"]


@contextlib.contextmanager
def training_forward(scales: list[TrainedScales]):
    """Each module's forward computes with its trained scales (forward pre-hooks, e.g. an online
    Hadamard rotation of the input, still run: they live in the module's __call__)."""
    for t in scales:
        t.module.forward = t.forward
    try:
        yield
    finally:
        for t in scales:
            del t.module.forward


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), in nats."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def distill_scales(student: nn.Module, teacher: nn.Module, ids: torch.Tensor, args: DistillArgs,
                   progress: bool = True) -> dict:
    """Train `student`'s QuantLinear scales in place against `teacher` (the same model unquantized,
    float32) on args.samples of the calibration samples ids [N, L]; returns the report."""
    t0 = time.perf_counter()
    n = min(args.samples, len(ids))
    if n < args.samples:
        log.warning("distill: %d samples asked for, the calibration set has %d; using %d", args.samples, len(ids), n)
    scales = trainable(student)
    if not scales or n == 0:
        return {"samples": 0, "layers": 0, "seconds": time.perf_counter() - t0}
    device = scales[0].base.device
    dtype = next(student.parameters()).dtype
    student.float()  # the forward and its gradients in float32; the checkpoint's dtype is set when writing
    params = [t.log_ratio for t in scales]
    frozen = [p for p in student.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    opt = torch.optim.Adam(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / n)))
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:n]
    losses = []
    use_cache = student.config.use_cache
    student.config.use_cache = False
    try:
        with training_forward(scales):
            for i in tqdm(order.tolist(), desc="qtk distill", unit="sample", disable=not progress):
                x = ids[i:i + 1].to(device)
                with torch.no_grad():
                    target = teacher(x, use_cache=False).logits
                loss = kl_divergence(target, student(x, use_cache=False).logits)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
        moved = max(t.store() for t in scales)
    finally:
        student.config.use_cache = use_cache
        for p in frozen:
            p.requires_grad_(True)
        student.to(dtype)
    quarter = max(1, n // 4)
    report = {"samples": n, "layers": len(scales), "lr": args.lr,
              "scales": sum(t.base.numel() for t in scales), "largest_relative_change": moved,
              "kl_first_quarter": sum(losses[:quarter]) / quarter, "kl_last_quarter": sum(losses[-quarter:]) / quarter,
              "seconds": time.perf_counter() - t0}
    log.info("distill: %d scales of %d layers trained on %d samples in %.0f s; KL %.4f over the first quarter, "
             "%.4f over the last", report["scales"], len(scales), n, report["seconds"],
             report["kl_first_quarter"], report["kl_last_quarter"])
    return report
