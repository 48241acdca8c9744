// ZeRO-3 / FSDP under mpirun: the same losses as one process with the same global batch (clipping
// and gradient accumulation on), the ledger's bytes per rank (only shards persist; at peak the root
// and one block are gathered on top), and the 3Ψ traffic per step counted by the process group.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/fsdp.h"
#include "tests/mpi/mpi_support.h"
#include "tests/support.h"

using namespace sg;

namespace {

constexpr int64_t kB = 8, kT = 8;
constexpr double kClip = 0.6;  // the tiny model's norms run 0.5-1.0: some steps clip, some do not

void batch(int64_t step, Tensor& idx, Tensor& tgt) { testing::token_batch(step, kB, kT, idx, tgt); }

// What the last step measured: the ledger right after the optimizer step (peaks over the step)
// and the group's counters over the step.
struct Probe {
  MemStats mem;
  comm::CommCounters comm;
  int64_t reduce_scatters_in_backward = 0;  // issued before finish_gradients(): the hooks' work
  std::vector<int64_t> unit_padded;         // Ψu_p per unit, root first
  int64_t psi = 0, psi_p = 0;
  int clipped_steps = 0;
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

std::vector<double> train(int steps, int64_t micro, std::shared_ptr<comm::ProcessGroup> group, Probe* probe = nullptr,
                          nn::Recompute rc = nn::Recompute::none, const nn::GPTConfig& cfg = testing::tiny_gpt()) {
  nn::GPT model(cfg);
  model.init_weights(5);
  model.recompute = rc;
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
  if (group) fsdp = std::make_unique<parallel::FullyShardedDataParallel>(model, group, oc);
  else opt = std::make_unique<optim::AdamW>(model.named_parameters(), oc);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    if (group) group->reset_counters();
    Ledger::global().reset_peaks(Device::cpu());
    double loss = testing::backward_rank_rows(model, idx, tgt, rank, world, micro);
    if (fsdp) {
      if (probe) probe->reduce_scatters_in_backward = group->counters()[comm::CommKind::reduce_scatter].calls;
      fsdp->finish_gradients();
      const double norm = fsdp->grad_norm();
      fsdp->step(1e-2, optim::clip_coefficient(norm, kClip));
      if (probe) {
        probe->mem = Ledger::global().stats(Device::cpu());
        probe->comm = group->counters();
        probe->psi = fsdp->numel();
        probe->psi_p = fsdp->padded_numel();
        probe->unit_padded.clear();
        for (int u = 0; u < fsdp->num_units(); ++u) probe->unit_padded.push_back(fsdp->unit_padded_numel(u));
        probe->clipped_steps += norm > kClip;
      }
      fsdp->zero_grad();
      loss = testing::sum_over(*group, loss);
    } else {
      const double norm = optim::global_grad_norm(model.parameters());
      opt->step(1e-2, optim::clip_coefficient(norm, kClip));
      model.zero_grad();
    }
    losses.push_back(loss);
  }
  return losses;
}

using testing::world;

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
    for (size_t i = 0; i < reference.size(); ++i) {
      INFO("step " << i << ": " << got[i] << " vs " << reference[i]);
      REQUIRE(std::abs(got[i] - reference[i]) <= 1e-5 * std::abs(reference[i]));
    }
  }
  // units with padding
  const std::vector<double> odd_ref = train(20, kB, nullptr, nullptr, nn::Recompute::none, odd_gpt());
  std::vector<double> odd = train(20, 1, w, nullptr, nn::Recompute::none, odd_gpt());
  for (size_t i = 0; i < odd.size(); ++i) REQUIRE(std::abs(odd[i] - odd_ref[i]) <= 1e-5 * std::abs(odd_ref[i]));
  // recompute re-runs a block's forward inside its backward, after the unit was gathered again
  for (nn::Recompute rc : {nn::Recompute::selective, nn::Recompute::full}) {
    std::vector<double> got = train(5, 1, w, nullptr, rc);
    testing::require_same_losses(got, reference);
  }
}

TEST_CASE("zero3 ledger on every rank: only shards persist; at peak the root and one block are gathered", "[fsdp]") {
  auto w = world();
  const int n = w->size();
  for (const nn::GPTConfig& cfg : {testing::tiny_gpt(), odd_gpt()}) {
    INFO("rank " << w->rank() << " of " << n << ", n_embd " << cfg.n_embd);
    Probe probe;
    train(2, kB / n, w, &probe, nn::Recompute::none, cfg);
    REQUIRE(probe.psi == cfg.num_params());
    const int64_t units = int64_t(probe.unit_padded.size());
    REQUIRE(units == cfg.n_layer + 1);
    int64_t shards = 0;
    for (int64_t p : probe.unit_padded) {
      REQUIRE(p % n == 0);
      shards += 4 * p / n;
    }
    REQUIRE(probe.psi_p - probe.psi < units * n);  // at most N-1 padding elements per unit
    REQUIRE(probe.mem.cur(MemCategory::param) == shards);  // every full unit released
    REQUIRE(probe.mem.cur(MemCategory::grad) == shards);
    REQUIRE(probe.mem.cur(MemCategory::optim_state) == 2 * shards);
    std::vector<int64_t> sorted = probe.unit_padded;
    std::sort(sorted.rbegin(), sorted.rend());
    REQUIRE(probe.mem.pk(MemCategory::param) <= shards + 4 * (sorted[0] + sorted[1]));
    // exactly: the root (wte, wpe, ln_f: gathered through the whole forward and backward) plus one block
    const int64_t block = *std::max_element(probe.unit_padded.begin() + 1, probe.unit_padded.end());
    REQUIRE(probe.mem.pk(MemCategory::param) == shards + 4 * (probe.unit_padded[0] + block));
    // full gradients: at most the root's and one block's at a time, besides the shards
    REQUIRE(probe.mem.pk(MemCategory::grad) <= shards + 4 * (sorted[0] + sorted[1]));
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
