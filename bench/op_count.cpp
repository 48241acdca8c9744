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
#include <string>
#include <type_traits>
#include <vector>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"
#include "models/gpt.h"
#include "optim/optim.h"

using namespace sg;

namespace {

std::map<std::string, long> g_calls;
const kernels::OpTable* g_real = nullptr;

// Forwards an entry of the real CPU table, counting the call under the entry's name.
template <auto Entry, class Fn>
struct Counted;
template <auto Entry, class R, class... A>
struct Counted<Entry, R (*)(A...)> {
  static const char* name;
  static R call(A... a) {
    ++g_calls[name];
    return (g_real->*Entry)(a...);
  }
};
template <auto Entry, class R, class... A>
const char* Counted<Entry, R (*)(A...)>::name = nullptr;

template <auto Entry>
void count(kernels::OpTable& t, const char* name) {
  using Fn = std::remove_reference_t<decltype(t.*Entry)>;
  if (!(g_real->*Entry)) return;
  Counted<Entry, Fn>::name = name;
  t.*Entry = &Counted<Entry, Fn>::call;
}

}  // namespace

int main() {
  g_real = &kernels::table(Device::cpu());
  static kernels::OpTable t = *g_real;
#define SG_COUNT(e) count<&kernels::OpTable::e>(t, #e)
  SG_COUNT(copy_strided), SG_COUNT(scatter_strided), SG_COUNT(fill), SG_COUNT(binary), SG_COUNT(unary);
  SG_COUNT(unary_backward), SG_COUNT(reduce), SG_COUNT(gemm), SG_COUNT(softmax), SG_COUNT(softmax_backward);
  SG_COUNT(layernorm), SG_COUNT(layernorm_backward), SG_COUNT(rmsnorm), SG_COUNT(rmsnorm_backward);
  SG_COUNT(embedding), SG_COUNT(embedding_backward), SG_COUNT(cross_entropy), SG_COUNT(cross_entropy_backward);
  SG_COUNT(cross_entropy_fused);
  SG_COUNT(dropout), SG_COUNT(attention), SG_COUNT(attention_backward), SG_COUNT(random), SG_COUNT(adamw);
  SG_COUNT(adamw_many), SG_COUNT(sum_squares_many), SG_COUNT(residual_layernorm);
  SG_COUNT(residual_layernorm_backward);
#undef SG_COUNT

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
  std::vector<std::pair<std::string, std::map<std::string, long>>> phases;
  auto phase = [&](const char* name) {
    phases.emplace_back(name, g_calls);
    g_calls.clear();
  };
  for (int step = 0; step < 2; ++step) {
    if (step == 1) kernels::register_table(DeviceType::cpu, &t);
    for (auto& p : model.parameters()) p.set_grad(Tensor());
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope scope(tape);
      loss = model.loss(idx, tgt);
    }
    if (step == 1) phase("forward");
    tape.backward(loss);
    if (step == 1) phase("backward");
    const double norm = optim::global_grad_norm(model.parameters());
    opt.step(6e-4, optim::clip_coefficient(norm, 1.0));
    if (step == 1) phase("norm and optimizer");
  }
  kernels::register_table(DeviceType::cpu, g_real);

  long total = 0;
  std::string out;
  for (const auto& [name, calls] : phases) {
    long sum = 0;
    std::string per;
    for (const auto& [entry, n] : calls) {
      sum += n;
      per += (per.empty() ? "" : ", ") + ("\"" + entry + "\": " + std::to_string(n));
    }
    total += sum;
    out += (out.empty() ? "" : ", ") + ("\"" + name + "\": {\"calls\": " + std::to_string(sum) + ", " + per + "}");
  }
  std::printf("{\"model\": \"gpt2\", \"op_table_calls_per_step\": %ld, %s}\n", total, out.c_str());
}
