"""Survey of CPU weight-only-quantized GEMV/GEMM kernels callable from PyTorch.

Measures, in one process and interleaved with a plain float32
``torch.nn.functional.linear(x, W)``, every candidate kernel for W4A16 (int4,
group 64) and W8A16 (int8 per-channel) on the SmolLM2-135M linear shapes, and
reports ratio = candidate median time / fp32 median time (lower is better).

Run (survey venv, see benchmarks/results/cpu_kernel_survey.md):

    /tmp/survey-venv/bin/python benchmarks/cpu_kernel_survey.py [--reps 50] [--compile]

Single-threaded on purpose (torch.set_num_threads(1), OMP_NUM_THREADS=1 for
libraries with their own OpenMP runtime). Optional libraries (torchao,
bitsandbytes, auto_round_kernel) are skipped when not importable.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # must precede imports of OpenMP libs

import argparse
import json
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
MS = [1, 4, 16]
GROUP = 64


# ----------------------------------------------------------------- reference quantizers
def quant_int4_sym(W, g=GROUP):
    N, K = W.shape
    Wg = W.view(N, K // g, g)
    s = (Wg.abs().amax(-1, keepdim=True) / 7.0).clamp(min=1e-8)
    q = torch.clamp(torch.round(Wg / s), -8, 7)
    return q.view(N, K).to(torch.int8), s.view(N, K // g), (q * s).view(N, K)


def quant_int4_asym(W, g=GROUP):
    N, K = W.shape
    Wg = W.view(N, K // g, g)
    lo, hi = Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True)
    s = ((hi - lo) / 15.0).clamp(min=1e-8)
    zp = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(Wg / s) + zp, 0, 15)
    deq = ((q - zp) * s).view(N, K)
    return q.view(N, K).to(torch.uint8), s.view(N, K // g), zp.view(N, K // g), deq


def quant_int8_perchannel(W):
    s = (W.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-8)
    q = torch.clamp(torch.round(W / s), -128, 127)
    return q.to(torch.int8), s.view(-1), q * s


def rel_err(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------- candidate builders
# Each builder returns a list of (name, fn(x_fp32) -> y, ref_weight_fp32 or None, note)
# ref_weight is the dequantized weight the kernel should reproduce; x is fp32 and
# candidates that need bf16 cast inside fn (the cast is part of the timed call).


def build_torch_ops(W, notes):
    out = []
    N, K = W.shape
    # --- aten._weight_int4pack_mm_for_cpu (tinygemm scheme: w = (q-8)*s + z, z float)
    q, s, zp, deq_a = quant_int4_asym(W)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    z = (8.0 - zp) * s  # so (q-8)*s + z == (q-zp)*s
    sz32 = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/g, N, 2]
    szbf = sz32.to(torch.bfloat16)
    out.append(("aten int4pack asym g64 fp32-act",
                lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz32), deq_a, ""))
    # bf16 activations + bf16 scales/zeros: reference uses bf16-rounded scale/zero
    deq_a_bf = ((q.float() - 8).view(N, K // GROUP, GROUP) * szbf[..., 0].float().t()[..., None]
                + szbf[..., 1].float().t()[..., None]).view(N, K)
    out.append(("aten int4pack asym g64 bf16-act",
                lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, szbf),
                deq_a_bf, "bf16"))
    # symmetric int4 through the same kernel (zero = 0, q+8 stored)
    qs, ss, deq_s = quant_int4_sym(W)
    packed_s = torch.ops.aten._convert_weight_to_int4pack_for_cpu((qs.to(torch.int32) + 8), 1)
    szs = torch.stack([ss.t(), torch.zeros_like(ss.t())], dim=-1).contiguous()
    out.append(("aten int4pack sym g64 fp32-act",
                lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed_s, GROUP, szs), deq_s, ""))
    # --- aten._weight_int8pack_mm (int8 per-channel, scales same dtype as x)
    q8, s8, deq8 = quant_int8_perchannel(W)
    s8bf = s8.to(torch.bfloat16)
    deq8_bf = q8.float() * s8bf.float()[:, None]
    out.append(("aten int8pack per-ch fp32-act",
                lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8), deq8, ""))
    out.append(("aten int8pack per-ch bf16-act",
                lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8bf), deq8_bf, "bf16"))
    # --- fbgemm (quantized engine) references: not W4A16, shown for context
    try:
        torch.backends.quantized.engine = "fbgemm"
        wq = torch.quantize_per_channel(W, s8.double(), torch.zeros(N, dtype=torch.long), 0, torch.qint8)
        pk = torch.ops.quantized.linear_prepack(wq, None)
        out.append(("fbgemm dyn-int8 act, int8 per-ch W (W8A8)",
                    lambda x: torch.ops.quantized.linear_dynamic(x, pk, True), deq8, "W8A8 dynamic"))
        pk16 = torch.ops.quantized.linear_prepack_fp16(W, None)
        out.append(("fbgemm fp16 weight (W16A32)",
                    lambda x: torch.ops.quantized.linear_dynamic_fp16(x, pk16), W.half().float(), "fp16 weight"))
    except Exception as e:  # pragma: no cover
        notes.append(f"fbgemm: {e!r}"[:200])
    return out


def build_torchao(W, notes):
    out = []
    try:
        import torchao  # noqa: F401
        from torchao.quantization import quantize_, Int8WeightOnlyConfig, Int4WeightOnlyConfig
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    except Exception as e:
        notes.append(f"torchao import failed: {e!r}"[:200])
        return out
    N, K = W.shape

    def mk():
        lin = torch.nn.Linear(K, N, bias=False)
        lin.weight.data.copy_(W)
        return lin

    # Int4 prototype (CPU, Int4OpaqueTensor -> aten._weight_int4pack_mm_for_cpu)
    try:
        lin = mk()
        quantize_(lin, PrototypeInt4WeightOnlyConfig(group_size=GROUP))
        # Int4OpaqueTensor has no dequantize(); recover its dequantized weight by
        # feeding the identity through the same layer (exact in fp32).
        with torch.no_grad():
            deq = lin(torch.eye(K)).t().float().contiguous()
        out.append(("torchao Int4 prototype g64 fp32-act", lambda x, lin=lin: lin(x), deq, ""))
        linb = mk().to(torch.bfloat16)
        quantize_(linb, PrototypeInt4WeightOnlyConfig(group_size=GROUP))
        with torch.no_grad():
            deqb = linb(torch.eye(K, dtype=torch.bfloat16)).t().float().contiguous()
        out.append(("torchao Int4 prototype g64 bf16-act",
                    lambda x, lin=linb: lin(x.to(torch.bfloat16)), deqb, "bf16; ref via identity in bf16"))
    except Exception as e:
        notes.append(f"torchao PrototypeInt4WeightOnlyConfig: {e!r}"[:300])
    # Int4WeightOnlyConfig (non-prototype, default PLAIN packing)
    try:
        lin = mk()
        quantize_(lin, Int4WeightOnlyConfig(group_size=GROUP))
        lin(torch.randn(1, K))
        out.append(("torchao Int4WeightOnlyConfig g64 fp32-act", lambda x, lin=lin: lin(x),
                    lin.weight.dequantize().float(), ""))
    except Exception as e:
        notes.append(f"torchao Int4WeightOnlyConfig(PLAIN) on CPU: {type(e).__name__}: {e}"[:300])
    # Int8 weight-only per-row
    try:
        lin = mk()
        quantize_(lin, Int8WeightOnlyConfig())
        out.append(("torchao Int8WeightOnly per-ch fp32-act", lambda x, lin=lin: lin(x),
                    lin.weight.dequantize().float(), ""))
    except Exception as e:
        notes.append(f"torchao Int8WeightOnlyConfig: {e!r}"[:300])
    return out


def build_bnb(W, notes):
    out = []
    try:
        import logging

        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes as bnb
        import bitsandbytes.functional as BF
    except Exception as e:
        notes.append(f"bitsandbytes import failed: {e!r}"[:200])
        return out
    for qt in ("nf4", "fp4"):
        try:
            packed, st = BF.quantize_4bit(W, blocksize=GROUP, quant_type=qt, compress_statistics=False)
            deq = BF.dequantize_4bit(packed, st).float()
            out.append((f"bnb {qt} blocksize64 fp32-act",
                        lambda x, p=packed, st=st: bnb.matmul_4bit(x, p.t(), st), deq, f"{qt} codebook"))
        except Exception as e:
            notes.append(f"bnb {qt}: {e!r}"[:300])
    try:
        lin = bnb.nn.Linear8bitLt(W.shape[1], W.shape[0], bias=False, has_fp16_weights=False, threshold=0.0)
        lin.weight = bnb.nn.Int8Params(W.clone(), requires_grad=False, has_fp16_weights=False)
        lin = lin.to("cpu")  # triggers int8 quantization of the weight
        lin.eval()
        wq = lin.weight
        scb = getattr(wq, "SCB", None)
        deq = (wq.data.float() * scb.float()[:, None] / 127.0) if scb is not None else None
        out.append(("bnb LLM.int8 Linear8bitLt (threshold 0)", lambda x, lin=lin: lin(x), deq,
                    "int8 act x int8 W"))
    except Exception as e:
        notes.append(f"bnb Linear8bitLt: {type(e).__name__}: {e}"[:300])
    return out


def build_ark(W, notes):
    out = []
    try:
        import auto_round_kernel as ark
    except Exception as e:
        notes.append(f"auto_round_kernel import failed: {e!r}"[:200])
        return out
    N, K = W.shape
    empty_bias = torch.empty(0)
    try:
        qs, ss, deq_s = quant_int4_sym(W)
        blob_s = ark.repack_quantized_weight(qs.t().contiguous(), ss.t().contiguous(),
                                             torch.empty(0, dtype=torch.int8), GROUP, "auto", "int4", "fp32", False)
        out.append(("ARK int4 sym g64 fp32-act",
                    lambda x: ark.woqgemm(x, blob_s, empty_bias, N, K, GROUP, "auto", "int4", "fp32", False),
                    deq_s, ""))
        q, s, zp, deq_a = quant_int4_asym(W)
        blob_a = ark.repack_quantized_weight((q.to(torch.int32) - 8).to(torch.int8).t().contiguous(),
                                             s.t().contiguous(), (zp - 8).to(torch.int8).t().contiguous(),
                                             GROUP, "auto", "int4", "fp32", True)
        out.append(("ARK int4 asym g64 fp32-act",
                    lambda x: ark.woqgemm(x, blob_a, empty_bias, N, K, GROUP, "auto", "int4", "fp32", True),
                    deq_a, ""))
    except Exception as e:
        notes.append(f"ARK int4: {type(e).__name__}: {e}"[:300])
    try:
        q8, s8, deq8 = quant_int8_perchannel(W)
        blob8 = ark.repack_quantized_weight(q8.t().contiguous(), s8[None, :].contiguous(),
                                            torch.empty(0, dtype=torch.int8), K, "auto", "int8", "fp32", False)
        out.append(("ARK int8 per-ch fp32-act",
                    lambda x: ark.woqgemm(x, blob8, empty_bias, N, K, K, "auto", "int8", "fp32", False), deq8, ""))
        out.append(("ARK woqgemm_s8 per-ch fp32-act", lambda x: ark.woqgemm_s8(x, q8, s8), deq8, ""))
    except Exception as e:
        notes.append(f"ARK int8: {type(e).__name__}: {e}"[:300])
    return out


def build_compile(W, notes):
    """torch.compile of an explicit unpack+dequant+GEMV (inductor C++ codegen, AVX2)."""
    out = []
    N, K = W.shape
    qs, ss, deq_s = quant_int4_sym(W)
    u = (qs.to(torch.int16) + 8).to(torch.uint8).view(N, K // 2, 2)
    packed = (u[..., 0] | (u[..., 1] << 4)).contiguous()  # [N, K/2] uint8
    scales = ss.contiguous()

    def woq(x, packed, scales):
        lo = (packed & 0xF).to(torch.float32) - 8.0
        hi = (packed >> 4).to(torch.float32) - 8.0
        w = torch.stack([lo, hi], dim=-1).view(N, K // GROUP, GROUP) * scales[..., None]
        return (x[:, None, :] * w.view(N, K)[None]).sum(-1)

    try:
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = 64  # one graph per (shape, M)
        dynamo.config.cache_size_limit = 64
        f = torch.compile(woq, dynamic=False)
        out.append(("torch.compile unpack+dequant+GEMV int4 sym g64 fp32",
                    lambda x: f(x, packed, scales), deq_s, "inductor"))
    except Exception as e:
        notes.append(f"torch.compile: {e!r}"[:300])
    return out


# ----------------------------------------------------------------- timing
def bench_case(W, M, cands, reps, warmup=5, slow_s=0.15):
    """Interleaved timing: each repeat calls fp32 then every candidate once."""
    K = W.shape[1]
    torch.manual_seed(1)
    x = torch.randn(M, K)
    fns = [("fp32 F.linear", lambda x: F.linear(x, W), W, "")] + list(cands)
    res = {}
    alive = []
    for name, fn, ref_w, note in fns:
        try:
            with torch.no_grad():
                fn(x)  # first call: compilation / lazy init, not timed
                t0 = time.perf_counter()
                for _ in range(warmup):
                    y = fn(x)
                per = (time.perf_counter() - t0) / warmup
            err = rel_err(y, x @ ref_w.t()) if ref_w is not None else float("nan")
            alive.append((name, fn, per))
            res[name] = {"err": err, "times": [], "note": note}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300], "note": note}
    # very slow candidates (scalar fallbacks on lm_head) get fewer repeats, flagged
    with torch.no_grad():
        for r in range(reps):
            for name, fn, per in alive:
                if per > slow_s and r >= 11:
                    continue
                t0 = time.perf_counter_ns()
                fn(x)
                res[name]["times"].append(time.perf_counter_ns() - t0)
    base = statistics.median(res["fp32 F.linear"]["times"])
    for name, d in res.items():
        if "times" in d:
            med = statistics.median(d["times"])
            d["median_us"] = med / 1e3
            d["ratio"] = med / base
            d["n"] = len(d["times"])
            del d["times"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd dequant GEMV")
    ap.add_argument("--shapes", default="all", help="comma list of NxK, e.g. 576x576,49152x576")
    ap.add_argument("--ms", default="1,4,16", help="comma list of M (tokens)")
    ap.add_argument("--only-compile", action="store_true", help="time only fp32 and the compiled GEMV")
    ap.add_argument("--json", default=None, help="write raw results here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    vers = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.processor()}
    for mod in ("torchao", "bitsandbytes", "auto_round_kernel"):
        try:
            __import__(mod)
            from importlib.metadata import version

            vers[mod] = version({"auto_round_kernel": "auto-round-lib"}.get(mod, mod))
        except Exception as e:
            vers[mod] = f"unavailable ({type(e).__name__})"
    print(json.dumps(vers))

    allres = {"versions": vers, "cases": []}
    for N, K in shapes:
        W = torch.randn(N, K) * 0.02
        notes = []
        if args.only_compile:
            cands = []
        else:
            cands = build_torch_ops(W, notes) + build_torchao(W, notes) + build_bnb(W, notes) + build_ark(W, notes)
        if args.compile or args.only_compile:
            cands += build_compile(W, notes)
        for note in notes:
            print(f"  note [{N}x{K}]: {note}")
        for M in [int(v) for v in args.ms.split(",")]:
            res = bench_case(W, M, cands, args.reps)
            allres["cases"].append({"N": N, "K": K, "M": M, "results": res, "notes": notes})
            print(f"== N={N} K={K} M={M}  fp32 median {res['fp32 F.linear']['median_us']:.1f} us")
            for name, d in res.items():
                if "error" in d:
                    print(f"   {name:48s}  ERROR {d['error']}")
                else:
                    flag = "" if d["n"] >= args.reps else f" (n={d['n']})"
                    print(f"   {name:48s} ratio {d['ratio']:7.2f}  {d['median_us']:10.1f} us  "
                          f"relerr {d['err']:.2e}{flag}")
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(allres, fh, indent=1)


if __name__ == "__main__":
    main()
