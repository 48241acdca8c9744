// Global gradient norm on the device: the squared L2 norm of many tensors, each with a weight (0 or
// 1 for the mesh's "count this replica once"), in two deterministic passes: (1) one block per
// kTensorChunk chunk writes its weighted sum of squares to partial[chunk];
// (2) one block adds the partials in a fixed order. Same bits on every run; the squared norm is
// what shards all-reduce before the square root (clipping by global norm).
#pragma once
#include "kernels/cuda/multi_tensor.cuh"

namespace sg::cuda {

struct NormTensor {
  const void* data = nullptr;
  int64_t n = 0;
  float weight = 1.0f;
};

template <class T>
struct NormList {
  TensorChunks chunks;
  const T* data[kMaxTensorsPerLaunch];
  float weight[kMaxTensorsPerLaunch];
  bool packs[kMaxTensorsPerLaunch];  // the tensor is 16-byte aligned: 16-byte loads
};

// A thread reads Pack<T>::N elements (16 bytes) a load where the tensor is aligned for it, the
// chunk's tail (and an unaligned tensor) one element at a time. Each thread sums its elements in
// a fixed order and the block in a fixed tree: the same bits on every run.
template <class T>
__global__ void norm_partial_kernel(NormList<T> list, float* partial) {
  SG_SHARED(float, scratch, 32);
  constexpr int N = Pack<T>::N;
  int64_t begin, end;
  const int t = block_chunk(list.chunks, begin, end);
  const T* __restrict__ x = list.data[t];
  const int64_t packs = list.packs[t] ? (end - begin) / N : 0;  // begin is a multiple of N (chunks of 4096)
  float acc = 0.0f;
  SG_UNROLL(2)  // loads in flight together; the sum keeps its order
  for (int64_t q = threadIdx.x; q < packs; q += blockDim.x) {
    const Pack<T> v = load_pack<T>(x + begin + N * q);
    for (int j = 0; j < N; ++j) {
      const float f = to_f32(v.v[j]);
      acc += f * f;
    }
  }
  for (int64_t i = begin + N * packs + threadIdx.x; i < end; i += blockDim.x) {
    const float f = to_f32(x[i]);
    acc += f * f;
  }
  acc = block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc * list.weight[t];
}

static __global__ void sum_partials_kernel(float* out, const float* partial, int64_t n) {
  SG_SHARED(float, scratch, 32);
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) *out = acc;
}

// The op table's sum_squares_many list as the kernels take it: the empty tensors and those of
// weight 0 left out: not read at all (kernels/ops.h), as on the CPU.
inline std::vector<NormTensor> norm_tensors(const void* const* xs, const int64_t* ns, const double* weights,
                                            int64_t count) {
  std::vector<NormTensor> list;
  for (int64_t i = 0; i < count; ++i)
    if (ns[i] && weights[i] != 0) list.push_back({xs[i], ns[i], float(weights[i])});
  return list;
}

// Workspace (f32 elements) for these tensors.
inline int64_t global_norm_workspace(const std::vector<NormTensor>& tensors) {
  int64_t chunks = 0;
  for (const auto& t : tensors) chunks += chunks_of(t.n);
  return chunks;
}

// *out = sum over the tensors of weight * sum x^2 ('='). T: the tensors' storage type.
template <class T>
void global_norm_squared(float* out, const std::vector<NormTensor>& tensors, float* workspace, Stream stream) {
  int64_t written = 0;
  for (size_t first = 0; first < tensors.size(); first += kMaxTensorsPerLaunch) {
    NormList<T> list;
    for (size_t i = first; i < tensors.size() && i < first + kMaxTensorsPerLaunch; ++i) {
      list.data[list.chunks.count] = static_cast<const T*>(tensors[i].data);
      list.weight[list.chunks.count] = tensors[i].weight;
      list.packs[list.chunks.count] = aligned16(tensors[i].data);
      list.chunks.add(tensors[i].n);
    }
    if (list.chunks.chunks() > 0)
      launch(norm_partial_kernel<T>, dim3(blocks_for(list.chunks.chunks(), 1)), dim3(kTensorThreads), 0, stream, list,
             workspace + written);
    written += list.chunks.chunks();
  }
  launch(sum_partials_kernel, dim3(1), dim3(256), 0, stream, out, static_cast<const float*>(workspace), written);
}

}  // namespace sg::cuda
