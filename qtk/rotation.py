"""Hadamard rotations applied before calibration (QuaRot, Ashkboos et al. 2024; SpinQuant's R2 and
R4, Liu et al. 2024): the model computes the same function, with flatter weights to round.

`v_o` rotates each attention head's values: v' = H^T v per head (the v_proj rows of each KV head,
and a fused qkv projection's value rows), so every head's attention output is H^T a, which o_proj
undoes with its columns W_o' = W_o H per query head. H is the normalized Sylvester Hadamard matrix
of the head size (a power of two), the same for every head, so grouped-query attention needs
nothing more. Attention is linear in the values per head, which is what makes this exact; a model
whose values pass through anything else (a norm on v) would change, so the rotated model's
next-token distribution is checked against the original's on a few tokens and the rotation is
refused if they differ.

Why: a rotation spreads a head's outlier channels over all of its channels, so the int4 groups of
v_proj's rows and o_proj's columns (one head's 64 columns are one group at group size 64) see
flatter weights. `v_o` is fused into the weights: nothing to apply at run time.

`residual` rotates the residual stream (QuaRot's Q, SpinQuant's R1), fused into the weights: every
norm that reads the residual first gives its weight to the Linear layers it feeds (their columns
W diag(g), the norm's weight then 1: an RMSNorm without a weight commutes with any rotation), then
the residual becomes x Q: the embeddings' rows E Q, the columns of every Linear that reads the
residual (q/k/v, gate/up, lm_head) W Q, the rows of every one that writes it (o_proj, down_proj)
Q^T W (bias b Q). Q = diag(s) H: H a Hadamard matrix of the hidden size (hadamard_matrix: 576 = 36 x
16 for SmolLM2), s random signs (seeded), as QuaRot's randomized Hadamard; a random orthogonal
matrix where no Hadamard matrix of that order is built. Tied embeddings are untied first: the
embedding takes E Q, and lm_head, which must also take the final norm's weight, W diag(g) Q, so the
checkpoint then holds lm_head's weight (vocab x hidden more bytes: 56 MB at bf16 on SmolLM2-135M).
Only weights change: the checkpoint is plain compressed-tensors, for vLLM and transformers alike.

`down` rotates each MLP down projection's input online (R4): its columns become W H, and the input
x H is computed at every forward by a fast Walsh-Hadamard transform (hadamard.py; H block-diagonal,
Sylvester blocks of the largest power of two dividing the intermediate size, at most 512). Nothing
before the down projection can absorb H (the GLU's product is not linear), so the checkpoint carries
it as compressed-tensors' transform config, which vLLM, transformers' compressed-tensors loader and
qtk's runtime apply. Every down projection's inputs then mix all the channels of a block, so an
outlier channel of the GLU's output no longer sets one column group's int4 range.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from . import hadamard as hd
from .arch import Arch
from .errors import InputError

log = logging.getLogger(__name__)

ROTATIONS = ("residual", "v_o", "down")  # applied in this order
SEED = 0  # the residual rotation's random signs (and random orthogonal matrix, where no Hadamard)
CHECK_TOKENS = 16
MAX_KL = 1e-2  # nats, in float32: far above float32's rounding (about 1e-7), far below a changed function
# ... and no log-probability moved by more than this fraction of the largest: a random tiny model's
# near-uniform distributions keep the KL of a changed function small (a post-norm rotated: 0.5 apart)
MAX_MOVED = 1e-3


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix / sqrt(n) (orthogonal and symmetric), float64."""
    if n < 1 or n & (n - 1):
        raise InputError(f"a Hadamard rotation of size {n}: only powers of two are built (the head size)")
    return hd.sylvester(n)


def _rotate_rows(linear: nn.Linear, H: torch.Tensor, rows: slice) -> None:
    """linear's output rows in `rows` -> H^T per head (blocks of H's size), bias alike."""
    w = linear.weight.data
    block = w[rows].double()
    d = H.shape[0]
    w[rows] = (H.t() @ block.reshape(-1, d, block.shape[1])).reshape(block.shape).to(w.dtype)
    if linear.bias is not None:
        b = linear.bias.data
        b[rows] = (b[rows].double().reshape(-1, d) @ H).reshape(-1).to(b.dtype)


def _rotate_columns(linear: nn.Linear, H: torch.Tensor) -> None:
    """linear's input columns -> W H per head."""
    w = linear.weight.data
    d = H.shape[0]
    w.copy_((w.double().reshape(w.shape[0], -1, d) @ H).reshape(w.shape).to(w.dtype))


def head_dim(model: nn.Module) -> int:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@torch.no_grad()
def rotate_values(model: nn.Module, arch: Arch) -> int:
    """Rotate every block's v -> o pair in place (see the module's docstring); returns how many
    blocks were rotated. Refused (InputError, the model left as it was) where the model would change."""
    d = head_dim(model)
    H = hadamard(d)
    layers = model.get_submodule(arch.layers)
    pairs = []
    for i, block_pairs in enumerate(arch.smooth):
        for p in block_pairs:
            prev = layers[i].get_submodule(p.prev)
            inside = arch.attention[i] is not None and p.prev.startswith(arch.attention[i] + ".")
            if not (inside and isinstance(prev, nn.Linear) and len(p.linears) == 1):  # the attention's v -> o
                continue
            o = layers[i].get_submodule(p.linears[0])
            kv_rows = _value_rows(model, prev, p.tail)
            if kv_rows % d or o.in_features % d:
                continue
            pairs.append((prev, o, slice(prev.out_features - kv_rows, prev.out_features)))
    if not pairs:
        raise InputError(f"model_type {arch.model_type!r}: no values -> output projection pair in its attention to "
                         "rotate (--rotate v_o)")
    saved = [(prev.weight.data.clone(), None if prev.bias is None else prev.bias.data.clone(),
              o.weight.data.clone()) for prev, o, _ in pairs]

    def rotate():
        for prev, o, rows in pairs:
            _rotate_rows(prev, H, rows)
            _rotate_columns(o, H)

    def undo():
        for (prev, o, _), (w, b, wo) in zip(pairs, saved):
            prev.weight.data.copy_(w)
            if b is not None:
                prev.bias.data.copy_(b)
            o.weight.data.copy_(wo)

    kl = _checked(model, rotate, undo, f"model_type {arch.model_type!r}: rotating the values changes the model's "
                  "outputs (KL {kl:.3g} on {n} tokens): something between v_proj and o_proj is not per-head linear; "
                  "quantize without --rotate v_o")
    log.info("rotation v_o: %d blocks, Hadamard %d per head (KL to the unrotated model %.2g)", len(pairs), d, kl)
    return len(pairs)


def _value_rows(model: nn.Module, prev: nn.Linear, tail: bool) -> int:
    """How many of prev's output rows are values: all of a v_proj's, the tail of a fused qkv."""
    if not tail:
        return prev.out_features
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_heads * head_dim(model)


def _rotate_inputs(linear: nn.Linear, block: int) -> None:
    """linear's columns -> W H, H the block-diagonal Sylvester matrix: each row of W through the fast
    Walsh-Hadamard transform (H is symmetric), in float32."""
    w = linear.weight.data
    w.copy_(hd.fwht(w.float(), block).to(w.dtype))


@torch.no_grad()
def rotate_down(model: nn.Module, arch: Arch) -> int:
    """Rotate every block's down projection's input online (see the module's docstring): its columns
    become W H and it rotates its input at every forward (hadamard.attach). Returns how many were
    rotated: 0, with a warning, where the model has no down_proj (GPT-NeoX's and OPT's MLPs are
    named otherwise and their activation is not a GLU: the recipe's rotation is then not applied);
    refused (InputError, the model left as it was) where rotating would change the model."""
    layers = model.get_submodule(arch.layers)
    downs = [(f"{arch.layers}.{i}.{n}", m) for i, layer in enumerate(layers) for n, m in layer.named_modules()
             if n.split(".")[-1] == "down_proj" and isinstance(m, nn.Linear)]
    if not downs:
        log.warning("model_type %r: no down_proj Linear in its blocks; the down projections' rotation (rotate: "
                    "[down]) is not applied", arch.model_type)
        return 0
    saved = [m.weight.data.clone() for _, m in downs]

    def rotate():
        for _, m in downs:
            block = hd.block_size(m.in_features)
            _rotate_inputs(m, block)
            hd.attach(m, block)

    def undo():
        for (_, m), w in zip(downs, saved):
            m.weight.data.copy_(w)
            hd.detach(m)

    kl = _checked(model, rotate, undo, f"model_type {arch.model_type!r}: rotating the down projections' inputs "
                  "changes the model's outputs (KL {kl:.3g} on {n} tokens); quantize without --rotate down "
                  "(--rotate none)")
    blocks = sorted({hd.of(m) for _, m in downs})
    log.info("rotation down: %d down projections, Hadamard blocks of %s online (KL to the unrotated model %.2g)",
             len(downs), "/".join(map(str, blocks)), kl)
    return len(downs)


def residual_matrix(n: int, seed: int = SEED) -> torch.Tensor:
    """Q [n, n] float64, orthogonal: diag(s) H, H the normalized Hadamard matrix of order n (else a
    random orthogonal matrix, the QR of a Gaussian one), s random signs."""
    g = torch.Generator().manual_seed(seed)
    h = hd.hadamard_matrix(n)
    if h is None:
        log.info("rotation residual: no Hadamard matrix of order %d built; a random orthogonal matrix instead", n)
        q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        h = q * torch.sign(torch.diagonal(r))
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return signs[:, None] * h


def _final_norm(model: nn.Module, arch: Arch) -> nn.Module:
    """The norm between the last block and lm_head: the one module outside the blocks named *norm."""
    norms = [m for n, m in model.named_modules() if not n.startswith(arch.layers + ".") and n != arch.layers
             and "norm" in n.split(".")[-1].lower() and getattr(m, "weight", None) is not None]
    if len(norms) != 1:
        raise InputError(f"model_type {arch.model_type!r}: {len(norms)} norms outside the blocks where one final norm "
                         "before lm_head was expected; quantize without --rotate residual")
    return norms[0]


def _set_tied(model: nn.Module, tied: bool) -> None:
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        config.tie_word_embeddings = tied


def _untie(model: nn.Module, embed: nn.Module, head: nn.Module) -> bool:
    """Give lm_head a weight of its own where it shares the embeddings' (and say so in the config).
    Returns whether it did."""
    if head.weight is not embed.weight:
        return False
    head.weight = nn.Parameter(embed.weight.data.clone(), requires_grad=False)
    _set_tied(model, False)
    return True


def _retie(model: nn.Module, embed: nn.Module, head: nn.Module) -> None:
    head.weight = embed.weight
    _set_tied(model, True)


@torch.no_grad()
def rotate_residual(model: nn.Module, arch: Arch) -> int:
    """Fold the norms and rotate the residual stream (see the module's docstring); returns how many
    blocks. Refused (InputError, the model left as it was) where a norm has a bias (a LayerNorm, which
    subtracts the mean: not rotation-invariant) or the rotated model's outputs differ."""
    config = model.config.get_text_config(decoder=True)
    n = config.hidden_size
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or getattr(head, "weight", None) is None:
        raise InputError(f"model_type {arch.model_type!r}: no input and output embeddings to rotate "
                         "(--rotate residual)")
    final = _final_norm(model, arch)
    layers = model.get_submodule(arch.layers)
    offsets = [p.offset for pairs in arch.smooth for p in pairs]
    norms, readers, writers = [(final, [head], offsets[0] if offsets else 0.0)], [head], []  # the blocks' norms' kind
    for i, layer in enumerate(layers):
        pairs = [p for p in arch.smooth[i] if not isinstance(layer.get_submodule(p.prev), nn.Linear)]
        reads = {name for p in pairs for name in p.linears}
        for p in pairs:
            norms.append((layer.get_submodule(p.prev), [layer.get_submodule(x) for x in p.linears], p.offset))
        readers += [layer.get_submodule(x) for x in reads]
        writers += [m for name, m in layer.named_modules()
                    if isinstance(m, nn.Linear) and name not in reads and m.out_features == n]
    for norm, _, _ in norms:
        if getattr(norm, "bias", None) is not None:
            raise InputError(f"model_type {arch.model_type!r}: its norms have a bias (LayerNorm subtracts the mean, "
                             "which a rotation does not keep); quantize without --rotate residual")
    if any(not isinstance(m, nn.Linear) or m.in_features != n for m in readers):
        raise InputError(f"model_type {arch.model_type!r}: a layer that reads the residual stream is not a Linear of "
                         f"{n} inputs; quantize without --rotate residual")
    untied = _untie(model, embed, head)
    touched = [embed, *readers, *writers, *(norm for norm, _, _ in norms)]
    saved = [(m, {k: v.data.clone() for k, v in m.named_parameters(recurse=False)}) for m in touched]
    Q = residual_matrix(n)

    def rotate():
        q = Q.float()
        for norm, linears, offset in norms:  # y = x / rms(x) * (offset + g): (offset + g) into the columns
            g = norm.weight.data.float() + offset
            for lin in linears:
                lin.weight.data.mul_(g.to(lin.weight.dtype))
            norm.weight.data.fill_(1.0 - offset)
        embed.weight.data.copy_(embed.weight.data.float() @ q)
        for lin in readers:
            lin.weight.data.copy_(lin.weight.data.float() @ q)
        for lin in writers:
            lin.weight.data.copy_(q.t() @ lin.weight.data.float())
            if lin.bias is not None:
                lin.bias.data.copy_(lin.bias.data.float() @ q)

    def undo():
        for m, params in saved:
            for k, v in params.items():
                getattr(m, k).data = v
        if untied:
            _retie(model, embed, head)

    kl = _checked(model, rotate, undo, f"model_type {arch.model_type!r}: rotating the residual stream changes the "
                  "model's outputs (KL {kl:.3g} on {n} tokens): something reads or writes it other than the norms' "
                  "Linear layers and the blocks' output projections; quantize without --rotate residual")
    log.info("rotation residual: %d blocks, %s of %d fused%s (KL to the unrotated model %.2g)", len(layers),
             "Hadamard" if hd.hadamard_matrix(n) is not None else "random orthogonal", n,
             f"; the tied embeddings untied (lm_head's {head.weight.numel() * head.weight.element_size() / 1e6:.0f} MB "
             "written apart)" if untied else "", kl)
    return len(layers)


def _checked(model: nn.Module, rotate, undo, refusal: str) -> float:
    """rotate() the model, checked: the next-token distributions on CHECK_TOKENS tokens before and
    after (their KL, and the largest change of a log-probability), in float32 (a bf16 forward departs from float32's by up to KL 1.7 on these tokens (the
    bundled model), which would hide a changed function or refuse an exact one); undo() and
    InputError(refusal) where they differ. The rotated weights are rounded once, to each parameter's
    own dtype. Returns the KL."""
    dtypes = {p: p.dtype for p in model.parameters()}
    for p in dtypes:
        p.data = p.data.float()
    try:
        ids = torch.arange(1, CHECK_TOKENS + 1).unsqueeze(0) % model.config.get_text_config(decoder=True).vocab_size
        before = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
        rotate()
        after = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
        kl = (before.exp() * (before - after)).sum(-1).max().item()
        moved = ((after - before).abs().max() / before.abs().max().clamp(min=1.0)).item()
        if not (kl < MAX_KL and moved < MAX_MOVED):
            undo()
            raise InputError(refusal.format(kl=kl, n=CHECK_TOKENS))
    finally:
        for p, dtype in dtypes.items():
            p.data = p.data.to(dtype)
    return kl
