// Fused scaled-dot-product attention. The node saves q, k, v, the output and one log-sum-exp per
// query row; the T x T probabilities are rebuilt in backward, never stored.
#include <cmath>

#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  SG_CHECK(q.dim() == 4, "attention: q must be [B, H, T, D], got ", shape_str(q.shape()));
  SG_CHECK(k.shape() == q.shape() && v.shape() == q.shape(), "attention: q ", shape_str(q.shape()), ", k ",
           shape_str(k.shape()), " and v ", shape_str(v.shape()), " must have the same shape");
  SG_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(), "attention: q, k, v dtypes differ");
  detail::check_floating("attention", q);
  kernels::AttentionArgs a;
  a.B = q.size(0);
  a.H = q.size(1);
  a.T = q.size(2);
  a.D = q.size(3);
  a.causal = causal;
  a.scale = scale > 0 ? scale : 1.0 / std::sqrt(double(a.D));
  Tensor Q, K, V, out, lse;
  {
    autograd::NoGradGuard ng;
    Q = detail::operand(q);
    K = detail::operand(k);
    V = detail::operand(v);
    a.dtype = Q.dtype();
    out = empty(Q.shape(), Q.dtype(), Q.device());
    lse = empty({a.B, a.H, a.T}, kernels::stats_dtype(Q.dtype()), Q.device());
    a.q = Q.data_ptr();
    a.k = K.data_ptr();
    a.v = V.data_ptr();
    a.out = out.data_ptr();
    a.lse = lse.data_ptr();
    SG_KERNEL(Q.device(), attention)(a);
  }
  Tensor result = detail::narrow_result(out, q.dtype());
  if (needs_grad({q, k, v})) {
    Q = detach(Q);
    K = detach(K);
    V = detach(V);
    Tensor O = detach(out);
    DType want = q.dtype();
    record("attention", {q, k, v}, {result}, [a, Q, K, V, O, lse, want](const TensorList& g) mutable {
      Tensor G = detail::operand(g[0]);
      Tensor dq = empty(Q.shape(), Q.dtype(), Q.device()), dk = empty(Q.shape(), Q.dtype(), Q.device()),
             dv = empty(Q.shape(), Q.dtype(), Q.device());
      a.q = Q.data_ptr();
      a.k = K.data_ptr();
      a.v = V.data_ptr();
      a.out = O.data_ptr();
      a.lse = lse.data_ptr();
      a.dout = G.data_ptr();
      a.dq = dq.data_ptr();
      a.dk = dk.data_ptr();
      a.dv = dv.data_ptr();
      SG_KERNEL(Q.device(), attention_backward)(a);
      return TensorList{detail::narrow_result(dq, want), detail::narrow_result(dk, want), detail::narrow_result(dv, want)};
    });
  }
  return result;
}

}  // namespace sg
