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
  bool quads[kMaxTensorsPerLaunch];   // every array aligned for 4-element vector accesses
};

// One element's update, in the order of the header's formula. Returns the new parameter; m, v in place.
SG_DEVICE float adamw_update(float p, float g, float& m, float& v, float decay, const AdamWConstants& k) {
  g *= k.grad_scale;
  m = k.b1 * m + (1.0f - k.b1) * g;
  v = k.b2 * v + ((1.0f - k.b2) * g) * g;
  return p * decay - k.step_size * m / (sqrtf(v) / k.bc2_sqrt + k.eps);
}

// Four elements a thread at a time where the tensor's arrays allow: one 16-byte access for each
// f32 array, 8 bytes for a half one (the loads of an element group are in flight together); the
// tensor's tail, and a tensor at an odd offset, one element at a time.
template <class P, class G>
__global__ void adamw_kernel(AdamWList<P, G> list, AdamWConstants k) {
  int64_t begin, end;
  const int t = block_chunk(list.chunks, begin, end);
  // Distinct buffers (restrict) and every load before any store.
  P* __restrict__ p = list.param[t];
  const G* __restrict__ g = list.grad[t];
  G* __restrict__ copy = list.copy[t];
  float* __restrict__ m = list.m[t];
  float* __restrict__ v = list.v[t];
  const float decay = list.decay[t];
  const int64_t quads = list.quads[t] ? (end - begin) / 4 : 0;  // begin is a multiple of 4 (chunks of 4096)
  SG_UNROLL(2)
  for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
    const int64_t i = begin + 4 * q;
    const Pack<G, 4> gq = load_pack<G, 4>(g + i);
    const Pack<P, 4> p0 = load_pack<P, 4>(p + i);
    Pack<float, 4> mq = load_pack<float, 4>(m + i), vq = load_pack<float, 4>(v + i);
    Pack<P, 4> pq;
    for (int j = 0; j < 4; ++j)
      pq.v[j] = from_f32<P>(adamw_update(to_f32(p0.v[j]), to_f32(gq.v[j]), mq.v[j], vq.v[j], decay, k));
    store_pack(m + i, mq);
    store_pack(v + i, vq);
    store_pack(p + i, pq);
    if (copy) {
      Pack<G, 4> cq;
      for (int j = 0; j < 4; ++j) cq.v[j] = from_f32<G>(to_f32(pq.v[j]));
      store_pack(copy + i, cq);
    }
  }
  SG_UNROLL(4)
  for (int64_t i = begin + 4 * quads + threadIdx.x; i < end; i += blockDim.x) {
    float mi = m[i], vi = v[i];
    const P pi = from_f32<P>(adamw_update(to_f32(p[i]), to_f32(g[i]), mi, vi, decay, k));
    m[i] = mi;
    v[i] = vi;
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
      const AdamWTensor& x = tensors[i];
      list.quads[j] = aligned_to(x.param, 4 * sizeof(P)) && aligned_to(x.grad, 4 * sizeof(G)) && aligned16(x.m) &&
                      aligned16(x.v) && aligned_to(x.copy, 4 * sizeof(G));  // (a null copy is aligned)
      list.chunks.add(tensors[i].n);
    }
    if (list.chunks.chunks() > 0)
      launch(adamw_kernel<P, G>, dim3(blocks_for(list.chunks.chunks(), 1)), dim3(kTensorThreads), 0, stream, list, k);
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
