// Matrix products: matmul (batched, broadcasting batch dims) and linear (x W^T + b), through the
// device's GEMM. Backward of C = A B: dA = dC B^T, dB = A^T dC (summed over broadcast batches).
#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

namespace {

// The GemmArgs of out[b] = op(A[b]) op(B[b]) ('='); A, B, out contiguous in the
// compute dtype. A is stored [batch, rows_a, cols_a] and B [batch, rows_b, cols_b]; a batch stride
// of 0 reuses one matrix. Callers add an epilogue before running it.
kernels::GemmArgs gemm_args(const Tensor& out, const Tensor& A, bool ta, const Tensor& B, bool tb, int64_t batch,
                            int64_t M, int64_t N, int64_t K, int64_t stride_a, int64_t stride_b) {
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
  g.batch = batch;
  g.stride_a = stride_a;
  g.stride_b = stride_b;
  g.stride_c = M * N;
  return g;
}

void gemm_into(const Tensor& out, const Tensor& A, bool ta, const Tensor& B, bool tb, int64_t batch, int64_t M,
               int64_t N, int64_t K, int64_t stride_a, int64_t stride_b) {
  SG_KERNEL(out.device(), gemm)(gemm_args(out, A, ta, B, tb, batch, M, N, K, stride_a, stride_b));
}

// The rows of t as a matrix [rows, last dim]: the product of its leading dims (not numel / last
// dim, which is 0 when the last dim is, leaving an output unwritten).
int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::check_same_device("matmul", a, b);
  detail::check_floating("matmul", a);
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
    const int64_t M = leading_rows(a);
    Shape s = a.shape();
    s.back() = N;
    out = empty(s, A.dtype(), a.device());
    gemm_into(out, A, false, B, false, 1, M, N, K, 0, 0);
    out = detail::narrow_result(out, a.dtype());
  } else {
    SG_CHECK(a.dim() >= 2, "matmul: a must have at least 2 dims when b is batched");
    Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
    const std::string op = str("matmul of ", shape_str(a.shape()), " and ", shape_str(b.shape()), ", batch dims");
    Shape batch = broadcast_shapes(ba, bb, op.c_str());
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
          const int64_t rows = leading_rows(ka);
          Tensor a2 = reshape(ka, {rows, ka.size(-1)}), g2 = reshape(g[0], {rows, g[0].size(-1)});
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

// The forward GEMM of a linear layer: out [rows, out] = X [rows, in] W^T (+ bias) (then GELU, the
// value before it stored to pre when pre is defined; or + R, a residual of out's shape), on
// compute-dtype operands.
void linear_gemm(const Tensor& out, const Tensor& X, const Tensor& W, const Tensor& B, bool gelu, const Tensor& pre,
                 const Tensor& R = Tensor()) {
  const int64_t N = W.size(0);
  kernels::GemmArgs g = gemm_args(out, X, false, W, true, 1, out.numel() / std::max<int64_t>(N, 1), N, W.size(1), 0, 0);
  g.bias = B.defined() ? B.data_ptr() : nullptr;
  g.gelu = gelu;
  g.pre_gelu = pre.defined() ? pre.data_ptr() : nullptr;
  g.residual = R.defined() ? R.data_ptr() : nullptr;
  SG_KERNEL(out.device(), gemm)(g);
}

// What a linear layer's backward owes, given G = dy as a contiguous compute-dtype [rows, out]:
// dx = G W (when gx), dW = G^T x with the bias gradient db = the sum of G's rows in the same
// GEMM's epilogue (when gw; a separate sum when only gb). Results in the inputs' dtypes.
struct LinearGrads {
  Tensor dx, dw, db;
};
LinearGrads linear_grads(const Tensor& G, const Tensor& kx, const Tensor& kw, bool gx, bool gw, bool gb) {
  const int64_t in = kw.size(1), outf = kw.size(0), rows = leading_rows(kx);
  LinearGrads r;
  if (gx) {  // dx [rows, in] = dy [rows, out] @ W [out, in]
    Tensor W = detail::operand(kw);
    r.dx = empty(kx.shape(), G.dtype(), G.device());
    gemm_into(r.dx, G, false, W, false, 1, rows, in, outf, 0, 0);
    r.dx = detail::narrow_result(r.dx, kx.dtype());
  }
  if (gw) {  // dW [out, in] = dy^T [out, rows] @ x [rows, in]; db = the rows of dy^T summed
    Tensor X = detail::operand(kx);
    r.dw = empty({outf, in}, G.dtype(), G.device());
    if (gb) r.db = empty({outf}, G.dtype(), G.device());
    kernels::GemmArgs g = gemm_args(r.dw, G, true, X, false, 1, outf, in, rows, 0, 0);
    g.row_sums_a = gb ? r.db.data_ptr() : nullptr;
    SG_KERNEL(G.device(), gemm)(g);
    r.dw = detail::narrow_result(r.dw, kw.dtype());
  } else if (gb) {
    r.db = sum(reshape(G, {rows, outf}), {0});
  }
  if (gb) r.db = detail::narrow_result(r.db, kw.dtype());
  return r;
}

void check_linear(const char* op, const Tensor& x, const Tensor& w, const Tensor& b) {
  detail::check_same_device(op, x, w);
  detail::check_floating(op, x);
  SG_CHECK(w.dim() == 2, op, ": weight must be [out, in], got ", shape_str(w.shape()));
  const int64_t in = w.size(1), outf = w.size(0);
  SG_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": input ", shape_str(x.shape()), " does not match weight ",
           shape_str(w.shape()), " (", x.size(-1), " != ", in, ")");
  SG_CHECK(x.dtype() == w.dtype(), op, ": input dtype ", dtype_name(x.dtype()), " but weight dtype ",
           dtype_name(w.dtype()));
  SG_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == outf), op, ": bias ", shape_str(b.shape()),
           " does not match ", outf, " outputs");
  SG_CHECK(!b.defined() || b.device() == w.device(), op, ": bias on ", b.device().str(), ", weight on ",
           w.device().str());
  SG_CHECK(!b.defined() || b.dtype() == w.dtype(), op, ": bias dtype ", dtype_name(b.dtype()), " but weight dtype ",
           dtype_name(w.dtype()));
}

Shape with_last(Shape s, int64_t n) {
  s.back() = n;
  return s;
}

// A residual added by the GEMM that computes an op's output (out_shape, x's dtype and device).
void check_residual(const char* op, const Tensor& residual, const Shape& out_shape, const Tensor& x) {
  SG_CHECK(!residual.defined() || (residual.shape() == out_shape && residual.dtype() == x.dtype() &&
                                   residual.device() == x.device()),
           op, ": residual ", residual.describe(), " is not the output's ", shape_str(out_shape), " in ",
           dtype_name(x.dtype()), " on ", x.device().str());
}

// linear (gelu false) and linear_gelu: one GEMM with the bias (and GELU) in its epilogue. The GELU
// form saves the pre-activation, which its backward needs. linear may add a residual there too.
// The layer's input: x itself, or gathered from the shard x (Regather), unrecorded.
Tensor layer_input(const Tensor& x, const Regather& rg) {
  if (!rg) return x;
  autograd::NoGradGuard ng;
  return rg.gather(x);
}

Tensor linear_impl(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, bool gelu,
                   const Tensor& residual, const Regather& rg) {
  const Tensor xin = layer_input(x, rg);
  check_linear(op, xin, w, b);
  const Shape s = with_last(xin.shape(), w.size(0));
  check_residual(op, residual, s, xin);
  const bool grad = needs_grad({x, w, b, residual});  // asked before the guard below turns recording off
  Tensor out, pre;
  {
    autograd::NoGradGuard ng;
    Tensor X = detail::operand(xin), W = detail::operand(w), B = detail::operand_if(b);
    out = empty(s, X.dtype(), x.device());
    if (gelu && grad) pre = empty(s, X.dtype(), x.device());
    linear_gemm(out, X, W, B, gelu, pre, detail::operand_if(residual));
    out = detail::narrow_result(out, x.dtype());
  }
  if (grad) {
    Tensor kx = detach(x), kw = detach(w);
    bool gx = x.requires_grad(), gw = w.requires_grad(), gb = b.defined() && b.requires_grad();
    record(op, {x, w, b, residual}, {out}, [kx, kw, pre, gx, gw, gb, rg](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      if (pre.defined()) {  // through the GELU first: d(pre) = dy * gelu'(pre)
        Tensor dpre = empty(pre.shape(), pre.dtype(), pre.device());
        SG_KERNEL(pre.device(), unary_backward)(kernels::Unary::gelu, pre.dtype(), dpre.data_ptr(), G.data_ptr(),
                                                pre.data_ptr(), pre.numel());
        G = dpre;
      }
      LinearGrads r = linear_grads(G, layer_input(kx, rg), kw, gx, gw, gb);
      if (rg && r.dx.defined()) r.dx = rg.scatter(r.dx);
      return TensorList{r.dx, r.dw, r.db, g[0]};  // d(residual) = dy
    });
  }
  return out;
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& residual, const Regather& regather) {
  return linear_impl("linear", x, w, b, false, residual, regather);
}

Tensor linear_gelu(const Tensor& x, const Tensor& w, const Tensor& b, const Regather& regather) {
  return linear_impl("linear_gelu", x, w, b, true, Tensor(), regather);
}

Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const Tensor& residual, const Regather& rg) {
  const Tensor xin = layer_input(x, rg);
  check_linear("mlp (c_fc)", xin, w1, b1);
  SG_CHECK(w2.dim() == 2 && w2.size(1) == w1.size(0), "mlp: c_proj weight ", shape_str(w2.shape()),
           " does not take c_fc's ", w1.size(0), " outputs");
  SG_CHECK(w1.dtype() == w2.dtype() && w1.device() == w2.device(), "mlp: c_fc weight ", w1.describe(),
           " and c_proj weight ", w2.describe(), " differ in dtype or device");
  SG_CHECK(!b2.defined() || (b2.dim() == 1 && b2.size(0) == w2.size(0) && b2.device() == w2.device()),
           "mlp: c_proj bias ", b2.describe(), " does not match ", w2.size(0), " outputs on ", w2.device().str());
  const Shape sh = with_last(xin.shape(), w1.size(0)), sy = with_last(xin.shape(), w2.size(0));
  check_residual("mlp", residual, sy, xin);
  const bool grad = needs_grad({x, w1, b1, w2, b2, residual});
  Tensor y, pre, h;
  {
    autograd::NoGradGuard ng;
    Tensor X = detail::operand(xin), W1 = detail::operand(w1), B1 = detail::operand_if(b1);
    Tensor H = empty(sh, X.dtype(), x.device());
    if (grad) pre = empty(sh, X.dtype(), x.device());
    linear_gemm(H, X, W1, B1, true, pre);
    // h as the two-op form would hand it on: in the input's dtype (what the backward keeps).
    h = detail::narrow_result(H, x.dtype());
    Tensor Hc = detail::operand(h), W2 = detail::operand(w2), B2 = detail::operand_if(b2);
    y = empty(sy, Hc.dtype(), x.device());
    linear_gemm(y, Hc, W2, B2, false, Tensor(), detail::operand_if(residual));
    y = detail::narrow_result(y, x.dtype());
  }
  if (grad) {
    Tensor kx = detach(x), kw1 = detach(w1), kw2 = detach(w2);
    const bool gx = x.requires_grad(), gw1 = w1.requires_grad(), gb1 = b1.defined() && b1.requires_grad(),
               gw2 = w2.requires_grad(), gb2 = b2.defined() && b2.requires_grad();
    record("mlp", {x, w1, b1, w2, b2, residual}, {y}, [kx, kw1, kw2, pre, h, gx, gw1, gb1, gw2, gb2, rg](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      LinearGrads proj = linear_grads(G, h, kw2, false, gw2, gb2);
      LinearGrads fc;
      if (gx || gw1 || gb1) {
        // d(pre) [rows, 4C] = dy [rows, C] @ W2 [C, 4C] times GELU'(pre), and c_fc's bias gradient
        // (its rows summed) in the same GEMM.
        Tensor W2 = detail::operand(kw2), dpre = empty(pre.shape(), pre.dtype(), pre.device());
        const int64_t hidden = kw2.size(1), outf = kw2.size(0), rows = pre.numel() / std::max<int64_t>(hidden, 1);
        Tensor db1 = gb1 ? empty({hidden}, pre.dtype(), pre.device()) : Tensor();
        kernels::GemmArgs a = gemm_args(dpre, G, false, W2, false, 1, rows, hidden, outf, 0, 0);
        a.dgelu_pre = pre.data_ptr();
        a.bias_grad = gb1 ? db1.data_ptr() : nullptr;
        SG_KERNEL(pre.device(), gemm)(a);
        fc = linear_grads(dpre, layer_input(kx, rg), kw1, gx, gw1, false);
        if (gb1) fc.db = detail::narrow_result(db1, kw1.dtype());
        if (rg && fc.dx.defined()) fc.dx = rg.scatter(fc.dx);
      }
      return TensorList{fc.dx, fc.dw, fc.db, proj.dw, proj.db, g[0]};  // d(residual) = dy
    });
  }
  return y;
}

}  // namespace sg
