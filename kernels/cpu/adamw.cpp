// AdamW update on the CPU (Loshchilov & Hutter, decoupled weight decay), in place.
#include <cmath>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

// p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
// p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)      (the order PyTorch uses)
void adamw(const AdamWArgs& a) {
  dispatch_float(a.dtype, "adamw", [&](auto tag) {
    using T = decltype(tag);
    auto* p = static_cast<T*>(a.param);
    auto* g = static_cast<const T*>(a.grad);
    auto* m = static_cast<T*>(a.m);
    auto* v = static_cast<T*>(a.v);
    const double bc1 = 1.0 - std::pow(a.beta1, double(a.step));
    const double bc2 = 1.0 - std::pow(a.beta2, double(a.step));
    const T step_size = T(a.lr / bc1), bc2_sqrt = T(std::sqrt(bc2));
    const T decay = T(1.0 - a.lr * a.weight_decay), b1 = T(a.beta1), b2 = T(a.beta2), eps = T(a.eps);
    const T gs = T(a.grad_scale);
#pragma omp parallel for schedule(static) if (a.n > 32768)
    for (int64_t i = 0; i < a.n; ++i) {
      T gi = g[i] * gs;
      m[i] = b1 * m[i] + (T(1) - b1) * gi;
      v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
      p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + eps);
    }
  });
}

}  // namespace sg::kernels::cpu
