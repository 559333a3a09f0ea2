// The Python module of a kernel build (qtk.kernels.cpu.library): the functions of cpu_woq.cpp,
// cpu_w8a8.cpp, cpu_layers.cpp, cpu_attention.cpp, cpu_bf16_linear.cpp and cpu_decode.cpp as plain pybind11 functions. The first three's are
// also torch operators (torch.ops.<QTK_LIB>.*, for graphs); the engine calls these, which cost a
// quarter as much per call.
#include <torch/csrc/utils/pybind.h>

#ifndef QTK_LIB
#define QTK_LIB qtk_cpu_generic
#endif

namespace QTK_LIB {
void bind_woq(pybind11::module_& m);
void bind_layers(pybind11::module_& m);
void bind_w8a8(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_bf16_linear(pybind11::module_& m);
void bind_decode(pybind11::module_& m);
}  // namespace QTK_LIB

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  QTK_LIB::bind_woq(m);
  QTK_LIB::bind_layers(m);
  QTK_LIB::bind_w8a8(m);
  QTK_LIB::bind_attention(m);
  QTK_LIB::bind_bf16_linear(m);
  QTK_LIB::bind_decode(m);
}
