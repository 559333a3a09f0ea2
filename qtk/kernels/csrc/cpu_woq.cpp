// Weight-only quantized linear layers on x86 CPUs: y = x @ dequant(W)^T + b, float32 activations,
// int4 or int8 weight codes decoded in registers (the float weight is never written to memory).
//
// Why: decoding one token reads every weight once, so a CPU decode step is bound by memory
// bandwidth; int4 codes are 8x fewer bytes than float32. torch has no fast kernel for float32
// activations on AVX2 (see qtk/kernels/cpu.py for the measurements), so qtk carries this one.
//
// Layout (built once per layer by qtk.kernels.cpu.pack): columns in blocks of 8, one AVX2 lane each.
//   int4: codes  int32  [N/8, K/8, 8]  word (nb, kb, j) holds u[8kb + i, 8nb + j] in bits 4i..4i+3,
//                                      u = q + 8 in 0..15 (8 consecutive k of one column per word)
//   int8: codes  int8   [N/8, K, 8]    q[k, 8nb + j]
//   bf16: codes  int16  [N/8, K, 8]    the weight itself in bf16 (scales 1): a float layer kept as its
//                                      checkpoint stores it, half the bytes of float32, exact
//   scales       float  [N/8, G, 8]    s[g, n] (G groups along K; 1 for per-channel)
//   zs           float  [N/8, G, 8]    s * z' with z' the zero of the stored codes: z + 8 for int4 (z = 0
//                                      when symmetric), z for asymmetric int8; absent for symmetric int8
// Then y[m, n] = sum_g ( s[g, n] * sum_{k in g} u[k, n] x[m, k]  -  zs[g, n] * sum_{k in g} x[m, k] ):
// the inner loop is one FMA per weight on codes converted in registers; scale and zero apply once
// per group.
//
// Decoding int4 in registers: one 32-byte load holds 8 k x 8 columns. Code i of each lane is
// (v & 0xF << 4i), which converts exactly to the float u * 16^i; multiplying it by x[k] / 16^i
// (x scaled once per call, exact powers of two) gives u * x[k]. So a weight costs an AND, a
// convert and an FMA (the last code of a word: a shift instead of the AND, and x unscaled).
//
// Three paths, chosen by M (rows of x; thresholds at rows_min below):
//   gemv: decode (a few rows): 2 rows per pass, register-blocked over 4 column blocks (32 columns) so
//         8 FMA chains run at once; a tile's codes (32 columns x K) stay in L1 between passes.
//   rows: batched decode, short prefill chunks (AVX2 build): each 64-row slice of a 32-column tile is
//         decoded once into L1 as float weights, then every 6 rows multiply it in 6 x 16 micro-tiles.
//   tiles: long prefill chunks: each thread decodes a tile of 64 columns into a float buffer [K, 64]
//         that stays in its cache, then multiplies with at::mm_out (MKL / oneDNN sgemm) straight into y.
// All parallelise over column tiles with torch's intra-op threads (at::parallel_for).
//
// The AVX-512 build (cpu.py's avx512 variant) runs the int8 / bf16 gemv on 16-lane registers: the same
// layout, two adjacent column blocks per register (block b in the low half, b + 1 in the high), tiles of 8
// blocks (64 columns) and up to 4 rows per pass with 16 of its 32 registers as accumulators, so a
// decoded code feeds 4 FMAs instead of 2; its int4 gemv multiplies integer limbs of x on VNNI (gemv_vnni).
// The other paths are the AVX2 code, compiled with EVEX.
// Every gemv sums each row alone, in k order: a row's result does not depend on the rows beside it.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QTK_AVX2 1
#endif
#if defined(QTK_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QTK_AVX512 1
#endif

namespace {

constexpr int64_t LANES = 8;       // columns per block (one AVX2 register of floats)
constexpr int NT = 4;              // column blocks per gemv tile: 32 columns
constexpr int64_t TILE_COLS = 64;  // columns per tile on the large-M path
// The path by rows of x: the gemv below rows_min(bits) rows (it decodes in registers, with no stores, but
// again for every pair of rows), decoded slices times 6 x 16 micro-tiles from there to M_ROWS_MAX, and
// past it decoded tiles + sgemm (whose own blocking wins once the rows' sums no longer stay in cache).
// The portable build has only the gemv and the tiles. Measured (SmolLM2's shapes, codes out of cache):
// - 2 Zen 3 cores, int4 g64: slices tie with the gemv at 16-20 rows and win from 24 on (1.2x at 64,
//   1.05-1.25x over decoded tiles + sgemm at 128-512);
// - 2 Zen 1 cores (128-bit FMA units: the gemv's decode costs as much as its FMAs), SmolLM2's 120 decoder
//   layers in ms per pass, gemv / slices: bf16 8 rows 45.2 / 45.7, 10 rows 56.2 / 50.0, 16 rows 86.4 /
//   62.2; int8 6 rows 34.9 / 34.0, 8 rows 47.0 / 41.3, 16 rows 91.4 / 63.7; int4 6 rows 36.6 / 32.6,
//   12 rows 61.0 / 50.9, 16 rows 86.9 / 61.6 (its lm_head, bf16 [49152, 576], at 16 rows 22.7 / 16.4).
//   With bf16 slices converted under the FMAs (micro6<true>): 4 rows 24.2 / 34.4, 5 rows 32.2 / 36.7,
//   6 rows 34.5 / 32.8, 8 rows 45.0 / 41.0, 16 rows 60.9 (lm_head 15.6).
// So the AVX2 build leaves the gemv where the Zen 1 slices win (bf16, int8: the gemv's per-weight decode,
// a shift or a widening, is dearer than int4's AND) and for int4 at 12 rows, between Zen 1's crossover (6)
// and Zen 3's (16-20). The AVX-512 build's gemv multiplies 4 rows per decoded register, 16 lanes wide: 20
// (measured with the float int4 gemv, before int4 moved to VNNI row by row).
constexpr int64_t M_ROWS_MAX = 512, M_GEMV_MAX = 64;
#ifdef QTK_AVX512
constexpr int64_t rows_min(int64_t) { return 20; }
#else
constexpr int64_t rows_min(int64_t bits) { return bits == 16 ? 6 : bits == 8 ? 8 : 12; }
#endif

struct Args {
  const float* x;   // [M, K]
  const float* xs;  // int4: x[m, k] / 16^(k % 8) (k % 8 < 7), x[m, k] (k % 8 == 7); int8: x
  int64_t M, K, N;
  const uint8_t* codes; const float* scales; const float* zs; const float* bias;
  const float* xsum;  // [M, G] sums of x over each group (only with zs)
  int64_t G, gsize;
  float* y;  // [M, N]
};

template <int BITS>
constexpr int64_t block_bytes(int64_t K) { return BITS == 4 ? K * 4 : K * LANES * (BITS / 8); }

// The stored code (u for int4, q for int8) at row k, lane j of a column block (portable).
template <int BITS>
static inline float code_at(const uint8_t* blk, int64_t k, int j) {
  if constexpr (BITS == 4) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(blk)[(k / 8) * LANES + j];
    return static_cast<float>((w >> (4 * (k % 8))) & 0xF);
  } else if constexpr (BITS == 8) {
    return static_cast<float>(reinterpret_cast<const int8_t*>(blk)[k * LANES + j]);
  } else {  // bf16: the top half of a float32
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(blk)[k * LANES + j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

#ifdef QTK_AVX2
alignas(32) const uint32_t NIBBLE_MASKS[7][8] = {
#define QTK_MASK(i) {0xFu << (4 * i), 0xFu << (4 * i), 0xFu << (4 * i), 0xFu << (4 * i), \
                     0xFu << (4 * i), 0xFu << (4 * i), 0xFu << (4 * i), 0xFu << (4 * i)}
    QTK_MASK(0), QTK_MASK(1), QTK_MASK(2), QTK_MASK(3), QTK_MASK(4), QTK_MASK(5), QTK_MASK(6)};
#undef QTK_MASK

// int8 codes or bf16 weights at row k of a column block (8 lanes) as floats.
template <int BITS>
static inline __m256 load_lanes(const uint8_t* blk, int64_t k) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + k * LANES));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * LANES * 2));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Code i of each lane of v, as u * 16^i (i < 7) or u (i == 7).
template <int I>
static inline __m256 nibble(__m256i v) {
  if constexpr (I == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  else return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(NIBBLE_MASKS[I]))));
}

// acc[r][t] += sum_{k0 <= k < k1} code[k, block t] * x_r[k] for 4 column blocks and MR (1 or 2) rows.
// Every row sums in k order in one chain per lane, at any MR and in the 16-lane loops alike: a row's result
// does not depend on the rows beside it, so a step that verifies speculative drafts (k + 1 rows a sequence)
// gives each token plain decoding's logits to the bit. (One row once split its even and odd k into two
// chains, 8 FMA chains in flight instead of 4: 7% faster for int4 at one row on 2 Zen 4 cores, where the
// avx512 build now runs int4 on VNNI, itself row by row.)
// One variable per accumulator: with arrays GCC kept them on the stack (a store-forward per FMA).
template <int MR>
struct Acc4 {
  __m256 a00, a01, a02, a03, a10, a11, a12, a13;
  Acc4() { a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _mm256_setzero_ps(); }
  inline void fma(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float* x0, const float* x1) {
    const __m256 xa = _mm256_broadcast_ss(x0);
    a00 = _mm256_fmadd_ps(w0, xa, a00); a01 = _mm256_fmadd_ps(w1, xa, a01);
    a02 = _mm256_fmadd_ps(w2, xa, a02); a03 = _mm256_fmadd_ps(w3, xa, a03);
    if constexpr (MR == 2) {
      const __m256 xb = _mm256_broadcast_ss(x1);
      a10 = _mm256_fmadd_ps(w0, xb, a10); a11 = _mm256_fmadd_ps(w1, xb, a11);
      a12 = _mm256_fmadd_ps(w2, xb, a12); a13 = _mm256_fmadd_ps(w3, xb, a13);
    }
  }
  inline void get(__m256 (&acc)[2][NT]) const {
    acc[0][0] = a00; acc[0][1] = a01; acc[0][2] = a02; acc[0][3] = a03;
    acc[1][0] = a10; acc[1][1] = a11; acc[1][2] = a12; acc[1][3] = a13;
  }
};

template <int I, int MR>
static inline void int4_step(Acc4<MR>& acc, __m256i v0, __m256i v1, __m256i v2, __m256i v3, const float* x0,
                             const float* x1) {
  acc.fma(nibble<I>(v0), nibble<I>(v1), nibble<I>(v2), nibble<I>(v3), x0 + I, x1 + I);
}

template <int BITS, int MR>
static inline void dot_4blocks(const uint8_t* blk, int64_t bb, const float* x0, const float* x1, int64_t k0,
                               int64_t k1, __m256 (&out)[2][NT]) {
  Acc4<MR> acc;
  if constexpr (BITS == 4) {
    const __m256i* c0 = reinterpret_cast<const __m256i*>(blk);
    const __m256i* c1 = reinterpret_cast<const __m256i*>(blk + bb);
    const __m256i* c2 = reinterpret_cast<const __m256i*>(blk + 2 * bb);
    const __m256i* c3 = reinterpret_cast<const __m256i*>(blk + 3 * bb);
    for (int64_t kb = k0 / 8; kb < k1 / 8; ++kb) {
      if ((kb & 1) == 0) {  // the next tile's codes (4 blocks on), one cache line per stream: a decode step
        const char* next = reinterpret_cast<const char*>(c0 + kb) + 4 * bb;  // streams each layer once
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + bb, _MM_HINT_T0);
        _mm_prefetch(next + 2 * bb, _MM_HINT_T0);
        _mm_prefetch(next + 3 * bb, _MM_HINT_T0);
      }
      const __m256i v0 = _mm256_loadu_si256(c0 + kb), v1 = _mm256_loadu_si256(c1 + kb);
      const __m256i v2 = _mm256_loadu_si256(c2 + kb), v3 = _mm256_loadu_si256(c3 + kb);
      const float* xa = x0 + 8 * kb;
      const float* xb = x1 + 8 * kb;
      int4_step<0, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<1, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<2, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<3, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<4, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<5, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<6, MR>(acc, v0, v1, v2, v3, xa, xb);
      int4_step<7, MR>(acc, v0, v1, v2, v3, xa, xb);
    }
  } else {
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) {
      if (k % (64 / (LANES * BITS / 8)) == 0) {  // the next tile's weights, a line per block, into L2 (a bf16
        // tile is more than L1 holds; at 1-2 rows of SmolLM2's layers this made the gemv 10-30% faster, and T0 less)
        const char* next = reinterpret_cast<const char*>(blk + k * LANES * (BITS / 8)) + 4 * bb;
        _mm_prefetch(next, _MM_HINT_T1);
        _mm_prefetch(next + bb, _MM_HINT_T1);
        _mm_prefetch(next + 2 * bb, _MM_HINT_T1);
        _mm_prefetch(next + 3 * bb, _MM_HINT_T1);
      }
      acc.fma(load_lanes<BITS>(blk, k), load_lanes<BITS>(blk + bb, k),
                              load_lanes<BITS>(blk + 2 * bb, k), load_lanes<BITS>(blk + 3 * bb, k), x0 + k, x1 + k);
      acc.fma(load_lanes<BITS>(blk, k + 1), load_lanes<BITS>(blk + bb, k + 1),
                             load_lanes<BITS>(blk + 2 * bb, k + 1), load_lanes<BITS>(blk + 3 * bb, k + 1), x0 + k + 1,
                             x1 + k + 1);
    }
    if (k < k1)
      acc.fma(load_lanes<BITS>(blk, k), load_lanes<BITS>(blk + bb, k),
                              load_lanes<BITS>(blk + 2 * bb, k), load_lanes<BITS>(blk + 3 * bb, k), x0 + k, x1 + k);
  }
  acc.get(out);
}
#endif

#ifdef QTK_AVX512
constexpr int NT16 = 8;  // column blocks per AVX-512 gemv tile: 64 columns, 4 registers of 16 lanes
// Rows from which the gemv runs on 16 lanes. Measured on 2 Zen 4 cores (which split a 512-bit operation
// into two 256-bit halves, so 16 lanes bring no more arithmetic per cycle): at 1-2 rows the AVX2 loops
// are 20-25% faster (the pair loads cost a shuffle each), from 4 rows on 16 lanes are 0-17% faster (a
// decoded code feeds 4 FMAs).
constexpr int64_t M16_MIN = 4;

#define QTK_INLINE inline __attribute__((always_inline))

// Row kb (8 k x 8 lanes of int4 words) of blocks b and b + 1 (bb bytes apart) as one register.
static QTK_INLINE __m512i pair_words(const uint8_t* blk, int64_t bb, int64_t kb) {
  const __m256i* lo = reinterpret_cast<const __m256i*>(blk) + kb;
  const __m256i* hi = reinterpret_cast<const __m256i*>(blk + bb) + kb;
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(lo)), _mm256_loadu_si256(hi), 1);
}

// int8 codes or bf16 weights at row k of blocks b and b + 1 as 16 floats.
template <int BITS>
static QTK_INLINE __m512 pair_lanes(const uint8_t* blk, int64_t bb, int64_t k) {
  if constexpr (BITS == 8) {
    const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + k * LANES));
    const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + bb + k * LANES));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi)));
  } else {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * LANES * 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bb + k * LANES * 2));
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 8 floats of blocks b and b + 1 of a per-block array [nblocks, G, 8] (scales, zs) at group g.
static QTK_INLINE __m512 pair_floats(const float* p, int64_t G, int64_t g) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p + g * LANES)),
                            _mm256_loadu_ps(p + (G + g) * LANES), 1);
}

template <int I>
static QTK_INLINE __m512 nibble16(__m512i v) {  // as nibble<I>, 16 lanes
  if constexpr (I == 7) return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 28));
  else return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFu << (4 * I)))));
}

// acc[r][t] += w[t] * x_r[k] for the MR rows, one chain per lane, as in Acc4.
template <int MR>
static QTK_INLINE void fma16(__m512 (&acc)[MR][4], const __m512 (&w)[4], const float* const (&x)[MR],
                             int64_t k) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512 xb = _mm512_set1_ps(x[r][k]);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_fmadd_ps(w[t], xb, acc[r][t]);
  }
}

template <int I, int MR>
static QTK_INLINE void int4_step16(__m512 (&acc)[MR][4], const __m512i (&v)[4],
                                   const float* const (&x)[MR], int64_t k) {
  const __m512 w[4] = {nibble16<I>(v[0]), nibble16<I>(v[1]), nibble16<I>(v[2]), nibble16<I>(v[3])};
  fma16<MR>(acc, w, x, k + I);
}

// out[r][0..64) += the group sums of MR rows against 8 column blocks (4 pairs), over k0..k1.
template <int BITS, int MR>
static QTK_INLINE void dot_8blocks(const uint8_t* blk, int64_t bb, const float* const (&x)[MR], int64_t k0,
                                   int64_t k1, __m512 (&out)[MR][4]) {
  constexpr int NC = MR;
  __m512 acc[NC][4];
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[c][t] = _mm512_setzero_ps();
  if constexpr (BITS == 4) {
    for (int64_t kb = k0 / 8; kb < k1 / 8; ++kb) {
      if ((kb & 1) == 0) {  // the next tile's codes (8 blocks on), one cache line per stream
        const char* next = reinterpret_cast<const char*>(blk) + kb * 32 + 8 * bb;
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) _mm_prefetch(next + t * bb, _MM_HINT_T0);
      }
      const __m512i v[4] = {pair_words(blk, bb, kb), pair_words(blk + 2 * bb, bb, kb),
                            pair_words(blk + 4 * bb, bb, kb), pair_words(blk + 6 * bb, bb, kb)};
      const int64_t k = 8 * kb;
      int4_step16<0, MR>(acc, v, x, k); int4_step16<1, MR>(acc, v, x, k);
      int4_step16<2, MR>(acc, v, x, k); int4_step16<3, MR>(acc, v, x, k);
      int4_step16<4, MR>(acc, v, x, k); int4_step16<5, MR>(acc, v, x, k);
      int4_step16<6, MR>(acc, v, x, k); int4_step16<7, MR>(acc, v, x, k);
    }
  } else {
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) {
      if (k % (64 / (LANES * BITS / 8)) == 0) {  // the next tile's weights (8 blocks on), a line per block
        const char* next = reinterpret_cast<const char*>(blk + k * LANES * (BITS / 8)) + 8 * bb;
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) _mm_prefetch(next + t * bb, _MM_HINT_T1);
      }
      const __m512 w0[4] = {pair_lanes<BITS>(blk, bb, k), pair_lanes<BITS>(blk + 2 * bb, bb, k),
                            pair_lanes<BITS>(blk + 4 * bb, bb, k), pair_lanes<BITS>(blk + 6 * bb, bb, k)};
      fma16<MR>(acc, w0, x, k);
      const __m512 w1[4] = {pair_lanes<BITS>(blk, bb, k + 1), pair_lanes<BITS>(blk + 2 * bb, bb, k + 1),
                            pair_lanes<BITS>(blk + 4 * bb, bb, k + 1), pair_lanes<BITS>(blk + 6 * bb, bb, k + 1)};
      fma16<MR>(acc, w1, x, k + 1);
    }
    if (k < k1) {
      const __m512 w0[4] = {pair_lanes<BITS>(blk, bb, k), pair_lanes<BITS>(blk + 2 * bb, bb, k),
                            pair_lanes<BITS>(blk + 4 * bb, bb, k), pair_lanes<BITS>(blk + 6 * bb, bb, k)};
      fma16<MR>(acc, w0, x, k);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) out[r][t] = acc[r][t];
}

// gemv tile on 16 lanes: rows m0..m0+MR (MR in 1, 2, 4) against the 8 column blocks from nb0.
template <int BITS, int MR>
static void gemv_tile16(const Args& a, int64_t m0, int64_t nb0) {
  const int64_t bb = block_bytes<BITS>(a.K);
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = a.xs + (m0 + r) * a.K;
  __m512 out[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < 4; ++t) out[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 sum[MR][4];
    dot_8blocks<BITS, MR>(a.codes + nb0 * bb, bb, x, g * a.gsize, (g + 1) * a.gsize, sum);
    for (int t = 0; t < 4; ++t) {
      const int64_t base = (nb0 + 2 * t) * a.G * LANES;
      const __m512 s = pair_floats(a.scales + base, a.G, g);
      const __m512 zs = a.zs ? pair_floats(a.zs + base, a.G, g) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r) {
        out[r][t] = _mm512_fmadd_ps(s, sum[r][t], out[r][t]);
        if (a.zs) out[r][t] = _mm512_fnmadd_ps(zs, _mm512_set1_ps(a.xsum[(m0 + r) * a.G + g]), out[r][t]);
      }
    }
  }
  const int64_t c0 = nb0 * LANES, cols = std::min<int64_t>(NT16 * LANES, a.N - c0);
  for (int r = 0; r < MR; ++r) {
    float* yr = a.y + (m0 + r) * a.N + c0;
    for (int t = 0; t < 4; ++t) {
      const int64_t left = cols - 16 * t;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      __m512 o = out[r][t];
      if (a.bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(mask, a.bias + c0 + 16 * t));
      _mm512_mask_storeu_ps(yr + 16 * t, mask, o);
    }
  }
}

template <int BITS>
static void gemv_columns16(const Args& a, int64_t nb0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) gemv_tile16<BITS, 4>(a, m, nb0);
  for (; m + 2 <= a.M; m += 2) gemv_tile16<BITS, 2>(a, m, nb0);
  if (m < a.M) gemv_tile16<BITS, 1>(a, m, nb0);
}
#endif

#ifdef QTK_AVX2
// The scales and zeros of the tile of NT blocks from nb (one contiguous run each), asked for before its codes
// need them: the loops prefetch the codes a tile ahead, and a group's scales would otherwise miss at the end of
// its dot products. Two tiles ahead, 6-7% more GB/s for SmolLM2's int4 layers at one row on 2 Zen 4 cores.
constexpr int64_t SCALES_AHEAD = 2;

static inline void prefetch_tile_scales(const Args& a, int64_t nb) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
  if (nb >= nblocks) return;
  const int64_t len = std::min<int64_t>(NT, nblocks - nb) * a.G * LANES * static_cast<int64_t>(sizeof(float));
  const char* sc = reinterpret_cast<const char*>(a.scales + nb * a.G * LANES);
  const char* zc = a.zs ? reinterpret_cast<const char*>(a.zs + nb * a.G * LANES) : nullptr;
  for (int64_t i = 0; i < len; i += 64) {
    _mm_prefetch(sc + i, _MM_HINT_T0);
    if (zc) _mm_prefetch(zc + i, _MM_HINT_T0);
  }
}
#endif

// gemv tile: rows m0..m0+MR (MR <= 2), column blocks nb0..nb0+nt (nt <= NT).
template <int BITS, int MR>
static void gemv_tile(const Args& a, int64_t m0, int64_t nb0, int nt) {
  const int64_t bb = block_bytes<BITS>(a.K);
  float out[MR][NT * LANES];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NT * LANES; ++i) out[r][i] = 0.f;
#ifdef QTK_AVX2
  if (nt == NT) {
    if (m0 == 0) prefetch_tile_scales(a, nb0 + SCALES_AHEAD * NT);
    const float* x0 = a.xs + m0 * a.K;
    const float* x1 = MR == 2 ? x0 + a.K : x0;
    for (int64_t g = 0; g < a.G; ++g) {
      __m256 acc[2][NT];
      dot_4blocks<BITS, MR>(a.codes + nb0 * bb, bb, x0, x1, g * a.gsize, (g + 1) * a.gsize, acc);
      for (int t = 0; t < NT; ++t) {
        const int64_t so = ((nb0 + t) * a.G + g) * LANES;
        const __m256 s = _mm256_loadu_ps(a.scales + so);
        for (int r = 0; r < MR; ++r) {
          __m256 o = _mm256_fmadd_ps(s, acc[r][t], _mm256_loadu_ps(out[r] + t * LANES));
          if (a.zs) o = _mm256_fnmadd_ps(_mm256_loadu_ps(a.zs + so), _mm256_set1_ps(a.xsum[(m0 + r) * a.G + g]), o);
          _mm256_storeu_ps(out[r] + t * LANES, o);
        }
      }
    }
  } else
#endif
  {  // portable: any nt, any CPU (unscaled x)
    for (int t = 0; t < nt; ++t) {
      const uint8_t* blk = a.codes + (nb0 + t) * bb;
      for (int64_t g = 0; g < a.G; ++g) {
        float acc[MR][LANES] = {};
        for (int64_t k = g * a.gsize; k < (g + 1) * a.gsize; ++k)
          for (int j = 0; j < LANES; ++j) {
            const float w = code_at<BITS>(blk, k, j);
            for (int r = 0; r < MR; ++r) acc[r][j] += w * a.x[(m0 + r) * a.K + k];
          }
        const int64_t so = ((nb0 + t) * a.G + g) * LANES;
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < LANES; ++j) {
            float o = out[r][t * LANES + j] + a.scales[so + j] * acc[r][j];
            if (a.zs) o -= a.zs[so + j] * a.xsum[(m0 + r) * a.G + g];
            out[r][t * LANES + j] = o;
          }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* yr = a.y + (m0 + r) * a.N + nb0 * LANES;
    const int64_t cols = std::min<int64_t>(nt * LANES, a.N - nb0 * LANES);
    for (int64_t i = 0; i < cols; ++i) yr[i] = out[r][i] + (a.bias ? a.bias[nb0 * LANES + i] : 0.f);
  }
}

// All rows of x against one column tile of nt blocks, two rows at a time.
template <int BITS>
static void gemv_columns(const Args& a, int64_t nb0, int nt) {
  int64_t m = 0;
  for (; m + 2 <= a.M; m += 2) gemv_tile<BITS, 2>(a, m, nb0, nt);
  if (m < a.M) gemv_tile<BITS, 1>(a, m, nb0, nt);
}

// A thread's first tile has no tile before it to prefetch it (the loops prefetch one tile ahead): ask
// for all of it (codes, scales, zeros) at once rather than miss line by line (a small layer is only a
// few tiles).
template <int BITS>
static inline void prefetch_first_tile(const Args& a, int64_t nb0, int64_t nblocks, int64_t tile = NT) {
#ifdef QTK_AVX2
  const int64_t bb = block_bytes<BITS>(a.K), nb = std::min<int64_t>(tile, nblocks - nb0);
  const char* c = reinterpret_cast<const char*>(a.codes + nb0 * bb);
  for (int64_t i = 0; i < nb * bb; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  const int64_t sb = nb * a.G * LANES * sizeof(float);
  const char* sc = reinterpret_cast<const char*>(a.scales + nb0 * a.G * LANES);
  const char* zc = reinterpret_cast<const char*>(a.zs ? a.zs + nb0 * a.G * LANES : nullptr);
  for (int64_t i = 0; i < sb; i += 64) {
    _mm_prefetch(sc + i, _MM_HINT_T0);
    if (zc) _mm_prefetch(zc + i, _MM_HINT_T0);
  }
#endif
}

#if defined(QTK_AVX512) && defined(__AVX512VNNI__)
#define QTK_VNNI 1
// int4 gemv on VNNI: VPDPBUSD multiplies 4 codes (unsigned bytes) by 4 signed bytes of x per
// 32-bit lane, so x is split per group into three int8 limbs, x ~ dx * (65536 h2 + 256 h1 + h0) with
// |65536 h2 + 256 h1 + h0| <= 127 * 65536: a 24-bit integer, as fine as float32's mantissa at the group's
// largest |x| (off by half a step at most, max|x| / (2 * 127 * 65536)). So y is dequant(W) x^, x^ the
// limbs' value, within float32 rounding of the float gemv (tests/test_cpu_kernels.py holds both to 1e-5
// of y). A weight costs 3/4 of a VPDPBUSD and 3/8 of an AND or a shift, not an AND, a convert and an FMA.
// A word (nb, kb, j) holds u[8kb + i] in bits 4i: its bytes' low nibbles are the even k (w & 0x0F0F0F0F),
// the high nibbles the odd k ((w >> 4) & 0x0F0F0F0F).
// Measured on 2 Zen 4 cores (one thread, int4 g64 [49152, 576] streamed from memory): 31 GB/s against the
// float gemv's 17.7; two limbs (15 bits) were no faster.
constexpr int32_t LIMB_MAX = 127 * 65536;
// The whole gemv (below rows_min rows): row by row, so a row's result does not depend on the others (Acc4).
constexpr int64_t VNNI_ROWS_MAX = rows_min(4);
std::atomic<int64_t> limb_rows{VNNI_ROWS_MAX};  // set_int4_limb_rows: cpu.py sets 0 where QTK_CPU_VNNI=0

struct Limbs {
  std::vector<int32_t> words;  // [M, K / 8, 6]: limbs h0, h1, h2 of the even k, then of the odd k (4 int8 each)
  std::vector<float> dx;       // [M, G]
  std::vector<float> xsum;     // [M, G]: the group sums of x^ (for the zeros)
};

// The limbs of x [M, K] in G groups (K / G a multiple of 8); false where x is not finite (the float gemv
// then propagates it). t = x * (127 * 65536 / max|x|) rounded to nearest even (in float32), then base-256
// digits h0, h1 in [-128, 127] and h2 in [-127, 127].
static bool split_limbs(const float* x, int64_t M, int64_t K, int64_t G, Limbs& L) {
  const int64_t gsize = K / G;
  L.words.resize(M * (K / 8) * 6);
  L.dx.resize(M * G);
  L.xsum.resize(M * G);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i lim = _mm256_set1_epi32(LIMB_MAX), half = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
  const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * gsize;
      __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int64_t k = 0; k < gsize; k += 8) {
        const __m256 v = _mm256_loadu_ps(xg + k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // (max_ps would drop a NaN)
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      float mx = 0.f;
      for (float v : lanes) mx = std::max(mx, v);
      if (!_mm256_testz_ps(nan, nan) || !std::isfinite(mx)) return false;
      const __m256 inv = _mm256_set1_ps(mx > 0.f ? static_cast<float>(LIMB_MAX) / mx : 0.f);
      __m256 tsum = _mm256_setzero_ps();
      int32_t* out = &L.words[(m * K + g * gsize) / 8 * 6];
      for (int64_t k = 0; k < gsize; k += 8, out += 6) {
        __m256i t = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), inv));  // nearest even
        t = _mm256_max_epi32(_mm256_min_epi32(t, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
        tsum = _mm256_add_ps(tsum, _mm256_cvtepi32_ps(t));
        const __m256i h0 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(t, half), byte), half);
        const __m256i q = _mm256_srai_epi32(_mm256_sub_epi32(t, h0), 8);
        const __m256i h1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, half), byte), half);
        const __m256i h2 = _mm256_srai_epi32(_mm256_sub_epi32(q, h1), 8);
        // bytes h0 k0..7 | h1 k0..7, then h2 k0..7: each to even k, odd k
        const __m128i b01 = _mm_shuffle_epi8(_mm_unpacklo_epi64(_mm256_cvtepi32_epi8(h0), _mm256_cvtepi32_epi8(h1)),
                                             even_odd);  // h0e h0o h1e h1o
        const __m128i b2 = _mm_shuffle_epi8(_mm256_cvtepi32_epi8(h2), even_odd);  // h2e h2o
        alignas(16) int32_t w01[4], w2[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(w01), b01);
        _mm_store_si128(reinterpret_cast<__m128i*>(w2), b2);
        out[0] = w01[0]; out[1] = w01[2]; out[2] = w2[0];  // h0, h1, h2 of the even k
        out[3] = w01[1]; out[4] = w01[3]; out[5] = w2[1];  // of the odd k
      }
      alignas(32) float ts[8];
      _mm256_store_ps(ts, tsum);
      double sum = 0.;
      for (float v : ts) sum += v;
      L.dx[m * G + g] = mx / static_cast<float>(LIMB_MAX);
      L.xsum[m * G + g] = static_cast<float>(sum * L.dx[m * G + g]);
    }
  return true;
}

// out[t] = the group sums (65536 h2 + 256 h1 + h0 against the codes, in float) of one row's limbs against NB
// column blocks over kb0..kb1.
template <int NB>
static QTK_INLINE void dot_blocks_vnni(const uint8_t* blk, int64_t bb, const int32_t* xw, int64_t kb0, int64_t kb1,
                                       __m256 (&out)[NB]) {
  __m256i a0[NB], a1[NB], a2[NB];  // by limb
#pragma GCC unroll 4
  for (int t = 0; t < NB; ++t) a0[t] = a1[t] = a2[t] = _mm256_setzero_si256();
  const __m256i low = _mm256_set1_epi32(0x0F0F0F0F);
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    if ((kb & 1) == 0) {  // the next tile's codes, a line per stream, as dot_4blocks
      const char* next = reinterpret_cast<const char*>(blk) + kb * 32 + NB * bb;
#pragma GCC unroll 4
      for (int t = 0; t < NB; ++t) _mm_prefetch(next + t * bb, _MM_HINT_T0);
    }
    const int32_t* w = xw + 6 * kb;
    const __m256i e0 = _mm256_set1_epi32(w[0]), e1 = _mm256_set1_epi32(w[1]), e2 = _mm256_set1_epi32(w[2]);
    const __m256i o0 = _mm256_set1_epi32(w[3]), o1 = _mm256_set1_epi32(w[4]), o2 = _mm256_set1_epi32(w[5]);
#pragma GCC unroll 4
    for (int t = 0; t < NB; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + t * bb) + kb);
      const __m256i even = _mm256_and_si256(v, low), odd = _mm256_and_si256(_mm256_srli_epi32(v, 4), low);
      a0[t] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(a0[t], even, e0), odd, o0);
      a1[t] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(a1[t], even, e1), odd, o1);
      a2[t] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(a2[t], even, e2), odd, o2);
    }
  }
  const __m256 f256 = _mm256_set1_ps(256.f);
#pragma GCC unroll 4
  for (int t = 0; t < NB; ++t)
    out[t] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(a2[t]), f256, _mm256_cvtepi32_ps(a1[t])), f256,
                             _mm256_cvtepi32_ps(a0[t]));
}

// One row m against the NB column blocks from nb0 (NB = NT but in a last, partial tile).
template <int NB>
static void gemv_tile_vnni(const Args& a, const Limbs& L, int64_t m, int64_t nb0) {
  const int64_t bb = block_bytes<4>(a.K), kbg = a.gsize / 8;
  if (m == 0) prefetch_tile_scales(a, nb0 + SCALES_AHEAD * NT);
  const int32_t* xw = L.words.data() + m * (a.K / 8) * 6;
  __m256 out[NB];
#pragma GCC unroll 4
  for (int t = 0; t < NB; ++t) out[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 acc[NB];
    dot_blocks_vnni<NB>(a.codes + nb0 * bb, bb, xw, g * kbg, (g + 1) * kbg, acc);
    const __m256 dx = _mm256_set1_ps(L.dx[m * a.G + g]), xsum = _mm256_set1_ps(L.xsum[m * a.G + g]);
#pragma GCC unroll 4
    for (int t = 0; t < NB; ++t) {
      const int64_t so = ((nb0 + t) * a.G + g) * LANES;
      out[t] = _mm256_fmadd_ps(_mm256_loadu_ps(a.scales + so), _mm256_mul_ps(acc[t], dx), out[t]);
      out[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(a.zs + so), xsum, out[t]);
    }
  }
  float* yr = a.y + m * a.N;
#pragma GCC unroll 4
  for (int t = 0; t < NB; ++t) {
    const int64_t c0 = (nb0 + t) * LANES, left = a.N - c0;  // the last block of N % 8 columns: masked
    const __mmask8 mask = left >= LANES ? static_cast<__mmask8>(0xFF) : static_cast<__mmask8>((1u << left) - 1);
    __m256 o = out[t];
    if (a.bias) o = _mm256_add_ps(o, _mm256_maskz_loadu_ps(mask, a.bias + c0));
    _mm256_mask_storeu_ps(yr + c0, mask, o);
  }
}

// The int4 gemv on VNNI, each row against each tile of NT column blocks (a tile's codes stay in L1).
static void gemv_vnni(const Args& a, const Limbs& L) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES, ntiles = (nblocks + NT - 1) / NT;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    prefetch_first_tile<4>(a, t0 * NT, nblocks);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * NT, nb = std::min<int64_t>(NT, nblocks - nb0);
      for (int64_t m = 0; m < a.M; ++m) {
        switch (nb) {
          case 4: gemv_tile_vnni<4>(a, L, m, nb0); break;
          case 3: gemv_tile_vnni<3>(a, L, m, nb0); break;
          case 2: gemv_tile_vnni<2>(a, L, m, nb0); break;
          default: gemv_tile_vnni<1>(a, L, m, nb0); break;
        }
      }
    }
  });
}
#endif

template <int BITS>
static void gemv(const Args& a) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
#ifdef QTK_AVX512
  if (nblocks >= NT16 && a.M >= M16_MIN) {  // whole 64-column tiles on 16 lanes; a last partial one on the AVX2 loops
    const int64_t full = nblocks / NT16, ntiles = full + (nblocks % NT16 ? 1 : 0);
    at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
      prefetch_first_tile<BITS>(a, t0 * NT16, nblocks, NT16);
      for (int64_t t = t0; t < t1; ++t) {
        if (t < full) {
          gemv_columns16<BITS>(a, t * NT16);
        } else {
          for (int64_t nb = t * NT16; nb < nblocks; nb += NT)
            gemv_columns<BITS>(a, nb, static_cast<int>(std::min<int64_t>(NT, nblocks - nb)));
        }
      }
    });
    return;
  }
#endif
  const int64_t ntiles = (nblocks + NT - 1) / NT;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    prefetch_first_tile<BITS>(a, t0 * NT, nblocks);
    for (int64_t t = t0; t < t1; ++t)
      gemv_columns<BITS>(a, t * NT, static_cast<int>(std::min<int64_t>(NT, nblocks - t * NT)));
  });
}

// Decode rows k0..k1 of column blocks nb0..nb0+nblk into w [k1 - k0, ld] (k-major: a block's 8 lanes are
// 8 adjacent floats), as the float weight s * u - s * z'. k0 % 8 == 0 for int4. Kept out of line: inlined
// into rows_tile, GCC's code ran the micro-tiles at half their speed (measured, 44 against 88 GFLOP/s).
template <int BITS>
__attribute__((noinline)) static void decode_tile(const Args& a, int64_t nb0, int64_t nblk, float* w, int64_t ld,
                                                  int64_t k0, int64_t k1) {
  const int64_t bb = block_bytes<BITS>(a.K);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = a.codes + (nb0 + b) * bb;
    for (int64_t k = k0; k < k1;) {
      const int64_t g = k / a.gsize, kend = std::min(k1, (g + 1) * a.gsize);
      const int64_t so = ((nb0 + b) * a.G + g) * LANES;
      const float* s = a.scales + so;
      float z[LANES] = {};
      if (a.zs) std::memcpy(z, a.zs + so, sizeof(z));
#ifdef QTK_AVX2
      if constexpr (BITS == 4) {  // a word at a time: 8 rows, constant shifts (k and kend are multiples of 8)
        const __m256 sv = _mm256_loadu_ps(s), zv = _mm256_loadu_ps(z);
        const __m256i mask = _mm256_set1_epi32(0xF);
        for (; k < kend; k += 8) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk) + k / 8);
          float* dst = w + (k - k0) * ld + b * LANES;
#define QTK_ROW(i) _mm256_storeu_ps(dst + (i) * ld, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256( \
                       _mm256_srli_epi32(v, 4 * (i)), mask)), sv, zv))
          QTK_ROW(0); QTK_ROW(1); QTK_ROW(2); QTK_ROW(3); QTK_ROW(4); QTK_ROW(5); QTK_ROW(6); QTK_ROW(7);
#undef QTK_ROW
        }
      }
#endif
      for (; k < kend; ++k) {
        float* dst = w + (k - k0) * ld + b * LANES;
#ifdef QTK_AVX2
        __m256 c;
        if constexpr (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk) + k / 8);
          c = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * (k % 8))),
                                                  _mm256_set1_epi32(0xF)));
        } else {
          c = load_lanes<BITS>(blk, k);
        }
        if constexpr (BITS == 16) _mm256_storeu_ps(dst, c);  // the weight itself (scales 1, no zeros)
        else _mm256_storeu_ps(dst, _mm256_fmsub_ps(c, _mm256_loadu_ps(s), _mm256_loadu_ps(z)));
#else
        for (int j = 0; j < LANES; ++j) dst[j] = code_at<BITS>(blk, k, j) * s[j] - z[j];
#endif
      }
    }
  }
}

#ifdef QTK_AVX2
constexpr int64_t KC = 64;  // rows of a tile decoded at a time on the batched path: 64 x 32 floats, 8 KB of L1
constexpr int MRB = 6;      // rows per micro-tile: 6 rows x 16 columns = 12 accumulators (BLIS's Haswell shape)

// acc[r, 0..16) += sum_k x[r, k] * w[k, 0..16) for MR rows: 2 loads of w and MR broadcasts per 2 MR FMAs.
template <int MR>
static inline void micro(const float* w, const float* x, int64_t ldx, int64_t kn, float* acc) {
  __m256 c[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm256_loadu_ps(acc + r * 32);
    c[r][1] = _mm256_loadu_ps(acc + r * 32 + 8);
  }
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * 32), w1 = _mm256_loadu_ps(w + k * 32 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      c[r][0] = _mm256_fmadd_ps(w0, b, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(w1, b, c[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(acc + r * 32, c[r][0]);
    _mm256_storeu_ps(acc + r * 32 + 8, c[r][1]);
  }
}

// micro<6> with its 12 accumulators as variables (GCC keeps an array of them on the stack), on the slice's
// float weights w [kn, 32]. CONVERT (bf16 weights): it first makes them itself, from rows k0..k0 + kn of
// the column blocks at b0 and b0 + bb, in registers, and stores them into w for the slice's other
// micro-tiles, so the stores run under the FMAs. Converting a slice first, in decode_tile's loop of its own,
// left the FMA units idle behind the stores (Zen 1 stores one 128-bit half per cycle): SmolLM2's 120 layers
// at 16 rows took 70 ms that way, 61 this way, and 53 with no conversion at all (wrong numbers, the bound;
// 2 Zen 1 cores). Not for int8 and int4 codes: there the decoding's own arithmetic (convert, scale, zero; a
// shift and a mask for int4) competes with the FMAs, and fusing measured no faster (int8) or 2-4% slower
// (int4).
template <bool CONVERT = false>
static inline void micro6(float* w, const float* x, int64_t ldx, int64_t kn, float* acc,
                          const uint8_t* b0 = nullptr, int64_t bb = 0, int64_t k0 = 0) {
#define QTK_LD(r) __m256 c##r##0 = _mm256_loadu_ps(acc + r * 32), c##r##1 = _mm256_loadu_ps(acc + r * 32 + 8);
  QTK_LD(0) QTK_LD(1) QTK_LD(2) QTK_LD(3) QTK_LD(4) QTK_LD(5)
#undef QTK_LD
  for (int64_t k = 0; k < kn; ++k) {
    __m256 w0, w1;
    if constexpr (CONVERT) {
      w0 = load_lanes<16>(b0, k0 + k), w1 = load_lanes<16>(b0 + bb, k0 + k);
      _mm256_storeu_ps(w + k * 32, w0);
      _mm256_storeu_ps(w + k * 32 + 8, w1);
    } else {
      w0 = _mm256_loadu_ps(w + k * 32), w1 = _mm256_loadu_ps(w + k * 32 + 8);
    }
#define QTK_FMA(r)                                                 \
  {                                                                \
    const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);         \
    c##r##0 = _mm256_fmadd_ps(w0, b, c##r##0);                     \
    c##r##1 = _mm256_fmadd_ps(w1, b, c##r##1);                     \
  }
    QTK_FMA(0) QTK_FMA(1) QTK_FMA(2) QTK_FMA(3) QTK_FMA(4) QTK_FMA(5)
#undef QTK_FMA
  }
#define QTK_ST(r) _mm256_storeu_ps(acc + r * 32, c##r##0); _mm256_storeu_ps(acc + r * 32 + 8, c##r##1);
  QTK_ST(0) QTK_ST(1) QTK_ST(2) QTK_ST(3) QTK_ST(4) QTK_ST(5)
#undef QTK_ST
}

// Batched decode and short prefill chunks (rows_min(bits)..M_ROWS_MAX rows): each KC-row slice of a full 32-column tile is decoded
// once into L1 as float weights, then multiplied by all rows in 6 x 16 micro-tiles (the gemv decodes
// the codes again for every pair of rows); the rows' sums stay in acc [M, 32].
template <int BITS>
static void rows_tile(const Args& a, int64_t nb0, float* wbuf, float* acc) {
  constexpr int64_t W = NT * LANES;
  const int64_t M = a.M, K = a.K;
  const int64_t bb = block_bytes<BITS>(K), nblocks = (a.N + LANES - 1) / LANES;
  if (nb0 + 2 * NT <= nblocks) {  // the next tile's codes into L2 while this one runs
    const char* next = reinterpret_cast<const char*>(a.codes + (nb0 + NT) * bb);
    for (int64_t i = 0; i < NT * bb; i += 64) _mm_prefetch(next + i, _MM_HINT_T1);
  }
  std::fill(acc, acc + M * W, 0.f);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kn = std::min(KC, K - k0);
    const bool convert_first = BITS == 16 && M >= MRB;  // bf16: the first 6 rows convert the slice
    if (!convert_first) decode_tile<BITS>(a, nb0, NT, wbuf, W, k0, k0 + kn);
    for (int64_t h = 0; h < W; h += 16)
      for (int64_t m = 0; m < M; m += MRB) {
        const float* x = a.x + m * K + k0;
        float* o = acc + m * W + h;
        if (convert_first && m == 0) {
          micro6<true>(wbuf + h, x, K, kn, o, a.codes + (nb0 + h / LANES) * bb, bb, k0);
          continue;
        }
        switch (std::min<int64_t>(MRB, M - m)) {
          case 6: micro6(wbuf + h, x, K, kn, o); break;
          case 5: micro<5>(wbuf + h, x, K, kn, o); break;
          case 4: micro<4>(wbuf + h, x, K, kn, o); break;
          case 3: micro<3>(wbuf + h, x, K, kn, o); break;
          case 2: micro<2>(wbuf + h, x, K, kn, o); break;
          default: micro<1>(wbuf + h, x, K, kn, o); break;
        }
      }
  }
  const int64_t c0 = nb0 * LANES, cols = std::min<int64_t>(W, a.N - c0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < cols; ++i) a.y[m * a.N + c0 + i] = acc[m * W + i] + (a.bias ? a.bias[c0 + i] : 0.f);
}

template <int BITS>
static void rows(const Args& a) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
  const int64_t ntiles = (nblocks + NT - 1) / NT;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wbuf(KC * NT * LANES), acc(a.M * NT * LANES);
    prefetch_first_tile<BITS>(a, t0 * NT, nblocks);
    for (int64_t t = t0; t < t1; ++t) {
      const int nt = static_cast<int>(std::min<int64_t>(NT, nblocks - t * NT));
      if (nt == NT)
        rows_tile<BITS>(a, t * NT, wbuf.data(), acc.data());
      else
        gemv_columns<BITS>(a, t * NT, nt);  // a last, partial tile: the gemv's portable loop
    }
  });
}
#endif

template <int BITS>
static void tiles(const Args& a, const at::Tensor& x, const at::Tensor& y, const at::Tensor& bias) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
  const int64_t per = TILE_COLS / LANES;
  const int64_t ntiles = (nblocks + per - 1) / per;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: carry it to the workers
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard(inference);
    at::NoGradGuard no_grad;  // workers start with grad mode on, and mm_out refuses an x that requires grad
    std::vector<float> buf(TILE_COLS * a.K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * per, nblk = std::min(per, nblocks - nb0);
      const int64_t c0 = nb0 * LANES, cols = std::min(nblk * LANES, a.N - c0);
      decode_tile<BITS>(a, nb0, nblk, buf.data(), TILE_COLS, 0, a.K);
      const at::Tensor w = at::from_blob(buf.data(), {a.K, cols}, {TILE_COLS, 1}, at::kFloat);
      at::Tensor yt = y.narrow(1, c0, cols);
      if (bias.defined())
        at::addmm_out(yt, bias.narrow(0, c0, cols).expand({a.M, cols}), x, w);
      else
        at::mm_out(yt, x, w);
    }
  });
}

at::Tensor woq_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zs, const std::optional<at::Tensor>& bias, int64_t bits,
                      int64_t n) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "woq_linear: x must be float32 on CPU");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16, "woq_linear: bits must be 4, 8 or 16 (bf16)");
  const int64_t K = x_in.size(-1);
  const int64_t nblocks = codes.size(0);
  TORCH_CHECK(nblocks * LANES >= n && nblocks * LANES < n + LANES, "woq_linear: codes hold ", nblocks,
              " column blocks for n=", n);
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "woq_linear: packed tensors must be contiguous (float32 scales)");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == nblocks && scales.size(2) == LANES, "woq_linear: scales must be [",
              nblocks, ", G, ", LANES, "] (one row of groups per column block), got ", scales.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->numel() == n), "woq_linear: bias must be [", n, "], got ",
              bias ? bias->sizes() : at::IntArrayRef{});
  TORCH_CHECK(codes.numel() * codes.element_size() == nblocks * (bits == 4 ? K * 4 : K * LANES * (bits / 8)),
              "woq_linear: codes do not match K=", K);
  TORCH_CHECK(bits != 4 || (K % 8 == 0 && zs), "woq_linear: int4 needs K % 8 == 0 and zs");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (bits != 4 || (K / G) % 8 == 0), "woq_linear: ", G,
              " groups do not divide K=", K, " (int4: into multiples of 8)");
  // Tensor ops below only where needed: at M = 1 each dispatcher round trip (reshape, to, empty) is a
  // visible part of a small layer's time.
  const at::Tensor x = x_in.dim() == 2 && x_in.is_contiguous() ? x_in : x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::detail::empty_cpu(out_shape, at::kFloat, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  if (M == 0) return y;
  const at::Tensor b = !bias ? at::Tensor()
                       : bias->scalar_type() == at::kFloat && bias->is_contiguous() ? *bias
                                                                                    : bias->to(at::kFloat).contiguous();
  TORCH_CHECK(!zs || (zs->scalar_type() == at::kFloat && zs->sizes() == scales.sizes()),
              "woq_linear: zs must be float32 shaped as scales");
  const at::Tensor zsc = zs ? zs->contiguous() : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const int64_t gsize = K / G;
#ifdef QTK_AVX2
  const bool gemv_path = M < rows_min(bits), rows_path = !gemv_path && M <= M_ROWS_MAX;
#else
  const bool gemv_path = M <= M_GEMV_MAX, rows_path = false;
#endif
#ifdef QTK_VNNI
  if (gemv_path && bits == 4 && M < limb_rows.load(std::memory_order_relaxed)) {  // its own sums of x^, not x's
    Limbs limbs;
    if (split_limbs(xp, M, K, G, limbs)) {
      const Args a{xp, xp, M, K, n, reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                   zsc.data_ptr<float>(), bias ? b.data_ptr<float>() : nullptr, nullptr, G, gsize, y.data_ptr<float>()};
      gemv_vnni(a, limbs);
      return y;
    }
  }
#endif
  // per call, small: the group sums of x (for the zeros) and, for the int4 gemv, x / 16^(k % 8)
  // (vectorizable loops: at M = 1 this prologue is part of a small layer's fixed cost)
  std::vector<float> xsum(zs ? M * G : 0), xs(gemv_path && !rows_path && bits == 4 ? M * K : 0);
  for (int64_t m = 0; m < (zs ? M : 0); ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = xp + m * K + g * gsize;
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= gsize; k += 8)
        for (int i = 0; i < 8; ++i) part[i] += xg[k + i];
      float acc = 0.f;
      for (; k < gsize; ++k) acc += xg[k];
      for (int i = 0; i < 8; ++i) acc += part[i];
      xsum[m * G + g] = acc;
    }
  static const float INV16[8] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096, 1.f / 65536, 1.f / 1048576,
                                 1.f / 16777216, 1.f};
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); i += 8)  // K % 8 == 0 for int4
    for (int j = 0; j < 8; ++j) xs[i + j] = xp[i + j] * INV16[j];
  Args a{xp, xs.empty() ? xp : xs.data(), M, K, n, reinterpret_cast<const uint8_t*>(codes.data_ptr()),
         scales.data_ptr<float>(), zs ? zsc.data_ptr<float>() : nullptr, bias ? b.data_ptr<float>() : nullptr,
         zs ? xsum.data() : nullptr, G, gsize, y.data_ptr<float>()};
  if (rows_path) {
#ifdef QTK_AVX2
    bits == 4 ? rows<4>(a) : bits == 8 ? rows<8>(a) : rows<16>(a);
#endif
  } else if (gemv_path) {
    bits == 4 ? gemv<4>(a) : bits == 8 ? gemv<8>(a) : gemv<16>(a);
  } else {
    const at::Tensor y2 = y.view({M, n});
    bits == 4 ? tiles<4>(a, x, y2, b) : bits == 8 ? tiles<8>(a, x, y2, b) : tiles<16>(a, x, y2, b);
  }
  return y;
}

bool compiled_avx2() {
#ifdef QTK_AVX2
  return true;
#else
  return false;
#endif
}

// Rows below which this build's int4 gemv multiplies x's 24-bit limbs (VNNI), not x itself; 0: never.
int64_t int4_limb_rows() {
#ifdef QTK_VNNI
  return limb_rows.load();
#else
  return 0;
#endif
}

// The rows below which the int4 gemv runs on VNNI where built (-1: the default; 0: never, every row multiplies
// x in float32; at most the gemv's rows, rows_min).
void set_int4_limb_rows(int64_t rows) {
#ifdef QTK_VNNI
  limb_rows.store(rows < 0 ? VNNI_ROWS_MAX : std::min<int64_t>(rows, rows_min(4)));
#else
  (void)rows;
#endif
}

bool compiled_avx512() {
#ifdef QTK_AVX512
  return true;
#else
  return false;
#endif
}

}  // namespace

// One library per build (QTK_LIB: qtk_cpu_avx2, qtk_cpu_generic), so both can be loaded side by side.
#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif
#define QTK_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define QTK_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

QTK_LIBRARY(QTK_LIB, m) {
  m.def("woq_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zs, Tensor? bias, int bits, int n) -> Tensor");
  m.def("compiled_avx2() -> bool", &compiled_avx2);
  m.def("compiled_avx512() -> bool", &compiled_avx512);
  m.def("int4_limb_rows() -> int", &int4_limb_rows);
  m.def("set_int4_limb_rows(int rows) -> ()", &set_int4_limb_rows);
}

QTK_LIBRARY_IMPL(QTK_LIB, CPU, m) { m.impl("woq_linear", &woq_linear); }

namespace QTK_LIB {
namespace ops {
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zs, const std::optional<at::Tensor>& bias, int64_t bits, int64_t n) {
  return ::woq_linear(x, codes, scales, zs, bias, bits, n);
}
}  // namespace ops

void bind_woq(pybind11::module_& m) {
  m.def("woq_linear", &woq_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("compiled_avx2", &compiled_avx2);
  m.def("compiled_avx512", &compiled_avx512);
  m.def("int4_limb_rows", &int4_limb_rows);
  m.def("set_int4_limb_rows", &set_int4_limb_rows);
}
}  // namespace QTK_LIB

