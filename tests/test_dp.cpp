// DataParallel (one process, several devices): the single-process losses, and the ledger showing
// what piles up on the first device.
#include "tests/catch.h"
#include <map>
#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/gpt.h"
#include "tests/support.h"
#include "optim/optim.h"
#include "parallel/dp.h"
#include "tests/mpi/mpi_support.h"

using namespace sg;

namespace {

nn::GPTConfig tiny() { return testing::tiny_gpt(); }

void batch(int64_t step, Tensor& idx, Tensor& tgt) {
  std::vector<int64_t> x, y;
  for (float v : to_vector<float>(rand({8, 9}, 77, uint64_t(step), 0, 23))) x.push_back(int64_t(v));
  std::vector<int64_t> in, out;
  for (int64_t b = 0; b < 8; ++b)
    for (int64_t t = 0; t < 8; ++t) {
      in.push_back(x[size_t(b * 9 + t)]);
      out.push_back(t == 0 ? -1 : x[size_t(b * 9 + t + 1)]);
    }
  idx = from_vector(in, {8, 8});
  tgt = from_vector(out, {8, 8});
}

using Grads = std::map<std::string, std::vector<float>>;

// norms: each step's global gradient norm; first_grads: the gradients of the first step.
std::vector<double> train(int steps, const std::vector<Device>& devices, const nn::GPTConfig& config = tiny(),
                          std::vector<double>* norms = nullptr, Grads* first_grads = nullptr) {
  nn::GPT model(config, DType::f32, devices[0]);
  model.init_weights(9);
  optim::AdamW opt(model.named_parameters(), {});
  std::unique_ptr<parallel::DataParallel> dp;
  if (devices.size() > 1) dp = std::make_unique<parallel::DataParallel>(model, devices);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor idx, tgt;
    batch(s, idx, tgt);
    const double scale = 1.0 / double(count_targets(tgt, -1));
    double loss = 0;
    if (dp) {
      loss = dp->forward_backward(idx, tgt, scale);
    } else {
      autograd::Tape tape;
      Tensor l;
      {
        autograd::TapeScope sc(tape);
        l = model.loss(idx, tgt, true, scale);
      }
      loss = item(l);
      tape.backward(l);
    }
    const double norm = optim::global_grad_norm(model.parameters());
    if (norms) norms->push_back(norm);
    if (first_grads && s == 0)
      for (auto& [n, p] : model.named_parameters()) (*first_grads)[n] = to_vector<float>(p.grad());
    opt.step(1e-2, optim::clip_coefficient(norm, 1.0));
    model.zero_grad();
    losses.push_back(loss);
  }
  return losses;
}

}  // namespace

TEST_CASE("dp over cpu:0,cpu:1 reproduces the single-process losses for 20 steps", "[dp]") {
  auto ref = train(20, {Device::cpu(0)});
  auto got = train(20, {Device::cpu(0), Device::cpu(1)});
  for (size_t i = 0; i < ref.size(); ++i) {
    INFO("step " << i);
    REQUIRE(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
  }
}

// AdamW would hide a gradient summed over the replicas instead of averaged: the norms and the
// gradients on the first device must be the single device's.
TEST_CASE("dp over cpu:0,cpu:1 leaves the single-device gradients and norms on the first device", "[dp]") {
  std::vector<double> ref_norms, norms;
  Grads ref_grads, grads;
  train(3, {Device::cpu(0)}, tiny(), &ref_norms, &ref_grads);
  train(3, {Device::cpu(0), Device::cpu(1)}, tiny(), &norms, &grads);
  REQUIRE(norms.size() == ref_norms.size());
  for (size_t i = 0; i < norms.size(); ++i) REQUIRE(std::abs(norms[i] - ref_norms[i]) <= 1e-5 * ref_norms[i]);
  REQUIRE(grads.size() == ref_grads.size());
  testing::require_same_gradients(grads, ref_grads);
}

TEST_CASE("dp piles the gathered outputs and the reduced gradients onto the first device", "[dp]") {
  Device d0 = Device::cpu(2), d1 = Device::cpu(3);  // fresh ledger rows for this test
  Ledger::global().reset_peaks(d0);
  Ledger::global().reset_peaks(d1);
  nn::GPTConfig config = tiny();
  config.vocab_size = 2000;  // logits [8, 8, 2048] f32, 512 KiB: larger than the rest of a replica's activations
  train(1, {d0, d1}, config);
  MemStats s0 = Ledger::global().stats(d0), s1 = Ledger::global().stats(d1);
  const int64_t psi_bytes = config.num_params() * 4;
  REQUIRE(s1.pk(MemCategory::param) == psi_bytes);  // the per-step replica
  REQUIRE(s1.cur(MemCategory::param) == 0);         // freed after the step
  REQUIRE(s0.pk(MemCategory::param) == psi_bytes);  // the one real model
  REQUIRE(s0.pk(MemCategory::optim_state) == 2 * psi_bytes);
  REQUIRE(s1.pk(MemCategory::optim_state) == 0);
  // Device 0 holds its own half of the logits, both halves' copies and their concatenation when
  // the loss runs: at least half the logits more than device 1 ever holds (its half of the logits,
  // then its half of their gradient and its replica's backward).
  const int64_t logits = 8 * 8 * config.vocab_rows() * 4;
  REQUIRE(s0.pk(MemCategory::activation) >= s1.pk(MemCategory::activation) + logits / 2);
}
