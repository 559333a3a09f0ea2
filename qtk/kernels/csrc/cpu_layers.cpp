// The small per-layer operations of a decoder step on CPU, fused: each is one call where the torch
// version is 3-20 (RMSNorm alone is seven: cast, pow, mean, add, rsqrt, mul, mul). At batch 1 a
// step of a 30-layer model is ~2000 torch calls of a few microseconds each, as long as the
// 4-bit matmuls themselves; these bring it to ~300. float32 activations; the torch code in
// qtk/runtime (models/llama.py, attention.py) is the reference and the path for everything else.
//
//   rms_norm(x, w, eps, bf16_out)      y = x / sqrt(mean(x^2) + eps) * w, per row (bf16_out: y in bf16)
//   add_rms_norm_(residual, x, w, eps, bf16_out)
//                                      residual += x (float32 or bf16), then rms_norm(residual): the
//                                      residual stream
//   rope_(x, cos, sin, heads)          rotate the first `heads` heads of each row of x in place
//                                      (HF's rotate_half layout: pairs (i, i + D/2)); cos, sin [T, D]
//   silu_and_mul(x)                    x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  (float32, or bf16 in and out)
//   gelu_tanh_and_mul(x)               x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]  (Gemma's GeGLU)
//   hadamard(x, block)                 x [T, n] -> x H, H block-diagonal: the normalized Sylvester matrix of
//                                      size block (a power of two dividing n) along each row; the fast
//                                      Walsh-Hadamard transform, log2(block) passes of sums and differences
//                                      (an online rotation of a down projection's input: qtk/hadamard.py)
//                                      (float32, or bf16 in and out with the math in float32)
//   rms_norm_quant(x, w, eps, static_scale), add_rms_norm_quant_(residual, x, w, eps, static_scale),
//   silu_and_mul_quant(x, static_scale), gelu_tanh_and_mul_quant(x, static_scale)
//                                      the same on float32 rows, the result quantized for a W8A8 layer
//                                      (cpu_act_quant.h) as each row is written: (xq, sx) for
//                                      w8a8_linear_quantized, as w8a8_quantize of the float32 result
//   store_kv_(k_cache, v_cache, k, v, slots, k_scale, v_scale)
//                                      k, v [T, kv_heads, D] into caches [kv_heads, slots, D] at
//                                      slots [T]; float32, or INT8 / FP8 e4m3 (uint8 bits) with
//                                      scales [kv_heads or 1] (stored = value / scale, rounded to
//                                      nearest, saturated)
//   paged_decode_attention(q, k_cache, v_cache, block_tables, lens, block_size, scale, k_scale, v_scale,
//                          window, softcap, sinks)
//                                      one query token per sequence: q [B, H, D] over each sequence's
//                                      cached keys/values through its block table; GQA as repeat_kv;
//                                      window > 0: its last `window` keys only; softcap > 0: scores
//                                      softcap * tanh(s / softcap); sinks [H]: one more logit per head
//                                      in the softmax, its weight dropped (gpt-oss)
//   sample_rows(logits, temperature, u) -> tokens
//                                      the sampler's draw by inverse CDF (runtime/sampler.py), fused: per
//                                      row of logits [B, V] float32, weights w = exp((x - max) / t) with
//                                      temperature t [B] (NaN and -inf weigh 0, +inf counts as the largest
//                                      float, as sampler.finite), the first token whose running sum of
//                                      weights passes u * sum(w) for u [B] in [0, 1); -1 for a row with no
//                                      token of weight > 0. int64 [B]. torch's version (shift, divide,
//                                      softmax, cumsum, searchsorted) read and wrote the row ten times:
//                                      6 ms of a 110 ms decode step at 16 x 49,152; this reads it three.
// All parallelise over rows (or sequence x KV head, and query heads at small batches) with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "cpu_glu.h"  // QTK_AVX2 / QTK_AVX512 (this build's vectors), load8 / load16, exp8 / exp16, glu_span

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif
#define QTK_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define QTK_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

#include "cpu_act_quant.h"  // W8A8's quantized rows: quantize_row, row_buffer, empty_quantized, static_scale_of

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": expects a float32 CPU matrix with contiguous rows");
}

inline float rms_inv(const float* x, int64_t n, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / n + eps));
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_rows(x, "rope_");
  check_rows(cos, "rope_");
  check_rows(sin, "rope_");
  const int64_t T = x.size(0), D = cos.size(1), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && sin.size(1) == D && D % 2 == 0 && heads * D <= x.size(1),
              "rope_: cos/sin must be [T, D] with ", heads, " heads of D in each row of x");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + t * xs + h * D;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

// y = w * (x * inv) for one row of H, y float32 or bf16 (rounded to nearest even)
template <typename Y>
inline void scale_row(const float* x, const float* w, float inv, int64_t H, Y* y) {
  int64_t i = 0;
#ifdef QTK_AVX512
  const __m512 iv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= H; i += 16) store16(y + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), iv16)));
#endif
#ifdef QTK_AVX2
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= H; i += 8) store8(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
#endif
  for (; i < H; ++i) y[i] = static_cast<Y>(w[i] * (x[i] * inv));
}

// residual += x for one row, x float32 or bf16 (a bf16 matmul's output)
template <typename X>
inline void add_row(float* r, const X* x, int64_t H) {
  int64_t i = 0;
#ifdef QTK_AVX512
  for (; i + 16 <= H; i += 16) _mm512_storeu_ps(r + i, _mm512_add_ps(_mm512_loadu_ps(r + i), load16(x + i)));
#endif
#ifdef QTK_AVX2
  for (; i + 8 <= H; i += 8) _mm256_storeu_ps(r + i, _mm256_add_ps(_mm256_loadu_ps(r + i), load8(x + i)));
#endif
  for (; i < H; ++i) r[i] += static_cast<float>(x[i]);
}

// bf16_out: y in bf16 for the bf16 matmuls of a prefill step (what they would round it to anyway)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.numel() == H && w.scalar_type() == at::kFloat && w.is_contiguous(), "rms_norm: weight must be float32 [", H, "]");
  at::Tensor y = at::empty({T, H}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  c10::BFloat16* yb = bf16_out ? y.data_ptr<c10::BFloat16>() : nullptr;
  float* yf = bf16_out ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * xs;
      const float inv = rms_inv(xr, H, eps);
      if (bf16_out) scale_row(xr, wp, inv, H, yb + t * H);
      else scale_row(xr, wp, inv, H, yf + t * H);
    }
  });
  return y;
}

// x float32, or bf16 (a bf16 matmul's output, added as it is: its float32 value); bf16_out as rms_norm
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out) {
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1, "add_rms_norm_: x must be a float32 or bf16 CPU matrix with contiguous rows");
  const int64_t T = residual.size(0), H = residual.size(1);
  TORCH_CHECK(x.size(0) == T && x.size(1) == H, "add_rms_norm_: x and residual differ in shape");
  TORCH_CHECK(w.numel() == H && w.scalar_type() == at::kFloat && w.is_contiguous(), "add_rms_norm_: weight must be float32 [", H, "]");
  at::Tensor y = at::empty({T, H}, residual.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float* wp = w.data_ptr<float>();
  const bool xb = x.scalar_type() == at::kBFloat16;
  float* rp = residual.data_ptr<float>();
  const c10::BFloat16* xbp = xb ? x.data_ptr<c10::BFloat16>() : nullptr;
  const float* xfp = xb ? nullptr : x.data_ptr<float>();
  const int64_t rs = residual.stride(0), xs = x.stride(0);
  c10::BFloat16* yb = bf16_out ? y.data_ptr<c10::BFloat16>() : nullptr;
  float* yf = bf16_out ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* rr = rp + t * rs;
      if (xb) add_row(rr, xbp + t * xs, H);
      else add_row(rr, xfp + t * xs, H);
      const float inv = rms_inv(rr, H, eps);
      if (bf16_out) scale_row(rr, wp, inv, H, yb + t * H);
      else scale_row(rr, wp, inv, H, yf + t * H);
    }
  });
  return y;
}

// rms_norm and add_rms_norm_ with their output rows quantized for a W8A8 layer as they are written (quantize_row
// on the float32 row rms_norm writes): the same codes and scales as w8a8_quantize(rms_norm(...)), without the
// float32 rows in memory. -> (xq uint8 [T, K4], sx float32 [T])
std::tuple<at::Tensor, at::Tensor> norm_quant(at::Tensor* residual, const at::Tensor& x, const at::Tensor& w, double eps,
                                              const std::optional<at::Tensor>& static_scale, const char* name) {
  const at::Tensor& r = residual ? *residual : x;
  check_rows(r, name);
  const int64_t T = r.size(0), H = r.size(1), H4 = quant_width(H);
  if (residual) {
    check_rows(x, name);
    TORCH_CHECK(x.size(0) == T && x.size(1) == H, name, ": x and residual differ in shape");
  }
  TORCH_CHECK(w.numel() == H && w.scalar_type() == at::kFloat && w.is_contiguous(), name, ": weight must be float32 [", H, "]");
  float st = 0.f;
  const bool is_static = static_scale_of(static_scale, name, &st);
  auto [xq, sx] = empty_quantized(T, H);
  const float* wp = w.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t rs = r.stride(0), xs = x.stride(0);
  float* sp = sx.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    float* row = row_buffer(H);
    for (int64_t t = t0; t < t1; ++t) {
      float* rr = rp + t * rs;
      if (residual) add_row(rr, xp + t * xs, H);
      scale_row(rr, wp, rms_inv(rr, H, eps), H, row);
      sp[t] = quantize_row(row, H, H4, is_static ? &st : nullptr, qp + t * H4);
    }
  });
  return {xq, sx};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor& x, const at::Tensor& w, double eps,
                                                  const std::optional<at::Tensor>& static_scale) {
  return norm_quant(nullptr, x, w, eps, static_scale, "rms_norm_quant");
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w,
                                                       double eps, const std::optional<at::Tensor>& static_scale) {
  return norm_quant(&residual, x, w, eps, static_scale, "add_rms_norm_quant_");
}

// Over rows x [T, 2I] -> y [T, I], shared out in spans of 16 elements (256 a work item at least)
template <Glu ACT, typename T>
void act_and_mul_rows(const at::Tensor& x, at::Tensor& y) {
  const int64_t rows = x.size(0), I = x.size(1) / 2, spans = (I + 15) / 16, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows * spans, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t t = i0 / spans; t <= (i1 - 1) / spans; ++t) {
      const T* g = xp + t * xs;
      const int64_t a = std::max(i0 - t * spans, int64_t(0)) * 16, b = std::min((i1 - t * spans) * 16, I);
      glu_span<ACT, T>(g, g + I, yp + t * I, a, b);
    }
  });
}

// float32 rows, or bf16 rows (a bf16 matmul's output: the math in float32, the result rounded to bf16)
template <Glu ACT>
at::Tensor act_and_mul(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1, name, ": expects a float32 or bf16 CPU matrix with contiguous rows");
  TORCH_CHECK(x.size(1) % 2 == 0, name, ": x must have an even number of columns");
  at::Tensor y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat)
    act_and_mul_rows<ACT, float>(x, y);
  else
    act_and_mul_rows<ACT, c10::BFloat16>(x, y);
  return y;
}

at::Tensor silu_and_mul(const at::Tensor& x) { return act_and_mul<Glu::SILU>(x, "silu_and_mul"); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return act_and_mul<Glu::GELU_TANH>(x, "gelu_tanh_and_mul"); }

// One block of `n` floats in place: butterflies of elements h apart, h = 1, 2, 4, ... (Sylvester's order,
// H_2m = [[H_m, H_m], [H_m, -H_m]]), then the 1/sqrt(n) that makes it orthogonal.
inline void fwht_block(float* v, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
#pragma omp simd
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  const float s = 1.f / std::sqrt(static_cast<float>(n));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] *= s;
}

template <typename T>
void hadamard_rows(const at::Tensor& x, at::Tensor& y, int64_t block) {
  const int64_t rows = x.size(0), n = x.size(1), blocks = n / block, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows * blocks, std::max<int64_t>(1, 4096 / block), [&](int64_t i0, int64_t i1) {
    float* v = row_buffer(block);
    for (int64_t i = i0; i < i1; ++i) {
      const T* src = xp + (i / blocks) * xs + (i % blocks) * block;
      T* dst = yp + (i / blocks) * n + (i % blocks) * block;
      for (int64_t j = 0; j < block; ++j) v[j] = static_cast<float>(src[j]);
      fwht_block(v, block);
      for (int64_t j = 0; j < block; ++j) dst[j] = static_cast<T>(v[j]);
    }
  });
}

at::Tensor hadamard(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() == 2 && x.stride(1) == 1, "hadamard: expects a float32 or bf16 CPU matrix with contiguous rows");
  TORCH_CHECK(block > 0 && (block & (block - 1)) == 0 && x.size(1) % block == 0, "hadamard: block ", block,
              " must be a power of two dividing the ", x.size(1), " columns");
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kFloat)
    hadamard_rows<float>(x, y, block);
  else
    hadamard_rows<c10::BFloat16>(x, y, block);
  return y;
}

// silu_and_mul / gelu_tanh_and_mul of float32 rows with the result quantized for a W8A8 layer as each row is
// written (quantize_row on the row act_and_mul writes): the same codes and scales as
// w8a8_quantize(silu_and_mul(x)), without the float32 rows in memory. -> (xq uint8 [T, I4], sx float32 [T])
template <Glu ACT>
std::tuple<at::Tensor, at::Tensor> act_and_mul_quant(const at::Tensor& x, const std::optional<at::Tensor>& static_scale,
                                                     const char* name) {
  check_rows(x, name);
  TORCH_CHECK(x.size(1) % 2 == 0, name, ": x must have an even number of columns");
  float st = 0.f;
  const bool is_static = static_scale_of(static_scale, name, &st);
  const int64_t rows = x.size(0), I = x.size(1) / 2, I4 = quant_width(I);
  auto [xq, sx] = empty_quantized(rows, I);
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  float* sp = sx.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t t0, int64_t t1) {
    float* row = row_buffer(I);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * xs;
      glu_span<ACT, float>(g, g + I, row, 0, I);
      sp[t] = quantize_row(row, I, I4, is_static ? &st : nullptr, qp + t * I4);
    }
  });
  return {xq, sx};
}

std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant(const at::Tensor& x, const std::optional<at::Tensor>& static_scale) {
  return act_and_mul_quant<Glu::SILU>(x, static_scale, "silu_and_mul_quant");
}
std::tuple<at::Tensor, at::Tensor> gelu_tanh_and_mul_quant(const at::Tensor& x, const std::optional<at::Tensor>& static_scale) {
  return act_and_mul_quant<Glu::GELU_TANH>(x, static_scale, "gelu_tanh_and_mul_quant");
}

// exp over an array in place; returns the sum. AVX2: Cephes' expf polynomial (relative error ~2e-7,
// as std::exp for a softmax's purposes), 8 at a time.
float exp_sum_(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef QTK_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 y = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh));
    _mm256_storeu_ps(v + i, y);
    acc = _mm256_add_ps(acc, y);
  }
  float part[8];
  _mm256_storeu_ps(part, acc);
  for (float p : part) sum += p;
#endif
  for (; i < n; ++i) sum += (v[i] = std::exp(v[i] - shift));
  return sum;
}

// -- the KV cache ---------------------------------------------------------------------------------
#include "cpu_kv.h"  // its element types (Kv), e4m3 -> float32, kv_scale, kv_kind, as_float

uint8_t float_to_e4m3(float f) {  // round to nearest even, saturating at +-448 (as torch's .to(float8_e4m3fn) after clamp)
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::min(std::fabs(f), 448.f);
  // search the 127 non-negative finite codes: the table is monotonic in the code
  const float* t = e4m3().v;
  int lo = 0, hi = 126;  // t[126] = 448
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t[mid] <= a) lo = mid; else hi = mid - 1;
  }
  int code = lo;
  if (code < 126) {
    const float d0 = a - t[code], d1 = t[code + 1] - a;
    if (d1 < d0 || (d1 == d0 && (code & 1))) code += 1;
  }
  return sign | static_cast<uint8_t>(code);
}

// One head's row x [D] into the cache row dst, as the cache stores it: float32 as it is; bf16 rounded to nearest
// even, as torch's .to(bfloat16) (NaN as 0x7FC0); INT8 and FP8 divided by the scale (as attention.quantize_kv),
// rounded to nearest, saturated
template <Kv KIND>
inline void store_row(const float* x, int64_t D, float scale, kv_t<KIND>* dst) {
  if constexpr (KIND == Kv::F32) {
    std::memcpy(dst, x, D * sizeof(float));
  } else if constexpr (KIND == Kv::BF16) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      uint32_t u;
      std::memcpy(&u, x + d, sizeof u);
      const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      dst[d] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : r;
    }
  } else if constexpr (KIND == Kv::I8) {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / scale), -128.f, 127.f));
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = float_to_e4m3(x[d] / scale);
  }
}

// k, v [T, KV, D] into the caches [KV, S, D] at slots sl [T] (checked), with the scales ks, vs (undefined: none)
template <Kv KIND>
void store_rows(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, const int64_t* sl,
                const at::Tensor& ks, const at::Tensor& vs) {
  const int64_t T = k.size(0), KV = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
  kv_t<KIND>* kc = static_cast<kv_t<KIND>*>(k_cache.data_ptr());
  kv_t<KIND>* vc = static_cast<kv_t<KIND>*>(v_cache.data_ptr());
  const float *ksp = ks.defined() ? ks.data_ptr<float>() : nullptr, *vsp = vs.defined() ? vs.data_ptr<float>() : nullptr;
  const bool k_one = ks.defined() && ks.numel() == 1, v_one = vs.defined() && vs.numel() == 1;
  at::parallel_for(0, T * KV, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / KV, h = i % KV, off = (h * S + sl[t]) * D;
      store_row<KIND>(kp + t * k0 + h * k1, D, ksp ? ksp[k_one ? 0 : h] : 1.f, kc + off);
      store_row<KIND>(vp + t * v0 + h * v1, D, vsp ? vsp[v_one ? 0 : h] : 1.f, vc + off);
    }
  });
}

void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slots, const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale) {
  const Kv kind = kv_kind(k_cache);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv_: caches must be contiguous [kv_heads, slots, D] of one dtype");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "store_kv_: caches must be [kv_heads, slots, D], both of one shape");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 &&
              v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv_: k, v must be float32 [T, kv_heads, D] with contiguous D");
  TORCH_CHECK((kind == Kv::F32 || kind == Kv::BF16) == !k_scale.has_value() && k_scale.has_value() == v_scale.has_value(),
              "store_kv_: scales go with (and only with) an INT8 / FP8 cache");
  const int64_t T = k.size(0), KV = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(k.size(1) == KV && k.size(2) == D && slots.numel() == T && slots.scalar_type() == at::kLong,
              "store_kv_: shapes do not match the cache");
  const at::Tensor slots_c = slots.contiguous();
  const int64_t* sl = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // checked before any row is stored: a bad call leaves the caches as they were
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "store_kv_: slot ", sl[t], " is outside the cache's ", S);
  at::Tensor ks, vs;
  if (k_scale) { ks = kv_scale(*k_scale, KV, "store_kv_"); vs = kv_scale(*v_scale, KV, "store_kv_"); }
  if (kind == Kv::F32) store_rows<Kv::F32>(k_cache, v_cache, k, v, sl, ks, vs);
  else if (kind == Kv::BF16) store_rows<Kv::BF16>(k_cache, v_cache, k, v, sl, ks, vs);
  else if (kind == Kv::I8) store_rows<Kv::I8>(k_cache, v_cache, k, v, sl, ks, vs);
  else store_rows<Kv::F8>(k_cache, v_cache, k, v, sl, ks, vs);
}

#ifdef QTK_AVX2
// 8 elements of an INT8 cache (its codes) or an FP8 e4m3 cache (uint8 bits) as float32, unscaled, decoded in
// registers so that every cache dtype is read in place (decoded first into a float32 copy of the context,
// an FP8 cache by a table, the decode attention took 2.1x a float32 cache's time and an INT8 cache 0.74x,
// for a quarter of the bytes). e4m3: 2^(e - 7) (1 + m / 8), for e = 0 m * 2^-9, is 2^120 times the float32
// whose exponent field holds e and whose mantissa starts with m (a subnormal for e = 0, which the product
// makes exact unless the thread flushes denormal inputs to zero); 0x7F / 0xFF are NaN.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const uint8_t* p) {
  // sign-extended and shifted: the sign in bit 31 (and 30..27), e and m in bits 26..20
  const __m256i x = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
  const __m256 v = _mm256_mul_ps(_mm256_and_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x87F00000u)))),
                                 _mm256_set1_ps(0x1p120f));
  const __m256i em = _mm256_set1_epi32(0x07F00000);
  return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(x, em), em)));  // NaN: all ones
}

// Ask for a cache row's lines (D elements) in L1 ahead of its use: the decode's passes stream the context
// from memory, a sequence's blocks anywhere in the pool, and they compute between loads (so the hardware
// prefetchers, which stop at each 4 KB page, fell behind).
template <typename R>
static inline void prefetch_row(const R* row, int64_t D) {  // every 64-byte line the row touches
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + D);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63); a < end; a += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}

// q . k for NH query heads of one KV head (rows q, q + qs, ...) and NK keys at once (NK % 4 == 0): NH NK FMA
// chains over D (D % 8 == 0), each key's 8 elements decoded once for all NH heads; then each head's sums across
// lanes, 4 keys at a time by a transpose of adds (one horizontal sum per key cost more than the dots), times the
// scale, into out[h * os ..][0..NK), and each head's maximum into mx[h]. The last step adds the two 128-bit
// halves rather than permuting them across lanes: vperm2f128 is 8 uops on Zen 1. NH NK accumulators, NH q
// vectors and one key vector fit in the 16 registers: 2-3 heads x 4 keys (a KV head's query heads, each key
// vector loaded and decoded once for them all) or 1 head x 8 keys (a query head left over, or alone).
// pf: the rows whose lines to ask for while these compute (each key's, some keys ahead), or null.
template <int NH, int NK, typename R>  // rows of float32, or read in place: bf16, INT8 codes, FP8 bits
static inline void dot_heads(const float* q, int64_t qs, const R* const* rows, int64_t D, __m128 scale, float* out,
                             int64_t os, __m128* mx, const R* const* pf) {
  static_assert(NK % 4 == 0 && NH * NK + NH + 1 <= 16, "dot_heads: NH x NK accumulators must fit the registers");
  if (pf)
    for (int k = 0; k < NK; ++k) prefetch_row(pf[k], D);
  __m256 a[NH][NK];
#pragma GCC unroll 3
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) a[h][k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[NH];
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) qv[h] = _mm256_loadu_ps(q + h * qs + d);
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) {
      const __m256 kv = load8(rows[k] + d);
#pragma GCC unroll 3
      for (int h = 0; h < NH; ++h) a[h][k] = _mm256_fmadd_ps(qv[h], kv, a[h][k]);
    }
  }
#pragma GCC unroll 3
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
    for (int k = 0; k < NK; k += 4) {
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[h][k], a[h][k + 1]), _mm256_hadd_ps(a[h][k + 2], a[h][k + 3]));
      const __m128 s = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), scale);
      _mm_storeu_ps(out + h * os + k, s);  // t: [keys k..k+3, low halves | high halves]
      mx[h] = _mm_max_ps(mx[h], s);
    }
}

// out[h][d0 .. d0 + 8 NV) (+)= sum_j p[h][j] * rows[j][d0 ..] for NH heads (p[h] = p + h * ps, out[h] = out + h * os):
// NH NV accumulators held in registers over the context, each value vector decoded once for all NH heads.
// 1 head x up to 8 vectors (head by head), or 2-3 heads x 4. pf: as dot_heads', rows of D elements, or null.
template <int NH, int NV, typename R>
static inline void pv_heads(const float* p, int64_t ps, const R* const* rows, int64_t L, int64_t d0, float* out,
                            int64_t os, bool add, const R* const* pf, int64_t D) {
  static_assert(NH * NV + NH + 1 <= 16, "pv_heads: NH x NV accumulators must fit the registers");
  __m256 acc[NH][NV];
#pragma GCC unroll 3
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[h][v] = add ? _mm256_loadu_ps(out + h * os + d0 + 8 * v) : _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m256 pj[NH];
#pragma GCC unroll 3
    for (int h = 0; h < NH; ++h) pj[h] = _mm256_broadcast_ss(p + h * ps + j);
    if (pf) prefetch_row(pf[j], D);
    const R* r = rows[j] + d0;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256 x = load8(r + 8 * v);
#pragma GCC unroll 3
      for (int h = 0; h < NH; ++h) acc[h][v] = _mm256_fmadd_ps(pj[h], x, acc[h][v]);
    }
  }
#pragma GCC unroll 3
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + h * os + d0 + 8 * v, acc[h][v]);
}

static inline float hmax4(__m128 v) {
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
}

#endif

// sr[j] = (q . rows[j]) * scale for the keys j .. j1 one at a time (the tails the vector passes leave, and
// every key on the portable build), raising m to the largest
template <typename R>
static void dot_tail(const float* q, const R* const* rows, int64_t j, int64_t j1, int64_t D, float scale, float* sr,
                     float& m) {
  for (; j < j1; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * as_float(rows[j][d]);
    sr[j] = dot * scale;
    m = std::max(m, sr[j]);
  }
}

// out [D] = sum_j p[j] * rows[j] over L rows (add: out += that); pf as pv_heads'.
template <typename R>
static void weighted_rows(const float* p, const R* const* rows, int64_t L, int64_t D, float* out, bool add,
                          const R* const* pf = nullptr) {
  int64_t d0 = 0;
#ifdef QTK_AVX2
  for (; d0 + 64 <= D; d0 += 64) pv_heads<1, 8>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D);
  switch ((D - d0) / 8) {
    case 1: pv_heads<1, 1>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 2: pv_heads<1, 2>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 3: pv_heads<1, 3>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 4: pv_heads<1, 4>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 5: pv_heads<1, 5>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 6: pv_heads<1, 6>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    case 7: pv_heads<1, 7>(p, 0, rows, L, d0, out, 0, add, d0 == 0 ? pf : nullptr, D); break;
    default: break;
  }
  d0 += (D - d0) / 8 * 8;
#endif
  for (int64_t d = d0; d < D; ++d) {
    float acc = add ? out[d] : 0.f;
    for (int64_t j = 0; j < L; ++j) acc += p[j] * as_float(rows[j][d]);
    out[d] = acc;
  }
}

// Keys per tile of the decode's two passes (Q K^T, then P V): a tile's rows (64 x D of float32 or bf16)
// stay in L1 while every query head of the group reads them; head by head over the whole context,
// each head re-read them from L2 and ran 3x slower (a 2-core Zen 4, 16 sequences x 1024 keys).
constexpr int64_t DECODE_TILE = 64;
// How many keys ahead the passes ask for rows (prefetch_row): the 2-3 query heads of a KV head compute
// ~100 cycles per 4 keys. 16 sequences x 1040 keys x 30 layers, float32, 2 Zen 1 cores: 64.0 ms asking
// for none (69.6 head by head), 56.9 at 16 keys ahead, 55.4 at 32, 57-58 at 64 and 128.
constexpr int64_t DECODE_AHEAD = 32;

// How many of the `left` query heads of a KV head the AVX2 passes take at once (dot_heads, pv_heads):
// 3, or 2 where 4 are left (2 + 2 rather than 3 + 1); 1 means the head-by-head path.
constexpr int64_t heads_at_once(int64_t left) { return left == 4 ? 2 : std::min<int64_t>(3, left); }

// One work item: the query heads g0..g1 of KV head h of sequence b. With fewer B * KV items than threads
// (as at batch 1 with few KV heads) the query heads of a KV head are split over items too.
template <Kv KIND>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& lens, int64_t bs, double scale, const float* ks, int64_t nks, const float* vs,
            int64_t nvs, int64_t window, float softcap, const float* sinks, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(0), S = k_cache.size(1);
  const int64_t G = H / KV, W = tables.size(1);
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const kv_t<KIND>* kc = static_cast<const kv_t<KIND>*>(k_cache.data_ptr());
  const kv_t<KIND>* vc = static_cast<const kv_t<KIND>*>(v_cache.data_ptr());
  float* op = out.data_ptr<float>();
  // Rows are read (bf16, INT8 and FP8 decoded in registers) once per 2-3 query heads (dot_heads,
  // pv_heads), and asked for DECODE_AHEAD keys ahead by the first group or head that reads them (g == g0).
  // Head by head, decoding cost more than the bytes it saves (16 sequences x 1024 keys, 2 Zen 1 cores,
  // the step's attention: bf16 72-75 ms that way, 49 grouped). Float32 rows went head by head, 8 keys at
  // once, until the passes prefetched: grouped, 4 keys at once kept fewer lines in flight and took
  // 1.15-1.2x as long; grouped and prefetched, 0.8x.
  int64_t work = 0;  // keys and values to read: a tiny step runs on the calling thread
  for (int64_t b = 0; b < B; ++b) work += ln[b] * KV * D;
  // Query heads split over items only where the KV heads are fewer than the threads: split, each head reads
  // its KV head's rows alone and head by head. SmolLM2 at batch 1 (3 KV heads of 3 query heads, 2 Zen 4
  // threads; split while B * KV < 2 threads before): 15.9 -> 9.2 us at 256 keys, 45.3 -> 29.2 at 1024.
  const int64_t splits = B * KV < at::get_num_threads() ? G : 1;
  const int64_t items = B * KV * splits;
  at::parallel_for(0, items, work < (1 << 12) ? items : 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, smax;
    std::vector<const kv_t<KIND>*> krow, vrow;  // every cache dtype is read in place (load8, as_float)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (KV * splits), h = (i / splits) % KV, s = i % splits;
      const int64_t g0 = s * G / splits, g1 = (s + 1) * G / splits, ng = g1 - g0, n = ln[b];
      TORCH_CHECK(n >= 1, "paged_decode_attention: context length ", n, " of sequence ", b, " (at least 1)");
      TORCH_CHECK((n + bs - 1) / bs <= W, "paged_decode_attention: context longer than its block table");
      const int64_t first = window > 0 && n > window ? n - window : 0, L = n - first;  // the keys it sees
      const kv_t<KIND>* kh = kc + h * S * D;
      const kv_t<KIND>* vh = vc + h * S * D;
      krow.resize(L + DECODE_AHEAD);  // the context's rows, through the block table, then the rows to
      vrow.resize(L + DECODE_AHEAD);  // ask for past its end: the first values, after the last keys
      for (int64_t blk = first / bs; blk * bs < n; ++blk) {
        const int64_t base = tb[b * W + blk] * bs;
        TORCH_CHECK(base >= 0 && base + bs <= S, "paged_decode_attention: block table points outside the cache");
        for (int64_t o = std::max(first - blk * bs, int64_t(0)); o < bs && blk * bs + o < n; ++o) {
          krow[blk * bs + o - first] = kh + (base + o) * D;
          vrow[blk * bs + o - first] = vh + (base + o) * D;
        }
      }
      for (int64_t j = L; j < L + DECODE_AHEAD; ++j) {
        krow[j] = vrow[std::min(j - L, L - 1)];
        vrow[j] = vrow[L - 1];
      }
      scores.resize(ng * L);
      smax.assign(ng, -INFINITY);
      const float kscale = static_cast<float>(scale) * (ks ? ks[nks == 1 ? 0 : h] : 1.f);
      const float vscale = vs ? vs[nvs == 1 ? 0 : h] : 1.f;
      for (int64_t j0 = 0; j0 < L; j0 += DECODE_TILE) {  // scores: q . k over the context, a tile at a time
        const int64_t j1 = std::min(L, j0 + DECODE_TILE);
        int64_t g = g0;
#ifdef QTK_AVX2
        if (D % 8 == 0)  // 2 or 3 heads at a time, each key row decoded once for them all
          for (int64_t nh; (nh = heads_at_once(g1 - g)) > 1; g += nh) {
            const float* qr = qp + b * qs0 + (h * G + g) * qs1;
            float* sr = scores.data() + (g - g0) * L;
            __m128 mv[3];
            for (int64_t e = 0; e < nh; ++e) mv[e] = _mm_set1_ps(smax[g - g0 + e]);
            const __m128 sc = _mm_set1_ps(kscale);
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4)
              if (nh == 3)
                dot_heads<3, 4>(qr, qs1, &krow[j], D, sc, sr + j, L, mv, g == g0 ? &krow[j + DECODE_AHEAD] : nullptr);
              else
                dot_heads<2, 4>(qr, qs1, &krow[j], D, sc, sr + j, L, mv, g == g0 ? &krow[j + DECODE_AHEAD] : nullptr);
            for (int64_t e = 0; e < nh; ++e) {
              smax[g - g0 + e] = hmax4(mv[e]);
              dot_tail(qr + e * qs1, krow.data(), j, j1, D, kscale, sr + e * L, smax[g - g0 + e]);
            }
          }
#endif
        for (; g < g1; ++g) {
          const float* qr = qp + b * qs0 + (h * G + g) * qs1;
          float* sr = scores.data() + (g - g0) * L;
          float& m = smax[g - g0];  // each head's largest score, kept as they are written
          int64_t j = j0;
#ifdef QTK_AVX2
          if (D % 8 == 0) {
            __m128 mv = _mm_set1_ps(m);
            for (; j + 8 <= j1; j += 8)  // the rows' first reader asks for the next ones
              dot_heads<1, 8>(qr, 0, &krow[j], D, _mm_set1_ps(kscale), sr + j, 0, &mv,
                              g == g0 ? &krow[j + DECODE_AHEAD] : nullptr);
            m = hmax4(mv);
          }
#endif
          dot_tail(qr, krow.data(), j, j1, D, kscale, sr, m);
        }
      }
      for (int64_t g = g0; g < g1; ++g) {  // softmax: exp(s - max); vscale / their sum in smax's place
        float* sr = scores.data() + (g - g0) * L;
        float mx = smax[g - g0];
        if (softcap > 0.f) {  // tanh is monotonic: the capped maximum is the cap of the maximum
          for (int64_t jj = 0; jj < L; ++jj) sr[jj] = softcap * std::tanh(sr[jj] / softcap);
          mx = softcap * std::tanh(mx / softcap);
        }
        const float sink = sinks ? sinks[h * G + g] : -INFINITY;
        mx = std::max(mx, sink);
        smax[g - g0] = vscale / (exp_sum_(sr, L, mx) + (sinks ? std::exp(sink - mx) : 0.f));
      }
      for (int64_t j0 = 0; j0 < L; j0 += DECODE_TILE) {  // out = exp(s) . v, a tile at a time
        const int64_t n = std::min(DECODE_TILE, L - j0);
        int64_t g = g0;
#ifdef QTK_AVX2
        if (D % 32 == 0)  // 2 or 3 heads at a time, each value row decoded once for them all
          for (int64_t nh; (nh = heads_at_once(g1 - g)) > 1; g += nh)
            for (int64_t d0 = 0; d0 < D; d0 += 32)
              if (nh == 3)
                pv_heads<3, 4>(scores.data() + (g - g0) * L + j0, L, vrow.data() + j0, n, d0,
                               op + (b * H + h * G + g) * D, D, j0 > 0,
                               g == g0 && d0 == 0 ? vrow.data() + j0 + DECODE_AHEAD : nullptr, D);
              else
                pv_heads<2, 4>(scores.data() + (g - g0) * L + j0, L, vrow.data() + j0, n, d0,
                               op + (b * H + h * G + g) * D, D, j0 > 0,
                               g == g0 && d0 == 0 ? vrow.data() + j0 + DECODE_AHEAD : nullptr, D);
#endif
        for (; g < g1; ++g)
          weighted_rows(scores.data() + (g - g0) * L + j0, vrow.data() + j0, n, D, op + (b * H + h * G + g) * D,
                        j0 > 0, g == g0 ? vrow.data() + j0 + DECODE_AHEAD : nullptr);
      }
      for (int64_t g = g0; g < g1; ++g) {  // then divided by the sum, once per output row rather than per key
        float* o = op + (b * H + h * G + g) * D;
        const float inv = smax[g - g0];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size,
                                  double scale, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks) {
  const Kv kind = kv_kind(k_cache);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
              "paged_decode_attention: q must be float32 [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
              k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == q.size(2) &&
              q.size(1) % k_cache.size(0) == 0,
              "paged_decode_attention: caches must be contiguous [kv_heads, slots, D], both of one shape, with "
              "heads % kv_heads == 0");
  TORCH_CHECK(block_size > 0, "paged_decode_attention: block_size must be positive, got ", block_size);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == q.size(0) && lens.scalar_type() == at::kLong && lens.is_contiguous() &&
              lens.numel() == q.size(0), "paged_decode_attention: block_tables [B, W] and lens [B] must be int64");
  TORCH_CHECK((kind == Kv::F32 || kind == Kv::BF16) == !k_scale.has_value() && k_scale.has_value() == v_scale.has_value(),
              "paged_decode_attention: scales go with (and only with) an INT8 / FP8 cache");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor ks, vs;
  if (k_scale) {
    ks = kv_scale(*k_scale, k_cache.size(0), "paged_decode_attention");
    vs = kv_scale(*v_scale, k_cache.size(0), "paged_decode_attention");
  }
  const float* ksp = k_scale ? ks.data_ptr<float>() : nullptr;
  const float* vsp = k_scale ? vs.data_ptr<float>() : nullptr;
  const int64_t nks = k_scale ? ks.numel() : 0, nvs = k_scale ? vs.numel() : 0;
  at::Tensor sk;
  if (sinks) {
    TORCH_CHECK(sinks->numel() == q.size(1), "paged_decode_attention: sinks must hold one value per query head (",
                q.size(1), "), got ", sinks->numel());
    sk = sinks->to(at::kFloat).contiguous();
  }
  const float* skp = sinks ? sk.data_ptr<float>() : nullptr;
  const float cap = static_cast<float>(softcap);
  if (kind == Kv::F32)
    decode<Kv::F32>(q, k_cache, v_cache, block_tables, lens, block_size, scale, ksp, nks, vsp, nvs, window, cap, skp, out);
  else if (kind == Kv::BF16)
    decode<Kv::BF16>(q, k_cache, v_cache, block_tables, lens, block_size, scale, ksp, nks, vsp, nvs, window, cap, skp, out);
  else if (kind == Kv::I8)
    decode<Kv::I8>(q, k_cache, v_cache, block_tables, lens, block_size, scale, ksp, nks, vsp, nvs, window, cap, skp, out);
  else
    decode<Kv::F8>(q, k_cache, v_cache, block_tables, lens, block_size, scale, ksp, nks, vsp, nvs, window, cap, skp, out);
  return out;
}

// -- the sampler's draw ---------------------------------------------------------------------------
constexpr int64_t DRAW_BLOCK = 64;  // weights per partial sum: the scan recomputes at most one block's

// The weights of one block of a row, x[j0 .. j1) -> w: exp((x - m) * inv), 0 for NaN, -inf and anything
// below float32's smallest normal (+inf counts as the largest float); returns their sum
float draw_weights(const float* x, int64_t j0, int64_t j1, float m, float inv, float* w) {
  const float big = std::numeric_limits<float>::max();
  int64_t j = j0;
  float sum = 0.f;
#ifdef QTK_AVX2
  const __m256 mb = _mm256_set1_ps(m), iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-87.3f), top = _mm256_set1_ps(big);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= j1; j += 8) {  // min(top, x): a NaN x stays NaN, then compares false
    const __m256 a = _mm256_mul_ps(_mm256_sub_ps(_mm256_min_ps(top, _mm256_loadu_ps(x + j)), mb), iv);
    const __m256 e = _mm256_and_ps(exp8(a), _mm256_cmp_ps(a, lo, _CMP_GE_OQ));
    _mm256_storeu_ps(w + j - j0, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; j < j1; ++j) {
    const float a = ((x[j] > big ? big : x[j]) - m) * inv;
    sum += w[j - j0] = a >= -87.3f ? std::exp(a) : 0.f;
  }
  return sum;
}

// Row r's token: pass 1 the largest logit, pass 2 the weights' sum per block of DRAW_BLOCK (the weights
// are not kept: recomputing one block costs less than writing the row), pass 3 the block where the
// running sum passes u * sum, then the token inside it.
int64_t draw_row(const float* x, int64_t V, float t, float u, std::vector<float>& part) {
  const float big = std::numeric_limits<float>::max();
  float m = -INFINITY;
  int64_t i = 0;
#ifdef QTK_AVX2
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= V; i += 8)  // max(x, acc): a NaN x leaves acc
    mv = _mm256_max_ps(_mm256_min_ps(_mm256_set1_ps(big), _mm256_loadu_ps(x + i)), mv);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float l : lanes) m = std::max(m, l);
#endif
  for (; i < V; ++i)
    if (!(x[i] <= m)) m = std::isnan(x[i]) ? m : std::min(x[i], big);
  if (m == -INFINITY) return -1;  // every logit -inf or NaN
  const float inv = 1.f / t;
  const int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
  part.resize(nb);
  float w[DRAW_BLOCK], total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j0 = b * DRAW_BLOCK, j1 = std::min(V, j0 + DRAW_BLOCK);
    part[b] = draw_weights(x, j0, j1, m, inv, w);
    total += part[b];
  }
  if (!(total > 0.f)) return -1;
  const float target = u * total;
  float run = 0.f;
  int64_t last = -1;  // the last token of weight > 0: the answer where rounding leaves the target unpassed
  for (int64_t b = 0; b < nb; ++b) {
    if (part[b] == 0.f) continue;
    if (run + part[b] <= target) {
      run += part[b];
      continue;
    }
    const int64_t j0 = b * DRAW_BLOCK, j1 = std::min(V, j0 + DRAW_BLOCK);
    draw_weights(x, j0, j1, m, inv, w);
    for (int64_t j = 0; j < j1 - j0; ++j) {
      if (w[j] == 0.f) continue;
      run += w[j];
      last = j0 + j;
      if (run > target) return last;
    }
  }
  return last;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "sample_rows: logits must be float32 [B, V] with contiguous V");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.numel() == B && u.numel() == B, "sample_rows: temperature and u must hold one value per row");
  const at::Tensor t = temperature.to(at::kFloat).contiguous(), uu = u.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const float* up = uu.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r)
    TORCH_CHECK(tp[r] > 0.f && std::isfinite(1.f / tp[r]), "sample_rows: temperature must be positive with a finite "
                "reciprocal, got ", tp[r], " (a greedy row takes the argmax instead)");
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> part;
    for (int64_t r = r0; r < r1; ++r) op[r] = draw_row(x + r * logits.stride(0), V, tp[r], up[r], part);
  });
  return out;
}
}  // namespace

QTK_FRAGMENT(QTK_LIB, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool bf16_out=False) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor w, float eps, bool bf16_out=False) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("hadamard(Tensor x, int block) -> Tensor");
  m.def("store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots, Tensor? k_scale, "
        "Tensor? v_scale) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lens, "
        "int block_size, float scale, Tensor? k_scale, Tensor? v_scale, int window=0, float softcap=0., "
        "Tensor? sinks=None) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
}

QTK_IMPL(QTK_LIB, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("hadamard", &hadamard);
  m.impl("store_kv_", &store_kv_);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("sample_rows", &sample_rows);
}

namespace QTK_LIB {
namespace ops {  // for cpu_decode.cpp (cpu_ops.h)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out) {
  return ::rms_norm(x, w, eps, bf16_out);
}
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out) {
  return ::add_rms_norm_(residual, x, w, eps, bf16_out);
}
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) { ::rope_(x, cos, sin, heads); }
at::Tensor silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return ::gelu_tanh_and_mul(x); }
at::Tensor hadamard(const at::Tensor& x, int64_t block) { return ::hadamard(x, block); }
void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  ::store_kv_(k_cache, v_cache, k, v, slots, k_scale, v_scale);
}
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size, double scale,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  return ::paged_decode_attention(q, k_cache, v_cache, block_tables, lens, block_size, scale, k_scale, v_scale, window,
                                  softcap, sinks);
}
}  // namespace ops
}  // namespace QTK_LIB

// Python calls these directly (csrc/cpu_bindings.cpp): a pybind11 call costs ~1 us where torch.ops'
// schema-driven one cost ~4.5 us, which a decode step pays some 300 times.
namespace QTK_LIB {
void bind_layers(pybind11::module_& m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, nogil, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("bf16_out") = false);
  m.def("add_rms_norm_", &add_rms_norm_, nogil, py::arg("residual"), py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("bf16_out") = false);
  m.def("rope_", &rope_, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, nogil);
  m.def("hadamard", &hadamard, nogil, py::arg("x"), py::arg("block"));
  m.def("rms_norm_quant", &rms_norm_quant, nogil, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("static_scale"));
  m.def("add_rms_norm_quant_", &add_rms_norm_quant_, nogil, py::arg("residual"), py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("static_scale"));
  m.def("silu_and_mul_quant", &silu_and_mul_quant, nogil, py::arg("x"), py::arg("static_scale"));
  m.def("gelu_tanh_and_mul_quant", &gelu_tanh_and_mul_quant, nogil, py::arg("x"), py::arg("static_scale"));
  m.def("store_kv_", &store_kv_, nogil);
  m.def("paged_decode_attention", &paged_decode_attention, nogil, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_scale"),
        py::arg("v_scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("sample_rows", &sample_rows, nogil, py::arg("logits"), py::arg("temperature"), py::arg("u"));
}
}  // namespace QTK_LIB

