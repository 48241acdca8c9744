// The fused classifier on the device: softmax + cross-entropy (+ its gradient) over
// logits[rows, Vp], of which only the first V columns are the vocabulary (Vp is padded for GEMM
// shapes). One block per row; probabilities are never written, only recomputed from the row's
// log-sum-exp. Semantics of the op table's cross_entropy / cross_entropy_backward:
//   lse[r] = log sum_{j<V} exp(x[r,j]);  loss[r] = lse[r] - x[r, t_r]   (0 when t_r == ignore_index)
//   dlogits[r,j] = (exp(x[r,j] - lse[r]) - [j == t_r]) dloss[r]  for j < V; 0 for j >= V and for
//   ignored rows                                                                      ('=')
// loss, lse and dloss are f32 whatever the logits' type. A target outside [0, V) that is not
// ignore_index gives loss 0 and increments *bad_targets (when given): the caller checks it.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

// Row r's log-sum-exp over its first V logits (every thread of the block gets it).
template <class T>
SG_DEVICE float row_logsumexp(const T* x, int64_t V, float* scratch) {
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f32(x[j]));
  m = block_reduce<true>(m, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f32(x[j]) - m);
  return m + logf(block_reduce<false>(s, scratch));
}

// dlogits of one row from its lse; dlogits may alias x (each element is read before it is written
// by the same thread).
template <class T>
SG_DEVICE void row_dlogits(T* g, const T* x, float lse, int64_t t, float d, int64_t Vp, int64_t V, bool ignored) {
  for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) {
    float v = 0.0f;
    if (!ignored && j < V) v = (expf(to_f32(x[j]) - lse) - (j == t ? 1.0f : 0.0f)) * d;
    g[j] = from_f32<T>(v);
  }
}

// Forward, and with kBackward also dlogits (in place over the logits if dlogits == logits).
template <class T, class I, bool kBackward>
__global__ void classifier_kernel(float* loss, float* lse, T* dlogits, const T* logits, const I* targets,
                                  const float* dloss, int64_t Vp, int64_t V, int64_t ignore_index, int* bad_targets) {
  SG_SHARED(float, scratch, 32);
  const int64_t r = blockIdx.x;
  const T* x = logits + r * Vp;
  const float s = row_logsumexp(x, V, scratch);
  const int64_t t = int64_t(targets[r]);
  const bool ignored = t == ignore_index, in_range = t >= 0 && t < V;
  if (threadIdx.x == 0) {
    if (!ignored && !in_range && bad_targets) atomicAdd(bad_targets, 1);
    if (lse) lse[r] = s;
    if (loss) loss[r] = ignored || !in_range ? 0.0f : s - to_f32(x[t]);
  }
  if constexpr (kBackward) {
    __syncthreads();  // x[t] is read above before the in-place write below
    row_dlogits(dlogits + r * Vp, x, s, t, dloss[r], Vp, V, ignored || !in_range);
  }
}

template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* dlogits, const float* dloss, const T* logits, const float* lse,
                                              const I* targets, int64_t Vp, int64_t V, int64_t ignore_index) {
  const int64_t r = blockIdx.x, t = int64_t(targets[r]);
  row_dlogits(dlogits + r * Vp, logits + r * Vp, lse[r], t, dloss[r], Vp, V, t == ignore_index || t < 0 || t >= V);
}

template <class Body>
void dispatch_index(DType t, const char* op, Body&& body) {
  if (t == DType::i32) return body(int32_t{});
  if (t == DType::i64) return body(int64_t{});
  kernels::unsupported(op, t, "cuda (targets/indices)");
}

constexpr int kClassifierThreads = 512;

// loss[r], lse[r] ('=').
inline void cross_entropy(DType dtype, DType tgt_dtype, float* loss, float* lse, const void* logits,
                          const void* targets, int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index,
                          int* bad_targets, Stream stream) {
  dispatch_storage(dtype, "cross_entropy", [&](auto tag) {
    dispatch_index(tgt_dtype, "cross_entropy", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      launch(classifier_kernel<T, I, false>, dim3(unsigned(rows)), dim3(kClassifierThreads), 0, stream, loss, lse,
             static_cast<T*>(nullptr), static_cast<const T*>(logits), static_cast<const I*>(targets),
             static_cast<const float*>(nullptr), Vp, V, ignore_index, bad_targets);
    });
  });
}

// dlogits from the saved lse ('=').
inline void cross_entropy_backward(DType dtype, DType tgt_dtype, void* dlogits, const float* dloss,
                                   const void* logits, const float* lse, const void* targets, int64_t rows, int64_t Vp,
                                   int64_t V, int64_t ignore_index, Stream stream) {
  dispatch_storage(dtype, "cross_entropy_backward", [&](auto tag) {
    dispatch_index(tgt_dtype, "cross_entropy_backward", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      launch(cross_entropy_backward_kernel<T, I>, dim3(unsigned(rows)), dim3(kClassifierThreads), 0, stream,
             static_cast<T*>(dlogits), dloss, static_cast<const T*>(logits), lse, static_cast<const I*>(targets), Vp,
             V, ignore_index);
    });
  });
}

// Forward and backward in one pass over the logits (llm.c's fused classifier): loss, lse and
// dlogits ('='), dlogits may be the logits buffer itself. dloss[r] is known before the forward
// (e.g. 1 / number of counted targets for a mean loss).
inline void classifier_forward_backward(DType dtype, DType tgt_dtype, float* loss, float* lse, void* dlogits,
                                        const void* logits, const void* targets, const float* dloss, int64_t rows,
                                        int64_t Vp, int64_t V, int64_t ignore_index, int* bad_targets, Stream stream) {
  dispatch_storage(dtype, "classifier_forward_backward", [&](auto tag) {
    dispatch_index(tgt_dtype, "classifier_forward_backward", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      launch(classifier_kernel<T, I, true>, dim3(unsigned(rows)), dim3(kClassifierThreads), 0, stream, loss, lse,
             static_cast<T*>(dlogits), static_cast<const T*>(logits), static_cast<const I*>(targets), dloss, Vp, V,
             ignore_index, bad_targets);
    });
  });
}

}  // namespace sg::cuda
