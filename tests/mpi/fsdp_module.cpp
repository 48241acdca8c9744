// FSDP over a module of one's own (the generic constructor): the given submodules become units,
// every other parameter a root unit. Under mpirun, every mode gives the single-process losses and
// weights, the ledger and the counters follow ZeRO-3's formulas unit by unit, prefetch gathers
// nothing twice (also without a root unit), the checkpoint state is the single process's under the
// model's names and resumes bitwise, and bad unit lists are refused by name.
#include "tests/catch.h"
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/module.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/fsdp.h"
#include "parallel/shard_state.h"
#include "tests/mpi/mpi_support.h"

using namespace sg;
using parallel::FsdpMode;
using parallel::FsdpOptions;

namespace {

constexpr int64_t kB = 8, kW = 13;  // rows of the global batch; width 13: no unit divides by 2 or 4
constexpr double kClip = 0.5;

struct Stack : nn::Module {  // "layers.0", "layers.1", "layers.2"
  std::vector<std::shared_ptr<nn::Linear>> layers;
  Stack() {
    for (int i = 0; i < 3; ++i) layers.push_back(register_module(std::to_string(i), std::make_shared<nn::Linear>(kW, kW, true)));
  }
};

// in (3 -> 13), three hidden layers, head (13 -> 1); the model's and every unit's forward through hooked().
struct Net : nn::Module {
  std::shared_ptr<nn::Linear> in = register_module("in", std::make_shared<nn::Linear>(3, kW, true));
  std::shared_ptr<Stack> layers = register_module("layers", std::make_shared<Stack>());
  std::shared_ptr<nn::Linear> head = register_module("head", std::make_shared<nn::Linear>(kW, 1, true));
  Net() {
    autograd::NoGradGuard no_grad;
    uint64_t stream = 0;
    for (auto& [name, p] : named_parameters()) copy_(p, randn(p.shape(), /*seed=*/11, stream++, 0.0, 0.4));
  }
  Tensor forward(const Tensor& x) const {
    return hooked([&] {
      Tensor h = in->hooked([&] { return in->forward_gelu(x); });
      for (const auto& l : layers->layers) h = l->hooked([&] { return l->forward_gelu(h); });
      return head->hooked([&] { return head->forward(h); });
    });
  }
  std::vector<nn::Module*> hidden_and_head() { return {layers->layers[0].get(), layers->layers[1].get(), layers->layers[2].get(), head.get()}; }
};

struct Result {
  std::vector<double> losses;
  std::map<std::string, Tensor> state;  // parameters after the last step (rank 0; single process)
  MemStats mem;                         // after the last step, peaks over it
  comm::CommCounters comm;              // the last step's, on the world group
  std::vector<int64_t> padded;          // Ψu_p per unit
  std::vector<std::string> names;
};

// Checkpoint state around a run: load it before the first step, or hand back this rank's pieces
// after the last; steps [first, first + steps) of the 6.
struct Span {
  int first = 0, steps = 6;
  const ckpt::PieceSource* resume = nullptr;
  std::vector<ckpt::Piece>* pieces = nullptr;
  std::map<std::string, Tensor>* single_state = nullptr;  // no group: parameters and AdamW state after the last step
};

// y = tanh(x w) by MSE, clipped; with a group each rank takes its rows and FSDP shards (units: the
// given modules; with_in: "in" as well, so no root unit).
Result train(std::shared_ptr<comm::ProcessGroup> group, FsdpOptions o = {}, bool with_in = false, Span span = {}) {
  Net net;
  optim::AdamWConfig adam;
  adam.weight_decay = 0.1;
  const int n = group ? group->size() : 1, rank = group ? group->rank() : 0;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp;
  std::unique_ptr<optim::AdamW> single;
  std::vector<nn::Module*> units = net.hidden_and_head();
  if (with_in) units.insert(units.begin(), net.in.get());
  if (group) fsdp = std::make_unique<parallel::FullyShardedDataParallel>(net, units, group, adam, o);
  else single = std::make_unique<optim::AdamW>(net.named_parameters(), adam);
  if (span.resume) fsdp->load_state(*span.resume, span.first);
  const Tensor w = from_vector<float>({1.0f, -1.5f, 0.5f}, {3, 1});
  Result res;
  for (int step = span.first; step < span.first + span.steps; ++step) {
    const Tensor x = rand({kB, 3}, /*seed=*/3, uint64_t(step), -1.0, 1.0), y = tanh(matmul(x, w));
    const Tensor xr = narrow(x, 0, rank * (kB / n), kB / n), yr = narrow(y, 0, rank * (kB / n), kB / n);
    if (group) group->reset_counters();
    Ledger::global().reset_peaks(Device::cpu());
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope record(tape);
      loss = mean(square(sub(net.forward(xr), yr)));  // this rank's rows; FSDP averages over ranks
    }
    tape.backward(loss);
    double l = item(loss);
    if (fsdp) {
      fsdp->finish_gradients();
      fsdp->step(1e-2, optim::clip_coefficient(fsdp->grad_norm(), kClip));
      res.mem = Ledger::global().stats(Device::cpu());
      res.comm = group->counters();
      fsdp->zero_grad();
      l = testing::sum_over(*group, l) / n;
    } else {
      single->step(1e-2, optim::clip_coefficient(optim::global_grad_norm(net.parameters()), kClip));
      net.zero_grad();
    }
    res.losses.push_back(l);
  }
  if (fsdp && span.pieces) *span.pieces = fsdp->state_pieces();
  if (single && span.single_state) {
    for (auto& [name, p] : net.named_parameters()) (*span.single_state)[name] = clone(p);
    for (auto& [name, t] : single->state()) (*span.single_state)[name] = clone(t);
  }
  if (fsdp) {
    for (int u = 0; u < fsdp->num_units(); ++u) {
      res.padded.push_back(fsdp->unit_padded_numel(u));
      res.names.push_back(fsdp->unit_name(u));
    }
    res.state = fsdp->full_state_dict(false);
  } else {
    for (auto& [name, p] : net.named_parameters()) res.state[name] = clone(p);
  }
  return res;
}

void require_same_state(const std::map<std::string, Tensor>& got, const std::map<std::string, Tensor>& reference) {
  REQUIRE(got.size() == reference.size());
  for (const auto& [name, t] : reference) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    REQUIRE(got.at(name).shape() == t.shape());
    REQUIRE(testing::max_rel_diff(got.at(name), t) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("FSDP over a module of one's own gives the single-process losses and weights in every mode", "[fsdp]") {
  auto w = testing::world();
  const int n = w->size();
  const Result reference = train(nullptr);
  REQUIRE(reference.losses.back() < reference.losses.front());
  std::vector<std::pair<std::string, FsdpOptions>> modes;
  for (FsdpMode m : {FsdpMode::full_shard, FsdpMode::shard_grad_op, FsdpMode::no_shard, FsdpMode::hybrid}) {
    FsdpOptions o;
    o.mode = m;
    if (m == FsdpMode::hybrid) o.shard_group_size = n / 2;
    modes.emplace_back(parallel::fsdp_mode_name(m), o);
  }
  FsdpOptions prefetch;
  prefetch.forward_prefetch = prefetch.backward_prefetch = true;
  modes.emplace_back("full_shard + prefetch", prefetch);
  for (const auto& [name, o] : modes) {
    INFO(name << " on " << n << " ranks");
    const Result r = train(w, o);
    testing::require_same_losses(r.losses, reference.losses);
    if (w->rank() == 0) require_same_state(r.state, reference.state);
    // the root (in) first, then the given modules under their names in the model
    REQUIRE(r.names == std::vector<std::string>{"root", "layers.0", "layers.1", "layers.2", "head"});
  }
}

TEST_CASE("FSDP over a module: ZeRO-3's bytes unit by unit, and prefetch gathers each unit once, with or without a root", "[fsdp]") {
  auto w = testing::world();
  const int n = w->size();
  const Result r = train(w);
  // Ψu: root 3·13+13 = 52, each layer 13·13+13 = 182, head 14; each padded to a multiple of n
  REQUIRE(r.padded.size() == 5);
  const std::vector<int64_t> numel = {52, 182, 182, 182, 14};
  int64_t psi_p = 0, rs = 0;
  for (size_t u = 0; u < numel.size(); ++u) {
    REQUIRE(r.padded[u] == (numel[u] + n - 1) / n * n);
    psi_p += r.padded[u];
    rs += comm::reduce_scatter_bytes(4 * r.padded[u], n);
  }
  // after the step every unit is released: 4Ψp/N of parameters and of gradients, 8Ψp/N of m and v
  REQUIRE(r.mem.cur(MemCategory::param) == 4 * psi_p / n);
  REQUIRE(r.mem.cur(MemCategory::grad) == 4 * psi_p / n);
  REQUIRE(r.mem.cur(MemCategory::optim_state) == 8 * psi_p / n);
  // at peak the root and one layer gathered on top of the shards
  REQUIRE(r.mem.pk(MemCategory::param) == 4 * psi_p / n + 4 * (r.padded[0] + r.padded[1]));
  // per step: every unit gathered for forward and again for backward, reduce-scattered once: 3Ψ
  REQUIRE(r.comm[comm::CommKind::reduce_scatter].calls == 5);
  REQUIRE(r.comm[comm::CommKind::reduce_scatter].bytes == rs);
  REQUIRE(r.comm[comm::CommKind::all_gather].calls == 10);
  REQUIRE(r.comm[comm::CommKind::all_gather].bytes == 2 * rs);

  FsdpOptions prefetch;
  prefetch.forward_prefetch = prefetch.backward_prefetch = true;
  for (bool with_in : {false, true}) {
    INFO((with_in ? "in as a unit: no root" : "in in the root"));
    const Result p = train(w, prefetch, with_in);
    REQUIRE(p.names.front() == (with_in ? "in" : "root"));
    REQUIRE(p.padded.size() == 5);
    // ahead of time, never twice: the same calls as without prefetch
    REQUIRE(p.comm[comm::CommKind::all_gather].calls == 10);
    REQUIRE(p.comm[comm::CommKind::all_gather].bytes == 2 * rs);
    REQUIRE(p.comm[comm::CommKind::reduce_scatter].calls == 5);
    // the layers gathered at once stay within limit_all_gathers (2): at most two units beside the root
    const int64_t layer = 4 * r.padded[1];
    REQUIRE(p.mem.pk(MemCategory::param) <= 4 * psi_p / n + 4 * r.padded[0] + 2 * layer);
  }
}

TEST_CASE("FSDP over a module: its state pieces are the single process's state; resuming from them continues the run bitwise", "[fsdp]") {
  auto w = testing::world();
  std::map<std::string, Tensor> single3;
  Span three;
  three.steps = 3;
  three.single_state = &single3;
  train(nullptr, {}, false, three);  // fills single3
  const Result reference6 = train(nullptr);
  FsdpOptions prefetch;
  prefetch.forward_prefetch = prefetch.backward_prefetch = true;
  for (const auto& [name, o] : std::vector<std::pair<std::string, FsdpOptions>>{{"full_shard", {}}, {"prefetch", prefetch}}) {
    INFO(name << " on " << w->size() << " ranks");
    const Result whole = train(w, o);
    std::vector<ckpt::Piece> pieces;
    Span first = three;
    first.single_state = nullptr;
    first.pieces = &pieces;
    train(w, o, false, first);
    // every element of the parameters, m and v exactly once over the ranks, under the model's names
    const std::map<std::string, Tensor> saved = ckpt::assemble(testing::all_pieces(*w, pieces));
    REQUIRE(saved.size() == single3.size());
    for (const auto& [tensor, t] : single3) {
      INFO(tensor);
      REQUIRE(saved.count(tensor) == 1);
      REQUIRE(testing::max_rel_diff(saved.at(tensor), t) <= 1e-5);
    }
    // a fresh model resumed from the pieces: the uninterrupted run's last 3 losses, bit for bit
    const ckpt::MemorySource source(saved);
    Span rest;
    rest.first = 3, rest.steps = 3, rest.resume = &source;
    testing::require_resumed_losses(train(w, o, false, rest).losses, whole.losses, 3);
    // and from the single process's state: its last 3 losses, to rounding
    const ckpt::MemorySource from_single(single3);
    rest.resume = &from_single;
    testing::require_same_losses(train(w, o, false, rest).losses,
                                 std::vector<double>(reference6.losses.begin() + 3, reference6.losses.end()));
  }
}

TEST_CASE("FSDP over a module refuses a unit outside the model, units inside one another, the model itself and GPT-only options", "[fsdp]") {
  auto w = testing::world();
  Net net;
  nn::Linear stranger(3, 3, true);
  const optim::AdamWConfig adam;
  using parallel::FullyShardedDataParallel;
  REQUIRE_THROWS_WITH(FullyShardedDataParallel(net, {net.head.get(), &stranger}, w, adam),
                      Catch::Contains("a unit module (Linear) is not part of the model"));
  REQUIRE_THROWS_WITH(FullyShardedDataParallel(net, {net.layers.get(), net.layers->layers[1].get()}, w, adam),
                      Catch::Contains("units 'layers' and 'layers.1' overlap"));
  REQUIRE_THROWS_WITH(FullyShardedDataParallel(net, {&net}, w, adam), Catch::Contains("must be a module below the model"));
  FsdpOptions grouped;
  grouped.wrap_min_params = 100;
  REQUIRE_THROWS_WITH(FullyShardedDataParallel(net, net.hidden_and_head(), w, adam, grouped),
                      Catch::Contains("wrap_min_params groups a GPT's blocks"));
  // one Linear registered twice (tied weights): kept once under its first name inside a unit,
  // refused across two units
  struct Wrapper : nn::Module {
    explicit Wrapper(std::shared_ptr<nn::Linear> l) { register_module("inner", std::move(l)); }
  };
  struct Tied : nn::Module {
    std::shared_ptr<nn::Linear> lin = register_module("first", std::make_shared<nn::Linear>(2, 2, true));
    std::shared_ptr<Wrapper> wrapper = register_module("second", std::make_shared<Wrapper>(lin));
  };
  {
    Tied tied;
    REQUIRE(tied.named_parameters().size() == 2);  // first.weight, first.bias: the shared Linear once, as PyTorch
    REQUIRE_THROWS_WITH(FullyShardedDataParallel(tied, {tied.lin.get(), tied.wrapper.get()}, w, adam),
                        Catch::Contains("parameter 'second.inner.weight' is also 'first.weight' (shared) in another unit"));
  }
  {
    Tied tied;
    FullyShardedDataParallel root_only(tied, {}, w, adam);  // every parameter in the root: each tensor once
    REQUIRE(root_only.num_units() == 1);
    REQUIRE(root_only.unit_numel(0) == 2 * 2 + 2);
    root_only.gather_all();
  }
  // a unit whose forward skips hooked() would read released parameters: refused, saying so
  {
    FullyShardedDataParallel fsdp(net, net.hidden_and_head(), w, adam);
    const Tensor x = rand({2, 3}, /*seed=*/3, 0, -1.0, 1.0);
    REQUIRE_THROWS_WITH(net.hooked([&] { return net.layers->layers[0]->forward(net.in->forward(x)); }),
                        Catch::Contains("is read while its storage is released") &&
                            Catch::Contains("must run through nn::Module::hooked"));
    REQUIRE(std::isfinite(item(sum(net.forward(x)))));  // through the hooks it runs
    REQUIRE_THROWS_WITH(item(sum(net.head->weight)), Catch::Contains("gather_all() brings them back"));
    fsdp.gather_all();  // the whole parameters, kept after FSDP is gone
  }
  // nothing was sharded by the refusals, and gather_all() left the parameters whole: they hold values
  REQUIRE(net.head->weight.numel() == kW);
  REQUIRE(std::isfinite(item(sum(net.head->weight))));
}
