// Softmax family: softmax, log-softmax, and the fused softmax-cross-entropy. When the logits are
// handed over, its forward writes their gradient over them (the fused classifier); otherwise its
// node saves the logits handle and one log-sum-exp per row, and the backward writes the gradient
// over the logits when no other tensor can see them by then.
#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

static Tensor softmax_impl(const Tensor& x, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  detail::check_floating(name, x);
  SG_CHECK(x.dim() >= 1, name, ": needs at least one dim");
  const int64_t cols = x.size(-1), rows = x.numel() / std::max<int64_t>(cols, 1);
  Tensor y;
  {
    autograd::NoGradGuard ng;
    Tensor X = detail::operand(x);
    y = empty(X.shape(), X.dtype(), X.device());
    SG_KERNEL(x.device(), softmax)(X.dtype(), y.data_ptr(), X.data_ptr(), rows, cols, log);
    y = detail::narrow_result(y, x.dtype());
  }
  if (needs_grad({x})) {
    Tensor ky = detach(y);
    record(name, {x}, {y}, [ky, rows, cols, log](const TensorList& g) {
      Tensor G = detail::operand(g[0]), Y = detail::operand(ky);
      Tensor dx = empty(G.shape(), G.dtype(), G.device());
      SG_KERNEL(G.device(), softmax_backward)(G.dtype(), dx.data_ptr(), G.data_ptr(), Y.data_ptr(), rows, cols, log);
      return TensorList{detail::narrow_result(dx, ky.dtype())};
    });
  }
  return y;
}

Tensor softmax(const Tensor& x) { return softmax_impl(x, false); }
Tensor log_softmax(const Tensor& x) { return softmax_impl(x, true); }

int64_t count_targets(const Tensor& targets, int64_t ignore_index) {
  int64_t n = 0;
  for (int64_t t : to_vector<int64_t>(targets)) n += t != ignore_index;
  return n;
}

int64_t check_class_targets(const char* op, const Tensor& logits, const Tensor& targets) {
  SG_CHECK(targets.dtype() == DType::i32 || targets.dtype() == DType::i64, op, ": targets must be i32/i64, got ",
           targets.describe());
  SG_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1, op, ": logits ", shape_str(logits.shape()),
           " have no class dim to take the loss over");
  const int64_t rows = logits.numel() / logits.size(-1);
  SG_CHECK(targets.numel() == rows, op, ": logits ", shape_str(logits.shape()), " give ", rows, " rows but targets ",
           shape_str(targets.shape()), " has ", targets.numel());
  const Shape leading(logits.shape().begin(), logits.shape().end() - 1);
  SG_CHECK(targets.shape() == leading || targets.dim() == 1, op, ": targets ", shape_str(targets.shape()),
           " are neither the logits' leading dims ", shape_str(leading), " nor flat [", rows, "]");
  return rows;
}

Tensor cross_entropy(Tensor logits, const Tensor& targets, const CrossEntropyOptions& opt) {
  detail::check_floating("cross_entropy", logits);
  const int64_t rows = check_class_targets("cross_entropy", logits, targets), Vp = logits.size(-1);
  const int64_t V = opt.vocab < 0 ? Vp : opt.vocab;
  SG_CHECK(V >= 1 && V <= Vp, "cross_entropy: vocab ", V, " is outside the ", Vp, " logit columns (1..", Vp, ")");
  detail::check_same_device("cross_entropy", logits, targets);
  // mean: divide by the number of counted targets (as PyTorch's reduction='mean' with ignore_index)
  double factor = opt.scale;
  if (!opt.sum) {
    int64_t n = count_targets(targets, opt.ignore_index);
    factor = n > 0 ? opt.scale / double(n) : 0.0;
  }
  const bool grad = needs_grad({logits});
  const int64_t ignore = opt.ignore_index;
  const Shape shape = logits.shape();
  const DType want = logits.dtype();
  Tensor loss, X, tg = contiguous(targets), lse;
  bool fused = false;
  {
    autograd::NoGradGuard ng;
    // The fused classifier: when the logits' bytes are this call's alone (handed over with
    // std::move, the model head's case, or a fresh contiguous/compute-dtype copy), the forward
    // writes their gradient over them in the same pass (for an upstream gradient of 1), and the
    // logits are read from memory once instead of twice.
    const bool handed_over = autograd::sole_owner(logits);
    X = detail::operand(logits);
    fused = grad && (handed_over || X.storage() != logits.storage());
    // Per-row losses and lse in f32 for bf16/f16 logits (kernels::stats_dtype): the loss is f32 as
    // under autocast (a loss scaled for fp16, x 65536, would overflow at 65504 in f16).
    const DType st = kernels::stats_dtype(X.dtype());
    Tensor per_row = empty({rows}, st, X.device());
    if (fused) {
      SG_KERNEL(X.device(), cross_entropy_fused)(X.dtype(), tg.dtype(), per_row.data_ptr(), X.data_ptr(),
                                                 X.data_ptr(), tg.data_ptr(), factor, rows, Vp, V, ignore);
    } else {
      lse = empty({rows}, st, X.device());
      SG_KERNEL(X.device(), cross_entropy)(X.dtype(), tg.dtype(), per_row.data_ptr(), lse.data_ptr(), X.data_ptr(),
                                           tg.data_ptr(), rows, Vp, V, ignore);
    }
    loss = mul(sum(per_row), factor);
  }
  if (!grad) return loss;
  Tensor kx = detach(X);
  if (fused) {
    // X now holds the gradient for an upstream 1: backward(loss)'s own seed hands it on as it is
    // (the same bits as the unfused path); any other upstream gradient scales it in f32.
    record("cross_entropy", {logits}, {loss}, [kx, want](const TensorList& g) {
      if (autograd::is_unit_seed(g[0])) return TensorList{detail::narrow_result(kx, want)};
      const DType st = kernels::stats_dtype(kx.dtype());
      return TensorList{detail::narrow_result(mul(to(kx, st), to(g[0], st)), want)};
    });
    return loss;
  }
  record("cross_entropy", {logits}, {loss}, [kx, tg, lse, rows, Vp, V, ignore, factor, shape, want](const TensorList& g) {
    // dloss per row = upstream scalar * factor
    // on the device, not through item(): reading the scalar would drain the GPU's queue here
    Tensor d = contiguous(expand(reshape(mul(to(g[0], lse.dtype()), factor), {1}), {rows}));
    // In place over the logits when nothing else holds them by now (the caller dropped its
    // handle after the forward): a logits-sized buffer less at the backward's peak.
    Tensor dx = autograd::sole_owner(kx) ? kx : empty(shape, kx.dtype(), kx.device());
    SG_KERNEL(kx.device(), cross_entropy_backward)(kx.dtype(), tg.dtype(), dx.data_ptr(), d.data_ptr(), kx.data_ptr(),
                                                   lse.data_ptr(), tg.data_ptr(), rows, Vp, V, ignore);
    return TensorList{detail::narrow_result(dx, want)};
  });
  return loss;
}

}  // namespace sg
