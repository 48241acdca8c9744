#include "parallel/zero.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/trace.h"
#include "kernels/ops.h"
#include "parallel/tp/layers.h"

namespace sg::parallel {

GradWeight mesh_grad_weight(int tp_rank, bool first_stage) {
  return [tp_rank, first_stage](const std::string& name) {
    if (name == "wte.weight") return first_stage ? 1.0 : 0.0;  // both pipeline ends hold the summed gradient
    return tp_rank == 0 || !tp::gpt_param_split(name).replicated() ? 1.0 : 0.0;
  };
}

Tensor transfer_buffer(const Shape& shape, DType dtype, Device where, Device compute) {
  return where.is_cpu() && compute.is_cuda() ? Tensor::empty_pinned(shape, dtype) : empty(shape, dtype, where);
}

Tensor offloaded_gradient(const Tensor& g, Device host) {
  MemScope scope(MemCategory::comm_buffer);
  Tensor out = transfer_buffer(g.shape(), DType::f32, host, g.device());
  copy_(out, g.dtype() == DType::f32 ? g : to(g, DType::f32));
  return out;
}

namespace {
// Elements [lo, lo + len) of a contiguous tensor, as a 1-D view (a copy only if t is strided,
// which is fine for reading).
Tensor piece(const Tensor& t, int64_t lo, int64_t len) { return narrow(reshape(t, {t.numel()}), 0, lo, len); }
}  // namespace

ZeroOptimizer::ZeroOptimizer(NamedTensors params, std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                             ZeroOptions opt)
    : params_(std::move(params)), group_(std::move(group)), adam_(adam), opt_(opt), alive_(std::make_shared<bool>(true)) {
  SG_CHECK(group_, "zero: no process group");
  SG_CHECK(opt_.stage == 1 || opt_.stage == 2, "zero: stage ", opt_.stage, " is not available (expected 1 or 2)");
  SG_CHECK(opt_.bucket_bytes > 0, "zero: --bucket-mb must be > 0");
  SG_CHECK(!params_.empty(), "zero: no parameters");
  dtype_ = params_[0].second.dtype();
  const Device dev = device_ = params_[0].second.device();
  SG_CHECK(dtype_ == DType::f32 || dtype_ == DType::bf16 || dtype_ == DType::f16, "zero: parameters are ",
           dtype_name(dtype_), " (expected f32, bf16 or f16)");
  for (auto& [n, p] : params_) {
    SG_CHECK(p.dtype() == dtype_ && p.device() == dev, "zero: parameter '", n, "' is ", p.describe(), ", but '",
             params_[0].first, "' is ", params_[0].second.describe(), ": one flat vector needs one dtype and device");
    SG_CHECK(p.is_contiguous(), "zero: parameter '", n, "' is not contiguous");
    offsets_.push_back(psi_);
    psi_ += p.numel();
  }
  for (auto& [n, p] : params_)
    SG_CHECK(p.updated_by().empty(), "zero: parameter '", n, "' is updated by ", p.updated_by(), " already: ",
             "one optimizer per parameter");
  group_->check_same_parameters("zero", params_);
  const int N = group_->size(), r = group_->rank();
  shard_ = (psi_ + N - 1) / N;  // Ψp = N·S: at most N-1 zero padding elements at the end
  psi_p_ = shard_ * N;
  const int64_t elem = int64_t(dtype_size(dtype_));
  const int64_t c = std::clamp<int64_t>(opt_.bucket_bytes / (N * elem), 1, shard_);
  stripes_of_.resize(params_.size());
  for (int64_t begin = 0; begin < shard_; begin += c) {
    Stripe s;
    s.begin = begin;
    s.len = std::min(c, shard_ - begin);
    std::set<size_t> touched;
    for_pieces(N * begin, N * (begin + s.len), [&](size_t p, int64_t, int64_t, int64_t) { touched.insert(p); });
    s.params.assign(touched.begin(), touched.end());
    // This rank's segments, stripe by stripe: its shard is the concatenation of its windows.
    for_pieces(window(r, s), window(r, s) + s.len, [&](size_t p, int64_t lo, int64_t len, int64_t pos) {
      segments_.push_back(Segment{p, lo, len, s.begin + pos - window(r, s)});
    });
    s.pending = int(s.params.size());
    for (size_t p : s.params) stripes_of_[p].push_back(stripes_.size());
    stripes_.push_back(std::move(s));
  }
  unlaunched_.resize(params_.size());
  for (size_t p = 0; p < params_.size(); ++p) unlaunched_[p] = int(stripes_of_[p].size());
  marked_.assign(params_.size(), 0);

  {
    MemScope scope(MemCategory::optim_state);  // ZeRO's K·Ψ/N: m, v (and f32 masters) for the shard only
    const Device odev = opt_.offload_optimizer.value_or(dev);  // offloaded: an f32 master there too
    m_ = zeros({shard_}, DType::f32, odev);
    v_ = zeros({shard_}, DType::f32, odev);
    if (dtype_ != DType::f32 || opt_.offload_optimizer) {
      master_ = transfer_buffer({shard_}, DType::f32, odev, dev);
      zero_(master_);  // the padding
    }
  }
  if (master_.defined()) {
    autograd::NoGradGuard ng;
    for (const Segment& s : segments_) copy_(narrow(master_, 0, s.at, s.len), piece(params_[s.param].second, s.lo, s.len));
  }
  if (opt_.stage == 2) {
    MemScope scope(MemCategory::grad);  // the partitioned gradient: 4Ψp/N bytes in f32
    grad_shard_ = zeros({shard_}, dtype_, dev);
    std::weak_ptr<bool> alive = alive_;
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].second.add_grad_ready_hook([this, i, alive](const Tensor&) {
        if (alive.lock()) on_grad_ready(i);
      });
  }
  for (auto& [n, p] : params_) p.set_updated_by(str("a ZeRO-", opt_.stage, " optimizer"));
}

ZeroOptimizer::~ZeroOptimizer() {
  for (size_t k : in_flight_)
    if (stripes_[k].work) stripes_[k].work->wait();
  *alive_ = false;
  for (auto& [n, p] : params_) p.set_updated_by("");
}

template <class Fn>
void ZeroOptimizer::for_pieces(int64_t begin, int64_t end, Fn fn) const {
  size_t i = size_t(std::upper_bound(offsets_.begin(), offsets_.end(), begin) - offsets_.begin());
  i = i ? i - 1 : 0;
  for (; i < params_.size() && offsets_[i] < end; ++i) {
    const int64_t off = offsets_[i], n = params_[i].second.numel();
    const int64_t lo = std::max(begin, off), hi = std::min(end, off + n);
    if (hi > lo) fn(i, lo - off, hi - lo, lo);
  }
}

void ZeroOptimizer::broadcast_parameters() {
  autograd::NoGradGuard ng;
  for (auto& [n, p] : params_) group_->broadcast(p, 0)->wait();
  if (master_.defined())
    for (const Segment& s : segments_) copy_(narrow(master_, 0, s.at, s.len), piece(params_[s.param].second, s.lo, s.len));
}

void ZeroOptimizer::on_grad_ready(size_t i) {
  if (!sync_) return;
  if (marked_[i]) {
    abandon_step();
    throw Error(str("zero: '", params_[i].first, "' got a second gradient before finish_gradients: a backward ran ",
                    "again with synchronisation on (accumulate with set_sync(false) on every backward but the last), ",
                    "or the last backward's finish_gradients() was never called; this step's gradients are dropped"));
  }
  marked_[i] = 1;
  for (size_t k : stripes_of_[i])
    if (--stripes_[k].pending == 0) launch(k);
}

// Copies the stripe's gradient pieces from every rank's window into a fresh buffer and
// reduce-scatters it: stage 2 straight into the shard gradient (or, when an earlier micro-batch
// has, into the buffer's tail, which complete() adds to it), stage 1 into the buffer's tail.
void ZeroOptimizer::launch(size_t k) {
  autograd::NoGradGuard ng;
  reap();
  Stripe& s = stripes_[k];
  if (s.work) complete_through(k);  // the previous micro-batch's reduction of this stripe
  // At most two buffers in flight (DeepSpeed's double-buffered reduction): a backward that
  // outruns the communication waits here rather than moving its gradients into ever more buffers.
  if (in_flight_.size() >= 2) complete_through(in_flight_.front());
  s.launched = true;
  s.adds = opt_.stage == 2 && s.reduced;
  s.reduced = true;
  const int N = group_->size();
  {
    MemScope scope(MemCategory::comm_buffer);
    s.buffer = empty({N * s.len + (opt_.stage == 1 || s.adds ? s.len : 0)}, dtype_, device_);
  }
  Tensor in = narrow(s.buffer, 0, 0, N * s.len);
  zero_(in);  // padding, and parameters that got no gradient
  for (int q = 0; q < N; ++q) {
    const int64_t w = window(q, s);
    for_pieces(w, w + s.len, [&](size_t p, int64_t lo, int64_t len, int64_t pos) {
      Tensor g = params_[p].second.grad();
      if (g.defined()) copy_(narrow(in, 0, q * s.len + pos - w, len), piece(g, lo, len));
    });
  }
  Tensor out = opt_.stage == 2 && !s.adds ? narrow(grad_shard_, 0, s.begin, s.len) : narrow(s.buffer, 0, N * s.len, s.len);
  s.work = group_->reduce_scatter(out, in, comm::ReduceOp::avg);
  in_flight_.push_back(k);
  if (opt_.stage == 2)  // a full gradient is dead once every stripe touching it has been copied
    for (size_t p : s.params)
      if (--unlaunched_[p] == 0) params_[p].second.set_grad(Tensor());
  trace::memory(device_);
}

// Waits for a stripe; stage 1 writes this rank's averaged window back into its own .grad pieces,
// a later micro-batch's stage 2 reduction adds its window into the shard gradient.
void ZeroOptimizer::complete(Stripe& s) {
  s.work->wait();
  if (s.adds) add_(narrow(grad_shard_, 0, s.begin, s.len), narrow(s.buffer, 0, group_->size() * s.len, s.len));
  if (opt_.stage == 1) {
    const int N = group_->size();
    const int64_t w = window(group_->rank(), s);
    for_pieces(w, w + s.len, [&](size_t p, int64_t lo, int64_t len, int64_t pos) {
      const Tensor& param = params_[p].second;
      if (!param.grad().defined()) {
        MemScope scope(MemCategory::grad);
        param.set_grad(zeros(param.shape(), dtype_, param.device()));
      }
      SG_CHECK(param.grad().is_contiguous(), "zero: the gradient of '", params_[p].first, "' is not contiguous");
      copy_(piece(param.grad(), lo, len), narrow(s.buffer, 0, N * s.len + pos - w, len));
    });
  }
  s.work.reset();
  s.buffer = Tensor();
}

void ZeroOptimizer::complete_through(size_t k) {
  while (!in_flight_.empty()) {
    const size_t front = in_flight_.front();
    complete(stripes_[front]);
    in_flight_.erase(in_flight_.begin());
    if (front == k) return;
  }
}

// Frees the buffers of stripes whose reduce-scatter has completed (in launch order).
void ZeroOptimizer::reap() {
  while (!in_flight_.empty() && stripes_[in_flight_.front()].work->test()) {
    complete(stripes_[in_flight_.front()]);
    in_flight_.erase(in_flight_.begin());
  }
}

void ZeroOptimizer::finish_gradients() {
  SG_CHECK(sync_, "zero: finish_gradients() under set_sync(false) reduces nothing: set_sync(true) before the step's ",
           "last backward (PyTorch's no_sync covers all but the last), or call reduce_now()");
  // Stage 2 with no stripe launched and no gradient anywhere: nothing since the last call (whose
  // reduce-scatters freed the gradients), and reducing again would write zeros over the shard.
  const bool nothing = opt_.stage == 2 && std::none_of(stripes_.begin(), stripes_.end(), [](const Stripe& s) {
                         return s.launched;
                       }) && std::none_of(params_.begin(), params_.end(), [](const auto& p) {
                         return p.second.grad().defined();
                       });
  SG_CHECK(!nothing, "zero: no gradient to reduce: no backward since the last finish_gradients (stage 2 has reduced ",
           "and freed that step's gradients; calling it twice would zero the shard)");
  autograd::NoGradGuard ng;
  // Stage 1 issues every stripe here; stage 2 only the ones whose parameters did not all get a
  // gradient. Stripe order, so every rank issues the same sequence.
  for (size_t k = 0; k < stripes_.size(); ++k)
    if (!stripes_[k].launched) launch(k);
  for (size_t k : in_flight_) complete(stripes_[k]);
  in_flight_.clear();
  reset_stripes();
  for (auto& st : stripes_) st.reduced = false;  // the next step's first reductions write the shard
}

void ZeroOptimizer::reduce_micro_batch() {
  SG_CHECK(opt_.stage == 2, "zero: reduce_micro_batch accumulates in the shard gradient, which only stage 2 keeps ",
           "(stage 1 accumulates the full gradients and reduces them in finish_gradients)");
  SG_CHECK(sync_, "zero: reduce_micro_batch after a backward under set_sync(false): its gradients were not reduced; ",
           "accumulate in the shard with sync on for every backward");
  autograd::NoGradGuard ng;
  for (size_t k = 0; k < stripes_.size(); ++k)  // stripe order, as every rank issues them
    if (!stripes_[k].launched) launch(k);
  reset_stripes();  // the stripes in flight stay in flight
}

void ZeroOptimizer::abandon_step() {
  for (size_t k : in_flight_) {
    try {
      if (stripes_[k].work) stripes_[k].work->wait();  // the peers issued it too: let it finish first
    } catch (const Error&) {
    }
    stripes_[k].work.reset();
    stripes_[k].buffer = Tensor();
  }
  in_flight_.clear();
  reset_stripes();
  for (auto& s : stripes_) s.reduced = s.adds = false;
  for (auto& [n, p] : params_) p.set_grad(Tensor());  // the step's partial gradients go too
}

void ZeroOptimizer::reset_stripes() {
  for (auto& s : stripes_) {
    s.launched = false;
    s.pending = int(s.params.size());
  }
  for (size_t p = 0; p < params_.size(); ++p) unlaunched_[p] = int(stripes_of_[p].size());
  std::fill(marked_.begin(), marked_.end(), 0);
}

void ZeroOptimizer::reduce_now() {
  sync_ = true;
  finish_gradients();  // every stripe is unlaunched: the hooks did nothing under set_sync(false)
}

double ZeroOptimizer::grad_sum_squares(const GradWeight& weight) const {
  autograd::NoGradGuard ng;
  std::vector<Tensor> pieces;
  std::vector<double> weights;
  for (const Segment& s : segments_) {  // the padding has no segment and is zero anyway
    const auto& [name, p] = params_[s.param];
    const double w = weight ? weight(name) : 1.0;
    if (w == 0) continue;
    pieces.push_back(opt_.stage == 2 ? narrow(grad_shard_, 0, s.at, s.len)
                                     : (p.grad().defined() ? piece(p.grad(), s.lo, s.len) : Tensor()));
    weights.push_back(w);
  }
  return sum_squares(pieces, weights);
}

double ZeroOptimizer::grad_norm() {
  autograd::NoGradGuard ng;
  Tensor t = from_vector<double>({grad_sum_squares()}, {1});
  group_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return std::sqrt(item(t));
}

void ZeroOptimizer::step(double lr, double grad_scale) {
  // A backward's reduce-scatters not finished: the step would read unreduced gradients, and its
  // all-gathers reuse stripe buffers a reduce-scatter may still be writing.
  if (!in_flight_.empty() || std::any_of(marked_.begin(), marked_.end(), [](char m) { return m != 0; })) {
    abandon_step();
    throw Error("zero: step() before finish_gradients(): the backward's gradients are not reduced yet (call "
                "finish_gradients() after the last backward of the step); this step's gradients are dropped");
  }
  autograd::NoGradGuard ng;
  ++step_;
  optim::AdamWBatch batch(adam_, lr, grad_scale, step_);
  for (const Segment& s : segments_) {
    const Tensor& p = params_[s.param].second;
    Tensor g = opt_.stage == 2 ? narrow(grad_shard_, 0, s.at, s.len)
                               : (p.grad().defined() ? piece(p.grad(), s.lo, s.len) : Tensor());
    if (!g.defined()) continue;
    if (g.device() != m_.device()) g = offloaded_gradient(g, m_.device());  // to the host for the step
    Tensor target = master_.defined() ? narrow(master_, 0, s.at, s.len) : piece(p, s.lo, s.len);
    // the weight decay is masked per segment, by the parameter it belongs to
    batch.add(target, g, narrow(m_, 0, s.at, s.len), narrow(v_, 0, s.at, s.len), optim::AdamW::decays(p));
  }
  batch.run();
  // All-gather the updated shards, stripe by stripe, one stripe in flight while the previous one
  // is scattered into the parameters.
  const int N = group_->size(), r = group_->rank();
  auto issue = [&](Stripe& s) {
    MemScope scope(MemCategory::comm_buffer);
    s.buffer = empty({N * s.len}, dtype_, device_);
    Tensor own = narrow(s.buffer, 0, r * s.len, s.len);
    const int64_t w = window(r, s);
    if (master_.defined()) {
      copy_(own, narrow(master_, 0, s.begin, s.len));  // rounds the f32 masters to the parameters' dtype
    } else {
      zero_(own);
      for_pieces(w, w + s.len, [&](size_t p, int64_t lo, int64_t len, int64_t pos) {
        copy_(narrow(own, 0, pos - w, len), piece(params_[p].second, lo, len));
      });
    }
    s.work = group_->all_gather(s.buffer, own);
    trace::memory(device_);
  };
  auto scatter = [&](Stripe& s) {
    s.work->wait();
    for (int q = 0; q < N; ++q) {
      const int64_t w = window(q, s);
      for_pieces(w, w + s.len, [&](size_t p, int64_t lo, int64_t len, int64_t pos) {
        copy_(piece(params_[p].second, lo, len), narrow(s.buffer, 0, q * s.len + pos - w, len));
      });
    }
    s.work.reset();
    s.buffer = Tensor();
  };
  for (size_t k = 0; k < stripes_.size(); ++k) {
    issue(stripes_[k]);
    if (k > 0) scatter(stripes_[k - 1]);
  }
  scatter(stripes_.back());
}

void ZeroOptimizer::zero_grad() {
  for (auto& [n, p] : params_) p.set_grad(Tensor());
  if (grad_shard_.defined()) zero_(grad_shard_);
}

namespace {
ckpt::LocalView view_with(const ZeroOptimizer::ViewOf& view, const std::string& name, const Tensor& p) {
  return view ? view(name, p.shape()) : ckpt::whole_view(name, p.shape());
}
Tensor host(const Tensor& t) { return t.device() == Device::cpu() ? t : to(t, Device::cpu()); }
}  // namespace

// The optimizer state tensors of the shard, with the suffix of their global names.
std::vector<std::pair<std::string, Tensor>> ZeroOptimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out{{".exp_avg", m_}, {".exp_avg_sq", v_}};
  if (master_.defined()) out.emplace_back(".master", master_);
  return out;
}

std::vector<ckpt::Piece> ZeroOptimizer::state_pieces(const ViewOf& view) const {
  autograd::NoGradGuard ng;
  std::vector<ckpt::Piece> out;
  for (const Segment& s : segments_) {
    const auto& [name, p] = params_[s.param];
    const ckpt::LocalView v = view_with(view, name, p);
    for (const auto& [suffix, t] : state_tensors())
      for (auto& piece : ckpt::pieces_of(ckpt::renamed(v, name + suffix), s.lo, host(narrow(t, 0, s.at, s.len))))
        out.push_back(std::move(piece));
  }
  return out;
}

void ZeroOptimizer::load_state(const ckpt::PieceSource& src, int64_t optimizer_step, const ViewOf& view) {
  autograd::NoGradGuard ng;
  for (const Segment& s : segments_) {
    const auto& [name, p] = params_[s.param];
    const ckpt::LocalView v = view_with(view, name, p);
    for (const auto& [suffix, t] : state_tensors()) {
      Tensor run = narrow(t, 0, s.at, s.len);
      if (suffix == ".master" && !src.has(name + suffix)) {
        copy_(run, piece(p, s.lo, s.len));
        continue;
      }
      const bool on_host = run.device() == Device::cpu();
      Tensor tmp = on_host ? run : empty({s.len}, t.dtype(), Device::cpu());
      ckpt::read_local(src, ckpt::renamed(v, name + suffix), s.lo, tmp);
      if (!on_host) copy_(run, tmp);
    }
  }
  step_ = optimizer_step;
}

std::map<std::string, Tensor> ZeroOptimizer::full_state_dict(const ViewOf& view) {
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> out;
  const bool lead = group_->rank() == 0;
  auto global = [&](const ckpt::LocalView& v, const Tensor& local) {
    return ckpt::assemble(ckpt::pieces_of(v, 0, host(local))).at(v.name);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const ckpt::LocalView v = view_with(view, name, p);
    if (lead) out[name] = global(v, contiguous(reshape(p, {p.numel()})));
    for (const auto& [suffix, t] : state_tensors()) {
      // This rank's runs of the parameter's local tensor, zeros elsewhere, summed on rank 0.
      Tensor local = zeros({p.numel()}, t.dtype(), t.device());
      for (const Segment& s : segments_)
        if (s.param == i) copy_(narrow(local, 0, s.lo, s.len), narrow(t, 0, s.at, s.len));
      if (group_->size() > 1) group_->reduce(local, 0, comm::ReduceOp::sum)->wait();
      if (lead) out[name + suffix] = global(ckpt::renamed(v, name + suffix), local);
    }
  }
  return out;
}

}  // namespace sg::parallel
