"""A random-weight Llama with a large model's layer shapes and any number of layers: prefill and kernel rates at
those shapes (where the matmuls, not the element-wise ops and attention, hold most of the FLOPs) without the
model's size in memory, and models as large as the disk holds for the streamed quantize's memory figures
(written one block at a time: nothing near the model's size is ever in memory). The bundled model's tokenizer
and vocabulary; bf16, as `qtk quantize` reads it.

    python benchmarks/shaped_model.py OUT [--shape llama3-8b] [--layers 2]
    qtk quantize OUT --method smoothquant --scheme w8a8 --weights rtn --num-samples 8 --seq-len 128 -o OUT-w8a8
    python benchmarks/prefill_peak.py --model OUT --quantized OUT-w8a8 --num-prompts 8
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's qtk, not an installed one

from qtk.loading import resolve  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, KV heads (head_dim = hidden / heads), rope theta, the model's layers
    "llama3-8b": (4096, 14336, 32, 8, 500000.0, 32),
    "14b": (5120, 13824, 40, 8, 1000000.0, 48),  # Qwen2.5-14B's sizes as a Llama: 13.5B parameters, 27 GB in bf16
    "llama3-70b": (8192, 28672, 64, 8, 500000.0, 80),
}


def write(out: Path, shape: str, layers: int, seed: int = 0) -> Path:
    """The model, one safetensors file per block (and one for the embeddings and final norm), each made and
    written before the next: Linear and embedding weights N(0, 0.02) as transformers initializes a Llama,
    norms ones; the bundled model's tokenizer files beside."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, theta, _ = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                      num_hidden_layers=layers, vocab_size=49152, max_position_embeddings=8192, rope_theta=theta,
                      tie_word_embeddings=True, dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if k != "lm_head.weight"}  # tied
    groups: dict[str, list[str]] = {}
    for k in shapes:
        parts = k.split(".")
        groups.setdefault(".".join(parts[:3]) if parts[1] == "layers" else "outside", []).append(k)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for n, (group, keys) in enumerate(groups.items()):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=gen) * cfg.initializer_range if len(shapes[k]) == 2
                       else torch.ones(shapes[k])).to(torch.bfloat16) for k in keys}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        total += sum(t.numel() * 2 for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2) + "\n")
    cfg.save_pretrained(out)
    for f in Path(resolve("smollm2-135m")).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (0: as many as the model it is shaped as)")
    a = p.parse_args()
    layers = a.layers or SHAPES[a.shape][-1]
    write(Path(a.out), a.shape, layers)
    print(f"wrote {a.out}: {a.shape}'s layer shapes, {layers} layers, random weights")


if __name__ == "__main__":
    main()
