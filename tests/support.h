// Shared by the tests: the small GPT configuration most strategy tests train.
#pragma once
#include <functional>
#include <vector>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"
#include "models/gpt.h"

namespace sg::testing {

// 2 layers, 2 heads, width 16, 8 positions, 23 tokens (padded to 64): fast, and irregular enough.
inline nn::GPTConfig tiny_gpt() {
  nn::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 23;
  return c;
}

// The CPU op table as `edit` leaves a copy of it, for the scope's life (the table registered
// before is put back, also when a failed REQUIRE leaves the scope).
struct ScopedCpuTable {
  const kernels::OpTable* real = &kernels::table(Device::cpu());
  kernels::OpTable t = *real;
  template <class Edit>
  explicit ScopedCpuTable(Edit&& edit) {
    edit(t);
    kernels::register_table(DeviceType::cpu, &t);
  }
  ~ScopedCpuTable() { kernels::register_table(DeviceType::cpu, real); }
  ScopedCpuTable(const ScopedCpuTable&) = delete;
  ScopedCpuTable& operator=(const ScopedCpuTable&) = delete;
};

// Loss of one batch, with every parameter's .grad set to this batch's gradient alone.
inline double loss_and_grads(nn::GPT& m, const Tensor& idx, const Tensor& tgt) {
  m.zero_grad();
  autograd::Tape tape;
  Tensor loss;
  {
    autograd::TapeScope s(tape);
    loss = m.loss(idx, tgt);
  }
  tape.backward(loss);
  return item(loss);
}

// Global batch `step` of a fixed token stream over 23 tokens (every rank sees the same batch),
// with some targets ignored, unevenly over the rows.
inline void token_batch(int64_t step, int64_t B, int64_t T, Tensor& idx, Tensor& tgt) {
  std::vector<int64_t> tok;
  for (float v : to_vector<float>(rand({B, T + 1}, 2024, uint64_t(step), 0, 23))) tok.push_back(int64_t(v));
  std::vector<int64_t> x, y;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      x.push_back(tok[size_t(b * (T + 1) + t)]);
      y.push_back((b * 7 + t * 3) % 11 == 0 ? -1 : tok[size_t(b * (T + 1) + t + 1)]);
    }
  idx = from_vector(x, {B, T});
  tgt = from_vector(y, {B, T});
}

// Forward + backward of this rank's rows in micro-batches, the loss of each scaled by
// world / counted so that averaging the ranks' gradients gives the global batch's mean; returns
// this rank's share of that mean. before_micro(m, last) runs first (no_sync switches).
inline double backward_rank_rows(const nn::GPT& model, const Tensor& idx, const Tensor& tgt, int rank, int world,
                                 int64_t micro, const std::function<void(int64_t, bool)>& before_micro = {}) {
  const double counted = double(count_targets(tgt, -1));
  const int64_t local = idx.size(0) / world, n_micro = local / micro;
  Tensor li = narrow(idx, 0, rank * local, local), lt = narrow(tgt, 0, rank * local, local);
  double loss = 0;
  for (int64_t m = 0; m < n_micro; ++m) {
    if (before_micro) before_micro(m, m == n_micro - 1);
    autograd::Tape tape;
    Tensor l;
    {
      autograd::TapeScope sc(tape);
      l = model.loss(narrow(li, 0, m * micro, micro), narrow(lt, 0, m * micro, micro), true, world / counted);
    }
    loss += item(l) / world;
    tape.backward(l);
  }
  return loss;
}

}  // namespace sg::testing
