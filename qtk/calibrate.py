"""The one sequential driver every method goes through.

    capture the inputs of block 0 (embeddings, rotary, masks) for the calibration batches
    for each decoder block:
        move it to the calibration device                      (only this block is there)
        smoothing (awq / smoothquant): rescale float weights, fold into the previous op
        observe static activation / KV ranges as the method needs
        weights (rtn / gptq): replace each Linear by a QuantLinear
        recompute the block's outputs with the quantized weights -> next block's inputs
        move it back to CPU

Methods see a `Block`: the layer, its targeted linears, and helpers to run it on the captured
inputs with hooks. Peak device memory is one block plus one batch of activations.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from . import distributed, hadamard
from .arch import Arch, decoder_layers, discover, set_module, static_linears
from .chunked_sdpa import chunked_attention
from .kv_fake_quant import enable_kv_quant
from .methods import METHODS
from .moe import all_experts, router_names
from .recipe import Recipe
from .quant_linear import QuantLinear
from .schemes import Scheme, check_group_divides
from .smoothing import widths_match
from .spill import Activations
from .errors import InputError

log = logging.getLogger(__name__)


class _Stop(Exception):
    """Raised at the input of the last module a pass needs (block 0 when capturing the calibration
    inputs, a block's last hooked Linear when collecting statistics): nothing after it is needed."""


# Every device move of the driver goes through these two, so "one block on the calibration
# device at a time" is one place to read (and to check in tests without a GPU).
def onload(module: nn.Module, device: torch.device) -> nn.Module:
    """Move `module` to the calibration device."""
    return module.to(device)


def offload(module: nn.Module) -> nn.Module:
    """Move `module` back to where the model rests between blocks (CPU)."""
    return module.to("cpu")


@dataclass
class BlockInputs:
    """Calibration activations entering a block: one hidden-state tensor and kwargs per batch."""

    hidden: list[torch.Tensor]  # each [batch, seq, hidden], kept on CPU between blocks
    kwargs: list[dict]  # position embeddings, masks, ... (on the calibration device)
    # per batch, the attention mask the model gives each block: models that mix full-attention and
    # sliding-window layers (Qwen2/Qwen3 with max_window_layers) give each kind its own
    masks: list[list] = field(default_factory=list)
    # where each batch starts among the samples of every rank (data-parallel calibration, distributed.py:
    # a rank holds some of the batches), and how many batches all ranks hold; one process: all of them
    starts: list[int] = field(default_factory=list)
    batches: int = 0

    def __len__(self):
        return len(self.hidden)

    def first_sample(self, b: int) -> int:
        """The index of batch b's first sample among every rank's samples."""
        return self.starts[b] if self.starts else sum(len(h) for h in self.hidden[:b])

    @property
    def total(self) -> int:
        """How many batches every rank holds together."""
        return self.batches or len(self.hidden)

    def for_block(self, index: int) -> BlockInputs:
        """These inputs with block `index`'s own attention mask."""
        if not self.masks:
            return self
        kwargs = [{**kw, "attention_mask": m[index]} for kw, m in zip(self.kwargs, self.masks)]
        return replace(self, kwargs=kwargs)


@dataclass
class Block:
    index: int
    name: str  # e.g. "model.layers.3"
    layer: nn.Module
    arch: Arch
    inputs: BlockInputs | None
    device: torch.device
    targets: tuple[str, ...]  # relative names of the Linear layers the recipe's methods quantize
    errors: dict[str, float] = field(default_factory=dict)
    # relative names of the Linear layers a recipe override gives a scheme of their own -> that scheme
    overrides: dict[str, Scheme] = field(default_factory=dict)
    # (linear names sharing an input, H = 2/n sum x x^T) left by a smoothing pass that saw every
    # input, kept exact under its scale folds, for the weight quantizer (GPTQ) to reuse
    hessians: list[tuple[tuple[str, ...], torch.Tensor]] | None = None
    # the float block's outputs on the float model's own activations (one per batch), for a weight
    # quantizer that targets them (Method.float_chain: autoround); None otherwise
    reference: list[torch.Tensor] | None = None
    # where the outputs kept for the next block wait (memory, or memory-mapped files: spill.py)
    store: Activations = field(default_factory=Activations)

    @property
    def pairs(self) -> tuple:
        """This block's smoothing pairs (SmoothPair), in execution order."""
        return self.arch.smooth[self.index]

    @property
    def attention(self) -> str | None:
        """Name of this block's attention module."""
        return self.arch.attention[self.index]

    def linear(self, name: str) -> nn.Module:
        return self.layer.get_submodule(name)

    def run(self, inputs: BlockInputs | None = None) -> list[torch.Tensor]:
        """Outputs of the layer on every input batch (its own inputs unless others are given),
        moved back to CPU and kept where the block's store keeps activations."""
        return [self.store.keep(y.to("cpu")) for y in self._outputs(inputs)]

    def observe(self) -> None:
        """Run the layer on every input batch for what its hooks see; the outputs are dropped where
        they were computed."""
        for _ in self._outputs(self.inputs):
            continue

    def _outputs(self, inputs: BlockInputs | None):
        """The layer's output hidden states, batch by batch, on the calibration device."""
        from .kernels.dispatch import dense_weights

        inputs = self.inputs if inputs is None else inputs
        with torch.no_grad(), dense_weights():
            for h, kw in zip(inputs.hidden, inputs.kwargs):
                y = self.layer(h.to(self.device), **kw)
                yield y[0] if isinstance(y, tuple) else y

    def feed(self, until: str) -> None:
        """Run the layer on every input batch only as far as the input of submodule `until` (the
        hooks see what they need; the rest of the block is skipped)."""

        def stop(*_):
            raise _Stop

        handle = self.layer.get_submodule(until).register_forward_pre_hook(stop)
        try:
            with torch.no_grad():
                for h, kw in zip(self.inputs.hidden, self.inputs.kwargs):
                    with contextlib.suppress(_Stop):
                        self.layer(h.to(self.device), **kw)
        finally:
            handle.remove()

    @contextlib.contextmanager
    def hooks(self, names, fn):
        """Call fn(name, x) with the input of each named submodule on every forward."""
        handles = [self.layer.get_submodule(n).register_forward_pre_hook(
            lambda m, args, n=n: fn(n, args[0])) for n in names]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def replace(self, name: str, module: nn.Module) -> None:
        """module takes the named submodule's place (an online input rotation with it: hadamard.carry)."""
        set_module(self.layer, name, hadamard.carry(self.layer.get_submodule(name), module))


class _StandIn(nn.Module):
    """Takes a decoder block's place while the calibration inputs are captured: keeps the call the
    model makes to it (hidden states, rotary, the mask of the block's attention kind) and passes
    the hidden states on; the last one ends the forward."""

    def __init__(self, layer: nn.Module, calls: list, last: bool):
        super().__init__()
        if hasattr(layer, "attention_type"):  # transformers 4.x picks each block's mask by it
            self.attention_type = layer.attention_type
        self.calls, self.last = calls, last

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.last:
            raise _Stop
        return args[0] if args else kwargs["hidden_states"]


def capture_inputs(model: nn.Module, arch: Arch, ids: torch.Tensor, device: torch.device,
                   batch_size: int, store: Activations | None = None) -> BlockInputs:
    """Run the model up to its blocks and keep what block 0 receives, one entry per batch (where
    `store` keeps activations, batch by batch), and the attention mask each block receives. The
    blocks stand aside meanwhile: none of them runs. With several processes (distributed.py) each
    captures its own share of the batches."""
    store = store or Activations()
    ids, starts, batches = distributed.shard(ids, batch_size)
    layers = model.get_submodule(arch.layers)
    pre = [model.get_submodule(name) for name in arch.before]
    for m in pre:
        onload(m, device)
    calls: list[tuple] = []  # the batch's (args, kwargs) of each block's call
    set_module(model, arch.layers, nn.ModuleList(_StandIn(layer, calls, last=i + 1 == len(layers))
                                                  for i, layer in enumerate(layers)))
    hidden, kwargs, masks = [], [], []
    try:
        with torch.no_grad():
            for i in range(0, len(ids), batch_size):
                calls.clear()
                with contextlib.suppress(_Stop):
                    model(input_ids=ids[i:i + batch_size].to(device), use_cache=False)
                args, kw = calls[0]  # block 0's call
                hidden.append(store.keep((args[0] if args else kw["hidden_states"]).to("cpu")))
                kwargs.append({k: v for k, v in kw.items()
                               if k not in ("hidden_states", "cache", "past_key_values", "past_key_value")})
                kwargs[-1]["use_cache"] = False
                masks.append([block_kw.get("attention_mask") for _, block_kw in calls])
    finally:
        set_module(model, arch.layers, layers)
        for m in pre:
            offload(m)
    return BlockInputs(hidden, kwargs, masks, starts, batches)


def targeted_linears(model: nn.Module, recipe: Recipe, arch: Arch | None = None) -> dict[str, nn.Linear]:
    """Full names of the block Linears the recipe quantizes (ignore patterns applied), in execution
    order given the model's Arch; without one (a model on meta), every Linear inside the blocks."""
    from .checkpoint import target_matches

    path = arch.layers if arch is not None else decoder_layers(model)
    routers = set(router_names(model))  # a MoE block's router stays float
    out = {}
    for i, layer in enumerate(model.get_submodule(path)):
        for rel in arch.linears[i] if arch is not None else static_linears(layer):
            name = f"{path}.{i}.{rel}"
            mod = layer.get_submodule(rel)
            if name not in routers and not any(target_matches(name, mod, t) for t in recipe.ignore):
                out[name] = mod
    return out


def override_schemes(targets: dict[str, nn.Linear], recipe: Recipe) -> dict[str, Scheme]:
    """The targeted Linears a recipe override names -> its scheme (the first override naming one)."""
    from .checkpoint import target_matches

    out = {}
    for name, mod in targets.items():
        found = next((o.scheme for o in recipe.overrides if any(target_matches(name, mod, t) for t in o.targets)),
                     None)
        if found is not None:
            out[name] = found
    return out


def quantize_model(model: nn.Module, recipe: Recipe, calib_ids: torch.Tensor | None = None,
                   progress: bool = True, stream=None, store: Activations | None = None) -> dict:
    """Quantize `model` in place, block by block; returns a report (per-layer errors, timings).

    `stream`: a streaming.StreamedModel of `model` (its blocks on meta until read): each block is read
    from the files when its turn comes and handed to stream.finish(i, carry) once quantized (which
    writes and frees it; carry: what the next block needs), so one block is in memory at a time; with
    stream.resumed (an interrupted run's last carry) the blocks before its "next" are skipped.
    `store`: where the calibration activations wait between blocks (spill.py; memory by default)."""
    store = store or Activations()
    arch = discover(model, smoothing=recipe.smoothing is not None, stream=stream)  # pairs probed where used
    check_pairs(model, arch, recipe.smoothing)
    if recipe.kv_cache is not None and None in arch.attention:
        raise InputError(f"model_type {arch.model_type!r}: block {arch.attention.index(None)} calls no attention "
                         "through transformers' attention interface, so its KV cache cannot be calibrated")
    device = torch.device(recipe.device)
    targets = targeted_linears(model, recipe, arch)
    overrides = override_schemes(targets, recipe)
    for scheme in set(overrides.values()):
        check_group_divides(scheme, {n: targets[n].in_features for n, s in overrides.items() if s == scheme})
    targets = {n: m for n, m in targets.items() if n not in overrides}
    check_group_divides(recipe.scheme, {n: m.in_features for n, m in targets.items()})
    targets = list(targets)  # names: a module kept here would keep its float weights after it is replaced
    if recipe.needs_data and calib_ids is None:
        raise InputError(f"method {recipe.method!r} with this scheme needs calibration data")
    t0 = time.perf_counter()
    use_cache, model.config.use_cache = model.config.use_cache, False  # restored below: it is saved in config.json
    layers = model.get_submodule(arch.layers)
    report = {"layers": {}, "blocks": len(layers)}
    with chunked_attention(model):
        resumed = stream.resumed if stream is not None else None
        if resumed is not None:  # an interrupted run's blocks before `next` are written: on from its carry
            start, inputs, floats = resumed["next"], resumed["inputs"], resumed["floats"]
            report["layers"].update(resumed["layers"])
        else:
            start = 0
            inputs = capture_inputs(model, arch, calib_ids, device, recipe.calibration.batch_size,
                                    store) if recipe.needs_data else None
            # the float model's own activations, beside the quantized model's, for a method that targets them
            floats = inputs if inputs is not None and METHODS[recipe.weights].float_chain else None
        bar = tqdm(range(start, len(layers)), initial=start, total=len(layers), desc=f"qtk {recipe.method}",
                   unit="block", disable=not progress)
        for i in bar:
            prefix = f"{arch.layers}.{i}"
            rel = tuple(n[len(prefix) + 1:] for n in targets if n.startswith(prefix + "."))
            own = None if inputs is None else inputs.for_block(i)  # with the mask of its attention kind
            if stream is not None:
                stream.load(i)
            block = Block(i, prefix, onload(layers[i], device), arch, own, device, rel,
                          overrides={n[len(prefix) + 1:]: s for n, s in overrides.items() if n.startswith(prefix + ".")},
                          store=store)
            if floats is not None:  # the float block on the float activations: the target, and the next block's
                block.reference = block.run(floats.for_block(i))
            inputs = quantize_block(model, block, recipe, last=i + 1 == len(layers))
            if floats is not None:
                floats = replace(floats, hidden=block.reference)
            layers[i] = offload(block.layer)
            for name, err in block.errors.items():
                report["layers"][f"{prefix}.{name}"] = err
            if stream is not None:  # what the next block needs: a resumed run goes on from it
                stream.finish(i, {"next": i + 1, "inputs": inputs, "floats": floats, "layers": report["layers"]})
            if block.errors:
                bar.set_postfix(err=f"{max(block.errors.values()):.3g}", worst=max(block.errors, key=block.errors.get))
            log.debug("block %d errors %s", i, block.errors)
    if recipe.kv_cache is not None:
        for layer, attention in zip(layers, arch.attention):
            layer.get_submodule(attention).kv_scheme = recipe.kv_cache
        enable_kv_quant(model)
    model.config.use_cache = use_cache
    if store.on_disk:
        report["activations_on_disk"] = {"folder": str(store.folder), "bytes_written": store.written}
    report["seconds"] = time.perf_counter() - t0
    return report


def check_pairs(model: nn.Module, arch: Arch, smoothing: str | None) -> None:
    """A smoothing method needs pairs that fold: a norm feeding linears for smoothquant, any for awq."""
    if smoothing is None:
        return
    layers = model.get_submodule(arch.layers)
    pairs = [p for i, ps in enumerate(arch.smooth) for p in ps
             if widths_match(layers[i], p) and (smoothing == "awq" or p.prev not in arch.linears[i])]
    if not pairs:
        feeds = "a norm feeding linears" if smoothing == "smoothquant" else "an op whose output channels fold"
        raise InputError(f"{smoothing} needs smoothing pairs ({feeds}) and model_type {arch.model_type!r} has none "
                         "qtk can fold exactly; use --method gptq or rtn")


def quantize_block(model: nn.Module, block: Block, recipe: Recipe, last: bool) -> BlockInputs | None:
    """Smooth, quantize and observe one block; returns the next block's inputs (None for the last
    block, whose outputs feed nothing, unless KV-cache ranges are observed on them)."""
    from .methods import rtn
    from .methods.kv_cache import finish_observing, start_observing

    if block.targets:  # an ignored block is still run: the next block needs its outputs
        with all_experts(block.layer, recipe.calibration.calibrate_all_experts):  # statistics only
            if recipe.smoothing is not None:
                METHODS[recipe.smoothing].run(block, recipe)
            METHODS[recipe.weights].run(block, recipe)
    for scheme in dict.fromkeys(block.overrides.values()):  # after smoothing folded its scales into them
        rtn.quantize_linears(block, [n for n, s in block.overrides.items() if s == scheme], scheme, {})
    distributed.same_block(block.layer)  # several processes: every one goes on from rank 0's block
    if block.inputs is None or (last and recipe.kv_cache is None):
        return None
    kv = recipe.kv_cache
    attn = start_observing(model, block.layer.get_submodule(block.attention), kv) if kv else None
    outputs = replace(block.inputs, hidden=block.run())
    if attn is not None:
        finish_observing(model, attn, kv, dtype=next(block.layer.parameters()).dtype)
    return outputs


def checkpoint_groups(model: nn.Module, recipe: Recipe) -> tuple[list, list[str]]:
    """(config groups, ignore list) describing a quantized model: every Linear left float is ignored."""
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QuantLinear)]
    ignore += [r for r in router_names(model) if r not in ignore]  # routers that are not Linear (readers' may be)
    own = {o.scheme for o in recipe.overrides} - {recipe.scheme}
    by_scheme: dict[Scheme, list[str]] = {}
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear) and m.scheme in own:  # an override's layers, named one by one
            by_scheme.setdefault(m.scheme, []).append(n)
    return [*((s, names) for s, names in by_scheme.items()), (recipe.stored_scheme, ["Linear"])], ignore
