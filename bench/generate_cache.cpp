// Sampling with and without the KV cache (what `shardgrad generate` does, greedy): the reference
// runs forward() over the whole window for every new token, as generate did before
// GPT::forward_cached; the variant runs the prompt once and then one position per token. Both
// must pick the same tokens; the times are per sampled token.
//
//   ./build/bench/sg_bench_generate_cache [preset] [prompt tokens] [new tokens]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/gpt.h"

using namespace sg;

namespace {
int64_t argmax_last(const Tensor& logits, int64_t vocab) {
  std::vector<float> last = to_vector<float>(narrow(logits, 1, logits.size(1) - 1, 1));
  return std::max_element(last.begin(), last.begin() + vocab) - last.begin();
}
}  // namespace

int main(int argc, char** argv) {
  const std::string preset = argc > 1 ? argv[1] : "gpt2";
  const int64_t prompt = argc > 2 ? std::atoll(argv[2]) : 16, steps = argc > 3 ? std::atoll(argv[3]) : 128;
  nn::GPT model(nn::gpt_preset(preset));
  model.init_weights(1);
  const int64_t V = model.config.vocab_size;
  SG_CHECK(prompt + steps <= model.config.block_size, "generate_cache: ", prompt + steps, " positions exceed ",
           model.config.block_size);
  std::vector<int64_t> start;
  for (int64_t i = 0; i < prompt; ++i) start.push_back((i * 7919 + 11) % V);
  autograd::NoGradGuard ng;
  using clock = std::chrono::steady_clock;

  std::vector<int64_t> ref = start;
  const auto t0 = clock::now();
  for (int64_t s = 0; s < steps; ++s)
    ref.push_back(argmax_last(model.forward(from_vector(ref, {1, int64_t(ref.size())})), V));
  const auto t1 = clock::now();

  std::vector<int64_t> cached = start;
  nn::KVCache cache;
  const auto t2 = clock::now();
  Tensor logits = model.forward_cached(from_vector(cached, {1, prompt}), cache);
  for (int64_t s = 0; s < steps; ++s) {
    cached.push_back(argmax_last(logits, V));
    if (s + 1 < steps) logits = model.forward_cached(from_vector(std::vector<int64_t>{cached.back()}, {1, 1}), cache);
  }
  const auto t3 = clock::now();

  auto ms_per_token = [&](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count() / double(steps);
  };
  std::printf("{\"model\": \"%s\", \"prompt\": %lld, \"new_tokens\": %lld, \"same_tokens\": %s, "
              "\"ms_per_token_window\": %.1f, \"ms_per_token_cached\": %.1f}\n",
              preset.c_str(), (long long)prompt, (long long)steps, ref == cached ? "true" : "false",
              ms_per_token(t0, t1), ms_per_token(t2, t3));
  return ref == cached ? 0 : 1;
}
