// Op-table calls in one training step of GPT-2's shape (12 layers, C = 768, H = 12; the counts do
// not depend on batch or sequence length, so the step runs at B = 1, T = 32 on the CPU, with
// block_size = T as training's T = 1024 = block_size has it): forward,
// loss, backward, global gradient norm, AdamW. On a GPU each call is one kernel launch or more
// (a LayerNorm backward is three), so this is the floor of a step's launch count, and what
// fusions remove shows here first. Prints one JSON object: the total and the calls per entry.
//
//   ./build/bench/sg_bench_op_count
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/profile.h"
#include "models/gpt.h"
#include "optim/optim.h"

using namespace sg;

int main() {
  const int64_t B = 1, T = 32;
  nn::GPTConfig c = nn::gpt_preset("gpt2");
  c.block_size = T;  // T = block_size, as in training at T = 1024: the positions are all of wpe
  nn::GPT model(c, DType::f32, Device::cpu());
  model.init_weights(1);
  for (auto& p : model.parameters()) p.set_requires_grad(true);
  optim::AdamW opt(model.named_parameters(), optim::AdamWConfig{});
  std::vector<int64_t> tokens(size_t(B * T + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int64_t(i * 7919 % size_t(c.vocab_size));
  Tensor idx = from_vector(std::vector<int64_t>(tokens.begin(), tokens.end() - 1), {B, T}),
         tgt = from_vector(std::vector<int64_t>(tokens.begin() + 1, tokens.end()), {B, T});

  // Two steps: the first creates the gradients and the optimizer's moments; the second is the one
  // every later step repeats, and the one counted.
  std::vector<std::pair<std::string, std::map<std::string, kernels::OpTime>>> phases;
  std::optional<kernels::OpProfiler> profiler;  // counts the calls by entry (kernels/profile.h)
  auto phase = [&](const char* name) {
    if (profiler) phases.emplace_back(name, profiler->take());
  };
  for (int step = 0; step < 2; ++step) {
    if (step == 1) profiler.emplace(Device::cpu());
    for (auto& p : model.parameters()) p.set_grad(Tensor());
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope scope(tape);
      loss = model.loss(idx, tgt);
    }
    phase("forward");
    tape.backward(loss);
    phase("backward");
    const double norm = optim::global_grad_norm(model.parameters());
    opt.step(6e-4, optim::clip_coefficient(norm, 1.0));
    phase("norm and optimizer");
  }
  profiler.reset();

  long total = 0;
  std::string out;
  for (const auto& [name, calls] : phases) {
    long sum = 0;
    std::string per;
    for (const auto& [entry, t] : calls) {
      sum += t.calls;
      per += (per.empty() ? "" : ", ") + ("\"" + entry + "\": " + std::to_string(t.calls));
    }
    total += sum;
    out += (out.empty() ? "" : ", ") + ("\"" + name + "\": {\"calls\": " + std::to_string(sum) + ", " + per + "}");
  }
  std::printf("{\"model\": \"gpt2\", \"op_table_calls_per_step\": %ld, %s}\n", total, out.c_str());
}
