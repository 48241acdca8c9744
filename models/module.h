// nn::Module: a tree of modules with named parameters and buffers ("h.0.attn.c_attn.weight").
// Parameters are tensor handles: a strategy that shards or gathers a parameter swaps the
// storage behind the same handle, and the module's forward never notices.
#pragma once
#include <functional>
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
  NamedTensors named_parameters() const;  // registration order, depth first; a shared tensor once
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const { return children_; }
  int64_t num_parameters() const;
  void zero_grad();  // drops every parameter's .grad
  // Type name for wrap policies ("Block", "Linear", ...).
  virtual const char* type_name() const { return "Module"; }

  // Forward hooks for sharding strategies (parallel/fsdp.h gathers a unit's parameters before its
  // forward and releases them after). Empty by default; the modules that call them say so (Block,
  // GPT). post_forward gets the forward's output and returns what the forward hands on: the output
  // itself, or the output wrapped in an autograd node.
  std::function<void()> pre_forward;
  std::function<Tensor(const Tensor&)> post_forward;
  // forward() between the hooks: pre_forward, then forward, then post_forward on its output. A
  // module that FSDP shards as a unit runs its forward through this (Block and GPT do).
  Tensor hooked(const std::function<Tensor()>& forward) const;
  // This module ("") and every module below it with its name ("h.0", "h.0.attn"), depth first.
  std::vector<std::pair<std::string, Module*>> named_modules();

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

// Gives a parameter built on a meta device real memory on `device`, zeroed and charged to the param
// category, keeping its handle, shape, name and requires_grad (PyTorch's to_empty on one tensor):
// a model built on meta then holds memory only for the parameters this rank keeps (a pipeline
// stage's). Initialise or load it afterwards.
void materialize(const Tensor& p, Device device);

// Parameters start at zero (LayerNorm's and BatchNorm's gains at one): the engine draws nothing
// without a seed. Initialise them from one (randn(shape, seed, stream, ...) copied in under a
// NoGradGuard, as examples/ do; GPT::init_weights for GPT-2's scheme). PyTorch's modules draw a
// Kaiming-uniform init from its global generator instead.

// y = x W^T + b, W [out, in].
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias, DType dtype = DType::f32, Device device = Device::cpu());
  // With residual: residual + forward(x), the add in the GEMM's epilogue (sg::linear).
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor()) const;
  Tensor forward_gelu(const Tensor& x) const;  // gelu(forward(x)) in one op (sg::linear_gelu)
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
  // {x + residual, forward(x + residual)} in one fused op (sg::add_layernorm).
  std::pair<Tensor, Tensor> forward_add(const Tensor& x, const Tensor& residual) const;
  const char* type_name() const override { return "LayerNorm"; }
  Tensor weight, bias;
  double eps;
};

}  // namespace sg::nn

namespace sg::nn {

// BatchNorm over the batch of x [N, C] (or [N, C, L], statistics over N and L) with affine weight
// and bias and running statistics (momentum 0.1, unbiased running variance, as PyTorch).
class BatchNorm : public Module {
 public:
  explicit BatchNorm(int64_t channels, double eps = 1e-5, double momentum = 0.1, DType dtype = DType::f32,
                     Device device = Device::cpu());
  Tensor forward(const Tensor& x);
  const char* type_name() const override { return "BatchNorm"; }
  Tensor weight, bias, running_mean, running_var;
  double eps, momentum;
  bool training = true;

 protected:
  // The batch statistics' sums over the batch: [C] sums of x and of x^2 plus the element count.
  // SyncBatchNorm reduces these over its group; here they stay local.
  virtual void reduce_statistics(Tensor& sum_x, Tensor& sum_x2, double& count) {}
  // x as [rows, C]: the layout statistics are taken over.
  static Tensor as_rows(const Tensor& x);
};

}  // namespace sg::nn
