// Prefill attention on x86 CPUs: FlashAttention's loop (Dao et al. 2022; FlashAttention-2's order:
// queries outside, keys inside, one running max and sum per query row) over a prefill chunk, in bf16 math
// (AVX512-BF16) or float32 math: in 16-lane vectors on AVX-512 (what a CPU without bf16 units runs), in
// 8-lane ones on AVX2 with FMA (the avx2 build: AVX2-only CPUs and Skylake-SP; QTK_ATTN_AVX2 below).
//
//   prefill_attention(q, k_cache, v_cache, slots, window, scale, k_scale, v_scale, bf16=True, out=None) -> o
//     q [n, H, D] float32 (heads contiguous, rows at any stride): the chunk's queries; k_cache, v_cache [KV, S, D]: float32, bf16, INT8 or
//     FP8 e4m3 (as uint8), read at slots [L], the keys in order, the chunk's own n last (query i
//     sits where key L - n + i does); k_scale, v_scale [1 or KV] for INT8 / FP8;
//     the query at p sees the keys at p - window < j <= p (window 0: every j <= p);
//     GQA: query head h reads KV head h / (H / KV), as transformers' repeat_kv.
//     o [n, H, D] float32: `out` where given (contiguous: the chunk's rows of the step's output, written in place
//     of a copy), else a new tensor.
//   prefill_attention_runs(bf16=True)   whether this build and CPU run it in that math
//
// Numerics. bf16 math is a bf16 FlashAttention's (vLLM's CPU attention in bf16 rounds the same tensors): q * scale,
// K, V and the softmax weights P rounded to bf16 (to nearest even), every sum in float32 (Q K^T, the
// softmax's denominator, P V). float32 math rounds nothing: it differs from torch's float32 attention by the
// exp2 polynomial (2e-7) and the order of the sums. INT8 and e4m3 codes are bf16 numbers, so a quantized cache
// loses nothing more: k_scale joins the query's scale and v_scale the output's.
//
// The work, for D % 16 == 0, in words of PER elements (Math<BF>: bf16 pairs for vdpbf16ps, which multiplies
// pairs and adds both products to a float32 lane; single float32 for vfmadd):
//   1. pack   each KV head's keys and values once, in blocks of BK = 64 keys, in the operands' layout:
//             K as [D/PER][BK] words (bf16: (k[j][2i], k[j][2i+1])): one 16-lane load is 16 keys' word i;
//             V as [BK/PER][D] words (bf16: (v[2j][d], v[2j+1][d])): one load is 16 dims of a word of keys.
//   2. attend for each (KV head, BQ = 32 query positions): rows are (position, head of the group), so
//             one K/V block serves the whole group. Per key block, per register tile of 4 rows, over the
//             block's first 16, 32, 48 or 64 keys (the last any of the 4 rows sees), in groups of GT = 4
//             tiles that take each phase in turn (group_block):
//             S = Q K^T (4 x 64 in registers, then L1); the causal / window mask (only where the diagonal or
//             the window's edge crosses); the online softmax in base 2 (log2 e joins the query's scale):
//             m = max(m, rowmax S) (the 4 rows' maxima in one transposing reduction),
//             alpha = 2^(m_old - m), l = alpha l + sum 2^(S - m) (16 lanes a row, summed at the end),
//             P = 2^(S - m) as words; O = alpha O + P V (alpha skipped where the 4 rows' are all 1).
//             Finally O / l.
// Work items are handed out largest first from one counter (causal items differ up to n / BQ times in
// size), on torch's threads. The AVX2 version keeps the blocks, tiles, work items and numerics of the
// float32 math; its 16 registers of 8 lanes cannot hold a tile's S, which goes through a buffer in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define QTK_ATTN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QTK_ATTN_AVX2 1  // the float32 prefill in 8-lane vectors (the avx2 build: AVX2 CPUs, Skylake-SP)
#endif

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif
#define QTK_INLINE inline __attribute__((always_inline))

namespace {

#include "cpu_kv.h"

// Whether this build and CPU run the kernels: the bf16 ones need AVX512-BF16, the float32 prefill AVX-512 alone
bool runs(bool bf16 = true) {
#if defined(QTK_ATTN_AVX512)
  return bf16 ? __builtin_cpu_supports("avx512bf16") : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#elif defined(QTK_ATTN_AVX2)
  return !bf16 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// ---- shared by both ISAs' prefill kernels: the problem, the blocks, the work items -----------------------------

constexpr int64_t BK = 64;  // keys per block: 4 vectors of 16 scores (AVX-512), 8 of 8 (AVX2)
constexpr int64_t BQ = 32;  // query positions per work item
constexpr int64_t MR = 4;   // query rows per register tile (row_max4 reduces exactly 4)
constexpr int GT = 4;       // register tiles per group (group_block: each phase over the group's tiles)
constexpr float kLog2e = 1.4426950408889634f;

struct Problem {
  int64_t n, H, KV, D, keys, window;  // keys = L; query i sits at key keys - n + i
  int64_t q_row;  // q's stride between tokens
  float scale;
  const float *q, *ks, *vs;  // ks / vs: per-head scales (nks / nvs of them: 1 or KV), or null
  int64_t nks, nvs;
  float* out;
  const uint32_t *kp, *vp;  // packed: head h, block b at ((h * blocks + b) * BK * D / PER)
  int64_t blocks;

  float q_scale(int64_t h) const { return scale * kLog2e * (ks ? ks[nks == 1 ? 0 : h] : 1.f); }  // base 2 softmax
  float v_scale(int64_t h) const { return vs ? vs[nvs == 1 ? 0 : h] : 1.f; }
};

// A thread's buffers, sized for BQ positions of the group (PER: elements per word)
struct Scratch {
  std::vector<uint32_t> q, p;     // q [rows][D / PER] words, p [GT][MR][BK / PER] words
  std::vector<float> s, o, lsum, m, alpha;  // s [GT][MR][BK], o [rows][D], lsum [rows][16], m and alpha [rows]

  Scratch(const Problem& P, int64_t PER) {
    const int64_t padded = (BQ * (P.H / P.KV) + MR - 1) / MR * MR;
    q.resize(padded * P.D / PER);
    p.resize(GT * MR * BK / PER);
    s.resize(GT * MR * BK);
    o.resize(padded * P.D);
    lsum.resize(padded * 16);
    m.resize(padded);
    alpha.resize(padded);
  }
  // a work item's start: O = 0, l = 0, m = -inf for its `rows` (padded) rows
  void reset(int64_t rows, int64_t D) {
    std::fill(o.begin(), o.begin() + rows * D, 0.f);
    std::fill(lsum.begin(), lsum.begin() + rows * 16, 0.f);
    std::fill(m.begin(), m.begin() + rows, -INFINITY);
  }
};

// The keys of block b that a register tile (rows r .. r + MR of a work item: positions from i0, `rows` real ones,
// padding rows the last one's) computes: the block's first 16 nc, nc returned (0: none of the tile's rows sees any,
// its state stays as it is). all: every row sees every computed key; else seen[row]: a bit per key it sees.
inline int64_t tile_keys(const Problem& P, int64_t i0, int64_t rows, int64_t r, int64_t b, uint64_t (&seen)[MR], bool& all) {
  const int64_t G = P.H / P.KV, j0 = b * BK;
  // keys j seen by the row at position p: lo(p) <= j < hi(p); the tile's rows span positions pa .. pz
  auto hi_of = [&](int64_t p) { return p + 1; };
  auto lo_of = [&](int64_t p) { return P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : int64_t(0); };
  auto pos = [&](int64_t row) { return P.keys - P.n + i0 + std::min(row, rows - 1) / G; };
  const int64_t pa = pos(r), pz = pos(r + MR - 1);
  const int64_t keys = std::min(BK, hi_of(pz) - j0);  // the block's keys any row of the tile sees start there
  if (keys <= 0 || lo_of(pa) >= j0 + BK) return 0;
  const int64_t nc = (keys + 15) / 16;
  all = j0 + 16 * nc <= hi_of(pa) && j0 >= lo_of(pz);
  for (int rr = 0; rr < MR && !all; ++rr) {
    const int64_t p = pos(r + rr);
    const int64_t lo = std::clamp<int64_t>(lo_of(p) - j0, 0, BK), hi = std::clamp<int64_t>(hi_of(p) - j0, 0, BK);
    const uint64_t below = hi >= 64 ? ~uint64_t(0) : (uint64_t(1) << hi) - 1;
    seen[rr] = lo >= 64 ? 0 : below & ~((uint64_t(1) << lo) - 1);
  }
  return nc;
}

// The key blocks [b0, b1) the queries at positions i0 .. i1 - 1 of the chunk read
inline std::pair<int64_t, int64_t> item_blocks(const Problem& P, int64_t i0, int64_t i1) {
  const int64_t p0 = P.keys - P.n + i0, p1 = P.keys - P.n + i1 - 1;
  return {(P.window > 0 ? std::max<int64_t>(0, p0 - P.window + 1) : 0) / BK, (p1 + 1 + BK - 1) / BK};
}

// Steps 1 and 2 over a chunk: pack(h, j0, kp, vp) packs head h's block of keys from j0 (words of PER elements),
// on torch's threads; then attend(h, i0, i1, T) takes each work item (KV head, BQ query positions), handed out
// largest first from one counter (causal items differ up to n / BQ times in size), a Scratch per thread
template <int64_t PER, class Pack, class Attend>
void run_chunk(Problem& P, Pack&& pack, Attend&& attend) {
  const int64_t W = P.D / PER;
  P.blocks = (P.keys + BK - 1) / BK;
  // only the blocks some query reads: with a window the keys before the first query's go unread
  const int64_t lo_block = (P.window > 0 ? std::max<int64_t>(0, P.keys - P.n - P.window + 1) : 0) / BK;
  std::vector<uint32_t> kp(P.KV * P.blocks * BK * W), vp(P.KV * P.blocks * BK * W);
  const int64_t nb = P.blocks - lo_block;
  at::parallel_for(0, P.KV * nb, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / nb, b = lo_block + t % nb;
      pack(h, b * BK, kp.data() + (h * P.blocks + b) * BK * W, vp.data() + (h * P.blocks + b) * BK * W);
    }
  });
  P.kp = kp.data();
  P.vp = vp.data();
  const int64_t qblocks = (P.n + BQ - 1) / BQ, items = P.KV * qblocks;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch T(P, PER);
    for (int64_t t; (t = next.fetch_add(1)) < items;) {
      const int64_t qb = qblocks - 1 - t / P.KV, h = t % P.KV;  // the last queries (the most keys) first
      attend(h, qb * BQ, std::min(P.n, (qb + 1) * BQ), T);
    }
  });
}

#ifdef QTK_ATTN_AVX512
#pragma GCC push_options
#pragma GCC target("avx512bf16")  // these functions only: the build's other code runs on CPUs without it


// 16 keys' or values' elements as float32 from any cache dtype (codes, unscaled)
template <Kv KIND>
inline __m512 load16(const kv_t<KIND>* p) {
  if constexpr (KIND == Kv::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (KIND == Kv::BF16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else if constexpr (KIND == Kv::I8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_i32gather_ps(idx, e4m3().v, 4);
  }
}

// 32 floats -> 16 words, word i = (bf16(lo[2i]), bf16(lo[2i + 1])) for i < 8, then hi's: a row's pairs
inline __m512i pairs32(__m512 lo, __m512 hi) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)); }

// bf16 (rounded to nearest even) of a in the low half of each word, of b in the high half
inline __m512i interleave16(__m512 a, __m512 b) {
  const __m256i ab = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a)), bb = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(_mm512_cvtepu16_epi32(ab), _mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
}

// 2^x for x <= 0 (-inf included: 0): x = n + f, |f| <= 1/2, 2^f by a polynomial of degree DEG with p(0) = 1
// (so a row whose maximum stays rescales by exactly 1), fitted for relative error: below 2e-7 in float32 for
// degree 5, 3e-6 for 4 (bf16 weights round by up to 2e-3 anyway); times 2^n by vscalefps (0 below 2^-149)
template <int DEG = 5>
inline __m512 exp2_16(__m512 x) {
  static_assert(DEG == 4 || DEG == 5);
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (DEG == 5) {
    p = _mm512_set1_ps(1.3264725e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6715130e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507336e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314700e-1f));
  } else {
    p = _mm512_set1_ps(9.5828455e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906430e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024099e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312418e-1f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The two ways a product is taken. Operands are words of PER elements: bf16 pairs (BF: vdpbf16ps multiplies
// the pairs of two words and adds both products to a float32 lane) or single float32 (vfmadd).
template <bool BF>
struct Math {
  static constexpr int64_t PER = BF ? 2 : 1;
  static constexpr int EXP_DEGREE = BF ? 4 : 5;  // the weights' precision: bf16's 2^-9, float32's 2^-24
  static QTK_INLINE __m512 word(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(*p))); }
  static QTK_INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) {
    if constexpr (BF) return _mm512_dpbf16_ps(acc, as_bh(_mm512_castps_si512(a)), as_bh(_mm512_castps_si512(b)));
    else return _mm512_fmadd_ps(a, b, acc);
  }
  // 32 elements of a row (hi: the next 16, zero past the row's end) as words at dst
  static QTK_INLINE void put32(uint32_t* dst, __m512 lo, __m512 hi) {
    if constexpr (BF) {
      _mm512_storeu_si512(dst, pairs32(lo, hi));
    } else {
      _mm512_storeu_ps(dst, lo);
      _mm512_storeu_ps(dst + 16, hi);
    }
  }
};

// Step 1: keys j0 .. j0 + BK of one head (rows past `keys` zero) into kp [D/PER][BK] and vp [BK/PER][D] words.
template <bool BF, Kv KIND>
void pack_block(const kv_t<KIND>* kh, const kv_t<KIND>* vh, const int64_t* slots, int64_t j0, int64_t keys,
                int64_t D, uint32_t* kp, uint32_t* vp) {
  constexpr int64_t PER = Math<BF>::PER;
  std::memset(kp, 0, sizeof(uint32_t) * D / PER * BK);
  std::memset(vp, 0, sizeof(uint32_t) * BK / PER * D);
  alignas(64) uint32_t w[32];
  for (int64_t jj = 0; jj < BK && j0 + jj < keys; ++jj) {
    const kv_t<KIND>* row = kh + slots[j0 + jj] * D;
    for (int64_t d = 0; d < D; d += 32) {  // D % 16 == 0: the last 16 pair with zeros if D % 32 != 0
      const __m512 lo = load16<KIND>(row + d), hi = d + 16 < D ? load16<KIND>(row + d + 16) : _mm512_setzero_ps();
      Math<BF>::put32(w, lo, hi);
      const int64_t words = std::min<int64_t>(32, D - d) / PER;
      for (int64_t i = 0; i < words; ++i) kp[(d / PER + i) * BK + jj] = w[i];
    }
  }
  for (int64_t jj = 0; jj < BK && j0 + jj < keys; jj += PER) {
    const kv_t<KIND>* a = vh + slots[j0 + jj] * D;
    if constexpr (BF) {
      const kv_t<KIND>* b = j0 + jj + 1 < keys ? vh + slots[j0 + jj + 1] * D : nullptr;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(vp + jj / 2 * D + d, interleave16(load16<KIND>(a + d), b ? load16<KIND>(b + d) : _mm512_setzero_ps()));
    } else {
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vp + jj * D + d, load16<KIND>(a + d));
    }
  }
}

// S = Q K^T for MR rows and the block's first NC vectors of 16 keys (the rest -inf): q [MR][W] words,
// kp [W][BK] words
template <bool BF, int NC>
QTK_INLINE void scores(const uint32_t* q, const uint32_t* kp, int64_t W, __m512 (&s)[MR][4]) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = c < NC ? _mm512_setzero_ps() : _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < W; ++i) {
    __m512 k[NC];
    for (int c = 0; c < NC; ++c) k[c] = _mm512_loadu_ps(kp + i * BK + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = Math<BF>::word(q + r * W + i);
      for (int c = 0; c < NC; ++c) s[r][c] = Math<BF>::dot(s[r][c], a, k[c]);
    }
  }
}

// lanes 0 .. 3: the maxima of rows 0 .. 3 (each over its 4 vectors): a 4 x 16 transpose-and-reduce
QTK_INLINE __m128 row_max4(const __m512 (&s)[MR][4]) {
  __m512 v[MR];
  for (int r = 0; r < MR; ++r) v[r] = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
  const __m512 t01 = _mm512_max_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));  // (r0, r1, r0, r1)
  const __m512 t23 = _mm512_max_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  __m512 u = _mm512_max_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));  // (r0 .. r3) per 128 bits
  u = _mm512_max_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E));
  u = _mm512_max_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1));
  return _mm512_castps512_ps128(u);
}

// The online softmax of a register tile's scores (the first NC vectors of each row; the rest are -inf), in base 2: m = max(m, rowmax S), alpha = 2^(m_old - m),
// l = alpha l + sum 2^(S - m) (kept as 16 lanes a row: summed once, at the end), P = 2^(S - m) as words
// [MR][BK/PER]. Returns whether some row's alpha is not 1 (its O must be rescaled).
template <bool BF, int NC>
QTK_INLINE bool softmax_tile(const __m512 (&s)[MR][4], float* m, float* alpha, float* lsum, uint32_t* p) {
  const __m128 old = _mm_loadu_ps(m), top = _mm_max_ps(old, row_max4(s));
  // a row that has seen nothing yet (all -inf, a window's first keys) shifts by 0: its weights are 0
  const __m128 shift = _mm_mask_mov_ps(top, _mm_cmp_ps_mask(top, _mm_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm_setzero_ps());
  const __m128 al = _mm512_castps512_ps128(exp2_16<Math<BF>::EXP_DEGREE>(_mm512_zextps128_ps512(_mm_sub_ps(old, shift))));
  _mm_storeu_ps(m, top);
  _mm_storeu_ps(alpha, al);
  alignas(16) float sh[4];
  _mm_store_ps(sh, shift);
  constexpr int64_t PW = BK / Math<BF>::PER;
  for (int r = 0; r < MR; ++r) {
    const __m512 b = _mm512_set1_ps(sh[r]);
    __m512 e[4];
    for (int c = 0; c < 4; ++c) e[c] = c < NC ? exp2_16<Math<BF>::EXP_DEGREE>(_mm512_sub_ps(s[r][c], b)) : _mm512_setzero_ps();
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
    _mm512_storeu_ps(lsum + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(lsum + 16 * r), _mm512_set1_ps(alpha[r]), sum));
    Math<BF>::put32(p + r * PW, e[0], e[1]);
    Math<BF>::put32(p + r * PW + 32 / Math<BF>::PER, e[2], e[3]);
  }
  return _mm_cmp_ps_mask(al, _mm_set1_ps(1.f), _CMP_NEQ_UQ) != 0;
}

// O rows r .. r + MR, dims d0 .. d0 + 16 NV: o = alpha o + P V over the block's first `words` words of P's
// rows, p [MR][BK/PER] words, vp [BK/PER][D] words
template <bool BF, int NV>
QTK_INLINE void pv_tile(const uint32_t* p, const uint32_t* vp, int64_t words, int64_t D, int64_t d0, const float* alpha,
                        bool rescale, float* o) {
  constexpr int64_t PW = BK / Math<BF>::PER;
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NV; ++c) {
      acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + 16 * c);
      if (rescale) acc[r][c] = _mm512_mul_ps(al, acc[r][c]);
    }
  }
  for (int64_t jp = 0; jp < words; ++jp) {
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(vp + jp * D + d0 + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = Math<BF>::word(p + r * PW + jp);
      for (int c = 0; c < NV; ++c) acc[r][c] = Math<BF>::dot(acc[r][c], a, v[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

// A register tile's S = Q K^T over one key block, its first nc vectors of 16 keys (the rest -inf), masked where
// seen is given (a bit per key a row sees; null: all), stored to out [MR][BK] floats
template <bool BF>
QTK_INLINE void tile_scores(const uint32_t* q, const uint32_t* kp, int64_t W, int64_t nc, const uint64_t* seen, float* out) {
  __m512 s[MR][4];
  switch (nc) {
    case 4: scores<BF, 4>(q, kp, W, s); break;
    case 3: scores<BF, 3>(q, kp, W, s); break;
    case 2: scores<BF, 2>(q, kp, W, s); break;
    default: scores<BF, 1>(q, kp, W, s); break;
  }
  if (seen)
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < 4; ++c)
        s[r][c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(seen[r] >> (16 * c)), s[r][c]);
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + BK * r + 16 * c, s[r][c]);
}

// The online softmax (softmax_tile) of a tile's stored scores in [MR][BK]
template <bool BF>
QTK_INLINE bool tile_softmax(const float* in, int64_t nc, float* m, float* alpha, float* lsum, uint32_t* p) {
  __m512 s[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_loadu_ps(in + BK * r + 16 * c);
  switch (nc) {
    case 4: return softmax_tile<BF, 4>(s, m, alpha, lsum, p);
    case 3: return softmax_tile<BF, 3>(s, m, alpha, lsum, p);
    case 2: return softmax_tile<BF, 2>(s, m, alpha, lsum, p);
    default: return softmax_tile<BF, 1>(s, m, alpha, lsum, p);
  }
}

// A tile's O = alpha O + P V over the block's first nc vectors of keys, 64 dims at a time
template <bool BF>
QTK_INLINE void tile_pv(const uint32_t* p, const uint32_t* vp, int64_t nc, int64_t D, const float* alpha, bool rescale, float* o) {
  const int64_t words = 16 * nc / Math<BF>::PER;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(4, (D - d0) / 16)) {
      case 4: pv_tile<BF, 4>(p, vp, words, D, d0, alpha, rescale, o); break;
      case 3: pv_tile<BF, 3>(p, vp, words, D, d0, alpha, rescale, o); break;
      case 2: pv_tile<BF, 2>(p, vp, words, D, d0, alpha, rescale, o); break;
      default: pv_tile<BF, 1>(p, vp, words, D, d0, alpha, rescale, o); break;
    }
  }
}

// Rows r0 .. r0 + GT MR of a work item (positions from i0, `rows` real ones, `padded` in all) against key block
// b: the keys some row of each tile sees, in three phases over the group's GT register tiles (S = Q K^T and the
// mask; the softmax; O = alpha O + P V), each phase's tiles independent. Tile by tile, each phase waited on the
// one before (the scores' last products, the maxima's reduction, P's stores), which the out-of-order window
// could not cover: the group takes 3-8% off a head's attention at 256-1024 tokens on one Zen 5 core.
template <bool BF>
void group_block(const Problem& P, int64_t h, int64_t i0, int64_t rows, int64_t padded, int64_t r0, int64_t b, Scratch& T) {
  constexpr int64_t PW = BK / Math<BF>::PER;
  const int64_t D = P.D, W = D / Math<BF>::PER;
  const uint32_t* kp = P.kp + (h * P.blocks + b) * BK * W;
  const uint32_t* vp = P.vp + (h * P.blocks + b) * BK * W;
  const int tiles = static_cast<int>(std::min<int64_t>(GT, (padded - r0) / MR));
  int64_t nc[GT];
  bool rescale[GT];
  for (int t = 0; t < tiles; ++t) {
    const int64_t r = r0 + t * MR;
    uint64_t seen[MR];
    bool all;
    nc[t] = tile_keys(P, i0, rows, r, b, seen, all);
    if (nc[t]) tile_scores<BF>(T.q.data() + r * W, kp, W, nc[t], all ? nullptr : seen, T.s.data() + t * MR * BK);
  }
  for (int t = 0; t < tiles; ++t) {
    const int64_t r = r0 + t * MR;
    if (nc[t])
      rescale[t] = tile_softmax<BF>(T.s.data() + t * MR * BK, nc[t], T.m.data() + r, T.alpha.data() + r, T.lsum.data() + 16 * r,
                                    T.p.data() + t * MR * PW);
  }
  for (int t = 0; t < tiles; ++t) {
    const int64_t r = r0 + t * MR;
    if (nc[t]) tile_pv<BF>(T.p.data() + t * MR * PW, vp, nc[t], D, T.alpha.data() + r, rescale[t], T.o.data() + r * D);
  }
}

// Step 2 for KV head h and query positions i0 .. i1
template <bool BF>
void attend(const Problem& P, int64_t h, int64_t i0, int64_t i1, Scratch& T) {
  constexpr int64_t PER = Math<BF>::PER;
  const int64_t G = P.H / P.KV, D = P.D, W = D / PER;
  const int64_t rows = (i1 - i0) * G, padded = (rows + MR - 1) / MR * MR;
  // the queries, scaled (log2 e: the softmax in base 2), as words, row (i - i0) G + g for position i and
  // head g of the group; padding rows zero
  const __m512 qs = _mm512_set1_ps(P.q_scale(h));
  std::fill(T.q.begin() + rows * W, T.q.begin() + padded * W, 0u);
  alignas(64) uint32_t w[32];
  for (int64_t i = i0; i < i1; ++i) {
    const float* src = P.q + i * P.q_row + h * G * D;
    uint32_t* dst = T.q.data() + (i - i0) * G * W;
    for (int64_t g = 0; g < G; ++g, src += D, dst += W) {
      int64_t d = 0;
      for (; d + 32 <= D; d += 32)
        Math<BF>::put32(dst + d / PER, _mm512_mul_ps(_mm512_loadu_ps(src + d), qs), _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), qs));
      if (d < D) {  // D % 32 == 16: the last 16 paired with zeros
        Math<BF>::put32(w, _mm512_mul_ps(_mm512_loadu_ps(src + d), qs), _mm512_setzero_ps());
        for (int64_t k = 0; k < 16 / PER; ++k) dst[d / PER + k] = w[k];
      }
    }
  }
  T.reset(padded, D);
  const auto [b0, b1] = item_blocks(P, i0, i1);
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < padded; r += GT * MR) group_block<BF>(P, h, i0, rows, padded, r, b, T);
  const float vscale = P.v_scale(h);
  for (int64_t i = i0, r = 0; i < i1; ++i) {
    float* dst = P.out + (i * P.H + h * G) * D;
    for (int64_t g = 0; g < G; ++g, ++r, dst += D) {
      const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(T.lsum.data() + 16 * r));
      const __m512 inv = _mm512_set1_ps(l > 0.f ? vscale / l : 0.f);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(T.o.data() + r * D + d)));
    }
  }
}

template <bool BF, Kv KIND>
void run(Problem& P, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots) {
  const int64_t D = P.D, S = k_cache.size(1);
  const kv_t<KIND>* kc = reinterpret_cast<const kv_t<KIND>*>(k_cache.data_ptr());
  const kv_t<KIND>* vc = reinterpret_cast<const kv_t<KIND>*>(v_cache.data_ptr());
  run_chunk<Math<BF>::PER>(
      P, [&](int64_t h, int64_t j0, uint32_t* kp, uint32_t* vp) {
        pack_block<BF, KIND>(kc + h * S * D, vc + h * S * D, slots, j0, P.keys, D, kp, vp); },
      [&](int64_t h, int64_t i0, int64_t i1, Scratch& T) { attend<BF>(P, h, i0, i1, T); });
}

template <bool BF>
void dispatch(Kv kind, Problem& P, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots) {
  if (kind == Kv::F32) run<BF, Kv::F32>(P, k_cache, v_cache, slots);
  else if (kind == Kv::BF16) run<BF, Kv::BF16>(P, k_cache, v_cache, slots);
  else if (kind == Kv::I8) run<BF, Kv::I8>(P, k_cache, v_cache, slots);
  else run<BF, Kv::F8>(P, k_cache, v_cache, slots);
}

// ---- decode: each sequence's one query against its paged context, in a bf16 cache --------------------------
// For the decode rows of a step whose matmuls run in bf16 (a batched decode of a bf16 checkpoint), with the
// prefill kernel's numerics: q * scale and the softmax weights rounded to bf16, the sums float32. A work item
// is the query heads of one KV head of one sequence (split further when there are few sequences, as in
// cpu_layers.cpp's float32 kernel), over its keys in tiles of 16, read in place through the block table:
//   Q K^T  per key: a dpbf16 per 32 dims of its row against the head's q pairs (16 lanes of partial sums),
//          then 16 keys' lanes summed at once by a tree of unpacks and lane shuffles into 16 scores;
//   softmax in base 2 (log2 e joins the scores' scale), softcap and sinks as the float32 kernel;
//   P V    per pair of keys: their rows interleaved by two unpacks (pairs (v[2i][d], v[2i+1][d]), dims in a
//          lane order undone once at the end), a dpbf16 per 32 dims for each head against its weights' pair.

// lane j of the result: the sum of x[j]'s 16 lanes
static QTK_INLINE __m512 sum16x16(const __m512 (&x)[16]) {
  __m512 y[8], z[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // 128-bit lane l of y[i]: (x[2i], x[2i+1]) x (elements 0+2, 1+3 of lane l)
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // lane l of z[k]: keys 4k .. 4k + 3, each summed over lane l
    const __m512d a = _mm512_castps_pd(y[2 * k]), b = _mm512_castps_pd(y[2 * k + 1]);
    z[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 32 bf16 of a row from dim d (the last 16 alone when D - d == 16)
static QTK_INLINE __m512i row32(const uint16_t* row, int64_t d, int64_t D) {
  return D - d >= 32 ? _mm512_loadu_si512(row + d) : _mm512_maskz_loadu_epi16(0xFFFF, row + d);
}

constexpr int DECODE_HEADS = 8;
constexpr int64_t DECODE_AHEAD = 64;  // keys ahead whose rows are asked for  // query heads per P V pass: 2 accumulators each per 32 dims

struct DecodeItem {
  const uint16_t* const* krow;  // the context's L key and value rows, in order
  const uint16_t* const* vrow;
  int64_t L, D;
  const float* q;  // ng rows of D, at stride qs
  int64_t ng, qs;
  float scale, softcap;
  const float* sinks;  // ng, or null
  float* out;          // ng rows of D, contiguous
};

static void decode_item(const DecodeItem& it, std::vector<uint32_t>& qp, std::vector<float>& sc, std::vector<uint32_t>& pp) {
  const int64_t L = it.L, D = it.D, ng = it.ng, half = (D + 31) / 32 * 16;  // pairs per head, padded to 16
  const float qscale = it.softcap > 0.f ? it.scale : it.scale * kLog2e;  // softcap: on natural-scale scores
  qp.assign(ng * half, 0);
  for (int64_t g = 0; g < ng; ++g) {
    const float* qr = it.q + g * it.qs;
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask16 m2 = D - d >= 32 ? 0xFFFF : 0;
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(qr + d), _mm512_set1_ps(qscale));
      const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(m2, qr + d + 16), _mm512_set1_ps(qscale));
      _mm512_storeu_si512(qp.data() + g * half + d / 2, pairs32(lo, hi));
    }
  }
  const int64_t Lp = (L + 15) / 16 * 16;
  sc.resize(ng * Lp);
  const int64_t row_bytes = D * 2;
  for (int64_t j = 0; j < std::min<int64_t>(L, DECODE_AHEAD); ++j)  // the first tiles' keys
    for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(it.krow[j]) + c, _MM_HINT_T0);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {  // Q K^T: 16 keys at a time, every head of the item
    const uint16_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = it.krow[j0 + j < L ? j0 + j : j0];
    // a sequence's blocks lie anywhere in the pool: ask for the next tile's keys, and this tile's values
    // (into L2, for P V), while this one computes, rather than wait for each row
    for (int64_t j = j0; j < std::min(L, j0 + 16); ++j)
      for (int64_t c = 0; c < row_bytes; c += 64) {
        if (j + DECODE_AHEAD < L) _mm_prefetch(reinterpret_cast<const char*>(it.krow[j + DECODE_AHEAD]) + c, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(it.vrow[j]) + c, _MM_HINT_T1);
      }
    for (int64_t g = 0; g < ng; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(qp.data() + g * half + d / 2));
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], as_bh(row32(rows[j], d, D)), qv);
      }
      _mm512_storeu_ps(sc.data() + g * Lp + j0, sum16x16(acc));
    }
  }
  const int64_t npairs = (L + 1) / 2;
  pp.resize(ng * npairs);
  for (int64_t g = 0; g < ng; ++g) {  // softmax, in base 2; the weights rounded to bf16 in pairs
    float* s = sc.data() + g * Lp;
    if (it.softcap > 0.f)
      for (int64_t j = 0; j < L; ++j) s[j] = it.softcap * std::tanh(s[j] / it.softcap) * kLog2e;
    const float sink = it.sinks ? it.sinks[g] * kLog2e : -INFINITY;
    float mx = sink;
    for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
    for (int64_t j = L; j < Lp; ++j) s[j] = -INFINITY;
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 16) {
      const __m512 e = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(s + j, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.f / (_mm512_reduce_add_ps(total) + (it.sinks ? std::exp2(sink - mx) : 0.f));
    for (int64_t j = 0; j < Lp; j += 32) {  // Lp % 16 == 0; past L the weights are 0
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(inv));
      const __m512 hi = j + 16 < Lp ? _mm512_mul_ps(_mm512_loadu_ps(s + j + 16), _mm512_set1_ps(inv)) : _mm512_setzero_ps();
      alignas(64) uint32_t w[16];
      _mm512_store_si512(w, pairs32(lo, hi));
      for (int64_t i = 0; i < 16 && j / 2 + i < npairs; ++i) pp[g * npairs + j / 2 + i] = w[i];
    }
  }
  // dims of the unpacked accumulators: lo lane 4l + t is dim 8l + t, hi's is 8l + 4 + t (per 32 dims)
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t g0 = 0; g0 < ng; g0 += DECODE_HEADS) {  // P V: 32 dims at a time, up to 8 heads
    const int64_t nh = std::min<int64_t>(DECODE_HEADS, ng - g0);
    for (int64_t d = 0; d < D; d += 32) {
      __m512 lo[DECODE_HEADS], hi[DECODE_HEADS];
#pragma GCC unroll 8
      for (int g = 0; g < DECODE_HEADS; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
      for (int64_t i = 0; i < npairs; ++i) {
        const __m512i a = row32(it.vrow[2 * i], d, D);
        const __m512i b = row32(it.vrow[2 * i + 1 < L ? 2 * i + 1 : 2 * i], d, D);  // a lone last key: weight 0
        const __m512bh ul = as_bh(_mm512_unpacklo_epi16(a, b)), uh = as_bh(_mm512_unpackhi_epi16(a, b));
#pragma GCC unroll 8
        for (int g = 0; g < DECODE_HEADS; ++g) {
          if (g < nh) {
            const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pp[(g0 + g) * npairs + i])));
            lo[g] = _mm512_dpbf16_ps(lo[g], ul, p);
            hi[g] = _mm512_dpbf16_ps(hi[g], uh, p);
          }
        }
      }
#pragma GCC unroll 8
      for (int g = 0; g < DECODE_HEADS; ++g) {
        if (g < nh) {
          float* o = it.out + (g0 + g) * D + d;
          _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo[g], first, hi[g]));
          if (D - d >= 32) _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo[g], second, hi[g]));
        }
      }
    }
  }
}

void decode_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                const at::Tensor& lens, int64_t bs, float scale, int64_t window, float softcap, const float* sinks,
                at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(0), S = k_cache.size(1);
  const int64_t G = H / KV, W = tables.size(1);
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t splits = B * KV < 2 * at::get_num_threads() ? G : 1;  // few sequences: split the heads too
  const int64_t items = B * KV * splits;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const uint16_t*> krow, vrow;
    std::vector<uint32_t> qp, pp;
    std::vector<float> sc, o;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (KV * splits), h = (i / splits) % KV, sp = i % splits;
      const int64_t g0 = sp * G / splits, g1 = (sp + 1) * G / splits, n = ln[b];
      TORCH_CHECK(n >= 1, "paged_decode_attention_bf16: context length ", n, " of sequence ", b, " (at least 1)");
      TORCH_CHECK((n + bs - 1) / bs <= W, "paged_decode_attention_bf16: context longer than its block table");
      const int64_t first = window > 0 && n > window ? n - window : 0, L = n - first;
      krow.resize(L);
      vrow.resize(L);
      for (int64_t blk = first / bs; blk * bs < n; ++blk) {
        const int64_t base = tb[b * W + blk] * bs;
        TORCH_CHECK(base >= 0 && base + bs <= S, "paged_decode_attention_bf16: block table points outside the cache");
        for (int64_t off = std::max(first - blk * bs, int64_t(0)); off < bs && blk * bs + off < n; ++off) {
          krow[blk * bs + off - first] = kc + (h * S + base + off) * D;
          vrow[blk * bs + off - first] = vc + (h * S + base + off) * D;
        }
      }
      if (g1 == g0) continue;
      const DecodeItem it{krow.data(), vrow.data(), L, D, q.data_ptr<float>() + b * q.stride(0) + (h * G + g0) * q.stride(1),
                          g1 - g0, q.stride(1), scale, softcap, sinks ? sinks + h * G + g0 : nullptr,
                          out.data_ptr<float>() + (b * H + h * G + g0) * D};
      decode_item(it, qp, sc, pp);
    }
  });
}

#pragma GCC pop_options
#endif  // QTK_ATTN_AVX512

#ifdef QTK_ATTN_AVX2
// ---- prefill on AVX2 CPUs: the float32 math in vectors of 8 -------------------------------------------------
// The AVX-512 kernel's blocks, work items and float32 numerics (K packed as [D][BK], V as [BK][D], the online
// softmax in base 2 with the same exp2 polynomial), tiled for 16 registers of 8 lanes, too few to hold a
// 4-row tile's scores for a block of 64 keys. Per register tile of 4 rows and key block:
//   S = Q K^T  per 16 keys a 4 x 16 micro-tile (8 accumulators: 2 key loads and 4 broadcasts feed 8 FMAs a
//              dim), masked, into s [MR][BK] (1 KB, in L1);
//   softmax    per row over s: m, alpha, l as the AVX-512 kernel's; P written over S;
//   P V        per 16 dims a 4 x 16 micro-tile of O (alpha applied as it is loaded) over the keys computed.

// 8 keys' or values' elements as float32 from any cache dtype (codes, unscaled)
template <Kv KIND>
QTK_INLINE __m256 load8(const kv_t<KIND>* p) {
  if constexpr (KIND == Kv::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (KIND == Kv::BF16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (KIND == Kv::I8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_i32gather_ps(e4m3().v, idx, 4);
  }
}

// 2^x for x <= 0 (-inf: 0): x = n + f, |f| <= 1/2, 2^f by the AVX-512 kernel's degree-5 polynomial (p(0) = 1,
// relative error below 2e-7), times 2^n made in the exponent bits (0 for n <= -127: a weight below 2^-126 of
// the row's largest, which is 1)
QTK_INLINE __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3264725e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6715130e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5507336e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022242e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314700e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

QTK_INLINE float reduce8(__m256 v, bool max) {
  __m128 x = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_movehl_ps(x, x);
  x = max ? _mm_max_ps(x, y) : _mm_add_ps(x, y);
  const __m128 z = _mm_movehdup_ps(x);
  return _mm_cvtss_f32(max ? _mm_max_ss(x, z) : _mm_add_ss(x, z));
}

// lanes whose bit of `bits` (8 of them) is set keep s, the others -inf
QTK_INLINE __m256 keep8(__m256 s, uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(on));
}

inline float* as_f32(uint32_t* p) { return reinterpret_cast<float*>(p); }
inline const float* as_f32(const uint32_t* p) { return reinterpret_cast<const float*>(p); }

// Step 1: keys j0 .. j0 + BK of one head (rows past `keys` zero) into kp [D][BK] and vp [BK][D]
template <Kv KIND>
void pack_block8(const kv_t<KIND>* kh, const kv_t<KIND>* vh, const int64_t* slots, int64_t j0, int64_t keys, int64_t D,
                 float* kp, float* vp) {
  std::memset(kp, 0, sizeof(float) * D * BK);
  std::memset(vp, 0, sizeof(float) * BK * D);
  alignas(32) float w[8];
  for (int64_t jj = 0; jj < BK && j0 + jj < keys; ++jj) {
    const kv_t<KIND>*k = kh + slots[j0 + jj] * D, *v = vh + slots[j0 + jj] * D;
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_store_ps(w, load8<KIND>(k + d));
      for (int i = 0; i < 8; ++i) kp[(d + i) * BK + jj] = w[i];
      _mm256_storeu_ps(vp + jj * D + d, load8<KIND>(v + d));
    }
  }
}

// A tile's pass over one key block, its first 16 nc keys: S into s, the mask (seen: a bit per key a row sees, or
// null: all), the softmax, O = alpha O + P V
void tile_pass8(const float* q, const float* kp, const float* vp, int64_t D, int64_t nc, const uint64_t* seen, float* m,
                float* alpha, float* lsum, float* s, float* o) {
  __m256 top[MR];  // each row's largest score, kept as the scores are stored
  for (int r = 0; r < MR; ++r) top[r] = _mm256_set1_ps(-INFINITY);
  for (int64_t c = 0; c < nc; ++c) {  // S = Q K^T, 16 keys at a time
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* k = kp + 16 * c;
    for (int64_t i = 0; i < D; ++i) {
      const __m256 k0 = _mm256_loadu_ps(k + i * BK), k1 = _mm256_loadu_ps(k + i * BK + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(q + r * D + i);
        acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) {
        const __m256 x = seen ? keep8(acc[r][v], static_cast<uint32_t>(seen[r] >> (16 * c + 8 * v)) & 0xFF) : acc[r][v];
        _mm256_storeu_ps(s + r * BK + 16 * c + 8 * v, x);
        top[r] = _mm256_max_ps(top[r], x);
      }
  }
  alignas(32) float shift[8] = {}, step[8] = {};  // the rows' new maxima (0 for a row that has seen nothing
  for (int r = 0; r < MR; ++r) {                  // yet: its weights are 0), and the old ones less those
    const float mx = std::max(m[r], reduce8(top[r], true));
    shift[r] = mx == -INFINITY ? 0.f : mx;
    step[r] = m[r] - shift[r];
    m[r] = mx;
  }
  _mm_storeu_ps(alpha, _mm256_castps256_ps128(exp2_8(_mm256_load_ps(step))));  // 2^0 is exactly 1
  bool rescale = false;
  for (int r = 0; r < MR; ++r) {  // the online softmax in base 2, P over S
    float* sr = s + r * BK;
    rescale |= alpha[r] != 1.f;
    const __m256 b = _mm256_set1_ps(shift[r]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t v = 0; v < 2 * nc; ++v) {
      const __m256 e = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(sr + 8 * v), b));
      _mm256_storeu_ps(sr + 8 * v, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(lsum + 8 * r, _mm256_fmadd_ps(_mm256_loadu_ps(lsum + 8 * r), _mm256_set1_ps(alpha[r]), sum));
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {  // O = alpha O + P V, 16 dims at a time
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) {
        acc[r][v] = _mm256_loadu_ps(o + r * D + d0 + 8 * v);
        if (rescale) acc[r][v] = _mm256_mul_ps(_mm256_set1_ps(alpha[r]), acc[r][v]);
      }
    for (int64_t j = 0; j < 16 * nc; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vp + j * D + d0), v1 = _mm256_loadu_ps(vp + j * D + d0 + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(s + r * BK + j);
        acc[r][0] = _mm256_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(o + r * D + d0 + 8 * v, acc[r][v]);
  }
}

// Step 2 for KV head h and query positions i0 .. i1
void attend8(const Problem& P, int64_t h, int64_t i0, int64_t i1, Scratch& T) {
  const int64_t G = P.H / P.KV, D = P.D;
  const int64_t rows = (i1 - i0) * G, padded = (rows + MR - 1) / MR * MR;
  float* q = as_f32(T.q.data());  // the queries, scaled; padding rows zero
  std::fill(q + rows * D, q + padded * D, 0.f);
  const __m256 qs = _mm256_set1_ps(P.q_scale(h));
  for (int64_t i = i0, r = 0; i < i1; ++i) {  // row (i - i0) G + g: position i, head g of the group
    const float* src = P.q + i * P.q_row + h * G * D;
    for (int64_t g = 0; g < G; ++g, ++r, src += D)
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(q + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), qs));
  }
  T.reset(padded, D);
  const auto [b0, b1] = item_blocks(P, i0, i1);
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < padded; r += MR) {
      uint64_t seen[MR];
      bool all;
      const int64_t nc = tile_keys(P, i0, rows, r, b, seen, all);
      if (nc == 0) continue;
      const float* kp = as_f32(P.kp) + (h * P.blocks + b) * BK * D;
      const float* vp = as_f32(P.vp) + (h * P.blocks + b) * BK * D;
      tile_pass8(q + r * D, kp, vp, D, nc, all ? nullptr : seen, T.m.data() + r, T.alpha.data() + r,
                 T.lsum.data() + 8 * r, as_f32(T.p.data()), T.o.data() + r * D);
    }
  const float vscale = P.v_scale(h);
  for (int64_t i = i0, r = 0; i < i1; ++i) {
    float* dst = P.out + (i * P.H + h * G) * D;
    for (int64_t g = 0; g < G; ++g, ++r, dst += D) {
      const float l = reduce8(_mm256_loadu_ps(T.lsum.data() + 8 * r), false);
      const __m256 inv = _mm256_set1_ps(l > 0.f ? vscale / l : 0.f);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(inv, _mm256_loadu_ps(T.o.data() + r * D + d)));
    }
  }
}

template <Kv KIND>
void run8(Problem& P, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots) {
  const int64_t D = P.D, S = k_cache.size(1);
  const kv_t<KIND>* kc = reinterpret_cast<const kv_t<KIND>*>(k_cache.data_ptr());
  const kv_t<KIND>* vc = reinterpret_cast<const kv_t<KIND>*>(v_cache.data_ptr());
  run_chunk<1>(
      P, [&](int64_t h, int64_t j0, uint32_t* kp, uint32_t* vp) {
        pack_block8<KIND>(kc + h * S * D, vc + h * S * D, slots, j0, P.keys, D, as_f32(kp), as_f32(vp)); },
      [&](int64_t h, int64_t i0, int64_t i1, Scratch& T) { attend8(P, h, i0, i1, T); });
}
#endif  // QTK_ATTN_AVX2

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t window, double scale,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool bf16,
                             const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(runs(bf16), bf16 ? "prefill_attention: needs AVX-512 with AVX512-BF16 (this build or CPU has not; the torch "
              "path attends here)" : "prefill_attention: needs AVX-512, or AVX2 and FMA (this build or CPU has not; the torch "
              "path attends here)");
  const Kv kind = kv_kind(k_cache);
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 &&
              q.stride(1) == q.size(2), "prefill_attention: q must be float32 [n, H, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
              k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == q.size(2) &&
              q.size(1) % k_cache.size(0) == 0,
              "prefill_attention: caches must be contiguous [kv_heads, slots, D], both of one shape, with heads % kv_heads == 0");
  TORCH_CHECK(q.size(2) % 16 == 0, "prefill_attention: head_dim must be a multiple of 16, got ", q.size(2));
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() >= q.size(0),
              "prefill_attention: slots must be int64 [L] with L >= n (the chunk's own keys last)");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0");
  TORCH_CHECK((kind == Kv::F32 || kind == Kv::BF16) == !k_scale.has_value() && k_scale.has_value() == v_scale.has_value(),
              "prefill_attention: scales go with (and only with) an INT8 / FP8 cache");
  TORCH_CHECK(!out_opt || (out_opt->scalar_type() == at::kFloat && out_opt->sizes() == q.sizes() && out_opt->is_contiguous()),
              "prefill_attention: out must be contiguous float32 of q's shape ", q.sizes());
  at::Tensor out = out_opt ? *out_opt : at::empty(q.sizes(), q.options());
#if defined(QTK_ATTN_AVX512) || defined(QTK_ATTN_AVX2)
  const at::Tensor sl = slots.contiguous();
  const int64_t S = k_cache.size(1);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t j = 0; j < sl.numel(); ++j) TORCH_CHECK(sp[j] >= 0 && sp[j] < S, "prefill_attention: a slot is outside the cache");
  at::Tensor ks, vs;
  if (k_scale) {
    ks = kv_scale(*k_scale, k_cache.size(0), "prefill_attention");
    vs = kv_scale(*v_scale, k_cache.size(0), "prefill_attention");
  }
  Problem P{q.size(0), q.size(1), k_cache.size(0), q.size(2), sl.numel(), window, q.stride(0), static_cast<float>(scale),
            q.data_ptr<float>(), k_scale ? ks.data_ptr<float>() : nullptr, k_scale ? vs.data_ptr<float>() : nullptr,
            k_scale ? ks.numel() : 0, k_scale ? vs.numel() : 0, out.data_ptr<float>(), nullptr, nullptr, 0};
  if (P.n == 0) return out;
#if defined(QTK_ATTN_AVX512)
  if (bf16) dispatch<true>(kind, P, k_cache, v_cache, sp);
  else dispatch<false>(kind, P, k_cache, v_cache, sp);
#else
  if (kind == Kv::F32) run8<Kv::F32>(P, k_cache, v_cache, sp);
  else if (kind == Kv::BF16) run8<Kv::BF16>(P, k_cache, v_cache, sp);
  else if (kind == Kv::I8) run8<Kv::I8>(P, k_cache, v_cache, sp);
  else run8<Kv::F8>(P, k_cache, v_cache, sp);
#endif
#endif
  return out;
}


at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size,
                                       double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(runs(), "paged_decode_attention_bf16: needs AVX-512 with AVX512-BF16 (this build or CPU has not; "
              "paged_decode_attention attends there)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
              "paged_decode_attention_bf16: q must be float32 [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(0) == 0,
              "paged_decode_attention_bf16: caches must be contiguous bf16 [kv_heads, slots, D], both of one shape, "
              "with heads % kv_heads == 0");
  TORCH_CHECK(q.size(2) % 16 == 0, "paged_decode_attention_bf16: head_dim must be a multiple of 16, got ", q.size(2));
  TORCH_CHECK(block_size > 0, "paged_decode_attention_bf16: block_size must be positive, got ", block_size);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == q.size(0) && lens.scalar_type() == at::kLong && lens.is_contiguous() &&
              lens.numel() == q.size(0), "paged_decode_attention_bf16: block_tables [B, W] and lens [B] must be int64");
  at::Tensor sk;
  if (sinks) {
    TORCH_CHECK(sinks->numel() == q.size(1), "paged_decode_attention_bf16: sinks must hold one value per query head (",
                q.size(1), "), got ", sinks->numel());
    sk = sinks->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#ifdef QTK_ATTN_AVX512
  if (q.size(0))
    decode_run(q, k_cache, v_cache, block_tables, lens, block_size, static_cast<float>(scale), window,
               static_cast<float>(softcap), sinks ? sk.data_ptr<float>() : nullptr, out);
#endif
  return out;
}
}  // namespace

namespace QTK_LIB {
void bind_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("prefill_attention_runs", &runs, py::arg("bf16") = true);
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>(), py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("window"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("bf16") = true,
        py::arg("out") = py::none());
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16, py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
}
}  // namespace QTK_LIB
