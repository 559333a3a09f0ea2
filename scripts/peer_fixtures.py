"""Build llm-compressor checkpoints for tests/test_peer_checkpoints.py. Runs in the peer venv.

    python scripts/peer_fixtures.py OUT

writes (bash scripts/peer_env.sh fixtures runs it there, into build/peer_fixtures):
    OUT/float/                a tiny random Llama (float32, seed 0) with a byte-level tokenizer
    OUT/<scheme>/             llm-compressor oneshot, QuantizationModifier (RTN, no calibration
                              data), saved with save_compressed=True; scheme in SCHEMES
    OUT/peer_logits.safetensors
        input_ids             [2, 16] int64
        <scheme>.oneshot      the oneshot model's own forward (bf16, fake-quant weights and activations)
        <scheme>.fake_quant   the saved checkpoint reloaded by the peer's transformers +
                              compressed-tensors (run_compressed, float32): fake-quant weights,
                              activations and KV as compressed-tensors simulates them
        <scheme>.weight_only  the saved checkpoint reloaded with dequantize=True (float32) and
                              quantization disabled: dequantized weights, float activations
    OUT/versions.json         torch / transformers / compressed-tensors / llmcompressor versions
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# The tiny model of the qtk tests (tests/interop.py and conftest.py import it from here): group 32 divides every input size
# (64 and 128); llm-compressor's W4A16 preset (group 128) would not.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)


def _w4_group32(symmetric: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 32}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


# fixture name -> QuantizationModifier arguments (ignore=["lm_head"] is added to each)
SCHEMES = {
    "w4a16": _w4_group32(symmetric=True),
    "w4a16_asym": _w4_group32(symmetric=False),
    "w8a8": {"scheme": "W8A8", "targets": ["Linear"]},  # int8 channel weights, dynamic per-token int8
    "fp8_dynamic": {"scheme": "FP8_DYNAMIC", "targets": ["Linear"]},
}


def byte_tokenizer():
    """A 256-token byte-level tokenizer: every byte is one token, so ids fit the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0])


def save_float(d: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)


def quantize(float_dir: Path, out: Path, modifier_args: dict, ids: torch.Tensor) -> torch.Tensor:
    """oneshot RTN on the float model loaded in bf16 (as users load it); the model's own logits."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16)
    model = oneshot(model=model, recipe=QuantizationModifier(ignore=["lm_head"], **modifier_args))
    with torch.no_grad():
        logits = model(ids).logits.float()
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(float_dir).save_pretrained(out)
    return logits


def reload_logits(d: Path, ids: torch.Tensor, weight_only: bool) -> torch.Tensor:
    """Logits of the saved checkpoint as the peer's transformers + compressed-tensors load it."""
    from compressed_tensors.quantization import disable_quantization
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=weight_only))
    if weight_only:
        # transformers 5.17 keeps the activation fake-quant hooks after dequantizing the weights
        model.apply(disable_quantization)
    with torch.no_grad():
        return model(ids).logits.float()


def versions() -> dict:
    import compressed_tensors
    import llmcompressor
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__, "llmcompressor": llmcompressor.__version__}


def main(out: Path):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_float(out / "float")
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    tensors = {"input_ids": ids}
    for name, args in SCHEMES.items():
        tensors[f"{name}.oneshot"] = quantize(out / "float", out / name, args, ids)
        tensors[f"{name}.fake_quant"] = reload_logits(out / name, ids, weight_only=False)
        tensors[f"{name}.weight_only"] = reload_logits(out / name, ids, weight_only=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "peer_logits.safetensors"))
    (out / "versions.json").write_text(json.dumps(versions(), indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/peer_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
