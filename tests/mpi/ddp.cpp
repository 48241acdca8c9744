// DDP under mpirun: the same losses as one process with the same global batch, the ring
// all-reduce volume per step, bucket order, and unused-parameter handling.
#include "tests/catch.h"
#include <cmath>
#include <map>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/gpt.h"
#include "tests/mpi/mpi_support.h"
#include "tests/support.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/ddp.h"

using namespace sg;

namespace {

nn::GPTConfig tiny() { return testing::tiny_gpt(); }

constexpr int64_t kB = 8, kT = 8;

void batch(int64_t step, Tensor& idx, Tensor& tgt) { testing::token_batch(step, kB, kT, idx, tgt); }

using Grads = std::map<std::string, std::vector<float>>;

// Trains for `steps`; with a group, this rank takes its rows and DDP averages gradients. norms:
// each step's global gradient norm; first_grads: every parameter's gradient at the first step,
// as the optimizer sees it.
std::vector<double> train(int steps, int64_t micro, std::shared_ptr<comm::ProcessGroup> group, int64_t* bytes_per_step = nullptr,
                          std::vector<double>* norms = nullptr, Grads* first_grads = nullptr) {
  nn::GPT model(tiny());
  model.init_weights(5);
  optim::AdamWConfig oc;
  oc.weight_decay = 0.1;
  optim::AdamW opt(model.named_parameters(), oc);
  const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  if (group) {
    parallel::DdpOptions o;
    o.bucket_bytes = 4096;  // several buckets even for this model
    ddp = std::make_unique<parallel::DistributedDataParallel>(model.named_parameters(), group, o);
    ddp->broadcast_parameters();
  }
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    if (group) group->reset_counters();
    double loss = testing::backward_rank_rows(model, idx, tgt, rank, world, micro, [&](int64_t, bool last) { if (ddp) ddp->set_sync(last); });
    if (ddp) {
      ddp->finish_gradients();
      if (bytes_per_step) *bytes_per_step = group->counters()[comm::CommKind::all_reduce].bytes;
      loss = testing::sum_over(*group, loss);
    }
    double norm = optim::global_grad_norm(model.parameters());
    if (norms) norms->push_back(norm);
    if (first_grads && s == 0)
      for (auto& [n, p] : model.named_parameters()) (*first_grads)[n] = to_vector<float>(p.grad());
    opt.step(1e-2, optim::clip_coefficient(norm, 1.0));
    model.zero_grad();
    losses.push_back(loss);
  }
  return losses;
}

using testing::world;

}  // namespace

TEST_CASE("ddp reproduces the single-process losses for 20 steps, with and without accumulation", "[ddp]") {
  auto w = world();
  const std::vector<double> reference = train(20, kB, nullptr);
  for (int64_t micro : {kB / w->size(), int64_t(1)}) {
    INFO("micro-batch " << micro << " on " << w->size() << " ranks");
    std::vector<double> got = train(20, micro, w);
    testing::require_same_losses(got, reference);
  }
}

// AdamW divides a gradient by its own running scale, so losses alone would not see a gradient
// summed instead of averaged (or counted twice): the norms and the gradients themselves must be
// the single process's.
TEST_CASE("ddp's averaged gradients and their norms are the single process's, with and without accumulation", "[ddp]") {
  auto w = world();
  std::vector<double> ref_norms;
  Grads ref_grads;
  train(5, kB, nullptr, nullptr, &ref_norms, &ref_grads);
  for (int64_t micro : {kB / w->size(), int64_t(1)}) {
    INFO("micro-batch " << micro << " on " << w->size() << " ranks");
    std::vector<double> norms;
    Grads grads;
    train(5, micro, w, nullptr, &norms, &grads);
    REQUIRE(norms.size() == ref_norms.size());
    for (size_t i = 0; i < norms.size(); ++i) REQUIRE(std::abs(norms[i] - ref_norms[i]) <= 1e-5 * ref_norms[i]);
    REQUIRE(grads.size() == ref_grads.size());
    testing::require_same_gradients(grads, ref_grads);
  }
}

TEST_CASE("ddp moves the ring all-reduce volume 2(n-1)/n * 4 bytes * Psi per step", "[ddp]") {
  auto w = world();
  int64_t bytes = 0;
  train(1, 1, w, &bytes);  // accumulation over micro-batches: still one all-reduce per bucket
  const int64_t psi = tiny().num_params();
  const int n = w->size();
  REQUIRE(bytes == 2 * (n - 1) * psi * 4 / n);
}

TEST_CASE("ddp buckets follow reverse registration order and name parameters that got no gradient", "[ddp]") {
  auto w = world();
  nn::GPT model(tiny());
  model.init_weights(1);
  parallel::DdpOptions o;
  o.bucket_bytes = 1 << 30;
  parallel::DistributedDataParallel one(model.named_parameters(), w, o);
  REQUIRE(one.num_buckets() == 1);
  REQUIRE(one.bucket_names(0).front() == "ln_f.bias");
  REQUIRE(one.bucket_names(0).back() == "wte.weight");

  nn::GPT m2(tiny());
  m2.init_weights(1);
  parallel::DistributedDataParallel ddp(m2.named_parameters(), w, parallel::DdpOptions{});
  autograd::Tape tape;
  Tensor loss;
  {
    autograd::TapeScope sc(tape);
    loss = sum(m2.wte->forward(from_vector<int64_t>({1, 2}, {1, 2})));  // only wte is used
  }
  tape.backward(loss);
  REQUIRE_THROWS_WITH(ddp.finish_gradients(), Catch::Contains("received no gradient") && Catch::Contains("h.0.ln_1.weight"));
}

// A backward through wte only (the others get no gradient), or through the whole model.
Tensor partial_or_whole(nn::GPT& m, bool whole, autograd::Tape& tape) {
  autograd::TapeScope sc(tape);
  Tensor idx, tgt;
  testing::token_batch(0, 2, kT, idx, tgt);
  return whole ? m.loss(idx, tgt) : sum(m.wte->forward(idx));
}

TEST_CASE("ddp refuses a second synchronised backward and a finish without one, and starts clean after an error",
          "[ddp]") {
  auto w = world();
  nn::GPT m(tiny());
  m.init_weights(1);
  parallel::DistributedDataParallel ddp(m.named_parameters(), w, parallel::DdpOptions{});
  // What a clean step gives: the reference for the steps after each error.
  auto step = [&](bool whole) {
    autograd::Tape tape;
    tape.backward(partial_or_whole(m, whole, tape));
  };
  step(true);
  ddp.finish_gradients();
  const std::vector<float> want = to_vector<float>(m.h[0]->ln_1->weight.grad());
  REQUIRE_THROWS_WITH(ddp.finish_gradients(), Catch::Contains("finish_gradients was already called"));
  m.zero_grad();
  // Two backwards with sync on: PyTorch's "mark a variable ready only once".
  step(true);
  REQUIRE_THROWS_WITH(step(true), Catch::Contains("got a second gradient before finish_gradients") &&
                                      Catch::Contains("set_sync(false)"));
  step(true);  // no zero_grad: the error dropped the step's gradients
  ddp.finish_gradients();
  CHECK(to_vector<float>(m.h[0]->ln_1->weight.grad()) == want);
  m.zero_grad();
  // Parameters without a gradient: refused, and the next step is whole again.
  step(false);
  REQUIRE_THROWS_WITH(ddp.finish_gradients(), Catch::Contains("received no gradient"));
  step(true);
  ddp.finish_gradients();
  CHECK(to_vector<float>(m.h[0]->ln_1->weight.grad()) == want);
  m.zero_grad();
  // find_unused_parameters: an unused parameter's .grad stays undefined (AdamW then skips it).
  parallel::DdpOptions o;
  o.find_unused_parameters = true;
  nn::GPT m2(tiny());
  m2.init_weights(1);
  parallel::DistributedDataParallel tolerant(m2.named_parameters(), w, o);
  {
    autograd::Tape tape;
    tape.backward(partial_or_whole(m2, false, tape));
  }
  tolerant.finish_gradients();
  CHECK(m2.wte->weight.grad().defined());
  CHECK_FALSE(m2.h[0]->ln_1->weight.grad().defined());
  m2.zero_grad();
  // Used on rank 0 only: every rank gets the average (rank 0's gradient / n), as PyTorch's usage map.
  {
    autograd::Tape tape;
    tape.backward(partial_or_whole(m2, w->rank() == 0, tape));
  }
  tolerant.finish_gradients();
  REQUIRE(m2.h[0]->ln_1->weight.grad().defined());
  Tensor g = clone(m2.h[0]->ln_1->weight.grad());
  w->all_reduce(g, comm::ReduceOp::max)->wait();  // the same on every rank
  CHECK(to_vector<float>(g) == to_vector<float>(m2.h[0]->ln_1->weight.grad()));
}

// gradient_as_bucket_view: at launch a bucket takes its parameters' gradients (their own .grad
// freed), and once averaged its slots are the .grad tensors. A gradient is never held twice.
TEST_CASE("ddp holds each gradient once: in its tensor, then in its bucket, then as a view of the averaged bucket", "[ddp]") {
  auto w = world();
  nn::GPT model(tiny());
  model.init_weights(5);
  parallel::DdpOptions o;
  o.bucket_bytes = 4096;  // several buckets
  parallel::DistributedDataParallel ddp(model.named_parameters(), w, o);
  REQUIRE(ddp.num_buckets() > 1);
  const int64_t psi = tiny().num_params();
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    Tensor idx, tgt;
    batch(step, idx, tgt);
    Ledger::global().reset_peaks(Device::cpu());
    const MemStats before = Ledger::global().stats(Device::cpu());
    REQUIRE(before.cur(MemCategory::grad) == 0);
    REQUIRE(before.cur(MemCategory::comm_buffer) == 0);
    testing::backward_rank_rows(model, idx, tgt, w->rank(), w->size(), kB / w->size());
    ddp.finish_gradients();
    const MemStats after = Ledger::global().stats(Device::cpu());
    CHECK(after.cur(MemCategory::grad) == 4 * psi);       // the averaged buckets, now gradients
    CHECK(after.cur(MemCategory::comm_buffer) == 0);      // nothing left beside them
    CHECK(after.pk(MemCategory::grad) == 4 * psi);        // never the gradients and ...
    CHECK(after.pk(MemCategory::comm_buffer) <= 4 * psi);  // ... a second copy in buckets
    // the parameters of one bucket share its storage
    const auto names = ddp.bucket_names(0);
    REQUIRE(names.size() > 1);
    std::map<std::string, Tensor> params;
    for (auto& [n, p] : model.named_parameters()) params[n] = p;
    CHECK(params[names[0]].grad().storage() == params[names[1]].grad().storage());
    model.zero_grad();
  }
}
