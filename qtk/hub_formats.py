"""GPTQ and AWQ checkpoints, the hub's two common 4-bit layouts, read into compressed-tensors'.

A GPTQ checkpoint (AutoGPTQ, GPTQModel, optimum: quantization_config.quant_method "gptq",
checkpoint_format "gptq" or "gptq_v2") and an AWQ one (AutoAWQ's GEMM layout: quant_method
"awq", version "gemm") store each quantized Linear [out N, in K] as

                GPTQ                                     AWQ (gemm)
    qweight     int32 [K*b/32, N], packed along K:       int32 [K, N*b/32], packed along N: word c
                word i holds inputs (32/b)i + j at       holds outputs 8c + ORDER[j] at bits 4j,
                bits b*j                                 ORDER = 0 2 4 6 1 3 5 7
    qzeros      int32 [groups, N*b/32], packed along N   same packing (and order) as its qweight
                (v1 "gptq" stores zero - 1, v2 zero)      (zero_point false: GPTQModel's symmetric
                                                         AWQ, every zero 2^(b-1))
    scales      fp16 [groups, N]
    g_idx       int32 [K]: the group of each input       (none: group k // group_size)
                (act-order / desc_act permutes it)

    w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),   g = g_idx[k] or k // group_size

with q and zero unsigned b-bit integers. compressed-tensors (and QuantLinear) store the signed
q - 2^(b-1) as q - 2^(b-1) + 2^(b-1): the same bits, so GPTQ's qweight transposed is weight_packed,
and AWQ's is unpacked, put in order and packed along K; zero points are repacked likewise.
v1 words are read as GPTQModel reads them, word + 0x11111111 (4-bit; 0x01010101 for 8): it writes
them as v2 word - 0x11111111, so a zero of 0 borrows from the next field, and only the carry undoes
that (AutoGPTQ's packer instead ORs the wrapped -1 over the fields above, which no reader undoes;
those words read as GPTQModel and transformers read them). Reading is exact, and the kernels run
the result as they run llm-compressor's checkpoints:
- a layer whose zeros are all 2^(b-1) (every symmetric checkpoint) has no zero point;
- g_idx that is not k // group_size becomes weight_g_idx (run as a column permutation,
  kernels/dispatch.py); a trivial one is dropped;
- a partial last group (K not a multiple of group_size, as AutoGPTQ and GPTQModel allow) becomes
  groups of gcd(K, group_size), each group's scale and zero repeated: the same weights, in groups
  the kernels take (with act-order, g_idx reads it instead, on the reference path).
Bit width and group count come from each layer's tensors (GPTQModel's per-module `dynamic`
overrides need nothing more), checked against the Linear the config describes. Layers without a
qweight are float and load as such (lm_head, `modules_to_not_convert`, GPTQModel's "-:" rules).
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import torch
from torch import nn

from . import moe
from .errors import CheckpointError
from .quant import pack_int32, unpack_int32
from .schemes import QuantArgs, Scheme

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word c's nibble j holds output 8c + AWQ_ORDER[j]
AWQ_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + i is nibble AWQ_INVERSE[i]
BITS = (4, 8)  # what QuantLinear's packed layout and qtk's kernels run


def is_hub_format(qc: dict) -> bool:
    return qc.get("quant_method") in METHODS


def check_config(qc: dict, path: Path) -> None:
    """The config's layout is one qtk reads (before any tensor is read)."""
    method = qc["quant_method"]
    where = f"{path / 'config.json'} quantization_config"
    if method == "gptq":
        fmt = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format", "gptq")  # AutoGPTQ 0.6
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; qtk reads "
                                  "'gptq' (v1) and 'gptq_v2' (GPTQModel can convert others back to them)")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ version {version!r} is not supported; qtk reads AutoAWQ's "
                                  "'gemm' layout (as vLLM does)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits is None:
        raise CheckpointError(f"{where}: a {method.upper()} config needs 'bits' (is this a {method.upper()} "
                              "checkpoint? its quant_method says so)")
    if bits not in BITS or (method == "awq" and bits != 4):
        raise CheckpointError(f"{where}: {bits}-bit {method.upper()} is not supported; qtk reads "
                              + ("4- and 8-bit GPTQ" if method == "gptq" else "4-bit AWQ"))


def describe(qc: dict) -> list[dict]:
    """`qtk inspect`'s line for the config (the layers' own bits and groups are in their rows)."""
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    if qc["quant_method"] == "gptq":
        fmt = "gptq v2" if qc.get("checkpoint_format") == "gptq_v2" else "gptq v1"
        sym = qc.get("sym", True)
        order = ", act-order" if qc.get("desc_act") else ""
    else:
        fmt, sym, order = "awq gemm", not qc.get("zero_point", True), ""
    w = f"int{bits} " + ("channel" if group in (-1, None) else f"group g{group}") + ("" if sym else " asym") + order
    return [{"group": qc["quant_method"], "targets": ["Linear"], "format": fmt, "weights": w, "activations": None}]


def convert(qc: dict, tensors: dict[str, torch.Tensor], model: nn.Module,
            path: Path) -> tuple[dict[str, Scheme], dict[str, torch.Tensor]]:
    """(scheme of each quantized Linear, the tensors in compressed-tensors' names and layout)."""
    method, v1 = qc["quant_method"], qc.get("checkpoint_format", "gptq") == "gptq"
    out = dict(tensors)
    schemes = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or f"{name}.qweight" not in tensors:
            continue
        parts = {k: out.pop(f"{name}.{k}", None) for k in ("qweight", "qzeros", "scales", "g_idx")}
        missing = [k for k in ("qzeros", "scales") if parts[k] is None]
        if missing:
            raise CheckpointError(f"{path}: {name} has a qweight but no {missing[0]}")
        for k in ("qweight", "qzeros"):  # GPTQModel can pack into int8/16/64 words (pack_dtype)
            if parts[k].dtype != torch.int32:
                raise CheckpointError(f"{path}: {name}.{k} is {str(parts[k].dtype).removeprefix('torch.')}; qtk "
                                      "reads int32-packed GPTQ / AWQ layers (GPTQModel's default pack_dtype)")
        if not parts["scales"].is_floating_point():
            raise CheckpointError(f"{path}: {name}.scales is {parts['scales'].dtype}, not a float tensor")
        layer = _gptq_layer if method == "gptq" else _awq_layer
        try:
            bits, q, zero, scales, g_idx = layer(parts, mod.in_features, mod.out_features, v1)
            schemes[name], layer_tensors = _compressed(bits, q, zero, scales, g_idx,
                                                       _group_size(qc, name, mod.in_features))
        except ValueError as e:
            raise CheckpointError(f"{path}: {name}: {e}") from e
        out.update({f"{name}.{k}": v for k, v in layer_tensors.items()})
        _drop_zero_bias(out, name, mod, path)
    if not schemes:
        raise CheckpointError(f"{path}: quantization_config says {method.upper()}, but no layer has a qweight")
    _check_no_stray_layers(out, model, path)
    return schemes, out


def _check_no_stray_layers(tensors: dict, model: nn.Module, path: Path) -> None:
    """Every qweight went to a Linear of the model: one left names a layer (e.g. experts packed in
    another tool's module layout) that the model the config describes does not have."""
    stray = sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight"))
    if stray:
        mt = model.config.model_type
        raise CheckpointError(f"{path}: {len(stray)} quantized layers are no Linear of the {mt} model the config "
                              f"describes, e.g. {moe.hub_name(mt, stray[0])}; qtk reads MoE experts one per expert, "
                              "named as GPTQModel and AutoAWQ name them (mlp.experts.N.gate_proj, Mixtral's "
                              "block_sparse_moe.experts.N.w1)")


def _gptq_layer(t: dict, k: int, n: int, v1: bool):
    """(bits, codes packed as compressed-tensors' weight_packed [N, K*b/32], unsigned zeros
    [groups, N], scales [groups, N], g_idx [K] or None)."""
    bits = _bits(t["qweight"].shape[0] * 32, k, "qweight rows x 32 / in_features")
    _shape(t["qweight"], (k * bits // 32, n), "qweight")
    _shape(t["qzeros"], (t["scales"].shape[0], n * bits // 32), "qzeros")
    # both store code + 2^(b-1) = GPTQ's unsigned code, packed along K the same way: a transpose
    packed = t["qweight"].t().contiguous()
    qzeros = _v1_to_v2(t["qzeros"], bits) if v1 else t["qzeros"]
    zero = unpack_int32(qzeros, bits, n).to(torch.int16) + (1 << (bits - 1))
    g_idx = t["g_idx"]
    if g_idx is not None:
        _shape(g_idx, (k,), "g_idx")
        if g_idx.min() < 0 or g_idx.max() >= t["scales"].shape[0]:
            raise ValueError(f"g_idx names groups outside 0..{t['scales'].shape[0] - 1}")
    return bits, packed, zero, t["scales"], g_idx


def _v1_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQModel's convert_gptq_v1_to_v2_format: + 1 in every field of the word, carries included."""
    ones = sum(1 << i for i in range(0, 32, bits))  # 0x11111111 for 4 bits
    w = (qzeros.to(torch.int64) + ones) & 0xFFFFFFFF
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def _awq_layer(t: dict, k: int, n: int, v1: bool):
    bits = _bits(t["qweight"].shape[1] * 32, n, "qweight columns x 32 / out_features")
    _shape(t["qweight"], (k, n * bits // 32), "qweight")
    _shape(t["qzeros"], (t["scales"].shape[0], n * bits // 32), "qzeros")
    packed = _awq_codes_along_k(t["qweight"], k, n)
    zero = unpack_int32(t["qzeros"], bits, n)[:, _awq_inverse(n)].to(torch.int16) + (1 << (bits - 1))
    return bits, packed, zero, t["scales"], None


def _awq_codes_along_k(qweight: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """AWQ's qweight [K, N/8] -> weight_packed [N, K/8], in bytes: a 4096 x 14336 layer in ~1 s on
    2 busy cores, against 2.7 s unpacking to int32 codes and packing again (kept for odd K)."""
    if sys.byteorder != "little" or k % 8:
        q = unpack_int32(qweight, 4, n)[:, _awq_inverse(n)]
        return pack_int32(q.t().contiguous(), 4)
    # [K, N/8] words -> [N/8, 4, K]: byte m of word c, along K (byte m holds nibbles 2m, 2m + 1)
    b = qweight.contiguous().view(torch.uint8).reshape(k, n // 8, 4).permute(1, 2, 0).contiguous()
    nibble = [b[:, j // 2] & 0xF if j % 2 == 0 else b[:, j // 2] >> 4 for j in range(8)]  # each [N/8, K]
    q = torch.stack([nibble[j] for j in AWQ_INVERSE], dim=1).reshape(n, k)  # [N, K] unsigned codes
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous().view(torch.int32)  # input 8w + j at bits 4j


def _awq_inverse(n: int) -> torch.Tensor:
    """Column index into an AWQ-packed row's unpacked nibbles, for outputs 0..n-1."""
    return torch.tensor(AWQ_INVERSE).repeat(n // 8) + torch.arange(n).div(8, rounding_mode="floor") * 8


def _bits(total: int, features: int, what: str) -> int:
    bits = total // features
    if total % features or bits not in BITS:
        raise ValueError(f"{what} gives {total / features:g} bits; qtk reads 4- and 8-bit layers")
    return bits


def _shape(t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {list(t.shape)}, the layer needs {list(shape)}")


def _group_size(qc: dict, name: str, k: int) -> int:
    """The layer's group size (GPTQModel's `dynamic` may override it per module)."""
    size = qc.get("group_size", qc.get("q_group_size", -1))
    for pattern, override in (qc.get("dynamic") or {}).items():
        if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), name):
            size = override.get("group_size", size)
            break
    return k if size in (-1, None) else size


def _compressed(bits: int, packed, zero, scales, g_idx, group_size: int) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """Codes already in weight_packed's layout [N, K*b/32]; zero [groups, N] unsigned -> signed, packed."""
    n, k = packed.shape[0], packed.shape[1] * 32 // bits
    groups = scales.shape[0]
    if groups != math.ceil(k / group_size):
        raise ValueError(f"{groups} scale rows for {k} inputs do not fit group_size {group_size}")
    half = 1 << (bits - 1)
    zp = None if (zero == half).all() else zero - half
    trivial = torch.arange(k, dtype=torch.int32) // group_size
    if k % group_size and (g_idx is None or torch.equal(g_idx.to(torch.int32), trivial)):
        # a partial last group: the same weights in groups of gcd(K, group_size), each a part of one
        # group (its scale and zero repeated), which every kernel takes (576 in 128s: 9 groups of 64)
        repeat, group_size = group_size // math.gcd(k, group_size), math.gcd(k, group_size)
        scales = scales.repeat_interleave(repeat, dim=0)[:k // group_size]
        zp = None if zp is None else zp.repeat_interleave(repeat, dim=0)[:k // group_size]
        g_idx, groups = None, k // group_size
    strategy = "channel" if groups == 1 else "group"
    args = QuantArgs(num_bits=bits, type="int", symmetric=zp is None, strategy=strategy,
                     group_size=group_size if strategy == "group" else None)
    tensors = {"weight_packed": packed, "weight_scale": scales.t().contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zp is not None:
        tensors["weight_zero_point"] = pack_int32(zp.t().to(torch.int8).contiguous(), bits, packed_dim=0)
    if g_idx is not None and (k % group_size or not torch.equal(g_idx.to(torch.int32), trivial)):
        tensors["weight_g_idx"] = g_idx.to(torch.int32).contiguous()  # act-order (with a partial group)
    return Scheme(weights=args, stored_format="pack-quantized"), tensors


def _drop_zero_bias(tensors: dict, name: str, mod: nn.Linear, path: Path) -> None:
    """AutoGPTQ saves a bias for every quantized Linear; one the model has none for must be zeros."""
    bias = tensors.get(f"{name}.bias")
    if bias is None or mod.bias is not None:
        return
    if bias.any():
        raise CheckpointError(f"{path}: {name}.bias is not zero, but the config's model has no bias there")
    del tensors[f"{name}.bias"]
