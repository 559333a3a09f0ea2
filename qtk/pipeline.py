"""`qtk quantize` end to end: load, calibrate block by block, write the checkpoint atomically."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .calibrate import checkpoint_groups, quantize_model, targeted_linears
from .checkpoint import save_quantized
from .data import calibration_ids
from .models import is_quantized_dir, load_model, resolve
from .recipe import Recipe, to_yaml
from .schemes import check_group_divides

log = logging.getLogger(__name__)


def quantize(model_name: str, recipe: Recipe, output: str | Path, force: bool = False,
             dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> dict:
    """Quantize MODEL with `recipe` into `output`; nothing is written unless everything succeeds."""
    output = Path(output)
    if output.exists() and not force:
        raise FileExistsError(f"output {output} exists; pass --force to replace it")
    if is_quantized_dir(resolve(model_name)):  # resolve() also converts a .gguf once
        raise ValueError(f"{model_name} is already quantized; quantize the original model")
    t0 = time.perf_counter()
    path = resolve(model_name)
    c = recipe.calibration
    # calibration data first: a source too short fails before the model is even loaded
    check_layers(path, recipe)
    tok = AutoTokenizer.from_pretrained(path)
    ids = calibration_ids(tok, c.dataset, c.num_samples, c.seq_len, c.seed, c.chat_template) if recipe.needs_data else None
    model, tok = load_model(str(path), dtype=getattr(torch, recipe.dtype))
    report = quantize_model(model, recipe, ids, progress=progress)
    groups, ignore = checkpoint_groups(model, recipe)
    report.update(model=model_name, method=recipe.method, calibration_tokens=0 if ids is None else ids.numel(),
                  calibration_samples=0 if ids is None else len(ids))
    extra = {"recipe.yaml": to_yaml(recipe), "qtk_report.json": json.dumps(report, indent=2) + "\n"}
    save_quantized(model, tok, output, groups, ignore, recipe.kv_cache, dtype=dtype, force=force, extra_files=extra)
    report["total_seconds"] = time.perf_counter() - t0
    return report


def check_layers(path: Path, recipe: Recipe) -> None:
    """Refuse a group size that does not divide some layer, from the config alone (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .models import arch_for

    config = AutoConfig.from_pretrained(path)
    arch_for(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    check_group_divides(recipe.scheme, {n: m.in_features for n, m in targeted_linears(skeleton, recipe).items()})
