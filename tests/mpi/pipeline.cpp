// Pipeline parallelism under mpirun (one rank per pipeline stage group): every schedule
// reproduces the single-process losses; the recorded timeline and the ledger show the bubble and
// GPipe's larger activation memory.
#include "tests/catch.h"
#include <chrono>
#include <cmath>
#include <map>
#include <thread>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/pp/executor.h"
#include "tests/mpi/mpi_support.h"

using namespace sg;
using namespace sg::parallel;

namespace {

nn::GPTConfig config(int layers) {
  nn::GPTConfig c;
  c.n_layer = layers;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 23;
  return c;
}

constexpr int64_t kRows = 8, kT = 8;

void batch(int step, Tensor& idx, Tensor& tgt) {
  std::vector<int64_t> x, y;
  for (float v : to_vector<float>(rand({kRows, kT + 1}, 11, uint64_t(step), 0, 23))) x.push_back(int64_t(v));
  std::vector<int64_t> in, out;
  for (int64_t b = 0; b < kRows; ++b)
    for (int64_t t = 0; t < kT; ++t) {
      in.push_back(x[size_t(b * (kT + 1) + t)]);
      out.push_back(x[size_t(b * (kT + 1) + t + 1)]);
    }
  idx = from_vector(in, {kRows, kT});
  tgt = from_vector(out, {kRows, kT});
}

using Grads = std::map<std::string, std::vector<float>>;

// norms: each step's global gradient norm; first_grads: every parameter's gradient at the first
// step, before clipping.
std::vector<double> single(int layers, int steps, std::vector<double>* norms = nullptr, Grads* first_grads = nullptr) {
  nn::GPT m(config(layers));
  m.init_weights(3);
  optim::AdamW opt(m.named_parameters(), {});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    autograd::Tape tape;
    Tensor l;
    {
      autograd::TapeScope sc(tape);
      l = m.loss(idx, tgt, true, 1.0 / double(kRows * kT));
    }
    losses.push_back(item(l));
    tape.backward(l);
    const double norm = optim::global_grad_norm(m.parameters());
    if (norms) norms->push_back(norm);
    if (first_grads && s == 0)
      for (auto& [n, p] : m.named_parameters()) (*first_grads)[n] = to_vector<float>(p.grad());
    opt.step(1e-2, optim::clip_coefficient(norm, 1.0));
    m.zero_grad();
  }
  return losses;
}

std::vector<double> piped(int layers, int steps, pp::Schedule sched, std::shared_ptr<comm::ProcessGroup> g,
                          std::vector<double>* norms = nullptr, Grads* first_grads = nullptr) {
  nn::GPT m(config(layers));
  m.init_weights(3);
  pp::PipelineExecutor ex(m, std::move(sched), g);
  optim::AdamW opt(ex.parameters(), {});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    losses.push_back(ex.run(idx, tgt, 1.0 / double(kRows * kT)));
    ex.reduce_tied_embedding();
    Tensor ss = from_vector<double>({ex.grad_sum_squares()}, {1});
    g->all_reduce(ss)->wait();
    if (norms) norms->push_back(std::sqrt(item(ss)));
    if (first_grads && s == 0)
      for (auto& [n, p] : ex.parameters()) (*first_grads)[n] = to_vector<float>(p.grad());
    opt.step(1e-2, optim::clip_coefficient(std::sqrt(item(ss)), 1.0));
    for (auto& [n, p] : ex.parameters()) p.set_grad(Tensor());
  }
  return losses;
}

}  // namespace

TEST_CASE("gpipe, 1f1b and interleaved pipelines reproduce the single-process losses", "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size();
  const int layers = 2 * p;  // interleaved with v = 2 needs one layer per virtual stage
  const auto ref = single(layers, 6);
  for (const char* kind : {"gpipe", "1f1b", "interleaved"}) {
    INFO(kind << " on " << p << " ranks");
    auto got = piped(layers, 6, pp::make_schedule(kind, p, 4, std::string(kind) == "interleaved" ? 2 : 1), world);
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("step " << i);
      REQUIRE(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
    }
  }
}

// MPI guarantees tags up to 32767 only (UCX: 2^23 - 1): the pipeline's tags wrap below the group's
// limit, here 5 (tags 0-3 for the micro-batches' messages, 5 for the tied embedding's), and every
// schedule still pairs each message with its own receive; a tag above the limit is refused.
TEST_CASE("under a small tag limit the pipelines' tags wrap and every schedule still reproduces the single-process losses",
          "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size();
  world->limit_tags(5);
  CHECK(world->max_tag() == 5);
  const int layers = 2 * p;
  const auto ref = single(layers, 3);
  for (const char* kind : {"gpipe", "1f1b", "interleaved"}) {
    INFO(kind << " on " << p << " ranks");
    auto got = piped(layers, 3, pp::make_schedule(kind, p, 2 * p, std::string(kind) == "interleaved" ? 2 : 1), world);
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("step " << i);
      REQUIRE(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
    }
  }
  REQUIRE_THROWS_WITH(world->send(zeros({1}), (world->rank() + 1) % p, 6),
                      Catch::Contains("send: tag 6 is above the mpi backend's largest tag 5 (MPI_TAG_UB)"));
  REQUIRE_THROWS_WITH(world->limit_tags(0), Catch::Contains("limit_tags: 0 leaves no tag"));
}

// Losses alone would not see a gradient scaled by a constant (AdamW divides it out): each stage's
// gradients, the tied wte's summed over the two ends, and the norm over the stages must be the
// single process's.
TEST_CASE("every pipeline schedule gives each stage the single-process gradients and the global norm", "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size();
  const int layers = 2 * p;
  std::vector<double> ref_norms;
  Grads ref_grads;
  single(layers, 3, &ref_norms, &ref_grads);
  for (const char* kind : {"gpipe", "1f1b", "interleaved"}) {
    INFO(kind << " on " << p << " ranks, rank " << world->rank());
    std::vector<double> norms;
    Grads grads;
    piped(layers, 3, pp::make_schedule(kind, p, 4, std::string(kind) == "interleaved" ? 2 : 1), world, &norms, &grads);
    for (size_t i = 0; i < ref_norms.size(); ++i) REQUIRE(std::abs(norms[i] - ref_norms[i]) <= 1e-5 * ref_norms[i]);
    testing::require_same_gradients(grads, ref_grads);
  }
}

// Between stages travel only activations forward and their gradients back: per micro-batch, one
// [b, T, C] f32 tensor out of every (virtual) stage but the last and one back out of every stage
// but the first. Rank r holds stages r, r + p, ... (v of them), so it sends
// m·b·T·C·4·(#its stages < V-1 + #its stages > 0) bytes in a step, V = p·v, and receives as much.
TEST_CASE("a pipeline step sends and receives exactly the stage boundaries' activations and gradients", "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size(), r = world->rank();
  const int layers = 2 * p, m = 4;
  const nn::GPTConfig c = config(layers);
  for (const char* kind : {"gpipe", "1f1b", "interleaved"}) {
    const int v = std::string(kind) == "interleaved" ? 2 : 1, V = p * v;
    INFO(kind << " on " << p << " ranks, rank " << r);
    nn::GPT model(c);
    model.init_weights(3);
    pp::PipelineExecutor ex(model, pp::make_schedule(kind, p, m, v), world);
    Tensor idx, tgt;
    batch(0, idx, tgt);
    world->reset_counters();
    ex.run(idx, tgt, 1.0 / double(kRows * kT));
    int boundaries = 0;
    for (int k = r; k < V; k += p) boundaries += (k < V - 1) + (k > 0);
    const int64_t expect = int64_t(m) * (kRows / m) * kT * c.n_embd * 4 * boundaries;
    const comm::CommCounters got = world->counters();
    REQUIRE(boundaries > 0);
    CHECK(got[comm::CommKind::send].bytes == expect);
    CHECK(got[comm::CommKind::recv].bytes == expect);
    CHECK(got[comm::CommKind::send].calls == int64_t(m) * boundaries);
  }
}

TEST_CASE("gpipe keeps every micro-batch's activations alive, 1f1b at most p (ledger)", "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size(), m = 4 * p;
  int64_t peak[2];
  const char* kinds[2] = {"gpipe", "1f1b"};
  for (int k = 0; k < 2; ++k) {
    nn::GPT model(config(p));
    model.init_weights(3);
    pp::PipelineExecutor ex(model, pp::make_schedule(kinds[k], p, m), world);
    Tensor idx, tgt;
    batch(0, idx, tgt);
    Tensor big_idx = cat(std::vector<Tensor>(size_t(m / 2), idx), 0), big_tgt = cat(std::vector<Tensor>(size_t(m / 2), tgt), 0);
    Ledger::global().reset_peaks(Device::cpu());
    const int64_t before = Ledger::global().stats(Device::cpu()).cur(MemCategory::activation);
    ex.run(big_idx, big_tgt, 1.0);
    peak[k] = Ledger::global().stats(Device::cpu()).pk(MemCategory::activation) - before;
    // the recorded timeline holds every action of this rank
    REQUIRE(ex.last_timeline().per_rank[size_t(world->rank())].size() == size_t(2 * m));
  }
  INFO("rank " << world->rank() << ": gpipe peak " << peak[0] << " B, 1f1b peak " << peak[1] << " B");
  if (world->rank() == 0) REQUIRE(peak[0] > 2 * peak[1]);  // the first stage holds m vs p micro-batches
}

TEST_CASE("the measured timeline leaves waits for another stage out of the actions: the bubble shows", "[pp]") {
  // Stage 0's forwards are slowed by 40 ms each: every later stage waits for its inputs, and that
  // wait is idle time in its timeline, not part of its (millisecond) actions.
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size(), m = 2;
  if (p < 2) return;
  nn::GPT model(config(p));
  model.init_weights(3);
  pp::PipelineExecutor ex(model, pp::make_schedule("gpipe", p, m), world);
  constexpr double kSlow = 0.040;
  ex.before_forward = [=](int stage) {
    if (stage == 0) std::this_thread::sleep_for(std::chrono::duration<double>(kSlow));
  };
  Tensor idx, tgt;
  batch(0, idx, tgt);
  world->barrier()->wait();  // the ranks' clocks start together
  ex.run(idx, tgt, 1.0);
  const auto& mine = ex.last_timeline().per_rank[size_t(world->rank())];
  REQUIRE(mine.size() == size_t(2 * m));
  double busy = 0;
  for (const auto& act : mine) busy += act.end - act.start;
  const double makespan = ex.last_timeline().makespan;
  INFO("rank " << world->rank() << ": first action at " << mine[0].start << " s, busy " << busy << " s of "
               << makespan << " s");
  if (world->rank() == 0) {
    REQUIRE(busy >= m * kSlow);  // its own forwards hold the sleeps
  } else {
    REQUIRE(mine[0].start >= 0.75 * kSlow);  // the first forward starts once its input has come
    REQUIRE(makespan - busy >= 0.75 * m * kSlow);  // both slow forwards upstream are idle time here
  }
}

TEST_CASE("ranks that build different schedules are refused at construction, naming the rank; one rank with chunks too",
          "[pp]") {
  auto world = comm::MpiProcessGroup::world();
  const int p = world->size(), r = world->rank();
  const nn::GPTConfig c = config(2 * p);
  nn::GPT model(c);
  // Rank 0 runs 4 micro-batches, the others 2: unchecked, sends and receives of different
  // micro-batches would pair up (a truncated message, or a deadlock).
  if (p > 1)
    REQUIRE_THROWS_WITH(pp::PipelineExecutor(model, pp::make_schedule("1f1b", p, r == 0 ? 4 : 2), world),
                        Catch::Contains(r == 0 ? "rank 1 of the pipeline group runs another schedule"
                                               : "rank 0 of the pipeline group runs another schedule"));
  // Interleaving on one rank would send a chunk's activations to this rank.
  auto self = world->split(r, 0);
  nn::GPT solo(c);
  REQUIRE_THROWS_WITH(pp::PipelineExecutor(solo, pp::make_schedule("interleaved", 1, 2, 2), self),
                      Catch::Contains("interleaved with 2 chunks on one rank"));
}
