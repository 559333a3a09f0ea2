"""vLLM reads qtk's checkpoints of model types beyond Llama: MoE (experts quantized, by the hub's
names), Gemma 3, Phi-3, ... Per type, a small random model (sizes vLLM's CPU kernels take: head
dim 64) is quantized by qtk (RTN W4A16, group 32: the format is under test, not the method) and
loaded by vLLM's CPU build in its own venv; both engines score the same windows and greedy-decode
the same prompts (benchmarks/vllm_referee.py's referee: perplexity within 1%, tokens equal up to a
near-tie). The float model is the control. Where vLLM refuses, its reason is recorded.

    python benchmarks/vllm_referee_models.py [--types qwen3_moe,mixtral,...] [--out benchmarks/results]

Random weights give near-flat distributions, so near-ties are common: `exact_prompts` counts the
prompts decoded identically to the end, `near_tie` says whether a parting was one.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
TYPES = {"qwen3_moe": MOE, "mixtral": MOE, "olmoe": MOE, "gemma3_text": {}, "phi3": {}, "qwen3": {}}


def _referee_module():
    spec = importlib.util.spec_from_file_location("vllm_referee", REPO / "benchmarks" / "vllm_referee.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(model_type: str, path: Path) -> Path:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from peer_fixtures import byte_tokenizer

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**SIZES, **TYPES[model_type]))
        model.to(torch.bfloat16).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


def quantize(src: Path, out: Path) -> Path:
    from qtk import pipeline
    from qtk.recipe import from_flags

    if not (out / "config.json").is_file():
        pipeline.quantize(str(src), from_flags("rtn", scheme="w4a16", group_size=32), out, progress=False)
    return out


def main() -> None:
    from qtk.bench.engine import record

    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--work", default="build/vllm_referee_models")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="vllm_referee_models", help="JSON file name (add the CPU and date).")
    args = ap.parse_args()
    ref = _referee_module()
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 256, (4, 128), generator=g).tolist()
    prompts = torch.randint(3, 256, (8, 12), generator=g).tolist()
    results = {}
    for t in args.types.split(","):
        src = build(t, Path(args.work) / t / "float")
        q = quantize(src, Path(args.work) / t / "w4a16")
        results[t] = {name: ref.referee(d, windows, prompts, "bfloat16") for name, d in (("float", src), ("w4a16", q))}
        print(t, json.dumps(results[t], indent=1), flush=True)
    record({"sizes": SIZES, "moe": MOE, "dtype": "bfloat16", "windows": "4 x 128 random ids", "prompts": 8,
            "new_tokens": ref.NEW_TOKENS, "types": results}, args.out, args.name,
           " ".join(["python", *sys.argv]))


if __name__ == "__main__":
    main()
