// Optimizers (SGD with momentum, AdamW with decoupled weight decay on >= 2-D weights only),
// learning-rate schedules and global-norm clipping. An optimizer holds its parameters by name so
// its state can be saved and loaded under Hugging Face-style names.
#pragma once
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace sg::optim {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  AdamW(NamedTensors params, AdamWConfig cfg);
  // One update with learning rate lr; gradients are multiplied by grad_scale first (clipping).
  // Parameters without a gradient are left alone (their moments do not advance), but the bias
  // correction of every parameter counts the optimizer's steps (PyTorch counts each parameter's
  // own; they differ only for a parameter that went without a gradient for some steps). An f32
  // parameter's gradient may be bf16/f16 (a mixed-precision model's own, read as it is).
  void step(double lr, double grad_scale = 1.0);
  // Mixed precision: the parameters are f32 masters of these half-precision tensors (one per
  // parameter, same order and sizes), which every step rewrites with the updated values rounded,
  // in the update's own pass.
  void set_copies(std::vector<Tensor> copies);
  int64_t steps() const { return step_; }
  // m, v per parameter ("<name>.exp_avg", "<name>.exp_avg_sq") and the step counter.
  NamedTensors state() const;
  void load_state(const NamedTensors& state, int64_t step);
  const AdamWConfig& config() const { return cfg_; }
  // Weight decay applies to matrices and embeddings only (dim >= 2), never to biases or gains.
  static bool decays(const Tensor& p) { return p.dim() >= 2; }

 private:
  NamedTensors params_;
  std::vector<Tensor> m_, v_, copies_;
  AdamWConfig cfg_;
  int64_t step_ = 0;
};

// One step's AdamW updates, gathered by add() and applied by run() with one adamw_many call per
// device and dtype (on a GPU one launch per batch of tensors, not one per parameter). Every optimizer that
// runs AdamW (AdamW, ZeRO, FSDP) goes through it.
class AdamWBatch {
 public:
  AdamWBatch(const AdamWConfig& cfg, double lr, double grad_scale, int64_t step);
  // param, m, v: contiguous, same dtype (f32/f64), device and element count; grad is made
  // contiguous, cast to param's dtype unless it is a bf16/f16 gradient of an f32 parameter (the
  // kernel reads those as they are), and kept alive until run(). decay: whether this tensor takes
  // the weight decay (AdamW::decays of the parameter it belongs to). copy (optional, contiguous,
  // the gradient's half type): receives the updated parameter rounded.
  void add(const Tensor& param, Tensor grad, const Tensor& m, const Tensor& v, bool decay,
           const Tensor& copy = Tensor());
  void run();

 private:
  AdamWConfig cfg_;
  double lr_, grad_scale_;
  int64_t step_;
  std::vector<Tensor> keep_;  // the converted gradients
  std::vector<std::pair<Tensor, Tensor>> late_copies_;  // (copy, param) the kernel does not write
  struct Group {
    Device device;
    std::vector<kernels::AdamWArgs> args;  // one parameter dtype and one gradient dtype
  };
  std::vector<Group> groups_;
};

struct SGDConfig {
  double momentum = 0.0, weight_decay = 0.0;
};

class SGD {
 public:
  SGD(NamedTensors params, SGDConfig cfg);
  // buf = momentum * buf + (g + wd * p);  p -= lr * buf   (PyTorch's form, no dampening)
  void step(double lr, double grad_scale = 1.0);

 private:
  NamedTensors params_;
  std::vector<Tensor> buf_;
  SGDConfig cfg_;
};

// Square root of the sum of squared gradients over all params (undefined grads count zero).
double global_grad_norm(const std::vector<Tensor>& params);
// The factor that brings a gradient norm down to max_norm (1 when within it or max_norm <= 0),
// as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6).
double clip_coefficient(double norm, double max_norm);

// A peak learning rate for AdamW by model size (non-embedding parameters), where none is given:
// GPT-3's rates for the sizes of GPT-2's four models (Brown et al. 2020, table 2.1: 6e-4 at 125M,
// 3e-4 at 350M, 2.5e-4 at 760M, 2e-4 at 1.3B), nanoGPT's 1e-3 for its ~10M character model, and
// 1e-2 for the sub-million-parameter models this engine's tests and demos train.
double default_peak_lr(int64_t non_embedding_params);

struct LrSchedule {
  std::string kind = "constant";  // constant | cosine | linear | wsd
  double lr = 3e-4, min_lr = 0.0;
  int64_t warmup_steps = 0, total_steps = 1;
  int64_t decay_steps = 0;  // wsd: the last decay_steps steps decay (0: a fifth of the steps after warmup)
  // Learning rate for step (0-based): linear warmup over warmup_steps to lr, then constant; a
  // cosine or a straight line from lr down to min_lr at total_steps; or wsd (warmup-stable-decay,
  // as MiniCPM and Megatron's WSD): lr until the last decay_steps steps, then a straight line to
  // min_lr at total_steps.
  double at(int64_t step) const;
  int64_t wsd_decay_steps() const { return decay_steps ? decay_steps : std::max<int64_t>(1, (total_steps - warmup_steps) / 5); }
  void validate() const;
};

}  // namespace sg::optim
