// What the GPU sandboxes (bench/*_gpu.cpp) share: device buffers of random values, and the median
// time over CUDA events on cuda:0's compute stream, where the op table's kernels run.
#pragma once
#include <algorithm>
#include <vector>

#include "core/storage.h"
#include "kernels/cuda/runtime.h"
#include "kernels/ops.h"

namespace sg::bench {

// n values of dtype on cuda:0, normal(mean, std) from Philox stream `seed`.
struct DeviceBuffer {
  Storage s;
  DeviceBuffer(int64_t n, DType dtype, uint64_t seed, double mean = 0.0, double std = 1.0)
      : s(size_t(n) * dtype_size(dtype), Device::cuda(0), MemCategory::activation) {
    kernels::table(Device::cuda(0)).random(dtype, s.data(), n, true, mean, std, seed, 0, 0);
  }
  void* get() const { return s.data(); }
};

// Median milliseconds of f over `reps` runs, after `warm` untimed ones.
template <class F>
double median_ms(F&& f, int warm = 3, int reps = 20) {
  const cudaStream_t s = cuda::compute_stream(Device::cuda(0));
  for (int i = 0; i < warm; ++i) f();
  cudaEvent_t start, stop;
  SG_CUDA_CHECK(cudaEventCreate(&start));
  SG_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    SG_CUDA_CHECK(cudaEventRecord(start, s));
    f();
    SG_CUDA_CHECK(cudaEventRecord(stop, s));
    SG_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    SG_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  SG_CUDA_CHECK(cudaEventDestroy(start));
  SG_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace sg::bench
