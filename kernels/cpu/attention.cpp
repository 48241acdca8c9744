// Fused causal scaled-dot-product attention on the CPU, forward and backward. One (batch, head)
// per task; inside, S = scale * Q K^T, a masked row softmax P, O = P V, all with Eigen on a
// per-thread T x T buffer. Forward saves only the row log-sum-exp; backward rebuilds P from it:
//   dV = P^T dO;  dP = dO V^T;  dS = P o (dP - rowsum(dO o O));  dQ = scale dS K;  dK = scale dS^T Q
#include <Eigen/Core>
#include <cmath>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

namespace {
template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using CMap = Eigen::Map<const Mat<T>>;
template <class T>
using MMap = Eigen::Map<Mat<T>>;

// Fills P (T x T) with the attention probabilities of one head, from scores and the saved lse.
template <class T>
void probabilities(Mat<T>& P, const CMap<T>& q, const CMap<T>& k, T scale, bool causal, const T* lse) {
  const int64_t Tn = q.rows();
  P.noalias() = (q * k.transpose()) * scale;
  for (int64_t i = 0; i < Tn; ++i) {
    T* row = P.data() + i * Tn;
    const int64_t last = causal ? i : Tn - 1;
    for (int64_t j = 0; j <= last; ++j) row[j] = std::exp(row[j] - lse[i]);
    for (int64_t j = last + 1; j < Tn; ++j) row[j] = 0;
  }
}
}  // namespace

void attention(const AttentionArgs& a) {
  dispatch_float(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    const int64_t T_ = a.T, D = a.D, BH = a.B * a.H;
    const T scale = T(a.scale);
#pragma omp parallel
    {
      Mat<T> S(T_, T_);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t off = bh * T_ * D;
        CMap<T> q(static_cast<const T*>(a.q) + off, T_, D);
        CMap<T> k(static_cast<const T*>(a.k) + off, T_, D);
        CMap<T> v(static_cast<const T*>(a.v) + off, T_, D);
        MMap<T> o(static_cast<T*>(a.out) + off, T_, D);
        T* lse = static_cast<T*>(a.lse) + bh * T_;
        S.noalias() = (q * k.transpose()) * scale;
        for (int64_t i = 0; i < T_; ++i) {
          T* row = S.data() + i * T_;
          const int64_t last = a.causal ? i : T_ - 1;
          T m = row[0];
          for (int64_t j = 1; j <= last; ++j) m = row[j] > m ? row[j] : m;
          T s = 0;
          for (int64_t j = 0; j <= last; ++j) s += (row[j] = std::exp(row[j] - m));
          const T inv = T(1) / s;
          for (int64_t j = 0; j <= last; ++j) row[j] *= inv;
          for (int64_t j = last + 1; j < T_; ++j) row[j] = 0;
          lse[i] = m + std::log(s);
        }
        o.noalias() = S * v;
      }
    }
  });
}

void attention_backward(const AttentionArgs& a) {
  dispatch_float(a.dtype, "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t T_ = a.T, D = a.D, BH = a.B * a.H;
    const T scale = T(a.scale);
#pragma omp parallel
    {
      Mat<T> P(T_, T_), dP(T_, T_);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t off = bh * T_ * D;
        CMap<T> q(static_cast<const T*>(a.q) + off, T_, D);
        CMap<T> k(static_cast<const T*>(a.k) + off, T_, D);
        CMap<T> v(static_cast<const T*>(a.v) + off, T_, D);
        CMap<T> o(static_cast<const T*>(a.out) + off, T_, D);
        CMap<T> dout(static_cast<const T*>(a.dout) + off, T_, D);
        MMap<T> dq(static_cast<T*>(a.dq) + off, T_, D);
        MMap<T> dk(static_cast<T*>(a.dk) + off, T_, D);
        MMap<T> dv(static_cast<T*>(a.dv) + off, T_, D);
        const T* lse = static_cast<const T*>(a.lse) + bh * T_;
        probabilities<T>(P, q, k, scale, a.causal, lse);
        dv.noalias() = P.transpose() * dout;
        dP.noalias() = dout * v.transpose();
        for (int64_t i = 0; i < T_; ++i) {
          const T di = dout.row(i).dot(o.row(i));
          T* pr = P.data() + i * T_;
          T* dr = dP.data() + i * T_;
          for (int64_t j = 0; j < T_; ++j) dr[j] = pr[j] * (dr[j] - di);
        }
        dq.noalias() = (dP * k) * scale;
        dk.noalias() = (dP.transpose() * q) * scale;
      }
    }
  });
}

}  // namespace sg::kernels::cpu
