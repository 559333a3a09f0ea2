"""The runtime's model over a loaded transformers causal LM: qtk's native forward where it has one
(models/native.py: FAMILIES), else transformers' own modeling code with qtk's paged attention
(models/generic.py). Both take the same step (input_ids, positions [T], AttentionMetadata, KV
caches) and give hidden states [T, hidden]; logits(hidden) is the causal LM's."""
from __future__ import annotations

from torch import nn

from ...errors import InputError
from ...moe import linearize_experts
from ..packed_linear import bf16_checkpoint, bf16_lm_head, pack_linears
from .generic import GenericModel, unsupported
from .native import FAMILIES, FUSED, NativeModel


def is_native(hf_model: nn.Module) -> bool:
    return hf_model.config.model_type in FAMILIES


def build(hf_model: nn.Module, model_impl: str = "auto") -> NativeModel | GenericModel:
    """The runtime model over hf_model, its float32 CPU Linears packed for oneDNN (and, on the native
    path, q/k/v and gate/up fused; the generic path keeps the module names its modeling code calls).
    model_impl (EngineConfig's, vLLM's name): "auto" the native path where there is one, else the
    generic one; "qtk" the native path only; "transformers" the generic path even where a native one
    exists (to measure one against the other). InputError with one line where the chosen path cannot
    run the model."""
    if model_impl == "qtk" and not is_native(hf_model):
        raise InputError(f"model_impl 'qtk': qtk has no native forward for model_type {hf_model.config.model_type!r} "
                         f"(it has for {sorted(FAMILIES)}); use model_impl 'auto' or 'transformers'")
    why = unsupported(hf_model)
    if why:  # before any repacking
        raise InputError(why)
    bf16 = bf16_checkpoint(hf_model)  # a quantized one's weight-only layers then multiply many rows in bf16
    bf16_lm_head(hf_model)
    if is_native(hf_model) and model_impl != "transformers":
        linearize_experts(hf_model)  # 3-D experts as per-expert Linears, each gate/up fused below
        pack_linears(hf_model, fuse=FUSED, bf16=bf16)
        return NativeModel(hf_model)
    pack_linears(hf_model, bf16=bf16)
    return GenericModel(hf_model)
