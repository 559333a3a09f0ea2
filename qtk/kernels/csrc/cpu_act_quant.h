// W8A8's activation quantization, shared by the W8A8 kernel (cpu_w8a8.cpp: x quantized inside the call) and
// the ops that hand it its input already quantized (cpu_layers.cpp: a norm's or a GLU's rows, quantized as
// they are written, as vLLM's fused rms_norm + quant and silu_and_mul + quant kernels do). One function, so
// either place gives the same bytes. Inside each file's anonymous namespace.
//
//   quantized rows:  u uint8 [M, K4] = clamp(round(x / s), -128, 127) + 128 (round half to even), padded with
//                    128 (q = 0) to K4 = K rounded up to a multiple of 4; s float32 [M]: max |x_m| / 127 per
//                    row (FLT_EPSILON where not > 0), or the static per-tensor scale for every row. The same
//                    float32 division and rounding as qtk.quant.quantize_activation.
// The including file brings <immintrin.h> (where __AVX512F__ and __AVX512BW__ are defined), <cfloat>,
// <cmath>, <optional>, <tuple> and <vector>.
#pragma once

inline int64_t quant_width(int64_t K) { return (K + 3) / 4 * 4; }

// Row x [K] into q [K4] as above; returns its scale (static_scale's value where given)
inline float quantize_row(const float* x, int64_t K, int64_t K4, const float* static_scale, uint8_t* q) {
  float s;
  if (static_scale) {
    s = *static_scale;
  } else {
    float amax = 0.f;
    int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 m = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    s = amax / 127.f;  // qtk.quant.quantize_activation: absmax / qmax in float32, eps where not > 0
    if (!(s > 0.f)) s = FLT_EPSILON;
  }
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512i off = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), sv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), off)));
  }
#endif
  for (; k < K; ++k) {
    const float v = std::min(std::max(std::nearbyint(x[k] / s), -128.f), 127.f);
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
  }
  for (; k < K4; ++k) q[k] = 128;
  return s;
}

// An optional static input scale: one float32, its value in *value; false where none is given
inline bool static_scale_of(const std::optional<at::Tensor>& scale, const char* name, float* value) {
  if (!scale) return false;
  TORCH_CHECK(scale->numel() == 1 && scale->scalar_type() == at::kFloat, name, ": a static input scale must be one float32");
  *value = scale->item<float>();
  return true;
}

// Empty quantized rows for M rows of K: (u uint8 [M, K4], s float32 [M])
inline std::tuple<at::Tensor, at::Tensor> empty_quantized(int64_t M, int64_t K) {
  return {at::empty({M, quant_width(K)}, at::TensorOptions().dtype(at::kByte)), at::empty({M}, at::TensorOptions().dtype(at::kFloat))};
}

// A thread's float32 row of at least n, kept between calls: where a fused op writes a row before quantizing it
inline float* row_buffer(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
