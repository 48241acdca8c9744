// Softmax family on the CPU: row softmax / log-softmax and the fused softmax-cross-entropy that
// never materialises probabilities (backward recomputes them from the saved log-sum-exp, or the
// fused classifier writes the gradient in the forward's pass over the row).
#include <cmath>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

void softmax(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, bool log) {
  dispatch_float(dtype, "softmax", [&](auto tag) {
    using T = decltype(tag);
    auto* out = static_cast<T*>(y);
    auto* in = static_cast<const T*>(x);
#pragma omp parallel for schedule(static) if (rows * cols > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = in + r * cols;
      T* yr = out + r * cols;
      T m = -INFINITY;
      for (int64_t j = 0; j < cols; ++j) m = xr[j] > m ? xr[j] : m;
      double s = 0;
      for (int64_t j = 0; j < cols; ++j) s += std::exp(double(xr[j] - m));
      if (log) {
        T lse = m + T(std::log(s));
        for (int64_t j = 0; j < cols; ++j) yr[j] = xr[j] - lse;
      } else {
        T inv = T(1.0 / s);
        for (int64_t j = 0; j < cols; ++j) yr[j] = std::exp(xr[j] - m) * inv;
      }
    }
  });
}

// softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy). ('=')
void softmax_backward(DType dtype, void* dx, const void* dy, const void* y, int64_t rows, int64_t cols, bool log) {
  dispatch_float(dtype, "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    auto* gx = static_cast<T*>(dx);
    auto* gy = static_cast<const T*>(dy);
    auto* py = static_cast<const T*>(y);
#pragma omp parallel for schedule(static) if (rows * cols > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gy + r * cols;
      const T* yr = py + r * cols;
      T* o = gx + r * cols;
      double s = 0;
      if (log) {
        for (int64_t j = 0; j < cols; ++j) s += double(g[j]);
        for (int64_t j = 0; j < cols; ++j) o[j] = g[j] - std::exp(yr[j]) * T(s);
      } else {
        for (int64_t j = 0; j < cols; ++j) s += double(g[j]) * double(yr[j]);
        for (int64_t j = 0; j < cols; ++j) o[j] = yr[j] * (g[j] - T(s));
      }
    }
  });
}

namespace {

// Row r's log-sum-exp over its first V logits (max first, the sum of exp in f64).
template <class T>
T row_logsumexp(const T* x, int64_t V) {
  T m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) m = x[j] > m ? x[j] : m;
  double s = 0;
  for (int64_t j = 0; j < V; ++j) s += std::exp(double(x[j] - m));
  return m + T(std::log(s));
}

// One row's dlogits ('='): (exp(x - lse) - onehot(t)) * d over the vocabulary, 0 in the padding
// and for an ignored row. g may be x: each element is read before it is written.
template <class T>
void row_dlogits(T* g, const T* x, T lse, T d, int64_t t, int64_t Vp, int64_t V, bool ignored) {
  if (ignored) {
    for (int64_t j = 0; j < Vp; ++j) g[j] = 0;
    return;
  }
  for (int64_t j = 0; j < V; ++j) g[j] = std::exp(x[j] - lse) * d;
  for (int64_t j = V; j < Vp; ++j) g[j] = 0;
  g[t] -= d;
}

// The forward over every row, then (when dlogits is given) the row's gradient while the row is
// still in cache: the fused classifier. A target outside [0, V) that is not ignore_index gives
// loss 0 and a zero gradient row, and the call then throws naming it.
template <class T>
void classifier_rows(DType tgt_dtype, T* L, T* S, T* G, const T* X, const void* targets, T d, int64_t rows,
                     int64_t Vp, int64_t V, int64_t ignore_index) {
  bool any_bad = false;  // a flag, not a sentinel: -1 is itself a target that can be out of range
  int64_t bad = 0;
#pragma omp parallel for schedule(static) if (rows * V > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = X + r * Vp;
    const T s = row_logsumexp(x, V);
    if (S) S[r] = s;
    const int64_t t = read_index(tgt_dtype, targets, r);
    const bool in_range = t >= 0 && t < V;
    if (t != ignore_index && !in_range) {
#pragma omp critical
      {
        any_bad = true;
        bad = t;
      }
    }
    L[r] = t != ignore_index && in_range ? s - x[t] : T(0);
    if (G) row_dlogits(G + r * Vp, x, s, d, t, Vp, V, t == ignore_index || !in_range);
  }
  SG_CHECK(!any_bad, "cross_entropy: target ", bad, " out of range [0, ", V, ")");
}

}  // namespace

void cross_entropy(DType dtype, DType tgt_dtype, void* loss, void* lse, const void* logits, const void* targets,
                   int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) {
  dispatch_float(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    classifier_rows<T>(tgt_dtype, static_cast<T*>(loss), static_cast<T*>(lse), nullptr, static_cast<const T*>(logits),
                       targets, T(0), rows, Vp, V, ignore_index);
  });
}

void cross_entropy_backward(DType dtype, DType tgt_dtype, void* dlogits, const void* dloss, const void* logits,
                            const void* lse, const void* targets, int64_t rows, int64_t Vp, int64_t V,
                            int64_t ignore_index) {
  dispatch_float(dtype, "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    auto* G = static_cast<T*>(dlogits);
    auto* dL = static_cast<const T*>(dloss);
    auto* X = static_cast<const T*>(logits);
    auto* S = static_cast<const T*>(lse);
#pragma omp parallel for schedule(static) if (rows * V > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = read_index(tgt_dtype, targets, r);
      row_dlogits(G + r * Vp, X + r * Vp, S[r], dL[r], t, Vp, V, t == ignore_index || t < 0 || t >= V);
    }
  });
}

void cross_entropy_fused(DType dtype, DType tgt_dtype, void* loss, void* dlogits, const void* logits,
                         const void* targets, double dloss, int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) {
  dispatch_float(dtype, "cross_entropy_fused", [&](auto tag) {
    using T = decltype(tag);
    classifier_rows<T>(tgt_dtype, static_cast<T*>(loss), nullptr, static_cast<T*>(dlogits),
                       static_cast<const T*>(logits), targets, T(dloss), rows, Vp, V, ignore_index);
  });
}

}  // namespace sg::kernels::cpu
