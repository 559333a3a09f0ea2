"""Prefill against the CPU's matmul peak (issue 29, part 1): how close qtk's runtime comes to what
this CPU's matmul units can do, for each path the engine may take on a float checkpoint.

    python benchmarks/prefill_peak.py [--model smollm2-135m] [--prompts 256,1024] [--num-prompts 16]
        [--quantized W4A16_DIR,W8A8_DIR] [--repeats 2] [--out benchmarks/results]

Four measurements, in one process, 2 threads unless --threads:
1. matmul peak, per dtype: oneDNN's matmul (the engine's, weights reordered once) on the model's
   layer shapes (q/k/v joined, o, gate/up joined, down) at 256-2048 rows, in cache; the best
   GFLOP/s of float32 and of bf16 (bf16 only where the CPU has bf16 units); and, where the CPU has
   int8 dot products (VNNI), the best GOP/s of int8 x int8 -> int32 products: oneDNN's (torch._int_mm)
   and qtk's W8A8 kernel (csrc/cpu_w8a8.cpp, the activations' quantization included).
2. the crossover by rows: the model's decoder layers out of cache (every layer's own weights), per
   rows M, in the kernels the engine chooses among for a bf16 checkpoint's weights: qtk's kernel
   (bf16 weights, float32 activations), qtk's bf16 kernel (AVX512-BF16, packed_linear.BF16_DOT_ROWS),
   oneDNN float32, oneDNN bf16 (packed_linear.MANY_ROWS).
3. attention: one layer's causal attention over a whole prompt (the prompt lengths and 4096) in
   qtk's flash kernel, bf16 math (where the CPU has AVX512-BF16) and float32 math (AVX-512), and in
   torch's float32 flash kernel (sdpa: the path of CPUs without AVX-512).
4. prefill: `num-prompts` prompts of exactly L tokens of the built-in evaluation text, 1 output
   token, prefix caching off (every token is computed), after a warm-up, the best of `repeats` runs
   (these VMs' speed moves 10-20% within minutes); tokens/s, and the FLOPs
   done per second (the decoder's linear layers, 2 per weight per token; attention, 4 * heads *
   head_dim per (query, key) pair it reads: causal, so (L + 1) / 2 keys on average; the lm_head on
   the last token) as a share of the peak of the dtype its many-row matmuls run in (as measured in 1,
   and timed again right after the prefill: the VM's speed drifts), and of the roofline with each op at
   its own dtype's peak timed beside (W8A8: the layers at the int8 peak, attention at bf16's). Once as the
   engine chooses (bf16 where the CPU has the units) and once with QTK_CPU_BF16=0 (float32).
   --quantized: checkpoints of the same model (`qtk quantize` outputs) prefilled alike, as the engine
   runs them: weight-only int4/int8 in bf16 on qtk's kernel for the codes where the CPU has AVX512-BF16
   (against the bf16 peak), else float32 (the float32 peak); W8A8 on qtk's VNNI kernel (the int8 peak).
Writes JSON (command, commit, CPU, versions, date) and prints tables.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # this checkout's qtk, not an installed one

from qtk.bench import git_commit  # noqa: E402
from qtk.device import cpu_has_int8_dot, cpu_has_native_bf16, cpu_name  # noqa: E402
from qtk.kernels import cpu as cpu_kernels  # noqa: E402
from qtk.kernels.dispatch import packed_linear  # noqa: E402


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(K, N) of one decoder layer's matmuls as the engine joins them: qkv, o, gate_up, down."""
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    return [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]


def reorder(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def matmul_peak(shapes, dtypes, int8: bool) -> tuple[dict, dict]:
    """({dtype name: best GFLOP/s} of oneDNN's matmul on these shapes, in cache; int8: the best GOP/s of
    int8 products (oneDNN's torch._int_mm, qtk's W8A8 kernel) as "int8", and each as "int8_onednn",
    "int8_qtk_w8a8"), ({dtype name: probe}: a call that times the best case again, GFLOP/s, to measure
    the peak beside a later measurement: these VMs' speed moves by 10-20% within minutes)."""
    peak, cases = {}, {}
    for dtype in dtypes:
        best = (0.0, None)
        for k, n in shapes:
            w = reorder(torch.randn(n, k).to(dtype))
            for m in (256, 1024, 2048):
                x = torch.randn(m, k).to(dtype)
                best = max(best, (2 * m * k * n / best_seconds(lambda: packed_linear(x, w, None), 10) / 1e9, (m, k, n)))
        peak[str(dtype)[6:]], cases[str(dtype)[6:]] = best[0], ("onednn", dtype, *best[1])
    if int8:
        lib, onednn, qtk = cpu_kernels.ops(), (0.0, None), (0.0, None)
        for k, n in shapes:
            wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            packed = cpu_kernels.pack_w8a8(wq, torch.full((n,), 0.01)) if lib is not None else None
            for m in (256, 1024, 2048):
                xq, x = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randn(m, k)
                ops = 2 * m * k * n
                onednn = max(onednn, (ops / best_seconds(lambda: torch._int_mm(xq, wq.T), 10) / 1e9, (m, k, n)))
                if packed is not None:
                    qtk = max(qtk, (ops / best_seconds(lambda: cpu_kernels.w8a8_linear(x, packed, None, None, lib), 10) / 1e9,
                                    (m, k, n)))
        peak.update(int8=max(onednn, qtk)[0], int8_onednn=onednn[0], int8_qtk_w8a8=qtk[0])
        cases["int8"] = ("int_mm", torch.int8, *onednn[1]) if onednn >= qtk else ("qtk_w8a8", torch.int8, *qtk[1])
    return peak, {name: lambda case=case: probe(*case) for name, case in cases.items()}


def probe(kind: str, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """GFLOP/s of one peak case again (best of 5)."""
    if kind == "onednn":
        w, x = reorder(torch.randn(n, k).to(dtype)), torch.randn(m, k).to(dtype)
        fn = lambda: packed_linear(x, w, None)  # noqa: E731
    elif kind == "int_mm":
        wq, xq = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.randint(-127, 128, (m, k), dtype=torch.int8)
        fn = lambda: torch._int_mm(xq, wq.T)  # noqa: E731
    else:
        lib = cpu_kernels.ops()
        packed, x = cpu_kernels.pack_w8a8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.full((n,), 0.01)), torch.randn(m, k)
        fn = lambda: cpu_kernels.w8a8_linear(x, packed, None, None, lib)  # noqa: E731
    return 2 * m * k * n / best_seconds(fn, 5) / 1e9


def crossover(shapes, layers: int, ms: list[int], bf16: bool) -> list[dict]:
    """Per rows M: ms per pass over `layers` decoder layers (weights out of cache) in each kernel."""
    lib = cpu_kernels.ops()
    ws = [[torch.randn(n, k).bfloat16().float() for k, n in shapes] for _ in range(layers)]
    kinds = {"onednn_float32": [[reorder(w) for w in layer] for layer in ws]}
    if bf16:
        kinds["onednn_bf16"] = [[reorder(w.bfloat16()) for w in layer] for layer in ws]
    woq = [[cpu_kernels.pack_bf16(w) for w in layer] for layer in ws] if lib is not None else None
    rows = []
    for m in ms:
        xs = [torch.randn(m, k) for k, _ in shapes]
        r = {"m": m}
        if woq is not None:
            r["qtk_kernel_bf16_weights"] = 1e3 * best_seconds(lambda: [
                lib.woq_linear(x, w.codes, w.scales, w.zs, None, w.bits, w.n) for layer in woq for x, w in zip(xs, layer)])
            if bf16 and lib.bf16_linear_runs():
                r["qtk_bf16_kernel"] = 1e3 * best_seconds(lambda: [
                    lib.bf16_linear(x, w.codes, None, w.n) for layer in woq for x, w in zip(xs, layer)])
        r["onednn_float32"] = 1e3 * best_seconds(lambda: [
            packed_linear(x, p, None) for layer in kinds["onednn_float32"] for x, p in zip(xs, layer)])
        if bf16:
            r["onednn_bf16"] = 1e3 * best_seconds(lambda: [
                packed_linear(x.bfloat16(), p, None).float() for layer in kinds["onednn_bf16"] for x, p in zip(xs, layer)])
        rows.append(r)
    return rows


def attention_rates(cfg, lengths: list[int]) -> list[dict]:
    """Per prompt length L: one layer's prefill attention over a whole prompt (n = L, causal) in the
    kernels the engine chooses among: qtk's flash kernel (csrc/cpu_attention.cpp) in bf16 math (where
    the CPU has AVX512-BF16) and in float32 math (AVX-512), and torch's float32 flash kernel (sdpa, the
    path without AVX-512), in ms and GFLOP/s (4 * heads * head_dim per (query, key) pair, causal:
    L (L + 1) / 2 pairs)."""
    import torch.nn.functional as F

    lib = cpu_kernels.ops()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    runs = lib is not None and hasattr(lib, "prefill_attention_runs")
    maths = [name for name, bf16 in (("bf16", True), ("float32", False)) if runs and lib.prefill_attention_runs(bf16=bf16)]
    rows = []
    for length in lengths:
        q, k, v = torch.randn(length, heads, d), torch.randn(kv, length, d), torch.randn(kv, length, d)
        slots, flops = torch.arange(length), 4 * heads * d * length * (length + 1) / 2
        r = {"prompt_len": length}
        torch_s = best_seconds(lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=d ** -0.5, enable_gqa=kv != heads))
        r["torch_float32_ms"], r["torch_float32_gflops"] = 1e3 * torch_s, flops / torch_s / 1e9
        for math in maths:
            qtk_s = best_seconds(lambda: lib.prefill_attention(q, k, v, slots, 0, d ** -0.5, bf16=math == "bf16"))
            r[f"qtk_{math}_ms"], r[f"qtk_{math}_gflops"] = 1e3 * qtk_s, flops / qtk_s / 1e9
        rows.append(r)
    return rows


def flops_per_token(cfg, length: int) -> tuple[float, float]:
    """(the linear layers' and the lm_head's, attention's) FLOPs per prompt token of a prompt of `length`."""
    h, heads, layers = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    d = getattr(cfg, "head_dim", None) or h // heads
    linear = 2 * sum(k * n for k, n in layer_shapes(cfg)) * layers
    attention = 4 * heads * d * (length + 1) / 2 * layers
    return linear + 2 * h * cfg.vocab_size / length, attention


def matmul_dtypes(model) -> tuple[str, str]:
    """The dtypes of the peaks a runtime model's prefill is held to: (its many-row matmuls': int8 for W8A8
    layers, else bf16 where its steps run in bf16 (packed_linear.steps_in_bf16), else float32; its
    attention's: bf16 where its steps run in bf16, else float32)."""
    from qtk.runtime.packed_linear import W8A8Linear, steps_in_bf16

    attention = "bfloat16" if steps_in_bf16(model) else "float32"
    return "int8" if any(isinstance(m, W8A8Linear) for m in model.modules()) else attention, attention


def prefill(model: str, length: int, n: int, force_float32: bool, repeats: int) -> dict:
    from qtk import LLM, SamplingParams
    from qtk.bench.prompts import PromptSet, token_prompts
    from qtk.runtime.packed_linear import kernel_summary

    if force_float32:
        os.environ["QTK_CPU_BF16"] = "0"
    try:
        llm = LLM(model, enable_prefix_caching=False)
        prompts = token_prompts(llm.tokenizer, PromptSet.parse(f"fixed:{length}"), n + 2)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        seconds = best_seconds(lambda: llm.generate(prompts[2:], params), repeats=repeats)  # after a warm-up run
        kernels, (dtype, attention_dtype) = kernel_summary(llm.model), matmul_dtypes(llm.model)
    finally:
        os.environ.pop("QTK_CPU_BF16", None)
    cfg = llm.model.config
    del llm
    linear, attention = flops_per_token(cfg, length)
    return {"prompt_len": length, "prompts": n, "seconds": seconds, "tokens_per_s": n * length / seconds,
            "flops_per_token": linear + attention, "linear_flops_per_token": linear,
            "attention_flops_per_token": attention, "kernels": kernels, "matmul_dtype": dtype,
            "attention_dtype": attention_dtype}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default="256,1024", help="prompt lengths, comma-separated")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="prefill runs per (checkpoint, length): the best is kept")
    p.add_argument("--quantized", default="", help="checkpoints of the model to prefill too, comma-separated")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoConfig

    from qtk.loading import resolve

    cfg = AutoConfig.from_pretrained(resolve(a.model))
    shapes, bf16 = layer_shapes(cfg), cpu_has_native_bf16()
    int8 = cpu_has_int8_dot() and cpu_kernels.variant() == "avx512"
    peak, probes = matmul_peak(shapes, [torch.float32] + ([torch.bfloat16] if bf16 else []), int8)
    print("matmul peak (model shapes, in cache): " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()))
    cross = crossover(shapes, cfg.num_hidden_layers, [1, 2, 4, 5, 8, 10, 12, 16, 20, 24, 32, 64, 80, 128, 256], bf16)
    print("\n| rows | " + " | ".join(k for k in cross[0] if k != "m") + " |  (ms per pass over the decoder layers)")
    for r in cross:
        print(f"| {r['m']} | " + " | ".join(f"{v:.1f}" for k, v in r.items() if k != "m") + " |")
    lengths = [int(x) for x in a.prompts.split(",")]
    attention = attention_rates(cfg, sorted(set(lengths + [4096])))
    print("\n| prompt tokens | " + " | ".join(k for k in attention[0] if k != "prompt_len") + " |  (one layer's attention)")
    for r in attention:
        print(f"| {r['prompt_len']} | " + " | ".join(f"{v:.1f}" for k, v in r.items() if k != "prompt_len") + " |")
    runs = []
    checkpoints = [(a.model, force) for force in ([False, True] if bf16 else [False])]
    checkpoints += [(q, False) for q in a.quantized.split(",") if q]
    for length in lengths:
        for model, force in checkpoints:
            r = prefill(model, length, a.num_prompts, force, a.repeats)
            r["model"] = model
            r["gflops"] = r["tokens_per_s"] * r["flops_per_token"] / 1e9
            dtypes = {r["matmul_dtype"], r["attention_dtype"]}
            r["peak_beside"] = {d: probes[d]() for d in dtypes if d in probes}  # the peak timed again, now
            r["of_peak"] = r["gflops"] / peak[r["matmul_dtype"]] if r["matmul_dtype"] in peak else None
            beside = r["peak_beside"].get(r["matmul_dtype"])
            r["of_peak_beside"] = r["gflops"] / beside if beside else None
            # the time the CPU at its peaks (timed beside) would take, each op at its own dtype's (W8A8: the
            # layers int8, attention bf16), over the time taken
            if dtypes <= r["peak_beside"].keys():
                ideal = (r["linear_flops_per_token"] / r["peak_beside"][r["matmul_dtype"]] +
                         r["attention_flops_per_token"] / r["peak_beside"][r["attention_dtype"]]) / 1e9
                r["of_roofline"] = r["tokens_per_s"] * ideal
            else:
                r["of_roofline"] = None
            runs.append(r)
    print("\n| model | prompt tokens | many-row matmuls | attention | prefill tok/s | GFLOP/s | of the matmuls' "
          "dtype's peak | of that peak timed beside | of the roofline, each op at its dtype's peak timed beside |")
    print("|---|---|---|---|---|---|---|---|---|")
    share = lambda x: "" if x is None else f"{x:.0%}"  # noqa: E731
    for r in runs:
        print(f"| {r['model']} | {r['prompt_len']} | {r['matmul_dtype']} | {r['attention_dtype']} | "
              f"{r['tokens_per_s']:.0f} | {r['gflops']:.0f} | {share(r['of_peak'])} | {share(r['of_peak_beside'])} | "
              f"{share(r['of_roofline'])} |")
    result = {"command": "python benchmarks/prefill_peak.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
              "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": bf16, "threads": a.threads,
              "torch": torch.__version__, "model": a.model, "matmul_peak_gflops": peak, "crossover_ms": cross,
              "attention": attention, "prefill": runs}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result["capability"].lower() + ("-bf16" if bf16 else "")
    stem = f"prefill-peak-{Path(a.model).name}-{tag}-{datetime.date.today()}-{result['commit'][:7]}"
    path, n = out / f"{stem}.json", 2
    while path.exists():  # a repeat run of the same commit keeps the earlier ones
        path, n = out / f"{stem}-run{n}.json", n + 1
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
