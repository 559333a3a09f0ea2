"""One core's arithmetic peaks on an AVX2 CPU, from micro-kernels whose operands sit in registers or L1:
what qtk's float32 kernels can reach at best, and whether int8 arithmetic would beat them on this CPU.

    python benchmarks/cpu_core_peak.py [--reps 100000] [--out benchmarks/results]

Compiles a small C++ file with g++ (-O3 -mavx2 -mfma) and times, on one thread, best of 5:
  fma_registers      12 independent FMA chains on registers: the float32 peak (GFLOP/s, 2 per lane)
  fma_6x16_tile      6 rows x 16 columns, w loaded and x broadcast from L1: the shape of qtk's weight
                     kernel's micro-tiles (csrc/cpu_woq.cpp micro6) and of BLIS's Haswell kernel
  attention_tiles    4 rows x 16 keys of S = Q K^T, then 4 rows x 16 dims of O += P V, over a 64-key
                     block in L1: the inner loops of the AVX2 prefill attention (csrc/cpu_attention.cpp)
  int8_maddubs_6x16  the 6 x 16 tile in int8 on AVX2 without VNNI: vpmaddubsw (u8 x s8 pairs to int16),
                     vpmaddwd by ones (to int32), vpaddd (GOP/s, 2 per multiply-add): what an AVX2 W8A8
                     kernel would run on
A core that issues 256-bit operations as two 128-bit halves (Zen 1) has the same FMA peak per cycle as
its int8 path; cores with two 256-bit multiply ports run the int8 tile up to twice as fast. Prints and
writes a JSON (CPU, date, figures). Run on an idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from qtk.device import cpu_name  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

alignas(64) float W[256 * 16];
alignas(64) float X[6 * 256];
alignas(64) int8_t W8[256 * 64];
alignas(64) uint8_t X8[6 * 1024];
constexpr int BK = 64, D = 64, MR = 4;
alignas(64) float KP[D * BK], VP[BK * D], Q[MR * D], S[MR * BK], O[MR * D];
volatile float sink;

__attribute__((noinline)) void fma_registers(int n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.f + i * 1e-3f);
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int k = 0; k < n; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  sink = _mm256_cvtss_f32(s);
}

__attribute__((noinline)) void fma_tile(int K) {
  __m256 c[6][2];
  for (int r = 0; r < 6; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(W + k * 16), w1 = _mm256_load_ps(W + k * 16 + 8);
    for (int r = 0; r < 6; ++r) {
      const __m256 b = _mm256_broadcast_ss(X + r * 256 + k);
      c[r][0] = _mm256_fmadd_ps(w0, b, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(w1, b, c[r][1]);
    }
  }
  __m256 s = c[0][0];
  for (int r = 0; r < 6; ++r) s = _mm256_add_ps(s, _mm256_add_ps(c[r][0], c[r][1]));
  sink = _mm256_cvtss_f32(s);
}

__attribute__((noinline)) void attention_tiles() {
  for (int c = 0; c < BK / 16; ++c) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int i = 0; i < D; ++i) {
      const __m256 k0 = _mm256_load_ps(KP + i * BK + 16 * c), k1 = _mm256_load_ps(KP + i * BK + 16 * c + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(Q + r * D + i);
        acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) _mm256_store_ps(S + r * BK + 16 * c + 8 * v, acc[r][v]);
  }
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) acc[r][v] = _mm256_load_ps(O + r * D + d0 + 8 * v);
    for (int j = 0; j < BK; ++j) {
      const __m256 v0 = _mm256_load_ps(VP + j * D + d0), v1 = _mm256_load_ps(VP + j * D + d0 + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(S + r * BK + j);
        acc[r][0] = _mm256_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) _mm256_store_ps(O + r * D + d0 + 8 * v, acc[r][v]);
  }
}

__attribute__((noinline)) void int8_tile(int K4) {
  __m256i acc[6][2];
  for (int r = 0; r < 6; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int k = 0; k < K4; ++k) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(W8 + k * 64));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(W8 + k * 64 + 32));
    for (int r = 0; r < 6; ++r) {
      const __m256i a = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(X8 + r * 1024 + 4 * k));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w0), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w1), ones));
    }
  }
  __m256i s = acc[0][0];
  for (int r = 0; r < 6; ++r) s = _mm256_add_epi32(s, _mm256_add_epi32(acc[r][0], acc[r][1]));
  sink = static_cast<float>(_mm256_extract_epi32(s, 0));
}

template <class F>
double best_seconds(F&& f) {
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 100000;
  for (int i = 0; i < 256 * 16; ++i) W[i] = 1e-3f * (i % 7);
  for (int i = 0; i < 6 * 256; ++i) X[i] = 1e-3f * (i % 5);
  for (int i = 0; i < 256 * 64; ++i) W8[i] = static_cast<int8_t>(i % 7 - 3);
  for (int i = 0; i < 6 * 1024; ++i) X8[i] = static_cast<uint8_t>(i % 11);
  for (int i = 0; i < D * BK; ++i) { KP[i] = 1e-3f * (i % 7); VP[i] = 1e-4f * (i % 3); }
  for (int i = 0; i < MR * D; ++i) Q[i] = 1e-3f * (i % 5);
  const double regs = best_seconds([&] { fma_registers(reps * 40); });
  const double tile = best_seconds([&] { for (int i = 0; i < reps; ++i) fma_tile(256); });
  const double attn = best_seconds([&] { for (int i = 0; i < reps; ++i) attention_tiles(); });
  const double i8 = best_seconds([&] { for (int i = 0; i < reps; ++i) int8_tile(256); });
  std::printf("{\"fma_registers\": %.2f, \"fma_6x16_tile\": %.2f, \"attention_tiles\": %.2f, \"int8_maddubs_6x16\": %.2f}\n",
              2.0 * 12 * 8 * 40.0 * reps / regs / 1e9, 2.0 * 6 * 16 * 256 * reps / tile / 1e9,
              4.0 * MR * BK * D * reps / attn / 1e9, 2.0 * 6 * 16 * 4 * 256 * reps / i8 / 1e9);
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100000, help="calls of each micro-kernel per timing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if shutil.which("g++") is None:
        print("cpu_core_peak: needs g++ (apt install g++)", file=sys.stderr)
        return 2
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        print(f"cpu_core_peak: needs an AVX2 CPU (this one: {torch.backends.cpu.get_cpu_capability()})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-o", str(exe), str(src)], check=True)
        figures = json.loads(subprocess.run([str(exe), str(args.reps)], check=True, capture_output=True,
                                            text=True).stdout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    result = {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "commit": commit,
              "date": datetime.date.today().isoformat(), "unit": "G op/s, one core (a multiply-add is 2)", **figures}
    print(json.dumps(result, indent=1))
    name = f"cpu-core-peak-{result['capability'].lower()}-{result['date']}-{commit}.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {Path(args.out) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
