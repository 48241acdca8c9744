// Philox family on the device: dropout (forward and backward) and uniform/normal fills. Element i
// uses Philox(seed, stream, index) from core/philox.h, the same function the CPU kernels call, so
// a GPU mask equals the CPU mask bit for bit (uniform() is integer arithmetic; normal() goes
// through the device's logf/cosf, which may differ from the host libm in the last ulp).
//   dropout forward:  out = x keep / (1 - p),  keep = uniform(seed, stream + r, first + j) >= p
//                     for element j of row r (rows of row_len)                             ('=')
//   dropout backward: dx = dy keep / (1 - p), the same draw                               ('=')
#pragma once
#include "core/philox.h"
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

// I: the index type. uint32_t whenever n fits it (every tensor of GPT-2 124M's training), as the
// row and column of an element take a division, and a 64-bit one is a long software routine on
// the GPU where a 32-bit one is a few instructions.
template <class T, class I>
__global__ void dropout_kernel(T* out, const T* x, I n, float p, float scale, uint64_t seed, uint64_t stream,
                               I row_len, uint64_t first) {
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I r = i / row_len, j = i - r * row_len;
    out[i] = Philox::uniform(seed, stream + r, first + j) >= p ? from_f32<T>(to_f32(x[i]) * scale) : from_f32<T>(0.0f);
  }
}

// Computed in double like the CPU table, so f32 fills match it exactly.
template <class T>
__global__ void random_kernel(T* out, int64_t n, bool normal, double a, double b, uint64_t seed, uint64_t stream,
                              uint64_t first) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t idx = first + uint64_t(i);
    const double v = normal ? a + b * double(Philox::normal(seed, stream, idx))
                            : a + (b - a) * double(Philox::uniform(seed, stream, idx));
    out[i] = from_f32<T>(float(v));
  }
}

constexpr int kPhiloxThreads = 256;

inline void dropout(DType dtype, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t rng_stream,
                    int64_t row_len, uint64_t first, Stream stream) {
  SG_CHECK(row_len > 0 && n % row_len == 0, "dropout (cuda): ", n, " elements are not rows of ", row_len);
  dispatch_storage(dtype, "dropout", [&](auto tag) {
    using T = decltype(tag);
    const auto run = [&](auto index) {
      using I = decltype(index);
      launch(dropout_kernel<T, I>, dim3(blocks_for(n, kPhiloxThreads)), dim3(kPhiloxThreads), 0, stream,
             static_cast<T*>(out), static_cast<const T*>(x), I(n), float(p), float(1.0 / (1.0 - p)), seed, rng_stream,
             I(row_len), first);
    };
    // i + the grid's stride must not wrap either: 32 bits while n stays a grid below 2^32
    if (n + int64_t(kPhiloxThreads) * blocks_for(n, kPhiloxThreads) < (int64_t(1) << 32)) run(uint32_t{});
    else run(uint64_t{});
  });
}

// The backward is the forward applied to dy with the same draw.
inline void dropout_backward(DType dtype, void* dx, const void* dy, int64_t n, double p, uint64_t seed,
                             uint64_t rng_stream, int64_t row_len, uint64_t first, Stream stream) {
  dropout(dtype, dx, dy, n, p, seed, rng_stream, row_len, first, stream);
}

inline void random(DType dtype, void* out, int64_t n, bool normal, double a, double b, uint64_t seed,
                   uint64_t rng_stream, uint64_t first, Stream stream) {
  dispatch_storage(dtype, "random", [&](auto tag) {
    using T = decltype(tag);
    launch(random_kernel<T>, dim3(blocks_for(n, kPhiloxThreads)), dim3(kPhiloxThreads), 0, stream,
           static_cast<T*>(out), n, normal, a, b, seed, rng_stream, first);
  });
}

}  // namespace sg::cuda
