// GEMM and batched GEMM on Eigen. One large GEMM uses Eigen's own OpenMP threading; a batch of
// small ones is spread over threads with one single-threaded GEMM each.
#include <Eigen/Core>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

namespace {
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using CMap = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using MMap = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;

template <class T>
void gemm_one(const GemmArgs& g, const T* A, const T* B, T* C) {
  // Stored shapes: A is [M,K] (or [K,M] if trans_a), B is [K,N] (or [N,K] if trans_b).
  CMap<T> a(A, g.trans_a ? g.K : g.M, g.trans_a ? g.M : g.K, Eigen::OuterStride<>(g.lda));
  CMap<T> b(B, g.trans_b ? g.N : g.K, g.trans_b ? g.K : g.N, Eigen::OuterStride<>(g.ldb));
  MMap<T> c(C, g.M, g.N, Eigen::OuterStride<>(g.ldc));
  const T alpha = T(g.alpha);
  if (g.beta == 0.0) {
    if (!g.trans_a && !g.trans_b) c.noalias() = alpha * (a * b);
    else if (g.trans_a && !g.trans_b) c.noalias() = alpha * (a.transpose() * b);
    else if (!g.trans_a && g.trans_b) c.noalias() = alpha * (a * b.transpose());
    else c.noalias() = alpha * (a.transpose() * b.transpose());
  } else {
    if (g.beta != 1.0) c *= T(g.beta);
    if (!g.trans_a && !g.trans_b) c.noalias() += alpha * (a * b);
    else if (g.trans_a && !g.trans_b) c.noalias() += alpha * (a.transpose() * b);
    else if (!g.trans_a && g.trans_b) c.noalias() += alpha * (a * b.transpose());
    else c.noalias() += alpha * (a.transpose() * b.transpose());
  }
}
}  // namespace

void gemm(const GemmArgs& g) {
  check_gemm_epilogue(g, "cpu");
  dispatch_float(g.dtype, "gemm", [&](auto tag) {
    using T = decltype(tag);
    auto* A = static_cast<const T*>(g.A);
    auto* B = static_cast<const T*>(g.B);
    auto* C = static_cast<T*>(g.C);
    if (g.batch == 1) {
      // The epilogue as the separate ops would do it, the same values bit for bit: the product
      // (and bias) lands in pre_gelu when one is wanted, GELU then reads it from there.
      T* pre = g.gelu && g.pre_gelu ? static_cast<T*>(g.pre_gelu) : C;
      gemm_one<T>(g, A, B, pre);
      if (g.bias) MMap<T>(pre, g.M, g.N, Eigen::OuterStride<>(g.ldc)).rowwise() +=
                  Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(static_cast<const T*>(g.bias), g.N);
      // the residual last, as add(residual, product + bias) would: C = residual + C
      if (g.residual) binary(Binary::add, g.dtype, C, g.residual, {g.N, 1}, C, {g.N, 1}, {g.M, g.N});
      if (g.gelu) unary(Unary::gelu, g.dtype, C, pre, g.M * g.N, 0);
      if (g.dgelu_pre) unary_backward(Unary::gelu, g.dtype, C, C, g.dgelu_pre, g.M * g.N);
      if (g.bias_grad) reduce(Reduce::sum, g.dtype, g.bias_grad, C, 1, g.M, g.N);
      // op(A) is [M, K]: stored [K, M] (a column sum) when transposed, [M, K] (row sums) when not.
      if (g.row_sums_a) {
        if (g.trans_a) reduce(Reduce::sum, g.dtype, g.row_sums_a, A, 1, g.K, g.M);
        else reduce(Reduce::sum, g.dtype, g.row_sums_a, A, g.M, g.K, 1);
      }
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < g.batch; ++i) gemm_one<T>(g, A + i * g.stride_a, B + i * g.stride_b, C + i * g.stride_c);
    }
  });
}

}  // namespace sg::kernels::cpu
