"""`qtk bench kernels`: the quantized GEMMs on a real model's shapes, by the protocol of
docs/benchmarks.md (Kernels).

For each layer shape (K x N) and M: median time of the kernels replayed from a CUDA graph
(triton.testing.do_bench_cudagraph; the engine's decode steps run captured), and beside it the time
launched from Python (do_bench, the host's launch overhead included), GB/s (weights +
scales + zero points + activations read once, output written once), TFLOP/s (2*M*N*K), the
fraction of the hardware limit max(bytes / HBM bandwidth, FLOPs / peak of the kernel's math), both
measured in the same run (a device-to-device copy; an 8192^3 cuBLAS matmul in each math: the
activation dtype for weight-only kernels, int8 for W8A8, fp8 for FP8, whose tensor cores do twice
bf16's dense ops on sm_89/sm_90; "-" where that peak cannot be measured), and the speedup over
torch.matmul in the activation dtype on the dequantized weight. Inputs are random and never all zero. The
W8A8 / FP8 rows time what a layer runs: activation quantization plus the GEMM. Writes JSON
(command, git commit, device, versions, date, figures) into the out dir and prints a table.
"""
from __future__ import annotations

import datetime
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.testing

from ..kernels.act_quant import act_quant
from ..kernels.common import sm_count
from ..kernels.fp8 import Fp8Backend, fp8_gemm, fp8_supported, scaled_mm_applies
from ..kernels.layout import dequant_woq, pack_woq
from ..kernels.w4a16 import woq_config, woq_gemm
from ..kernels.w8a8 import int8_gemm
from . import git_commit

log = logging.getLogger(__name__)

# name -> [(layer, K, N)]
SHAPES = {
    "llama3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MATH = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class Row:
    shape: str
    k: int
    n: int
    m: int
    kernel: str
    us: float
    gbps: float
    tflops: float
    limit_fraction: float | None  # None: the peak of the kernel's math is unknown here
    speedup_vs_matmul: float
    matmul_us: float
    max_rel_err: float
    us_eager: float  # us, matmul_us: CUDA-graph replay (the kernels alone); this: launched from Python


@dataclass
class Case:
    """One kernel on one weight: fn(x) -> y, the bytes of its weight side, the dense twin, and the
    math its GEMM runs in (a key of the run's peaks: "bf16", "fp16", "int8", "fp8")."""
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    weight_bytes: int
    dense: torch.Tensor  # W^T [K, N] in the activation dtype
    math: str


def median_us(fn: Callable[[], object], graph: bool = False) -> float:
    """Median microseconds of fn on the GPU: replayed from a CUDA graph (graph=True: the kernels
    alone, as the engine's captured decode steps run them), or launched from Python each time (the
    host's launch overhead included, as an eager step pays it; at small M that overhead is most of
    the time: on the first H200 run, 60-200 us a call for work of a few us)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn: Callable[[], object], name: str) -> float | None:
    """median_us(fn, graph=True), or None (logged) where fn cannot be captured."""
    try:
        return median_us(fn, graph=True)
    except RuntimeError as e:
        log.warning("%s: not capturable in a CUDA graph (%s); its row times the eager launch", name, e)
        return None


def hbm_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (median_us(lambda: dst.copy_(src)) * 1e-6)


def matmul_peak(device, math: str) -> float | None:
    """Op/s of an 8192^3 cuBLAS matmul in `math`: a @ b for "bf16" / "fp16", torch._int_mm (int32
    accumulation) for "int8", torch._scaled_mm (e4m3, unit per-tensor scales, bf16 out) for "fp8".
    Each math is its own peak: int8 (sm_80+) and fp8 (sm_89+) tensor cores do twice bf16's dense
    ops (H100 SXM: 1979 vs 989 T), so bf16's would overstate those kernels' fraction of the limit 2x.
    None (logged) where torch or the GPU cannot run that matmul: no row gets a made-up fraction."""
    n = 8192
    if math in DTYPES:
        a, b = (torch.randn(n, n, device=device, dtype=DTYPES[math]) for _ in range(2))

        def mm():
            return a @ b
    elif math == "int8":  # w [N, K] as a layer's weight, a @ w^T as the W8A8 / FP8 kernels
        a, w = (torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device) for _ in range(2))

        def mm():
            return torch._int_mm(a, w.t())
    elif math == "fp8":
        a, w = (torch.randn(n, n, device=device).to(torch.float8_e4m3fn) for _ in range(2))
        one = torch.ones((), device=device)

        def mm():
            return torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown math {math!r}; choose one of {sorted(DTYPES)}, int8, fp8")
    try:
        mm()
    except RuntimeError as e:
        log.warning("no %s matmul peak on this GPU (%s): its kernels' limit fraction is left out", math, e)
        return None
    return 2 * n**3 / (median_us(mm) * 1e-6)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def woq_case(name, n, k, bits, group, asym, dtype, device, tiled: bool = False) -> Case:
    """A weight-only kernel: the weight decoded in registers, the GEMM in the activation dtype
    (from DEQUANT_MM_MIN_M rows on, W^T decoded then cuBLAS, unless `tiled`: the Triton GEMM)."""
    half = 1 << (bits - 1)
    groups = 1 if group is None else k // group
    codes = torch.randint(-half, half, (n, k), dtype=torch.int8, device=device)
    scale = torch.rand(n, groups, device=device) * 0.01 + 1e-3
    zp = torch.randint(-half, half, (n, groups), dtype=torch.int8, device=device) if asym else None
    w = pack_woq(codes, scale, zp, bits, group, dtype)
    dense = dequant_woq(w.qweight, w.scales, w.zeros, bits, group, k).to(dtype)
    def fn(x):
        config = woq_config(x.shape[0], n, k, group, sm_count(x.device))
        config = replace(config, dequant_mm=False) if tiled else config
        return woq_gemm(x, w.qweight, w.scales, w.zeros, None, bits, group, config=config)

    return Case(name, fn, nbytes(w.qweight, w.scales, w.zeros), dense, MATH[dtype])


def w8a8_case(name, n, k, codes_dtype, dtype, device, backend=Fp8Backend.AUTO) -> Case:
    if codes_dtype == torch.int8:
        w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    else:
        w_q = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(codes_dtype)
    w_scale = (torch.rand(n, 1, device=device) * 0.01 + 1e-3).to(dtype)

    def fn(x):
        q, s = act_quant(x, codes_dtype)
        if codes_dtype == torch.int8:
            return int8_gemm(q, w_q, s, w_scale, None, dtype)
        return fp8_gemm(q, w_q, s, w_scale, None, dtype, backend=backend)

    dense = (w_q.float() * w_scale.float()).t().to(dtype)
    return Case(name, fn, nbytes(w_q, w_scale), dense, "int8" if codes_dtype == torch.int8 else "fp8")


def cases(n, k, dtype, device) -> list[Case]:
    out = [woq_case("w4a16_g128", n, k, 4, 128, False, dtype, device),
           woq_case("w4a16_g128_tiled", n, k, 4, 128, False, dtype, device, tiled=True),
           woq_case("w4a16_asym_g128", n, k, 4, 128, True, dtype, device),
           woq_case("w4a16_channel", n, k, 4, None, False, dtype, device),
           woq_case("w8a16", n, k, 8, None, False, dtype, device),
           w8a8_case("w8a8_int8", n, k, torch.int8, dtype, device)]
    if fp8_supported(device):
        out.append(w8a8_case("fp8_triton", n, k, torch.float8_e4m3fn, dtype, device, Fp8Backend.TRITON))
        per_token, per_channel = torch.ones(2, 1, device=device), torch.ones(n, 1, device=device)
        if scaled_mm_applies(2, n, k, per_token, per_channel, dtype, device):
            out.append(w8a8_case("fp8_scaled_mm", n, k, torch.float8_e4m3fn, dtype, device, Fp8Backend.SCALED_MM))
    return out


def bench_shape(shape, k, n, ms, dtype, device, hbm, peaks: dict[str, float | None]) -> list[Row]:
    rows = []
    for case in cases(n, k, dtype, device):
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = x @ case.dense
            y = case.fn(x)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t_eager = median_us(lambda: case.fn(x))
            t_mm = graph_us(lambda: x @ case.dense, "matmul") or median_us(lambda: x @ case.dense)
            t = graph_us(lambda: case.fn(x), case.name) or t_eager
            moved = case.weight_bytes + nbytes(x) + m * n * torch.finfo(dtype).bits // 8
            flops = 2 * m * n * k
            peak = peaks.get(case.math)
            limit = None if peak is None else max(moved / hbm, flops / peak) * 1e6 / t
            rows.append(Row(shape, k, n, m, case.name, t, moved / t * 1e-3, flops / t * 1e-6, limit,
                            t_mm / t, t_mm, err, t_eager))
    return rows


def _fraction(x: float | None) -> str:
    return f"{'-':>6}" if x is None else f"{x:6.2f}"


def table(rows: list[Row]) -> str:
    head = f"{'shape':8} {'K':>6} {'N':>6} {'M':>5} {'kernel':16} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8} " \
           f"{'limit':>6} {'vs mm':>6} {'err':>8} {'eager us':>9}"
    lines = [head] + [f"{r.shape:8} {r.k:6d} {r.n:6d} {r.m:5d} {r.kernel:16} {r.us:9.1f} {r.gbps:7.0f} "
                      f"{r.tflops:8.1f} {_fraction(r.limit_fraction)} {r.speedup_vs_matmul:6.2f} {r.max_rel_err:8.1e} {r.us_eager:9.1f}"
                      for r in rows]
    return "\n".join(lines)


def run(shapes: str = "llama3-8b", ms: list[int] | None = None, out: str = "benchmarks/results",
        dtype: str = "bf16", command: str | None = None) -> tuple[Path, str]:
    """Benchmark every kernel on `shapes` for each M; returns the JSON path and a printable summary
    (needs CUDA). command: the command line the JSON records."""
    if not torch.cuda.is_available():
        raise RuntimeError("qtk bench kernels needs a CUDA GPU: torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU")
    if shapes not in SHAPES:
        raise ValueError(f"unknown shapes {shapes!r}; choose one of {sorted(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    ms = ms or [1, 16, 64, 256, 1024, 4096]
    device = torch.device("cuda", torch.cuda.current_device())
    act = DTYPES[dtype]
    torch.manual_seed(0)
    hbm = hbm_bandwidth(device)
    maths = [dtype, "int8"] + (["fp8"] if fp8_supported(device) else [])
    peaks = {math: matmul_peak(device, math) for math in maths}
    peaks_text = ", ".join(f"{math} {'unknown' if p is None else f'{p * 1e-12:.0f}'}" for math, p in peaks.items())
    log.info("HBM %.0f GB/s, matmul peaks (T op/s) %s", hbm * 1e-9, peaks_text)
    rows = []
    for name, k, n in SHAPES[shapes]:
        rows += bench_shape(name, k, n, ms, act, device, hbm, peaks)
        torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "command": command, "git_commit": git_commit(), "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "date": now.isoformat(timespec="seconds"), "shapes": shapes, "dtype": dtype, "ms": ms,
        "hbm_gbps": hbm * 1e-9,  # each math's peak, T op/s (int8: TOP/s); null: unknown, no fraction
        "matmul_peaks_tops": {math: None if p is None else p * 1e-12 for math, p in peaks.items()},
        "rows": [asdict(r) for r in rows],
    }
    slug = torch.cuda.get_device_name(device).replace(" ", "-")
    path = Path(out) / f"kernels-{shapes}-{dtype}-{slug}-{now:%Y%m%dT%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    summary = (f"{result['device']}: HBM {hbm * 1e-9:.0f} GB/s, matmul peaks (T op/s) {peaks_text} "
               f"(torch {torch.__version__}, triton {triton.__version__})\n{table(rows)}\nwrote {path}")
    return path, summary
