#include "models/module.h"

#include "autograd/ops.h"

namespace sg::nn {

void Module::collect(const std::string& prefix, NamedTensors& out, bool buffers) const {
  for (const auto& [n, t] : buffers ? buffers_ : params_) out.emplace_back(prefix + n, t);
  for (const auto& [n, m] : children_) m->collect(prefix + n + ".", out, buffers);
}

NamedTensors Module::named_parameters() const {
  NamedTensors out;
  collect("", out, false);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters()) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers() const {
  NamedTensors out;
  collect("", out, true);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::zero_grad() {
  for (auto& [n, t] : named_parameters()) t.set_grad(Tensor());
}

Tensor Module::register_parameter(const std::string& name, const Shape& shape, DType dtype, Device device) {
  MemScope scope(MemCategory::param);
  Tensor t = zeros(shape, dtype, device);
  t.set_requires_grad(true);
  t.set_name(name);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  buffers_.emplace_back(name, t);
  return t;
}

Linear::Linear(int64_t in, int64_t out, bool has_bias, DType dtype, Device device) : in_features(in), out_features(out) {
  weight = register_parameter("weight", {out, in}, dtype, device);
  if (has_bias) bias = register_parameter("bias", {out}, dtype, device);
}
Tensor Linear::forward(const Tensor& x) const { return linear(x, weight, bias); }

Embedding::Embedding(int64_t num, int64_t dim, DType dtype, Device device) {
  weight = register_parameter("weight", {num, dim}, dtype, device);
}
Tensor Embedding::forward(const Tensor& idx) const { return embedding(weight, idx); }

LayerNorm::LayerNorm(int64_t dim, double eps_, DType dtype, Device device) : eps(eps_) {
  weight = register_parameter("weight", {dim}, dtype, device);
  bias = register_parameter("bias", {dim}, dtype, device);
  fill_(weight, 1.0);
}
Tensor LayerNorm::forward(const Tensor& x) const { return layernorm(x, weight, bias, eps); }

}  // namespace sg::nn
