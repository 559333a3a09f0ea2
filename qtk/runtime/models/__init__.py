"""The runtime's model over a loaded transformers causal LM: qtk's native forward where it has one
(models/llama.py: FAMILIES), else transformers' own modeling code with qtk's paged attention
(models/generic.py). Both take the same step (input_ids, positions [T], AttentionMetadata, KV
caches) and give hidden states [T, hidden]; logits(hidden) is the causal LM's."""
from __future__ import annotations

from torch import nn

from ...errors import InputError
from ..packed_linear import bf16_lm_head, pack_linears
from .generic import GenericModel, unsupported
from .llama import FAMILIES, FUSED, LlamaModel


def is_native(hf_model: nn.Module) -> bool:
    return hf_model.config.model_type in FAMILIES


def build(hf_model: nn.Module, generic: bool = False) -> LlamaModel | GenericModel:
    """The runtime model over hf_model, its float32 CPU Linears packed for oneDNN (and, on the native
    path, q/k/v and gate/up fused; the generic path keeps the module names its modeling code calls).
    generic: the generic path even where a native one exists (vLLM's model_impl="transformers"; to
    measure one against the other). InputError with one line where the generic path cannot run the model."""
    if is_native(hf_model) and not generic:
        bf16_lm_head(hf_model)
        pack_linears(hf_model, fuse=FUSED)
        return LlamaModel(hf_model)
    why = unsupported(hf_model)
    if why:  # before any repacking
        raise InputError(why)
    bf16_lm_head(hf_model)
    pack_linears(hf_model)
    return GenericModel(hf_model)
