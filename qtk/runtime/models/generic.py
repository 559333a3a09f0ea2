"""Any transformers decoder over a packed, ragged batch: the model's own modeling code with qtk's
paged attention plugged in through transformers' AttentionInterface, as vLLM's Transformers
backend does it.

    hidden = base_model(input_ids [1, T], position_ids [1, T], qtk_step=PagedStep(meta, caches))
        each attention module calls ALL_ATTENTION_FUNCTIONS["qtk_paged"](module, q, k, v, mask,
        scaling=, sliding_window=, softcap=, s_aux=, qtk_step=...) -> PagedStep.attend: the layer's
        paged attention (module.layer_idx's cache) over the step's block tables
    logits = the causal LM's forward with its base model stood in by the given hidden states
        (lm_head and whatever follows it: Gemma 2's final soft-capping, Cohere's logit_scale, ...)

"qtk_paged" has no mask function, so transformers builds no mask (masking_utils.
_preprocess_mask_arguments returns early): the step's masks are the paged attention's, from the
metadata, with each layer's window, softcap, sinks and scale as its module passes them. The model
attends through "qtk_paged" only inside GenericModel.forward; outside it is the model it was.

At construction one probe forward of two tokens records what each attention module passes
(LayerProbe): which modules attend, their layer_idx, head counts and head_dim, windows, softcap
and sinks. A model that cannot run this way fails there with one line (`unsupported`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ...arch import unsupported_reason
from ...chunked_sdpa import attention_configs, set_implementation
from ...errors import InputError
from ..attention import NO_TERMS, AttentionMetadata, KVCache, ScoreTerms, paged_attention

log = logging.getLogger(__name__)

NAME = "qtk_paged"



@dataclass(frozen=True)
class PagedStep:
    """One step's attention inputs, passed down the model's forward as the kwarg qtk_step."""

    meta: AttentionMetadata
    kv_caches: list[KVCache]
    cpu_ops: object = None  # qtk's CPU kernel library for the "cpu" backend, or None

    def attend(self, module: nn.Module, query, key, value, scaling=None, sliding_window=None, softcap=None,
               s_aux=None, **_) -> torch.Tensor:
        """query [1, H, T, D], key/value [1, KV, T, D] -> [1, T, H, D] (what the interface returns)."""
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, D]
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        terms = ScoreTerms(softcap, s_aux) if softcap or s_aux is not None else NO_TERMS
        cache = self.kv_caches[module.layer_idx]
        return paged_attention(q, k, v, cache, self.meta, scale, self.cpu_ops, sliding_window, terms)[None]


@dataclass
class LayerProbe:
    """Stands in for PagedStep in the probe forward: records each attention call, attends to nothing."""

    calls: list[dict] = field(default_factory=list)

    def attend(self, module: nn.Module, query, key, value, attention_mask=None, sliding_window=None, softcap=None,
               s_aux=None, **_) -> torch.Tensor:
        self.calls.append(dict(module=module, layer_idx=getattr(module, "layer_idx", None), heads=query.shape[1],
                               kv_heads=key.shape[1], head_dim=key.shape[-1], v_head_dim=value.shape[-1],
                               window=sliding_window, softcap=softcap, sinks=s_aux is not None,
                               causal=getattr(module, "is_causal", True), masked=attention_mask is not None))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def qtk_paged_attention(module, query, key, value, attention_mask, qtk_step=None, **kwargs):
    """transformers' attention-function signature -> (output [1, T, H, D], None). The step comes as the
    kwarg qtk_step, or, where the modeling code drops the forward's kwargs on the way (Nemotron's
    decoder layer), as the attention module's attribute of that name for the forward (GenericModel._run)."""
    if qtk_step is None:
        qtk_step = module.__dict__.get("qtk_step")
    if qtk_step is None:
        raise MissingStep("the qtk_paged attention runs inside GenericModel.forward only (no qtk_step given)")
    return qtk_step.attend(module, query, key, value, attention_mask=attention_mask, **kwargs), None


def register() -> None:
    """Register qtk_paged with transformers, with no mask function (so no mask is built)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, qtk_paged_attention)


class MissingStep(RuntimeError):
    """The attention was called without the step: the model's forward did not pass its kwargs down."""


class GivenHidden(nn.Module):
    """Stands in for the causal LM's base model: returns the hidden states it is given as inputs_embeds.
    It is also its own child of each name the base model has (OPT's head calls model.decoder)."""

    def __init__(self, child_names: list[str]):
        super().__init__()
        self.child_names = frozenset(child_names)

    def __getattr__(self, name: str):
        if name != "child_names" and name in self.__dict__.get("child_names", ()):
            return self
        return super().__getattr__(name)

    def forward(self, *_, inputs_embeds: torch.Tensor, **__):
        from transformers.modeling_outputs import MoeModelOutputWithPast

        return MoeModelOutputWithPast(last_hidden_state=inputs_embeds)  # router_logits None: no aux loss


def unsupported(hf_model: nn.Module) -> str | None:
    """Why the generic path cannot run this model (what is missing), or None: arch's support check
    (a causal LM of attention layers only, run through the AttentionInterface), of the class and config."""
    return unsupported_reason(hf_model.config)


def _probe_problem(cfg, calls: list[dict]) -> str | None:
    """What the probe forward found that the generic path cannot run, or None."""
    n, where = cfg.num_hidden_layers, f"model_type {cfg.model_type!r}"
    if len(calls) != n or sorted(str(c["layer_idx"]) for c in calls) != sorted(str(i) for i in range(n)):
        return (f"{where}: {len(calls)} attention calls with layer_idx {[c['layer_idx'] for c in calls]} in a "
                f"forward of {n} layers; qtk's generic runtime needs one attention per layer, numbered 0..{n - 1}")
    c = next((c for c in calls if c["head_dim"] != c["v_head_dim"]), None)
    if c is not None:
        return (f"{where}: K head_dim {c['head_dim']} differs from V head_dim {c['v_head_dim']}; "
                "qtk's KV cache holds one head_dim")
    if len({(c["kv_heads"], c["head_dim"]) for c in calls}) > 1:
        return f"{where}: the layers' KV heads / head_dim differ; qtk's KV cache holds one shape for every layer"
    if not all(c["causal"] for c in calls):
        return f"{where}: an attention module is not causal; qtk's runtime runs causal decoders"
    types, window = getattr(cfg, "layer_types", None) or [], getattr(cfg, "sliding_window", None)
    if window and any(t == "sliding_attention" and c["window"] is None for t, c in zip(types, calls)):
        return (f"{where}: its sliding layers apply their window through the mask only, not passing it to the "
                "attention function, where qtk's paged attention would read it")
    if any(c["masked"] for c in calls):  # masking_utils builds none for qtk_paged: this one is the model's own
        return f"{where}: its modeling code builds an attention mask of its own, which qtk's paged attention cannot apply"
    return None


def pin_rope(model: nn.Module, max_positions: int) -> None:
    """Fix the RoPE frequencies that transformers picks per forward by its last position ("dynamic",
    "longrope") at their value for max_positions (as models/native.py frozen_rope and vLLM do), so a
    token's RoPE does not depend on the chunk and batch it runs in."""
    for m in model.modules():
        types = getattr(m, "rope_type", None)
        per_type = types if isinstance(types, dict) else {None: types} if isinstance(types, str) else {}
        moving = {lt: rt for lt, rt in per_type.items() if "dynamic" in rt or rt == "longrope"}
        if not moving:
            continue
        device = next(iter(m.buffers())).device
        for lt in moving:
            kw = {} if lt is None else {"layer_type": lt}
            m(torch.zeros(1, device=device), torch.tensor([[max_positions - 1]], device=device), **kw)
        m.rope_type = "default" if isinstance(types, str) else {**types, **dict.fromkeys(moving, "default")}


class GenericModel(nn.Module):
    """The runtime's model interface (as NativeModel's) over any transformers causal LM that runs its
    attention through the AttentionInterface."""

    why_no_graphs = "the generic path (transformers' modeling code, Python-side per-layer work) is not captured"

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        why = unsupported(hf_model)
        if why:
            raise InputError(why)
        register()
        cfg = self.config = hf_model.config
        self.base = getattr(hf_model, hf_model.base_model_prefix)  # [1, T] ids -> final hidden states
        self.head = copy.copy(hf_model)  # the causal LM sharing every module, its base stood in by GivenHidden
        self.head._modules = dict(hf_model._modules)
        setattr(self.head, hf_model.base_model_prefix, GivenHidden([n for n, _ in self.base.named_children()]))
        self._configs = attention_configs(hf_model)  # switched to qtk_paged for each forward
        pin_rope(self.base, getattr(cfg, "max_position_embeddings", None) or 2048)
        self._step_holders: list[nn.Module] = []  # see _probe
        calls = self._probe()
        calls.sort(key=lambda c: (c["layer_idx"] is None, c["layer_idx"] or 0))  # by layer
        why = _probe_problem(cfg, calls)
        if why:
            raise InputError(why)
        self.attentions = [c["module"] for c in calls]  # per layer: the module owning k_scale / v_scale
        self.num_heads, self.num_kv_heads, self.head_dim = calls[0]["heads"], calls[0]["kv_heads"], calls[0]["head_dim"]
        self.windows = [c["window"] for c in calls]
        self.softcaps = [c["softcap"] for c in calls]
        self.has_sinks = [c["sinks"] for c in calls]
        self.cpu_ops = self._cpu_ops()
        log.info("%s on the generic path: %d layers, windows %s, softcap %s, sinks %s", type(hf_model).__name__,
                 len(calls), self.windows, self.softcaps, self.has_sinks)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.get_input_embeddings().weight.dtype

    def _cpu_ops(self):
        """qtk's CPU ops (its paged decode attention) for a float32 model on CPU, or None."""
        from ...kernels import cpu as cpu_kernels

        w = self.base.get_input_embeddings().weight
        return cpu_kernels.ops() if w.device.type == "cpu" and w.dtype == torch.float32 else None

    @torch.inference_mode()
    def _probe(self) -> list[dict]:
        probe = LayerProbe()
        device = self.base.get_input_embeddings().weight.device
        ids, positions = torch.tensor([1, 2], device=device), torch.arange(2, device=device)
        try:
            self._run(ids, positions, probe)
        except MissingStep:  # the kwargs are dropped on the way: hand the step to the modules themselves
            probe, self._step_holders = LayerProbe(), list(self.base.modules())
            self._run(ids, positions, probe)
            self._step_holders = [c["module"] for c in probe.calls]
            log.info("%s drops the forward's kwargs before attention: the step is set on its attention modules",
                     type(self.base).__name__)
        return probe.calls

    @contextlib.contextmanager
    def _paged(self):
        old = set_implementation(self.base, NAME, self._configs)
        try:
            yield
        finally:
            set_implementation(self.base, old, self._configs)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        for m in self._step_holders:  # empty unless the modeling code drops the kwargs (see _probe)
            m.__dict__["qtk_step"] = step
        try:
            with self._paged():
                out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                qtk_step=step)
        finally:
            for m in self._step_holders:
                m.__dict__.pop("qtk_step", None)
        return out.last_hidden_state[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (the base model's output)."""
        return self._run(input_ids, positions, PagedStep(meta, kv_caches, self.cpu_ops))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> the causal LM's logits [n, vocab] float32, everything after lm_head included."""
        return self.head(inputs_embeds=hidden[None], use_cache=False).logits[0].float()
