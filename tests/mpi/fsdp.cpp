// ZeRO-3 / FSDP under mpirun, every mode (full_shard, shard_grad_op, no_shard, hybrid): the same
// losses as one process with the same global batch (clipping and gradient accumulation on), the
// ledger's bytes per rank against the mode's formula (parallel/fsdp.h), the bytes per step per
// collective kind counted by the process groups, mixed precision (bf16 compute, f32 masters), and
// the checkpoint state (pieces of global tensors, resume in the same and in another layout).
#include "tests/catch.h"
#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/comm/mesh.h"
#include "parallel/fsdp.h"
#include "parallel/shard_state.h"
#include "tests/mpi/mpi_support.h"
#include "tests/support.h"

using namespace sg;
using parallel::FsdpMode;
using parallel::FsdpOptions;

namespace {

constexpr int64_t kB = 8, kT = 8;
constexpr double kClip = 0.6;  // the tiny model's norms run 0.5-1.0: some steps clip, some do not

void batch(int64_t step, Tensor& idx, Tensor& tgt) { testing::token_batch(step, kB, kT, idx, tgt); }

// What the last step measured: the ledger right after the optimizer step (peaks over the step)
// and the groups' counters over the step.
struct Probe {
  MemStats mem;
  comm::CommCounters comm, shard, replicate;  // world, shard group, replicate group
  int64_t reduce_scatters_in_backward = 0;    // issued before finish_gradients(): the hooks' work
  std::vector<int64_t> unit_numel, unit_padded;  // Ψu, Ψu_p per unit, root first
  int64_t psi = 0, psi_p = 0;
  int ns = 1, nr = 1;
  int clipped_steps = 0;
  int64_t step_growth = 0;  // the optimizer step's peak above what the ledger held when it began
};

// tiny_gpt's units all divide by 2 and 4; this one's do not (Ψ_root = 165, Ψ_block = 365), so
// every unit carries its own padding.
nn::GPTConfig odd_gpt() {
  nn::GPTConfig c = testing::tiny_gpt();
  c.n_head = 1;
  c.n_embd = 5;
  c.padded_vocab = 23;
  return c;
}

nn::GPTConfig four_layers() {
  nn::GPTConfig c = testing::tiny_gpt();
  c.n_layer = 4;
  return c;
}

struct Run {
  nn::GPTConfig cfg = testing::tiny_gpt();
  nn::Recompute rc = nn::Recompute::none;
  DType dtype = DType::f32;
  FsdpOptions fsdp;
  int64_t micro = kB;
  bool no_sync = false;                         // set_sync(false) before every micro-batch but the last
  int first = 0, steps = 20;                    // batches [first, first + steps)
  uint64_t init_seed = 5;
  const ckpt::PieceSource* resume = nullptr;    // load_state(resume, first) before the first step
  std::vector<ckpt::Piece>* pieces = nullptr;   // this rank's state_pieces() after the last step
  std::map<std::string, Tensor>* full = nullptr;  // full_state_dict() after the last step
  std::map<std::string, Tensor>* single_state = nullptr;  // no group: reference_state() after the last step
  std::vector<double>* norms = nullptr;                   // no group: each step's global gradient norm
};

std::map<std::string, Tensor> reference_state(const nn::GPT& model, const optim::AdamW& opt);

// Trains steps [first, first + steps); with a group, this rank takes its rows and FSDP shards.
std::vector<double> train(const Run& run, std::shared_ptr<comm::ProcessGroup> group, Probe* probe = nullptr) {
  auto model = std::make_unique<nn::GPT>(run.cfg, run.dtype);
  model->init_weights(run.init_seed);
  model->recompute = run.rc;
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
  if (group) fsdp = std::make_unique<parallel::FullyShardedDataParallel>(*model, group, oc, run.fsdp);
  else opt = std::make_unique<optim::AdamW>(model->named_parameters(), oc);
  if (run.resume) fsdp->load_state(*run.resume, run.first);
  std::vector<double> losses;
  for (int s = run.first; s < run.first + run.steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    if (group) group->reset_counters();
    if (fsdp && fsdp->shard_group()) fsdp->shard_group()->reset_counters();
    if (fsdp && fsdp->replicate_group()) fsdp->replicate_group()->reset_counters();
    Ledger::global().reset_peaks(Device::cpu());
    double loss = testing::backward_rank_rows(*model, idx, tgt, rank, world, run.micro, [&](int64_t, bool last) {
      if (fsdp && run.no_sync) fsdp->set_sync(last);
    });
    if (fsdp) {
      if (probe && fsdp->shard_group())
        probe->reduce_scatters_in_backward = fsdp->shard_group()->counters()[comm::CommKind::reduce_scatter].calls;
      fsdp->finish_gradients();
      const double norm = fsdp->grad_norm();
      const MemStats before = Ledger::global().stats(Device::cpu());
      Ledger::global().reset_peaks(Device::cpu());  // the step's own peak, then merged with before's
      fsdp->step(1e-2, optim::clip_coefficient(norm, kClip));
      if (probe) {
        probe->mem = Ledger::global().stats(Device::cpu());
        probe->step_growth = probe->mem.total_peak - before.total_current;
        for (size_t c = 0; c < probe->mem.peak.size(); ++c) probe->mem.peak[c] = std::max(probe->mem.peak[c], before.peak[c]);
        probe->mem.total_peak = std::max(probe->mem.total_peak, before.total_peak);
        probe->comm = group->counters();
        probe->shard = fsdp->shard_group() ? fsdp->shard_group()->counters() : comm::CommCounters{};
        probe->replicate = fsdp->replicate_group() ? fsdp->replicate_group()->counters() : comm::CommCounters{};
        probe->psi = fsdp->numel();
        probe->psi_p = fsdp->padded_numel();
        probe->ns = fsdp->shard_size();
        probe->nr = fsdp->replica_count();
        probe->unit_numel.clear();
        probe->unit_padded.clear();
        for (int u = 0; u < fsdp->num_units(); ++u) {
          probe->unit_numel.push_back(fsdp->unit_numel(u));
          probe->unit_padded.push_back(fsdp->unit_padded_numel(u));
        }
        probe->clipped_steps += norm > kClip;
      }
      fsdp->zero_grad();
      loss = testing::sum_over(*group, loss);
    } else {
      const double norm = optim::global_grad_norm(model->parameters());
      if (run.norms) run.norms->push_back(norm);
      opt->step(1e-2, optim::clip_coefficient(norm, kClip));
      model->zero_grad();
    }
    losses.push_back(loss);
  }
  if (fsdp && run.pieces) *run.pieces = fsdp->state_pieces();
  if (fsdp && run.full) *run.full = fsdp->full_state_dict();
  if (opt && run.single_state) *run.single_state = reference_state(*model, *opt);
  return losses;
}

std::vector<double> train(int steps, int64_t micro, std::shared_ptr<comm::ProcessGroup> group, Probe* probe = nullptr,
                          nn::Recompute rc = nn::Recompute::none, const nn::GPTConfig& cfg = testing::tiny_gpt()) {
  Run run;
  run.steps = steps;
  run.micro = micro;
  run.rc = rc;
  run.cfg = cfg;
  return train(run, std::move(group), probe);
}

// The single-process run's state as global tensors (wte without its padding rows), the names
// FSDP's pieces use; copies (not charged to param or optim_state).
std::map<std::string, Tensor> reference_state(const nn::GPT& model, const optim::AdamW& opt) {
  std::map<std::string, Tensor> out;
  auto put = [&](const std::string& name, const Tensor& local) {
    auto whole = ckpt::assemble(ckpt::pieces_of(ckpt::gpt_param_view(name, local.shape(), model.config.vocab_size), local));
    for (auto& [n, t] : whole) out[name] = t;
  };
  for (auto& [n, p] : model.named_parameters()) put(n, p);
  for (auto& [n, t] : opt.state()) {
    const std::string param = n.substr(0, n.rfind('.'));
    auto whole = ckpt::assemble(ckpt::pieces_of(
        ckpt::renamed(ckpt::gpt_param_view(param, t.shape(), model.config.vocab_size), n), t));
    out[n] = whole.at(n);
  }
  return out;
}


using testing::world;

FsdpOptions mode(FsdpMode m, int shard_group_size = 0) {
  FsdpOptions o;
  o.mode = m;
  o.shard_group_size = shard_group_size;
  return o;
}

// Every mode the world size allows, with a name for INFO.
std::vector<std::pair<std::string, FsdpOptions>> all_modes(int n) {
  std::vector<std::pair<std::string, FsdpOptions>> out;
  FsdpOptions pre = mode(FsdpMode::full_shard);
  pre.forward_prefetch = pre.backward_prefetch = true;
  out.emplace_back("full_shard", mode(FsdpMode::full_shard));
  out.emplace_back("full_shard + prefetch", pre);
  out.emplace_back("shard_grad_op", mode(FsdpMode::shard_grad_op));
  out.emplace_back("no_shard", mode(FsdpMode::no_shard));
  for (int ns = 1; ns <= n; ++ns)
    if (n % ns == 0) out.emplace_back("hybrid " + std::to_string(ns), mode(FsdpMode::hybrid, ns));
  FsdpOptions zero2 = mode(FsdpMode::hybrid, n > 2 ? n / 2 : n);
  zero2.reshard_after_forward = false;
  out.emplace_back("hybrid, no reshard", zero2);
  return out;
}

}  // namespace

TEST_CASE("zero3 reproduces the single-process losses for 20 steps, with clipping and accumulation", "[fsdp]") {
  auto w = world();
  const std::vector<double> reference = train(20, kB, nullptr);
  for (int64_t micro : {kB / w->size(), int64_t(1)}) {
    INFO("zero3, micro-batch " << micro << " on " << w->size() << " ranks");
    Probe probe;
    std::vector<double> got = train(20, micro, w, &probe);
    REQUIRE(probe.clipped_steps > 0);  // clipping really engaged (and not on every step)
    REQUIRE(probe.clipped_steps < 20);
    testing::require_same_losses(got, reference);
  }
  // units with padding
  const std::vector<double> odd_ref = train(20, kB, nullptr, nullptr, nn::Recompute::none, odd_gpt());
  testing::require_same_losses(train(20, 1, w, nullptr, nn::Recompute::none, odd_gpt()), odd_ref);
  // recompute re-runs a block's forward inside its backward, after the unit was gathered again
  for (nn::Recompute rc : {nn::Recompute::selective, nn::Recompute::full}) {
    std::vector<double> got = train(5, 1, w, nullptr, rc);
    testing::require_same_losses(got, reference);
  }
}

TEST_CASE("every FSDP mode reproduces the single-process losses for 20 steps (2 micro-batches, clipping)", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  Run ref;
  const std::vector<double> reference = train(ref, nullptr);
  Run ref4;
  ref4.cfg = four_layers();
  const std::vector<double> reference4 = train(ref4, nullptr);
  for (auto& [name, o] : all_modes(n)) {
    INFO(name << " on " << n << " ranks");
    Run run;
    run.fsdp = o;
    run.micro = kB / n / 2;
    Probe probe;
    testing::require_same_losses(train(run, w, &probe), reference);
    REQUIRE(probe.clipped_steps > 0);
    REQUIRE(probe.clipped_steps < 20);
  }
  // wrap policy: blocks grouped into units of at least wrap_min_params parameters
  for (FsdpMode m : {FsdpMode::full_shard, FsdpMode::shard_grad_op}) {
    Run run;
    run.cfg = four_layers();
    run.fsdp = mode(m);
    run.fsdp.wrap_min_params = 2 * nn::GPT(run.cfg).h[0]->num_parameters() - 1;  // two blocks per unit
    run.fsdp.forward_prefetch = run.fsdp.backward_prefetch = true;
    run.micro = kB / n / 2;
    Probe probe;
    testing::require_same_losses(train(run, w, &probe), reference4);
    REQUIRE(probe.unit_numel.size() == 3);  // root, h.0-1, h.2-3
  }
}

TEST_CASE("FSDP ledger on every rank equals the mode's formula; prefetch holds at most limit_all_gathers blocks", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  for (const nn::GPTConfig& cfg : {testing::tiny_gpt(), odd_gpt()})
    for (auto& [name, o] : all_modes(n)) {
      INFO(name << ", rank " << w->rank() << " of " << n << ", n_embd " << cfg.n_embd);
      Run run;
      run.cfg = cfg;
      run.fsdp = o;
      run.steps = 2;
      run.micro = kB / n / 2;
      Probe probe;
      train(run, w, &probe);
      REQUIRE(probe.psi == cfg.num_params());
      const int ns = probe.ns;
      const int expect_ns = o.mode == FsdpMode::no_shard ? 1 : o.mode == FsdpMode::hybrid ? o.shard_group_size : n;
      REQUIRE(ns == expect_ns);
      REQUIRE(probe.nr == n / ns);
      int64_t psi_p = 0;
      for (size_t u = 0; u < probe.unit_padded.size(); ++u) {
        REQUIRE(probe.unit_padded[u] % ns == 0);
        REQUIRE(probe.unit_padded[u] - probe.unit_numel[u] < ns);  // at most Ns-1 padding elements per unit
        psi_p += probe.unit_padded[u];
      }
      REQUIRE(psi_p == probe.psi_p);
      if (ns == 1) REQUIRE(psi_p == probe.psi);
      const int64_t shards = 4 * psi_p / ns;
      REQUIRE(probe.mem.cur(MemCategory::param) == shards);  // no_shard: the full model, 4Ψ
      REQUIRE(probe.mem.cur(MemCategory::grad) == shards);
      REQUIRE(probe.mem.cur(MemCategory::optim_state) == 2 * shards);
      if (ns == 1) continue;
      // at peak: full_shard the root and one block on top of the shards; shard_grad_op (and
      // hybrid without resharding) every unit
      const bool reshard = o.mode == FsdpMode::full_shard || (o.mode == FsdpMode::hybrid && o.reshard_after_forward.value_or(true));
      const int64_t block = *std::max_element(probe.unit_padded.begin() + 1, probe.unit_padded.end());
      const int64_t blocks = o.forward_prefetch ? std::min<int64_t>(o.limit_all_gathers, cfg.n_layer) : 1;
      REQUIRE(probe.mem.pk(MemCategory::param) == shards + 4 * (reshard ? probe.unit_padded[0] + blocks * block : psi_p));
    }
  // forward and backward prefetch: limit_all_gathers Block units gathered at once, with the root
  for (int limit : {1, 2, 3}) {
    INFO("limit_all_gathers " << limit);
    Run run;
    run.cfg = four_layers();
    run.fsdp.forward_prefetch = run.fsdp.backward_prefetch = true;
    run.fsdp.limit_all_gathers = limit;
    run.steps = 2;
    run.micro = kB / n;
    Probe probe;
    train(run, w, &probe);
    const int64_t shards = 4 * probe.psi_p / n;
    REQUIRE(probe.unit_padded.size() == 5);
    REQUIRE(probe.mem.pk(MemCategory::param) == shards + 4 * (probe.unit_padded[0] + limit * probe.unit_padded[1]));
  }
}

TEST_CASE("zero3 moves 2(n-1)/n * 4 Psi_p bytes in all-gathers and (n-1)/n * 4 Psi_p in reduce-scatters per step", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  for (const nn::GPTConfig& cfg : {testing::tiny_gpt(), odd_gpt()}) {
    INFO("n_embd " << cfg.n_embd);
    Probe probe;
    train(1, kB / n, w, &probe, nn::Recompute::none, cfg);
    if (cfg.n_embd == 5) REQUIRE(probe.psi_p > probe.psi);  // the padding is really there, and counted
    const int64_t units = int64_t(probe.unit_padded.size());
    int64_t rs = 0;
    for (int64_t p : probe.unit_padded) rs += comm::reduce_scatter_bytes(4 * p, n);  // the exact per-unit padding
    REQUIRE(rs == int64_t(n - 1) * probe.psi_p * 4 / n);
    REQUIRE(probe.comm[comm::CommKind::reduce_scatter].bytes == rs);
    REQUIRE(probe.comm[comm::CommKind::reduce_scatter].calls == units);
    REQUIRE(probe.reduce_scatters_in_backward == units);  // all from the grad-ready hooks
    REQUIRE(probe.comm[comm::CommKind::all_gather].bytes == 2 * rs);  // forward + backward: 3Ψ in all
    REQUIRE(probe.comm[comm::CommKind::all_gather].calls == 2 * units);
    REQUIRE(probe.comm[comm::CommKind::all_reduce].calls == 1);  // the norm's partial sums of squares
    REQUIRE(probe.comm[comm::CommKind::all_reduce].bytes == comm::all_reduce_bytes(8, n));
    REQUIRE(probe.comm[comm::CommKind::broadcast].calls == 0);
    // with two micro-batches per rank, every micro-batch gathers twice and reduce-scatters once
    Probe acc;
    train(1, kB / n / 2, w, &acc, nn::Recompute::none, cfg);
    REQUIRE(acc.comm[comm::CommKind::reduce_scatter].bytes == 2 * rs);
    REQUIRE(acc.comm[comm::CommKind::all_gather].bytes == 4 * rs);
  }
}

// PyTorch FSDP's no_sync: each unit is released after its backward without a reduction, its full
// gradients accumulating; the last micro-batch reduces them. The same losses, the gathers of every
// micro-batch, one reduction a step, and the full gradient held meanwhile.
TEST_CASE("every FSDP mode under no_sync reproduces the single-process losses, reducing once a step while gathering every micro-batch", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  Run ref;
  ref.steps = 6;
  const std::vector<double> reference = train(ref, nullptr);
  for (auto& [name, o] : all_modes(n)) {
    INFO(name << " on " << n << " ranks");
    Probe synced, unsynced;
    Run run;
    run.steps = 6;
    run.fsdp = o;
    run.micro = kB / n / 2;  // two micro-batches a rank
    testing::require_same_losses(train(run, w, &synced), reference);
    run.no_sync = true;
    testing::require_same_losses(train(run, w, &unsynced), reference);
    const auto bytes = [](const Probe& p, comm::CommKind k) { return p.shard[k].bytes + p.replicate[k].bytes; };
    CHECK(bytes(unsynced, comm::CommKind::all_gather) == bytes(synced, comm::CommKind::all_gather));
    CHECK(2 * bytes(unsynced, comm::CommKind::reduce_scatter) == bytes(synced, comm::CommKind::reduce_scatter));
    // the replicas' all-reduce of the shard gradients (hybrid, no_shard), beside the norm's 8 bytes
    const int64_t norm = comm::all_reduce_bytes(8, unsynced.ns);
    CHECK(2 * (bytes(unsynced, comm::CommKind::all_reduce) - norm) == bytes(synced, comm::CommKind::all_reduce) - norm);
    CHECK(unsynced.mem.pk(MemCategory::grad) > synced.mem.pk(MemCategory::grad));  // full gradients held
  }
}

TEST_CASE("bytes per step per collective kind equal the theory in every FSDP mode", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  for (auto& [name, o] : all_modes(n)) {
    INFO(name << " on " << n << " ranks");
    Run run;
    run.cfg = odd_gpt();  // padding in every unit
    run.fsdp = o;
    run.steps = 1;
    run.micro = kB / n;  // one micro-batch: the per-micro-batch volume
    Probe probe;
    train(run, w, &probe);
    const int ns = probe.ns, nr = probe.nr;
    const int64_t units = int64_t(probe.unit_padded.size());
    int64_t rs = 0, ar = 0;  // Σ over units: reduce-scatter in the shard group, all-reduce in the replicate group
    for (int64_t p : probe.unit_padded) {
      rs += comm::reduce_scatter_bytes(4 * p, ns);
      ar += comm::all_reduce_bytes(4 * p / ns, nr);
    }
    const bool regather = ns > 1 && (o.mode == FsdpMode::full_shard ||
                                     (o.mode == FsdpMode::hybrid && o.reshard_after_forward.value_or(true)));
    const comm::CommCounters& sh = probe.shard;
    const comm::CommCounters& rp = probe.replicate;
    if (ns > 1) {
      REQUIRE(rs == int64_t(ns - 1) * probe.psi_p * 4 / ns);
      REQUIRE(sh[comm::CommKind::reduce_scatter].bytes == rs);
      REQUIRE(sh[comm::CommKind::reduce_scatter].calls == units);
      REQUIRE(probe.reduce_scatters_in_backward == units);
      // full_shard: forward + backward gathers (3Ψ in all); shard_grad_op: forward only (2Ψ)
      REQUIRE(sh[comm::CommKind::all_gather].bytes == (regather ? 2 : 1) * rs);
      REQUIRE(sh[comm::CommKind::all_gather].calls == (regather ? 2 : 1) * units);
      REQUIRE(sh[comm::CommKind::all_reduce].calls == 1);  // the norm
      REQUIRE(sh[comm::CommKind::all_reduce].bytes == comm::all_reduce_bytes(8, ns));
    } else {
      REQUIRE(probe.psi_p == probe.psi);
    }
    if (nr > 1) {  // no_shard: DDP's 2(N-1)/N·4Ψ, one all-reduce per unit; hybrid: of the shards
      REQUIRE(rp[comm::CommKind::all_reduce].calls == units);
      REQUIRE(rp[comm::CommKind::all_reduce].bytes == ar);
      REQUIRE(rp[comm::CommKind::reduce_scatter].calls == 0);
      REQUIRE(rp[comm::CommKind::all_gather].calls == 0);
    }
    if (o.mode == FsdpMode::hybrid) REQUIRE(probe.comm.sent_bytes() == 0);  // all on the subgroups
  }
}

using testing::kBf16Bound;

TEST_CASE("bf16 zero3 with f32 master shards tracks the f32 single-process losses; ledger and bytes match the mixed-precision formulas", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  Run ref;
  const std::vector<double> reference = train(ref, nullptr);
  for (DType reduce : {DType::bf16, DType::f32}) {
    INFO("bf16 parameters, reduce dtype " << dtype_name(reduce) << ", rank " << w->rank() << " of " << n);
    Run run;
    run.dtype = DType::bf16;
    run.fsdp.reduce_dtype = reduce;
    run.micro = kB / n / 2;
    Probe probe;
    std::vector<double> got = train(run, w, &probe);
    testing::require_half_precision_close(got, reference);
    // param 2Ψp/N (bf16 shards), grad e_r·Ψp/N, optim_state 12Ψp/N (f32 m, v, master)
    const int64_t er = int64_t(dtype_size(reduce));
    REQUIRE(probe.mem.cur(MemCategory::param) == 2 * probe.psi_p / n);
    REQUIRE(probe.mem.cur(MemCategory::grad) == er * probe.psi_p / n);
    REQUIRE(probe.mem.cur(MemCategory::optim_state) == 12 * probe.psi_p / n);
    // at peak: the root and one block gathered in bf16
    const int64_t block = *std::max_element(probe.unit_padded.begin() + 1, probe.unit_padded.end());
    REQUIRE(probe.mem.pk(MemCategory::param) == 2 * probe.psi_p / n + 2 * (probe.unit_padded[0] + block));
    // AdamW reads the bf16 gradient shard as it is: the step holds no f32 copy of it (4Ψp/N)
    REQUIRE(probe.step_growth == 0);
    // one micro-batch: gathers of 2-byte parameters, reductions in the reduce dtype
    Run one = run;
    one.steps = 1;
    one.micro = kB / n;
    Probe b;
    train(one, w, &b);
    REQUIRE(b.comm[comm::CommKind::all_gather].bytes == 2 * int64_t(n - 1) * b.psi_p * 2 / n);
    REQUIRE(b.comm[comm::CommKind::reduce_scatter].bytes == int64_t(n - 1) * b.psi_p * er / n);
  }
  // f16 parameters with f32 reduction (no loss scaling needed at this size)
  Run f16;
  f16.dtype = DType::f16;
  f16.fsdp.reduce_dtype = DType::f32;
  f16.micro = kB / n / 2;
  std::vector<double> got = train(f16, w);
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - reference[i]) <= kBf16Bound * reference[i]);
}

// State after 10 steps against the single-process AdamW's: the sharded runs reduce in another
// order, so they agree to f32 rounding, not bitwise.
constexpr double kStateBound = 1e-5;

// The key bias (the middle third of c_attn.bias) has a zero gradient in exact arithmetic (it adds
// q·b_k to every score of a query's row, and softmax ignores constants per row): Adam normalises
// the rounding noise of that zero into full-size updates, which differ between reduction orders
// (up to 7e-4 of the tensor's largest element here) without changing any loss. Left out of the
// parameter comparison; its m and v are compared like everything else.
Tensor without_key_bias(const std::string& name, const Tensor& t) {
  const std::string key = "attn.c_attn.bias";
  if (name.size() < key.size() || name.compare(name.size() - key.size(), key.size(), key) != 0) return t;
  Tensor c = clone(t);
  const int64_t third = c.numel() / 3;
  zero_(narrow(c, 0, third, third));
  return c;
}

TEST_CASE("FSDP state pieces assemble to the single-process state; load_state resumes exactly, and from another layout", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  Run ref;
  const std::vector<double> reference = train(ref, nullptr);
  std::map<std::string, Tensor> state10;
  Run ref10;
  ref10.steps = 10;
  ref10.single_state = &state10;
  train(ref10, nullptr);
  int64_t state_numel = 0;
  for (auto& [name, t] : state10) state_numel += t.numel();
  const ckpt::MemorySource single(state10);
  std::vector<std::pair<std::string, Run>> cases;
  for (auto& [name, o] : all_modes(n)) {
    Run run;
    run.fsdp = o;
    cases.emplace_back(name, run);
  }
  Run half;  // bf16: the f32 masters are saved and restored exactly
  half.dtype = DType::bf16;
  cases.emplace_back("full_shard, bf16", half);
  for (auto& [name, whole] : cases) {
    INFO(name << ", rank " << w->rank() << " of " << n);
    const bool f32 = whole.dtype == DType::f32;
    whole.micro = kB / n / 2;
    const std::vector<double> uninterrupted = train(whole, w);
    Run first = whole;
    first.steps = 10;
    std::vector<ckpt::Piece> pieces;
    std::map<std::string, Tensor> full;
    first.pieces = &pieces;
    first.full = &full;
    train(first, w);
    // every element of every state tensor exactly once over the ranks
    std::vector<ckpt::Piece> all = testing::all_pieces(*w, pieces);
    int64_t covered = 0;
    for (auto& p : all) covered += p.data.numel();
    const std::map<std::string, Tensor> saved = ckpt::assemble(all);
    REQUIRE(covered == state_numel / 3 * (f32 ? 3 : 4));  // bf16: + "<param>.master"
    REQUIRE(saved.size() == state10.size() / 3 * (f32 ? 3 : 4));
    for (auto& [tensor, t] : state10) {
      INFO(tensor);
      REQUIRE(saved.count(tensor));
      if (f32) REQUIRE(testing::max_rel_diff(without_key_bias(tensor, saved.at(tensor)), without_key_bias(tensor, t)) <= kStateBound);
    }
    // full_state_dict: the same tensors on rank 0, nothing elsewhere
    if (w->rank() == 0) {
      REQUIRE(full.size() == saved.size());
      for (auto& [tensor, t] : saved) REQUIRE(to_vector<float>(full.at(tensor)) == to_vector<float>(t));
    } else {
      REQUIRE(full.empty());
    }
    // resume in the same layout (from other initial weights): the uninterrupted run, bitwise
    const ckpt::MemorySource source(saved);
    Run resumed = testing::resumed_from(whole, source, 10, 10);
    testing::require_resumed_losses(train(resumed, w), uninterrupted, 10);
    if (!f32) continue;
    // resume from another layout: the single-process run's state
    resumed.resume = &single;
    testing::require_same_losses(train(resumed, w), std::vector<double>(reference.begin() + 10, reference.end()));
  }
}

namespace {

// FSDP over the dp group of a dp x tp mesh: the units hold this rank's tp slices; the global norm
// is every rank's grad_sum_squares(mesh_grad_weight) summed by one all-reduce over the world.
// sp: sequence parallelism, the replicated parameters' shard gradients summed over tp after the
// reduction over dp.
std::vector<double> train_dp_tp(const FsdpOptions& o, bool sp, int steps, std::vector<double>& norms,
                                std::vector<ckpt::Piece>* pieces = nullptr) {
  auto w = world();
  const int dp = w->size() / 2;
  comm::MeshGroups g = comm::create_mesh_groups(comm::DeviceMesh(dp, 1, 2), *w);
  nn::GPTConfig c = testing::tiny_gpt();
  c.tp = 2;
  c.sequence_parallel = sp;
  nn::GPT model(c, DType::f32, Device::cpu(), g.tp);
  model.init_weights(5);
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  parallel::FullyShardedDataParallel fsdp(model, g.dp, oc, o);
  const parallel::GradWeight weight = parallel::mesh_grad_weight(g.tp->rank(), true);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    const double loss = testing::backward_rank_rows(model, idx, tgt, g.coord.dp, dp, kB / dp / 2);
    fsdp.finish_gradients();
    if (sp) fsdp.sum_replicated_gradients(*g.tp);
    const double norm = std::sqrt(testing::sum_over(*w, fsdp.grad_sum_squares(weight)));
    fsdp.step(1e-2, optim::clip_coefficient(norm, kClip));
    fsdp.zero_grad();
    losses.push_back(testing::sum_over(*g.dp, loss));
    norms.push_back(norm);
  }
  if (pieces) *pieces = fsdp.state_pieces();
  return losses;
}

}  // namespace

TEST_CASE("full_shard and shard_grad_op across dp with tp 2 (with and without sequence parallelism) reproduce the single-process losses and norms; state pieces assemble to its state", "[fsdp][mesh]") {
  auto w = world();
  if (w->size() % 2) return;  // the mesh needs tp = 2
  std::vector<double> reference_norms;
  std::map<std::string, Tensor> state10;
  Run single;
  single.steps = 10;
  single.norms = &reference_norms;
  single.single_state = &state10;
  const std::vector<double> reference = train(single, nullptr);
  for (auto [m, sp] : {std::pair{FsdpMode::full_shard, false}, {FsdpMode::shard_grad_op, false},
                       {FsdpMode::full_shard, true}, {FsdpMode::shard_grad_op, true}}) {
    INFO(parallel::fsdp_mode_name(m) << " over dp " << w->size() / 2 << " x tp 2" << (sp ? " + sp" : "") << ", rank "
                                     << w->rank());
    std::vector<double> norms;
    std::vector<ckpt::Piece> pieces;
    testing::require_same_losses(train_dp_tp(mode(m), sp, 10, norms, &pieces), reference);
    for (size_t i = 0; i < norms.size(); ++i) {
      INFO("step " << i << ": norm " << norms[i] << ", single-process " << reference_norms[i]);
      REQUIRE(std::abs(norms[i] - reference_norms[i]) <= 1e-5 * reference_norms[i]);
    }
    // over the dp x tp ranks every element of every global tensor exactly once
    std::vector<ckpt::Piece> all = testing::all_pieces(*w, pieces);
    int64_t covered = 0, expected = 0;
    for (auto& p : all) covered += p.data.numel();
    const std::map<std::string, Tensor> saved = ckpt::assemble(all);
    for (auto& [tensor, t] : state10) expected += t.numel();
    REQUIRE(covered == expected);
    REQUIRE(saved.size() == state10.size());
    for (auto& [tensor, t] : state10) {
      INFO(tensor);
      REQUIRE(testing::max_rel_diff(without_key_bias(tensor, saved.at(tensor)), without_key_bias(tensor, t)) <= kStateBound);
    }
  }
}

// A module wrapped twice: refused before the second wrapper moves anything, and the first one's
// hooks stay (a failed second wrapper used to clear them on its way out).
TEST_CASE("fsdp refuses a module another FullyShardedDataParallel wraps, leaving that one working", "[fsdp]") {
  auto w = world();
  nn::GPT model(testing::tiny_gpt());
  model.init_weights(1);
  optim::AdamWConfig oc;
  parallel::FullyShardedDataParallel first(model, w, oc, parallel::FsdpOptions{});
  REQUIRE_THROWS_WITH(parallel::FullyShardedDataParallel(model, w, oc, parallel::FsdpOptions{}),
                      Catch::Contains("is wrapped by another FullyShardedDataParallel already"));
  Tensor idx, tgt;
  batch(0, idx, tgt);
  autograd::NoGradGuard ng;
  CHECK(std::isfinite(item(model.loss(idx, tgt))));  // the first wrapper still gathers its units
}
