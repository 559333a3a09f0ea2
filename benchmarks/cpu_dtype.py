"""Which dtype and which weight op is fast on this CPU: the measurements behind qtk.device and the CPU
rows of qtk/kernels/dispatch.py (protocol: docs/benchmarks.md, "CPU choices").

    python benchmarks/cpu_dtype.py [--threads 2] [--out benchmarks/results]

Times (median of repeats, after a warm-up), on the bundled model's shapes (hidden 576, intermediate
1536, 9 heads / 3 KV heads of 64):
  matmul       a dense [4096, 576] @ [576, 1536] in float32 and in bf16 (GFLOP/s)
  hessian      GPTQ's H += X^T X for 4096 tokens x 576: float32, and float32 on bf16 units
               (oneDNN fp32_precision="bf16", what the bf16 calibration path uses)
  w4a16/w8a16  one quantized Linear (N=1536, K=576, int4 g64 / int8 per channel) at M = 1, 16, 512,
               4096 tokens by each CPU path: torch's int4/int8 weight ops in bf16 and float32, and the
               reference (a float32 matmul on the cached decoded weight)
  w8a8         the same Linear as W8A8 int8: torch._int_mm with per-token activation quantization,
               against the float32 matmul on the decoded weight
  attention    causal attention over 8 x 512 and 1 x 2048 tokens: sdpa and qtk's query chunks, in
               float32 and bf16
  block        one decoder block of the bundled model over 8 x 512 tokens, float32 and bf16
The JSON (command, commit, CPU flags, torch version, date, figures) goes to OUT/cpu_dtype-<cpu>.json
and a table to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qtk.chunked_sdpa import chunked_causal_attention
from qtk.device import cpu_bf16_reason
from qtk.kernels.dispatch import CpuInt4, CpuInt8, CpuW8A8Int, Dense, build_runtime
from qtk.methods.gptq import accumulate_upper, bf16_products
from qtk.quant import quantize_weight
from qtk.quant_linear import QuantLinear
from qtk.schemes import preset

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def timed(fn, min_seconds: float = 0.3, repeats: int = 5) -> float:
    """Median seconds per call: one warm-up, then `repeats` rounds of enough calls for min_seconds."""
    fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-6)
    calls = max(1, int(min_seconds / once))
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls)
    return statistics.median(rounds)


def bench_matmul(rows):
    a32, b32 = torch.randn(4096, HIDDEN), torch.randn(HIDDEN, INTER)
    flops = 2 * 4096 * HIDDEN * INTER
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = a32.to(dt), b32.to(dt)
        s = timed(lambda: a @ b)
        rows.append({"bench": "matmul", "case": f"4096x576 @ 576x1536 {name}", "ms": s * 1e3, "gflops": flops / s / 1e9})


def bench_hessian(rows):
    x = torch.randn(4096, HIDDEN).bfloat16().float()  # bf16 values, as a bf16 block's activations are
    H = torch.zeros(HIDDEN, HIDDEN)
    for name, on in (("float32", False), ("float32 on bf16 units", True)):
        def step():
            with bf16_products(on):
                accumulate_upper(H, x)
        s = timed(step)
        rows.append({"bench": "hessian", "case": f"4096 tokens x 576 {name}", "ms": s * 1e3})


def quant_layer(scheme_name: str, group: int | None) -> QuantLinear:
    torch.manual_seed(0)
    w = torch.randn(INTER, HIDDEN) * 0.02
    scheme = preset(scheme_name, group)
    q, s, z = quantize_weight(w, scheme.weights)
    return QuantLinear.from_codes(q, s, z, scheme)


def bench_weight_only(rows):
    for label, layer in (("w4a16 g64", quant_layer("w4a16", 64)), ("w8a16 channel", quant_layer("w8a16", None))):
        for m in (1, 16, 512, 4096):
            x32 = torch.randn(m, HIDDEN)
            ref32 = layer.dequantized_weight(torch.float32)
            paths = {"reference float32 (decoded weight)": lambda: F.linear(x32, ref32)}
            for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "float32")):
                rt = build_runtime_forced(layer, dt)
                if rt is not None:
                    x = x32.to(dt)
                    paths[f"torch {type(rt).__name__} {tag}"] = lambda rt=rt, x=x: rt(x)
            xb = x32.bfloat16()
            refb = layer.dequantized_weight(torch.bfloat16)
            paths["dense bf16 (decoded weight)"] = lambda: F.linear(xb, refb)
            for name, fn in paths.items():
                s = timed(fn, min_seconds=0.2)
                rows.append({"bench": label, "case": f"M={m} {name}", "m": m, "path": name, "ms": s * 1e3})


def build_runtime_forced(layer, dtype):
    """torch's CPU weight op for `layer` in `dtype`, whatever dispatch would choose (None if none applies)."""
    args = layer.scheme.weights
    codes, zp = layer.codes(), layer.zero_point()
    n = codes.shape[0]
    if args.num_bits == 4:
        u = (codes.to(torch.int32) + 8).contiguous()
        s = layer.weight_scale.float().reshape(n, -1).t()
        z = torch.zeros_like(s) if zp is None else -zp.float().reshape(n, -1).t() * s
        sz = torch.stack([s, z], dim=-1).to(dtype).contiguous()
        return CpuInt4(torch._convert_weight_to_int4pack_for_cpu(u, 1), sz, args.group_size, None, None)
    s = layer.weight_scale.reshape(-1).to(dtype).expand(n).contiguous()
    return CpuInt8(codes.contiguous(), s, None)


def bench_w8a8(rows):
    layer = quant_layer("w8a8", None)
    cpu = torch.device("cpu")
    with forced_capability("QTK_CPU_VNNI", "1"):
        int_mm = build_runtime(layer, cpu, torch.float32)
    with forced_capability("QTK_CPU_VNNI", "0"):
        dense = build_runtime(layer, cpu, torch.float32)
    assert isinstance(int_mm, CpuW8A8Int) and isinstance(dense, Dense), (int_mm, dense)
    for m in (1, 16, 512, 4096):
        x = torch.randn(m, HIDDEN)
        for name, fn in (("torch._int_mm + per-token act quant", lambda: int_mm(x)),
                         ("Dense: act fake-quant + float32 matmul (decoded weight)", lambda: dense(x))):
            s = timed(fn, min_seconds=0.2)
            rows.append({"bench": "w8a8 int8", "case": f"M={m} {name}", "m": m, "path": name, "ms": s * 1e3})


@contextlib.contextmanager
def forced_capability(var: str, value: str):
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[var]
        else:
            os.environ[var] = saved


class _Attn:
    is_causal = True


def bench_attention(rows):
    for b, L in ((8, 512), (1, 2048)):
        q32 = torch.randn(b, HEADS, L, HEAD_DIM)
        k32, v32 = torch.randn(b, KV_HEADS, L, HEAD_DIM), torch.randn(b, KV_HEADS, L, HEAD_DIM)
        for dt, tag in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
            q, k, v = q32.to(dt), k32.to(dt), v32.to(dt)
            paths = {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                "qtk chunked": lambda: chunked_causal_attention(_Attn(), q, k, v, None, scaling=HEAD_DIM ** -0.5),
            }
            for name, fn in paths.items():
                s = timed(fn, min_seconds=0.2, repeats=3)
                rows.append({"bench": "attention", "case": f"{b}x{L} {tag} {name}", "ms": s * 1e3})


def bench_block(rows):
    from qtk.chunked_sdpa import chunked_attention
    from qtk.loading import BUNDLED, load_model

    model, _ = load_model(BUNDLED, dtype=torch.float32)
    layer = model.model.layers[0]
    x32 = torch.randn(8, 512, HIDDEN)
    pos = torch.arange(512)[None].expand(8, -1)
    for dt, tag in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        model.to(dt)
        x = x32.to(dt)
        emb = model.model.rotary_emb(x, pos)
        with torch.no_grad(), chunked_attention(model):
            s = timed(lambda: layer(x, position_embeddings=emb, attention_mask=None), min_seconds=0.5, repeats=3)
        rows.append({"bench": "block", "case": f"decoder block, 8 x 512 tokens {tag}", "ms": s * 1e3})


def cpu_info() -> dict:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    native, why = cpu_bf16_reason()
    return {"model": model, "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native,
            "why": why, "avx512_flags": sorted({f for f in flags.split() if f.startswith(("avx512", "amx"))})}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--only", default="matmul,hessian,weight_only,w8a8,attention,block")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows: list[dict] = []
    benches = {"matmul": bench_matmul, "hessian": bench_hessian, "weight_only": bench_weight_only,
               "w8a8": bench_w8a8, "attention": bench_attention, "block": bench_block}
    for name in a.only.split(","):
        benches[name](rows)
        for r in rows:
            if "_printed" not in r:
                print(f"{r['bench']:<14} {r['case']:<60} {r['ms']:>10.3f} ms" + (f"  {r['gflops']:.1f} GFLOP/s" if "gflops" in r else ""),
                      flush=True)
                r["_printed"] = True
    for r in rows:
        r.pop("_printed", None)
    cpu = cpu_info()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "commit": commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "threads": a.threads, "cpu": cpu, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "bf16" if cpu["native_bf16"] else "no-bf16"
    path = out / f"cpu_dtype-{cpu['capability'].lower()}-{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
