"""qtk's default-recipe checkpoint exported as GPTQ and AWQ by the tools' own packers, read back.

    bash scripts/hub_fixtures.sh                      # fetches the tools' packing code (build/hub_tools)
    python benchmarks/hub_formats.py CHECKPOINT [--out benchmarks/results/hub_formats.json]

CHECKPOINT is a compressed-tensors int4 asym checkpoint (`make demo` writes the default recipe's).
Each quantized Linear's exact codes, zero points and scales are handed to AutoGPTQ 0.7.1's
QuantLinear.pack (GPTQ v1) and AutoAWQ 0.2.9's WQLinear_GEMM.from_linear; the float tensors are
copied as they are. Then, for the three folders: the load time, whether every Linear's codes,
zero points and scales equal the original's, the engine's perplexity on the standard windows
(qtk eval --task ppl's, the first 4), and batch-1 decode (128 prompt tokens, 128 new; the engines
take turns, 5 rounds). A fourth folder stores the GPTQ export's zeros by value (gptq_v2).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from hub_fixtures import awq_modules, load_file  # noqa: E402

TOOLS = ROOT / "build" / "hub_tools"


def export(src: Path, out: Path, tool: str) -> None:
    """src (compressed-tensors) -> out in the tool's layout, packed by the tool's code."""
    from qtk.checkpoint import load_quantized, read_tensors
    from qtk.quant_linear import QuantLinear

    if tool == "gptq":
        qlinear = load_file("autogptq_qlinear_cuda", TOOLS / "auto_gptq/nn_modules/qlinear/qlinear_cuda.py")
    else:
        gemm = awq_modules(next(p for p in TOOLS.glob("autoawq-*") if p.is_dir()))
    model = load_quantized(src)
    state = read_tensors(src)
    group = None
    for name, q in model.named_modules():
        if not isinstance(q, QuantLinear):
            continue
        w = q.scheme.weights
        group = w.group_size
        codes = q.codes().float() + 8  # unsigned [N, K]
        zeros = q.zero_point().float() + 8  # [N, groups]
        scales = q.weight_scale.float().half()
        g = torch.arange(q.in_features) // group
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=False).half()
        lin.weight.data = ((codes - zeros[:, g]) * scales.float()[:, g]).half()
        for k in [k for k in state if k.startswith(f"{name}.")]:
            del state[k]
        if tool == "gptq":
            m = qlinear.QuantLinear(4, group, q.in_features, q.out_features, False)
            m.pack(lin, scales, zeros.half(), g.to(torch.int32))
            parts = {"qweight": m.qweight, "qzeros": m.qzeros, "scales": m.scales, "g_idx": m.g_idx}
        else:
            m = gemm.WQLinear_GEMM.from_linear(lin, 4, group, scales=scales.t().contiguous(),
                                              zeros=zeros.t().contiguous())
            parts = {"qweight": m.qweight, "qzeros": m.qzeros, "scales": m.scales}
        state.update({f"{name}.{k}": v.contiguous() for k, v in parts.items()})
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*", "qtk_report.json", "recipe.yaml"))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
        if tool == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": None})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def same_layers(a, b) -> bool:
    from qtk.quant_linear import QuantLinear

    la = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    lb = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    return la.keys() == lb.keys() and all(
        torch.equal(la[n].codes(), lb[n].codes()) and torch.equal(la[n].zero_point(), lb[n].zero_point())
        and torch.equal(la[n].weight_scale.float(), lb[n].weight_scale.float()) for n in la)


def to_v2(v1: Path, out: Path, src: Path) -> None:
    """The v1 export with its qzeros stored by value (gptq_v2): AutoGPTQ's v1 packer cannot store a
    zero of 0 (it writes -1 over the word's higher fields), v2 can. The codes stay the tool's."""
    from safetensors.torch import load_file

    from qtk.checkpoint import load_quantized
    from qtk.quant import pack_int32
    from qtk.quant_linear import QuantLinear

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(v1, out)
    state = load_file(str(out / "model.safetensors"))
    for name, q in load_quantized(src).named_modules():
        if isinstance(q, QuantLinear):  # zero_point() [N, groups] signed = the unsigned zero - 8
            state[f"{name}.qzeros"] = pack_int32(q.zero_point().t().contiguous(), 4)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def measure(path: Path, reference) -> tuple[dict, object]:
    from qtk import LLM
    from qtk.checkpoint import load_quantized
    from qtk.evals.perplexity import engine_perplexity, eval_windows

    t0 = time.perf_counter()
    model = load_quantized(path)
    load_s = time.perf_counter() - t0
    llm = LLM(str(path), dtype="float32", max_model_len=2049, enable_prefix_caching=False,
              kv_cache_memory=2**28)
    windows = eval_windows(llm.tokenizer, "builtin", 2048, 4)
    ppl = engine_perplexity(llm, windows, batch_size=1, progress=False, dataset="builtin").ppl
    return {"load_s": round(load_s, 2), "same_codes_zeros_scales": same_layers(model, reference),
            "perplexity": ppl}, llm


def decode_rounds(llms: dict, rounds: int = 5) -> dict[str, list[float]]:
    """Batch-1 decode tok/s, the engines taking turns (the machine's speed drifts between runs)."""
    from qtk import SamplingParams

    prompt = list(range(1000, 1128))
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    rates = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate([prompt], params)
            rates[name].append(round(128 / (time.perf_counter() - t0), 1))
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/hub_formats.json"))
    args = ap.parse_args()
    from qtk.checkpoint import load_quantized

    src = Path(args.checkpoint)
    work = ROOT / "build" / "hub_bench"
    for tool in ("gptq", "awq"):
        export(src, work / tool, tool)
    to_v2(work / "gptq", work / "gptq_v2", src)
    reference = load_quantized(src)
    results, llms = {}, {}
    for name, path in (("compressed-tensors", src), ("gptq v1 (AutoGPTQ)", work / "gptq"),
                       ("gptq_v2", work / "gptq_v2"), ("awq gemm (AutoAWQ)", work / "awq")):
        results[name], llms[name] = measure(path, reference)
    for name, rates in decode_rounds(llms).items():
        results[name]["batch1_tok_s"] = rates
        results[name]["batch1_tok_s_median"] = sorted(rates)[len(rates) // 2]
    from qtk.device import cpu_name
    res = {"checkpoint": str(src), "cpu": cpu_name(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "results": results}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
