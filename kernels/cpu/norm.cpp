// Normalisation family on the CPU: LayerNorm and RMSNorm, forward and backward.
#include <cmath>
#include <vector>

#include <omp.h>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

namespace {

// LayerNorm of x, or of r = x + residual stored into r_out first (the statistics use r as stored).
void layernorm_rows(const char* op, DType dtype, void* r_out, void* y, void* mean, void* rstd, const void* x,
                    const void* residual, const void* w, const void* b, int64_t rows, int64_t C, double eps) {
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    auto* Y = static_cast<T*>(y);
    auto* M = static_cast<T*>(mean);
    auto* R = static_cast<T*>(rstd);
    auto* X = static_cast<const T*>(x);
    auto* Res = static_cast<const T*>(residual);
    auto* W = static_cast<const T*>(w);
    auto* Bb = static_cast<const T*>(b);
#pragma omp parallel for schedule(static) if (rows * C > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = X + r * C;
      if (Res) {
        T* rr = static_cast<T*>(r_out) + r * C;
        for (int64_t i = 0; i < C; ++i) rr[i] = xr[i] + Res[r * C + i];
        xr = rr;
      }
      T m = 0;
      for (int64_t i = 0; i < C; ++i) m += xr[i];
      m /= T(C);
      T v = 0;
      for (int64_t i = 0; i < C; ++i) v += (xr[i] - m) * (xr[i] - m);
      v /= T(C);
      T s = T(1) / std::sqrt(v + T(eps));
      T* yr = Y + r * C;
      for (int64_t i = 0; i < C; ++i) yr[i] = (xr[i] - m) * s * W[i] + (Bb ? Bb[i] : T(0));
      M[r] = m;
      R[r] = s;
    }
  });
}

// dx = (dr +) rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)); dw = sum dy*xhat; db = sum dy. ('=')
void layernorm_backward_rows(const char* op, DType dtype, void* dx, void* dw, void* db, const void* dr,
                             const void* dy, const void* x, const void* w, const void* mean, const void* rstd,
                             int64_t rows, int64_t C) {
  dispatch_float(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    auto* DX = static_cast<T*>(dx);
    auto* DW = static_cast<T*>(dw);
    auto* DB = static_cast<T*>(db);
    auto* DR = static_cast<const T*>(dr);
    auto* DY = static_cast<const T*>(dy);
    auto* X = static_cast<const T*>(x);
    auto* W = static_cast<const T*>(w);
    auto* M = static_cast<const T*>(mean);
    auto* R = static_cast<const T*>(rstd);
    for (int64_t i = 0; i < C; ++i) DW[i] = 0;
    if (DB)
      for (int64_t i = 0; i < C; ++i) DB[i] = 0;
    // Per-thread partial sums of dw/db, added in thread order: deterministic for a thread count.
    const int nt = omp_get_max_threads();
    std::vector<T> partial(size_t(nt) * size_t(2 * C), T(0));
#pragma omp parallel num_threads(nt)
    {
      T* dw_local = partial.data() + size_t(omp_get_thread_num()) * size_t(2 * C);
      T* db_local = dw_local + C;
      std::vector<T> row(DR ? size_t(C) : 0);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const T* g = DY + r * C;
        const T* xr = X + r * C;
        const T m = M[r], s = R[r];
        T mean_g = 0, mean_gx = 0;
        for (int64_t i = 0; i < C; ++i) {
          T xhat = (xr[i] - m) * s;
          T gw = g[i] * W[i];
          mean_g += gw;
          mean_gx += gw * xhat;
          dw_local[i] += g[i] * xhat;
          db_local[i] += g[i];
        }
        mean_g /= T(C);
        mean_gx /= T(C);
        // With DR the row's gradient is rounded into `row` first, then added: the same two roundings
        // as the tape adding the two gradients (one fused multiply-add would round once), and DR
        // may be DX.
        T* o = DR ? row.data() : DX + r * C;
        for (int64_t i = 0; i < C; ++i) {
          T xhat = (xr[i] - m) * s;
          o[i] = s * (g[i] * W[i] - mean_g - xhat * mean_gx);
        }
        if (DR)
          for (int64_t i = 0; i < C; ++i) DX[r * C + i] = DR[r * C + i] + row[size_t(i)];
      }
    }
    for (int t = 0; t < nt; ++t) {
      const T* dw_local = partial.data() + size_t(t) * size_t(2 * C);
      for (int64_t i = 0; i < C; ++i) DW[i] += dw_local[i];
      if (DB)
        for (int64_t i = 0; i < C; ++i) DB[i] += dw_local[C + i];
    }
  });
}

}  // namespace

void layernorm(DType dtype, void* y, void* mean, void* rstd, const void* x, const void* w, const void* b,
               int64_t rows, int64_t C, double eps) {
  layernorm_rows("layernorm", dtype, nullptr, y, mean, rstd, x, nullptr, w, b, rows, C, eps);
}

void layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dy, const void* x, const void* w,
                        const void* mean, const void* rstd, int64_t rows, int64_t C) {
  layernorm_backward_rows("layernorm_backward", dtype, dx, dw, db, nullptr, dy, x, w, mean, rstd, rows, C);
}

void residual_layernorm(DType dtype, void* r, void* y, void* mean, void* rstd, const void* x, const void* residual,
                        const void* w, const void* b, int64_t rows, int64_t C, double eps) {
  SG_CHECK(r && residual, "residual_layernorm: needs the residual and the buffer for the sum");
  layernorm_rows("residual_layernorm", dtype, r, y, mean, rstd, x, residual, w, b, rows, C, eps);
}

void residual_layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dr, const void* dy,
                                 const void* r, const void* w, const void* mean, const void* rstd, int64_t rows,
                                 int64_t C) {
  layernorm_backward_rows("residual_layernorm_backward", dtype, dx, dw, db, dr, dy, r, w, mean, rstd, rows, C);
}

void rmsnorm(DType dtype, void* y, void* rstd, const void* x, const void* w, int64_t rows, int64_t C, double eps) {
  dispatch_float(dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    auto* Y = static_cast<T*>(y);
    auto* R = static_cast<T*>(rstd);
    auto* X = static_cast<const T*>(x);
    auto* W = static_cast<const T*>(w);
#pragma omp parallel for schedule(static) if (rows * C > 16384)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = X + r * C;
      T ss = 0;
      for (int64_t i = 0; i < C; ++i) ss += xr[i] * xr[i];
      T s = T(1) / std::sqrt(ss / T(C) + T(eps));
      for (int64_t i = 0; i < C; ++i) Y[r * C + i] = xr[i] * s * W[i];
      R[r] = s;
    }
  });
}

// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)); dw = sum dy*xhat. ('=')
void rmsnorm_backward(DType dtype, void* dx, void* dw, const void* dy, const void* x, const void* w, const void* rstd,
                      int64_t rows, int64_t C) {
  dispatch_float(dtype, "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    auto* DX = static_cast<T*>(dx);
    auto* DW = static_cast<T*>(dw);
    auto* DY = static_cast<const T*>(dy);
    auto* X = static_cast<const T*>(x);
    auto* W = static_cast<const T*>(w);
    auto* R = static_cast<const T*>(rstd);
    for (int64_t i = 0; i < C; ++i) DW[i] = 0;
    for (int64_t r = 0; r < rows; ++r) {  // serial: keeps dw summation order fixed
      const T* g = DY + r * C;
      const T* xr = X + r * C;
      const T s = R[r];
      T mean_gx = 0;
      for (int64_t i = 0; i < C; ++i) mean_gx += g[i] * W[i] * xr[i] * s;
      mean_gx /= T(C);
      for (int64_t i = 0; i < C; ++i) {
        T xhat = xr[i] * s;
        DX[r * C + i] = s * (g[i] * W[i] - xhat * mean_gx);
        DW[i] += g[i] * xhat;
      }
    }
  });
}

}  // namespace sg::kernels::cpu
