// Normalisation ops: LayerNorm (nodes save x, mean, rstd) and RMSNorm (x, rstd).
#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

Tensor layernorm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  detail::check_floating("layernorm", x);
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  SG_CHECK(w.dim() == 1 && w.size(0) == C, "layernorm: weight ", shape_str(w.shape()), " does not match input ",
           shape_str(x.shape()));
  SG_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == C), "layernorm: bias ", shape_str(b.shape()),
           " does not match input ", shape_str(x.shape()));
  Tensor y, X, W, mean, rstd;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(x);
    W = detail::operand(w);
    Tensor B = b.defined() ? detail::operand(b) : Tensor();
    y = empty(X.shape(), X.dtype(), X.device());
    mean = empty({rows}, X.dtype(), X.device());
    rstd = empty({rows}, X.dtype(), X.device());
    SG_KERNEL(x.device(), layernorm)(X.dtype(), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), X.data_ptr(),
                                     W.data_ptr(), B.defined() ? B.data_ptr() : nullptr, rows, C, eps);
    y = detail::narrow_result(y, x.dtype());
  }
  if (needs_grad({x, w, b})) {
    DType want = x.dtype();
    bool has_b = b.defined();
    record("layernorm", {x, w, b}, {y}, [X, W, mean, rstd, rows, C, want, has_b](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      Tensor dx = empty(X.shape(), X.dtype(), X.device()), dw = empty({C}, X.dtype(), X.device());
      Tensor db = has_b ? empty({C}, X.dtype(), X.device()) : Tensor();
      SG_KERNEL(X.device(), layernorm_backward)(X.dtype(), dx.data_ptr(), dw.data_ptr(), has_b ? db.data_ptr() : nullptr,
                                                G.data_ptr(), X.data_ptr(), W.data_ptr(), mean.data_ptr(),
                                                rstd.data_ptr(), rows, C);
      return TensorList{detail::narrow_result(dx, want), detail::narrow_result(dw, want),
                        has_b ? detail::narrow_result(db, want) : Tensor()};
    });
  }
  return y;
}

Tensor rmsnorm(const Tensor& x, const Tensor& w, double eps) {
  detail::check_floating("rmsnorm", x);
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  SG_CHECK(w.dim() == 1 && w.size(0) == C, "rmsnorm: weight ", shape_str(w.shape()), " does not match input ",
           shape_str(x.shape()));
  Tensor y, X, W, rstd;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(x);
    W = detail::operand(w);
    y = empty(X.shape(), X.dtype(), X.device());
    rstd = empty({rows}, X.dtype(), X.device());
    SG_KERNEL(x.device(), rmsnorm)(X.dtype(), y.data_ptr(), rstd.data_ptr(), X.data_ptr(), W.data_ptr(), rows, C, eps);
    y = detail::narrow_result(y, x.dtype());
  }
  if (needs_grad({x, w})) {
    DType want = x.dtype();
    record("rmsnorm", {x, w}, {y}, [X, W, rstd, rows, C, want](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      Tensor dx = empty(X.shape(), X.dtype(), X.device()), dw = empty({C}, X.dtype(), X.device());
      SG_KERNEL(X.device(), rmsnorm_backward)(X.dtype(), dx.data_ptr(), dw.data_ptr(), G.data_ptr(), X.data_ptr(),
                                              W.data_ptr(), rstd.data_ptr(), rows, C);
      return TensorList{detail::narrow_result(dx, want), detail::narrow_result(dw, want)};
    });
  }
  return y;
}

}  // namespace sg
