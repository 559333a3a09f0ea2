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

#include <cstdint>
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
  const int64_t c0 = b * LANES, cols = std::min<int64_t>(16, a.n - c0);
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512 o = _mm512_add_ps(acc[r], bias);
    if (a.bf16_out)
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + (m0 + r) * a.n + c0, mask, (__m256i)_mm512_cvtneps_pbh(o));
    else
      _mm512_mask_storeu_ps(static_cast<float*>(a.y) + (m0 + r) * a.n + c0, mask, o);
  }
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

// x [M, K] float32 or bf16 -> [K/2, M] words of bf16 pairs
static void transpose_pairs(const at::Tensor& x, uint32_t* xt) {
  const int64_t M = x.size(0), K = x.size(1), P = K / 2;
  if (x.scalar_type() == at::kBFloat16) {
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>() + m * x.stride(0));
      for (int64_t p = 0; p < P; ++p) xt[p * M + m] = row[p];
    }
    return;
  }
  std::vector<uint32_t> row(P);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x.data_ptr<float>() + m * x.stride(0);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {  // 32 floats -> 16 pairs (cvtne2ps: its second operand gives the low half)
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
      _mm512_storeu_si512(row.data() + k / 2, (__m512i)v);
    }
    if (k < K) {
      const int64_t left = K - k;
      const __mmask16 m1 = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m2 = left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m2, xr + k + 16), _mm512_maskz_loadu_ps(m1, xr + k));
      _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row.data()) + k, m1, _mm512_castsi512_si256((__m512i)v));
      if (m2) _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row.data()) + k + 16, m2,
                                       _mm512_extracti64x4_epi64((__m512i)v, 1));
    }
    for (int64_t p = 0; p < P; ++p) xt[p * M + m] = row[p];
  }
}

#pragma GCC pop_options
#endif

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
  std::vector<uint32_t> xt(K / 2 * M);
  transpose_pairs(x, xt.data());
  const Args a{reinterpret_cast<const uint16_t*>(codes.data_ptr()), xt.data(), bias ? bias->data_ptr<float>() : nullptr,
               M, K, n, nblocks, y.data_ptr(), bf16_out};
  at::parallel_for(0, (nblocks + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) columns(a, 2 * t);
  });
#endif
  return y;
}

}  // namespace

namespace QTK_LIB {
void bind_bf16_linear(pybind11::module_& m) {
  m.def("bf16_linear", &bf16_linear, pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("bf16_out") = false);
  m.def("bf16_linear_runs", &runs);
}
}  // namespace QTK_LIB
