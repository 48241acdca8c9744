// Row softmax / log-softmax on the device, forward and backward: one block per row, f32 math,
// f32 / bf16 / f16 storage. The cross-entropy that never materialises probabilities is in
// classifier.cuh.
//   forward:  y = exp(x - m) / s   or   y = x - (m + log s),   m = max x, s = sum exp(x - m)
//   backward: dx = y (dy - sum(dy y))   or   dx = dy - exp(y) sum(dy)            ('=')
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

constexpr int kRowThreads = 256;

template <class T>
__global__ void softmax_forward_kernel(T* y, const T* x, int64_t cols, bool log) {
  SG_SHARED(float, scratch, 32);
  const T* xr = x + int64_t(blockIdx.x) * cols;
  T* yr = y + int64_t(blockIdx.x) * cols;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]));
  m = block_reduce<true>(m, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += expf(to_f32(xr[j]) - m);
  s = block_reduce<false>(s, scratch);
  const float lse = m + logf(s), inv = 1.0f / s;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = to_f32(xr[j]);
    yr[j] = from_f32<T>(log ? v - lse : expf(v - m) * inv);
  }
}

template <class T>
__global__ void softmax_backward_kernel(T* dx, const T* dy, const T* y, int64_t cols, bool log) {
  SG_SHARED(float, scratch, 32);
  const int64_t off = int64_t(blockIdx.x) * cols;
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
    s += log ? to_f32(dy[off + j]) : to_f32(dy[off + j]) * to_f32(y[off + j]);
  s = block_reduce<false>(s, scratch);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_f32(dy[off + j]), v = to_f32(y[off + j]);
    dx[off + j] = from_f32<T>(log ? g - expf(v) * s : v * (g - s));
  }
}

inline void softmax(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, bool log, Stream stream) {
  dispatch_storage(dtype, "softmax", [&](auto tag) {
    using T = decltype(tag);
    launch(softmax_forward_kernel<T>, dim3(blocks_for(rows, 1)), dim3(kRowThreads), 0, stream, static_cast<T*>(y),
           static_cast<const T*>(x), cols, log);
  });
}

inline void softmax_backward(DType dtype, void* dx, const void* dy, const void* y, int64_t rows, int64_t cols, bool log,
                             Stream stream) {
  dispatch_storage(dtype, "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    launch(softmax_backward_kernel<T>, dim3(blocks_for(rows, 1)), dim3(kRowThreads), 0, stream, static_cast<T*>(dx),
           static_cast<const T*>(dy), static_cast<const T*>(y), cols, log);
  });
}

}  // namespace sg::cuda
