// GELU (tanh form, as GPT-2) on the device: forward and backward, f32 / bf16 / f16 storage with
// f32 math, 128-bit packs through map.cuh.
//   y  = 0.5 x (1 + t),  t = tanh(k (x + c x^3)),  k = sqrt(2/pi), c = 0.044715
//   dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2))          ('=')
#pragma once
#include "kernels/cuda/map.cuh"

namespace sg::cuda {

constexpr float kGeluK = 0.7978845608028654f, kGeluC = 0.044715f;

SG_DEVICE float gelu_value(float x) { return 0.5f * x * (1.0f + tanhf(kGeluK * (x + kGeluC * x * x * x))); }
SG_DEVICE float gelu_grad(float x) {
  const float t = tanhf(kGeluK * (x + kGeluC * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluC * x * x);
}

struct GeluForward {
  SG_DEVICE float operator()(float x) const { return gelu_value(x); }
};
struct GeluBackward {
  SG_DEVICE float operator()(float dy, float x) const { return dy * gelu_grad(x); }
};

template <class T>
void gelu_forward(T* y, const T* x, int64_t n, Stream stream) {
  map<1>(GeluForward{}, y, x, static_cast<const T*>(nullptr), n, stream);
}
template <class T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n, Stream stream) {
  map<2>(GeluBackward{}, dx, dy, x, n, stream);
}

}  // namespace sg::cuda
