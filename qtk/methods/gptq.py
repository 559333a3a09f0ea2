"""GPTQ (Frantar et al., 2022): quantize a Linear column by column, spreading each column's
rounding error over the columns not yet quantized through the inverse Hessian of its inputs.

`quantize_weight` is the algorithm as a pure function over tensors (IST-DASLab/gptq `fasterquant`);
`quantize_block` collects H = 2/n sum x x^T for each targeted Linear in one forward of the block
(float weights) and replaces each Linear by a QuantLinear. Linears fed the same tensor (q/k/v,
gate/up) share one Hessian and are solved together, their weights stacked by rows: GPTQ treats
rows independently, so that is the same result for a third of the column loops.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from .. import distributed, quant
from ..device import cpu_has_native_bf16
from ..schemes import QuantArgs
from . import rtn
from .args import GPTQArgs

log = logging.getLogger(__name__)

MIN_TOKENS = 16  # a Linear whose input saw fewer calibration tokens is rounded to nearest instead
DAMPING_RETRIES = 3  # each retry multiplies the dampening by 10; then RTN for that layer
CLIP_SHRINK = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.86, 0.84, 0.82, 0.8)  # mse_clip grid on min/max


def quantize_weight(W: torch.Tensor, H: torch.Tensor, args: QuantArgs, gptq: GPTQArgs,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ of one weight: (codes int8 [out, in], scale, zero point or None), shaped as quant.quantize_weight.

    W [out, in] float; H [in, in] float32, 2/n sum x x^T over the calibration tokens (any positive
    multiple gives the same result). Act-order is "static": columns are solved by descending
    diag(H) but groups keep their original columns, so column j uses the scale of group j // g and
    no g_idx is needed at run time. A group's scale/zero point is fixed when the solve first reaches
    one of its columns, from the group's columns as the solve has updated them so far (before the
    solve for channel/tensor). If H + damping is not positive definite the dampening is raised
    x10 up to DAMPING_RETRIES times, then the layer falls back to RTN with a warning naming it.
    """
    if args.type != "int":
        raise ValueError(f"gptq solves for integer weights, got {args.type} weights for {name}")
    return _fasterquant(W, H, args, gptq, name)


def _fasterquant(W, H, args, gptq, name):
    W0 = W
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    columns = W.shape[1]
    # dead inputs (always 0 in calibration): any weight works, 0 keeps H invertible
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if gptq.act_order else torch.arange(columns, device=W.device)
    invperm = torch.argsort(perm)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = inverse_hessian_cholesky(H, gptq.dampening, name)
    if Hinv is None:
        return quant.quantize_weight(W0, args)

    g = args.group_size if args.strategy == "group" else columns
    group = (perm // g).tolist()  # group (original column order) of each solve position
    members = invperm.reshape(-1, g)  # [n_groups, g] solve positions of each group's columns
    opens = {int(t): k for k, t in enumerate(members.amin(dim=1))}  # solve position -> group it opens
    rows = 1 if args.strategy == "tensor" else W.shape[0]
    scale = torch.empty(len(members), rows, device=W.device)  # [n_groups, out or 1]
    zero = None if args.symmetric else torch.zeros_like(scale)
    # The paper's column i is row i of W.T: every vector of the inner loop is contiguous.
    W = W.t().contiguous()  # [in (solve order), out]
    Q = torch.zeros_like(W)  # codes
    blocksize = gptq.block_size

    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[i1:i2].clone()
        Q1 = Q[i1:i2]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            w = W1[i]
            d = Hinv1[i, i]
            k = group[i1 + i]
            if i1 + i in opens:
                # the group's columns as updated so far: W minus this block's pending (lazy) updates
                cols = members[k]
                current = W[cols] - Hinv[i1:i1 + i, cols].t() @ Err1[:i]
                s, z = group_qparams(current.t(), args, gptq.mse_clip)
                scale[k] = s
                if zero is not None:
                    zero[k] = z
            s, z = scale[k], None if zero is None else zero[k]
            # q = clamp(round(w / s) + zp, qmin, qmax), as quant.quantize
            q = torch.div(w, s, out=Q1[i]).round_()
            if z is not None:
                q.add_(z)
            q.clamp_(args.qmin, args.qmax)
            # err = (w - dequant(q)) / [H^-1]_ii
            dq = torch.mul(q, s, out=Err1[i]) if z is None else torch.sub(q, z, out=Err1[i]).mul_(s)
            err = dq.sub_(w).div_(-d)
            # the block's remaining columns absorb the error: W[:, i:] -= err [H^-1]_{i, i:}
            W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
        W[i2:] -= Hinv[i1:i2, i2:].t() @ Err1  # the lazy update of every column after the block

    Q, scale = Q.t(), scale.t()
    zero = None if zero is None else zero.t()
    q = Q[:, invperm].to(torch.int8)
    # scale [out, n_groups] for group, [out, 1] for channel, [1] for tensor (quant.py conventions)
    if args.strategy == "tensor":
        scale, zero = scale.reshape(1), None if zero is None else zero.reshape(1)
    return q, scale, zero


def inverse_hessian_cholesky(H: torch.Tensor, dampening: float, name: str) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp I)^-1, damp = dampening * mean(diag H); None if that fails.

    The dampening is raised x10 up to DAMPING_RETRIES times before giving up."""
    eye = torch.eye(H.shape[0], device=H.device)
    mean_diag = torch.mean(torch.diag(H))
    for attempt in range(DAMPING_RETRIES + 1):
        percdamp = dampening * 10 ** attempt
        L, info = torch.linalg.cholesky_ex(H + percdamp * mean_diag * eye)
        if info == 0:
            Hinv, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0 and torch.isfinite(Hinv).all():
                return Hinv
        log.debug("gptq: %s: Hessian + %.3g * mean(diag) is not positive definite", name, percdamp)
    log.warning("gptq: the Hessian of %s is not positive definite even with dampening %.3g; "
                "falling back to RTN for this layer", name, percdamp)
    return None


def group_qparams(w: torch.Tensor, args: QuantArgs, mse_clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [rows] of w [rows, c] from its min/max (one for all of w with strategy tensor).

    mse_clip: shrink min/max by each factor of CLIP_SHRINK and keep, per row, the one whose
    quantized w is closest to w (squared error)."""
    x = w.reshape(1, -1) if args.strategy == "tensor" else w
    xmin, xmax = x.amin(dim=1), x.amax(dim=1)
    scale, zero = quant.qparams(xmin, xmax, args)
    if not mse_clip:
        return scale, zero
    best = torch.full_like(scale, float("inf"))
    for p in CLIP_SHRINK:
        s, z = quant.qparams(p * xmin, p * xmax, args)
        err = (quant.fake_quantize(x, s[:, None], z[:, None], args) - x).pow(2).sum(dim=1)
        better = err < best
        best, scale, zero = torch.where(better, err, best), torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """||X (W - W_hat)^T|| / ||X W^T|| over the calibration tokens, from H = 2/n X^T X."""
    D = (W.float() - W_hat.float())
    num = torch.sum((D @ H) * D)
    den = torch.sum((W.float() @ H) * W.float()).clamp_min(1e-30)
    return torch.sqrt(num / den).item()


@contextlib.contextmanager
def bf16_products(enabled: bool):
    """Let oneDNN run a float32 matmul on bf16 units, accumulating in float32.

    Only for operands that are bf16 values (activations of a bf16 block): rounding them to bf16 is
    then exact, every product is exact in float32 and the sum is float32 as before; about 2x faster
    on CPUs with bf16 dot-product instructions (and no faster without them: 17.1 vs 17.9 ms for
    4096 x 576 on an AVX2 CPU, benchmarks/cpu_dtype.py), so only used where qtk.device finds them."""
    flag = torch.backends.mkldnn.matmul
    saved = flag.fp32_precision
    if enabled:
        flag.fp32_precision = "bf16"
    try:
        yield
    finally:
        flag.fp32_precision = saved


class HessianSum:
    """sum x^T x (upper triangle, float32) and the token count of one Linear input, from activations
    [..., in] in any float dtype; `H` is 2/n sum x x^T."""

    def __init__(self):
        self.upper: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        exact_in_bf16 = x.dtype == torch.bfloat16
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        if self.upper is None:
            self.upper = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        with bf16_products(exact_in_bf16 and x.device.type == "cpu" and cpu_has_native_bf16()):
            accumulate_upper(self.upper, x)
        self.tokens += x.shape[0]

    def scale_inputs(self, s: torch.Tensor) -> None:
        """The Linear now reads x / s (a smoothing scale folded into the op before it): H -> H / (s s^T)."""
        self.upper /= s[:, None] * s[None, :]

    @property
    def H(self) -> torch.Tensor:
        return symmetric(self.upper) * (2 / self.tokens)


def collect_hessians(block, names) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """(names, H) for each run of consecutive named Linears fed one input tensor (q/k/v, gate/up),
    solved together; H = 2/n sum x x^T in float32. A tensor fed to several runs in a forward (every
    expert's gate/up when every token goes through every expert) is accumulated once, and those runs
    share its H. `names` must be in execution order: each forward stops at the last one's input.
    A Linear that saw fewer than MIN_TOKENS tokens (an expert the router seldom or never picks) is
    left out: no H is worth solving against there (zero tokens gave llm-compressor NaN scales, its
    issue 2826)."""
    sums: dict[str, HessianSum] = {}
    owner: dict[str, str] = {}  # Linear -> first Linear that received the same input tensor
    run: dict[str, str] = {}  # Linear -> first Linear of its run (consecutive calls on one tensor)
    seen: dict[int, tuple] = {}  # id -> (weak ref to the tensor, its first Linear) in this forward
    last = {"ref": lambda: None, "name": None}

    def accumulate(name, x):
        run[name] = run[last["name"]] if last["ref"]() is x else name
        last.update(ref=weakref.ref(x), name=name)
        first = seen.get(id(x))
        if first is not None and first[0]() is x:  # (a freed tensor's id may be reused: its ref is dead)
            owner[name] = first[1]
            return
        seen[id(x)] = (weakref.ref(x), name)
        owner[name] = name
        sums.setdefault(name, HessianSum()).add(x)

    new_forward = block.layer.register_forward_pre_hook(lambda *_: seen.clear())
    try:
        with block.hooks(names, accumulate):
            block.feed(until=names[-1])
    finally:
        new_forward.remove()
    if distributed.active():
        sum_over_ranks(block, sums, owner, run)
    H = {key: h.H for key, h in sums.items() if h.tokens >= MIN_TOKENS}
    firsts = dict.fromkeys(run[n] for n in names if n in run)
    return [(tuple(n for n in names if run.get(n) == r), H[owner[r]]) for r in firsts if owner[r] in H]


def sum_over_ranks(block, sums: dict[str, HessianSum], owner: dict[str, str], run: dict[str, str]) -> None:
    """Every rank's sums added up in place (data-parallel calibration, distributed.py); a Linear this
    rank sent no token (an expert its tokens never chose) learns its run and input from the others."""
    for their_owner, their_run in distributed.gathered((owner, run)):
        for name in their_owner:
            owner.setdefault(name, their_owner[name])
            run.setdefault(name, their_run[name])
    for key in sorted(set(owner.values())):
        h = sums.setdefault(key, HessianSum())
        if h.upper is None:
            n = block.linear(key).in_features
            h.upper = torch.zeros(n, n, device=block.device)
        distributed.sum_(h.upper)
        h.tokens = int(distributed.sum_floats(h.tokens)[0])


HESSIAN_BAND = 384  # columns per band of the upper-triangle accumulation


def accumulate_upper(H: torch.Tensor, x: torch.Tensor) -> None:
    """H += x^T x on and above the diagonal only, in bands of rows (H is symmetric; `symmetric`
    fills the rest): 5/8 of the products for 4 bands, which is most of the Hessian pass on CPU."""
    n = x.shape[1]
    for a in range(0, n, HESSIAN_BAND):
        b = min(a + HESSIAN_BAND, n)
        H[a:b, a:].addmm_(x[:, a:b].t(), x[:, a:])


def symmetric(H: torch.Tensor) -> torch.Tensor:
    """The full matrix from its upper triangle."""
    return torch.triu(H) + torch.triu(H, diagonal=1).t()


def quantize_block(block, recipe) -> None:
    """Replace each targeted Linear by its GPTQ QuantLinear; block.errors = relative output error
    ||X (W - W_hat)^T|| / ||X W^T|| on this block's calibration inputs (see output_error).

    All Hessians come from one forward of the float block, as llm-compressor does (measured: the
    "true sequential" order, each stage seeing already-quantized sublayers, is not worth its extra
    forwards here; see the report). A smoothing pass that already saw every input (AWQ) leaves
    them in block.hessians, and that forward is saved."""
    act = recipe.scheme.input_activations
    absmax = rtn.static_input_scales(block, block.targets) if act is not None and not act.dynamic else {}
    kept = block.hessians
    covered = kept is not None and {n for names, _ in kept for n in names} == set(block.targets)
    groups = kept if covered else collect_hessians(block, block.targets)
    # several processes (distributed.py) share the solves: each solves its share, the rest arrive from theirs
    owners = distributed.deal([H.shape[0] ** 2 * (H.shape[0] + sum(block.linear(n).out_features for n in names))
                               for names, H in groups])
    for (names, H), owner in zip(groups, owners):
        if owner == distributed.rank():
            quantize_linears(block, names, H, recipe, absmax)
        else:  # a stand-in of the same shapes until the owner's layers arrive
            rtn.quantize_linears(block, names, recipe.scheme, absmax)
    for (names, _), owner in zip(groups, owners):
        distributed.share_layers(block, names, owner)
    solved = {n for names, _ in groups for n in names}
    starved = [n for n in block.targets if n not in solved]
    if starved:
        log.warning("%s: %s saw fewer than %d calibration tokens (experts the router seldom picks; "
                    "calibration.calibrate_all_experts routes every token through every expert): "
                    "round-to-nearest for them", block.name, ", ".join(starved), MIN_TOKENS)
        rtn.quantize_linears(block, starved, recipe.scheme, absmax)


def quantize_linears(block, names, H, recipe, absmax) -> None:
    """GPTQ of the named Linears, which share the Hessian H, each replaced by a QuantLinear."""
    scheme, args = recipe.scheme, recipe.scheme.weights
    # one solve for all of them, their rows stacked (rows are independent), except a per-tensor scale
    for part in ([names] if args.strategy != "tensor" else [(n,) for n in names]):
        linears = [block.linear(n) for n in part]
        W = torch.cat([lin.weight.data.float() for lin in linears])  # [sum of out, in]
        q, scale, zp = quantize_weight(W, H, args, recipe.gptq, name=", ".join(f"{block.name}.{n}" for n in part))
        row = 0
        for n, lin in zip(part, linears):
            rows = slice(row, row + lin.out_features)
            row += lin.out_features
            s, z = (scale, zp) if args.strategy == "tensor" else (scale[rows], None if zp is None else zp[rows])
            block.errors[n] = output_error(lin.weight.data, quant.dequantize_weight(q[rows], s, z, args), H)
            block.replace(n, rtn.to_quant_linear(lin, q[rows], s, z, scheme, absmax.get(n)))
