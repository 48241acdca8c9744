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
#include "kernels/cuda/variants.h"

namespace sg::cuda {

// Elements [0, n) of a row through f(j, value), each thread taking a share: 16-byte pieces where
// the row allows (p 16-byte aligned), then the tail (or all of it) element by element.
template <class T, class F>
SG_DEVICE void for_row(const T* p, int64_t n, F&& f) {
  constexpr int kPer = int(16 / sizeof(T));
  const int64_t whole = aligned16(p) ? n / kPer : 0;
  SG_UNROLL(4) for (int64_t k = threadIdx.x; k < whole; k += blockDim.x) {  // loads in flight together
    const Pack<T> pk = load_pack(p + k * kPer);
    for (int e = 0; e < kPer; ++e) f(k * kPer + e, to_f32(pk.v[e]));
  }
  for (int64_t j = whole * kPer + threadIdx.x; j < n; j += blockDim.x) f(j, to_f32(p[j]));
}

// (m, s): a running max and a sum of exp(x - m); merging two is the online softmax's step.
SG_DEVICE void merge_max_sum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);  // fmaxf drops a NaN: the sums carry it (a NaN side's s is NaN)
  s = mm == -INFINITY ? s + s2 : s * expf(m - mm) + s2 * expf(m2 - mm);
  m = mm;
}

// exp for the classifier: the hardware's exp2 (__expf, a few ulp) for half logits, whose
// gradients are rounded to 8 or 11 bits anyway; the accurate expf for f32.
template <class T>
SG_DEVICE float classifier_exp(float x) {
#ifdef __CUDACC__
  if constexpr (!std::is_same_v<T, float>) return __expf(x);
#endif
  return expf(x);
}

// Row r's log-sum-exp over its first V logits, in one pass over them (every thread of the block
// gets it): each thread keeps a running max and the sum rescaled to it, then the block merges the
// pairs in a fixed tree (run-to-run deterministic). scratch: 64 floats of shared memory.
template <class T>
SG_DEVICE float row_logsumexp(const T* x, int64_t V, float* scratch) {
  float m = -INFINITY, s = 0.0f;
  for_row(x, V, [&](int64_t, float v) {
    if (!(v <= m)) {  // v > m, or a NaN, which then rides in m and s to the result (as on the CPU)
      s = s * classifier_exp<T>(m - v) + 1.0f;  // m = -inf at first: s is 0 then
      m = v;
    } else if (v > -INFINITY) {
      s += classifier_exp<T>(v - m);
    }
  });
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o), s2 = __shfl_xor_sync(kFullMask, s, o);
    merge_max_sum(m, s, m2, s2);
  }
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
  if (lane == 0) scratch[warp] = m, scratch[32 + warp] = s;
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? scratch[lane] : -INFINITY;
    s = lane < warps ? scratch[32 + lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(kFullMask, m, o), s2 = __shfl_xor_sync(kFullMask, s, o);
      merge_max_sum(m, s, m2, s2);
    }
    if (lane == 0) scratch[0] = m + logf(s);
  }
  __syncthreads();
  const float lse = scratch[0];
  __syncthreads();  // scratch may be reused after this
  return lse;
}

// dlogits of one row from its lse; dlogits may alias x (each element, or 16-byte piece, is read
// before it is written by the same thread). kReversed: the 16-byte pieces from the row's end, as
// last uses (Classifier::reversed).
template <class T, bool kReversed = false>
SG_DEVICE void row_dlogits(T* g, const T* x, float lse, int64_t t, float d, int64_t Vp, int64_t V, bool ignored) {
  const auto grad = [&](int64_t j, float v) {
    return !ignored && j < V ? (classifier_exp<T>(v - lse) - (j == t ? 1.0f : 0.0f)) * d : 0.0f;
  };
  constexpr int kPer = int(16 / sizeof(T));
  const int64_t whole = aligned16(x) && aligned16(g) ? Vp / kPer : 0;
  SG_UNROLL(4) for (int64_t i = threadIdx.x; i < whole; i += blockDim.x) {
    const int64_t k = kReversed ? whole - 1 - i : i;
    const Pack<T> in = kReversed ? load_pack_last_use(x + k * kPer) : load_pack(x + k * kPer);
    Pack<T> out;
    for (int e = 0; e < kPer; ++e) out.v[e] = from_f32<T>(grad(k * kPer + e, to_f32(in.v[e])));
    if constexpr (kReversed)
      store_pack_last_use(g + k * kPer, out);
    else
      store_pack(g + k * kPer, out);
  }
  for (int64_t j = whole * kPer + threadIdx.x; j < Vp; j += blockDim.x) g[j] = from_f32<T>(grad(j, to_f32(x[j])));
}

// Row r's target t, given its log-sum-exp s over the row x: thread 0 stores lse[r] and loss[r]
// (when given; the loss 0 for an ignored row or a target outside [0, V), which is counted in
// *bad_targets). Returns t, or -1 when the row gets no gradient (ignored or out of range).
template <class T, class I>
SG_DEVICE int64_t row_loss(float* loss, float* lse, int* bad_targets, const T* x, const I* targets, int64_t r, float s,
                           int64_t V, int64_t ignore_index) {
  const int64_t t = int64_t(targets[r]);
  const bool ignored = t == ignore_index, in_range = t >= 0 && t < V;
  if (threadIdx.x == 0) {
    if (!ignored && !in_range && bad_targets) atomicAdd(bad_targets, 1);
    if (lse) lse[r] = s;
    if (loss) loss[r] = ignored || !in_range ? 0.0f : s - to_f32(x[t]);
  }
  return ignored || !in_range ? -1 : t;
}

// One block of 512 threads per row, four blocks an SM (at most 32 registers a thread): measured on
// an H200 at GPT-2's 16384 x 50304 bf16 logits (bench/RESULTS.md), this beat 1024-thread blocks
// (fewer rows in flight) and a kernel holding the row in registers (one block an SM; git d36249f).
constexpr int kClassifierThreads = 512;

// Forward, and with kBackward also dlogits with the same dloss for every row (in place over the
// logits if dlogits == logits); kReversed: the second pass from the row's end (Classifier::reversed).
template <class T, class I, bool kBackward, bool kReversed = false>
__global__ void __launch_bounds__(kClassifierThreads, 4) classifier_kernel(float* loss, float* lse, T* dlogits, const T* logits, const I* targets, float dloss,
                                  int64_t Vp, int64_t V, int64_t ignore_index, int* bad_targets) {
  SG_SHARED(float, scratch, 64);
  const int64_t r = blockIdx.x;
  const T* x = logits + r * Vp;
  const float s = row_logsumexp(x, V, scratch);
  const int64_t t = row_loss(loss, lse, bad_targets, x, targets, r, s, V, ignore_index);
  if constexpr (kBackward) {
    __syncthreads();  // x[t] is read above before the in-place write below
    row_dlogits<T, kReversed>(dlogits + r * Vp, x, s, t, dloss, Vp, V, t < 0);
  }
}

// The fused pass with the row staged in shared memory (Classifier::staged): the row is read from
// memory once, 16 bytes a thread at a time with four loads in flight, and both passes (the
// log-sum-exp, then dlogits and the loss's target logit) read the copy. 1024 threads and at most
// 110 KiB a row, so two blocks an SM: one can load while the other reduces or stores.
constexpr int kStagedThreads = 1024;
constexpr int64_t kStagedRowBytes = 110 * 1024;

template <class T>
bool classifier_stages(const void* logits, const void* dlogits, int64_t Vp) {
  return Vp % Pack<T>::N == 0 && Vp * int64_t(sizeof(T)) <= kStagedRowBytes && aligned16(logits) && aligned16(dlogits);
}

template <class T, class I>
__global__ void __launch_bounds__(kStagedThreads, 2)
    classifier_staged_kernel(float* loss, float* lse, T* dlogits, const T* logits, const I* targets, float dloss,
                             int64_t Vp, int64_t V, int64_t ignore_index, int* bad_targets) {
  constexpr int kPer = Pack<T>::N;
  SG_SHARED(float, scratch, 64);
  SG_DYNAMIC_SHARED(T, row);  // Vp elements
  const int64_t r = blockIdx.x;
  const T* x = logits + r * Vp;
  SG_UNROLL(4) for (int64_t k = threadIdx.x; k < Vp / kPer; k += blockDim.x) {
    store_pack(row + k * kPer, load_pack(x + k * kPer));
  }
  __syncthreads();
  const float s = row_logsumexp(row, V, scratch);
  const int64_t t = row_loss(loss, lse, bad_targets, row, targets, r, s, V, ignore_index);
  row_dlogits(dlogits + r * Vp, row, s, t, dloss, Vp, V, t < 0);  // the copy is never written
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

// loss[r], lse[r] ('=').
inline void cross_entropy(DType dtype, DType tgt_dtype, float* loss, float* lse, const void* logits,
                          const void* targets, int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index,
                          int* bad_targets, Stream stream) {
  dispatch_storage(dtype, "cross_entropy", [&](auto tag) {
    dispatch_index(tgt_dtype, "cross_entropy", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      launch(classifier_kernel<T, I, false>, dim3(blocks_for(rows, 1)), dim3(kClassifierThreads), 0, stream, loss, lse,
             static_cast<T*>(nullptr), static_cast<const T*>(logits), static_cast<const I*>(targets), 0.0f, Vp, V,
             ignore_index, bad_targets);
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
      launch(cross_entropy_backward_kernel<T, I>, dim3(blocks_for(rows, 1)), dim3(kClassifierThreads), 0, stream,
             static_cast<T*>(dlogits), dloss, static_cast<const T*>(logits), lse, static_cast<const I*>(targets), Vp,
             V, ignore_index);
    });
  });
}

// Forward and backward in one read of the logits from memory (the fused classifier): loss, lse
// (when given) and dlogits ('='), dlogits may be the logits buffer itself. dloss is the same for
// every row and known before the forward (e.g. 1 / number of counted targets for a mean loss).
// kind: streaming (the block's second pass over its row reads what its first brought into L2),
// reversed (that second pass from the row's end) or staged (the row copied into shared memory)
// where classifier_stages allows.
inline void classifier_forward_backward(DType dtype, DType tgt_dtype, float* loss, float* lse, void* dlogits,
                                        const void* logits, const void* targets, float dloss, int64_t rows,
                                        int64_t Vp, int64_t V, int64_t ignore_index, int* bad_targets, Stream stream,
                                        Classifier kind = Classifier::streaming) {
  dispatch_storage(dtype, "classifier_forward_backward", [&](auto tag) {
    dispatch_index(tgt_dtype, "classifier_forward_backward", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      if (kind == Classifier::staged && classifier_stages<T>(logits, dlogits, Vp))
        return launch(classifier_staged_kernel<T, I>, dim3(blocks_for(rows, 1)), dim3(kStagedThreads),
                      size_t(Vp) * sizeof(T), stream, loss, lse, static_cast<T*>(dlogits),
                      static_cast<const T*>(logits), static_cast<const I*>(targets), dloss, Vp, V, ignore_index,
                      bad_targets);
      launch(kind == Classifier::reversed ? classifier_kernel<T, I, true, true> : classifier_kernel<T, I, true>,
             dim3(blocks_for(rows, 1)), dim3(kClassifierThreads), 0, stream, loss, lse, static_cast<T*>(dlogits),
             static_cast<const T*>(logits), static_cast<const I*>(targets), dloss, Vp, V, ignore_index, bad_targets);
    });
  });
}

}  // namespace sg::cuda
