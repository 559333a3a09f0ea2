// The GLU activations' math, shared by cpu_layers.cpp (silu_and_mul, gelu_tanh_and_mul and their quantizing
// forms) and cpu_w8a8.cpp (a gate_up layer's products with the activation taken in their epilogue): one glu_span,
// so either gives the same bits. Included at file scope, before the file's own code: it brings <immintrin.h>
// and defines QTK_AVX2 / QTK_AVX512 (this build's vector widths: 8 lanes with AVX2 and FMA, 16 with AVX-512 F
// and BW as well); its functions have internal linkage.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QTK_AVX2 1
#endif
#if defined(QTK_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QTK_AVX512 1  // the avx512 build: the element-wise ops on 16 lanes (their 8-lane math, lane by lane)
#endif

namespace {

// e^x (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n in the exponent bits; within 2 ulp
// of std::exp), x clamped to [-87.3, 88.3] (the results stay normal floats): the constants of exp8 and
// exp16, which take the same steps on 8 and 16 lanes, so give the same results
constexpr float kExpLo = -87.3f, kExpHi = 88.3f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

#ifdef QTK_AVX2
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kExpLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}
#endif

// act(g) * u over rows x [T, 2I] = [g | u] -> [T, I], for the activations of the form
// act(g) = g / (1 + e^(-z(g))): SiLU, z = g; the tanh GELU (transformers' "gelu_pytorch_tanh",
// Gemma's), z = 2 sqrt(2/pi) (g + 0.044715 g^3), as g / 2 (1 + tanh(z / 2)) is the same function.
enum class Glu { SILU, GELU_TANH };
constexpr float kGeluZ = 1.5957691216057308f;  // 2 sqrt(2 / pi)

template <Glu ACT>
inline float glu_z(float g) {
  if constexpr (ACT == Glu::SILU) return g;
  else return kGeluZ * (g + 0.044715f * g * g * g);
}

#ifdef QTK_AVX2
template <Glu ACT>
inline __m256 glu_z8(__m256 g) {
  if constexpr (ACT == Glu::SILU) return g;
  else return _mm256_mul_ps(_mm256_set1_ps(kGeluZ),
                            _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
}
#endif
#ifdef QTK_AVX512
template <Glu ACT>
inline __m512 glu_z16(__m512 g) {
  if constexpr (ACT == Glu::SILU) return g;
  else return _mm512_mul_ps(_mm512_set1_ps(kGeluZ),
                            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
}
#endif

#ifdef QTK_AVX2
// 8 floats from float32 or bf16 (the top half of a float32), and back: bf16 rounded to nearest even,
// as torch rounds (finite values; the activations here are)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const uint16_t* p) { return load8(reinterpret_cast<const c10::BFloat16*>(p)); }  // a bf16 cache's
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // 8 x 16 bits in the low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

#ifdef QTK_AVX512
// 16 lanes of load8 / store8 / exp8: the same operations on each lane, so the same results
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}
#endif

// y[a .. b) = act(g) * u over one row's [a, b) (a a multiple of 16: every element then takes the same path,
// 16 or 8 lanes, whatever the split, so a row's results do not depend on how rows are shared out)
template <Glu ACT, typename T>
inline void glu_span(const T* g, const T* u, T* yr, int64_t a, int64_t b) {
  int64_t i = a;
#ifdef QTK_AVX512  // 1.85x (float32) and 2.1x (bf16) the 8-lane loop's speed on Zen 5 (512 rows x 1536)
  for (; i + 16 <= b; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), glu_z16<ACT>(gv)))));
    store16(yr + i, _mm512_mul_ps(s, load16(u + i)));
  }
#endif
#ifdef QTK_AVX2  // scalar std::exp took 8 us of a 1536-wide row, a quarter of the down projection's time
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= b; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), glu_z8<ACT>(gv)))));
    store8(yr + i, _mm256_mul_ps(s, load8(u + i)));
  }
#endif
  for (; i < b; ++i) {
    const float gi = g[i];
    yr[i] = static_cast<T>(gi / (1.f + std::exp(-glu_z<ACT>(gi))) * static_cast<float>(u[i]));
  }
}

}  // namespace
