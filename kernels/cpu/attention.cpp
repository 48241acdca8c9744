// Fused causal scaled-dot-product attention on the CPU, forward and backward. One (batch, head)
// per task; inside, queries go in blocks of kRowBlock rows, and with the causal mask a block only
// meets the keys up to its last row (so about half the T x T work is never done). For a block:
// S = scale * Q K^T, a masked row softmax P, O = P V, all with Eigen on a per-thread buffer.
// q, k, v, out may be strided (AttentionArgs' layouts), e.g. slices of one packed projection.
// Forward saves only the row log-sum-exp; backward rebuilds P from it:
//   dV = P^T dO;  dP = dO V^T;  dS = P o (dP - rowsum(dO o O));  dQ = scale dS K;  dK = scale dS^T Q
#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

namespace {
template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
// A [T, D] head of q/k/v/out at its row stride (the head dim is contiguous).
template <class T>
using CMap = Eigen::Map<const Mat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using MMap = Eigen::Map<Mat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using RowArray = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;

constexpr int64_t kRowBlock = 32;

// Keys query row i may see: all T, or 0..i under the causal mask.
inline int64_t visible(bool causal, int64_t i, int64_t T) { return causal ? i + 1 : T; }

// Where head bh = b H + h starts in a tensor of layout s.
inline int64_t head_offset(const AttentionArgs::Strides& s, int64_t bh, int64_t H) {
  return bh / H * s.b + bh % H * s.h;
}
}  // namespace

void attention(const AttentionArgs& a) {
  dispatch_float(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    const int64_t T_ = a.T, D = a.D, BH = a.B * a.H;
    const T scale = T(a.scale);
    const AttentionArgs::Strides ls = a.q_layout(), lo = a.o_layout();
#pragma omp parallel
    {
      Mat<T> S(kRowBlock, T_);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t qo = head_offset(ls, bh, a.H), oo = head_offset(lo, bh, a.H);
        const Eigen::OuterStride<> qs(ls.t), os(lo.t);
        CMap<T> q(static_cast<const T*>(a.q) + qo, T_, D, qs);
        CMap<T> k(static_cast<const T*>(a.k) + qo, T_, D, qs);
        CMap<T> v(static_cast<const T*>(a.v) + qo, T_, D, qs);
        MMap<T> o(static_cast<T*>(a.out) + oo, T_, D, os);
        T* lse = static_cast<T*>(a.lse) + bh * T_;
        for (int64_t r0 = 0; r0 < T_; r0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, T_ - r0), cols = visible(a.causal, r0 + rows - 1, T_);
          auto s = S.topLeftCorner(rows, cols);
          s.noalias() = (q.middleRows(r0, rows) * k.topRows(cols).transpose()) * scale;
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t n = visible(a.causal, r0 + i, T_);
            RowArray<T> row(S.row(i).data(), n);
            const T m = row.maxCoeff();
            row = (row - m).exp();
            const T sum = row.sum();
            row *= T(1) / sum;
            for (int64_t j = n; j < cols; ++j) S(i, j) = 0;
            lse[r0 + i] = m + std::log(sum);
          }
          o.middleRows(r0, rows).noalias() = s * v.topRows(cols);
        }
      }
    }
  });
}

void attention_backward(const AttentionArgs& a) {
  dispatch_float(a.dtype, "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t T_ = a.T, D = a.D, BH = a.B * a.H;
    const T scale = T(a.scale);
    const AttentionArgs::Strides ls = a.q_layout(), lo = a.o_layout();
#pragma omp parallel
    {
      Mat<T> P(kRowBlock, T_), dP(kRowBlock, T_);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t qo = head_offset(ls, bh, a.H), oo = head_offset(lo, bh, a.H);
        const Eigen::OuterStride<> qs(ls.t), os(lo.t);
        CMap<T> q(static_cast<const T*>(a.q) + qo, T_, D, qs);
        CMap<T> k(static_cast<const T*>(a.k) + qo, T_, D, qs);
        CMap<T> v(static_cast<const T*>(a.v) + qo, T_, D, qs);
        CMap<T> o(static_cast<const T*>(a.out) + oo, T_, D, os);
        CMap<T> dout(static_cast<const T*>(a.dout) + oo, T_, D, os);
        MMap<T> dq(static_cast<T*>(a.dq) + qo, T_, D, qs);
        MMap<T> dk(static_cast<T*>(a.dk) + qo, T_, D, qs);
        MMap<T> dv(static_cast<T*>(a.dv) + qo, T_, D, qs);
        const T* lse = static_cast<const T*>(a.lse) + bh * T_;
        dk.setZero();
        dv.setZero();
        for (int64_t r0 = 0; r0 < T_; r0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, T_ - r0), cols = visible(a.causal, r0 + rows - 1, T_);
          auto p = P.topLeftCorner(rows, cols);
          auto dp = dP.topLeftCorner(rows, cols);
          auto q_blk = q.middleRows(r0, rows);
          auto do_blk = dout.middleRows(r0, rows);
          p.noalias() = (q_blk * k.topRows(cols).transpose()) * scale;
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t n = visible(a.causal, r0 + i, T_);
            RowArray<T> row(P.row(i).data(), n);
            row = (row - lse[r0 + i]).exp();
            for (int64_t j = n; j < cols; ++j) P(i, j) = 0;
          }
          dv.topRows(cols).noalias() += p.transpose() * do_blk;
          dp.noalias() = do_blk * v.topRows(cols).transpose();
          for (int64_t i = 0; i < rows; ++i) {
            const T di = dout.row(r0 + i).dot(o.row(r0 + i));
            dp.row(i) = p.row(i).cwiseProduct(dp.row(i) - Eigen::Matrix<T, 1, Eigen::Dynamic>::Constant(cols, di));
          }
          dq.middleRows(r0, rows).noalias() = (dp * k.topRows(cols)) * scale;
          dk.topRows(cols).noalias() += (dp.transpose() * q_blk) * scale;
        }
      }
    }
  });
}

}  // namespace sg::kernels::cpu
