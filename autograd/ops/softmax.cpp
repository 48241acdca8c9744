// Softmax family: softmax, log-softmax, and the fused softmax-cross-entropy whose node saves only
// the logits handle and one log-sum-exp per row, and writes the logits' gradient over them when
// no other tensor can see them.
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

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& opt) {
  detail::check_floating("cross_entropy", logits);
  SG_CHECK(targets.dtype() == DType::i32 || targets.dtype() == DType::i64, "cross_entropy: targets must be i32/i64, got ",
           targets.describe());
  const int64_t Vp = logits.size(-1), rows = logits.numel() / std::max<int64_t>(Vp, 1);
  const int64_t V = opt.vocab < 0 ? Vp : opt.vocab;
  SG_CHECK(V >= 1 && V <= Vp, "cross_entropy: vocab ", V, " exceeds the ", Vp, " logit columns");
  SG_CHECK(targets.numel() == rows, "cross_entropy: logits ", shape_str(logits.shape()), " give ", rows,
           " rows but targets ", shape_str(targets.shape()), " has ", targets.numel());
  detail::check_same_device("cross_entropy", logits, targets);
  // mean: divide by the number of counted targets (as PyTorch's reduction='mean' with ignore_index)
  double factor = opt.scale;
  if (!opt.sum) {
    int64_t n = count_targets(targets, opt.ignore_index);
    factor = n > 0 ? opt.scale / double(n) : 0.0;
  }
  Tensor loss;
  Tensor X, tg = contiguous(targets), lse;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(logits);
    // Per-row losses and lse in f32 for bf16/f16 logits (kernels::stats_dtype): the loss is f32 as
    // under autocast (a loss scaled for fp16, x 65536, would overflow at 65504 in f16).
    const DType st = kernels::stats_dtype(X.dtype());
    Tensor per_row = empty({rows}, st, X.device());
    lse = empty({rows}, st, X.device());
    SG_KERNEL(X.device(), cross_entropy)(X.dtype(), tg.dtype(), per_row.data_ptr(), lse.data_ptr(), X.data_ptr(),
                                         tg.data_ptr(), rows, Vp, V, opt.ignore_index);
    loss = mul(sum(per_row), factor);
  }
  if (needs_grad({logits})) {
    Tensor kx = detach(X);
    const int64_t ignore = opt.ignore_index;
    Shape shape = logits.shape();
    DType want = logits.dtype();
    record("cross_entropy", {logits}, {loss}, [kx, tg, lse, rows, Vp, V, ignore, factor, shape, want](const TensorList& g) {
      // dloss per row = upstream scalar * factor
      // on the device, not through item(): reading the scalar would drain the GPU's queue here
      Tensor d = contiguous(expand(reshape(mul(to(g[0], lse.dtype()), factor), {1}), {rows}));
      // In place over the logits when nothing else holds them (the usual case: a model's head
      // hands them straight to the loss): a logits-sized buffer less at the backward's peak.
      Tensor dx = autograd::sole_owner(kx) ? kx : empty(shape, kx.dtype(), kx.device());
      SG_KERNEL(kx.device(), cross_entropy_backward)(kx.dtype(), tg.dtype(), dx.data_ptr(), d.data_ptr(), kx.data_ptr(),
                                                     lse.data_ptr(), tg.data_ptr(), rows, Vp, V, ignore);
      return TensorList{detail::narrow_result(dx, want)};
    });
  }
  return loss;
}

}  // namespace sg
