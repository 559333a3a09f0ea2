// W8A8 int8 linear layers on x86 CPUs with int8 dot products (AVX512-VNNI):
//   y = (q_x @ q_w^T) * s_x * s_w + b,   q_x = clamp(round(x / s_x), -128, 127)
// with s_x per token (dynamic: max |x_m| / 127, eps where 0) or per tensor (static). The activations are
// quantized inside the call exactly as qtk.quant.quantize_activation does (the same float32 division and
// round-half-to-even), then the integer products run on VPDPBUSD: 64 u8 x s8 products per instruction,
// summed exactly into 16 int32 lanes. At M = 1 this reads a quarter of the float32 weight bytes, and the
// dot product costs one instruction per 64 weights (the float kernels: one FMA per 8 or 16).
//
// VPDPBUSD multiplies unsigned by signed bytes, so x is stored as u = q + 128 and each sum loses
// 128 * sum_k q_w[n, k] (colsum, computed once at pack time): sum_k u q_w - colsum = sum_k q_x q_w.
//
//
//   w8a8_linear(x, codes, colsum, scales, static_scale, bias, n) -> y   x float32 [..., K], quantized in the call
//   w8a8_quantize(x, static_scale) -> (xq, sx)                          x's rows quantized (cpu_act_quant.h)
//   w8a8_linear_quantized(xq, sx, codes, colsum, scales, bias, n) -> y  on rows quantized before the call: by
//       w8a8_quantize, or by the norm or GLU that wrote them (cpu_layers.cpp's *_quant ops), which saves the
//       float32 rows' round trip through memory and this call's pass over them; y the same to the bit
//   w8a8_linear_glu_quantized(xq, sx, codes, colsum, scales, bias, n, act) -> h   a joined gate_up layer
//       (n = 2I: gate's I columns, then up's) with the GLU taken in the products' epilogue: h [M, I] =
//       act(gate) * up (act "silu" or "gelu_tanh", cpu_glu.h's glu_span: the bits of silu_and_mul(y) /
//       gelu_tanh_and_mul(y) on this call's y), for I % 32 == 0. Each tile pairs gate's 32 columns with up's
//       same 32, so h is written without y [M, 2I] going through memory: a prefill step's largest activation,
//       6 MB for SmolLM2's 512 rows, written here and read back by the GLU.
//
// Layout (built once per layer by qtk.kernels.cpu.pack_w8a8):
//   codes   int8   [N16/16, K4/4, 16, 4]  4 consecutive k of one column per dword, 16 columns per 64-byte
//                                         row; N padded to N16 (a multiple of 16) and K to K4 (of 4) with 0
//   colsum  int32  [N16]                  128 * sum_k q_w[n, k]
//   scales  float  [N16]                  s_w per output channel (a per-tensor scale repeated)
// Tiles of 4 column blocks (64 columns, one register each) x 6 rows of x (24 of the 32 registers as
// accumulators; 4, 2 and 1 for the rows left over) run in parallel over column tiles, from 256 rows over
// (column tile, band of 60 rows) items (at::parallel_for). The portable build (no VNNI) has the same operator as plain integer loops,
// for the tests; the dispatch only routes W8A8 layers to it where the build has VNNI (compiled_vnni()).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
#include "cpu_glu.h"  // glu_span: the GLU of a gate_up layer's products, as cpu_layers.cpp takes it
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QTK_VNNI 1
#endif

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif

namespace {

#include "cpu_act_quant.h"  // quantize_row, quant_width, static_scale_of, empty_quantized

constexpr int64_t COLS = 16;  // columns per block (one register of int32 sums)
constexpr int TB = 4;         // blocks per tile: 64 columns
constexpr int64_t ROW_BAND = 60;  // rows of x per work item (a multiple of the 6-row micro-tile)
constexpr int64_t BANDED_ROWS = 256;  // rows from which a tile's rows are split into bands

enum class Act { NONE, SILU, GELU_TANH };  // the GLU taken in the epilogue (w8a8_linear_glu_quantized), or none

struct W8A8Args {
  const uint8_t* xq;  // [M, K4] u = q + 128
  const float* sx;    // [M]
  int64_t M, K4, N;
  const int8_t* codes; const int32_t* colsum; const float* scales; const float* bias;
  float* y;  // [M, N], or h [M, N / 2] with a GLU
  Act act = Act::NONE;
  int64_t up = 2;  // a tile's blocks: nb0, nb0 + 1, nb0 + up, nb0 + up + 1 (a GLU's: gate's pair, up's same pair)

  int64_t block(int64_t nb0, int t) const { return nb0 + (t < 2 ? t : up + t - 2); }
  int64_t step() const { return act == Act::NONE ? TB : 2; }  // the blocks from one tile's first to the next's
};

// The value of column c in row m from its int32 sum: (acc - colsum) * s_x * s_w + b, the last product and the
// bias in one rounding (an FMA, as the vector epilogue: the same bits whatever the compiler contracts)
static inline float value(const W8A8Args& a, int64_t m, int64_t c, int32_t acc) {
  const float v = static_cast<float>(acc - a.colsum[c]) * a.sx[m];
  return a.bias ? std::fma(v, a.scales[c], a.bias[c]) : v * a.scales[c];
}

// h[m, nb0 * 16 .. + 32) = act(gate) * up from a tile's 64 values: gate's 32, then up's
static inline void glu_row(const W8A8Args& a, int64_t m, int64_t nb0, const float* v) {
  float* h = a.y + m * (a.N / 2) + nb0 * COLS;
  if (a.act == Act::SILU) glu_span<Glu::SILU, float>(v, v + 32, h, 0, 32);
  else glu_span<Glu::GELU_TANH, float>(v, v + 32, h, 0, 32);
}

#ifdef QTK_VNNI
#define QTK_INLINE inline __attribute__((always_inline))

// acc[c][t] += the 4-k dot products of MR rows with the 4 blocks at row k4. One row alternates two
// sets of accumulators (c = `odd`) so that 8 dependency chains are in flight.
template <int MR, bool ODD>
static QTK_INLINE void dp_step(__m512i (&acc)[MR == 1 ? 2 : MR][TB], const int8_t* const (&blk)[TB],
                               const uint8_t* const (&x)[MR], int64_t k4) {
  __m512i w[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) w[t] = _mm512_loadu_si512(blk[t] + k4 * 64);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    int32_t xw;
    std::memcpy(&xw, x[r] + 4 * k4, 4);
    const __m512i xb = _mm512_set1_epi32(xw);
    const int c = MR == 1 ? (ODD ? 1 : 0) : r;
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[c][t] = _mm512_dpbusd_epi32(acc[c][t], xb, w[t]);
  }
}

// y[m, nb0 * 16 ..) from row m's int32 sums of the tile's 4 blocks: (acc - colsum) * s_x * s_w + b, 16
// columns at a time, the columns past N left alone; with a GLU, h[m, nb0 * 16 ..) = act(gate) * up of them
static QTK_INLINE void store_row(const W8A8Args& a, int64_t m, int64_t nb0, const __m512i (&acc)[TB]) {
  const __m512 sx = _mm512_set1_ps(a.sx[m]);
  // value() on 16 columns from c0 (those past N: any value, not stored)
  auto values = [&](int64_t c0, const __m512i& sum, __mmask16 mask) __attribute__((always_inline)) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_loadu_si512(a.colsum + c0))), sx);
    return a.bias ? _mm512_fmadd_ps(v, _mm512_loadu_ps(a.scales + c0), _mm512_maskz_loadu_ps(mask, a.bias + c0))
                  : _mm512_mul_ps(v, _mm512_loadu_ps(a.scales + c0));
  };
  if (a.act != Act::NONE) {  // every block whole (N % 64 == 0)
    alignas(64) float v[TB * COLS];
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) _mm512_store_ps(v + t * COLS, values(a.block(nb0, t) * COLS, acc[t], 0xFFFF));
    glu_row(a, m, nb0, v);
    return;
  }
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) {
    const int64_t c0 = (nb0 + t) * COLS;
    if (c0 >= a.N) break;
    const int64_t cols = std::min<int64_t>(COLS, a.N - c0);
    const __mmask16 mask = cols >= COLS ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    _mm512_mask_storeu_ps(a.y + m * a.N + c0, mask, values(c0, acc[t], mask));
  }
}

// the next tile's lines at k4, k4 + 1 into L1 (on a tile's first pass over rows only): its blocks lie `ahead`
// bytes past this tile's
static QTK_INLINE void fetch_next(const int8_t* const (&blk)[TB], int64_t ahead, int64_t k4) {
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) {
    const char* next = reinterpret_cast<const char*>(blk[t] + ahead + k4 * 64);
    _mm_prefetch(next, _MM_HINT_T0);
    _mm_prefetch(next + 64, _MM_HINT_T0);
  }
}

// A tile's 4 blocks of codes
static QTK_INLINE void tile_blocks(const W8A8Args& a, int64_t nb0, const int8_t* (&blk)[TB]) {
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) blk[t] = a.codes + a.block(nb0, t) * a.K4 * COLS;
}

// Rows m0..m0+6 against the 4 blocks from nb0: 24 accumulators, 4 weight registers, one broadcast per row
// and k4 (6 broadcasts and 4 loads per 24 products, against 4 and 4 per 16 for tile<4>), the rows read from
// one base `ld` apart. Written plainly: the 4-row tile's two-step unrolled form at 6 rows spilled (0.44x of
// oneDNN); this one runs at 0.94-0.98 of oneDNN's int8 matmul in cache (0.91-0.95 for tile<4>) and takes
// 6-10% off a W8A8 layer's time in a 1024-token prefill (2-core Zen 4).
static void tile6(const W8A8Args& a, int64_t m0, int64_t nb0, bool first) {
  constexpr int MR = 6;
  const int64_t ld = a.K4 / 4, ahead = a.step() * a.K4 * COLS;
  const int8_t* blk[TB];
  tile_blocks(a, nb0, blk);
  const uint32_t* x = reinterpret_cast<const uint32_t*>(a.xq + m0 * a.K4);
  __m512i acc[MR][TB];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_si512();
  const int64_t n4 = a.K4 / 4;
  for (int64_t k4 = 0; k4 < n4; ++k4) {
    if (first && (k4 & 1) == 0) fetch_next(blk, ahead, k4);
    const __m512i w0 = _mm512_loadu_si512(blk[0] + k4 * 64), w1 = _mm512_loadu_si512(blk[1] + k4 * 64),
                  w2 = _mm512_loadu_si512(blk[2] + k4 * 64), w3 = _mm512_loadu_si512(blk[3] + k4 * 64);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[r * ld + k4]));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) store_row(a, m0 + r, nb0, acc[r]);
}

// Rows m0..m0+MR against the 4 blocks from nb0 (all whole blocks of the padded N16).
template <int MR>
static void tile(const W8A8Args& a, int64_t m0, int64_t nb0, bool first) {
  constexpr int NC = MR == 1 ? 2 : MR;
  const int64_t ahead = a.step() * a.K4 * COLS;
  const int8_t* blk[TB];
  tile_blocks(a, nb0, blk);
  const uint8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = a.xq + (m0 + r) * a.K4;
  __m512i acc[NC][TB];
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[c][t] = _mm512_setzero_si512();
  const int64_t n4 = a.K4 / 4;
  int64_t k4 = 0;
  for (; k4 + 2 <= n4; k4 += 2) {
    if (first) fetch_next(blk, ahead, k4);
    dp_step<MR, false>(acc, blk, x, k4);
    dp_step<MR, true>(acc, blk, x, k4 + 1);
  }
  if (k4 < n4) dp_step<MR, false>(acc, blk, x, k4);
  if constexpr (MR == 1) {  // the row's two sets of sums
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[0][t] = _mm512_add_epi32(acc[0][t], acc[1][t]);
  }
  for (int r = 0; r < MR; ++r) store_row(a, m0 + r, nb0, acc[r]);
}
#endif

// The portable loops: any CPU, any number of the tile's blocks (all 4 with a GLU).
static void tile_portable(const W8A8Args& a, int64_t m, int64_t nb0, int64_t nblk) {
  const int64_t bb = a.K4 * COLS;
  float v[TB * COLS];
  for (int t = 0; t < nblk; ++t) {
    int32_t acc[COLS] = {};
    const int64_t b = a.block(nb0, t);
    const int8_t* blk = a.codes + b * bb;
    for (int64_t k = 0; k < a.K4; ++k)
      for (int64_t j = 0; j < COLS; ++j)
        acc[j] += static_cast<int32_t>(a.xq[m * a.K4 + k]) * blk[(k / 4) * 64 + j * 4 + k % 4];
    const int64_t c0 = b * COLS, cols = std::min<int64_t>(COLS, a.N - c0);
    for (int64_t j = 0; j < cols; ++j) v[t * COLS + j] = value(a, m, c0 + j, acc[j]);
    if (a.act == Act::NONE) std::copy(v + t * COLS, v + t * COLS + cols, a.y + m * a.N + c0);
  }
  if (a.act != Act::NONE) glu_row(a, m, nb0, v);
}

// The calling thread's buffer for the quantized x, at least `bytes` long, kept between calls (a zeroed
// vector per call cost 4.5% of a 1024-row layer in memset).
static uint8_t* x_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (static_cast<int64_t>(buf.size()) < bytes) buf.resize(bytes);
  return buf.data();
}

// M rows of x (ld floats apart) quantized into xq [M, K4] and sx [M], on torch's threads
void quantize_rows(const float* x, int64_t ld, int64_t M, int64_t K, const float* static_scale, uint8_t* xq, float* sx) {
  const int64_t K4 = quant_width(K);
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) sx[m] = quantize_row(x + m * ld, K, K4, static_scale, xq + m * K4);
  });
}

// The layer's tensors checked against K (x's width); returns N16, the padded columns
int64_t check_layer(const char* name, int64_t K, const at::Tensor& codes, const at::Tensor& colsum,
                    const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t K4 = quant_width(K);
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) * 4 == K4 && codes.size(2) == COLS && codes.size(3) == 4,
              name, ": codes must be contiguous int8 [N/16, ", K4 / 4, ", 16, 4] for K=", K, ", got ", codes.sizes());
  const int64_t N16 = codes.size(0) * COLS;
  TORCH_CHECK(n > N16 - COLS && n <= N16, name, ": codes hold ", N16, " columns for n=", n);
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == N16 &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N16,
              name, ": colsum (int32) and scales (float32) must be contiguous [", N16, "]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->numel() == n), name, ": bias must be [", n, "]");
  return N16;
}

// y [M, n] = the products of M quantized rows xq [M, K4] (scales sx [M]) with the layer, into y
void product(const uint8_t* xq, const float* sx, int64_t M, int64_t K4, const at::Tensor& codes, const at::Tensor& colsum,
             const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t n, float* y, Act act = Act::NONE) {
  const at::Tensor b = !bias ? at::Tensor() : bias->to(at::kFloat).contiguous();
  const int64_t nblocks = codes.size(0), ntiles = (nblocks + TB - 1) / TB;
  // a GLU's tile t: gate's blocks 2t, 2t + 1 and up's same two, nblocks / 2 further on
  const W8A8Args a{xq, sx, M, K4, n, codes.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(),
                   scales.data_ptr<float>(), bias ? b.data_ptr<float>() : nullptr, y, act, act == Act::NONE ? 2 : nblocks / 2};
  // Work items: a column tile against a band of ROW_BAND rows, tile-major, so that threads split the rows of
  // a tile where the tiles do not divide evenly among them (SmolLM2's 9 tiles of 64 columns on 2 threads:
  // 11% of a 1024-row layer was one thread waiting for the other). Each band reads its tile's weights
  // again, so only steps of at least BANDED_ROWS rows, whose products outweigh that, are split: a decode
  // batch reads every weight once.
  const int64_t band = M >= BANDED_ROWS ? ROW_BAND : M, bands = (M + band - 1) / band;
  at::parallel_for(0, ntiles * bands, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / bands, m0 = i % bands * band, m1 = std::min(M, m0 + band);
      const int64_t nb0 = t * a.step(), nblk = act == Act::NONE ? std::min<int64_t>(TB, nblocks - nb0) : TB;
#ifdef QTK_VNNI
      if (nblk == TB) {
        int64_t m = m0;
        for (; m + 6 <= m1; m += 6) tile6(a, m, nb0, m == m0);
        for (; m + 4 <= m1; m += 4) tile<4>(a, m, nb0, m == m0);
        for (; m + 2 <= m1; m += 2) tile<2>(a, m, nb0, m == m0);
        if (m < m1) tile<1>(a, m, nb0, m == m0);
        continue;
      }
#endif
      for (int64_t m = m0; m < m1; ++m) tile_portable(a, m, nb0, nblk);
    }
  });
}

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& colsum,
                       const at::Tensor& scales, const std::optional<at::Tensor>& static_scale,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "w8a8_linear: x must be float32 on CPU");
  const int64_t K = x_in.size(-1), K4 = quant_width(K);
  check_layer("w8a8_linear", K, codes, colsum, scales, bias, n);
  float st = 0.f;
  const bool is_static = static_scale_of(static_scale, "w8a8_linear", &st);
  const at::Tensor x = x_in.dim() == 2 && x_in.is_contiguous() ? x_in : x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::detail::empty_cpu(out_shape, at::kFloat, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  if (M == 0) return y;
  uint8_t* xq = x_buffer(M * K4);  // every byte written below before it is read
  std::vector<float> sx(M);
  quantize_rows(x.data_ptr<float>(), K, M, K, is_static ? &st : nullptr, xq, sx.data());
  product(xq, sx.data(), M, K4, codes, colsum, scales, bias, n, y.data_ptr<float>());
  return y;
}

// The products of rows quantized before the call (xq uint8 [M, K4], sx float32 [M]), checked, into a new
// y [M, n] (h [M, n / 2] with a GLU)
at::Tensor quantized_product(const char* name, const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& codes,
                             const at::Tensor& colsum, const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                             int64_t n, Act act) {
  TORCH_CHECK(xq.device().is_cpu() && xq.scalar_type() == at::kByte && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) == codes.size(1) * 4,
              name, ": xq must be contiguous uint8 [M, ", codes.size(1) * 4, "] (quantized rows)");
  const int64_t M = xq.size(0);
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == M,
              name, ": sx must be contiguous float32 [", M, "], a scale per row");
  check_layer(name, xq.size(1), codes, colsum, scales, bias, n);
  const int64_t width = act == Act::NONE ? n : n / 2;
  at::Tensor y = at::detail::empty_cpu({M, width}, at::kFloat, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  if (M > 0)
    product(xq.data_ptr<uint8_t>(), sx.data_ptr<float>(), M, xq.size(1), codes, colsum, scales, bias, n, y.data_ptr<float>(), act);
  return y;
}

// w8a8_linear on rows quantized before the call (w8a8_quantize, or the fused ops of cpu_layers.cpp that write
// them): xq uint8 [M, K4], sx float32 [M]. The same y as w8a8_linear on the rows they came from.
at::Tensor w8a8_linear_quantized(const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& codes,
                                 const at::Tensor& colsum, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& bias, int64_t n) {
  return quantized_product("w8a8_linear_quantized", xq, sx, codes, colsum, scales, bias, n, Act::NONE);
}

// w8a8_linear_quantized of a joined gate_up layer (n = 2I) with the GLU act ("silu" or "gelu_tanh") in the
// epilogue: h float32 [M, I] = act(y[:, :I]) * y[:, I:], the bits of silu_and_mul / gelu_tanh_and_mul(y)
at::Tensor w8a8_linear_glu_quantized(const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& codes,
                                     const at::Tensor& colsum, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& bias, int64_t n, const std::string& act) {
  TORCH_CHECK(act == "silu" || act == "gelu_tanh", "w8a8_linear_glu_quantized: act must be silu or gelu_tanh, got ", act);
  TORCH_CHECK(n % 64 == 0, "w8a8_linear_glu_quantized: n (gate's and up's columns) must be a multiple of 64, got ", n);
  return quantized_product("w8a8_linear_glu_quantized", xq, sx, codes, colsum, scales, bias, n,
                           act == "silu" ? Act::SILU : Act::GELU_TANH);
}

// x float32 [M, K] -> its quantized rows (xq, sx), per token or with the static scale
std::tuple<at::Tensor, at::Tensor> w8a8_quantize(const at::Tensor& x, const std::optional<at::Tensor>& static_scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "w8a8_quantize: x must be a float32 CPU matrix with contiguous rows");
  float st = 0.f;
  const bool is_static = static_scale_of(static_scale, "w8a8_quantize", &st);
  auto [xq, sx] = empty_quantized(x.size(0), x.size(1));
  quantize_rows(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), is_static ? &st : nullptr, xq.data_ptr<uint8_t>(),
                sx.data_ptr<float>());
  return {xq, sx};
}

bool compiled_vnni() {
#ifdef QTK_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

#define QTK_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define QTK_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

QTK_FRAGMENT(QTK_LIB, m) {
  m.def("w8a8_linear(Tensor x, Tensor codes, Tensor colsum, Tensor scales, Tensor? static_scale, Tensor? bias, "
        "int n) -> Tensor");
  m.def("compiled_vnni() -> bool", &compiled_vnni);
}

QTK_IMPL(QTK_LIB, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }

namespace QTK_LIB {
void bind_w8a8(pybind11::module_& m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("w8a8_linear", &w8a8_linear, nogil);
  m.def("w8a8_linear_quantized", &w8a8_linear_quantized, nogil);
  m.def("w8a8_linear_glu_quantized", &w8a8_linear_glu_quantized, nogil);
  m.def("w8a8_quantize", &w8a8_quantize, nogil);
  m.def("compiled_vnni", &compiled_vnni);
}
}  // namespace QTK_LIB
