#include "parallel/fsdp.h"

#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/trace.h"
#include "kernels/ops.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/tp/layers.h"

namespace sg::parallel {

namespace {
// A 1-D handle on a whole storage: it reads storage->data() at each use, so it follows the
// storage through release() and reallocate().
Tensor over(const std::shared_ptr<Storage>& s, int64_t n, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = s;
  impl->layout.shape = {n};
  impl->layout.strides = {1};
  impl->dtype = dtype;
  return Tensor(impl);
}
Tensor flat_view(const Tensor& t) { return reshape(t, {t.numel()}); }
bool half(DType t) { return t == DType::bf16 || t == DType::f16; }
Tensor host(const Tensor& t) { return t.device() == Device::cpu() ? t : to(t, Device::cpu()); }
}  // namespace

const char* fsdp_mode_name(FsdpMode m) {
  switch (m) {
    case FsdpMode::full_shard: return "full_shard";
    case FsdpMode::shard_grad_op: return "shard_grad_op";
    case FsdpMode::no_shard: return "no_shard";
    case FsdpMode::hybrid: return "hybrid";
  }
  return "?";
}

FullyShardedDataParallel::FullyShardedDataParallel(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> group,
                                                   optim::AdamWConfig adam, FsdpOptions opt)
    : FullyShardedDataParallel(model, &model, std::move(group), adam, opt) {
  gpt_units();
  shard_units();
}

FullyShardedDataParallel::FullyShardedDataParallel(nn::Module& model, const std::vector<nn::Module*>& units,
                                                   std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                                                   FsdpOptions opt)
    : FullyShardedDataParallel(model, nullptr, std::move(group), adam, opt) {
  SG_CHECK(!opt_.holds, "fsdp: a pipeline's stages are a GPT's (FsdpOptions::holds needs the GPT constructor)");
  SG_CHECK(opt_.wrap_min_params == 0, "fsdp: wrap_min_params groups a GPT's blocks; here the units are the modules "
           "given");
  module_units(units);
  shard_units();
}

FullyShardedDataParallel::FullyShardedDataParallel(nn::Module& module, nn::GPT* gpt,
                                                   std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                                                   FsdpOptions opt)
    : module_(module), gpt_(gpt), world_(std::move(group)), adam_(adam), opt_(opt),
      alive_(std::make_shared<bool>(true)) {
  const char* mode = fsdp_mode_name(opt_.mode);
  SG_CHECK(world_, "fsdp: no process group");
  SG_CHECK(!opt_.offload_params || opt_.offload_optimizer, "fsdp: offloading the parameters needs the optimizer "
           "offloaded too (the step updates the host shards)");
  SG_CHECK(!opt_.offload_params || opt_.mode != FsdpMode::no_shard, "fsdp: no_shard keeps whole replicas on the "
           "device; there are no parameter shards to offload");
  const int N = world_->size();
  SG_CHECK(opt_.mode == FsdpMode::hybrid || opt_.shard_group_size == 0, "fsdp: --shard-group-size applies to hybrid "
           "sharding only, not ", mode);
  SG_CHECK(opt_.limit_all_gathers >= 1, "fsdp: --limit-all-gathers must be >= 1, got ", opt_.limit_all_gathers);
  SG_CHECK(opt_.wrap_min_params >= 0, "fsdp: --wrap-min-params must be >= 0");
  switch (opt_.mode) {
    case FsdpMode::full_shard:
      SG_CHECK(opt_.reshard_after_forward.value_or(true), "fsdp: --reshard-after-forward false with full sharding "
               "(zero3, fsdp) is shard_grad_op: give --strategy fsdp-grad-op");
      shard_ = world_;
      reshard_ = true;
      break;
    case FsdpMode::shard_grad_op:
      SG_CHECK(!opt_.reshard_after_forward.value_or(false), "fsdp: shard_grad_op keeps units gathered until backward; "
               "resharding after forward is full_shard (--strategy fsdp)");
      shard_ = world_;
      reshard_ = false;
      break;
    case FsdpMode::no_shard:
      SG_CHECK(!opt_.reshard_after_forward.value_or(false), "fsdp: no_shard never reshards (full replicas)");
      replicate_ = world_;
      reshard_ = false;
      break;
    case FsdpMode::hybrid: {
      const int ns = opt_.shard_group_size;
      SG_CHECK(ns >= 1 && N % ns == 0, "fsdp: hybrid sharding needs --shard-group-size to divide the ", N,
               " ranks, got ", ns);
      const int r = world_->rank();
      shard_ = world_->split(r / ns, r);      // consecutive ranks share the shards
      replicate_ = world_->split(r % ns, r);  // the same shard in every group
      reshard_ = opt_.reshard_after_forward.value_or(true);
      break;
    }
  }
  if (shard_ && shard_->size() == 1) shard_.reset();  // sharding over one rank: the full unit, persistent
  if (replicate_ && replicate_->size() == 1) replicate_.reset();
  if (!shard_) reshard_ = false;
}

// Units: the root (wte, wpe, ln_f) first, then runs of consecutive blocks. Under a pipeline, only
// what this rank holds: "wte" and "root" (wpe, ln_f) when it holds them, then runs of its
// consecutive blocks.
void FullyShardedDataParallel::gpt_units() {
  nn::GPT& model = *gpt_;
  const bool piped = bool(opt_.holds);
  const auto held = [&](const std::string& name) { return !piped || opt_.holds(name); };
  // Parameters keep the model's names ("wte.weight", "h.0.attn.c_attn.weight"): the global
  // tensors of the checkpoint state.
  auto add = [&](Unit& u, const std::string& prefix, const nn::Module& m) {
    for (auto& [n, p] : m.named_parameters())
      if (held(prefix + "." + n)) u.params.emplace_back(prefix + "." + n, p);
  };
  const nn::Module& wte = model.wte ? static_cast<const nn::Module&>(*model.wte) : *model.tp_wte;
  // Under a pipeline the roots, and with shard_grad_op (or hybrid without resharding) every unit,
  // stay gathered from their first forward to finish_gradients(), reduced once a step.
  const bool keep_gathered = piped && shard_ && !reshard_;
  auto add_root = [&](Unit u) {
    u.root = true;
    u.deferred = piped;
    if (!piped) u.first = u.last = &model;
    if (!u.params.empty()) units_.push_back(std::move(u));
  };
  Unit root;
  root.name = "root";
  if (piped) {  // the tied embedding alone: the same unit (and shard) on the first and the last stage
    Unit tied;
    tied.name = "wte";
    add(tied, "wte", wte);
    add_root(std::move(tied));
  } else {
    add(root, "wte", wte);
  }
  add(root, "wpe", *model.wpe);
  add(root, "ln_f", *model.ln_f);
  add_root(std::move(root));
  // A run never spans another rank's blocks (a pipeline stage held elsewhere).
  const auto block_held = [&](size_t i) {
    return i < model.h.size() && held("h." + std::to_string(i) + "." + model.h[i]->named_parameters().front().first);
  };
  size_t begin = 0;
  int64_t run = 0;
  for (size_t i = 0; i < model.h.size(); ++i) {
    if (!block_held(i)) {
      begin = i + 1;
      continue;
    }
    run += model.h[i]->num_parameters();
    if (opt_.wrap_min_params > 0 && run < opt_.wrap_min_params && block_held(i + 1)) continue;
    Unit u;
    u.name = "h." + std::to_string(begin) + (i > begin ? "-" + std::to_string(i) : "");
    u.first = model.h[begin].get();
    u.last = model.h[i].get();
    u.first_block = int(begin), u.last_block = int(i);
    u.deferred = keep_gathered;
    for (size_t j = begin; j <= i; ++j) add(u, "h." + std::to_string(j), *model.h[j]);
    units_.push_back(std::move(u));
    begin = i + 1;
    run = 0;
  }
  size_t covered = 0, mine = 0;
  for (auto& u : units_) covered += u.params.size();
  for (auto& [n, p] : model.named_parameters()) mine += held(n);
  SG_CHECK(!units_.empty() && covered == mine, "fsdp: the units cover ", covered, " of the ", mine,
           " parameters this rank holds");
}

// Units of any module: the root (every parameter outside the given modules, gathered around the
// model's whole forward) first, then one unit per given module, in the order given (the order
// their forwards run in, which prefetch follows).
void FullyShardedDataParallel::module_units(const std::vector<nn::Module*>& modules) {
  std::vector<std::pair<std::string, nn::Module*>> named;  // the given modules, by their names in the model
  for (nn::Module* m : modules) {
    SG_CHECK(m && m != &module_, "fsdp: a unit must be a module below the model");
    std::string name;  // its first name, depth first (a module registered twice has two)
    for (auto& [n, sub] : module_.named_modules())
      if (sub == m && name.empty()) name = n;
    SG_CHECK(!name.empty(), "fsdp: a unit module (", m->type_name(), ") is not part of the model");
    for (auto& [other, sub] : named)
      SG_CHECK(name.rfind(other + ".", 0) != 0 && other.rfind(name + ".", 0) != 0 && name != other, "fsdp: units '",
               other, "' and '", name, "' overlap (one holds the other's parameters)");
    named.emplace_back(name, m);
  }
  const auto inside = [&](const std::string& param, const std::string& unit) { return param.rfind(unit + ".", 0) == 0; };
  Unit root;
  root.name = "root";
  root.root = true;
  root.first = root.last = &module_;
  for (auto& np : module_.named_parameters())  // not a structured binding: clang 14 (the fuzz build) cannot capture one
    if (std::none_of(named.begin(), named.end(), [&](const auto& u) { return inside(np.first, u.first); }))
      root.params.push_back(np);
  if (!root.params.empty()) units_.push_back(std::move(root));
  for (auto& [name, m] : named) {
    Unit u;
    u.name = name;
    u.first = u.last = m;
    u.first_block = u.last_block = int(units_.size());
    for (auto& [n, p] : m->named_parameters()) u.params.emplace_back(name + "." + n, p);
    SG_CHECK(!u.params.empty(), "fsdp: unit '", name, "' has no parameters");
    units_.push_back(std::move(u));
  }
  SG_CHECK(!units_.empty(), "fsdp: the model has no parameters");
  // A tensor moves into one unit's flat storage. One registered twice (tied weights) is kept under
  // its first name inside a unit (as PyTorch's named_parameters() does); two units cannot share it.
  std::map<const TensorImpl*, std::pair<std::string, size_t>> seen;  // tensor -> its name, its unit
  for (size_t k = 0; k < units_.size(); ++k) {
    auto& params = units_[k].params;
    for (size_t i = 0; i < params.size();) {
      const auto [it, fresh] = seen.emplace(params[i].second.impl(), std::make_pair(params[i].first, k));
      if (fresh) {
        ++i;
        continue;
      }
      SG_CHECK(it->second.second == k, "fsdp: parameter '", params[i].first, "' is also '", it->second.first,
               "' (shared) in another unit: give the modules that share it one unit");
      params.erase(params.begin() + std::ptrdiff_t(i));
    }
  }
}

// Moves every unit's parameters into one flat storage, keeps this rank's shard (and its gradient
// and optimizer state) and installs the hooks.
void FullyShardedDataParallel::shard_units() {
  const int N = world_->size(), Ns = shard_size(), r = shard_ ? shard_->rank() : 0;
  dtype_ = units_[0].params[0].second.dtype();
  SG_CHECK(dtype_ == DType::f32 || half(dtype_), "fsdp: parameters are ", dtype_name(dtype_),
           " (expected f32, bf16 or f16)");
  reduce_dtype_ = opt_.reduce_dtype.value_or(dtype_);
  SG_CHECK(reduce_dtype_ == DType::f32 || half(reduce_dtype_), "fsdp: --reduce-dtype ", dtype_name(reduce_dtype_),
           " is not available (expected f32, bf16 or f16)");
  const size_t elem = dtype_size(dtype_);

  autograd::NoGradGuard ng;
  for (const Unit& u : units_)  // before anything moves: a second wrapper would take the first one's storage
    SG_CHECK(!u.first || (!u.first->pre_forward && !u.last->post_forward), "fsdp: the unit holding '",
             u.params[0].first, "' is wrapped by another FullyShardedDataParallel already (its forward hooks are "
             "set): wrap a module once");
  std::vector<std::pair<std::string, Tensor>> all;
  for (const Unit& u : units_)
    for (const auto& [n, p] : u.params) {
      SG_CHECK(p.updated_by().empty(), "fsdp: parameter '", n, "' is updated by ", p.updated_by(), " already: ",
               "one optimizer per parameter");
      all.emplace_back(n, p);
    }
  world_->check_same_parameters("fsdp", all);
  for (auto& [n, p] : all) p.set_updated_by(str("an FSDP wrapper (", fsdp_mode_name(opt_.mode), ")"));
  tagged_ = true;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = units_[k];
    const Device built = u.params[0].second.device();
    // Built on a meta device: the unit's memory is made here, its values set by opt_.init.
    const bool materialise = opt_.materialize_on && built != *opt_.materialize_on;
    SG_CHECK(!materialise || (built.is_meta() && opt_.init), "fsdp: parameter '", u.params[0].first, "' is on ",
             built.str(), ", not on ", opt_.materialize_on->str(), ": only a model built on a meta device is given ",
             "memory there, and only with an init function");
    const Device dev = materialise ? *opt_.materialize_on : built;
    for (auto& [n, p] : u.params) {
      SG_CHECK(p.dtype() == dtype_ && p.device() == built, "fsdp: parameter '", n, "' is ", p.describe(),
               ": one flat vector per unit needs one dtype and device (", dtype_name(dtype_), ")");
      SG_CHECK(p.is_contiguous() && p.offset() == 0, "fsdp: parameter '", n, "' is not a whole contiguous tensor");
      u.offsets.push_back(u.numel);
      u.numel += p.numel();
    }
    u.shard = (u.numel + Ns - 1) / Ns;
    const int64_t padded = u.shard * Ns;
    u.flat = std::make_shared<Storage>(size_t(padded) * elem, dev, MemCategory::param);
    u.full = over(u.flat, padded, dtype_);
    zero_(u.full);  // the padding
    // Move every parameter into the flat storage: same handle, new storage and offset.
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor& p = u.params[i].second;
      if (!materialise) copy_(narrow(u.full, 0, u.offsets[i], p.numel()), flat_view(p));
      p.impl()->storage = u.flat;
      p.impl()->layout.offset = u.offsets[i];
    }
    if (materialise) opt_.init(u.params);
    if (opt_.broadcast_from_rank0 && N > 1) world_->broadcast(u.full, 0)->wait();
    if (shard_) {
      {
        MemScope scope(MemCategory::param);
        u.shard_param = transfer_buffer({u.shard}, dtype_, opt_.offload_params ? *opt_.offload_optimizer : dev, dev);
      }
      copy_(u.shard_param, narrow(u.full, 0, r * u.shard, u.shard));
      u.flat->release();
    } else {
      u.shard_param = u.full;  // no_shard: the unit itself is the persistent copy
      u.gathered = true;
    }
    // This rank's segments: the parameter pieces inside [r·S, (r+1)·S).
    const int64_t lo_s = r * u.shard, hi_s = lo_s + u.shard;
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t lo = std::max(lo_s, u.offsets[i]), hi = std::min(hi_s, u.offsets[i] + u.params[i].second.numel());
      if (hi > lo) u.segments.push_back(Segment{i, lo - u.offsets[i], hi - lo, lo - lo_s});
    }
    {
      MemScope scope(MemCategory::grad);  // the partitioned gradient: e_r·Ψu_p/Ns bytes
      u.grad_shard = zeros({u.shard}, reduce_dtype_, dev);
    }
    {
      MemScope scope(MemCategory::optim_state);  // m, v (and f32 masters) for the shard only
      const Device odev = opt_.offload_optimizer.value_or(dev);  // offloaded: an f32 master there too
      u.m = zeros({u.shard}, DType::f32, odev);
      u.v = zeros({u.shard}, DType::f32, odev);
      if (half(dtype_) || opt_.offload_optimizer) u.master = transfer_buffer({u.shard}, DType::f32, odev, dev);
    }
    if (u.master.defined()) copy_(u.master, u.shard_param);
    u.marked.assign(u.params.size(), 0);

    std::weak_ptr<bool> alive = alive_;
    for (size_t i = 0; i < u.params.size(); ++i)
      u.params[i].second.add_grad_ready_hook([this, k, i, alive](const Tensor&) {
        if (alive.lock()) on_grad_ready(k, i);
      });
    if (!u.first) continue;  // the pipeline's roots: gather_roots()
    u.hooked = true;
    u.first->pre_forward = [this, k, alive] {
      if (!alive.lock()) return;
      // The previous backward's last reductions (the root's, issued as it ended) give their
      // buffers back once done, not held through this forward to the next backward's first reduce.
      reap(false);
      wait_gather(units_[k]);
      if (opt_.forward_prefetch) prefetch(k, false);
    };
    u.last->post_forward = [this, k, alive](const Tensor& y) {
      if (!alive.lock()) return y;
      if (!autograd::needs_grad({y})) {  // evaluation: no backward will come for this unit
        release(units_[k]);
        return y;
      }
      if (!reshard_) return y;
      release(units_[k]);
      return wrap(k, y);
    };
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& r : reductions_) {
    if (r.scatter) r.scatter->wait();
    if (r.replicate) r.replicate->wait();
  }
  for (auto& u : units_)
    if (u.gathering) u.gathering->wait();
  *alive_ = false;
  for (auto& u : units_) {  // only the hooks this wrapper set (not another's, should this one have failed)
    if (tagged_)
      for (auto& [n, p] : u.params) p.set_updated_by("");
    if (!u.hooked) continue;
    u.first->pre_forward = nullptr;
    u.last->post_forward = nullptr;
  }
}

int64_t FullyShardedDataParallel::numel() const {
  int64_t n = 0;
  for (auto& u : units_) n += u.numel;
  return n;
}

int64_t FullyShardedDataParallel::padded_numel() const {
  int64_t n = 0;
  for (auto& u : units_) n += u.shard * shard_size();
  return n;
}

void FullyShardedDataParallel::issue_gather(Unit& u) {
  if (u.gathered) return;
  u.flat->reallocate(size_t(u.full.numel()) * dtype_size(dtype_));
  if (u.shard_param.device() != u.full.device()) {  // offloaded parameters: stage the shard first
    MemScope scope(MemCategory::comm_buffer);
    u.staged = to(u.shard_param, u.full.device());
  }
  u.gathering = shard_->all_gather(u.full, u.staged.defined() ? u.staged : u.shard_param);
  u.gathered = true;
  trace::memory(u.full.device());
}

void FullyShardedDataParallel::wait_gather(Unit& u) {
  trace::Scope ts("gather", "fsdp", {{"unit", u.name}});
  issue_gather(u);
  if (u.gathering) {
    u.gathering->wait();
    u.gathering.reset();
    u.staged = Tensor();
  }
}

void FullyShardedDataParallel::release(Unit& u) {
  if (!shard_ || !u.gathered) return;  // no_shard units are the persistent copy
  trace::Scope ts("release", "fsdp", {{"unit", u.name}});
  if (u.gathering) {  // a prefetch the unit never used: its bytes are being written
    u.gathering->wait();
    u.gathering.reset();
    u.staged = Tensor();
  }
  u.flat->release();
  u.gathered = false;
  trace::memory(u.full.device());
}

int FullyShardedDataParallel::gathered_blocks() const {
  int n = 0;
  for (auto& u : units_) n += !u.root && u.gathered;
  return n;
}

// Issues the all-gathers of the units that run after unit k (forward: k+1, k+2, ...; backward:
// from the root to the last block unit, then downwards), while fewer than limit_all_gathers block
// units are gathered. Under a pipeline an action runs one chunk of consecutive blocks, and the
// next unit runs in the same action only if its blocks continue the previous one's (the rank's
// other chunks start further on, in later actions): prefetch stops at the chunk's end.
void FullyShardedDataParallel::prefetch(size_t k, bool backward) {
  if (!shard_) return;
  const size_t n = units_.size();
  const auto next_in_chunk = [&](size_t a, size_t b) {  // unit b's blocks right after unit a's
    return !units_[a].root && !units_[b].root && units_[b].first_block == units_[a].last_block + 1;
  };
  for (size_t step = 1; step < n; ++step) {
    size_t j;
    if (!backward) {
      j = k + step;
      if (j >= n) return;
      if (opt_.holds && !next_in_chunk(j - 1, j)) return;
    } else {
      // backward order: the root (when there is one, unit 0), then n-1, n-2, ... down to the first non-root unit
      const size_t lowest = units_[0].root ? 1 : 0, from = k == 0 && units_[0].root ? n : k;
      if (from < lowest + step) return;
      j = from - step;
      if (opt_.holds && !next_in_chunk(j, j + 1)) return;
    }
    if (units_[j].gathered) continue;
    if (gathered_blocks() >= opt_.limit_all_gathers) return;
    issue_ahead(units_[j]);
  }
}

void FullyShardedDataParallel::issue_ahead(Unit& u) {
  issue_gather(u);
  ++gathers_ahead_;
}

void FullyShardedDataParallel::prefetch_action(int first_block, int last_block, bool forward) {
  if (!shard_ || !(forward ? opt_.forward_prefetch : opt_.backward_prefetch)) return;
  for (auto& u : units_)
    if (!u.root && (forward ? u.first_block == first_block : u.last_block == last_block)) {
      if (!u.gathered && gathered_blocks() < opt_.limit_all_gathers) issue_ahead(u);
      return;
    }
}

Tensor FullyShardedDataParallel::wrap(size_t k, const Tensor& y) {
  Tensor out = y.with_layout(y.layout());
  std::weak_ptr<bool> alive = alive_;
  autograd::record("fsdp_gather(" + units_[k].name + ")", {y}, {out}, [this, k, alive](const autograd::TensorList& g) {
    if (alive.lock()) {
      wait_gather(units_[k]);
      if (opt_.backward_prefetch) prefetch(k, true);
    }
    return autograd::TensorList{g[0]};
  });
  return out;
}

void FullyShardedDataParallel::on_grad_ready(size_t k, size_t i) {
  Unit& u = units_[k];
  if (u.marked[i]) return;
  u.marked[i] = 1;
  if (++u.ready == int(u.params.size()) && !u.deferred) {
    if (sync_) reduce(k);
    else hold(u);
  }
}

void FullyShardedDataParallel::hold(Unit& u) {
  release(u);
  u.ready = 0;
  std::fill(u.marked.begin(), u.marked.end(), 0);
}

void FullyShardedDataParallel::set_sync(bool sync) {
  SG_CHECK(sync || !opt_.holds, "fsdp: set_sync(false) under a pipeline: its micro-batches interleave and its roots ",
           "already accumulate; the units reduce per action");
  sync_ = sync;
}

// Packs unit k's full gradients into one comm_buffer in the reduce dtype (zeros for padding and
// for parameters without a gradient), frees them, releases the gathered parameters and issues the
// reduction: reduce-scatter (avg) over the shard group, then — in advance() — all-reduce (avg) of
// the shard over the replicas. Completed reductions are added to the shard gradient, so
// micro-batches accumulate there.
void FullyShardedDataParallel::reduce(size_t k) {
  autograd::NoGradGuard ng;
  trace::Scope ts("reduce", "fsdp", {{"unit", units_[k].name}});
  reap(false);
  Unit& u = units_[k];
  const Device dev = u.grad_shard.device();
  Reduction r;
  r.unit = k;
  {
    MemScope scope(MemCategory::comm_buffer);
    r.in = zeros({u.shard * shard_size()}, reduce_dtype_, dev);
    r.out = shard_ ? empty({u.shard}, reduce_dtype_, dev) : r.in;
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    const Tensor& p = u.params[i].second;
    if (p.grad().defined()) copy_(narrow(r.in, 0, u.offsets[i], p.numel()), flat_view(p.grad()));
    p.set_grad(Tensor());
  }
  release(u);
  u.ready = 0;
  std::fill(u.marked.begin(), u.marked.end(), 0);
  if (shard_) r.scatter = shard_->reduce_scatter(r.out, r.in, comm::ReduceOp::avg);
  else if (replicate_) r.replicate = replicate_->all_reduce(r.out, comm::ReduceOp::avg);
  reductions_.push_back(std::move(r));
}

// Moves a reduction along (without blocking unless asked): once its reduce-scatter is done, the
// replicas' all-reduce of the shard is issued; once that is done, the shard gradient takes it.
// Only the oldest reduction advances, so every rank issues the replicas' all-reduces in the
// same (unit) order.
bool FullyShardedDataParallel::advance(Reduction& r, bool block) {
  if (r.scatter) {
    if (!block && !r.scatter->test()) return false;
    r.scatter->wait();
    r.scatter.reset();
    r.in = Tensor();
    if (replicate_) r.replicate = replicate_->all_reduce(r.out, comm::ReduceOp::avg);
  }
  if (r.replicate) {
    if (!block && !r.replicate->test()) return false;
    r.replicate->wait();
    r.replicate.reset();
  }
  add_(units_[r.unit].grad_shard, r.out);
  r.in = r.out = Tensor();
  return true;
}

void FullyShardedDataParallel::reap(bool all) {
  autograd::NoGradGuard ng;
  size_t done = 0;
  while (done < reductions_.size() && advance(reductions_[done], all)) ++done;
  reductions_.erase(reductions_.begin(), reductions_.begin() + std::ptrdiff_t(done));
}

void FullyShardedDataParallel::finish_gradients() {
  const auto holds_gradients = [](const Unit& u) {
    return std::any_of(u.params.begin(), u.params.end(), [](const auto& p) { return p.second.grad().defined(); });
  };
  for (size_t k = 0; k < units_.size(); ++k)  // unit order: every rank issues the same sequence
    if (units_[k].ready > 0 || (shard_ && units_[k].gathered) || holds_gradients(units_[k])) reduce(k);
  reap(true);
}

void FullyShardedDataParallel::sum_replicated_gradients(comm::ProcessGroup& tp_group) {
  autograd::NoGradGuard ng;
  reap(true);
  std::vector<Tensor> pieces;
  for (auto& u : units_)
    for (const Segment& s : u.segments)
      if (tp::gpt_param_split(u.params[s.param].first).replicated()) pieces.push_back(narrow(u.grad_shard, 0, s.at, s.len));
  if (pieces.empty()) return;  // the same on every tp rank: same units, same segments
  Tensor packed = cat(pieces, 0);
  tp_group.all_reduce(packed, comm::ReduceOp::sum, comm::Sync::blocking);
  int64_t at = 0;
  for (const Tensor& piece : pieces) {
    copy_(piece, narrow(packed, 0, at, piece.numel()));
    at += piece.numel();
  }
}

void FullyShardedDataParallel::gather_roots() {
  for (auto& u : units_)
    if (u.root && u.deferred) wait_gather(u);
}

Tensor FullyShardedDataParallel::tied_grad_shard() {
  reap(true);
  for (auto& u : units_)
    if (u.deferred && u.name == "wte") return u.grad_shard;
  return Tensor();
}

double FullyShardedDataParallel::grad_norm() {
  autograd::NoGradGuard ng;
  reap(true);
  std::vector<Tensor> shards;
  for (auto& u : units_) shards.push_back(u.grad_shard);  // padding is zero
  double ss = sum_squares(shards);
  if (shard_) {  // replicas hold the same shards: summing over one shard group covers every element once
    Tensor t = from_vector<double>({ss}, {1});
    shard_->all_reduce(t, comm::ReduceOp::sum)->wait();
    ss = item(t);
  }
  return std::sqrt(ss);
}

double FullyShardedDataParallel::grad_sum_squares(const GradWeight& weight) {
  autograd::NoGradGuard ng;
  reap(true);
  if (replicate_ && replicate_->rank() != 0) return 0;  // the first replica speaks for all
  std::vector<Tensor> pieces;
  std::vector<double> weights;
  for (auto& u : units_)
    for (const Segment& s : u.segments) {
      pieces.push_back(narrow(u.grad_shard, 0, s.at, s.len));
      weights.push_back(weight ? weight(u.params[s.param].first) : 1.0);
    }
  return sum_squares(pieces, weights);
}

void FullyShardedDataParallel::step(double lr, double grad_scale) {
  autograd::NoGradGuard ng;
  reap(true);
  ++step_;
  optim::AdamWBatch batch(adam_, lr, grad_scale, step_);
  for (auto& u : units_)
    for (const Segment& s : u.segments) {
      Tensor g = narrow(u.grad_shard, 0, s.at, s.len);
      // A bf16/f16 shard is read as it is (AdamW widens each element): an f32 copy of every
      // segment would be held to batch.run(), 4Ψ/N more at the step's peak.
      if (g.device() != u.m.device()) g = offloaded_gradient(g, u.m.device());  // to the host for the step
      Tensor target = u.master.defined() ? narrow(u.master, 0, s.at, s.len) : narrow(u.shard_param, 0, s.at, s.len);
      batch.add(target, g, narrow(u.m, 0, s.at, s.len), narrow(u.v, 0, s.at, s.len),
                optim::AdamW::decays(u.params[s.param].second));
    }
  batch.run();
  for (auto& u : units_)  // round the f32 masters to the compute dtype
    if (u.master.defined())
      for (const Segment& s : u.segments)
        copy_(narrow(u.shard_param, 0, s.at, s.len), narrow(u.master, 0, s.at, s.len));
}

void FullyShardedDataParallel::zero_grad() {
  autograd::NoGradGuard ng;
  reap(true);
  for (auto& u : units_) {
    for (auto& [n, p] : u.params) p.set_grad(Tensor());
    zero_(u.grad_shard);
    u.ready = 0;
    std::fill(u.marked.begin(), u.marked.end(), 0);
  }
}

void FullyShardedDataParallel::gather_all() {
  for (auto& u : units_) wait_gather(u);
}

void FullyShardedDataParallel::release_all() {
  for (auto& u : units_) release(u);
}

ckpt::LocalView FullyShardedDataParallel::param_view(const std::string& name, const Shape& shape) const {
  return gpt_ ? ckpt::gpt_param_view(name, shape, gpt_->config.vocab_size, tp_rank(), tp_size())
              : ckpt::whole_view(name, shape);
}

// Calls fn(view, segment, shard tensor) for every state tensor of every segment of this rank:
// the parameter, exp_avg, exp_avg_sq and (bf16/f16) master. once: tp-replicated parameters only
// on tp rank 0, so that over all ranks every element appears once.
template <class Fn>
void FullyShardedDataParallel::for_state(Fn fn, bool once) const {
  for (const Unit& u : units_)
    for (const Segment& s : u.segments) {
      const auto& [name, p] = u.params[s.param];
      if (once && tp_rank() != 0 && tp::gpt_param_split(name).replicated()) continue;
      const ckpt::LocalView v = param_view(name, p.shape());
      fn(v, s, u.shard_param);
      fn(ckpt::renamed(v, name + ".exp_avg"), s, u.m);
      fn(ckpt::renamed(v, name + ".exp_avg_sq"), s, u.v);
      if (u.master.defined()) fn(ckpt::renamed(v, name + ".master"), s, u.master);
    }
}

std::vector<ckpt::Piece> FullyShardedDataParallel::state_pieces() const {
  std::vector<ckpt::Piece> out;
  if (replicate_ && replicate_->rank() != 0) return out;  // the first replica speaks for all
  autograd::NoGradGuard ng;
  for_state([&](const ckpt::LocalView& v, const Segment& s, const Tensor& t) {
    for (auto& piece : ckpt::pieces_of(v, s.lo, host(narrow(t, 0, s.at, s.len)))) out.push_back(std::move(piece));
  }, true);
  return out;
}

void FullyShardedDataParallel::load_state(const ckpt::PieceSource& src, int64_t optimizer_step) {
  autograd::NoGradGuard ng;
  release_all();  // a gathered copy would be stale
  const std::string master = ".master";
  for_state([&](const ckpt::LocalView& v, const Segment& s, const Tensor& t) {
    const bool is_master = v.name.size() > master.size() && v.name.compare(v.name.size() - master.size(), master.size(), master) == 0;
    ckpt::LocalView from =  // no master in the source: the parameter, widened
        is_master && !src.has(v.name) ? ckpt::renamed(v, v.name.substr(0, v.name.size() - master.size())) : v;
    // An f32 parameter from a half run's checkpoint: its f32 master, not the parameter rounded
    if (!ckpt::is_optimizer_state(v.name) && t.dtype() == DType::f32 && src.has(v.name + master))
      from = ckpt::renamed(v, v.name + master);
    Tensor run = narrow(t, 0, s.at, s.len);
    Tensor tmp = run.device() == Device::cpu() ? run : empty({s.len}, t.dtype(), Device::cpu());
    ckpt::read_local(src, from, s.lo, tmp);
    if (run.device() != Device::cpu()) copy_(run, tmp);
  });
  step_ = optimizer_step;
}

std::map<std::string, Tensor> FullyShardedDataParallel::full_state_dict(bool with_optimizer_state) {
  SG_CHECK(tp_size() == 1, "fsdp: full_state_dict gathers over the dp group only; under --tp ", tp_size(),
           " use state_pieces() (each rank's slices)");
  autograd::NoGradGuard ng;
  reap(true);
  const bool speaks = !replicate_ || replicate_->rank() == 0;
  std::map<std::string, Tensor> out;
  for (const Unit& u : units_)
    for (size_t i = 0; i < u.params.size(); ++i) {
      const auto& [name, p] = u.params[i];
      std::vector<std::pair<std::string, Tensor>> kinds;  // (built by emplace: GCC 12 misreads the braced list)
      kinds.emplace_back("", u.shard_param);
      if (with_optimizer_state) {
        kinds.emplace_back(".exp_avg", u.m);
        kinds.emplace_back(".exp_avg_sq", u.v);
        if (u.master.defined()) kinds.emplace_back(".master", u.master);
      }
      for (const auto& [suffix, shard] : kinds) {
        // This rank's elements of the parameter's local tensor, zeros elsewhere, summed on rank 0.
        Tensor local = zeros({p.numel()}, shard.dtype(), shard.device());
        if (speaks)
          for (const Segment& s : u.segments)
            if (s.param == i) copy_(narrow(local, 0, s.lo, s.len), narrow(shard, 0, s.at, s.len));
        if (world_->size() > 1) world_->reduce(local, 0, comm::ReduceOp::sum)->wait();
        if (world_->rank() != 0) continue;
        const ckpt::LocalView v = ckpt::renamed(param_view(name, p.shape()), name + suffix);
        auto whole = ckpt::assemble(ckpt::pieces_of(v, 0, host(local)));
        out[name + suffix] = whole.at(name + suffix);
      }
    }
  return out;
}

}  // namespace sg::parallel
