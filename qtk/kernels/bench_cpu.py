"""`qtk bench kernels --device cpu`: qtk's CPU weight-only kernels on a model's layer shapes against
the float32 matmul the engine would otherwise run, and against the machine's copy bandwidth.

For each layer (K x N) and M: the median time of
    fp32      the engine's float32 path: oneDNN's packed matmul (dispatch.cpu_packed_weight) where
              oneDNN is there, else F.linear, on float32 weights;
    int4      qtk_cpu.woq_linear, int4 asymmetric codes in groups of 64 (the default recipe's);
    read      torch's sum over as many bytes as the int4 layer's, out of cache: what merely reading
              that much costs at this size (a small layer never reaches the streaming rate of a
              256 MB copy: the first misses and the prefetchers' ramp dominate);
    int8      qtk_cpu.woq_linear, int8 symmetric per-channel codes;
    deq+mm    decoding the int4 weight to float32 on each call, then F.linear (the naive kernel);
    w8a8      (a build with VNNI) qtk_cpu.w8a8_linear: x quantized per token in the call, int8
              symmetric per-channel weights, VPDPBUSD;
    int_mm    (a build with VNNI) the same layer as torch does it: act_quant_ref + torch._int_mm + scales;
with the weights out of cache as in decoding: each case cycles through copies of its weight that
together exceed the last-level cache several times. GB/s counts the weight side (codes, scales,
zeros) read once per call. The copy bandwidth is measured in the same run: torch's copy_ of a
256 MB float32 buffer, (bytes read + bytes written) / time, as STREAM's Copy. The per-token sum
multiplies each layer by the model's layer count, once as separate layers and once as the engine
runs a weight-only model (q/k/v and gate/up joined: the qkv and gate_up rows); the lm_head is
timed apart, in float32 and as the engine keeps a bf16 checkpoint's (bf16 weights, this kernel).
Writes JSON (command, commit, CPU, versions, date, rows) into --out and prints a table.
"""
from __future__ import annotations

import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..device import cpu_name
from . import cpu
from .bench import git_commit
from .dispatch import cpu_packed_weight, packed_linear
from .reference import act_quant_ref

log = logging.getLogger(__name__)

# name -> (layers per model, [(layer, K, N, count per layer as separate layers, count as the engine runs
# them)], lm_head (K, N)). The engine joins q/k/v and gate/up of a weight-only layer into one call each
# (runtime/packed_linear.WOQLinear), so a decode step runs qkv, o, gate_up and down.
SHAPES = {
    "smollm2-135m": (30, [("q/o", 576, 576, 2, 1), ("k/v", 576, 192, 2, 0), ("gate/up", 576, 1536, 2, 0),
                          ("down", 1536, 576, 1, 1), ("qkv", 576, 960, 0, 1), ("gate_up", 576, 3072, 0, 1)],
                     (576, 49152)),
    "llama3-8b": (32, [("q/o", 4096, 4096, 2, 1), ("k/v", 4096, 1024, 2, 0), ("gate/up", 4096, 14336, 2, 0),
                       ("down", 14336, 4096, 1, 1), ("qkv", 4096, 6144, 0, 1), ("gate_up", 4096, 28672, 0, 1)],
                  (4096, 128256)),
}
CACHE_BYTES = 32 << 20  # rotate through at least 4x this much weight per case (LLC of most servers)


def timed(fn, repeats: int, min_s: float = 0.2) -> float:
    """Median seconds of fn() over `repeats` calls (more while under min_s in all), after a warm-up."""
    fn()
    fn()
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < repeats or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) > 50 * repeats:
            break
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 256 MB float32 copy, counting bytes read and written."""
    src = torch.rand(64 << 20)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / s / 1e9


def _rotating(make, nbytes: int):
    copies = [make() for _ in range(max(1, -(-4 * CACHE_BYTES // max(nbytes, 1))))]
    state = {"i": 0}

    def next_copy():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]
    return next_copy


def bench_shape(k: int, n: int, ms: list[int], lib, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    q4 = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    s4, z4 = torch.rand(n, k // 64, generator=g) * 0.01 + 1e-3, torch.randint(-8, 8, (n, k // 64), generator=g).float()
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, 1, generator=g) * 1e-3
    packed = cpu_packed_weight(w)
    fp32 = _rotating(lambda: cpu_packed_weight(w.clone()) if packed is not None else w.clone(), n * k * 4)
    p4 = cpu.pack(q4, s4, z4, 4)
    int4 = _rotating(lambda: cpu.pack(q4, s4, z4, 4), p4.nbytes)
    p8 = cpu.pack(q8, s8, None, 8)
    int8 = _rotating(lambda: cpu.pack(q8, s8, None, 8), p8.nbytes)
    raw = _rotating(lambda: (q4.clone(), s4.clone(), z4.clone()), n * k + 8 * s4.numel())
    plain = _rotating(lambda: torch.rand(p4.nbytes // 4), p4.nbytes)  # the int4 layer's bytes, as floats
    read_s = timed(lambda: plain().sum(), repeats)
    vnni = lib.compiled_vnni()
    if vnni:
        w8a8 = _rotating(lambda: cpu.pack_w8a8(q8, s8), n * k)
        q8t = _rotating(lambda: q8.clone().t(), n * k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=g)
        f32 = (lambda: packed_linear(x, fp32(), None)) if packed is not None else (lambda: F.linear(x, fp32()))

        def deq_mm():
            q, s, z = raw()
            return F.linear(x, (q.float() - z.repeat_interleave(64, 1)) * s.repeat_interleave(64, 1))

        t = {"fp32": timed(f32, repeats), "int4": timed(lambda: cpu.woq_linear(x, int4(), None, lib), repeats),
             "int8": timed(lambda: cpu.woq_linear(x, int8(), None, lib), repeats),
             "deq+mm": timed(deq_mm, max(3, repeats // 4)), "read": read_s}
        if vnni:
            def int_mm():
                q, sx = act_quant_ref(x, torch.int8, None)
                return torch._int_mm(q, q8t()).float() * sx * s8.reshape(1, -1)

            t["w8a8"] = timed(lambda: cpu.w8a8_linear(x, w8a8(), None, None, lib), repeats)
            t["int_mm"] = timed(int_mm, repeats)
        rows.append({"k": k, "n": n, "m": m, "us": {a: v * 1e6 for a, v in t.items()},
                     "weight_bytes": {"fp32": n * k * 4, "int4": p4.nbytes, "int8": p8.nbytes},
                     "gbps": {"fp32": n * k * 4 / t["fp32"] / 1e9, "int4": p4.nbytes / t["int4"] / 1e9,
                              "int8": p8.nbytes / t["int8"] / 1e9, "read": p4.nbytes / t["read"] / 1e9},
                     "speedup_int4": t["fp32"] / t["int4"], "speedup_int8": t["fp32"] / t["int8"],
                     "int4_vs_deq_mm": t["deq+mm"] / t["int4"]})
        if vnni:
            rows[-1]["speedup_w8a8"] = t["fp32"] / t["w8a8"]
            rows[-1]["w8a8_vs_int_mm"] = t["int_mm"] / t["w8a8"]
            rows[-1]["gbps"]["w8a8"] = n * k / t["w8a8"] / 1e9
    return rows


def run(shapes: str = "smollm2-135m", ms: list[int] | None = None, out: str | Path = "benchmarks/results",
        repeats: int = 30) -> tuple[dict, str]:
    ms = ms or [1, 2, 4, 8, 16, 64, 256]
    name = cpu.variant()
    lib = cpu.ops()
    if lib is None:
        raise SystemExit(f"qtk's CPU kernel is not available here (variant {name}); see the log above")
    layers, model_shapes, (hk, hn) = SHAPES[shapes]
    bw = copy_bandwidth()
    rows = []
    for layer, k, n, count, fused_count in model_shapes:
        for r in bench_shape(k, n, ms, lib, repeats):
            rows.append({"layer": layer, "count": count, "engine_count": fused_count, **r})
            u = r["us"]
            log.info(f"{layer:8s} K={k:5d} N={n:6d} M={r['m']:4d}  fp32 {u['fp32']:9.1f} us  int4 {u['int4']:9.1f} us "
                     f"({r['speedup_int4']:4.2f}x, {r['gbps']['int4']:5.1f} GB/s = {r['gbps']['int4'] / bw:4.0%} of copy, "
                     f"{r['gbps']['int4'] / r['gbps']['read']:4.0%} of a read)  "
                     f"int8 {u['int8']:9.1f} us ({r['speedup_int8']:4.2f}x)  deq+mm {u['deq+mm']:9.1f} us" +
                     (f"  w8a8 {u['w8a8']:8.1f} us ({r['speedup_w8a8']:4.2f}x; int_mm {u['int_mm']:8.1f} us)"
                      if "w8a8" in u else ""))
    head = torch.randn(hn, hk) * 0.02
    head_packed = cpu_packed_weight(head)
    x1 = torch.randn(1, hk)
    head_us = 1e6 * timed(lambda: packed_linear(x1, head_packed, None) if head_packed is not None
                          else F.linear(x1, head), 10)
    head_bf16 = cpu.pack_bf16(head.bfloat16().float())
    head_bf16_us = 1e6 * timed(lambda: cpu.woq_linear(x1, head_bf16, None, lib), 10)
    per_token = {a: sum(r["us"][a] * r["count"] * layers for r in rows if r["m"] == 1) / 1e3
                 for a in ("fp32", "int4", "int8", "w8a8") if a in rows[0]["us"]}
    per_token["int4_engine"] = sum(r["us"]["int4"] * r["engine_count"] * layers for r in rows if r["m"] == 1) / 1e3
    result = {
        "command": " ".join(["qtk", *sys.argv[1:]]) if Path(sys.argv[0]).name == "qtk" else
        f"qtk bench kernels --device cpu --shapes {shapes} --m {','.join(map(str, ms))}",
        "commit": git_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "variant": name,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": shapes,
        "copy_gbps": bw, "lm_head_fp32_us_m1": head_us, "lm_head_bf16_us_m1": head_bf16_us, "decoder_ms_per_token_m1": per_token, "rows": rows,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result["capability"].lower()
    tag = tag if tag == name else f"{tag}-{name}-build"  # e.g. QTK_CPU_KERNEL=avx2 on an AVX-512 CPU
    path = out / f"kernels-cpu-{shapes}-{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    summary = summarize(result) + f"\n\nwrote {path}"
    return result, summary


def summarize(r: dict) -> str:
    vnni = "w8a8" in r["rows"][0]["us"]
    lines = [f"CPU: {r['cpu']} ({r['capability']}, kernel build {r['variant']}, {r['threads']} threads); "
             f"copy bandwidth {r['copy_gbps']:.1f} GB/s",
             "| layer | K x N | M | fp32 us | int4 us | int4 / fp32 speedup | int4 GB/s (% of copy) | "
             "read of the int4 bytes: GB/s (int4 / read) | int8 us | int8 speedup | int4 vs deq+mm |" +
             (" w8a8 us | w8a8 speedup | int_mm us |" if vnni else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if vnni else "")]
    for x in r["rows"]:
        u = x["us"]
        lines.append(f"| {x['layer']} | {x['k']} x {x['n']} | {x['m']} | {u['fp32']:.1f} | {u['int4']:.1f} | "
                     f"{x['speedup_int4']:.2f}x | {x['gbps']['int4']:.1f} ({x['gbps']['int4'] / r['copy_gbps']:.0%}) | "
                     f"{x['gbps']['read']:.1f} ({x['gbps']['int4'] / x['gbps']['read']:.0%}) | "
                     f"{u['int8']:.1f} | {x['speedup_int8']:.2f}x | {x['int4_vs_deq_mm']:.2f}x |" +
                     (f" {u['w8a8']:.1f} | {x['speedup_w8a8']:.2f}x | {u['int_mm']:.1f} |" if vnni else ""))
    t = r["decoder_ms_per_token_m1"]
    lines.append(f"\nDecoder linears per token at M=1: fp32 {t['fp32']:.1f} ms, int4 {t['int4']:.1f} ms "
                 f"({t['fp32'] / t['int4']:.2f}x; {t['int4_engine']:.1f} ms as the engine joins q/k/v and "
                 f"gate/up), int8 {t['int8']:.1f} ms" + (f", w8a8 {t['w8a8']:.1f} ms" if "w8a8" in t else "") +
                 f"; the lm_head adds {r['lm_head_fp32_us_m1'] / 1e3:.1f} ms in float32, "
                 f"{r.get('lm_head_bf16_us_m1', float('nan')) / 1e3:.1f} ms in bf16 through this kernel")
    return "\n".join(lines)
