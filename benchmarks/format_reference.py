"""The format's own answer for a compressed-tensors checkpoint: compressed-tensors dequantizes the
weights, transformers runs them as a float model, and the perplexity on the vLLM referee's windows
is recorded. Where qtk's runtime and vLLM disagree on a checkpoint (benchmarks/vllm_referee.py),
this says which of them departs from the format.

    python benchmarks/format_reference.py --work build/vllm_referee --schemes w4a16,w4a16_asym
        # the checkpoints vllm_referee.py wrote there; results into benchmarks/results/
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def reference_ppl(checkpoint: Path, source: Path, windows: torch.Tensor, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    from interop import ct_dequantize  # tests/interop.py: compressed-tensors' dequantizer
    from qtk.evals.perplexity import perplexity

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = model.state_dict()
    deq = {k: v for k, v in ct_dequantize(checkpoint, fp32_scales=True).items() if k in state}
    if not any(k.endswith("proj.weight") for k in deq):
        raise SystemExit(f"{checkpoint}: compressed-tensors dequantized no Linear weight")
    model.load_state_dict(state | deq)
    return perplexity(model.to(dtype), windows, progress=False).ppl


def main() -> None:
    from transformers import AutoTokenizer

    import vllm_referee
    from qtk.bench.engine import record
    from qtk.loading import BUNDLED, resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="build/vllm_referee", help="where vllm_referee.py wrote the checkpoints")
    ap.add_argument("--schemes", default="w4a16,w4a16_asym")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()
    source = resolve(BUNDLED)
    windows, _ = vllm_referee.inputs(AutoTokenizer.from_pretrained(source))
    windows = torch.tensor(windows)
    results = {name: {str(dtype).removeprefix("torch."): reference_ppl(Path(args.work) / name, source, windows, dtype)
                      for dtype in (torch.float32, torch.bfloat16)}
               for name in args.schemes.split(",")}
    res = record({"model": BUNDLED, "windows": f"{len(windows)} x {windows.shape[1]}", "reference_ppl": results},
                 args.out, "format_reference", " ".join(["python", *sys.argv]))
    print(res["reference_ppl"])


if __name__ == "__main__":
    main()
