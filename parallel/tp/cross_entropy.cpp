// Vocabulary-parallel cross-entropy (Megatron's _VocabParallelCrossEntropy): every quantity that
// needs the whole vocabulary is a per-row scalar, so three all-reduces of [rows] replace a
// gather of [rows, V] logits.
#include <algorithm>
#include <limits>

#include "autograd/tape.h"
#include "kernels/ops.h"
#include "parallel/tp/layers.h"

namespace sg::parallel::tp {

namespace {
// In place over a contiguous [rows, cols] tensor, one pass each, so that the logits-sized
// temporaries do not pile up (each costs rows·V/p·4 bytes: 412 MB for GPT-2 at 4 × 1024 rows, tp 2).
void exp_(const Tensor& t) { SG_KERNEL(t.device(), unary)(kernels::Unary::exp, t.dtype(), t.data_ptr(), t.data_ptr(), t.numel(), 0); }
// t[r, c] op= v[r] (per_row) or v[c]
void broadcast_(kernels::Binary op, const Tensor& t, const Tensor& v, bool per_row) {
  SG_CHECK(t.is_contiguous() && v.is_contiguous() && v.numel() == t.size(per_row ? 0 : 1) && v.dtype() == t.dtype(),
           "vocab_parallel_cross_entropy: ", t.describe(), " and ", v.describe(), " do not line up");
  SG_KERNEL(t.device(), binary)(op, t.dtype(), t.data_ptr(), t.data_ptr(), {t.size(1), 1}, v.data_ptr(),
                                per_row ? kernels::Dims{1, 0} : kernels::Dims{0, 1}, {t.size(0), t.size(1)});
}
}  // namespace

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start,
                                    comm::ProcessGroup& group, const CrossEntropyOptions& opt) {
  SG_CHECK(is_floating(logits.dtype()), "vocab_parallel_cross_entropy: expected floating logits, got ",
           logits.describe());
  const int64_t rows = check_class_targets("vocab_parallel_cross_entropy", logits, targets), Vl = logits.size(-1);
  const int64_t V = opt.vocab < 0 ? Vl * group.size() : opt.vocab;
  // A target no rank's slice holds would count with no logit: a loss of log-sum-exp alone.
  SG_CHECK(V >= 1 && V <= Vl * group.size(), "vocab_parallel_cross_entropy: vocab ", V, " is outside the ",
           Vl * group.size(), " columns of the ", group.size(), " slices of ", Vl, " (1..", Vl * group.size(), ")");
  SG_CHECK(vocab_start >= 0 && vocab_start == group.rank() * Vl, "vocab_parallel_cross_entropy: vocab_start ",
           vocab_start, " is not this rank's first column (rank ", group.rank(), " x ", Vl, " = ", group.rank() * Vl, ")");
  // This rank's columns that are real vocabulary (the padded tail never counts).
  const int64_t valid = std::clamp<int64_t>(V - vocab_start, 0, Vl);

  // Per row: where its target sits in this slice (flat index into [rows * Vl]), if it does.
  std::vector<int64_t> tg = to_vector<int64_t>(targets), flat(size_t(rows), 0);
  std::vector<double> here(size_t(rows), 0.0), counted(size_t(rows), 0.0);
  int64_t n_counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = tg[size_t(r)];
    if (t == opt.ignore_index) continue;
    SG_CHECK(t >= 0 && t < V, "vocab_parallel_cross_entropy: target ", t, " outside the vocabulary [0, ", V, ")");
    counted[size_t(r)] = 1.0;
    ++n_counted;
    if (t >= vocab_start && t < vocab_start + valid) {
      flat[size_t(r)] = r * Vl + (t - vocab_start);
      here[size_t(r)] = 1.0;
    }
  }
  const double factor = opt.sum ? opt.scale : (n_counted > 0 ? opt.scale / double(n_counted) : 0.0);

  Tensor X, m, S, loss, flat_t, here_t;
  {
    autograd::NoGradGuard ng;
    X = contiguous(reshape(logits, {rows, Vl}));
    if (is_half(X.dtype())) X = to(X, DType::f32);
    const DType dt = X.dtype();
    const Device dev = X.device();
    Tensor Xv = narrow(X, 1, 0, valid);
    m = valid > 0 ? contiguous(amax(Xv, 1)) : full({rows}, std::numeric_limits<float>::lowest(), dt, dev);
    group.all_reduce(m, comm::ReduceOp::max, comm::Sync::blocking);
    if (valid > 0) {
      Tensor E = sub(Xv, unsqueeze(m, 1));  // the one [rows, valid] temporary: exp'd in place, summed, freed
      exp_(E);
      S = contiguous(sum(E, {1}));
    } else {
      S = zeros({rows}, dt, dev);
    }
    group.all_reduce(S, comm::ReduceOp::sum, comm::Sync::blocking);
    flat_t = from_vector(flat, {rows}, dev);
    here_t = to(from_vector(here, {rows}, dev), dt);
    Tensor xt = contiguous(mul(reshape(embedding(reshape(X, {rows * Vl, 1}), flat_t), {rows}), here_t));
    group.all_reduce(xt, comm::ReduceOp::sum, comm::Sync::blocking);
    Tensor counted_t = to(from_vector(counted, {rows}, dev), dt);
    Tensor per_row = mul(sub(add(log(S), m), xt), counted_t);
    loss = mul(sum(per_row), factor);  // in the compute dtype (f32 for half logits), as cross_entropy
  }
  if (autograd::needs_grad({logits})) {
    Tensor kx = autograd::detach(X);
    Tensor counted_t = from_vector(counted, {rows}, X.device());
    Shape shape = logits.shape();
    DType want = logits.dtype();
    autograd::record("vocab_parallel_cross_entropy", {logits}, {loss},
                     [kx, m, S, flat_t, here_t, counted_t, rows, Vl, valid, factor, shape, want](const autograd::TensorList& g) {
      // dloss_row = upstream * factor for counted rows; dx = (softmax - onehot) * dloss_row.
      Tensor d = contiguous(mul(to(counted_t, kx.dtype()), mul(to(g[0], kx.dtype()), factor)));  // on the device: no item()
      // dx = exp(x - m) / S * d, computed in one buffer: the saved logits themselves when nothing
      // else holds them (a fresh f32 copy of half logits, the model's case), else one copy. The
      // same operations in the same order as the composed ops they replace: the same bits.
      Tensor dx = autograd::sole_owner(kx) ? kx : clone(kx);
      broadcast_(kernels::Binary::sub, dx, m, true);
      exp_(dx);
      broadcast_(kernels::Binary::div, dx, S, true);
      broadcast_(kernels::Binary::mul, dx, d, true);
      if (valid < Vl) {  // padded columns: no probability, no gradient
        std::vector<double> real(size_t(Vl), 0.0);
        std::fill(real.begin(), real.begin() + valid, 1.0);
        broadcast_(kernels::Binary::mul, dx, to(from_vector(real, {Vl}, dx.device()), dx.dtype()), false);
      }
      Tensor minus_d = contiguous(unsqueeze(neg(mul(d, here_t)), 1));  // [rows, 1]
      // dx[r, t_r] -= dloss_row: a scatter-add of one value per row (+= into dx)
      SG_KERNEL(dx.device(), embedding_backward)(dx.dtype(), flat_t.dtype(), dx.data_ptr(), minus_d.data_ptr(),
                                                flat_t.data_ptr(), rows, 1, dx.numel());
      return autograd::TensorList{to(reshape(dx, shape), want)};
    });
  }
  return loss;
}

}  // namespace sg::parallel::tp
