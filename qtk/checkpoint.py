"""compressed-tensors checkpoints: write them atomically, read them (ours and llm-compressor's,
and GPTQ / AWQ ones through hub_formats).

On disk (as llm-compressor writes it): config.json with `quantization_config`
{quant_method: compressed-tensors, quantization_status: compressed, format, config_groups,
ignore, kv_cache_scheme, transform_config, ...}, safetensors shards holding each quantized Linear's
weight_packed/weight/weight_scale/weight_zero_point/weight_shape/input_scale and each attention
module's k_scale/v_scale, plus the tokenizer, chat template and generation config.

transform_config carries the online input rotations (hadamard.py): per block size a group
{type: hadamard, head_dim: block, apply: [input (online), weight_input inverse (fused)]}, and its
unnormalized +-1 Sylvester matrix once, in bf16 (exact), as `<first target>.<group>_input.weight`
(compressed-tensors writes one copy of a shared transform; vLLM loads it into every layer).
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import hadamard, hub_formats, moe
from .arch import set_module
from .atomic import write_dir
from .kv_fake_quant import enable_kv_quant
from .kv_scales import attach_kv_scales
from .quant_linear import QuantLinear
from .schemes import KVCacheScheme, Scheme
from .errors import CheckpointError, OutputExistsError

log = logging.getLogger(__name__)

CT_VERSION = "0.20.0"
MAX_SHARD_BYTES = 5 * 2**30
STREAMED_SHARD_BYTES = 2**30  # a streamed run's shards: the most it reads back at once to write one


# --- config ------------------------------------------------------------------------------

def quantization_config(groups: list[tuple[Scheme, list[str]]], ignore: list[str],
                        kv: KVCacheScheme | None, transforms: dict | None = None) -> dict:
    formats = {s.format for s, _ in groups}
    config_groups = {}
    for i, (scheme, targets) in enumerate(groups):
        d = scheme.to_dict()
        d["targets"] = targets
        config_groups[f"group_{i}"] = d
    return {
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None if kv is None else kv.to_dict(),
        "sparsity_config": {},
        "transform_config": transforms or {},
        "global_compression_ratio": None,
        "version": CT_VERSION,
    }


def target_matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors target semantics: 're:REGEX' on the name, a class name, or a name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == type(module).__name__ or target == name or (target == "Linear" and isinstance(module, nn.Linear))


def parse_quantization_config(qc: dict) -> tuple[list[Scheme], list[str], KVCacheScheme | None]:
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"quantization_config.quant_method is {qc.get('quant_method')!r}; qtk reads "
                              "compressed-tensors (llm-compressor's and qtk's), GPTQ and AWQ (gemm) checkpoints")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"quantization_status {status!r} is not supported; qtk reads compressed checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError("quantization_config.config_groups is empty")
    try:
        schemes = [Scheme.from_dict({"format": qc.get("format"), **g}) for g in groups.values()]
        kv = KVCacheScheme.from_dict(qc.get("kv_cache_scheme"))
    except ValueError as e:
        raise CheckpointError(f"config.json quantization_config: {e}") from e
    for name, g, s in zip(groups, groups.values(), schemes):
        fmt = g.get("format") or qc.get("format")
        if fmt not in ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mixed-precision"):
            raise CheckpointError(f"config group {name}: format {fmt!r} is not supported "
                                  "(pack-quantized, int-quantized, float-quantized, naive-quantized)")
        if fmt == "pack-quantized" and (s.weights.type != "int" or s.input_activations is not None):
            raise CheckpointError(f"config group {name}: pack-quantized format with an activation or float scheme")
    return schemes, list(qc.get("ignore") or []), kv


DOWN_TARGET = "re:.*down_proj$"  # SpinQuant's R4 target, as llm-compressor writes it


def transform_config(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(transform_config, its tensors) for the model's online input rotations (hadamard.attach): a group
    per block size, "R4" (or "R4_<block>" beside another), targeting every down projection by
    SpinQuant's pattern where they are exactly the rotated ones, else by name; ({}, {}) where none."""
    rotated: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        if hadamard.of(m) is not None:
            rotated.setdefault(hadamard.of(m), []).append(name)
    if not rotated:
        return {}, {}
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))]
    groups, tensors = {}, {}
    for block, names in sorted(rotated.items()):
        group = "R4" if len(rotated) == 1 else f"R4_{block}"
        pattern = [n for n in linears if re.match(DOWN_TARGET[3:], n)]
        targets = [DOWN_TARGET] if pattern == names else names
        groups[group] = {"type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": block,
                         "precision": "torch.float32",
                         "apply": [{"targets": targets, "location": "input", "inverse": False, "ignore": []},
                                   {"targets": targets, "location": "weight_input", "inverse": True, "ignore": []}]}
        # +-1 is exact in bf16: half float32's bytes (1 MiB at 512), read into `precision` by every reader
        tensors[f"{names[0]}.{group}_input.weight"] = (hadamard.sylvester(block) * block ** 0.5).to(torch.bfloat16)
    return {"config_groups": groups}, tensors


FUSED = {"weight_input", "weight_output"}  # transform locations compressed-tensors fuses into the weights


def parse_transform_config(tc: dict | None, model: nn.Module) -> tuple[dict[str, int], set[str]]:
    """({module name: block} of the online input rotations a checkpoint's transform_config names,
    the tensor names its groups may carry (suffixes `.<group>_input.weight`)). qtk applies compressed-
    tensors' deterministic Hadamard (type "hadamard": Sylvester blocks of head_dim, or of the whole
    input) on a layer's input, the inverse already in the weights; a group applied to weights only
    (SpinQuant's R1 and R2) was fused into them when written and needs nothing; other transforms are
    refused."""
    if not tc or not tc.get("config_groups"):
        return {}, set()
    blocks, suffixes = {}, set()
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))]
    for group, g in tc["config_groups"].items():
        where = {(a.get("location"), bool(a.get("inverse"))) for a in g.get("apply") or []}
        if where and {loc for loc, _ in where} <= FUSED:  # SpinQuant's R1 and R2: in the weights already
            continue
        if g.get("type") != "hadamard" or ("input", False) not in where or not where <= {("input", False),
                                                                                         ("weight_input", True)}:
            raise CheckpointError(f"transform_config group {group}: qtk applies a deterministic Hadamard on a layer's "
                                  f"input (type hadamard, locations input + weight_input inverse); this is type "
                                  f"{g.get('type')!r} at {sorted(where)}")
        online = next(a for a in g["apply"] if a.get("location") == "input")
        for name, m in modules:
            if any(target_matches(name, m, t) for t in online.get("targets") or []) and not any(
                    target_matches(name, m, t) for t in online.get("ignore") or []):
                block = g.get("head_dim") or m.in_features
                if block & (block - 1) or m.in_features % block:
                    raise CheckpointError(f"transform_config group {group}: a Hadamard of {block} on {name}'s "
                                          f"{m.in_features} inputs (a power of two dividing them)")
                blocks[name] = block
        suffixes.add(f".{group}_input.weight")
    return blocks, suffixes


# --- writing -----------------------------------------------------------------------------

def save_quantized(model: nn.Module, tokenizer, out_dir: str | Path, groups: list[tuple[Scheme, list[str]]],
                   ignore: list[str], kv: KVCacheScheme | None, dtype: torch.dtype = torch.bfloat16,
                   force: bool = False, extra_files: dict[str, str] | None = None) -> Path:
    """Write `model` (with QuantLinear layers) to out_dir atomically: temp dir, then rename (atomic.write_dir:
    with `force`, an existing output is replaced only once the new one is whole)."""
    out = Path(out_dir)
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")
    with write_dir(out) as tmp:
        write_checkpoint(model, tokenizer, tmp, groups, ignore, kv, dtype, extra_files or {})
    return out


def tied_keys(model: nn.Module) -> set[str]:
    """The parameters transformers ties to another (lm_head.weight to the embeddings, by the config):
    not written, and filled by tying at load."""
    return set(model.get_expanded_tied_weights_keys(all_submodels=True))


def write_checkpoint(model, tokenizer, d: Path, groups, ignore, kv, dtype, extra_files,
                     blocks: dict[str, Path] | None = None):
    """The checkpoint's files into d, a folder the caller made (save_quantized: atomically). `blocks`:
    block name -> the file write_block wrote it to (a streamed run's), whose tensors are on meta in
    `model`; every other tensor must be real."""
    blocks = blocks or {}
    transforms, state = transform_config(model)
    tied = tied_keys(model)
    for k, v in model.state_dict().items():
        if k in tied:
            continue
        if v.is_meta:
            if not any(k.startswith(b + ".") for b in blocks):
                raise CheckpointError(f"{k} has no weights (on meta) and no block file holds it")
            continue
        state[k] = _stored(v, dtype)
    _save_shards(moe.hub_state(model, state), d, list(blocks.values()))  # experts under the hub's names
    cfg = model.config.to_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    # an ignored layer under the model's name (transformers' loader) and the hub's (vLLM's), where they differ
    names = ((i,) if i.startswith("re:") else (i, moe.hub_name(model.config.model_type, i)) for i in ignore)
    ignore = list(dict.fromkeys(n for pair in names for n in pair))
    cfg["quantization_config"] = quantization_config(groups, ignore, kv, transforms)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    for name, text in extra_files.items():
        (d / name).write_text(text)


def _stored(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as the checkpoint stores it: on CPU, floats (FP8 aside) in the checkpoint's dtype."""
    v = v.detach().to("cpu")
    if v.is_floating_point() and v.dtype != torch.float8_e4m3fn:
        v = v.to(dtype)
    return v.contiguous()


def write_block(model: nn.Module, name: str, path: Path, dtype: torch.dtype) -> None:
    """Block `name`'s tensors (QuantLinear layers inside, its experts under the hub's names) into one
    safetensors file at `path`: what a streamed run writes as each block is quantized."""
    block = model.get_submodule(name)
    state = {f"{name}.{k}": _stored(v, dtype) for k, v in block.state_dict().items()}
    _save_file(moe.hub_state(model, state), path)


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the permissions of any other file written here: it creates its
    file private (0600), which a server running as another user could not read."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _save_shards(state: dict[str, torch.Tensor], d: Path, written: list[Path] | None = None):
    """`state`, and the tensors of the safetensors files already `written` (a streamed run's blocks,
    read back one shard at a time), into d: one file is model.safetensors, more are shards of at most
    MAX_SHARD_BYTES (STREAMED_SHARD_BYTES with written files, what a streamed run holds in memory to
    write one; a block's file is never split) and an index."""
    from safetensors.torch import load_file

    units = [(sum(n for _, _, n in read_tensor_meta(d, [f]).values()), f) for f in written or []]
    units += [(v.numel() * v.element_size(), {k: v}) for k, v in state.items()]
    cap = STREAMED_SHARD_BYTES if written else MAX_SHARD_BYTES
    shards, cur, size = [], [], 0
    for nbytes, unit in units:
        if cur and size + nbytes > cap:
            shards.append(cur)
            cur, size = [], 0
        cur.append(unit)
        size += nbytes
    shards.append(cur)

    def tensors(shard) -> dict[str, torch.Tensor]:
        out = {}
        for unit in shard:
            out.update(load_file(str(unit)) if isinstance(unit, Path) else unit)
        return out

    if len(shards) == 1:
        _save_file(tensors(shards[0]), d / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = tensors(shard)
        _save_file(shard, d / name)
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- reading -----------------------------------------------------------------------------

def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir, with a clear error for a missing or truncated file."""
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")
    read_tensor_meta(path, files)  # whole files only
    tensors = {}
    for fp in files:
        try:
            with safe_open(str(fp), framework="pt") as sf:
                for k in sf.keys():
                    tensors[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for truncated headers/data
            raise CheckpointError(f"{fp} cannot be read (truncated or corrupt safetensors file): {e}") from e
    return tensors


def quantized_linear_names(model: nn.Module, schemes: list[Scheme], ignore: list[str]) -> dict[str, Scheme]:
    """Which Linear layers a config's groups target, minus ignored ones. Where several groups
    target a layer, the most specific target wins, as compressed-tensors decides: its exact name,
    then a re: pattern, then its class ("Linear"); among equals the first group. A target or ignore
    entry may name a layer as qtk's model does or as the hub does (moe.hub_name: Mixtral's
    block_sparse_moe.experts.7.w1 is qtk's mlp.experts.7.gate_proj)."""
    chosen = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        names = {name, moe.hub_name(model.config.model_type, name)}
        if any(target_matches(n, mod, t) for t in ignore for n in names):
            continue
        ranked = [(rank, i) for i, s in enumerate(schemes) for t in s.targets
                  if (rank := _match_rank(names, mod, t)) is not None]
        if ranked:
            chosen[name] = schemes[min(ranked)[1]]
    return chosen


def _match_rank(names: set[str], module: nn.Module, target: str) -> int | None:
    """How `target` matches the layer: 0 by its name, 1 by a re: pattern, 2 by its class; None if not."""
    if target in names:
        return 0
    if any(target_matches(n, module, target) for n in names):
        return 1 if target.startswith("re:") else 2
    return None


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """Build the model from config.json with QuantLinear layers and load the tensors into it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise CheckpointError(f"{path / 'config.json'} cannot be read: {e}") from e
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise CheckpointError(f"{path / 'config.json'} has no quantization_config")
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if hub_formats.is_hub_format(qc):
        hub_formats.check_config(qc, path)
        kv = None
    else:
        schemes, ignore, kv = parse_quantization_config(qc)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):  # buffers real: rotary inv_freq, embedding scales, ...
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    moe.linearize_experts(model)  # each expert's projections are their own (Quant)Linears
    tensors = moe.model_tensors(model, read_tensors(path))  # the hub's expert names -> the model's
    tensors = transformers_names(model, tensors)  # names saved by transformers 4 -> transformers 5's
    if hub_formats.is_hub_format(qc):  # GPTQ / AWQ: repacked into compressed-tensors' layout
        layers, tensors = hub_formats.convert(qc, tensors, model, path)
    else:
        layers = quantized_linear_names(model, schemes, ignore)
    for name, scheme in layers.items():
        lin = model.get_submodule(name)
        has_gidx = f"{name}.weight_g_idx" in tensors
        set_module(model, name, QuantLinear(lin.in_features, lin.out_features, scheme, lin.bias is not None,
                                            dtype=dtype, device="meta", g_idx=has_gidx))
    rotated, suffixes = parse_transform_config(qc.get("transform_config"), model)
    tensors = {k: v for k, v in tensors.items() if not any(k.endswith(x) for x in suffixes)}
    for name, block in rotated.items():
        hadamard.attach(model.get_submodule(name), block)
    if kv is not None:
        attach_kv_scales(model, kv_modules(tensors), kv, device="meta")
        enable_kv_quant(model)  # transformers' attention fake-quantizes K and V with the scales
    _load_state(model, tensors, dtype, path)
    model.tie_weights()
    model.config.quantization_config = qc
    return model.to(device)


def transformers_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the names transformers renames them to on loading, where the
    model has no module of their own name (a Gemma 3 saved by transformers 4, as every hub GPTQ / AWQ
    one: language_model.model.layers.N -> model.language_model.layers.N): transformers' renamings for
    the model, not its converters (qtk keeps experts per expert)."""
    modules = dict(model.named_modules())
    foreign = {k for k in tensors if k.rpartition(".")[0] not in modules}
    if not foreign:
        return tensors
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {_renamed(k, renamings) if k in foreign else k: v for k, v in tensors.items()}


def _renamed(key: str, renamings) -> str:
    """KEY through each of transformers' renamings in turn (what its apply_renamings does;
    transformers 5.17 has no apply_renamings)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def kv_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The modules a checkpoint holds k_scale / v_scale of (each block's attention)."""
    return sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".k_scale")})


def _load_state(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, path: Path):
    expected = model.state_dict()
    tied = tied_keys(model)
    # parameters are on meta until filled; buffers the model built itself (real) may be absent
    missing = [k for k in expected if k not in tensors and k not in tied and expected[k].is_meta]
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} is missing from the checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise CheckpointError(f"{path}: tensor {unexpected[0]!r} is not part of the model the config describes"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    state = {}
    for k, ref in expected.items():
        if k not in tensors:
            continue
        t = tensors[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{path}: tensor {k!r} has shape {list(t.shape)} but the config implies "
                                  f"{list(ref.shape)} (does quantization_config match the tensors?)")
        if ref.dtype in (torch.int32, torch.int64, torch.int8, torch.float8_e4m3fn) and t.dtype != ref.dtype:
            raise CheckpointError(f"{path}: tensor {k!r} has dtype {t.dtype}, expected {ref.dtype}")
        if t.is_floating_point() and ref.is_floating_point() and ref.dtype != torch.float8_e4m3fn:
            t = t.to(ref.dtype)
        state[k] = t
    if "weight_shape" in "".join(state):
        for k, t in state.items():
            if k.endswith(".weight_shape"):
                mod = model.get_submodule(k.rsplit(".", 1)[0])
                if t.tolist() != [mod.out_features, mod.in_features]:
                    raise CheckpointError(f"{path}: {k} is {t.tolist()}, the model has "
                                          f"[{mod.out_features}, {mod.in_features}]")
    model.load_state_dict(state, strict=False, assign=True)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model dir (from the index when sharded)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from e
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def check_weight_files(path: Path) -> None:
    """Every weight file is there and whole (headers parse, data as long as they say), before a load."""
    files = weight_files(path)
    if not files:
        if any(path.glob("pytorch_model*.bin")):
            return  # torch pickles: transformers checks them itself
        raise CheckpointError(f"{path} has no weights (model.safetensors, a sharded index or pytorch_model.bin)")
    read_tensor_meta(path, files)


def read_tensor_meta(path: Path, files: list[Path] | None = None) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype, shape, bytes) from the safetensors headers, without loading data; a file that
    is missing, has a corrupt header or is shorter than its header says is a CheckpointError."""
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
    meta = {}
    for f in files if files is not None else weight_files(Path(path)):
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in the index but missing")
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            try:
                header = json.loads(fh.read(n)) if 0 < n <= f.stat().st_size - 8 else None
            except (ValueError, UnicodeDecodeError):
                header = None
        if not isinstance(header, dict):
            raise CheckpointError(f"{f} is not a safetensors file (corrupt or truncated header); "
                                  "re-download or re-save it")
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if f.stat().st_size < 8 + n + end:
            raise CheckpointError(f"{f} is truncated: its header describes {8 + n + end} bytes, the file has "
                                  f"{f.stat().st_size}; re-download or re-save it")
        for k, v in header.items():
            if k == "__metadata__":
                continue
            numel = 1
            for s in v["shape"]:
                numel *= s
            meta[k] = (v["dtype"], v["shape"], numel * sizes.get(v["dtype"], 1))
    return meta
