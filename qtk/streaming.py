"""Models bigger than memory: the model is built on the meta device and each decoder block's weights
are read from the safetensors files when its turn comes, then freed.

    StreamedModel.open(path, dtype)   the skeleton: parameters on meta, buffers real (rotary, ...), the
                                      modules outside the blocks (embeddings, final norm, head) read in full
    .load(i) / .free(i)               block i's weights from the files / back to meta
    .during_forward()                 within: a forward of the whole model reads each block as it runs
                                      and frees it after (what arch.discover's traced forward needs)
    .loaded(i)                        within: block i read (what a probe of its weights needs)

The names in the files are mapped to the model's as checkpoint.load_quantized maps them (the hub's
expert names, transformers' renamings), one block's tensors at a time. What stays in memory is the
outside modules plus one block: calibrate.quantize_model (given the StreamedModel) writes each block
to the output as soon as it is quantized and frees it.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from . import moe
from .arch import decoder_layers
from .checkpoint import tied_keys, transformers_names, weight_files
from .errors import CheckpointError

log = logging.getLogger(__name__)


class StreamedModel:
    """A causal LM whose blocks live in their files until read (see the module's docstring)."""

    def __init__(self, model: nn.Module, path: Path, files: dict[str, Path], owners: dict[str, str]):
        self.model, self.path = model, path
        self.files = files  # tensor name in the files -> its file
        self.owners = owners  # tensor name in the files -> the block it belongs to ("" outside the blocks)
        self.layers_path = decoder_layers(model)
        self.layers = model.get_submodule(self.layers_path)
        self.sink = None  # called with (i, carry) when block i is quantized, before it is freed (the output's writer)
        self.resumed: dict | None = None  # an interrupted run's last carry: the driver goes on from its "next" block
        # the persistent buffers a block builds itself (absent from the files): kept to put back after a free
        self.own_buffers = [{k: b.clone() for k, b in layer.named_buffers() if not b.is_meta and k in layer.state_dict()}
                            for layer in self.layers]

    @classmethod
    def open(cls, path: str | Path, dtype: torch.dtype) -> StreamedModel:
        """The model at `path` (an HF dir of safetensors files) on meta, its blocks unread, the modules
        outside them read in `dtype` (floating tensors; the model's own dtypes elsewhere)."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        files = weight_files(path)
        if not files:
            raise CheckpointError(f"{path} has no safetensors weights: a model is streamed block by block from "
                                  "safetensors files (save it with save_pretrained(..., safe_serialization=True))")
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights(include_buffers=False):  # buffers real: rotary inv_freq, embedding scales, ...
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        if (path / "generation_config.json").is_file():  # as from_pretrained reads it: the checkpoint carries it
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(path)
        moe.linearize_experts(model)  # each expert's projections are their own Linears, as Job.load has them
        where = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                where.update(dict.fromkeys(sf.keys(), f))
        layers = decoder_layers(model)
        owners, names = {}, set()
        mt = model.config.model_type
        for key in where:  # the model's name for each key, as a load maps it (one key at a time: names only)
            name = next(iter(transformers_names(model, {moe.model_name(mt, key): None})))
            owners[key] = _block_of(name, layers)
            names.add(name)
        experts = tuple(f"{n}." for n in moe.experts_modules(model))  # a hub's 3-D experts: split when read
        tied = tied_keys(model)
        missing = [k for k, v in model.state_dict().items()
                   if v.is_meta and k not in names and k not in tied and not k.startswith(experts)]
        if missing:  # found now, not when that block's turn comes
            raise CheckpointError(f"{path}: {len(missing)} weights the config needs are not in its files, e.g. "
                                  f"{missing[:3]}; the files are from another model or incomplete")
        blocks = {f"{layers}.{i}" for i in range(len(model.get_submodule(layers)))}
        extra = sorted(k for k, o in owners.items() if o and o not in blocks)
        if extra:  # from_pretrained would drop them unread: files of a deeper model than the config
            raise CheckpointError(f"{path}: tensor {extra[0]!r} belongs to no block of the {len(blocks)} the config "
                                  "describes (num_hidden_layers); the files are from another model")
        streamed = cls(model, path, where, owners)
        streamed._read(model, "")
        model.tie_weights()
        return streamed

    def _read(self, module: nn.Module, owner: str) -> None:
        """The tensors of `owner` (a block's name, or "" for everything outside the blocks) from the
        files into `module` (the model for "", else the block), each cast to the dtype the module has."""
        prefix = f"{owner}." if owner else ""
        keys = [k for k, o in self.owners.items() if o == owner]
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        tensors = {}
        for f, names in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as sf:
                    tensors.update({k: sf.get_tensor(k) for k in names})
            except Exception as e:  # safetensors raises its own error types for truncated data
                raise CheckpointError(f"{f} cannot be read (truncated or corrupt safetensors file): {e}") from e
        tensors = transformers_names(self.model, moe.model_tensors(self.model, tensors))
        expected = module.state_dict()
        tied = tied_keys(self.model) if not owner else set()
        state = {}
        for name, t in tensors.items():
            rel = name[len(prefix):]
            if not name.startswith(prefix) or rel not in expected:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not part of the model the config describes")
            ref = expected[rel]
            if tuple(t.shape) != tuple(ref.shape):
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}, the config implies "
                                      f"{list(ref.shape)}")
            # a copy in memory: a tensor read from the file maps it, and its pages would stay as long as it does
            state[rel] = t.to(ref.dtype, copy=True) if t.is_floating_point() and ref.is_floating_point() else t.clone()
        missing = [k for k, v in expected.items() if v.is_meta and k not in state and prefix + k not in tied
                   and (owner or _block_of(k, self.layers_path) == "")]
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} weights the config needs are not in its files, e.g. "
                                  f"{[prefix + k for k in missing[:3]]}; the files are from another model or incomplete")
        module.load_state_dict(state, strict=False, assign=True)

    def block_name(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def load(self, i: int) -> nn.Module:
        """Block i with its weights read from the files (the calibration dtype), on CPU."""
        layer = self.layers[i]
        if not self.is_loaded(i):
            self._read(layer, self.block_name(i))
            if self.own_buffers[i]:
                layer.load_state_dict(self.own_buffers[i], strict=False, assign=True)
        return layer

    def free(self, i: int) -> None:
        """Block i's tensors back to meta (its non-persistent buffers, e.g. rotary, stay), and the memory
        they held handed back to the system (release_freed_memory)."""
        layer = self.layers[i]
        persistent = set(layer.state_dict())
        for mod_name, mod in layer.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for k, p in list(mod._parameters.items()):
                if p is not None and not p.is_meta:
                    mod._parameters[k] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            for k, b in list(mod._buffers.items()):
                if b is not None and not b.is_meta and prefix + k in persistent:
                    mod._buffers[k] = torch.empty_like(b, device="meta")
        release_freed_memory()

    def finish(self, i: int, carry: dict) -> None:
        """Block i is done: handed to the sink with what the next block needs (a streamed quantize writes
        both to its staging folder), then freed."""
        if self.sink is not None:
            self.sink(i, carry)
        self.free(i)

    def restore(self, i: int, layers: dict[str, dict]) -> None:
        """Block i's quantized layers as an earlier run left them (name -> QuantLinear.describe()), on
        meta: what the checkpoint's config groups are read from, its tensors written already."""
        from .arch import set_module
        from .quant_linear import QuantLinear

        layer = self.layers[i]
        for name, d in layers.items():
            set_module(layer, name, QuantLinear.described(d, device="meta"))

    def is_loaded(self, i: int) -> bool:
        return not any(p.is_meta for p in self.layers[i].parameters())

    @contextlib.contextmanager
    def loaded(self, i: int):
        """Within: block i read (freed after unless it was read before)."""
        was = self.is_loaded(i)
        self.load(i)
        try:
            yield self.layers[i]
        finally:
            if not was:
                self.free(i)

    @contextlib.contextmanager
    def during_forward(self):
        """Within: each block is read when the model calls it and freed when it returns."""
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(lambda *_, i=i: self.load(i) and None))
            handles.append(layer.register_forward_hook(lambda *_, i=i: self.free(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def release_freed_memory() -> None:
    """glibc's malloc_trim: the free memory in the heap back to the system. A block's tensors of 8-32 MB come
    from the heap once glibc's mmap threshold has risen past them, and what they leave when freed stays
    in the process: peak RSS then grew by about a block's quantized size per block (Llama-3-8B shapes,
    RTN; measured flat with the trim). Elsewhere (musl, macOS) nothing is done."""
    global _trim
    if _trim is None:
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # glibc: musl has no malloc_trim
            _trim = libc.malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim = None


def _block_of(name: str, layers: str) -> str:
    """The block a tensor or module name belongs to ("model.layers.3"), or "" outside the blocks."""
    if not name.startswith(layers + "."):
        return ""
    index = name[len(layers) + 1:].split(".", 1)[0]
    return f"{layers}.{index}" if index.isdigit() else ""
