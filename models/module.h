// nn::Module: a tree of modules with named parameters and buffers ("h.0.attn.c_attn.weight").
// Parameters are tensor handles: a strategy that shards or gathers a parameter swaps the
// storage behind the same handle, and the module's forward never notices.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace sg::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  virtual ~Module() = default;
  NamedTensors named_parameters() const;  // registration order, depth first
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const { return children_; }
  int64_t num_parameters() const;
  void zero_grad();  // drops every parameter's .grad
  // Type name for wrap policies ("Block", "Linear", ...).
  virtual const char* type_name() const { return "Module"; }

 protected:
  // Allocates under the param ledger category; the name is this module's local name ("weight").
  Tensor register_parameter(const std::string& name, const Shape& shape, DType dtype, Device device);
  Tensor register_buffer(const std::string& name, Tensor t);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    children_.emplace_back(name, m);
    return m;
  }

 private:
  void collect(const std::string& prefix, NamedTensors& out, bool buffers) const;
  NamedTensors params_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// y = x W^T + b, W [out, in].
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& x) const;
  const char* type_name() const override { return "Linear"; }
  Tensor weight, bias;
  int64_t in_features, out_features;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& idx) const;
  const char* type_name() const override { return "Embedding"; }
  Tensor weight;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& x) const;
  const char* type_name() const override { return "LayerNorm"; }
  Tensor weight, bias;
  double eps;
};

}  // namespace sg::nn
