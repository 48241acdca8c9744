// Fused AdamW (decoupled weight decay) over many tensors in one launch, in place. Parameters and
// gradients are f32 or bf16 (bf16 weights are updated in f32 and rounded back); moments are f32.
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
};

struct AdamWHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, grad_scale = 1.0;
  int64_t step = 1;  // 1-based
};

struct AdamWConstants {  // what every element needs, precomputed on the host in double
  float decay, step_size, bc2_sqrt, b1, b2, eps, grad_scale;
};

template <class T>
struct AdamWList {
  TensorChunks chunks;
  T* param[kMaxTensorsPerLaunch];
  const T* grad[kMaxTensorsPerLaunch];
  float* m[kMaxTensorsPerLaunch];
  float* v[kMaxTensorsPerLaunch];
};

template <class T>
__global__ void adamw_kernel(AdamWList<T> list, AdamWConstants k) {
  int64_t begin, end;
  const int t = block_chunk(list.chunks, begin, end);
  T* p = list.param[t];
  const T* g = list.grad[t];
  float *m = list.m[t], *v = list.v[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = to_f32(g[i]) * k.grad_scale;
    const float mi = k.b1 * m[i] + (1.0f - k.b1) * gi;
    const float vi = k.b2 * v[i] + ((1.0f - k.b2) * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = from_f32<T>(to_f32(p[i]) * k.decay - k.step_size * mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
  }
}

template <class T>
void adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWHyper& h, Stream stream) {
  const double bc1 = 1.0 - std::pow(h.beta1, double(h.step)), bc2 = 1.0 - std::pow(h.beta2, double(h.step));
  const AdamWConstants k{float(1.0 - h.lr * h.weight_decay), float(h.lr / bc1), float(std::sqrt(bc2)),
                         float(h.beta1),                     float(h.beta2),    float(h.eps),
                         float(h.grad_scale)};
  for (size_t first = 0; first < tensors.size(); first += kMaxTensorsPerLaunch) {
    AdamWList<T> list;
    for (size_t i = first; i < tensors.size() && i < first + kMaxTensorsPerLaunch; ++i) {
      const int j = list.chunks.count;
      list.param[j] = static_cast<T*>(tensors[i].param);
      list.grad[j] = static_cast<const T*>(tensors[i].grad);
      list.m[j] = tensors[i].m;
      list.v[j] = tensors[i].v;
      list.chunks.add(tensors[i].n);
    }
    launch(adamw_kernel<T>, dim3(unsigned(list.chunks.chunks())), dim3(kTensorThreads), 0, stream, list, k);
  }
}

// The op-table entry: one f32 tensor.
inline void adamw(const kernels::AdamWArgs& a, Stream stream) {
  if (a.dtype != DType::f32) kernels::unsupported("adamw", a.dtype, "cuda");
  adamw_multi<float>({AdamWTensor{a.param, a.grad, static_cast<float*>(a.m), static_cast<float*>(a.v), a.n}},
                     AdamWHyper{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, a.step}, stream);
}

}  // namespace sg::cuda
