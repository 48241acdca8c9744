// Softmax family on the CPU: row softmax / log-softmax and the fused softmax-cross-entropy that
// never materialises probabilities (backward recomputes them from the saved log-sum-exp).
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

void cross_entropy(DType dtype, DType tgt_dtype, void* loss, void* lse, const void* logits, const void* targets,
                   int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) {
  dispatch_float(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    auto* L = static_cast<T*>(loss);
    auto* S = static_cast<T*>(lse);
    auto* X = static_cast<const T*>(logits);
    bool any_bad = false;  // a flag, not a sentinel: -1 is itself a target that can be out of range
    int64_t bad = 0;
#pragma omp parallel for schedule(static) if (rows * V > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = X + r * Vp;
      T m = -INFINITY;
      for (int64_t j = 0; j < V; ++j) m = x[j] > m ? x[j] : m;
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += std::exp(double(x[j] - m));
      S[r] = m + T(std::log(s));
      int64_t t = read_index(tgt_dtype, targets, r);
      if (t == ignore_index) {
        L[r] = 0;
      } else if (t < 0 || t >= V) {
#pragma omp critical
        {
          any_bad = true;
          bad = t;
        }
        L[r] = 0;
      } else {
        L[r] = S[r] - x[t];
      }
    }
    SG_CHECK(!any_bad, "cross_entropy: target ", bad, " out of range [0, ", V, ")");
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
      T* g = G + r * Vp;
      const T* x = X + r * Vp;
      int64_t t = read_index(tgt_dtype, targets, r);
      if (t == ignore_index) {
        for (int64_t j = 0; j < Vp; ++j) g[j] = 0;
        continue;
      }
      const T d = dL[r], s = S[r];
      for (int64_t j = 0; j < V; ++j) g[j] = std::exp(x[j] - s) * d;
      for (int64_t j = V; j < Vp; ++j) g[j] = 0;
      g[t] -= d;
    }
  });
}

}  // namespace sg::kernels::cpu
