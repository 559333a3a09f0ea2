// The KV cache's element types, shared by the decode kernel (cpu_layers.cpp) and the prefill
// kernel (cpu_attention.cpp): float32 or bf16 (a float model's), INT8 or FP8 e4m3 (uint8 bits) with
// float32 scales per tensor or per KV head. Inside each file's anonymous namespace.
#pragma once

// FP8 e4m3 (finite, no infinities; 0x7F / 0xFF are NaN) -> float32
float e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  else if (exp == 15 && man == 7) v = NAN;
  else v = std::ldexp(1.f + man / 8.f, exp - 7);
  return sign ? -v : v;
}

struct E4M3Table {
  float v[256];
  E4M3Table() { for (int i = 0; i < 256; ++i) v[i] = e4m3_to_float(static_cast<uint8_t>(i)); }
};
const E4M3Table& e4m3() {
  static const E4M3Table t;
  return t;
}

enum class Kv { F32, BF16, I8, F8 };  // BF16: a float model's cache in bf16 (no scales)

// Scales of a quantized cache: one per tensor or one per KV head, as float32.
at::Tensor kv_scale(const at::Tensor& scale, int64_t kv_heads, const char* name) {
  TORCH_CHECK(scale.numel() == 1 || scale.numel() == kv_heads, name, ": k_scale and v_scale must hold 1 or ", kv_heads,
              " (kv_heads) values, got ", scale.numel());
  return scale.to(at::kFloat).contiguous();
}

Kv kv_kind(const at::Tensor& cache) {
  if (cache.scalar_type() == at::kFloat) return Kv::F32;
  if (cache.scalar_type() == at::kBFloat16) return Kv::BF16;
  if (cache.scalar_type() == at::kChar) return Kv::I8;
  TORCH_CHECK(cache.scalar_type() == at::kByte, "KV cache must be float32, bf16, int8 or FP8 e4m3 viewed as uint8");
  return Kv::F8;
}

template <Kv KIND>
using kv_t = std::conditional_t<KIND == Kv::F32, float, std::conditional_t<KIND == Kv::BF16, uint16_t,
                                 std::conditional_t<KIND == Kv::I8, int8_t, uint8_t>>>;

inline float as_float(float x) { return x; }
inline float as_float(uint16_t bf16) {  // the top half of a float32
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float as_float(int8_t code) { return code; }           // an INT8 cache's code (unscaled)
inline float as_float(uint8_t bits) { return e4m3().v[bits]; }  // an FP8 cache's e4m3 bits (unscaled)
