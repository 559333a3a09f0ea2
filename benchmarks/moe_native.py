"""Decode throughput of MoE models on the native path (runtime/models/moe.py: tokens grouped by
expert, each expert's gate/up one packed matmul) against the generic one (transformers' modeling
code: its grouped_mm experts for float, qtk.moe.LinearExperts of QuantLinears for a checkpoint), on
tests/zoo.py's tiny Mixtral, Qwen3-MoE and gpt-oss, float32 and RTN w4a16 (experts quantized in memory as
`qtk quantize --method rtn` does).

    python benchmarks/moe_native.py [--batch 8] [--steps 32] [--repeats 3] [--threads 2]
        [--size tiny|small|many]    # small: hidden 512, 8 experts of 256, top-2, 4 layers;
                                    # many: hidden 256, 64 experts of 64, top-8, 4 layers

Prints one line per (model, weights): native and generic decode tokens/s and their ratio
(generic_vs_native.model_tokens_per_s: the median of `repeats` runs of `steps` batched decodes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]  # this checkout's qtk, not an installed one

from generic_vs_native import model_tokens_per_s  # noqa: E402

SIZES = {"tiny": {}, "small": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                   num_local_experts=8, num_experts=8, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=64),
         # many small experts, as Qwen3-30B-A3B's 128 of top-8
         "many": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_local_experts=64,
                      num_experts=64, num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64)}


def model(model_type: str, weights: str, size: str):
    from zoo import tiny, tiny_config

    sizes, types = dict(SIZES[size]), getattr(tiny_config(model_type), "layer_types", None)
    if types and "num_hidden_layers" in sizes:  # gpt-oss: the zoo's alternating windows over every layer
        sizes["layer_types"] = (types * sizes["num_hidden_layers"])[:sizes["num_hidden_layers"]]
    m = tiny(model_type, **sizes)
    if weights == "float32":
        return m
    from qtk.calibrate import quantize_model
    from qtk.moe import linearize_experts
    from qtk.recipe import from_flags

    linearize_experts(m)
    quantize_model(m, from_flags("rtn", scheme="w4a16", group_size=32), None, progress=False)
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{'model':10} {'weights':8} {'native tok/s':>13} {'generic tok/s':>14} {'ratio':>6}   "
          f"({a.size}, batch {a.batch}, {torch.get_num_threads()} threads)")
    for model_type in ("mixtral", "qwen3_moe", "gpt_oss"):
        for weights in ("float32", "w4a16"):
            native, generic = (model_tokens_per_s(model(model_type, weights, a.size), g, a.batch, a.prompt_len,
                                                  a.steps, a.repeats)["tokens_per_s"] for g in (False, True))
            print(f"{model_type:10} {weights:8} {native:13.1f} {generic:14.1f} {native / generic:6.2f}", flush=True)


if __name__ == "__main__":
    main()
