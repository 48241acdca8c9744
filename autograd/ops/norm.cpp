// Normalisation ops: LayerNorm (nodes save x, mean, rstd) and RMSNorm (x, rstd). LayerNorm's
// backward adds the gradient its input gathered from other consumers (a transformer's residual
// stream feeds ln_1 and the residual add) in its own kernel.
#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

namespace {

// A norm's weight or bias is in the input's dtype and on its device (the kernels read them as such).
void check_param_like(const char* op, const char* what, const Tensor& x, const Tensor& p) {
  SG_CHECK(p.dtype() == x.dtype() && p.device() == x.device(), op, ": ", what, " ", p.describe(),
           " must have the input's dtype and device (", x.describe(), ")");
}

void check_layernorm_args(const char* op, const Tensor& x, const Tensor& w, const Tensor& b) {
  detail::check_floating(op, x);
  const int64_t C = x.size(-1);
  SG_CHECK(!w.defined() || (w.dim() == 1 && w.size(0) == C), op, ": weight ", shape_str(w.shape()),
           " does not match input ", shape_str(x.shape()));
  SG_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == C), op, ": bias ", shape_str(b.shape()),
           " does not match input ", shape_str(x.shape()));
  if (w.defined()) check_param_like(op, "weight", x, w);
  if (b.defined()) check_param_like(op, "bias", x, b);
}

// The forward of layernorm (residual undefined) or add_layernorm: runs the kernel, records the
// node, returns {r, y} (r undefined without a residual).
std::pair<Tensor, Tensor> layernorm_impl(const char* op, const Tensor& x, const Tensor& residual, const Tensor& w,
                                         const Tensor& b, double eps) {
  const bool fused = residual.defined();
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  Tensor r, y, X, W, mean, rstd;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(x);
    // no weight (PyTorch's elementwise_affine=False): the kernels' gain of one
    W = w.defined() ? detail::operand(w) : full({C}, 1.0, X.dtype(), X.device());
    Tensor B = detail::operand_if(b);
    const DType st = kernels::stats_dtype(X.dtype());
    y = empty(X.shape(), X.dtype(), X.device());
    mean = empty({rows}, st, X.device());
    rstd = empty({rows}, st, X.device());
    if (fused) {
      const Tensor Res = detail::operand(residual);
      r = empty(X.shape(), X.dtype(), X.device());
      SG_KERNEL(x.device(), residual_layernorm)(X.dtype(), r.data_ptr(), y.data_ptr(), mean.data_ptr(),
                                                rstd.data_ptr(), X.data_ptr(), Res.data_ptr(), W.data_ptr(),
                                                B.defined() ? B.data_ptr() : nullptr, rows, C, eps);
      X = r;  // the backward normalises the sum
    } else {
      SG_KERNEL(x.device(), layernorm)(X.dtype(), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), X.data_ptr(),
                                       W.data_ptr(), B.defined() ? B.data_ptr() : nullptr, rows, C, eps);
    }
    y = detail::narrow_result(y, x.dtype());
    if (fused) r = detail::narrow_result(r, x.dtype());
  }
  const TensorList inputs = fused ? TensorList{x, residual, w, b} : TensorList{x, w, b};
  if (needs_grad(inputs)) {
    const DType want = x.dtype();
    const bool has_b = b.defined(), has_w = w.defined();
    X = detach(X);
    auto backward = [X, W, mean, rstd, rows, C, want, has_b, has_w, fused](const TensorList& g) {
      // g: add_layernorm's {d r, d y}; layernorm's {d y, what x has gathered from its other
      // consumers} (the tape hands that over: absorb_edge). Either way the kernel adds the first
      // to the input gradient itself (residual_layernorm_backward's dr), over it when this node
      // alone holds it.
      const Tensor& g_y = g[fused ? 1 : 0];
      static const Tensor kNone;
      const Tensor& g_add = fused ? g[0] : g.size() > 1 ? g[1] : kNone;
      const bool over_g_add = detail::can_write_over(g_add, X.dtype());
      Tensor dx = over_g_add ? g_add : empty(X.shape(), X.dtype(), X.device());
      Tensor dw = empty({C}, X.dtype(), X.device()), db = has_b ? empty({C}, X.dtype(), X.device()) : Tensor();
      const Tensor G = g_y.defined() ? detail::operand(g_y) : zeros(X.shape(), X.dtype(), X.device());
      if (g_add.defined()) {
        const Tensor DR = over_g_add ? dx : detail::operand(g_add);
        SG_KERNEL(X.device(), residual_layernorm_backward)(
            X.dtype(), dx.data_ptr(), dw.data_ptr(), has_b ? db.data_ptr() : nullptr, DR.data_ptr(), G.data_ptr(),
            X.data_ptr(), W.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, C);
      } else {
        SG_KERNEL(X.device(), layernorm_backward)(X.dtype(), dx.data_ptr(), dw.data_ptr(),
                                                  has_b ? db.data_ptr() : nullptr, G.data_ptr(), X.data_ptr(),
                                                  W.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, C);
      }
      dx = detail::narrow_result(dx, want);
      Tensor dwn = has_w ? detail::narrow_result(dw, want) : Tensor(), dbn = has_b ? detail::narrow_result(db, want) : Tensor();
      return fused ? TensorList{dx, dx, dwn, dbn} : TensorList{dx, dwn, dbn};
    };
    if (fused) record(op, inputs, {r, y}, backward);
    else record(op, inputs, {y}, backward, /*absorb_edge=*/0);  // x
  }
  return {r, y};
}

}  // namespace

Tensor layernorm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  check_layernorm_args("layernorm", x, w, b);
  return layernorm_impl("layernorm", x, Tensor(), w, b, eps).second;
}

std::pair<Tensor, Tensor> add_layernorm(const Tensor& x, const Tensor& residual, const Tensor& w, const Tensor& b,
                                        double eps) {
  check_layernorm_args("add_layernorm", x, w, b);
  detail::check_same_device("add_layernorm", x, residual);
  SG_CHECK(residual.shape() == x.shape() && residual.dtype() == x.dtype(), "add_layernorm: residual ",
           residual.describe(), " must match the input ", x.describe());
  return layernorm_impl("add_layernorm", x, residual, w, b, eps);
}

Tensor rmsnorm(const Tensor& x, const Tensor& w, double eps) {
  detail::check_floating("rmsnorm", x);
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  SG_CHECK(w.dim() == 1 && w.size(0) == C, "rmsnorm: weight ", shape_str(w.shape()), " does not match input ",
           shape_str(x.shape()));
  check_param_like("rmsnorm", "weight", x, w);
  Tensor y, X, W, rstd;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(x);
    W = detail::operand(w);
    y = empty(X.shape(), X.dtype(), X.device());
    rstd = empty({rows}, kernels::stats_dtype(X.dtype()), X.device());
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
