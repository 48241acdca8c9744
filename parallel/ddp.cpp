#include "parallel/ddp.h"

#include <algorithm>

#include "autograd/ops.h"
#include "autograd/tape.h"

namespace sg::parallel {

DistributedDataParallel::DistributedDataParallel(NamedTensors params, std::shared_ptr<comm::ProcessGroup> group,
                                                 DdpOptions opt)
    : params_(std::move(params)), group_(std::move(group)), opt_(opt), alive_(std::make_shared<bool>(true)) {
  SG_CHECK(group_, "ddp: no process group");
  SG_CHECK(opt_.bucket_bytes > 0, "ddp: --bucket-mb must be > 0");
  group_->check_same_parameters("ddp", params_);
  bucket_of_.assign(params_.size(), 0);
  marked_.assign(params_.size(), 0);
  had_grad_.assign(params_.size(), 0);
  handed_.assign(params_.size(), {});
  // Reverse registration order: the head and last blocks finish backward first.
  Bucket cur;
  int64_t bytes = 0;
  auto close = [&] {
    if (cur.params.empty()) return;
    for (size_t i : cur.params) {
      cur.offsets.push_back(cur.numel);
      cur.numel += params_[i].second.numel();
    }
    for (size_t i : cur.params) bucket_of_[i] = buckets_.size();
    buckets_.push_back(std::move(cur));
    cur = Bucket{};
    bytes = 0;
  };
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k].second;
    const bool dtype_change = !cur.params.empty() && params_[cur.params[0]].second.dtype() != p.dtype();
    if (dtype_change) close();
    cur.params.push_back(k);
    bytes += int64_t(p.nbytes());
    if (bytes >= opt_.bucket_bytes) close();
  }
  close();
  std::weak_ptr<bool> alive = alive_;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].second.add_grad_ready_hook([this, i, alive](const Tensor&) {
      if (alive.lock()) on_grad_ready(i);
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& b : buckets_)
    if (b.work) b.work->wait();
  *alive_ = false;
}

void DistributedDataParallel::broadcast_parameters() {
  for (auto& [n, p] : params_) group_->broadcast(p, 0)->wait();
}

std::vector<std::string> DistributedDataParallel::bucket_names(int b) const {
  std::vector<std::string> out;
  for (size_t i : buckets_[size_t(b)].params) out.push_back(params_[i].first);
  return out;
}

void DistributedDataParallel::on_grad_ready(size_t i) {
  if (!sync_) return;
  if (marked_[i]) {
    abandon_step();
    throw Error(str("ddp: '", params_[i].first, "' got a second gradient before finish_gradients: a backward ran ",
                    "again with synchronisation on (accumulate with set_sync(false) on every backward but the last, ",
                    "PyTorch's no_sync), or the last backward's finish_gradients() was never called; this step's ",
                    "gradients are dropped"));
  }
  marked_[i] = 1;
  Bucket& b = buckets_[bucket_of_[i]];
  if (++b.ready == int(b.params.size())) launch(b);
}

// The bucket's gradients move into a fresh flat buffer, and each parameter's own .grad is freed
// there and then: a gradient is held once, in its tensor or in its bucket, never in both.
void DistributedDataParallel::launch(Bucket& b) {
  autograd::NoGradGuard ng;
  const Tensor& first = params_[b.params[0]].second;
  {
    MemScope scope(MemCategory::comm_buffer);
    b.buffer = empty({b.numel}, first.dtype(), first.device());
  }
  for (size_t k = 0; k < b.params.size(); ++k) {
    const Tensor& p = params_[b.params[k]].second;
    Tensor slot = narrow(b.buffer, 0, b.offsets[k], p.numel());
    Tensor g = p.grad();
    had_grad_[b.params[k]] = g.defined();
    if (g.defined()) copy_(slot, reshape(g, {p.numel()}));
    else zero_(slot);
    p.set_grad(Tensor());
  }
  b.work = group_->all_reduce(b.buffer, comm::ReduceOp::avg);
}

void DistributedDataParallel::abandon_step() {
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();  // the peers launched it too: let it finish before its buffer goes
      } catch (const Error&) {
      }
      b.work.reset();
    }
    b.ready = 0;
    b.buffer = Tensor();
  }
  std::fill(marked_.begin(), marked_.end(), 0);
  for (auto& [n, p] : params_) p.set_grad(Tensor());  // the step's partial gradients go too
}

void DistributedDataParallel::reduce_now() {
  sync_ = true;
  for (size_t i = 0; i < params_.size(); ++i) marked_[i] = params_[i].second.grad().defined();
  finish_gradients();
}

void DistributedDataParallel::finish_gradients() {
  // Under set_sync(false) nothing was launched and nothing would be: the step would take each
  // rank's own gradients, and the replicas drift apart without a word.
  SG_CHECK(sync_, "ddp: finish_gradients() under set_sync(false) reduces nothing: set_sync(true) before the step's ",
           "last backward (PyTorch's no_sync covers all but the last), or call reduce_now()");
  // Called again with nothing new: every gradient is still a view of the buckets handed out last.
  // (weak handles: a buffer freed since, its address reused, is not mistaken for it)
  bool again = std::none_of(marked_.begin(), marked_.end(), [](char m) { return m; }) &&
               std::any_of(handed_.begin(), handed_.end(), [](const auto& h) { return !h.expired(); });
  for (size_t i = 0; again && i < params_.size(); ++i) {
    const Tensor& g = params_[i].second.grad();
    again = g.defined() ? g.storage() == handed_[i].lock() : handed_[i].expired();
  }
  SG_CHECK(!again, "ddp: finish_gradients was already called for this step (run a backward first)");
  // Buckets whose parameters did not all get a gradient never launched.
  std::string unused;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!marked_[i]) unused += (unused.empty() ? "" : ", ") + params_[i].first;
  if (!unused.empty() && !opt_.find_unused_parameters) {
    abandon_step();
    throw Error(str("ddp: these parameters received no gradient in this step: ", unused,
                    " (pass --find-unused-parameters if that is intended); this step's gradients are dropped"));
  }
  for (auto& b : buckets_)  // every rank launches the leftovers in bucket order: same order everywhere
    if (!b.work) launch(b);
  autograd::NoGradGuard ng;
  // A parameter some rank used has a gradient (the average) on every rank; one no rank used has
  // none, as PyTorch decides from its all-reduced usage map.
  if (opt_.find_unused_parameters) {
    std::vector<int32_t> flags(had_grad_.begin(), had_grad_.end());
    Tensor used = from_vector<int32_t>(flags, {int64_t(flags.size())});
    group_->all_reduce(used, comm::ReduceOp::max)->wait();
    const std::vector<int32_t> any = to_vector<int32_t>(used);
    for (size_t i = 0; i < any.size(); ++i) had_grad_[i] = char(any[i] != 0);
  }
  for (auto& b : buckets_) {
    b.work->wait();
    b.work.reset();
    b.ready = 0;
    // The averaged bucket becomes the gradients: each .grad a view of its slot (PyTorch's
    // gradient_as_bucket_view), the buffer's bytes now the gradient's in the ledger. It is freed
    // with the last of those views (zero_grad); the next step's launch takes a new one.
    b.buffer.storage()->recategorize(MemCategory::grad);
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Tensor& p = params_[b.params[k]].second;
      p.set_grad(had_grad_[b.params[k]] ? reshape(narrow(b.buffer, 0, b.offsets[k], p.numel()), p.shape()) : Tensor());
      handed_[b.params[k]] = p.grad().defined() ? p.grad().storage() : nullptr;
    }
    b.buffer = Tensor();
  }
  std::fill(marked_.begin(), marked_.end(), 0);
}

}  // namespace sg::parallel
