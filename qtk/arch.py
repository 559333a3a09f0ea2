"""What calibration needs to know about a decoder, found from the model itself.

    decoder_layers(model)   the ModuleList of config.num_hidden_layers blocks, wherever it is
    discover(model)         one traced forward of a few tokens: each block's Linear layers in the
                            order they run, its attention module (the one calling transformers'
                            attention interface), what runs before block 0 (embeddings, rotary),
                            the Linear layers that read one input (q/k/v, gate/up: vLLM fuses them,
                            so they must share a scheme), and each block's smoothing pairs
                            (qtk.smoothing: a table per family, inferred by probing elsewhere),
                            found once per distinct block structure
    check_supported(config) a model type transformers loads as a causal LM, attention-only, through
                            the attention interface; otherwise one line saying what is missing
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .chunked_sdpa import register, set_implementation
from .errors import InputError
from .moe import all_experts
from .smoothing import LayerProbe, SmoothPair, layer_pairs

log = logging.getLogger(__name__)

__all__ = ["Arch", "SmoothPair", "check_supported", "decoder_layers", "discover", "set_module", "unsupported_reason"]

TRACE_TOKENS = 16  # the traced forward's sequence length
ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # config.layer_types qtk runs
_RECORD = "qtk_record_attention"


@dataclass(frozen=True)
class Arch:
    model_type: str
    layers: str  # path of the decoder-layer ModuleList, e.g. "model.layers", "model.decoder.layers"
    linears: tuple[tuple[str, ...], ...]  # per layer: its Linear layers (relative names), in execution order
    attention: tuple[str | None, ...]  # per layer: the module that calls the attention (owns k_scale / v_scale)
    smooth: tuple[tuple[SmoothPair, ...], ...]  # per layer: AWQ / SmoothQuant pairs, in execution order
    before: tuple[str, ...]  # modules outside the layers that run before block 0 (embeddings, rotary)
    # per layer: the groups of 2+ Linear layers that read the same input tensor (q/k/v, gate/up): vLLM
    # fuses each group into one layer (qkv_proj, gate_up_proj) and requires one scheme for all of it
    shared_input: tuple[tuple[tuple[str, ...], ...], ...] = ()


def is_linear(m: nn.Module) -> bool:
    """An nn.Linear, or a module standing in for one (qtk's QuantLinear: in_features, out_features)."""
    return isinstance(m, nn.Linear) or (hasattr(m, "in_features") and hasattr(m, "out_features"))


def decoder_layers(model: nn.Module) -> str:
    """Path of the ModuleList holding the config's num_hidden_layers decoder blocks (works on meta)."""
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n and any(is_linear(x) for x in m[0].modules()):
            return name
    raise InputError(f"{model.config.model_type}: no list of {n} decoder layers (num_hidden_layers) with "
                     "Linear layers in the model; qtk quantizes decoders whose blocks sit in one nn.ModuleList")


def static_linears(layer: nn.Module) -> tuple[str, ...]:
    """A block's Linear layers in definition order (no forward: for a model on meta)."""
    return tuple(n for n, m in layer.named_modules() if is_linear(m))


def _trace_ids(model: nn.Module) -> torch.Tensor:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    device = next(model.parameters()).device
    return torch.randint(3, vocab, (1, TRACE_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)


@dataclass
class _Trace:
    order: list[list[str]]  # per layer, Linear names as they ran
    attention: list[str | None]
    calls: list[tuple | None]  # per layer, its (args, kwargs)
    before: list[str]
    inputs: list[list[tuple[str, object]]]  # per layer, (Linear name, its input tensor) as they ran


def _trace(model: nn.Module, path: str) -> _Trace:
    """One forward of TRACE_TOKENS tokens with hooks recording the calls."""
    layers = model.get_submodule(path)
    t = _Trace([[] for _ in layers], [None] * len(layers), [None] * len(layers), [], [[] for _ in layers])
    names = {id(m): n for n, m in model.named_modules()}
    started = []  # set once block 0 runs: nothing after it is "before"
    handles = []

    def on_linear(i, rel):
        def hook(_, args):
            t.order[i].append(rel)
            t.inputs[i].append((rel, args[0] if args else None))
        return hook

    def on_layer(i):
        def hook(_, args, kwargs):
            started.append(i)
            t.calls[i] = (args, dict(kwargs))
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(on_layer(i), with_kwargs=True))
        for rel, m in layer.named_modules():
            if is_linear(m):
                handles.append(m.register_forward_pre_hook(on_linear(i, rel)))
    for name, m in model.named_modules():
        outside = not (name == path or name.startswith(path + ".") or path.startswith(name + ".") or name == "")
        if outside:
            handles.append(m.register_forward_pre_hook(lambda *_, name=name: None if started else t.before.append(name)))

    def record(module, query, key, value, *args, **kwargs):
        # the trace needs who calls the attention, not its values (which any softcap, sinks, ... change):
        # zeros [B, L, H, D_v] for query [B, H, L, D]
        prefix = names.get(id(module), "")
        for i in range(len(layers)):
            if prefix.startswith(f"{path}.{i}.") and t.attention[i] is None:
                t.attention[i] = prefix[len(f"{path}.{i}."):]
        b, h, length, _ = query.shape
        return query.new_zeros(b, length, h, value.shape[-1]), None

    register(_RECORD, record)
    old = set_implementation(model, _RECORD)
    try:
        with torch.no_grad(), all_experts(model):  # every expert runs (and is found), in order
            model(input_ids=_trace_ids(model), use_cache=False)
    finally:
        set_implementation(model, old)
        for h in handles:
            h.remove()
    return t


def _outermost(names: list[str]) -> tuple[str, ...]:
    """The names not inside another one of them, in order, once each."""
    unique = dict.fromkeys(names)
    return tuple(n for n in unique if not any(n.startswith(o + ".") for o in unique))


def _structure(layer: nn.Module) -> tuple:
    """What makes two blocks alike for smoothing: their modules' names, types and parameter shapes."""
    return tuple((n, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
                 for n, m in layer.named_modules())


def discover(model: nn.Module, smoothing: bool = True, stream=None) -> Arch:
    """The Arch of a model with real weights (a traced forward of a few tokens on its device);
    smoothing=False leaves the pairs empty (no probing: e.g. a model already quantized). `stream`: a
    streaming.StreamedModel whose blocks are read from their files as the trace and the probes need
    them (its during_forward() and loaded(i))."""
    path = decoder_layers(model)
    layers = model.get_submodule(path)
    with stream.during_forward() if stream is not None else contextlib.nullcontext():
        t = _trace(model, path)
    model_type = model.config.model_type
    linears = []
    for i, layer in enumerate(layers):
        ran = tuple(dict.fromkeys(t.order[i]))
        unused = [n for n in static_linears(layer) if n not in ran]
        if unused:
            log.info("%s.%d: %s never ran in a forward; left unquantized", path, i, unused)
        linears.append(ran)
    pairs_of: dict[tuple, tuple[SmoothPair, ...]] = {}
    smooth = []
    for i, layer in enumerate(layers):
        key = _structure(layer)
        if not smoothing:
            pairs_of[key] = ()
        elif key not in pairs_of:
            with stream.loaded(i) if stream is not None else contextlib.nullcontext():
                pairs_of[key] = layer_pairs(model_type, LayerProbe(layer, t.calls[i], linears[i]), t.attention[i])
        smooth.append(pairs_of[key])
    return Arch(model_type, path, tuple(linears), tuple(t.attention), tuple(smooth), _outermost(t.before),
                tuple(_shared_input(calls) for calls in t.inputs))


def _shared_input(calls: list[tuple[str, object]]) -> tuple[tuple[str, ...], ...]:
    """The groups of 2+ Linear layers (first call each) whose input was the same tensor object."""
    groups: list[tuple[object, list[str]]] = []
    seen = set()
    for name, x in calls:
        if name in seen or x is None:
            continue
        seen.add(name)
        for tensor, names in groups:
            if tensor is x:
                names.append(name)
                break
        else:
            groups.append((x, [name]))
    return tuple(tuple(names) for _, names in groups if len(names) > 1)


def unsupported_reason(config) -> str | None:
    """Why qtk cannot quantize and serve this model type (one line saying what is missing), or None:
    it must be one transformers loads as a causal LM, whose layers are all attention (no recurrent
    state: Mamba, linear attention), run through transformers' attention interface."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"model_type {mt!r} is not a causal LM transformers loads (AutoModelForCausalLM has no class for "
                "it); qtk quantizes and serves decoder-only causal LMs")
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt])
    kinds = sorted(set(getattr(config.get_text_config(decoder=True), "layer_types", None) or ()) - set(ATTENTION_LAYERS))
    if getattr(cls, "_is_stateful", False) or kinds:
        what = f"layers of type {', '.join(kinds)}" if kinds else "recurrent (state-space) layers"
        return (f"model_type {mt!r} has {what}: qtk runs attention-only decoders (full or sliding attention), "
                "not hybrid or recurrent models")
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"model_type {mt!r} ({cls.__name__}) does not support transformers' attention interface, which "
                "qtk plugs its attention into")
    return None


def check_supported(config) -> None:
    """InputError with unsupported_reason's line unless the model type is one qtk runs."""
    why = unsupported_reason(config)
    if why:
        raise InputError(why)


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)
