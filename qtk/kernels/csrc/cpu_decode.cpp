// A decode step's decoder layers in one call: the sequence of qtk's CPU ops that models/native.py's fused
// forward calls one by one from Python, for a step of decodes only whose every projection runs on the
// weight-only kernel (cpu_woq.cpp) at the step's rows. The same ops in the same order on the same
// tensors, so the same numbers; what goes is Python's share of a small step: at batch 1 SmolLM2-135M's
// 30 layers are ~300 op calls, each with its interpreter work, argument conversion and tensor wrapping
// around a few microseconds of arithmetic.
//
// Per layer (heads H, KV heads KV, head dim D; h the residual stream, x its normalized rows):
//   y = qkv(x)                      [T, (H + 2 KV) D]: q, k and v side by side
//   rope_(y, cos, sin, H + KV)      q and k rotated in place (the layer's RoPE type)
//   store_kv_(k, v) into the layer's cache at the step's slots, then o = paged_decode_attention(q)
//   x = add_rms_norm_(h, o_proj(o), post_attention_norm)
//   x = add_rms_norm_(h, down(glu(gate_up(x))), next layer's input norm (the final norm after the last))
// A projection whose input is rotated online (a down projection, qtk/hadamard.py) gets hadamard(x) first.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cpu_ops.h"

namespace QTK_LIB {
namespace {

// A weight-only layer as woq_linear takes it (kernels/cpu.py's PackedWOQ), its input's Hadamard block or 0.
using LinearSpec = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, int64_t,
                              int64_t, int64_t>;

struct Linear {
  at::Tensor codes, scales;
  std::optional<at::Tensor> zs, bias;
  int64_t bits = 0, n = 0, hadamard = 0;

  explicit Linear(const LinearSpec& s)
      : codes(std::get<0>(s)), scales(std::get<1>(s)), zs(std::get<2>(s)), bias(std::get<3>(s)), bits(std::get<4>(s)),
        n(std::get<5>(s)), hadamard(std::get<6>(s)) {}

  at::Tensor operator()(const at::Tensor& x) const {
    return ops::woq_linear(hadamard ? ops::hadamard(x, hadamard) : x, codes, scales, zs, bias, bits, n);
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor post_norm;  // post_attention_layernorm's weight (float32 [hidden])
  double post_eps;
  at::Tensor k_cache, v_cache;
  std::optional<at::Tensor> k_scale, v_scale;  // [kv_heads or 1] for an INT8 / FP8 cache
  double scale;                                // the attention's score scale
  int64_t window;                              // sliding window, 0 for none
  double softcap;                              // 0 for none
  std::optional<at::Tensor> sinks;
  int64_t rope;  // which of forward's cos / sin this layer takes (its RoPE type)
};

class DecodeLayers {
 public:
  // norms: each layer's input norm, then the final norm (weight, eps); gelu: GeGLU (else SwiGLU)
  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, bool gelu, std::vector<at::Tensor> norms,
               std::vector<double> eps)
      : H_(heads), KV_(kv_heads), D_(head_dim), gelu_(gelu), norms_(std::move(norms)), eps_(std::move(eps)) {
    TORCH_CHECK(norms_.size() == eps_.size() && !norms_.empty(), "DecodeLayers: one eps per norm");
  }

  void add_layer(const LinearSpec& qkv, const LinearSpec& o, const LinearSpec& gate_up, const LinearSpec& down,
                 at::Tensor post_norm, double post_eps, at::Tensor k_cache, at::Tensor v_cache,
                 std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale, double scale, int64_t window,
                 double softcap, std::optional<at::Tensor> sinks, int64_t rope) {
    TORCH_CHECK(layers_.size() + 1 < norms_.size(), "DecodeLayers: more layers than input norms");
    layers_.push_back(Layer{Linear(qkv), Linear(o), Linear(gate_up), Linear(down), std::move(post_norm), post_eps,
                            std::move(k_cache), std::move(v_cache), std::move(k_scale), std::move(v_scale), scale,
                            window, softcap, std::move(sinks), rope});
  }

  // h [T, hidden] float32 (the embeddings; the residual stream, updated in place); cos / sin per RoPE type
  // [T, D]; block_tables [T, W], lens [T], slots [T] as the attention metadata holds them
  // -> the final norm of the last hidden states [T, hidden]
  at::Tensor forward(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size,
                     const at::Tensor& slots) const {
    TORCH_CHECK(layers_.size() + 1 == norms_.size(), "DecodeLayers: ", norms_.size() - 1, " layers expected, ",
                layers_.size(), " added");
    const int64_t T = h.size(0), H = H_, KV = KV_, D = D_;
    at::Tensor x = ops::rms_norm(h, norms_[0], eps_[0], false);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      at::Tensor y = L.qkv(x);
      const auto qkv = y.view({T, H + 2 * KV, D}).split_with_sizes({H, KV, KV}, 1);
      ops::rope_(y, cos[L.rope], sin[L.rope], H + KV);
      at::Tensor kc = L.k_cache, vc = L.v_cache;
      ops::store_kv_(kc, vc, qkv[1], qkv[2], slots, L.k_scale, L.v_scale);
      const at::Tensor o = ops::paged_decode_attention(qkv[0], kc, vc, block_tables, lens, block_size, L.scale,
                                                       L.k_scale, L.v_scale, L.window, L.softcap, L.sinks);
      x = ops::add_rms_norm_(h, L.o(o.view({T, H * D})), L.post_norm, L.post_eps, false);
      const at::Tensor g = L.gate_up(x);
      const at::Tensor m = L.down(gelu_ ? ops::gelu_tanh_and_mul(g) : ops::silu_and_mul(g));
      x = ops::add_rms_norm_(h, m, norms_[i + 1], eps_[i + 1], false);
    }
    return x;
  }

 private:
  int64_t H_, KV_, D_;
  bool gelu_;
  std::vector<at::Tensor> norms_;
  std::vector<double> eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<int64_t, int64_t, int64_t, bool, std::vector<at::Tensor>, std::vector<double>>(), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("gelu"), py::arg("norms"), py::arg("eps"))
      .def("add_layer", &DecodeLayers::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("post_norm"), py::arg("post_eps"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"),
           py::arg("v_scale"), py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("sinks"),
           py::arg("rope"))
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>(), py::arg("h"), py::arg("cos"),
           py::arg("sin"), py::arg("block_tables"), py::arg("lens"), py::arg("block_size"), py::arg("slots"));
}

}  // namespace QTK_LIB
