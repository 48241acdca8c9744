// Fused AdamW (decoupled weight decay) over many tensors in one launch, in place; each tensor has
// its own weight decay (biases and gains take none), the rest is shared. Parameters P are f32 or
// bf16 (bf16 weights are updated in f32 and rounded back); moments are f32. Gradients G are P, or
// bf16/f16 beside f32 parameters (a mixed-precision model's own gradients, widened as they are
// read); a tensor may also name a copy (G) that receives the updated parameter rounded to G (the
// model's half-precision weights, refreshed from their f32 master in the same pass).
// Per element, in the CPU table's order (the order PyTorch uses):
//   g *= grad_scale;  p *= 1 - lr wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#pragma once
#include <cmath>

#include "kernels/cuda/multi_tensor.cuh"

namespace sg::cuda {

struct AdamWTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  int64_t n = 0;
  double weight_decay = 0;
  void* copy = nullptr;
};

struct AdamWHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, grad_scale = 1.0;
  int64_t step = 1;  // 1-based
};

struct AdamWConstants {  // what every element needs, precomputed on the host in double
  float step_size, bc2_sqrt, b1, b2, eps, grad_scale;
};

template <class P, class G>
struct AdamWList {
  TensorChunks chunks;
  P* param[kMaxTensorsPerLaunch];
  const G* grad[kMaxTensorsPerLaunch];
  float* m[kMaxTensorsPerLaunch];
  float* v[kMaxTensorsPerLaunch];
  G* copy[kMaxTensorsPerLaunch];      // null: none
  float decay[kMaxTensorsPerLaunch];  // 1 - lr * weight_decay
};

template <class P, class G>
__global__ void adamw_kernel(AdamWList<P, G> list, AdamWConstants k) {
  int64_t begin, end;
  const int t = block_chunk(list.chunks, begin, end);
  // Distinct buffers (restrict) and every load before any store: the four loads of an element,
  // and of the unrolled next ones, are in flight together instead of waiting on the stores.
  P* __restrict__ p = list.param[t];
  const G* __restrict__ g = list.grad[t];
  G* __restrict__ copy = list.copy[t];
  float* __restrict__ m = list.m[t];
  float* __restrict__ v = list.v[t];
  SG_UNROLL(4)
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = to_f32(g[i]) * k.grad_scale, m0 = m[i], v0 = v[i], p0 = to_f32(p[i]);
    const float mi = k.b1 * m0 + (1.0f - k.b1) * gi;
    const float vi = k.b2 * v0 + ((1.0f - k.b2) * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    const P pi = from_f32<P>(p0 * list.decay[t] - k.step_size * mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
    p[i] = pi;
    if (copy) copy[i] = from_f32<G>(to_f32(pi));
  }
}

template <class P, class G = P>
void adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWHyper& h, Stream stream) {
  const double bc1 = 1.0 - std::pow(h.beta1, double(h.step)), bc2 = 1.0 - std::pow(h.beta2, double(h.step));
  const AdamWConstants k{float(h.lr / bc1), float(std::sqrt(bc2)), float(h.beta1),
                         float(h.beta2),      float(h.eps),           float(h.grad_scale)};
  for (size_t first = 0; first < tensors.size(); first += kMaxTensorsPerLaunch) {
    AdamWList<P, G> list;
    for (size_t i = first; i < tensors.size() && i < first + kMaxTensorsPerLaunch; ++i) {
      const int j = list.chunks.count;
      list.param[j] = static_cast<P*>(tensors[i].param);
      list.grad[j] = static_cast<const G*>(tensors[i].grad);
      list.m[j] = tensors[i].m;
      list.v[j] = tensors[i].v;
      list.copy[j] = static_cast<G*>(tensors[i].copy);
      list.decay[j] = float(1.0 - h.lr * tensors[i].weight_decay);
      list.chunks.add(tensors[i].n);
    }
    if (list.chunks.chunks() > 0)
      launch(adamw_kernel<P, G>, dim3(unsigned(list.chunks.chunks())), dim3(kTensorThreads), 0, stream, list, k);
  }
}

// The op-table entries (f32 master weights): one tensor, or many sharing all but weight decay.
inline void adamw_many(const kernels::AdamWArgs* args, int64_t count, Stream stream) {
  if (count == 0) return;
  kernels::check_adamw_batch(args, count, "cuda");
  const kernels::AdamWArgs& a = args[0];
  if (a.dtype != DType::f32) kernels::unsupported("adamw", a.dtype, "cuda");
  std::vector<AdamWTensor> list;
  for (int64_t i = 0; i < count; ++i)
    if (args[i].n)
      list.push_back({args[i].param, args[i].grad, static_cast<float*>(args[i].m), static_cast<float*>(args[i].v),
                      args[i].n, args[i].weight_decay, args[i].copy});
  const AdamWHyper h{a.lr, a.beta1, a.beta2, a.eps, a.grad_scale, a.step};
  switch (a.grad_type()) {
    case DType::f32: return adamw_multi<float, float>(list, h, stream);
    case DType::bf16: return adamw_multi<float, bf16>(list, h, stream);
    case DType::f16: return adamw_multi<float, f16>(list, h, stream);
    default: kernels::unsupported("adamw (gradient)", a.grad_type(), "cuda");
  }
}

inline void adamw(const kernels::AdamWArgs& a, Stream stream) { adamw_many(&a, 1, stream); }

}  // namespace sg::cuda
