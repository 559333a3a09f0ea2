"""`qtk quantize` end to end: load, calibrate block by block, write the checkpoint atomically."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import distributed
from .calibrate import checkpoint_groups, override_schemes, quantize_model, targeted_linears
from .atomic import write_dir
from .checkpoint import (check_weight_files, read_tensor_meta, save_quantized, target_matches, weight_files,
                         write_block, write_checkpoint)
from .data import calibration_ids
from .distill import distill_scales
from .device import DtypeChoice, check_device, choose_dtype
from .errors import InputError, OutputError, OutputExistsError
from .loading import is_quantized_dir, load_model, load_tokenizer, read_config, resolve
from .moe import linearize_experts, router_names
from .recipe import MIXED_WIDER, Override, Recipe, to_yaml
from .rotation import rotate_down, rotate_residual, rotate_values
from .self_text import instructed_ids, self_generated_ids
from .spill import Activations, activation_bytes
from .staging import Staging
from .methods import METHODS
from .schemes import Scheme, check_group_divides, dividing_group_size
from .sensitivity import bits_per_weight, choose_units, layer_sensitivity, weight_bits

log = logging.getLogger(__name__)


def quantize(model_name: str, recipe: Recipe, output: str | Path, force: bool = False,
             dtype: torch.dtype = torch.bfloat16, progress: bool = True, resume: bool = False) -> dict:
    """Quantize MODEL with `recipe` into `output`; nothing is written unless everything succeeds.

    Everything that can be checked without the weights is checked first (the output can be written,
    the model is an unquantized supported one, the group size divides, the calibration text is long
    enough), so a mistake costs seconds, not a calibration. `dtype` is the checkpoint's float dtype;
    the recipe's dtype is the one blocks run in while calibrating. `resume`: continue the streamed run
    into `output` that was interrupted (staging.py), at the block after the last it finished."""
    t0 = time.perf_counter()
    recipe = replace(recipe, device=distributed.setup(recipe.device))  # several processes: each joins them
    progress = progress and distributed.writes()
    staging = Staging(Path(output))
    if distributed.writes():
        staging.check_start(resume, force)
    job = prepare(model_name, recipe, Path(output), force, calibrate=not resume)
    check_processes(job, resume)
    if job.streams:
        report = write_streamed(job, Path(output), dtype, progress, staging, resume)
    elif resume:
        raise InputError(f"--resume continues a run streamed block by block; this recipe runs the whole model at once "
                         f"for: {'; '.join(job.whole_model_passes) or 'its weights are not in safetensors files'}")
    else:
        check_fits_memory(job)  # (with several processes, each loads it)
        model = job.load()
        recipe, mixed = job.recipe, None
        if recipe.max_bits is not None:
            recipe, mixed = mix_precision(model, recipe, job.ids, progress)
        report = write(job, model, recipe, Path(output), force, dtype, progress, mixed)
    report["total_seconds"] = time.perf_counter() - t0
    return report


@dataclass
class Job:
    """What `quantize` checked and read before any weights: the model's folder, the recipe fitted
    to it, the calibration token ids."""
    model_name: str
    path: Path
    recipe: Recipe
    compute: DtypeChoice
    tokenizer: object
    ids: torch.Tensor | None

    @property
    def whole_model_passes(self) -> list[str]:
        """What in the recipe runs the whole model at once (so the model is loaded whole): nothing, and
        it is streamed from its files block by block (write_streamed)."""
        r = self.recipe
        passes = [f"rotate {'/'.join(r.rotate)} (each rotation is checked on a forward of the whole model)"
                  if r.rotate else "",
                  "max_bits (each layer's sensitivity is measured on the whole model)" if r.max_bits is not None else "",
                  "distill (the scales are trained on the whole model)" if r.distill.samples else ""]
        return [p for p in passes if p]

    @property
    def streams(self) -> bool:
        """Whether the model is read block by block from its safetensors files as it is quantized."""
        return not self.whole_model_passes and bool(weight_files(self.path))

    def load(self) -> nn.Module:
        """The unquantized model, fresh from disk, in the calibration dtype (MoE experts as Linears)."""
        model, _ = load_model(str(self.path), dtype=self.compute.dtype, tokenizer=self.tokenizer)
        linearize_experts(model)  # a MoE's experts as Linears: each quantized as its own layer
        rotate(model, self.recipe)  # before anything measures or calibrates
        return model

    def teacher(self) -> nn.Module:
        """The unquantized model in float32 on the calibration device, as the user gave it (rotations
        change no output, so it is not rotated): the target of the distillation."""
        model, _ = load_model(str(self.path), dtype=torch.float32, device=self.recipe.device, tokenizer=self.tokenizer)
        for p in model.parameters():
            p.requires_grad_(False)
        return model


def check_processes(job: Job, resume: bool) -> None:
    """With several processes (distributed.py), what they cannot share is refused before any weights are
    read: the passes over the whole model, AutoRound's steps, a resume (each keeps its own activations)."""
    if not distributed.active():
        return
    if job.whole_model_passes:
        raise InputError(f"{distributed.size()} processes calibrate block by block, and this recipe runs the whole "
                         f"model at once for: {'; '.join(job.whole_model_passes)}. Run it in one process, or drop "
                         "those (e.g. --method gptq --scheme w4a16 --rotate none)")
    if job.recipe.weights == "autoround":
        raise InputError("autoround takes one calibration batch per step and runs in one process: drop --nproc "
                         "(or use gptq / awq, which several processes share)")
    if resume:
        raise InputError("--resume continues a run of one process (each of several processes keeps its own share of "
                         "the activations, which are not staged): resume without --nproc, or pass --force to "
                         "start over")


def rotate(model: nn.Module, recipe: Recipe) -> None:
    """The recipe's rotations (rotation.py), in place: residual and v_o fused, down online."""
    if recipe.rotate:
        from .arch import discover

        arch = discover(model)
        if "residual" in recipe.rotate:
            rotate_residual(model, arch)
        if "v_o" in recipe.rotate:
            rotate_values(model, arch)
        if "down" in recipe.rotate:
            rotate_down(model, arch)


def prepare(model_name: str, recipe: Recipe, output: Path, force: bool, calibrate: bool = True) -> Job:
    """Every check that needs no weights, and the calibration text tokenized (unless not `calibrate`:
    a resumed run reads the ids it calibrated on)."""
    check_device(recipe.device)
    check_output(output, force)
    path = resolve(model_name)  # also converts a .gguf once
    check_not_source(output, path)
    if is_quantized_dir(path):
        raise InputError(f"{model_name} is already quantized; quantize the original model")
    recipe = fit_layers(path, recipe)
    check_weight_files(path)
    compute = choose_dtype(recipe.dtype, recipe.device)
    c = recipe.calibration
    context = getattr(read_config(path), "max_position_embeddings", None) or c.seq_len
    if recipe.needs_data and c.seq_len > context:  # positions the model never saw would skew every statistic
        log.warning("calibration seq_len %d is longer than the model's context (max_position_embeddings %d): "
                    "calibrating on %d-token samples", c.seq_len, context, context)
        c = replace(c, seq_len=context)
        recipe = replace(recipe, calibration=c)
    tok = load_tokenizer(path)
    ids = None
    if recipe.needs_data and calibrate and distributed.writes():  # read (or written by the model) once
        ids = calibration_samples(path, tok, c, recipe.device)
    ids = distributed.from_writer(ids)
    return Job(model_name, path, recipe, compute, tok, ids)


def calibration_samples(path: Path, tok, c, device: str) -> torch.Tensor:
    """[num_samples, seq_len] calibration ids from c.dataset: one source, or several joined by +
    (builtin+self) with the samples split evenly; `self` is text the model writes, `instruct` its
    answers to qtk's instructions (self_text.py)."""
    sources = [c.dataset] if Path(c.dataset).is_file() else c.dataset.split("+")
    parts = []
    for i, source in enumerate(sources):
        n = c.num_samples // len(sources) + (i < c.num_samples % len(sources))
        if n == 0:
            continue
        if source == "self":
            parts.append(self_generated_ids(str(path), tok, n, c.seq_len, c.seed, device))
        elif source == "instruct":
            parts.append(instructed_ids(str(path), tok, n, c.seq_len, c.seed, device))
        else:
            parts.append(calibration_ids(tok, source, n, c.seq_len, c.seed, c.chat_template))
    return torch.cat(parts)


def write(job: Job, model: nn.Module, recipe: Recipe, output: Path, force: bool, dtype: torch.dtype,
          progress: bool, mixed: dict | None = None, extra_report: dict | None = None) -> dict:
    """Calibrate `model` (job.load()'s) with `recipe` block by block and write the checkpoint to
    `output` atomically; returns the report (also written as qtk_report.json)."""
    with activation_store(job, output) as store:
        report = quantize_model(model, recipe, job.ids, progress=progress, store=store)
    if recipe.distill.samples:
        model.to(recipe.device)
        report["distill"] = distill_scales(model, job.teacher(), job.ids, recipe.distill, progress)
        model.to("cpu")
    if mixed is not None:
        report["mixed_precision"] = mixed
    report.update(extra_report or {})
    groups, ignore = checkpoint_groups(model, recipe)
    describe(report, job, recipe)
    if distributed.writes():
        save_quantized(model, job.tokenizer, output, groups, ignore, recipe.kv_cache, dtype=dtype, force=force,
                       extra_files=report_files(recipe, report))
    return report


def write_streamed(job: Job, output: Path, dtype: torch.dtype, progress: bool, staging: Staging | None = None,
                   resume: bool = False) -> dict:
    """job.recipe run with the model streamed (streaming.py): the model built on meta, each block read
    from the files when its turn comes, quantized, written to the staging folder (staging.py) with
    what the next block needs, and freed, so memory holds the modules outside the blocks and one
    block. With `resume`, the run interrupted there goes on after its last finished block. The
    checkpoint becomes `output` only once whole (atomic.write_dir); returns the report."""
    from .quant_linear import QuantLinear
    from .streaming import StreamedModel

    recipe = job.recipe
    staging = staging or Staging(output)
    writes, one = distributed.writes(), not distributed.active()  # several processes: rank 0 writes, no resume
    run = run_description(job, dtype)
    stream = StreamedModel.open(job.path, job.compute.dtype)
    model = stream.model
    blocks: dict[int, dict] = {}  # finished block -> its quantized layers (QuantLinear.describe)
    if resume:
        job.ids = staging.reopen(run)
        state = staging.load()
        if state is not None:
            stream.resumed, blocks = state["carry"], state["blocks"]
            log.info("resuming at block %d of %d (%s)", len(blocks), len(stream.layers), staging.folder)
    elif writes:
        staging.begin(run, job.ids)

    def finished(i: int, carry: dict) -> None:
        if not writes:
            return
        write_block(model, stream.block_name(i), staging.block_file(i), dtype)
        blocks[i] = {n: m.describe() for n, m in stream.layers[i].named_modules() if isinstance(m, QuantLinear)}
        if one:  # (a process's carry holds its share of the activations only)
            staging.save(carry, blocks)

    stream.sink = finished
    try:
        with activation_store(job, output) as store:
            report = quantize_model(model, recipe, job.ids, progress=progress, stream=stream, store=store)
    except BaseException:
        if not writes:
            raise
        if blocks and one:
            log.warning("%d of %d blocks are finished and kept in %s: run the same command with --resume to "
                        "continue after them", len(blocks), len(stream.layers), staging.folder)
        else:
            staging.remove()
        raise
    for i, layers in blocks.items():  # the blocks an interrupted run finished: their layers' structure
        if stream.resumed is not None and i < stream.resumed["next"]:
            stream.restore(i, layers)
    report.update(streamed=True, resumed_at=None if stream.resumed is None else stream.resumed["next"])
    groups, ignore = checkpoint_groups(model, recipe)
    describe(report, job, recipe)
    if not writes:
        return report
    files = {stream.block_name(i): staging.block_file(i) for i in range(len(stream.layers))}
    with write_dir(output) as folder:
        write_checkpoint(model, job.tokenizer, folder, groups, ignore, recipe.kv_cache, dtype,
                         report_files(recipe, report), files)
    staging.remove()
    return report


@contextlib.contextmanager
def activation_store(job: Job, output: Path):
    """Where this process's calibration activations wait between blocks (spill.py): memory, or a
    folder beside the output, removed when the blocks are done (or fail)."""
    r, c = job.recipe, job.recipe.calibration
    if not r.needs_data:
        yield Activations()
        return
    config = read_config(job.path)
    hidden = getattr(getattr(config, "text_config", config), "hidden_size", 0)
    need = activation_bytes(math.ceil(c.num_samples / distributed.size()), c.seq_len, hidden, job.compute.dtype,
                            METHODS[r.weights].float_chain)
    rank = f"-{distributed.rank()}" if distributed.active() else ""
    store = Activations.choose(c.activations, need, output.parent / f".{output.name}.qtk-activations{rank}",
                               available_memory())
    try:
        yield store
    finally:
        store.close()


def run_description(job: Job, dtype: torch.dtype) -> dict:
    """What a streamed run is, for a resume to match: the model's folder and files, the recipe, the
    checkpoint's dtype, qtk's version."""
    from .version import __version__

    files = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in weight_files(job.path)}
    return {"model": str(job.path.resolve()), "model files": files, "recipe": to_yaml(job.recipe),
            "dtype": str(dtype).removeprefix("torch."), "compute dtype": job.compute.name, "qtk": __version__}


def describe(report: dict, job: Job, recipe: Recipe) -> None:
    """What the report says of the run besides the calibration's own figures."""
    ids = job.ids
    report.update(model=job.model_name, method=recipe.method, calibration_tokens=0 if ids is None else ids.numel(),
                  calibration_samples=0 if ids is None else len(ids), dtype=job.compute.name,
                  dtype_reason=job.compute.reason)


def report_files(recipe: Recipe, report: dict) -> dict[str, str]:
    """The files a checkpoint carries besides the model's: its recipe and the quantize report."""
    return {"recipe.yaml": to_yaml(recipe), "qtk_report.json": json.dumps(report, indent=2) + "\n"}


def check_fits_memory(job: Job) -> None:
    """A recipe that needs the whole model (Job.whole_model_passes) on a model bigger than the memory
    free now is refused before it loads, naming what to drop to stream it block by block instead."""
    available = available_memory()
    need = model_bytes(job.path, job.compute.dtype)
    if available is None or need is None or need <= available:
        return
    passes = job.whole_model_passes
    if not passes:  # no safetensors files to stream from
        raise InputError(f"the model takes {need / 2**30:.1f} GiB in {job.compute.name} and {available / 2**30:.1f} "
                         "GiB of memory is free; it is read whole from pytorch_model*.bin files: save it as "
                         "safetensors (save_pretrained(..., safe_serialization=True)) to stream it block by block")
    raise InputError(f"the model takes {need / 2**30:.1f} GiB in {job.compute.name} and {available / 2**30:.1f} GiB "
                     f"of memory is free; the recipe runs the whole model at once for: {'; '.join(passes)}. "
                     "Without those (e.g. --method gptq --scheme w4a16) it is streamed block by block")


def model_bytes(path: Path, dtype: torch.dtype) -> int | None:
    """The model's size in memory in `dtype` (its floating tensors), from the safetensors headers."""
    files = weight_files(path)
    if not files:
        return None
    width = torch.finfo(dtype).bits // 8
    return sum(math.prod(shape) * width if kind.startswith(("F", "BF")) else nbytes
               for kind, shape, nbytes in read_tensor_meta(path, files).values())


def available_memory() -> int | None:
    """Bytes of memory free for a new allocation (MemAvailable), None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


SENSITIVITY_SAMPLES = 2  # calibration samples the per-layer KL is measured on (1,022 positions at 512 tokens)


def spread(ids: torch.Tensor, k: int) -> torch.Tensor:
    """k of the samples ids [N, L], evenly spaced from the first to the last: with a mix of sources
    (builtin+self, concatenated in order) each source is measured, not only the first."""
    if len(ids) <= k:
        return ids
    return ids[torch.linspace(0, len(ids) - 1, k).round().long()]


@dataclass
class Sensitivity:
    """Each quantized layer's KL divergence when it alone is rounded to the recipe's scheme
    (sensitivity.py), on calibration samples: the order in which layers are kept at 8 bits."""
    kl: dict[str, float]
    shapes: dict[str, tuple[int, int]]  # name -> (out_features, in_features)
    scheme: Scheme
    samples: int
    seconds: float
    groups: tuple[tuple[str, ...], ...] = ()  # layers kept together or not at all (they read one input)

    def bits(self, kept=()) -> float:
        """Average bits per quantized weight with `kept` at MIXED_WIDER."""
        return bits_per_weight(self.shapes, self.scheme, MIXED_WIDER, kept)

    def ranked(self, max_bits: float) -> list[str]:
        """The most sensitive layers first, as many as fit within max_bits (sensitivity.choose)."""
        return [n for unit in self.units(max_bits) for n in unit]

    def units(self, max_bits: float) -> list[tuple[str, ...]]:
        """ranked, as the units kept together (a group, or a layer alone), most sensitive first."""
        return choose_units(self.kl, self.shapes, self.scheme, MIXED_WIDER, max_bits, self.groups)[0]

    def keep(self, recipe: Recipe, kept: list[str], max_bits: float) -> tuple[Recipe, dict]:
        """The recipe with `kept` at MIXED_WIDER (an override; max_bits resolved), and what the
        report says of the choice: the layers, their KL (why), and the bytes they add."""
        cost = sum(o * i * (weight_bits(MIXED_WIDER, i) - weight_bits(self.scheme, i))
                   for n, (o, i) in self.shapes.items() if n in set(kept)) / 8
        overrides = recipe.overrides + ((Override(tuple(kept), MIXED_WIDER),) if kept else ())
        report = {"max_bits": max_bits, "bits_per_weight": self.bits(kept), "scheme_alone_bits": self.bits(),
                  "kept_at_8_bits": {n: self.kl[n] for n in kept}, "bytes_added": round(cost),
                  "kept_together": [list(g) for g in self.groups],
                  "kl_each_layer_alone": self.kl, "samples": self.samples, "seconds": self.seconds}
        return replace(recipe, overrides=overrides, max_bits=None), report


def measure_sensitivity(model: nn.Module, recipe: Recipe, ids: torch.Tensor | None, progress: bool,
                        max_bits: float | None = None) -> Sensitivity:
    """Each quantized layer's KL on SENSITIVITY_SAMPLES calibration samples spread over the mix (layers
    an override of the recipe already names are left out); a budget below the scheme's own is refused
    first."""
    from .arch import discover

    if ids is None:
        raise InputError("max_bits measures each layer on calibration samples: this recipe reads none")
    arch = discover(model)
    targets = targeted_linears(model, recipe, arch)
    overridden = override_schemes(targets, recipe)
    targets = {n: m for n, m in targets.items() if n not in overridden}
    shapes = {n: (m.out_features, m.in_features) for n, m in targets.items()}
    floor = bits_per_weight(shapes, recipe.scheme, MIXED_WIDER)
    if max_bits is not None and max_bits < floor:
        raise InputError(f"max_bits {max_bits:g} is below what the scheme alone takes ({floor:.3f} bits per "
                         "weight, with its scales): give more")
    t0 = time.perf_counter()
    kl = layer_sensitivity(model, arch, targets, recipe.scheme, spread(ids, SENSITIVITY_SAMPLES), progress)
    groups = tuple(tuple(f"{arch.layers}.{i}.{n}" for n in g)
                   for i, layer in enumerate(arch.shared_input) for g in layer)
    return Sensitivity(kl, shapes, recipe.scheme, min(len(ids), SENSITIVITY_SAMPLES), time.perf_counter() - t0,
                       groups)


def mix_precision(model: nn.Module, recipe: Recipe, ids: torch.Tensor | None, progress: bool) -> tuple[Recipe, dict]:
    """recipe.max_bits: the most sensitive layers kept at 8 bits within the budget; returns the
    recipe with them as an override (max_bits resolved) and what the report says of the choice."""
    sens = measure_sensitivity(model, recipe, ids, progress, recipe.max_bits)
    kept = sens.ranked(recipe.max_bits)
    log.info("mixed precision: %d of %d layers at 8 bits (%.3f bits per weight, budget %g), measured in %.0f s; "
             "the most sensitive: %s", len(kept), len(sens.kl), sens.bits(kept), recipe.max_bits, sens.seconds,
             ", ".join(f"{n} (KL {sens.kl[n]:.4f})" for n in kept[:5]))
    return sens.keep(recipe, kept, recipe.max_bits)


def check_output(output: Path, force: bool) -> None:
    """Refuse an output that exists (without force) or whose folder cannot be written, before any work.

    Missing parent folders are not made here (a failed quantize would leave them): the nearest one
    that exists is probed, where the write will make them."""
    if output.exists() and not force:
        raise OutputExistsError(f"output {output} exists; pass --force to replace it")
    parent = next(p for p in (output.parent, *output.parent.parents) if p.exists())
    try:
        tempfile.TemporaryDirectory(dir=parent, prefix=f".{output.name}.probe-").cleanup()
    except OSError as e:
        raise OutputError(f"cannot write --output {output}: {e.strerror or e} ({parent}); "
                          "choose a folder you can write to") from e


def check_not_source(output: Path, source: Path) -> None:
    """Refuse an output that is the model's own folder or holds it: --force would delete the model."""
    out, src = output.resolve(), Path(source).resolve()
    if out == src or out in src.parents:
        raise InputError(f"--output {output} would replace the model being quantized ({source}); "
                         "choose another output folder")


def fit_layers(path: Path, recipe: Recipe) -> Recipe:
    """The recipe with a group size that divides every targeted layer, from the config alone (no
    weights loaded): a default group size is lowered to the largest power of two that divides them
    all (and logged); an explicit one that does not divide is refused, naming the layers."""
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    linearize_experts(skeleton)
    check_ignore(skeleton, recipe)
    in_features = {n: m.in_features for n, m in targeted_linears(skeleton, recipe).items()}
    w = recipe.scheme.weights
    if recipe.auto_group_size and w.strategy == "group":
        fit = dividing_group_size(in_features, at_most=w.group_size)
        if fit is not None and fit != w.group_size:
            log.info("group size %d (the default %d does not divide every quantized layer, e.g. in_features %d); "
                     "pass --group-size to choose", fit, w.group_size,
                     next(k for k in in_features.values() if k % w.group_size))
            recipe = replace(recipe, scheme=recipe.scheme.with_group_size(fit))
        recipe = replace(recipe, auto_group_size=False)
    check_group_divides(recipe.scheme, in_features)
    return recipe


def check_ignore(model: nn.Module, recipe: Recipe) -> None:
    """Every ignore pattern names at least one Linear layer or MoE router (a mistyped name would
    quantize the layer it meant to keep; llm-compressor's MoE recipes ignore 're:.*mlp.gate$', which
    is no Linear in transformers 5 and never quantized), at least one decoder Linear is left, and
    every override target names a decoder Linear that is quantized."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    linears.update({r: model.get_submodule(r) for r in router_names(model)})
    for pattern in recipe.ignore:
        if not any(target_matches(n, m, pattern) for n, m in linears.items()):
            example = next(n for n in linears if n.endswith("down_proj") or n != "lm_head")
            raise InputError(f"ignore pattern {pattern!r} matches no Linear layer; give full names such as "
                             f"{example!r} or a 're:REGEX' pattern (matched from the start of the name)")
    if not targeted_linears(model, recipe):
        raise InputError(f"the ignore patterns {list(recipe.ignore)} leave no decoder layer to quantize")
    targets = targeted_linears(model, recipe)
    for o in recipe.overrides:  # a mistyped name would leave the layer it meant at the main scheme
        for t in o.targets:
            if not any(target_matches(n, m, t) for n, m in targets.items()):
                example = next(iter(targets))
                raise InputError(f"override target {t!r} matches no quantized decoder Linear (an ignored layer "
                                 f"stays float); give full names such as {example!r} or a 're:REGEX' pattern")
