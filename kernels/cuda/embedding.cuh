// Embedding on the device: row gather forward, deterministic scatter-add backward.
//   forward:  out[i, :] = weight[idx[i], :]            ('='; 128-bit packs when rows are aligned)
//   backward: dweight[idx[i], :] += dout[i, :]          ('+=')
// The backward gives every column to one thread, which walks the tokens in index order: the sum
// for each table row is formed in exactly the CPU's order, with no float atomics, so results do
// not depend on scheduling. (Its parallelism is C columns; a sort of the indices by row would
// expose more, at the cost of a workspace.)
#pragma once
#include "kernels/cuda/classifier.cuh"  // dispatch_index

namespace sg::cuda {

template <class T, class I>
__global__ void embedding_forward_kernel(T* out, const I* idx, const T* weight, int64_t C, int64_t num_rows,
                                         bool vectorised, int* bad_indices) {
  const int64_t i = blockIdx.x, r = int64_t(idx[i]);
  T* o = out + i * C;
  if (r < 0 || r >= num_rows) {  // zeros, and counted for the caller to report
    if (threadIdx.x == 0 && bad_indices) atomicAdd(bad_indices, 1);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = from_f32<T>(0.0f);
    return;
  }
  const T* w = weight + r * C;
  constexpr int N = Pack<T>::N;
  const int64_t packs = vectorised ? C / N : 0;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) store_pack(o + p * N, load_pack(w + p * N));
  for (int64_t c = packs * N + threadIdx.x; c < C; c += blockDim.x) o[c] = w[c];
}

template <class T, class I>
__global__ void embedding_backward_kernel(T* dweight, const T* dout, const I* idx, int64_t n, int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t i = 0; i < n; ++i) {
    T* d = dweight + int64_t(idx[i]) * C + c;
    *d = from_f32<T>(to_f32(*d) + to_f32(dout[i * C + c]));
  }
}

inline void embedding_forward(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n,
                              int64_t C, int64_t num_rows, int* bad_indices, Stream stream) {
  dispatch_storage(dtype, "embedding", [&](auto tag) {
    dispatch_index(idx_dtype, "embedding", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      const bool vec = aligned16(out) && aligned16(weight) && (C * int64_t(sizeof(T))) % 16 == 0;
      launch(embedding_forward_kernel<T, I>, dim3(unsigned(n)), dim3(128), 0, stream, static_cast<T*>(out),
             static_cast<const I*>(idx), static_cast<const T*>(weight), C, num_rows, vec, bad_indices);
    });
  });
}

inline void embedding_backward(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx,
                               int64_t n, int64_t C, Stream stream) {
  dispatch_storage(dtype, "embedding_backward", [&](auto tag) {
    dispatch_index(idx_dtype, "embedding_backward", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      launch(embedding_backward_kernel<T, I>, dim3(blocks_for(C, 128)), dim3(128), 0, stream,
             static_cast<T*>(dweight), static_cast<const T*>(dout), static_cast<const I*>(idx), n, C);
    });
  });
}

}  // namespace sg::cuda
