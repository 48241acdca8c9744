// AdamW update on the CPU (Loshchilov & Hutter, decoupled weight decay), in place.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

// p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
// p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)      (the order PyTorch uses)
//
// A bf16/f16 gradient (grad_dtype) is widened chunk by chunk as it is read, and a copy gets the
// updated chunk rounded to that type: the same values as widening the whole gradient first and
// rounding the whole parameter after.
namespace {
void adamw_one(const AdamWArgs& a) {
  dispatch_float(a.dtype, "adamw", [&](auto tag) {
    using T = decltype(tag);
    auto* p = static_cast<T*>(a.param);
    const DType gt = a.grad_type();
    const size_t gsize = dtype_size(gt);
    auto* m = static_cast<T*>(a.m);
    auto* v = static_cast<T*>(a.v);
    const double bc1 = 1.0 - std::pow(a.beta1, double(a.step));
    const double bc2 = 1.0 - std::pow(a.beta2, double(a.step));
    const T step_size = T(a.lr / bc1), bc2_sqrt = T(std::sqrt(bc2));
    const T decay = T(1.0 - a.lr * a.weight_decay), b1 = T(a.beta1), b2 = T(a.beta2), eps = T(a.eps);
    const T gs = T(a.grad_scale);
    // Eigen arrays: the sqrt and divide vectorise (a plain loop keeps std::sqrt's errno branch).
    using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
    auto update = [=](T* pp, const T* gg, T* mm, T* vv, int64_t len) {
      Eigen::Map<Arr> P(pp, len), M(mm, len), V(vv, len);
      Eigen::Map<const Arr> G(gg, len);
      M = b1 * M + (T(1) - b1) * (G * gs);
      V = b2 * V + ((T(1) - b2) * (G * gs)) * (G * gs);
      P = P * decay - step_size * M / (V.sqrt() / bc2_sqrt + eps);
    };
    constexpr int64_t kChunk = 8192;
    const int64_t chunks = (a.n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (a.n > 32768)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, a.n - i0);
      const void* graw = static_cast<const char*>(a.grad) + size_t(i0) * gsize;
      const T* g = static_cast<const T*>(graw);
      std::vector<T> wide;
      if (gt != a.dtype) {
        wide.resize(size_t(len));
        copy_strided(wide.data(), a.dtype, graw, gt, {len}, {1});
        g = wide.data();
      }
      update(p + i0, g, m + i0, v + i0, len);
      if (a.copy) copy_strided(static_cast<char*>(a.copy) + size_t(i0) * gsize, gt, p + i0, a.dtype, {len}, {1});
    }
  });
}

}  // namespace

void adamw(const AdamWArgs& a) { adamw_many(&a, 1); }

void adamw_many(const AdamWArgs* args, int64_t count) {
  check_adamw_batch(args, count, "cpu");
  for (int64_t i = 0; i < count; ++i) adamw_one(args[i]);
}

}  // namespace sg::kernels::cpu
