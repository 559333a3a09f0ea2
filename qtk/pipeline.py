"""`qtk quantize` end to end: load, calibrate block by block, write the checkpoint atomically."""
from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .calibrate import checkpoint_groups, quantize_model, targeted_linears
from .checkpoint import save_quantized
from .data import calibration_ids
from .device import choose_dtype
from .errors import InputError, OutputError, OutputExistsError
from .models import arch_for, is_quantized_dir, load_model, read_config, resolve
from .recipe import Recipe, replace, to_yaml
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
    check_output(output, force)
    t0 = time.perf_counter()
    path = resolve(model_name)  # also converts a .gguf once
    if is_quantized_dir(path):
        raise InputError(f"{model_name} is already quantized; quantize the original model")
    recipe = fit_layers(path, recipe)
    compute = choose_dtype(recipe.dtype, recipe.device)
    c = recipe.calibration
    tok = AutoTokenizer.from_pretrained(path)
    ids = calibration_ids(tok, c.dataset, c.num_samples, c.seq_len, c.seed, c.chat_template) if recipe.needs_data else None
    model, tok = load_model(str(path), dtype=compute.dtype)
    report = quantize_model(model, recipe, ids, progress=progress)
    groups, ignore = checkpoint_groups(model, recipe)
    report.update(model=model_name, method=recipe.method, calibration_tokens=0 if ids is None else ids.numel(),
                  calibration_samples=0 if ids is None else len(ids), dtype=compute.name, dtype_reason=compute.reason)
    extra = {"recipe.yaml": to_yaml(recipe), "qtk_report.json": json.dumps(report, indent=2) + "\n"}
    save_quantized(model, tok, output, groups, ignore, recipe.kv_cache, dtype=dtype, force=force, extra_files=extra)
    report["total_seconds"] = time.perf_counter() - t0
    return report


def check_output(output: Path, force: bool) -> None:
    """Refuse an output that exists (without force) or whose folder cannot be written, before any work."""
    if output.exists() and not force:
        raise OutputExistsError(f"output {output} exists; pass --force to replace it")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.probe-").cleanup()
    except OSError as e:
        raise OutputError(f"cannot write --output {output}: {e.strerror or e} ({output.parent}); "
                          "choose a folder you can write to") from e


def fit_layers(path: Path, recipe: Recipe) -> Recipe:
    """The recipe with a group size that divides every targeted layer, from the config alone (no
    weights loaded): a default group size is lowered to the largest power of two that divides them
    all (and logged); an explicit one that does not divide is refused, naming the layers."""
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    arch_for(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
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
