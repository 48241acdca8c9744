#include "models/module.h"

#include <set>

#include "autograd/ops.h"
#include "autograd/tape.h"

namespace sg::nn {

void Module::collect(const std::string& prefix, NamedTensors& out, bool buffers) const {
  for (const auto& [n, t] : buffers ? buffers_ : params_) out.emplace_back(prefix + n, t);
  for (const auto& [n, m] : children_) m->collect(prefix + n + ".", out, buffers);
}

namespace {

// Each tensor once, under the first name it is reached by (a module registered twice, a weight
// shared): PyTorch's named_parameters(remove_duplicate=True). Counted twice, an optimizer would
// step it twice and a global norm count it twice.
NamedTensors first_names(NamedTensors all) {
  std::set<const void*> seen;
  NamedTensors out;
  for (auto& [n, t] : all)
    if (seen.insert(t.impl()).second) out.emplace_back(std::move(n), std::move(t));
  return out;
}

}  // namespace

NamedTensors Module::named_parameters() const {
  NamedTensors all;
  collect("", all, false);
  return first_names(std::move(all));
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters()) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers() const {
  NamedTensors all;
  collect("", all, true);
  return first_names(std::move(all));
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

Tensor Module::hooked(const std::function<Tensor()>& forward) const {
  if (pre_forward) pre_forward();
  Tensor y = forward();
  return post_forward ? post_forward(y) : y;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{"", this}};
  for (const auto& [n, m] : children_)
    for (auto& [below, sub] : m->named_modules()) out.emplace_back(below.empty() ? n : n + "." + below, sub);
  return out;
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

void materialize(const Tensor& p, Device device) {
  SG_CHECK(p.defined() && p.device().is_meta(), "materialize: ", p.defined() ? p.describe() : "an undefined tensor",
           " is not on a meta device");
  SG_CHECK(p.is_contiguous() && p.offset() == 0 && p.storage()->nbytes() == p.nbytes(), "materialize: ",
           p.describe(), " is a view into a larger storage, not a parameter of its own");
  MemScope scope(MemCategory::param);
  p.impl()->storage = zeros(p.shape(), p.dtype(), device).impl()->storage;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  buffers_.emplace_back(name, t);
  return t;
}

Linear::Linear(int64_t in, int64_t out, bool has_bias, DType dtype, Device device) : in_features(in), out_features(out) {
  weight = register_parameter("weight", {out, in}, dtype, device);
  if (has_bias) bias = register_parameter("bias", {out}, dtype, device);
}
Tensor Linear::forward(const Tensor& x, const Tensor& residual) const { return linear(x, weight, bias, residual); }
Tensor Linear::forward_gelu(const Tensor& x) const { return linear_gelu(x, weight, bias); }

Embedding::Embedding(int64_t num, int64_t dim, DType dtype, Device device) {
  weight = register_parameter("weight", {num, dim}, dtype, device);
}
Tensor Embedding::forward(const Tensor& idx) const { return embedding(weight, idx); }

LayerNorm::LayerNorm(int64_t dim, double eps_, DType dtype, Device device) : eps(eps_) {
  weight = register_parameter("weight", {dim}, dtype, device);
  bias = register_parameter("bias", {dim}, dtype, device);
  autograd::NoGradGuard ng;  // a module built while a tape records: its init is not part of the graph
  fill_(weight, 1.0);
}
Tensor LayerNorm::forward(const Tensor& x) const { return layernorm(x, weight, bias, eps); }
std::pair<Tensor, Tensor> LayerNorm::forward_add(const Tensor& x, const Tensor& residual) const {
  return add_layernorm(x, residual, weight, bias, eps);
}

}  // namespace sg::nn

namespace sg::nn {

BatchNorm::BatchNorm(int64_t channels, double eps_, double momentum_, DType dtype, Device device)
    : eps(eps_), momentum(momentum_) {
  weight = register_parameter("weight", {channels}, dtype, device);
  bias = register_parameter("bias", {channels}, dtype, device);
  autograd::NoGradGuard ng;  // as LayerNorm's
  fill_(weight, 1.0);
  running_mean = register_buffer("running_mean", zeros({channels}, dtype, device));
  running_var = register_buffer("running_var", ones({channels}, dtype, device));
}

Tensor BatchNorm::as_rows(const Tensor& x) {
  SG_CHECK(x.dim() == 2 || x.dim() == 3, "BatchNorm: expected [N, C] or [N, C, L], got ", shape_str(x.shape()));
  if (x.dim() == 2) return x;
  return reshape(transpose(x, 1, 2), {-1, x.size(1)});  // [N*L, C]
}

Tensor BatchNorm::forward(const Tensor& x) {
  const int64_t C = weight.size(0);
  SG_CHECK(x.size(1) == C, "BatchNorm: input has ", x.size(1), " channels, the layer ", C);
  Tensor rows = as_rows(x);
  Tensor mean, var;
  if (training) {
    Tensor sx = sum(rows, {0}), sx2 = sum(square(rows), {0});
    double n = double(rows.size(0));
    reduce_statistics(sx, sx2, n);
    SG_CHECK(n > 1, "BatchNorm: training needs more than one value per channel, got ", n);
    mean = mul(sx, 1.0 / n);
    var = sub(mul(sx2, 1.0 / n), square(mean));  // biased, as used for normalising
    autograd::NoGradGuard ng;
    copy_(running_mean, add(mul(running_mean, 1 - momentum), mul(mean, momentum)));
    copy_(running_var, add(mul(running_var, 1 - momentum), mul(var, momentum * n / (n - 1))));
  } else {
    mean = running_mean;
    var = running_var;
  }
  Tensor y = add(mul(mul(sub(rows, mean), pow(add(var, eps), -0.5)), weight), bias);
  if (x.dim() == 2) return y;
  return transpose(reshape(y, {x.size(0), x.size(2), C}), 1, 2);
}

}  // namespace sg::nn
