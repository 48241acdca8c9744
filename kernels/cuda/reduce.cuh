// Axis reductions on the device: out[outer, inner] = sum / max / sum of squares over the middle
// axis of x[outer, n, inner]. f32 accumulation in a fixed order (thread stride, then the block's
// fixed tree), so repeated runs give identical bits. The CPU accumulates sums in f64.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

using kernels::Reduce;

SG_DEVICE float reduce_step(Reduce op, float acc, float v) {
  switch (op) {
    case Reduce::sum: return acc + v;
    case Reduce::sum_squares: return acc + v * v;
    case Reduce::max: return v > acc ? v : acc;
  }
  return acc;
}

// inner == 1: one block per row of x[outer, n].
template <class T>
__global__ void reduce_rows_kernel(Reduce op, T* out, const T* x, int64_t n) {
  SG_SHARED(float, scratch, 32);
  const T* row = x + int64_t(blockIdx.x) * n;
  float acc = op == Reduce::max ? -INFINITY : 0.0f;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) acc = reduce_step(op, acc, to_f32(row[k]));
  acc = op == Reduce::max ? block_reduce<true>(acc, scratch) : block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = from_f32<T>(acc);
}

// inner > 1: one thread per output; neighbouring threads read neighbouring columns (coalesced).
template <class T>
__global__ void reduce_columns_kernel(Reduce op, T* out, const T* x, int64_t outer, int64_t n, int64_t inner) {
  const int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= outer * inner) return;
  const T* base = x + (o / inner) * n * inner + o % inner;
  float acc = op == Reduce::max ? -INFINITY : 0.0f;
  for (int64_t k = 0; k < n; ++k) acc = reduce_step(op, acc, to_f32(base[k * inner]));
  out[o] = from_f32<T>(acc);
}

inline void reduce(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner,
                   Stream stream) {
  if (outer * inner == 0) return;
  dispatch_storage(dtype, "reduce", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto* p = static_cast<const T*>(x);
    if (inner == 1) return launch(reduce_rows_kernel<T>, dim3(unsigned(outer)), dim3(256), 0, stream, op, o, p, n);
    launch(reduce_columns_kernel<T>, dim3(blocks_for(outer * inner, 256)), dim3(256), 0, stream, op, o, p, outer, n,
           inner);
  });
}

}  // namespace sg::cuda
