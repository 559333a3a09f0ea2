"""Run llm-compressor (the peer) on given calibration ids; runs inside the peer's own venv.

    python peer_quantize.py METHOD MODEL_DIR CALIB_IDS.pt OUT_DIR --group-size 64 [--dtype bfloat16]

Prints one JSON line {"method", "seconds", "output"} where seconds is the wall time of oneshot()
alone (model load and save excluded), the same span qtk's benchmark times on its side.
"""
import argparse
import json
import time

import torch

# llm-compressor's AWQ calls pin_memory, which fails on a machine with no accelerator.
torch.Tensor.pin_memory = lambda self, *a, **k: self


def w4_group(group_size: int, symmetric: bool) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}}}


def recipe(method: str, group_size: int, iters: int = 200):
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ignore = ["lm_head"]
    if method == "rtn":
        return QuantizationModifier(config_groups=w4_group(group_size, True), ignore=ignore)
    if method == "gptq":
        return GPTQModifier(config_groups=w4_group(group_size, True), ignore=ignore, dampening_frac=0.01, block_size=128)
    if method == "awq":
        return [AWQModifier(config_groups=w4_group(group_size, False), ignore=ignore, duo_scaling=True)]
    if method == "autoround":  # torch.compile off: qtk compiles nothing either, and it needs a compiler here
        return AutoRoundModifier(config_groups=w4_group(group_size, True), ignore=ignore, iters=iters, batch_size=8,
                                 enable_torch_compile=False)
    if method == "smoothquant_gptq_w8a8":
        return [SmoothQuantModifier(smoothing_strength=0.8), GPTQModifier(scheme="W8A8", ignore=ignore)]
    if method == "fp8":
        return QuantizationModifier(scheme="FP8_DYNAMIC", ignore=ignore)
    for suffix, rotations in (("_rotate_down", ["R4"]), ("_rotate_all", ["R1", "R2", "R4"])):
        if method.endswith(suffix):  # SpinQuant's rotations (R4: the down projections' input, online), then the method
            from llmcompressor.modifiers.transform import SpinQuantModifier

            # a block that divides the hidden size (576) and the head size (64): SpinQuant checks every
            # rotation's size even when not asked for it
            rotation = SpinQuantModifier(rotations=rotations, transform_type="hadamard", transform_block_size=64)
            then = recipe(method.removesuffix(suffix), group_size, iters)
            return [rotation, *(then if isinstance(then, list) else [then])]
    raise SystemExit(f"unknown method {method}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("model_dir")
    ap.add_argument("calib_ids")
    ap.add_argument("out_dir")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200, help="autoround: steps per block")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype for calibration (bfloat16: the checkpoint's, "
                    "as llm-compressor's examples load it with dtype='auto')")
    args = ap.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(args.calib_ids)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe(args.method, args.group_size, args.iters), num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    model.save_pretrained(args.out_dir, save_compressed=True)
    tok.save_pretrained(args.out_dir)
    print(json.dumps({"method": args.method, "seconds": seconds, "output": args.out_dir}))


if __name__ == "__main__":
    main()
