#include "parallel/fsdp.h"

#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"

namespace sg::parallel {

namespace {
// A 1-D f32 handle on a whole storage: it reads storage->data() at each use, so it follows the
// storage through release() and reallocate().
Tensor over(const std::shared_ptr<Storage>& s, int64_t n) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = s;
  impl->layout.shape = {n};
  impl->layout.strides = {1};
  impl->dtype = DType::f32;
  return Tensor(impl);
}
Tensor flat_view(const Tensor& t) { return reshape(t, {t.numel()}); }
}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> group,
                                                   optim::AdamWConfig adam, bool broadcast_from_rank0)
    : model_(model), group_(std::move(group)), adam_(adam), alive_(std::make_shared<bool>(true)) {
  SG_CHECK(group_, "zero3: no process group");
  SG_CHECK(model_.config.tp == 1 && model_.wte, "zero3: tensor-parallel models are not supported");
  const int N = group_->size(), r = group_->rank();

  // Units: the root (wte, wpe, ln_f) first, then one per block.
  units_.resize(1 + model_.h.size());
  units_[0].name = "root";
  units_[0].module = &model_;
  for (auto* m : {static_cast<nn::Module*>(model_.wte.get()), static_cast<nn::Module*>(model_.wpe.get()),
                  static_cast<nn::Module*>(model_.ln_f.get())})
    for (auto& np : m->named_parameters()) units_[0].params.push_back(np);
  for (size_t i = 0; i < model_.h.size(); ++i) {
    units_[i + 1].name = "h." + std::to_string(i);
    units_[i + 1].module = model_.h[i].get();
    units_[i + 1].params = model_.h[i]->named_parameters();
  }
  size_t covered = 0;
  for (auto& u : units_) covered += u.params.size();
  SG_CHECK(covered == model_.parameters().size(), "zero3: the units cover ", covered, " of the model's ",
           model_.parameters().size(), " parameters");

  autograd::NoGradGuard ng;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = units_[k];
    const Device dev = u.params[0].second.device();
    for (auto& [n, p] : u.params) {
      SG_CHECK(p.dtype() == DType::f32, "zero3: parameter '", n, "' is ", p.describe(), " (f32 only for now)");
      SG_CHECK(p.device() == dev, "zero3: parameters of unit ", u.name, " live on different devices");
      SG_CHECK(p.is_contiguous() && p.offset() == 0, "zero3: parameter '", n, "' is not a whole contiguous tensor");
      u.offsets.push_back(u.numel);
      u.numel += p.numel();
    }
    u.shard = (u.numel + N - 1) / N;
    const int64_t padded = u.shard * N;
    {
      MemScope scope(MemCategory::param);
      u.flat = std::make_shared<Storage>(size_t(padded) * 4, dev, MemCategory::param);
      u.shard_param = zeros({u.shard}, DType::f32, dev);
    }
    u.full = over(u.flat, padded);
    zero_(u.full);  // the padding
    // Move every parameter into the flat storage: same handle, new storage and offset.
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor& p = u.params[i].second;
      copy_(narrow(u.full, 0, u.offsets[i], p.numel()), flat_view(p));
      p.impl()->storage = u.flat;
      p.impl()->layout.offset = u.offsets[i];
    }
    if (broadcast_from_rank0) group_->broadcast(u.full, 0)->wait();
    copy_(u.shard_param, narrow(u.full, 0, r * u.shard, u.shard));
    u.flat->release();
    // This rank's segments: the parameter pieces inside [r·S, (r+1)·S).
    const int64_t begin = r * u.shard, end = begin + u.shard;
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t lo = std::max(begin, u.offsets[i]), hi = std::min(end, u.offsets[i] + u.params[i].second.numel());
      if (hi > lo) u.segments.push_back(Segment{i, lo - u.offsets[i], hi - lo, lo - begin});
    }
    {
      MemScope scope(MemCategory::grad);  // the partitioned gradient: 4Ψu_p/N bytes
      u.grad_shard = zeros({u.shard}, DType::f32, dev);
    }
    {
      MemScope scope(MemCategory::optim_state);  // m and v for the shard only: 8Ψu_p/N bytes
      u.m = zeros({u.shard}, DType::f32, dev);
      u.v = zeros({u.shard}, DType::f32, dev);
    }
    u.marked.assign(u.params.size(), 0);

    std::weak_ptr<bool> alive = alive_;
    u.module->pre_forward = [this, k, alive] {
      if (alive.lock()) gather(units_[k]);
    };
    u.module->post_forward = [this, k, alive](const Tensor& y) {
      if (!alive.lock()) return y;
      release(units_[k]);
      return wrap(units_[k], y);
    };
    for (size_t i = 0; i < u.params.size(); ++i)
      u.params[i].second.add_grad_ready_hook([this, k, i, alive](const Tensor&) {
        if (alive.lock()) on_grad_ready(units_[k], i);
      });
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  *alive_ = false;
  for (auto& u : units_) {
    u.module->pre_forward = nullptr;
    u.module->post_forward = nullptr;
  }
}

int64_t FullyShardedDataParallel::numel() const {
  int64_t n = 0;
  for (auto& u : units_) n += u.numel;
  return n;
}

int64_t FullyShardedDataParallel::padded_numel() const {
  int64_t n = 0;
  for (auto& u : units_) n += u.shard * group_->size();
  return n;
}

void FullyShardedDataParallel::gather(Unit& u) {
  if (u.gathered) return;
  u.flat->reallocate(size_t(u.full.numel()) * 4);
  group_->all_gather(u.full, u.shard_param)->wait();
  u.gathered = true;
}

void FullyShardedDataParallel::release(Unit& u) {
  u.flat->release();
  u.gathered = false;
}

Tensor FullyShardedDataParallel::wrap(Unit& u, const Tensor& y) {
  if (!autograd::needs_grad({y})) return y;
  Tensor out = y.with_layout(y.layout());
  std::weak_ptr<bool> alive = alive_;
  Unit* unit = &u;
  autograd::record("fsdp_gather(" + u.name + ")", {y}, {out}, [this, unit, alive](const autograd::TensorList& g) {
    if (alive.lock()) gather(*unit);
    return autograd::TensorList{g[0]};
  });
  return out;
}

void FullyShardedDataParallel::on_grad_ready(Unit& u, size_t i) {
  if (u.marked[i]) return;
  u.marked[i] = 1;
  if (++u.ready == int(u.params.size())) reduce(u);
}

// Packs the unit's full gradients into one comm_buffer (zeros for padding and for parameters
// without a gradient), reduce-scatters (avg) it into the shard gradient — accumulating over
// micro-batches — then frees the full gradients and releases the gathered parameters.
void FullyShardedDataParallel::reduce(Unit& u) {
  autograd::NoGradGuard ng;
  const int64_t S = u.shard;
  const Device dev = u.grad_shard.device();
  Tensor in, out;
  {
    MemScope scope(MemCategory::comm_buffer);
    in = zeros({S * group_->size()}, DType::f32, dev);
    out = empty({S}, DType::f32, dev);
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    const Tensor& p = u.params[i].second;
    if (p.grad().defined()) copy_(narrow(in, 0, u.offsets[i], p.numel()), flat_view(p.grad()));
    p.set_grad(Tensor());
  }
  group_->reduce_scatter(out, in, comm::ReduceOp::avg)->wait();
  add_(u.grad_shard, out);
  release(u);
  u.ready = 0;
  std::fill(u.marked.begin(), u.marked.end(), 0);
}

void FullyShardedDataParallel::finish_gradients() {
  for (auto& u : units_)  // unit order: every rank issues the same sequence
    if (u.ready > 0 || u.gathered) reduce(u);
}

double FullyShardedDataParallel::grad_norm() {
  autograd::NoGradGuard ng;
  double ss = 0;
  for (auto& u : units_) ss += sum_squares(u.grad_shard);  // padding is zero
  Tensor t = from_vector<double>({ss}, {1});
  group_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return std::sqrt(item(t));
}

void FullyShardedDataParallel::step(double lr, double grad_scale) {
  autograd::NoGradGuard ng;
  ++step_;
  for (auto& u : units_)
    for (const Segment& s : u.segments) {
      kernels::AdamWArgs a;
      a.dtype = DType::f32;
      a.n = s.len;
      a.param = u.shard_param.data<float>() + s.at;
      a.grad = u.grad_shard.data<float>() + s.at;
      a.m = u.m.data<float>() + s.at;
      a.v = u.v.data<float>() + s.at;
      a.lr = lr;
      a.beta1 = adam_.beta1;
      a.beta2 = adam_.beta2;
      a.eps = adam_.eps;
      a.weight_decay = optim::AdamW::decays(u.params[s.param].second) ? adam_.weight_decay : 0.0;
      a.grad_scale = grad_scale;
      a.step = step_;
      SG_KERNEL(u.shard_param.device(), adamw)(a);
    }
}

void FullyShardedDataParallel::zero_grad() {
  autograd::NoGradGuard ng;
  for (auto& u : units_) {
    for (auto& [n, p] : u.params) p.set_grad(Tensor());
    zero_(u.grad_shard);
    u.ready = 0;
    std::fill(u.marked.begin(), u.marked.end(), 0);
  }
}

void FullyShardedDataParallel::gather_all() {
  for (auto& u : units_) gather(u);
}

void FullyShardedDataParallel::release_all() {
  for (auto& u : units_) release(u);
}

}  // namespace sg::parallel
