// Matrix products: matmul (batched, broadcasting batch dims) and linear (x W^T + b), through the
// device's GEMM. Backward of C = A B: dA = dC B^T, dB = A^T dC (summed over broadcast batches).
#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

namespace {

// out[b] = op(A[b]) op(B[b]) (+ out when accumulate); A, B, out contiguous in the compute dtype.
// A is stored [batch, rows_a, cols_a] and B [batch, rows_b, cols_b]; a batch stride of 0 reuses one matrix.
void gemm_into(const Tensor& out, const Tensor& A, bool ta, const Tensor& B, bool tb, int64_t batch, int64_t M,
               int64_t N, int64_t K, int64_t stride_a, int64_t stride_b, bool accumulate = false) {
  kernels::GemmArgs g;
  g.dtype = out.dtype();
  g.trans_a = ta;
  g.trans_b = tb;
  g.M = M;
  g.N = N;
  g.K = K;
  g.A = A.data_ptr();
  g.lda = ta ? M : K;
  g.B = B.data_ptr();
  g.ldb = tb ? K : N;
  g.C = out.data_ptr();
  g.ldc = N;
  g.beta = accumulate ? 1.0 : 0.0;
  g.batch = batch;
  g.stride_a = stride_a;
  g.stride_b = stride_b;
  g.stride_c = M * N;
  SG_KERNEL(out.device(), gemm)(g);
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::check_same_device("matmul", a, b);
  SG_CHECK(a.dtype() == b.dtype(), "matmul: dtypes ", dtype_name(a.dtype()), " and ", dtype_name(b.dtype()), " differ");
  SG_CHECK(a.dim() >= 1 && b.dim() >= 2, "matmul: need a [..., M, K] and b [..., K, N], got ", shape_str(a.shape()),
           " and ", shape_str(b.shape()));
  const int64_t K = a.size(-1), N = b.size(-1);
  SG_CHECK(b.size(-2) == K, "matmul: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()),
           " do not chain (", K, " != ", b.size(-2), ")");
  Tensor out;
  if (b.dim() == 2) {
    // Fold all leading dims of a into M: one GEMM.
    autograd::NoGradGuard ng;
    Tensor A = detail::operand(a), B = detail::operand(b);
    const int64_t M = a.numel() / std::max<int64_t>(K, 1);
    Shape s = a.shape();
    s.back() = N;
    out = empty(s, A.dtype(), a.device());
    gemm_into(out, A, false, B, false, 1, M, N, K, 0, 0);
    out = detail::narrow_result(out, a.dtype());
  } else {
    SG_CHECK(a.dim() >= 2, "matmul: a must have at least 2 dims when b is batched");
    Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
    Shape batch = broadcast_shapes(ba, bb, "matmul");
    const int64_t M = a.size(-2);
    Shape sa = batch, sb = batch, so = batch;
    sa.insert(sa.end(), {M, K});
    sb.insert(sb.end(), {K, N});
    so.insert(so.end(), {M, N});
    autograd::NoGradGuard ng;
    Tensor A = detail::operand(expand(a, sa)), B = detail::operand(expand(b, sb));
    out = empty(so, A.dtype(), a.device());
    gemm_into(out, A, false, B, false, shape_numel(batch), M, N, K, M * K, K * N);
    out = detail::narrow_result(out, a.dtype());
  }
  if (needs_grad({a, b})) {
    Tensor ka = detach(a), kb = detach(b);
    bool ga = a.requires_grad(), gb = b.requires_grad();
    record("matmul", {a, b}, {out}, [ka, kb, ga, gb](const TensorList& g) {
      Tensor da, db;
      if (ga) da = sum_to(matmul(g[0], transpose(kb, -1, -2)), ka.shape());
      if (gb) {
        if (kb.dim() == 2) {
          Tensor a2 = reshape(ka, {-1, ka.size(-1)}), g2 = reshape(g[0], {-1, g[0].size(-1)});
          db = matmul(transpose(a2, 0, 1), g2);
        } else {
          db = sum_to(matmul(transpose(ka, -1, -2), g[0]), kb.shape());
        }
      }
      return TensorList{da, db};
    });
  }
  return out;
}

namespace {

// linear (gelu false) and linear_gelu: one GEMM with the bias (and GELU) in its epilogue. The GELU
// form saves the pre-activation, which its backward needs.
Tensor linear_impl(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, bool gelu) {
  detail::check_same_device(op, x, w);
  SG_CHECK(w.dim() == 2, op, ": weight must be [out, in], got ", shape_str(w.shape()));
  const int64_t in = w.size(1), outf = w.size(0);
  SG_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": input ", shape_str(x.shape()), " does not match weight ",
           shape_str(w.shape()), " (", x.size(-1), " != ", in, ")");
  SG_CHECK(x.dtype() == w.dtype(), op, ": input dtype ", dtype_name(x.dtype()), " but weight dtype ",
           dtype_name(w.dtype()));
  SG_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == outf), op, ": bias ", shape_str(b.shape()),
           " does not match ", outf, " outputs");
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1);
  Shape s = x.shape();
  s.back() = outf;
  const bool grad = needs_grad({x, w, b});  // asked before the guard below turns recording off
  Tensor out, pre;
  {
    autograd::NoGradGuard ng;
    Tensor X = detail::operand(x), W = detail::operand(w), B = b.defined() ? detail::operand(b) : Tensor();
    out = empty(s, X.dtype(), x.device());
    kernels::GemmArgs g;
    g.dtype = X.dtype();
    g.trans_b = true;  // out [rows, out] = x [rows, in] W^T
    g.M = rows, g.N = outf, g.K = in;
    g.A = X.data_ptr(), g.lda = in;
    g.B = W.data_ptr(), g.ldb = in;
    g.C = out.data_ptr(), g.ldc = outf;
    g.bias = B.defined() ? B.data_ptr() : nullptr;
    g.gelu = gelu;
    if (gelu && grad) {
      pre = empty(s, X.dtype(), x.device());
      g.pre_gelu = pre.data_ptr();
    }
    SG_KERNEL(out.device(), gemm)(g);
    out = detail::narrow_result(out, x.dtype());
  }
  if (grad) {
    Tensor kx = detach(x), kw = detach(w);
    bool gx = x.requires_grad(), gw = w.requires_grad(), gb = b.defined() && b.requires_grad();
    record(op, {x, w, b}, {out}, [kx, kw, pre, gx, gw, gb, rows, in, outf](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      if (pre.defined()) {  // through the GELU first: d(pre) = dy * gelu'(pre)
        Tensor dpre = empty(pre.shape(), pre.dtype(), pre.device());
        SG_KERNEL(pre.device(), unary_backward)(kernels::Unary::gelu, pre.dtype(), dpre.data_ptr(), G.data_ptr(),
                                                pre.data_ptr(), pre.numel());
        G = dpre;
      }
      Tensor dx, dw, db;
      if (gx) {  // dx [rows, in] = dy [rows, out] @ W [out, in]
        Tensor W = detail::operand(kw);
        dx = empty(kx.shape(), G.dtype(), G.device());
        gemm_into(dx, G, false, W, false, 1, rows, in, outf, 0, 0);
        dx = detail::narrow_result(dx, kx.dtype());
      }
      if (gw) {  // dW [out, in] = dy^T [out, rows] @ x [rows, in]
        Tensor X = detail::operand(kx);
        dw = empty({outf, in}, G.dtype(), G.device());
        gemm_into(dw, G, true, X, false, 1, outf, in, rows, 0, 0);
        dw = detail::narrow_result(dw, kw.dtype());
      }
      if (gb) db = detail::narrow_result(sum(reshape(G, {rows, outf}), {0}), kw.dtype());
      return TensorList{dx, dw, db};
    });
  }
  return out;
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) { return linear_impl("linear", x, w, b, false); }

Tensor linear_gelu(const Tensor& x, const Tensor& w, const Tensor& b) {
  return linear_impl("linear_gelu", x, w, b, true);
}

}  // namespace sg
