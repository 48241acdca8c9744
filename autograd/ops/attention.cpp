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

namespace {
// Points q, k, v at the three parts (q, k, v or their gradients) of a packed [B, T, 3C] buffer.
template <class P>
void packed_parts(const Tensor& packed, P& q, P& k, P& v) {
  char* p = static_cast<char*>(packed.data_ptr());
  const int64_t part = packed.size(2) / 3 * int64_t(dtype_size(packed.dtype()));
  q = p, k = p + part, v = p + 2 * part;
}
}  // namespace

Tensor attention_qkv(const Tensor& qkv, int64_t n_head, bool causal, double scale) {
  SG_CHECK(qkv.dim() == 3 && n_head > 0 && qkv.size(2) % (3 * n_head) == 0, "attention_qkv: qkv must be [B, T, 3C] ",
           "with C a multiple of ", n_head, " heads, got ", shape_str(qkv.shape()));
  detail::check_floating("attention_qkv", qkv);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, H = n_head, D = C / H;
  kernels::AttentionArgs a;
  a.B = B, a.H = H, a.T = T, a.D = D;
  a.causal = causal;
  a.scale = scale > 0 ? scale : 1.0 / std::sqrt(double(D));
  // [B, T, 3, H, D] read as three [B, H, T, D] tensors; y written as [B, T, H, D].
  a.q_strides[0] = T * 3 * C, a.q_strides[1] = D, a.q_strides[2] = 3 * C;
  a.o_strides[0] = T * C, a.o_strides[1] = D, a.o_strides[2] = C;
  Tensor X, out, lse;
  {
    autograd::NoGradGuard ng;
    X = detail::operand(qkv);
    a.dtype = X.dtype();
    out = empty({B, T, C}, X.dtype(), X.device());
    lse = empty({B, H, T}, kernels::stats_dtype(X.dtype()), X.device());
    packed_parts(X, a.q, a.k, a.v);
    a.out = out.data_ptr();
    a.lse = lse.data_ptr();
    SG_KERNEL(X.device(), attention)(a);
  }
  Tensor result = detail::narrow_result(out, qkv.dtype());
  if (needs_grad({qkv})) {
    X = detach(X);
    Tensor O = detach(out);
    const DType want = qkv.dtype();
    record("attention_qkv", {qkv}, {result}, [a, X, O, lse, want](const TensorList& g) mutable {
      Tensor G = detail::operand(g[0]);
      Tensor dqkv = empty(X.shape(), X.dtype(), X.device());  // every element written: q, k, v parts
      packed_parts(X, a.q, a.k, a.v);
      packed_parts(dqkv, a.dq, a.dk, a.dv);
      a.out = O.data_ptr();
      a.lse = lse.data_ptr();
      a.dout = G.data_ptr();
      SG_KERNEL(X.device(), attention_backward)(a);
      return TensorList{detail::narrow_result(dqkv, want)};
    });
  }
  return result;
}

}  // namespace sg
