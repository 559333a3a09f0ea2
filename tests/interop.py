"""Helpers for the referee and peer tests: compressed-tensors' view of a checkpoint folder, and
qtk models reduced to what a comparison can hold equal.

Where qtk and compressed-tensors (0.19 and 0.20) differ on purpose:
- Dynamic per-token int8 activations: compressed-tensors' fake-quant uses scale = absmax / 127.5
  ((qmax - qmin) / 2); vLLM's int8 kernels (csrc/quantization/compressed_tensors/
  int8_quant_kernels.cu) and qtk use absmax / 127. Nothing on disk differs, so the tests put qtk
  on compressed-tensors' grid (`reference_forward(ct_grid=True)`) to compare the rest exactly.
- transformers 5.23's dequantize=True path is weight-only: it has no parameter for input_scale,
  k_scale or v_scale (reported as unexpected keys) and quantizes no activations or KV (5.17
  keeps compressed-tensors' activation fake-quant there; scripts/peer_fixtures.py turns it off).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

# The tiny random Llama and its byte tokenizer come from the script that builds the peer's
# checkpoints of the same model, so the two sides cannot drift apart.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from peer_fixtures import TINY, byte_tokenizer  # noqa: E402,F401

# compressed-tensors rounds each dequantized weight (q - zp) * s once to the scale dtype (bf16):
# relative error <= 2^-8 (bf16 has 8 significant bits).
BF16_ROUNDING = 2.0 ** -8


def quant_linears(model: nn.Module) -> dict[str, nn.Module]:
    from qtk.quant_linear import QuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def weight_only(model: nn.Module) -> nn.Module:
    """qtk's model with each QuantLinear replaced by a float Linear holding its dequantized
    weight, and the KV-cache fake quantization off: what a weight-only dequantizer computes."""
    from qtk.arch import set_module

    for name, q in quant_linears(model).items():
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        lin.weight.data = q.dequantized_weight(torch.float32)
        if q.bias is not None:
            lin.bias.data = q.bias.data.float()
        set_module(model, name, lin)
    model.config._attn_implementation = "sdpa"
    return model


def reference_forward(monkeypatch, ct_grid: bool = False) -> None:
    """Run every QuantLinear through qtk's pure-torch reference (the meaning of the checkpoint;
    the fast CPU/GPU kernels are held to it by their own tests).

    ct_grid: quantize dynamic int activations on compressed-tensors' grid (absmax / 127.5)."""
    import qtk.kernels.dispatch as dispatch
    import qtk.kernels.reference as reference
    from qtk.quant import quantize

    monkeypatch.setattr(dispatch, "quant_linear", reference.quant_linear_ref)
    if not ct_grid:
        return
    own = reference.quantize_activation

    def quantize_activation(x, args, scale=None):
        if scale is not None or args.type != "int":
            return own(x, args, scale)
        absmax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1] per token
        scale = absmax / ((args.qmax - args.qmin) / 2)
        return quantize(x, scale, None, args), scale

    monkeypatch.setattr(reference, "quantize_activation", quantize_activation)


def ct_dequantize(d: Path, fp32_scales: bool = False) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantization of a checkpoint folder (float32 results).

    fp32_scales: upcast weight_scale first, so compressed-tensors multiplies in float32 as
    qtk does and the two must agree exactly; otherwise it multiplies in the stored dtype."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    from qtk.checkpoint import read_tensors

    tensors = read_tensors(Path(d))
    if fp32_scales:
        tensors = {k: v.float() if k.endswith("weight_scale") else v for k, v in tensors.items()}
    # The converter matches tensors by name only: with targets ["Linear"] every non-norm
    # `*.weight` counts, so for int-/float-quantized it also takes the embedding and fails
    # looking for model.embed_tokens.weight_scale. Its `ignore` says what is not a Linear.
    dequantizer = CompressedTensorsDequantizer(d, ignore=["model.embed_tokens"], dtype=torch.float32)
    return dequantizer.process(tensors)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
