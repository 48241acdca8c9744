#include "optim/optim.h"

#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"

namespace sg::optim {

namespace {
void check_not_updated_elsewhere(const char* who, const std::string& name, const Tensor& p) {
  SG_CHECK(p.updated_by().empty(), who, ": parameter '", name, "' is updated by ", p.updated_by(),
           ", whose own step() updates it (its gradient is sharded or freed there): don't build a second optimizer ",
           "over it");
}
}  // namespace

AdamW::AdamW(NamedTensors params, AdamWConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  MemScope scope(MemCategory::optim_state);
  for (auto& [n, p] : params_) {
    check_not_updated_elsewhere("AdamW", n, p);
    SG_CHECK(p.dtype() == DType::f32 || p.dtype() == DType::f64, "AdamW: parameter '", n, "' is ",
             dtype_name(p.dtype()), "; keep f32 master weights for the optimizer");
    m_.push_back(zeros(p.shape(), p.dtype(), p.device()));
    v_.push_back(zeros(p.shape(), p.dtype(), p.device()));
  }
}

void AdamW::step(double lr, double grad_scale) {
  autograd::NoGradGuard ng;
  ++step_;
  AdamWBatch batch(cfg_, lr, grad_scale, step_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;
    SG_CHECK(p.is_contiguous(), "AdamW: parameter '", params_[i].first, "' is not contiguous");
    batch.add(p, p.grad(), m_[i], v_[i], decays(p), copies_.empty() ? Tensor() : copies_[i]);
  }
  batch.run();
}

void AdamW::set_copies(std::vector<Tensor> copies) {
  SG_CHECK(copies.empty() || copies.size() == params_.size(), "AdamW::set_copies: ", copies.size(),
           " copies for ", params_.size(), " parameters");
  for (size_t i = 0; i < copies.size(); ++i)
    SG_CHECK(copies[i].numel() == params_[i].second.numel() && is_half(copies[i].dtype()) &&
                 copies[i].device() == params_[i].second.device(),
             "AdamW::set_copies: parameter '", params_[i].first, "' is ", params_[i].second.describe(), ", its copy ",
             copies[i].describe(), " (want a bf16/f16 tensor of as many elements on the same device)");
  copies_ = std::move(copies);
}

AdamWBatch::AdamWBatch(const AdamWConfig& cfg, double lr, double grad_scale, int64_t step)
    : cfg_(cfg), lr_(lr), grad_scale_(grad_scale), step_(step) {}

void AdamWBatch::add(const Tensor& param, Tensor grad, const Tensor& m, const Tensor& v, bool decay,
                     const Tensor& copy) {
  SG_CHECK(param.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
           "AdamW: the parameter and its moments must be contiguous");
  SG_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
           "AdamW: parameter ", param.describe(), " with gradient ", grad.describe(), " and moments ", m.describe(),
           ", ", v.describe(), ": element counts differ");
  grad = contiguous(grad);
  const bool half_grad = param.dtype() == DType::f32 && is_half(grad.dtype());
  if (!half_grad && grad.dtype() != param.dtype()) grad = to(grad, param.dtype());
  kernels::AdamWArgs a;
  a.dtype = param.dtype();
  if (half_grad) a.grad_dtype = grad.dtype();
  if (copy.defined()) {
    SG_CHECK(copy.is_contiguous() && copy.numel() == param.numel() && copy.device() == param.device(),
             "AdamW: the copy ", copy.describe(), " of parameter ", param.describe(),
             " must be contiguous, as large and on the same device");
    // The kernel rounds into the gradient's half type; any other copy is made after the update.
    if (half_grad && copy.dtype() == grad.dtype()) a.copy = copy.data_ptr();
    else late_copies_.emplace_back(copy, param);
  }
  a.n = param.numel();
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.m = m.data_ptr();
  a.v = v.data_ptr();
  a.lr = lr_;
  a.beta1 = cfg_.beta1;
  a.beta2 = cfg_.beta2;
  a.eps = cfg_.eps;
  a.weight_decay = decay ? cfg_.weight_decay : 0.0;
  a.grad_scale = grad_scale_;
  a.step = step_;
  keep_.push_back(std::move(grad));
  auto it = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) {
    return g.device == param.device() && g.args[0].dtype == a.dtype && g.args[0].grad_type() == a.grad_type();
  });
  if (it == groups_.end()) it = groups_.insert(groups_.end(), Group{param.device(), {}});
  it->args.push_back(a);
}

void AdamWBatch::run() {
  autograd::NoGradGuard ng;
  for (const Group& g : groups_) SG_KERNEL(g.device, adamw_many)(g.args.data(), int64_t(g.args.size()));
  for (auto& [copy, param] : late_copies_) copy_(copy, param);
  groups_.clear();
  keep_.clear();
  late_copies_.clear();
}

NamedTensors AdamW::state() const {
  NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].first + ".exp_avg", m_[i]);
    out.emplace_back(params_[i].first + ".exp_avg_sq", v_[i]);
  }
  return out;
}

void AdamW::load_state(const NamedTensors& state, int64_t step) {
  std::map<std::string, Tensor> by_name(state.begin(), state.end());
  for (size_t i = 0; i < params_.size(); ++i) {
    for (auto [suffix, dst] : {std::pair{".exp_avg", &m_[i]}, std::pair{".exp_avg_sq", &v_[i]}}) {
      auto it = by_name.find(params_[i].first + suffix);
      SG_CHECK(it != by_name.end(), "optimizer state: '", params_[i].first, suffix, "' is missing");
      SG_CHECK(it->second.shape() == dst->shape(), "optimizer state: '", params_[i].first, suffix, "' has shape ",
               shape_str(it->second.shape()), ", expected ", shape_str(dst->shape()));
      copy_(*dst, it->second);
    }
  }
  step_ = step;
}

SGD::SGD(NamedTensors params, SGDConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  MemScope scope(MemCategory::optim_state);
  for (auto& [n, p] : params_) check_not_updated_elsewhere("SGD", n, p);
  for (auto& [n, p] : params_) buf_.push_back(cfg_.momentum != 0 ? zeros(p.shape(), p.dtype(), p.device()) : Tensor());
}

void SGD::step(double lr, double grad_scale) {
  autograd::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor d = grad_scale == 1.0 ? g : mul(g, grad_scale);
    if (cfg_.weight_decay != 0) d = add(d, mul(p, cfg_.weight_decay));
    if (cfg_.momentum != 0) {
      copy_(buf_[i], add(mul(buf_[i], cfg_.momentum), d));
      d = buf_[i];
    }
    add_(p, d, -lr);
  }
}

double global_grad_norm(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad());  // undefined ones count zero
  return std::sqrt(sum_squares(grads));
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

void LrSchedule::validate() const {
  SG_CHECK(kind == "constant" || kind == "cosine" || kind == "linear" || kind == "wsd", "--lr-schedule: unknown schedule '",
           kind, "' (expected constant, cosine, linear or wsd)");
  SG_CHECK(decay_steps >= 0 && decay_steps <= std::max<int64_t>(0, total_steps - warmup_steps), "--decay-steps must be in ",
           "[0, steps - warmup steps] = [0, ", std::max<int64_t>(0, total_steps - warmup_steps), "], got ", decay_steps);
  SG_CHECK(!decay_steps || kind == "wsd", "--decay-steps sets the wsd schedule's decay, not ", kind, "'s");
  SG_CHECK(lr > 0, "--lr must be > 0, got ", lr);
  SG_CHECK(min_lr >= 0 && min_lr <= lr, "--min-lr must be in [0, lr], got ", min_lr);
  SG_CHECK(warmup_steps >= 0, "--warmup-steps must be >= 0, got ", warmup_steps);
}

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return lr * double(step + 1) / double(warmup_steps);
  if (kind == "constant") return lr;
  // The decay: from its first step (ratio 0, lr) to total_steps (ratio 1, min_lr).
  const int64_t start = kind == "wsd" ? std::max(warmup_steps, total_steps - wsd_decay_steps()) : warmup_steps;
  if (step < start) return lr;  // wsd's stable phase
  const int64_t span = std::max<int64_t>(1, total_steps - start);
  const double ratio = std::min(1.0, double(step - start) / double(span));
  if (kind == "cosine") return min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (lr - min_lr);
  return lr - ratio * (lr - min_lr);  // linear, wsd
}

double default_peak_lr(int64_t n) {
  if (n < 1'000'000) return 1e-2;
  if (n < 20'000'000) return 1e-3;
  if (n < 200'000'000) return 6e-4;
  if (n < 500'000'000) return 3e-4;
  if (n < 1'000'000'000) return 2.5e-4;
  return 2e-4;
}

}  // namespace sg::optim
