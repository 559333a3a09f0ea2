"""`qtk quantize` end to end: load, calibrate block by block, write the checkpoint atomically."""
from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .calibrate import checkpoint_groups, override_schemes, quantize_model, targeted_linears
from .checkpoint import check_weight_files, save_quantized, target_matches
from .data import calibration_ids
from .device import check_device, choose_dtype
from .errors import InputError, OutputError, OutputExistsError
from .loading import is_quantized_dir, load_model, load_tokenizer, read_config, resolve
from .moe import linearize_experts, router_names
from .recipe import MIXED_WIDER, Override, Recipe, to_yaml
from .schemes import check_group_divides, dividing_group_size

log = logging.getLogger(__name__)


def quantize(model_name: str, recipe: Recipe, output: str | Path, force: bool = False,
             dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> dict:
    """Quantize MODEL with `recipe` into `output`; nothing is written unless everything succeeds.

    Everything that can be checked without the weights is checked first (the output can be written,
    the model is an unquantized supported one, the group size divides, the calibration text is long
    enough), so a mistake costs seconds, not a calibration. `dtype` is the checkpoint's float dtype;
    the recipe's dtype is the one blocks run in while calibrating."""
    output = Path(output)
    check_device(recipe.device)
    check_output(output, force)
    t0 = time.perf_counter()
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
    ids = calibration_ids(tok, c.dataset, c.num_samples, c.seq_len, c.seed, c.chat_template) if recipe.needs_data else None
    model, tok = load_model(str(path), dtype=compute.dtype, tokenizer=tok)
    linearize_experts(model)  # a MoE's experts as Linears: each quantized as its own layer
    mixed = None
    if recipe.max_bits is not None:
        recipe, mixed = mix_precision(model, recipe, ids, progress)
    report = quantize_model(model, recipe, ids, progress=progress)
    if mixed is not None:
        report["mixed_precision"] = mixed
    groups, ignore = checkpoint_groups(model, recipe)
    report.update(model=model_name, method=recipe.method, calibration_tokens=0 if ids is None else ids.numel(),
                  calibration_samples=0 if ids is None else len(ids), dtype=compute.name, dtype_reason=compute.reason)
    extra = {"recipe.yaml": to_yaml(recipe), "qtk_report.json": json.dumps(report, indent=2) + "\n"}
    save_quantized(model, tok, output, groups, ignore, recipe.kv_cache, dtype=dtype, force=force, extra_files=extra)
    report["total_seconds"] = time.perf_counter() - t0
    return report


SENSITIVITY_SAMPLES = 2  # calibration samples the per-layer KL is measured on (1,022 positions at 512 tokens)


def mix_precision(model: nn.Module, recipe: Recipe, ids: torch.Tensor | None, progress: bool) -> tuple[Recipe, dict]:
    """recipe.max_bits: each layer's KL when it alone is rounded to the scheme (sensitivity.py), the
    most sensitive kept at 8 bits within the budget; returns the recipe with them as an override
    (max_bits resolved) and what the report says of the choice."""
    from .arch import discover
    from .sensitivity import choose, layer_sensitivity, weight_bits

    if ids is None:
        raise InputError("max_bits measures each layer on calibration samples: this recipe reads none")
    arch = discover(model)
    targets = targeted_linears(model, recipe, arch)
    overridden = override_schemes(targets, recipe)
    targets = {n: m for n, m in targets.items() if n not in overridden}
    shapes = {n: (m.out_features, m.in_features) for n, m in targets.items()}
    floor = sum(o * i * weight_bits(recipe.scheme, i) for o, i in shapes.values()) / sum(o * i for o, i in shapes.values())
    if recipe.max_bits < floor:
        raise InputError(f"max_bits {recipe.max_bits:g} is below what the scheme alone takes ({floor:.3f} bits per "
                         "weight, with its scales): give more")
    t0 = time.perf_counter()
    kl = layer_sensitivity(model, arch, targets, recipe.scheme, ids[:SENSITIVITY_SAMPLES], progress)
    chosen, bits = choose(kl, shapes, recipe.scheme, MIXED_WIDER, recipe.max_bits)
    log.info("mixed precision: %d of %d layers at 8 bits (%.3f bits per weight, budget %g), measured in %.0f s; "
             "the most sensitive: %s", len(chosen), len(targets), bits, recipe.max_bits, time.perf_counter() - t0,
             ", ".join(f"{n} (KL {kl[n]:.4f})" for n in chosen[:5]))
    overrides = recipe.overrides + ((Override(tuple(chosen), MIXED_WIDER),) if chosen else ())
    report = {"max_bits": recipe.max_bits, "bits_per_weight": bits, "scheme_alone_bits": floor,
              "kept_at_8_bits": {n: kl[n] for n in chosen}, "kl_each_layer_alone": kl,
              "samples": min(len(ids), SENSITIVITY_SAMPLES), "seconds": time.perf_counter() - t0}
    return replace(recipe, overrides=overrides, max_bits=None), report


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
