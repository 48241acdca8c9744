// ZeRO stages 1 and 2 under mpirun: the same losses as one process with the same global batch
// (gradient accumulation and clipping on), the ledger's bytes per rank against the ZeRO paper's
// formulas, and the reduce-scatter + all-gather volume per step.
#include "tests/catch.h"
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/comm/mesh.h"
#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/pp/executor.h"
#include "parallel/tp/layers.h"
#include "parallel/shard_state.h"
#include "parallel/zero.h"
#include "tests/mpi/mpi_support.h"
#include "tests/support.h"

using namespace sg;
using Catch::Contains;

namespace {

nn::GPTConfig tiny() { return testing::tiny_gpt(); }

constexpr int64_t kB = 8, kT = 8;
constexpr double kClip = 0.6;  // the tiny model's norms run 0.5-1.0: some steps clip, some do not

void batch(int64_t step, Tensor& idx, Tensor& tgt) { testing::token_batch(step, kB, kT, idx, tgt); }

// What the last step of a ZeRO run measured: the ledger right after the optimizer step (before
// zero_grad) and the group's counters over that step's gradient reduction and step.
struct Probe {
  MemStats mem;
  comm::CommCounters comm;
  int64_t reduce_scatters_in_backward = 0;  // issued before finish_gradients(): the hooks' work
  int stripes = 0;
  int64_t psi = 0, psi_p = 0;
  int clipped_steps = 0;
  int64_t grad_peak = 0;  // the ledger's gradient bytes at their highest, from the backward to the step
};

struct Run {
  int stage = 1;
  int64_t n_layer = 0;  // 0: tiny()'s
  DType dtype = DType::f32;
  int64_t micro = kB;
  bool sharded = false;  // stage 2: every micro-batch reduces into the shard (reduce_micro_batch)
  int first = 0, steps = 20;                    // batches [first, first + steps)
  uint64_t init_seed = 5;
  const ckpt::PieceSource* resume = nullptr;    // parameters and load_state(resume, first) first
  std::vector<ckpt::Piece>* pieces = nullptr;   // this rank's state_pieces() after the last step
  std::map<std::string, Tensor>* full = nullptr;  // full_state_dict() after the last step
  std::map<std::string, Tensor>* state = nullptr;  // parameters and optimizer state as global tensors
};

ckpt::LocalView view_of(const std::string& name, const Shape& local_shape) {
  return ckpt::gpt_param_view(name, local_shape, tiny().vocab_size);
}

// Parameter `param`'s local tensor (or its optimizer state, named `as`) -> the global tensor
// (wte without its padding rows): a copy.
Tensor global_of(const std::string& param, const Tensor& local, const std::string& as = "") {
  const std::string name = as.empty() ? param : as;
  return ckpt::assemble(ckpt::pieces_of(ckpt::renamed(view_of(param, local.shape()), name), local)).at(name);
}

// Trains; with a group, this rank takes its rows and ZeRO at `stage` shards the rest.
std::vector<double> train(const Run& run, std::shared_ptr<comm::ProcessGroup> group, Probe* probe = nullptr) {
  nn::GPTConfig config = tiny();
  if (run.n_layer) config.n_layer = run.n_layer;
  nn::GPT model(config, run.dtype);
  model.init_weights(run.init_seed);
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<parallel::ZeroOptimizer> zero;
  if (group) {
    parallel::ZeroOptions zo;
    zo.stage = run.stage;
    zo.bucket_bytes = 4096;  // several stripes even for this model
    zero = std::make_unique<parallel::ZeroOptimizer>(model.named_parameters(), group, oc, zo);
    zero->broadcast_parameters();
  } else {
    opt = std::make_unique<optim::AdamW>(model.named_parameters(), oc);
  }
  if (run.resume) {  // the caller's part: the replicated parameters; then the sharded state
    autograd::NoGradGuard ng;
    for (auto& [n, p] : model.named_parameters()) ckpt::read_local(*run.resume, view_of(n, p.shape()), p);
    zero->load_state(*run.resume, run.first, view_of);
  }
  std::vector<double> losses;
  for (int s = run.first; s < run.first + run.steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    if (group) group->reset_counters();
    Ledger::global().reset_peaks(Device::cpu());
    double loss = testing::backward_rank_rows(model, idx, tgt, rank, world, run.micro, [&](int64_t m, bool last) {
      if (!zero) return;
      if (run.sharded && m > 0) zero->reduce_micro_batch();  // the previous micro-batch's backward
      zero->set_sync(last || run.sharded);
    });
    double norm = 0;
    if (zero) {
      if (probe) probe->reduce_scatters_in_backward = group->counters()[comm::CommKind::reduce_scatter].calls;
      zero->finish_gradients();
      if (probe) probe->grad_peak = Ledger::global().stats(Device::cpu()).pk(MemCategory::grad);
      norm = zero->grad_norm();
      zero->step(1e-2, optim::clip_coefficient(norm, kClip));
      if (probe) {
        probe->mem = Ledger::global().stats(Device::cpu());
        probe->comm = group->counters();
        probe->psi = zero->numel();
        probe->psi_p = zero->padded_numel();
        probe->stripes = zero->num_stripes();
        probe->clipped_steps += norm > kClip;
      }
      zero->zero_grad();
      loss = testing::sum_over(*group, loss);
    } else {
      norm = optim::global_grad_norm(model.parameters());
      opt->step(1e-2, optim::clip_coefficient(norm, kClip));
      model.zero_grad();
    }
    losses.push_back(loss);
  }
  if (zero && run.pieces) *run.pieces = zero->state_pieces(view_of);
  if (zero && run.full) *run.full = zero->full_state_dict(view_of);
  if (run.state) {
    run.state->clear();
    for (auto& [n, p] : model.named_parameters()) (*run.state)[n] = global_of(n, p);
    if (opt)
      for (auto& [n, t] : opt->state()) (*run.state)[n] = global_of(n.substr(0, n.rfind('.')), t, n);
  }
  return losses;
}

std::vector<double> train(int steps, int64_t micro, int stage, std::shared_ptr<comm::ProcessGroup> group,
                          Probe* probe = nullptr, bool sharded = false) {
  Run run;
  run.steps = steps;
  run.micro = micro;
  run.stage = stage;
  run.sharded = sharded;
  return train(run, std::move(group), probe);
}

using testing::world;

// ---- dp x tp and dp x pp meshes: ZeRO over the dp group ----

struct Trajectory {
  std::vector<double> losses, norms;
};

struct MeshRun {
  int tp = 1, pp = 1;
  bool sp = false;  // sequence parallelism (tp > 1)
  int stage = 0;    // 0: the single-process run, no mesh
};

// ZeRO at `stage` over the dp group of a (world / (tp·pp)) x pp x tp mesh, 2 micro-batches; the
// global norm is every rank's grad_sum_squares(mesh_grad_weight) summed by one all-reduce over the
// world. The pipeline and sequence parallelism reduce only once their gradients are summed (tied
// wte across stages, replicated parameters across tp). psi/optim_bytes: this rank's parameter count
// and ledger optim_state after the last step.
Trajectory train_mesh(const MeshRun& run, int steps, int64_t* psi = nullptr, int64_t* optim_bytes = nullptr) {
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  Trajectory out;
  if (run.stage == 0) {
    nn::GPT model(tiny());
    model.init_weights(5);
    optim::AdamW opt(model.named_parameters(), oc);
    for (int s = 0; s < steps; ++s) {
      Tensor idx, tgt;
      batch(s, idx, tgt);
      out.losses.push_back(testing::backward_rank_rows(model, idx, tgt, 0, 1, kB));
      out.norms.push_back(optim::global_grad_norm(model.parameters()));
      opt.step(1e-2, optim::clip_coefficient(out.norms.back(), kClip));
      model.zero_grad();
    }
    return out;
  }
  auto w = world();
  const int dp = w->size() / (run.tp * run.pp);
  comm::MeshGroups g = comm::create_mesh_groups(comm::DeviceMesh(dp, run.pp, run.tp), *w);
  nn::GPTConfig c = tiny();
  c.tp = run.tp;
  c.sequence_parallel = run.sp;
  nn::GPT model(c, DType::f32, Device::cpu(), run.tp > 1 ? g.tp : nullptr);
  model.init_weights(5);
  std::unique_ptr<parallel::pp::PipelineExecutor> pipe;
  if (run.pp > 1) pipe = std::make_unique<parallel::pp::PipelineExecutor>(model, parallel::pp::make_schedule("1f1b", run.pp, 2), g.pp);
  const parallel::ZeroOptimizer::NamedTensors params = pipe ? pipe->parameters() : model.named_parameters();
  parallel::ZeroOptions zo;
  zo.stage = run.stage;
  zo.bucket_bytes = 4096;  // several stripes
  parallel::ZeroOptimizer zero(params, g.dp, oc, zo);
  zero.broadcast_parameters();
  const bool deferred = pipe || run.sp;
  const parallel::GradWeight weight = parallel::mesh_grad_weight(g.tp->rank(), !pipe || pipe->holds_stage(0));
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    double loss;
    if (pipe) {
      const int64_t local = kB / dp;
      const double counted = double(count_targets(tgt, -1));
      zero.set_sync(false);  // the micro-batches' backwards interleave
      loss = pipe->run(narrow(idx, 0, g.coord.dp * local, local), narrow(tgt, 0, g.coord.dp * local, local),
                       dp / counted) / dp;
      pipe->reduce_tied_embedding();
    } else {
      loss = testing::backward_rank_rows(model, idx, tgt, g.coord.dp, dp, kB / dp / 2,
                                         [&](int64_t, bool last) { zero.set_sync(last && !deferred); });
    }
    if (run.sp) parallel::tp::sync_sequence_parallel_grads(model, *g.tp);
    if (deferred) zero.reduce_now();
    else zero.finish_gradients();
    const double norm = std::sqrt(testing::sum_over(*w, zero.grad_sum_squares(weight)));
    zero.step(1e-2, optim::clip_coefficient(norm, kClip));
    if (optim_bytes) *optim_bytes = Ledger::global().stats(Device::cpu()).cur(MemCategory::optim_state);
    zero.zero_grad();
    out.losses.push_back(testing::sum_over(*g.dp, loss));
    out.norms.push_back(norm);
  }
  if (psi) {
    *psi = 0;
    for (auto& [n, p] : params) *psi += p.numel();
  }
  return out;
}

}  // namespace

TEST_CASE("zero1 and zero2 reproduce the single-process losses for 20 steps, with accumulation (zero2: unsharded and sharded) and clipping", "[zero]") {
  auto w = world();
  const std::vector<double> reference = train(20, kB, 0, nullptr);
  // (stage, accumulating in the shard): zero1, zero2 unsharded (no_sync), zero2 sharded
  for (auto [stage, sharded] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}})
    for (int64_t micro : {kB / w->size(), int64_t(1)}) {
      INFO("zero" << stage << (sharded ? " sharded" : "") << ", micro-batch " << micro << " on " << w->size() << " ranks");
      Probe probe;
      std::vector<double> got = train(20, micro, stage, w, &probe, sharded);
      REQUIRE(probe.clipped_steps > 0);  // clipping really engaged (and not on every step)
      REQUIRE(probe.clipped_steps < 20);
      for (size_t i = 0; i < reference.size(); ++i) {
        INFO("step " << i);
        REQUIRE(std::abs(got[i] - reference[i]) <= 1e-5 * std::abs(reference[i]));
      }
    }
}

TEST_CASE("ledger bytes on every rank equal ZeRO's formulas (f32, AdamW K = 8, no master copy)", "[zero]") {
  auto w = world();
  const int n = w->size();
  for (int stage : {1, 2}) {
    INFO("zero" << stage << ", rank " << w->rank() << " of " << n);
    Probe probe;
    train(2, 1, stage, w, &probe);
    const int64_t psi = probe.psi, psi_p = probe.psi_p;
    REQUIRE(psi == tiny().num_params());
    REQUIRE(psi_p % n == 0);
    REQUIRE(psi_p - psi < n);  // the only padding: up to N-1 elements so the shards are equal
    REQUIRE(probe.mem.cur(MemCategory::param) == 4 * psi);
    REQUIRE(probe.mem.cur(MemCategory::grad) == (stage == 1 ? 4 * psi : 4 * psi_p / n));
    REQUIRE(probe.mem.cur(MemCategory::optim_state) == 8 * psi_p / n);
  }
}

// Stage 2's point: the full gradient is never whole. Each stripe is a run of consecutive
// parameters, reduce-scattered as soon as the backward has finished them, and a parameter's full
// gradient is freed once its stripes are copied, so the peak stays under stage 1's full 4Ψ even
// with the 4Ψp/N shard beside it. (When each rank owned one contiguous range, every stripe waited
// for the first parameters, which the backward finishes last: the peak was near 4Ψ + 4Ψp/N.)
TEST_CASE("zero2's gradient peak, shard included, stays below one full gradient", "[zero]") {
  auto w = world();
  const int n = w->size();
  for (int stage : {1, 2}) {
    INFO("zero" << stage << ", rank " << w->rank() << " of " << n);
    Probe probe;
    Run run;
    run.steps = 2;
    run.micro = kB / n;  // one micro-batch per rank: accumulation would hold every gradient
    run.stage = stage;
    run.n_layer = 8;     // the first block, wte and wpe, held to the backward's end, are then a fraction
    train(run, w, &probe);
    if (stage == 1) REQUIRE(probe.grad_peak == 4 * probe.psi);
    else REQUIRE(probe.grad_peak > 4 * probe.psi_p / n);
    if (stage == 2) REQUIRE(probe.grad_peak < 4 * probe.psi);
  }
}

// DeepSpeed's ZeRO-2 under gradient accumulation: each micro-batch reduce-scatters its stripes as
// the backward finishes them and frees the full gradients, so the peak stays under one full
// gradient; accumulating unsharded (no_sync) holds every full gradient beside the shard until the
// last backward, for one reduce-scatter of each stripe a step instead of one a micro-batch.
TEST_CASE("zero2 accumulating M micro-batches in the shard keeps its gradient peak under one full gradient for M times the reduce-scatter bytes; unsharded holds 4 Psi + 4 Psi_p/N", "[zero]") {
  auto w = world();
  const int n = w->size();
  for (bool sharded : {false, true}) {
    INFO((sharded ? "sharded" : "unsharded") << ", rank " << w->rank() << " of " << n);
    Probe probe;
    Run run;
    run.steps = 2;
    run.micro = 1;  // M = kB / n micro-batches a rank: 4 on 2 ranks, 2 on 4
    run.stage = 2;
    run.sharded = sharded;
    run.n_layer = 8;
    const int64_t M = kB / n;
    REQUIRE(M >= 2);
    train(run, w, &probe);
    const int64_t once = int64_t(n - 1) * probe.psi_p * 4 / n;
    REQUIRE(probe.stripes > 1);
    REQUIRE(probe.mem.cur(MemCategory::grad) == 4 * probe.psi_p / n);  // the step's shard, either way
    if (sharded) {
      REQUIRE(probe.grad_peak < 4 * probe.psi);
      REQUIRE(probe.comm[comm::CommKind::reduce_scatter].bytes == M * once);
      REQUIRE(probe.reduce_scatters_in_backward == M * probe.stripes);  // all from the hooks
    } else {
      REQUIRE(probe.grad_peak == 4 * probe.psi + 4 * probe.psi_p / n);
      REQUIRE(probe.comm[comm::CommKind::reduce_scatter].bytes == once);
    }
    REQUIRE(probe.comm[comm::CommKind::all_gather].bytes == once);
  }
}

TEST_CASE("zero1/zero2 move (n-1)/n * 4 Psi_p bytes in reduce-scatters and the same in all-gathers per step", "[zero]") {
  auto w = world();
  const int n = w->size();
  for (int stage : {1, 2}) {
    INFO("zero" << stage);
    Probe probe;
    train(1, 1, stage, w, &probe);  // accumulation over micro-batches: still one reduction per stripe
    const int64_t expect = int64_t(n - 1) * probe.psi_p * 4 / n;
    REQUIRE(probe.comm[comm::CommKind::reduce_scatter].bytes == expect);
    REQUIRE(probe.comm[comm::CommKind::all_gather].bytes == expect);
    REQUIRE(probe.comm[comm::CommKind::all_reduce].calls == 1);  // the norm's partial sums of squares
    REQUIRE(probe.comm[comm::CommKind::all_reduce].bytes == comm::all_reduce_bytes(8, n));
    REQUIRE(probe.stripes > 1);
    // zero2 reduce-scatters every stripe from the grad-ready hooks during the last micro-batch's
    // backward; zero1 only after backward
    REQUIRE(probe.reduce_scatters_in_backward == (stage == 2 ? probe.stripes : 0));
  }
}

TEST_CASE("zero pads Psi to a multiple of N and steps like AdamW on the averaged gradient, decaying >= 2-D only", "[zero]") {
  auto w = world();
  const int n = w->size(), r = w->rank();
  // Ψ = 21: one padding element on 2 ranks, three on 4; 1-2 element stripes cut across both
  // parameters and every shard boundary.
  auto make = [] {
    return parallel::ZeroOptimizer::NamedTensors{{"w", randn({3, 5}, 7, 0)}, {"b", randn({6}, 7, 1)}};
  };
  for (int stage : {1, 2}) {
    INFO("zero" << stage << ", rank " << r << " of " << n);
    auto ref = make(), mine = make();
    optim::AdamWConfig oc;
    oc.weight_decay = 0.5;
    optim::AdamW reference(ref, oc);
    const MemStats before = Ledger::global().stats(Device::cpu());
    parallel::ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_bytes = 8;
    parallel::ZeroOptimizer zero(mine, w, oc, zo);
    const MemStats after = Ledger::global().stats(Device::cpu());
    REQUIRE(zero.numel() == 21);
    REQUIRE(zero.padded_numel() == (21 + n - 1) / n * n);
    REQUIRE(after.cur(MemCategory::optim_state) - before.cur(MemCategory::optim_state) == 8 * zero.padded_numel() / n);
    REQUIRE(after.cur(MemCategory::grad) - before.cur(MemCategory::grad) == (stage == 2 ? 4 * zero.padded_numel() / n : 0));
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < ref.size(); ++i) {
        const Shape& shape = ref[i].second.shape();
        Tensor mean = zeros(shape);
        for (int q = 0; q < n; ++q) {
          Tensor g = randn(shape, 11, uint64_t(100 * step + 10 * int(i) + q));
          add_(mean, g, 1.0 / n);
          if (q == r) mine[i].second.set_grad(g);
        }
        ref[i].second.set_grad(mean);
      }
      zero.finish_gradients();
      const double norm = zero.grad_norm();
      REQUIRE(norm == Approx(optim::global_grad_norm({ref[0].second, ref[1].second})).epsilon(1e-6));
      zero.step(1e-2, 0.5);
      zero.zero_grad();
      reference.step(1e-2, 0.5);
      for (size_t i = 0; i < ref.size(); ++i) {
        std::vector<float> a = to_vector<float>(mine[i].second), b = to_vector<float>(ref[i].second);
        for (size_t k = 0; k < a.size(); ++k) REQUIRE(std::abs(a[k] - b[k]) <= 1e-6f);
      }
    }
  }
}


TEST_CASE("bf16 zero1/zero2: losses track f32 within 2e-2; ledger 2Psi param, grads in bf16, optim 12Psi_p/N; 2-byte traffic", "[zero]") {
  auto w = world();
  const int n = w->size();
  const std::vector<double> reference = train(20, kB, 0, nullptr);
  for (int stage : {1, 2}) {
    INFO("bf16 zero" << stage << ", rank " << w->rank() << " of " << n);
    Run run;
    run.stage = stage;
    run.dtype = DType::bf16;
    run.micro = kB / n / 2;
    Probe probe;
    std::vector<double> got = train(run, w, &probe);
    testing::require_half_precision_close(got, reference);
    const int64_t psi = probe.psi, psi_p = probe.psi_p;
    REQUIRE(probe.mem.cur(MemCategory::param) == 2 * psi);
    REQUIRE(probe.mem.cur(MemCategory::grad) == (stage == 1 ? 2 * psi : 2 * psi_p / n));
    REQUIRE(probe.mem.cur(MemCategory::optim_state) == 12 * psi_p / n);  // f32 m, v and master
    Run one = run;
    one.steps = 1;
    Probe b;
    train(one, w, &b);
    const int64_t expect = int64_t(n - 1) * b.psi_p * 2 / n;
    REQUIRE(b.comm[comm::CommKind::reduce_scatter].bytes == expect);
    REQUIRE(b.comm[comm::CommKind::all_gather].bytes == expect);
  }
}

// Optimizer state after 10 steps against the single-process AdamW's: the reduce-scatters sum in
// another order, so they agree to f32 rounding amplified by Adam's normalisation, not bitwise.
constexpr double kStateBound = 1e-4;


TEST_CASE("zero state pieces assemble to the single-process optimizer state; load_state resumes exactly, and from another layout", "[zero]") {
  auto w = world();
  const int n = w->size();
  const std::vector<double> reference = train(20, kB, 0, nullptr);
  std::map<std::string, Tensor> state10;
  Run ref10;
  ref10.steps = 10;
  ref10.state = &state10;
  train(ref10, nullptr);
  const ckpt::MemorySource single(state10);
  for (DType dtype : {DType::f32, DType::bf16})
    for (int stage : {1, 2}) {
      INFO("zero" << stage << ", " << dtype_name(dtype) << ", rank " << w->rank() << " of " << n);
      Run whole;
      whole.stage = stage;
      whole.dtype = dtype;
      whole.micro = kB / n / 2;
      const std::vector<double> uninterrupted = train(whole, w);
      Run first = whole;
      first.steps = 10;
      std::vector<ckpt::Piece> pieces;
      std::map<std::string, Tensor> full, params;
      first.pieces = &pieces;
      first.full = &full;
      first.state = &params;
      train(first, w);
      std::vector<ckpt::Piece> all = testing::all_pieces(*w, pieces);
      std::map<std::string, Tensor> saved = ckpt::assemble(all);
      int64_t covered = 0, expected = 0;
      for (auto& p : all) covered += p.data.numel();
      for (auto& [name, t] : saved) expected += t.numel();
      REQUIRE(covered == expected);  // every element exactly once over the ranks
      REQUIRE(saved.size() == params.size() * (dtype == DType::f32 ? 2 : 3));  // m, v (, master) per parameter
      for (auto& [name, p] : params) {
        INFO(name);
        for (std::string suffix : {".exp_avg", ".exp_avg_sq"}) {
          REQUIRE(saved.count(name + suffix));
          if (dtype == DType::f32) REQUIRE(testing::max_rel_diff(saved.at(name + suffix), state10.at(name + suffix)) <= kStateBound);
        }
        if (dtype == DType::bf16) REQUIRE(to_vector<float>(to(saved.at(name + ".master"), DType::bf16)) == to_vector<float>(p));
      }
      // full_state_dict: parameters and state on rank 0, nothing elsewhere
      if (w->rank() == 0) {
        REQUIRE(full.size() == saved.size() + params.size());
        for (auto& [name, t] : saved) REQUIRE(to_vector<float>(full.at(name)) == to_vector<float>(t));
        for (auto& [name, t] : params) REQUIRE(to_vector<float>(full.at(name)) == to_vector<float>(t));
      } else {
        REQUIRE(full.empty());
      }
      // resume in the same layout (from other initial weights): the uninterrupted run, bitwise
      for (auto& [name, t] : params) saved[name] = t;
      const ckpt::MemorySource source(saved);
      Run resumed = testing::resumed_from(whole, source, 10, 10);
      testing::require_resumed_losses(train(resumed, w), uninterrupted, 10);
      if (dtype != DType::f32) continue;
      // resume from another layout: the single-process run's state
      resumed.resume = &single;
      testing::require_same_losses(train(resumed, w), std::vector<double>(reference.begin() + 10, reference.end()));
    }
}

TEST_CASE("zero1/zero2 across dp with tp, tp + sp or pp reproduce the single-process losses and norms; optim_state is 8 Psi_p/N of the rank's own Psi", "[zero][mesh]") {
  auto w = world();
  if (w->size() % 2) return;  // the mesh needs tp or pp = 2
  const int dp = w->size() / 2;
  const Trajectory reference = train_mesh({}, 8);
  const std::vector<std::pair<const char*, MeshRun>> layouts{
      {"tp 2", {2, 1, false, 0}}, {"tp 2 + sp", {2, 1, true, 0}}, {"pp 2", {1, 2, false, 0}}};
  for (const auto& [name, layout] : layouts)
    for (int stage : {1, 2}) {
      INFO("zero" << stage << " over dp " << dp << " x " << name << ", rank " << w->rank());
      MeshRun run = layout;
      run.stage = stage;
      int64_t psi = 0, optim_bytes = 0;
      const Trajectory got = train_mesh(run, 8, &psi, &optim_bytes);
      testing::require_same_losses(got.losses, reference.losses);
      for (size_t i = 0; i < got.norms.size(); ++i) {
        INFO("step " << i << ": norm " << got.norms[i] << ", single-process " << reference.norms[i]);
        REQUIRE(std::abs(got.norms[i] - reference.norms[i]) <= 1e-5 * reference.norms[i]);
      }
      REQUIRE(psi < tiny().num_params());  // the rank's slices / stages only
      REQUIRE(optim_bytes == 8 * ((psi + dp - 1) / dp));
    }
}

TEST_CASE("zero2 refuses a second synchronised backward, and the step after the error reduces as a clean one; zero1 accumulates; zero2 accumulates in the shard with reduce_micro_batch, which zero1 refuses", "[zero]") {
  auto w = world();
  for (int stage : {1, 2}) {
    INFO("zero" << stage);
    nn::GPT m(testing::tiny_gpt());
    m.init_weights(1);
    parallel::ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_bytes = 4096;  // several stripes
    parallel::ZeroOptimizer zero(m.named_parameters(), w, optim::AdamWConfig{}, zo);
    auto backward = [&] {
      autograd::Tape tape;
      Tensor idx, tgt;
      testing::token_batch(0, 2, 8, idx, tgt);
      {
        autograd::TapeScope sc(tape);
        tape.backward(m.loss(idx, tgt));
      }
    };
    backward();
    zero.finish_gradients();
    const double want = zero.grad_norm();
    m.zero_grad();
    backward();
    if (stage == 1) {  // the stripes are reduced at finish_gradients: two backwards are twice the gradient
      backward();
      zero.finish_gradients();
      CHECK(zero.grad_norm() == Approx(2 * want).epsilon(1e-6));
      m.zero_grad();
      continue;
    }
    REQUIRE_THROWS_WITH(backward(), Catch::Contains("got a second gradient before finish_gradients"));
    backward();  // no zero_grad: the error dropped the step's gradients
    zero.finish_gradients();
    CHECK(zero.grad_norm() == want);
    REQUIRE_THROWS_WITH(zero.finish_gradients(), Catch::Contains("no backward since the last finish_gradients"));
    CHECK(zero.grad_norm() == want);
    // accumulating in the shard: two backwards, each reduced, are twice the gradient
    zero.zero_grad();
    backward();
    zero.reduce_micro_batch();
    backward();
    zero.finish_gradients();
    CHECK(zero.grad_norm() == Approx(2 * want).epsilon(1e-6));
    zero.zero_grad();
    zero.set_sync(false);
    backward();
    REQUIRE_THROWS_WITH(zero.reduce_micro_batch(), Catch::Contains("after a backward under set_sync(false)"));
    zero.set_sync(true);
    zero.finish_gradients();
    zero.zero_grad();
    // a step before finish_gradients: refused (it read unreduced gradients and reused stripe
    // buffers a reduce-scatter was still writing); the backward's gradients are dropped
    backward();
    REQUIRE_THROWS_WITH(zero.step(1e-3), Catch::Contains("step() before finish_gradients()"));
    backward();
    zero.finish_gradients();
    CHECK(zero.grad_norm() == want);
    zero.step(1e-3);
    zero.zero_grad();
  }
  parallel::ZeroOptions zo;
  zo.stage = 1;
  nn::GPT m(testing::tiny_gpt());
  parallel::ZeroOptimizer zero1(m.named_parameters(), w, optim::AdamWConfig{}, zo);
  REQUIRE_THROWS_WITH(zero1.reduce_micro_batch(), Catch::Contains("only stage 2 keeps"));
}

TEST_CASE("ddp, zero and fsdp refuse, on every rank, a model that differs across ranks, naming the parameter and the rank", "[zero]") {
  auto w = testing::world();
  const int last = w->size() - 1;
  optim::AdamWConfig oc;
  // The last rank's model has a wider vocabulary: wte's shape differs, the count does not.
  nn::GPTConfig c = tiny(), wider = tiny();
  wider.vocab_size += 100;
  if (w->rank() == last) std::swap(c, wider);
  {
    nn::GPT model(c), other(wider);  // other: what the compared rank holds
    const Shape s = other.wte->weight.shape();
    const std::string theirs = str("f32[", s[0], ",", s[1], "] on rank ", w->rank() == last ? 0 : last);
    REQUIRE_THROWS_WITH(parallel::DistributedDataParallel(model.named_parameters(), w, {}),
                        Contains("ddp: parameter 0 ('wte.weight'") && Contains(theirs) &&
                            Contains("every rank must wrap the same model"));
    REQUIRE_THROWS_WITH(parallel::ZeroOptimizer(model.named_parameters(), w, oc, {}),
                        Contains("zero: parameter 0 ('wte.weight'") && Contains(theirs));
    REQUIRE_THROWS_WITH(parallel::FullyShardedDataParallel(model, w, oc, {}),
                        Contains("fsdp: parameter ") && Contains("('wte.weight'") && Contains(theirs));
  }
  // Another layer count on the last rank: the counts differ.
  nn::GPTConfig deeper = tiny();
  if (w->rank() == last) deeper.n_layer += 1;
  nn::GPT model(deeper);
  REQUIRE_THROWS_WITH(parallel::ZeroOptimizer(model.named_parameters(), w, oc, {}),
                      Contains("zero: rank ") && Contains(" parameters where this rank has "));
  // The group is left as it was: the same model on every rank wraps and trains.
  nn::GPT same(tiny());
  parallel::DistributedDataParallel ddp(same.named_parameters(), w, {});
  ddp.broadcast_parameters();
}

TEST_CASE("a parameter that zero or fsdp updates is refused by a plain optimizer and a second wrapper while they live", "[zero]") {
  auto w = testing::world();
  optim::AdamWConfig oc;
  nn::GPT model(tiny());
  auto params = model.named_parameters();
  {
    parallel::ZeroOptions zo;
    zo.stage = 2;
    parallel::ZeroOptimizer zero(params, w, oc, zo);
    REQUIRE_THROWS_WITH(optim::AdamW(params, oc), Contains("AdamW: parameter 'wte.weight' is updated by a ZeRO-2 "
                                                           "optimizer, whose own step() updates it"));
    REQUIRE_THROWS_WITH(optim::SGD(params, {}), Contains("SGD: parameter 'wte.weight' is updated by a ZeRO-2"));
    REQUIRE_THROWS_WITH(parallel::ZeroOptimizer(params, w, oc, {}),
                        Contains("zero: parameter 'wte.weight' is updated by a ZeRO-2 optimizer already"));
    REQUIRE_THROWS_WITH(parallel::FullyShardedDataParallel(model, w, oc, {}),
                        Contains("fsdp: parameter 'wte.weight' is updated by a ZeRO-2 optimizer already"));
  }
  optim::AdamW plain(params, oc);  // the wrapper gone, its mark went with it
  {
    parallel::FullyShardedDataParallel fsdp(model, w, oc, {});
    REQUIRE_THROWS_WITH(optim::AdamW(model.named_parameters(), oc),
                        Contains("AdamW: parameter 'wte.weight' is updated by an FSDP wrapper (full_shard)"));
    fsdp.gather_all();
  }
  optim::AdamW again(model.named_parameters(), oc);
}
