"""A random-weight Llama with a large model's layer shapes and only a few layers: prefill and kernel rates at
those shapes (where the matmuls, not the element-wise ops and attention, hold most of the FLOPs) without the
model's size in memory. The bundled model's tokenizer and vocabulary; bf16, as `qtk quantize` reads it.

    python benchmarks/shaped_model.py OUT [--shape llama3-8b] [--layers 2]
    qtk quantize OUT --method smoothquant --scheme w8a8 --weights rtn --num-samples 8 --seq-len 128 -o OUT-w8a8
    python benchmarks/prefill_peak.py --model OUT --quantized OUT-w8a8 --num-prompts 8
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's qtk, not an installed one

from qtk.loading import resolve  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, KV heads (head_dim = hidden / heads), rope theta
    "llama3-8b": (4096, 14336, 32, 8, 500000.0),
    "llama3-70b": (8192, 28672, 64, 8, 500000.0),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, theta = SHAPES[a.shape]
    src, out = Path(resolve("smollm2-135m")), Path(a.out)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                      num_hidden_layers=a.layers, vocab_size=49152, max_position_embeddings=8192, rope_theta=theta,
                      tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    print(f"wrote {out}: {a.shape}'s layer shapes, {a.layers} layers, random weights")


if __name__ == "__main__":
    main()
