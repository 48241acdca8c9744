// Multi-tensor launches: one kernel over many tensors, each cut into fixed chunks of
// kTensorChunk elements, one block per chunk. The tensor list travels in the kernel arguments
// (at most kMaxTensorsPerLaunch per launch, well inside the 4 KiB argument limit); launchers
// split longer lists into several launches.
#pragma once
#include <vector>

#include "kernels/cuda/common.cuh"

namespace sg::cuda {

constexpr int kMaxTensorsPerLaunch = 24;
constexpr int64_t kTensorChunk = 4096;
constexpr int kTensorThreads = 256;

struct TensorChunks {
  int count = 0;
  int64_t n[kMaxTensorsPerLaunch] = {};
  int64_t first_chunk[kMaxTensorsPerLaunch + 1] = {};  // prefix sums of each tensor's chunk count

  void add(int64_t elements) {
    n[count] = elements;
    first_chunk[count + 1] = first_chunk[count] + (elements + kTensorChunk - 1) / kTensorChunk;
    ++count;
  }
  int64_t chunks() const { return first_chunk[count]; }
};

inline int64_t chunks_of(int64_t n) { return (n + kTensorChunk - 1) / kTensorChunk; }

// The block's tensor and the element range [begin, end) of its chunk.
SG_DEVICE int block_chunk(const TensorChunks& c, int64_t& begin, int64_t& end) {
  const int64_t chunk = blockIdx.x;
  int t = 0;
  while (chunk >= c.first_chunk[t + 1]) ++t;
  begin = (chunk - c.first_chunk[t]) * kTensorChunk;
  end = begin + kTensorChunk < c.n[t] ? begin + kTensorChunk : c.n[t];
  return t;
}

}  // namespace sg::cuda
