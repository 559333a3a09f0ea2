// The ops of cpu_woq.cpp and cpu_layers.cpp as C++ functions other files of a build call (cpu_decode.cpp's
// decode step): the same functions Python calls through pybind11, one definition each.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif

namespace QTK_LIB {
namespace ops {
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zs, const std::optional<at::Tensor>& bias, int64_t bits, int64_t n);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps, bool bf16_out);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor hadamard(const at::Tensor& x, int64_t block);
void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size, double scale,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  int64_t window, double softcap, const std::optional<at::Tensor>& sinks);
}  // namespace ops
}  // namespace QTK_LIB
