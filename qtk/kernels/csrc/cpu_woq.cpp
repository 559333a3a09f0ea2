// Weight-only quantized linear layers on x86 CPUs: y = x @ dequant(W)^T + b, float32 activations,
// int4 or int8 weight codes decoded in registers (the float weight is never written to memory).
//
// Why: decoding one token reads every weight once, so a CPU decode step is bound by memory
// bandwidth; int4 codes are 8x fewer bytes than float32. torch has no fast kernel for float32
// activations on AVX2 (see qtk/kernels/cpu.py for the measurements), so qtk carries this one.
//
// Layout (built once per layer by qtk.kernels.cpu.pack): columns in blocks of 8, one AVX2 lane each.
//   int4: codes  int32  [N/8, K]     word (nb, k) holds q[k, 8nb + j] in bits 4j..4j+3 (two's complement)
//   int8: codes  int8   [N/8, K, 8]  q[k, 8nb + j]
//   scales       float  [N/8, G, 8]  s[g, n] (G groups along K; 1 for per-channel)
//   zs           float  [N/8, G, 8]  s[g, n] * z[g, n] for asymmetric codes (W = (q - z) s), else absent
// Then y[m, n] = sum_g ( s[g, n] * sum_{k in g} q[k, n] x[m, k]  -  zs[g, n] * sum_{k in g} x[m, k] ):
// the inner loop is one FMA per weight on integer codes converted in registers, and the scale and
// zero apply once per group.
//
// Two paths, chosen by M (rows of x):
//   gemv: 2 rows per pass, register-blocked over 4 column blocks (32 columns) so 4 or 8 FMA chains
//         run at once; a tile's codes (32 columns x K) stay in L1 between passes.
//   tiles: larger M: each thread decodes a tile of 64 columns into a float buffer that stays in
//         its cache, then multiplies with at::mm_out (MKL / oneDNN sgemm) straight into y.
// Both parallelise over column tiles with torch's intra-op threads (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QTK_AVX2 1
#endif

namespace {

constexpr int64_t LANES = 8;    // columns per block (one AVX2 register of floats)
constexpr int NT = 4;           // column blocks per gemv tile: 32 columns
constexpr int64_t TILE_COLS = 64;  // columns per tile on the large-M path

// Decode 8 weights (one per lane) at row k of a column block: the codes as floats.
#ifdef QTK_AVX2
template <int BITS>
static inline __m256 load_codes(const uint8_t* blk, int64_t k) {
  if constexpr (BITS == 4) {
    // nibble j to the top of lane j, then an arithmetic shift back: the signed code
    const __m256i shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    __m256i w = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(blk)[k]);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(w, shifts), 28));
  } else {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + k * LANES));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}
#endif

template <int BITS>
static inline float code_at(const uint8_t* blk, int64_t k, int lane) {
  if constexpr (BITS == 4) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(blk)[k] << (28 - 4 * lane);
    return static_cast<float>(static_cast<int32_t>(w) >> 28);
  } else {
    return static_cast<float>(reinterpret_cast<const int8_t*>(blk)[k * LANES + lane]);
  }
}

template <int BITS>
constexpr int64_t block_bytes(int64_t K) { return BITS == 4 ? K * 4 : K * LANES; }

struct Args {
  const float* x; int64_t M, K, N, ldy;
  const uint8_t* codes; const float* scales; const float* zs; const float* bias;
  const float* xsum;  // [M, G] sums of x over each group (only with zs)
  int64_t G, gsize;
  float* y;
};

#ifdef QTK_AVX2
// sum_{k0 <= k < k1} codes[k, :] * x_r[k] for 4 column blocks and MR (1 or 2) rows, into acc[r][t].
// Written out with one variable per accumulator: with arrays GCC kept them on the stack, and the
// loop ran at a store-forward per FMA.
template <int BITS, int MR>
static inline void dot_4blocks(const uint8_t* b0, const uint8_t* b1, const uint8_t* b2, const uint8_t* b3,
                               const float* x0, const float* x1, int64_t k0, int64_t k1, __m256 (&acc)[2][NT]) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 xa = _mm256_broadcast_ss(x0 + k);
    __m256 xb;
    if constexpr (MR == 2) xb = _mm256_broadcast_ss(x1 + k);
    __m256 w = load_codes<BITS>(b0, k);
    a00 = _mm256_fmadd_ps(w, xa, a00);
    if constexpr (MR == 2) a10 = _mm256_fmadd_ps(w, xb, a10);
    w = load_codes<BITS>(b1, k);
    a01 = _mm256_fmadd_ps(w, xa, a01);
    if constexpr (MR == 2) a11 = _mm256_fmadd_ps(w, xb, a11);
    w = load_codes<BITS>(b2, k);
    a02 = _mm256_fmadd_ps(w, xa, a02);
    if constexpr (MR == 2) a12 = _mm256_fmadd_ps(w, xb, a12);
    w = load_codes<BITS>(b3, k);
    a03 = _mm256_fmadd_ps(w, xa, a03);
    if constexpr (MR == 2) a13 = _mm256_fmadd_ps(w, xb, a13);
  }
  acc[0][0] = a00; acc[0][1] = a01; acc[0][2] = a02; acc[0][3] = a03;
  acc[1][0] = a10; acc[1][1] = a11; acc[1][2] = a12; acc[1][3] = a13;
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
    const uint8_t* blk = a.codes + nb0 * bb;
    const float* x0 = a.x + m0 * a.K;
    const float* x1 = MR == 2 ? x0 + a.K : x0;
    for (int64_t g = 0; g < a.G; ++g) {
      __m256 acc[2][NT];
      dot_4blocks<BITS, MR>(blk, blk + bb, blk + 2 * bb, blk + 3 * bb, x0, x1, g * a.gsize, (g + 1) * a.gsize, acc);
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
  {  // portable: any nt, any CPU
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
    float* yr = a.y + (m0 + r) * a.ldy + nb0 * LANES;
    const int64_t cols = std::min<int64_t>(nt * LANES, a.N - nb0 * LANES);
    for (int64_t i = 0; i < cols; ++i) yr[i] = out[r][i] + (a.bias ? a.bias[nb0 * LANES + i] : 0.f);
  }
}

template <int BITS>
static void gemv(const Args& a) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
  const int64_t ntiles = (nblocks + NT - 1) / NT;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * NT;
      const int nt = static_cast<int>(std::min<int64_t>(NT, nblocks - nb0));
      int64_t m = 0;
      for (; m + 2 <= a.M; m += 2) gemv_tile<BITS, 2>(a, m, nb0, nt);
      if (m < a.M) gemv_tile<BITS, 1>(a, m, nb0, nt);
    }
  });
}

// Decode columns [nb0*8, nb0*8 + 8*nblk) into w [8*nblk, K] floats (row-major, as F.linear's weight).
template <int BITS>
static void decode_tile(const Args& a, int64_t nb0, int64_t nblk, float* w) {
  const int64_t bb = block_bytes<BITS>(a.K);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = a.codes + (nb0 + b) * bb;
    for (int64_t g = 0; g < a.G; ++g) {
      const int64_t so = ((nb0 + b) * a.G + g) * LANES;
      float s[LANES], z[LANES];
      for (int j = 0; j < LANES; ++j) {
        s[j] = a.scales[so + j];
        z[j] = a.zs ? a.zs[so + j] : 0.f;
      }
      for (int64_t k = g * a.gsize; k < (g + 1) * a.gsize; ++k) {
#ifdef QTK_AVX2
        float v[LANES];
        _mm256_storeu_ps(v, _mm256_fmsub_ps(load_codes<BITS>(blk, k), _mm256_loadu_ps(s), _mm256_loadu_ps(z)));
        for (int j = 0; j < LANES; ++j) w[(b * LANES + j) * a.K + k] = v[j];
#else
        for (int j = 0; j < LANES; ++j) w[(b * LANES + j) * a.K + k] = code_at<BITS>(blk, k, j) * s[j] - z[j];
#endif
      }
    }
  }
}

template <int BITS>
static void tiles(const Args& a, const at::Tensor& x, const at::Tensor& y) {
  const int64_t nblocks = (a.N + LANES - 1) / LANES;
  const int64_t per = TILE_COLS / LANES;
  const int64_t ntiles = (nblocks + per - 1) / per;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(TILE_COLS * a.K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * per, nblk = std::min(per, nblocks - nb0);
      const int64_t c0 = nb0 * LANES, cols = std::min(nblk * LANES, a.N - c0);
      decode_tile<BITS>(a, nb0, nblk, buf.data());
      at::Tensor w = at::from_blob(buf.data(), {cols, a.K}, at::kFloat);
      at::Tensor yt = y.narrow(1, c0, cols);
      if (a.bias)
        at::addmm_out(yt, at::from_blob(const_cast<float*>(a.bias) + c0, {cols}, at::kFloat).expand({a.M, cols}), x,
                      w.t());
      else
        at::mm_out(yt, x, w.t());
    }
  });
}

at::Tensor woq_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zs, const std::optional<at::Tensor>& bias, int64_t bits,
                      int64_t n, int64_t m_gemv_max) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "woq_linear: x must be float32 on CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "woq_linear: bits must be 4 or 8");
  const int64_t K = x_in.size(-1);
  const int64_t nblocks = codes.size(0);
  TORCH_CHECK(nblocks * LANES >= n && nblocks * LANES < n + LANES, "woq_linear: codes hold ", nblocks,
              " column blocks for n=", n);
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "woq_linear: packed tensors must be contiguous (float32 scales)");
  TORCH_CHECK(codes.numel() * codes.element_size() == nblocks * (bits == 4 ? K * 4 : K * LANES),
              "woq_linear: codes do not match K=", K);
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0, "woq_linear: ", G, " groups do not divide K=", K);
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y.reshape(out_shape);
  at::Tensor b;
  if (bias) b = bias->to(at::kFloat).contiguous();
  at::Tensor zsc, xsum;
  if (zs) {
    zsc = zs->contiguous();
    xsum = x.reshape({M, G, K / G}).sum(-1).contiguous();  // [M, G]
  }
  Args a{x.data_ptr<float>(), M, K, n, n,
         reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
         zs ? zsc.data_ptr<float>() : nullptr, bias ? b.data_ptr<float>() : nullptr,
         zs ? xsum.data_ptr<float>() : nullptr, G, K / G, y.data_ptr<float>()};
  if (M <= m_gemv_max) {
    bits == 4 ? gemv<4>(a) : gemv<8>(a);
  } else {
    bits == 4 ? tiles<4>(a, x, y) : tiles<8>(a, x, y);
  }
  return y.reshape(out_shape);
}

bool compiled_avx2() {
#ifdef QTK_AVX2
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
  m.def("woq_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zs, Tensor? bias, int bits, int n, "
        "int m_gemv_max) -> Tensor");
  m.def("compiled_avx2() -> bool", &compiled_avx2);
}

QTK_LIBRARY_IMPL(QTK_LIB, CPU, m) { m.impl("woq_linear", &woq_linear); }
