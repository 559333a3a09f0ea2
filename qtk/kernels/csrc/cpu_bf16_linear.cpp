// Layers kept in bf16 multiplied in bf16 on CPUs with AVX512-BF16, for the rows of a batched decode step
// (a few to a few tens): the weights are a bf16 checkpoint's, in cpu_woq.cpp's layout for bits 16
// (int16 [N/8, K, 8]: column blocks of 8, row k of a block 8 adjacent bf16), the same copy the float32
// kernel reads for fewer rows.
//
//   bf16_linear(x, codes, bias, n, bf16_out) -> y
//     x [M, K] float32 or bf16, K even: rounded to bf16 (to nearest even);
//     y [M, n] = x W^T + bias (bias float32 [n] or None), the sums in float32; y float32, or rounded to
//     bf16 (bf16_out: what oneDNN's bf16 matmul returns, for a step that stays in bf16 between norms).
//   bf16_linear_runs()   whether this build and CPU run it (AVX-512 with the BF16 dot product)
//   woq_bf16_linear(x, codes, scales, zeros, bias, bits, n, bf16_out) -> y
//     the same for a weight-only int4 / int8 layer in cpu_woq.cpp's layout (kernels.cpu.pack), zeros int32
//     shaped as scales (kernels.cpu.code_zeros) or None (symmetric int8): y = x dequant(W)^T + bias with x
//     rounded to bf16, the codes less their zeros exact in bf16, float32 sums scaled once per group. For a
//     bf16 checkpoint's prefill chunks and decode batches (runtime/packed_linear.py QuantBF16Matmul): about
//     2x the float32 kernel's decoded tiles + sgemm at 128-512 rows, 0.95-1.0 of oneDNN's bf16 matmul on
//     bf16 weights; from 10-12 rows faster than the float32 kernel's gemv (see packed_linear.QUANT_BF16_ROWS).
//
// Why: a decode step of 16 sequences multiplies 16 rows by every weight. The float32 kernel is bound by
// the float32 FMA's arithmetic there, and oneDNN's bf16 matmul is slow at so few rows (see packed_linear.py
// for the measurements); vdpbf16ps multiplies two pairs of bf16 per float32 lane (twice an FMA's products
// per instruction), and 16 rows make the step's weights, read once, about as costly as its arithmetic.
//
// The work: threads take tiles of 16 columns (column blocks b and b + 1). Per pair of weight rows (k, k + 1)
// one 32-byte load from each block and one vpermw give the 16 columns' pairs (w[k][j], w[k+1][j]) in the
// operand layout of vdpbf16ps; each feeds MR (up to 16) rows of x, whose pairs (x[k], x[k+1]) the
// instruction broadcasts from memory (x is transposed first into [K/2][M] pairs, so a step's broadcasts
// share a cache line). A tile's weights come from memory once for up to 16 rows; more rows take more
// passes over the tile, from cache.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QTK_BF16_AVX512 1
#endif

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif

namespace {

constexpr int64_t LANES = 8;  // columns per block of the layout (cpu_woq.cpp)
constexpr int64_t AHEAD = 1;  // tiles ahead that a thread fetches into L2

bool runs() {
#ifdef QTK_BF16_AVX512
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#ifdef QTK_BF16_AVX512
#pragma GCC push_options
#pragma GCC target("avx512bf16")  // these functions only: the build's other code runs on CPUs without it
#define QTK_INLINE inline __attribute__((always_inline))

// word 2j and 2j + 1 of the result: column j's (row k, row k + 1), from a register holding block b's rows
// k, k + 1 (words 0-7, 8-15) and block b + 1's (16-23, 24-31)
alignas(64) const uint16_t PAIRS[32] = {0, 8,  1, 9,  2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                        16, 24, 17, 25, 18, 26, 19, 27, 20, 28, 21, 29, 22, 30, 23, 31};

// y[m0 + r, c0 .. c0 + 16) = acc[r] + bias for the MR rows (columns past n masked), float32 or rounded to bf16
template <int MR>
static QTK_INLINE void store_rows(const __m512 (&acc)[MR], const float* bias, void* y, int64_t n, int64_t m0,
                                  int64_t c0, bool bf16_out) {
  const int64_t cols = std::min<int64_t>(16, n - c0);
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512 o = _mm512_add_ps(acc[r], b);
    if (bf16_out)
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + (m0 + r) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(o));
    else
      _mm512_mask_storeu_ps(static_cast<float*>(y) + (m0 + r) * n + c0, mask, o);
  }
}

struct Args {
  const uint16_t* codes;  // [nblocks, K, 8] bf16
  const uint32_t* xt;     // [K/2, M]: (x[m, 2p], x[m, 2p + 1]) as bf16 in one word
  const float* bias;
  int64_t M, K, n, nblocks;
  void* y;  // [M, n] float32 or bf16
  bool bf16_out;
};

// rows m0..m0+MR against the tile of blocks b, b + 1 (b + 1 absent when `one`)
template <int MR, bool PREFETCH>
static void tile(const Args& a, int64_t b, int64_t m0, bool one) {
  const __m512i idx = _mm512_load_si512(PAIRS);
  const uint16_t* lo = a.codes + b * a.K * LANES;
  const uint16_t* hi = lo + a.K * LANES;
  const uint32_t* x = a.xt + m0;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t P = a.K / 2;
  const uint16_t* next = lo + AHEAD * 2 * a.K * LANES;  // a later tile's blocks, fetched ahead into L2
  const bool ahead = PREFETCH && b + AHEAD * 2 + 1 < a.nblocks;
  for (int64_t p = 0; p < P; ++p) {
    if (ahead && (p & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + p * 2 * LANES), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + a.K * LANES + p * 2 * LANES), _MM_HINT_T1);
    }
    const __m256i wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + p * 2 * LANES));
    const __m256i wh = one ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + p * 2 * LANES));
    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(wl), wh, 1));
    const uint32_t* xp = x + p * a.M;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r])));
  }
  store_rows<MR>(acc, a.bias, a.y, a.n, m0, b * LANES, a.bf16_out);
}

// rows m0..m0+MR, MR = 1..16 at run time (the first pass over a tile fetches the next one)
template <int MR = 16>
static QTK_INLINE void rows(const Args& a, int64_t b, int64_t m0, int mr, bool one) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows<MR - 1>(a, b, m0, mr, one);
  }
  m0 == 0 ? tile<MR, true>(a, b, m0, one) : tile<MR, false>(a, b, m0, one);
}

static void columns(const Args& a, int64_t b) {
  const bool one = b + 1 >= a.nblocks;
  for (int64_t m = 0; m < a.M; m += 16) rows(a, b, m, static_cast<int>(std::min<int64_t>(16, a.M - m)), one);
}

// row xr [K] float32 -> [K/2] words of bf16 pairs (to nearest even), K even
static void row_pairs(const float* xr, int64_t K, uint32_t* row) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // 32 floats -> 16 pairs (cvtne2ps: its second operand gives the low half)
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
    _mm512_storeu_si512(row + k / 2, (__m512i)v);
  }
  if (k < K) {
    const int64_t left = K - k;
    const __mmask16 m1 = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m2 = left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m2, xr + k + 16), _mm512_maskz_loadu_ps(m1, xr + k));
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row) + k, m1, _mm512_castsi512_si256((__m512i)v));
    if (m2) _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row) + k + 16, m2,
                                     _mm512_extracti64x4_epi64((__m512i)v, 1));
  }
}

// x [M, K] float32 or bf16 -> [K/2, M] words of bf16 pairs: row m read in place where x is bf16 (at an even
// stride), else converted into a buffer first
static void transpose_pairs(const at::Tensor& x, uint32_t* xt) {
  const int64_t M = x.size(0), K = x.size(1), P = K / 2, ld = x.stride(0);
  const bool bf = x.scalar_type() == at::kBFloat16;
  const c10::BFloat16* xb = bf ? x.data_ptr<c10::BFloat16>() : nullptr;
  const float* xf = bf ? nullptr : x.data_ptr<float>();
  std::vector<uint32_t> buf(P);
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* row = bf ? reinterpret_cast<const uint32_t*>(xb + m * ld) : buf.data();
    if (!bf) row_pairs(xf + m * ld, K, buf.data());
    for (int64_t p = 0; p < P; ++p) xt[p * M + m] = row[p];
  }
}

// ---- Weight-only int4 / int8 layers in bf16 (woq_bf16_linear) ----
//
// A tile of 16 columns (blocks b, b + 1) is decoded once into w [K/2][16] words: column j's pair
// (c[k][j], c[k+1][j]) with c = u - z, the stored code less its zero, as bf16: integers of at most 8
// significant bits (int4 -15..15, int8 -255..255), so exact. Then every QR rows of x multiply it:
// per group, vdpbf16ps sums x * c in float32, and acc += sum * s[g] once per group. So
// y = sum_g s[g] sum_{k in g} c[k] x[k]: the float32 kernel's sum, with x rounded to bf16.
// The rows of x are read in place as bf16 pairs (a bf16 x as it is, a float32 x rounded once per call into
// a row-major copy), each pair broadcast from its row as oneDNN's brgemm reads A; an earlier [K/2][12]
// transposed copy cost 9% of a layer in scattered stores.
// Blocking, per thread: its column tiles are decoded in groups of up to DECODED_BYTES (each tile once per
// call), and each group is multiplied by x in chunks of XT_CHUNK_BYTES, so both stay in L2. Tiles go in
// pairs (qtile: 8 rows x 32 columns), each broadcast of x feeding two vdpbf16ps. Its 16 group sums stay in
// registers; of its 16 totals, touched once per group, the compiler keeps what the 32 registers leave room
// for. Zen 5, whose two 512-bit units each start a vdpbf16ps a cycle, needs the 16 sums in flight: SmolLM2's
// four layer shapes, int4 g64, 256-1024 rows, 945-949 GFLOP/s (92% of the bf16 peak) against 831-851 with
// 6 rows (12 sums, the Zen 4 choice, where 6 rows gave 0.95-1.0 of oneDNN's bf16 matmul: against 0.87 for
// 12 rows x 16 columns and 0.93 for 12 x 32 with the totals in L1), 910-916 with 12 rows.
constexpr int QR = 8;  // rows of the micro-kernel (qtile): 8 x 32 columns
constexpr int64_t DECODED_BYTES = 256 * 1024;   // a thread's decoded tiles at once: a quarter of the L2
constexpr int64_t XT_CHUNK_BYTES = 256 * 1024;  // x per pass over them: a quarter of the L2 (2-core Zen 4, 128-512 rows: 1.2-1.5x faster than all of x per tile)

struct QArgs {
  const uint8_t* codes;   // int4 [nblocks, K/8, 8] words, int8 [nblocks, K, 8]
  const float* scales;    // [nblocks, G, 8]
  const int32_t* zeros;   // [nblocks, G, 8] zero of the stored codes, or null (symmetric int8)
  const float* bias;
  const uint32_t* x;      // [M] rows of K/2 words of bf16 pairs, `ld` words apart
  int64_t ld, M, K, n, nblocks, G, gsize;
  void* y;
  bool bf16_out;
};

// 16 lanes: 8 words of block b and 8 of block b + 1 (zeros where `one`) at element offset `off` of each
static QTK_INLINE __m512i two_blocks32(const uint32_t* lo, const uint32_t* hi, int64_t off, bool one) {
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + off));
  const __m256i h = one ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + off));
  return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}

// (a[j], b[j]) small integers (exact in bf16) -> word j = bf16(a[j]) | bf16(b[j]) << 16
static QTK_INLINE __m512i bf16_pairs(__m512i a, __m512i b) {
  const __m512i fa = _mm512_castps_si512(_mm512_cvtepi32_ps(a)), fb = _mm512_castps_si512(_mm512_cvtepi32_ps(b));
  return _mm512_or_si512(_mm512_srli_epi32(fa, 16), _mm512_and_si512(fb, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Decode the tile of blocks b, b + 1 into w [K/2][16] words (see above) and s [G][16] scales.
template <int BITS>
static void decode_pairs(const QArgs& a, int64_t b, uint32_t* w, float* s) {
  const bool one = b + 1 >= a.nblocks;
  const int64_t G = a.G;
  std::vector<__m512i> z(G);
  for (int64_t g = 0; g < G; ++g) {
    const float* s0 = a.scales + (b * G + g) * LANES;
    const __m256 sh = one ? _mm256_setzero_ps() : _mm256_loadu_ps(s0 + G * LANES);
    _mm512_store_ps(s + g * 16, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(s0)), sh, 1));
    if (a.zeros) {
      const int32_t* z0 = a.zeros + (b * G + g) * LANES;
      z[g] = two_blocks32(reinterpret_cast<const uint32_t*>(z0), reinterpret_cast<const uint32_t*>(z0 + G * LANES), 0, one);
    } else {
      z[g] = _mm512_setzero_si512();
    }
  }
  if constexpr (BITS == 4) {
    const uint32_t* lo = reinterpret_cast<const uint32_t*>(a.codes) + b * a.K;  // a block: K/8 words x 8 lanes
    const uint32_t* hi = lo + a.K;
    const __m512i nib = _mm512_set1_epi32(0xF);
    for (int64_t kb = 0; kb < a.K / 8; ++kb) {
      const __m512i v = two_blocks32(lo, hi, kb * LANES, one), zg = z[kb * 8 / a.gsize];
      uint32_t* o = w + kb * 4 * 16;
#define QTK_PAIR(q)                                                                                       \
  _mm512_store_si512(o + (q) * 16, bf16_pairs(                                                            \
      _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * (q)), nib), zg),                          \
      _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * (q) + 4), nib), zg)))
      QTK_PAIR(0); QTK_PAIR(1); QTK_PAIR(2); QTK_PAIR(3);
#undef QTK_PAIR
    }
  } else {
    const int8_t* lo = reinterpret_cast<const int8_t*>(a.codes) + b * a.K * LANES;  // a block: K rows x 8 lanes
    const int8_t* hi = lo + a.K * LANES;
    auto row = [&](int64_t k) {  // row k of both blocks as 16 int32
      const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo + k * LANES));
      const __m128i h = one ? _mm_setzero_si128() : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi + k * LANES));
      return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(l, h));
    };
    for (int64_t p = 0; p < a.K / 2; ++p) {
      const __m512i zg = z[2 * p / a.gsize];
      _mm512_store_si512(w + p * 16, bf16_pairs(_mm512_sub_epi32(row(2 * p), zg), _mm512_sub_epi32(row(2 * p + 1), zg)));
    }
  }
}

// rows m0 .. m0 + MR (MR <= QR) against two decoded tiles, blocks b .. b + 3 (32 columns): each broadcast
// of x feeds two products; 2 MR group sums and 2 MR totals in registers. A thread's odd last tile goes
// alone (`pair` false: w1, s1 are w0, s0 again and the second half is not stored).
template <int MR>
static void qtile(const QArgs& a, const uint32_t* w0, const uint32_t* w1, const float* s0, const float* s1,
                  int64_t b, bool pair, int64_t m0) {
  const int64_t gp = a.gsize / 2, ld = a.ld;
  const uint32_t* x = a.x + m0 * a.ld;
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 g0[MR], g1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) g0[r] = g1[r] = _mm512_setzero_ps();
    for (int64_t p = g * gp; p < (g + 1) * gp; ++p) {
      const __m512bh v0 = (__m512bh)_mm512_load_si512(w0 + p * 16), v1 = (__m512bh)_mm512_load_si512(w1 + p * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ld + p]));
        g0[r] = _mm512_dpbf16_ps(g0[r], v0, xv);
        g1[r] = _mm512_dpbf16_ps(g1[r], v1, xv);
      }
    }
    const __m512 t0 = _mm512_load_ps(s0 + g * 16), t1 = _mm512_load_ps(s1 + g * 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c0[r] = _mm512_fmadd_ps(g0[r], t0, c0[r]);
      c1[r] = _mm512_fmadd_ps(g1[r], t1, c1[r]);
    }
  }
  store_rows<MR>(c0, a.bias, a.y, a.n, m0, b * LANES, a.bf16_out);
  if (pair && (b + 2) * LANES < a.n) store_rows<MR>(c1, a.bias, a.y, a.n, m0, (b + 2) * LANES, a.bf16_out);
}

template <int MR = QR>
static QTK_INLINE void qrows(const QArgs& a, const uint32_t* w0, const uint32_t* w1, const float* s0,
                             const float* s1, int64_t b, bool pair, int64_t m0, int mr) {
  if constexpr (MR > 1) {
    if (mr < MR) return qrows<MR - 1>(a, w0, w1, s0, s1, b, pair, m0, mr);
  }
  qtile<MR>(a, w0, w1, s0, s1, b, pair, m0);
}

template <int BITS>
static void woq_bf16_tiles(const QArgs& a) {
  at::parallel_for(0, (a.nblocks + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
    const int64_t tile_words = a.K / 2 * 16;
    // tiles decoded at once: an even number (qtile takes them in pairs), at least 2
    const int64_t group = std::min<int64_t>(std::max<int64_t>(DECODED_BYTES / (tile_words * 4) / 2 * 2, 2), t1 - t0);
    const int64_t chunk = std::max<int64_t>(QR, XT_CHUNK_BYTES / (a.K / 2 * 4) / QR * QR);  // rows of x per pass
    uint32_t* w = static_cast<uint32_t*>(std::aligned_alloc(64, group * tile_words * 4));
    float* s = static_cast<float*>(std::aligned_alloc(64, group * a.G * 16 * 4));
    for (int64_t g0 = t0; g0 < t1; g0 += group) {
      const int64_t g1 = std::min(t1, g0 + group);
      for (int64_t t = g0; t < g1; ++t) decode_pairs<BITS>(a, 2 * t, w + (t - g0) * tile_words, s + (t - g0) * a.G * 16);
      for (int64_t c0 = 0; c0 < a.M; c0 += chunk) {
        const int64_t c1 = std::min(a.M, c0 + chunk);
        for (int64_t t = g0; t < g1; t += 2) {
          const bool pair = t + 1 < g1;
          const uint32_t* w0 = w + (t - g0) * tile_words;
          const float* s0 = s + (t - g0) * a.G * 16;
          const uint32_t* w1 = pair ? w0 + tile_words : w0;
          const float* s1 = pair ? s0 + a.G * 16 : s0;
          for (int64_t m = c0; m < c1; m += QR)
            qrows(a, w0, w1, s0, s1, 2 * t, pair, m, static_cast<int>(std::min<int64_t>(QR, c1 - m)));
        }
      }
    }
    std::free(w);
    std::free(s);
  });
}

// x [M, K] float32 -> out [M, K/2] words of bf16 pairs
static void rows_to_pairs(const at::Tensor& x, uint32_t* out) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) row_pairs(xp + m * ld, K, out + m * (K / 2));
  });
}

#pragma GCC pop_options
#endif

// The calling thread's buffer for x's bf16 pairs, at least `words` long, kept between calls: every word
// is written before it is read, so it is neither zeroed nor freshly mapped per call (a zeroed vector of a
// 512-row chunk's pairs cost 5% of a layer, its page faults as much again). It grows to the largest call's x
// (a 512-token step of K = 14336: 15 MB) and stays.
static uint32_t* x_buffer(int64_t words) {
  thread_local std::vector<uint32_t> buf;
  if (static_cast<int64_t>(buf.size()) < words) buf.resize(words);
  return buf.data();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& codes, const std::optional<at::Tensor>& bias, int64_t n,
                       bool bf16_out) {
  TORCH_CHECK(runs(), "bf16_linear: needs AVX-512 with AVX512-BF16 (this build or CPU has not; the float32 kernel "
              "or oneDNN runs these layers there)");
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.stride(0) % 2 == 0),
              "bf16_linear: x must be a float32 or bf16 CPU matrix with contiguous rows (bf16: at even strides)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_linear: K must be even (pairs of bf16), got ", K);
  TORCH_CHECK(codes.scalar_type() == at::kShort && codes.dim() == 3 && codes.size(1) == K && codes.size(2) == LANES &&
              codes.is_contiguous(), "bf16_linear: codes must be int16 [N/8, K, 8] (kernels.cpu.pack_bf16), got ",
              codes.sizes(), " for K=", K);
  const int64_t nblocks = codes.size(0);
  TORCH_CHECK(nblocks * LANES >= n && nblocks * LANES < n + LANES, "bf16_linear: codes hold ", nblocks,
              " column blocks for n=", n);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == n && bias->is_contiguous()),
              "bf16_linear: bias must be float32 [", n, "]");
  at::Tensor y = at::detail::empty_cpu({M, n}, bf16_out ? at::kBFloat16 : at::kFloat, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt);
#ifdef QTK_BF16_AVX512
  if (M == 0) return y;
  uint32_t* xt = x_buffer(K / 2 * M);
  transpose_pairs(x, xt);
  const Args a{reinterpret_cast<const uint16_t*>(codes.data_ptr()), xt, bias ? bias->data_ptr<float>() : nullptr,
               M, K, n, nblocks, y.data_ptr(), bf16_out};
  at::parallel_for(0, (nblocks + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) columns(a, 2 * t);
  });
#endif
  return y;
}


at::Tensor woq_bf16_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits,
                           int64_t n, bool bf16_out) {
  TORCH_CHECK(runs(), "woq_bf16_linear: needs AVX-512 with AVX512-BF16 (this build or CPU has not; the float32 "
              "kernel runs these layers there)");
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.stride(0) % 2 == 0),
              "woq_bf16_linear: x must be a float32 or bf16 CPU matrix with contiguous rows (bf16: at even strides)");
  TORCH_CHECK(bits == 4 || bits == 8, "woq_bf16_linear: bits must be 4 or 8 (bf16 weights: bf16_linear)");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nblocks = codes.size(0);
  TORCH_CHECK(K % 8 == 0, "woq_bf16_linear: K must be a multiple of 8, got ", K);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() * codes.element_size() == nblocks * (bits == 4 ? K * 4 : K * LANES),
              "woq_bf16_linear: codes (kernels.cpu.pack) do not match K=", K);
  TORCH_CHECK(nblocks * LANES >= n && nblocks * LANES < n + LANES, "woq_bf16_linear: codes hold ", nblocks,
              " column blocks for n=", n);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == nblocks && scales.size(2) == LANES, "woq_bf16_linear: scales must be float32 [",
              nblocks, ", G, 8], got ", scales.sizes());
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % (bits == 4 ? 8 : 2) == 0, "woq_bf16_linear: ", G,
              " groups do not divide K=", K, " into multiples of ", bits == 4 ? 8 : 2);
  TORCH_CHECK(bits == 8 || zeros, "woq_bf16_linear: int4 needs zeros");
  TORCH_CHECK(!zeros || (zeros->scalar_type() == at::kInt && zeros->is_contiguous() && zeros->sizes() == scales.sizes()),
              "woq_bf16_linear: zeros must be int32 shaped as scales");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == n && bias->is_contiguous()),
              "woq_bf16_linear: bias must be float32 [", n, "]");
  at::Tensor y = at::detail::empty_cpu({M, n}, bf16_out ? at::kBFloat16 : at::kFloat, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt);
#ifdef QTK_BF16_AVX512
  if (M == 0) return y;
  const uint32_t* xp;  // x's rows as bf16 pairs: x itself when bf16
  int64_t ld;
  if (x.scalar_type() == at::kBFloat16) {
    xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
    ld = x.stride(0) / 2;
  } else {
    uint32_t* buf = x_buffer(M * (K / 2));
    rows_to_pairs(x, buf);
    xp = buf;
    ld = K / 2;
  }
  const QArgs a{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                zeros ? zeros->data_ptr<int32_t>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, xp, ld,
                M, K, n, nblocks, G, K / G, y.data_ptr(), bf16_out};
  bits == 4 ? woq_bf16_tiles<4>(a) : woq_bf16_tiles<8>(a);
#endif
  return y;
}

}  // namespace

namespace QTK_LIB {
void bind_bf16_linear(pybind11::module_& m) {
  m.def("bf16_linear", &bf16_linear, pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("bf16_out") = false);
  m.def("bf16_linear_runs", &runs);
  m.def("woq_bf16_linear", &woq_bf16_linear, pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("zeros"), pybind11::arg("bias"),
        pybind11::arg("bits"), pybind11::arg("n"), pybind11::arg("bf16_out") = false);
}
}  // namespace QTK_LIB
