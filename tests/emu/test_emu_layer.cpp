// The emulation layer itself: the built-ins no kernel of kernels/cuda exercises yet behave as the
// CUDA programming guide documents them (ballot, shuffle variants with widths, atomics, 2-D
// blocks and grids, shared memory visible across the block after __syncthreads).
#include "tests/catch.h"
#include <vector>

#include "kernels/cuda/common.cuh"

namespace cu = sg::cuda;

namespace {

// Per thread of a 64-thread block: ballot of odd lanes, shfl_down by 3, shfl from lane 5 within
// 8-lane segments, shfl_xor 16; block-wide: the sum of thread ids via a shared array; grid-wide:
// atomic sum and max.
__global__ void builtins_kernel(unsigned* ballot, int* down, int* seg, int* xr, int* shared_sum, int* total,
                                int* biggest) {
  SG_SHARED(int, ids, 64);
  const int t = int(threadIdx.x), lane = t % 32;
  const int g = int(blockIdx.x) * 64 + t;
  ballot[g] = __ballot_sync(cu::kFullMask, lane % 2);
  down[g] = __shfl_down_sync(cu::kFullMask, t, 3);
  seg[g] = __shfl_sync(cu::kFullMask, t, 5, 8);
  xr[g] = __shfl_xor_sync(cu::kFullMask, t, 16);
  ids[t] = t;
  __syncthreads();
  int s = 0;
  for (int i = 0; i < 64; ++i) s += ids[i];
  shared_sum[g] = s;
  atomicAdd(total, g);
  atomicMax(biggest, g * 3 % 101);
}

__global__ void coordinates_kernel(int* out) {
  const unsigned bx = blockIdx.x + gridDim.x * blockIdx.y, tx = threadIdx.x + blockDim.x * threadIdx.y;
  out[bx * blockDim.x * blockDim.y + tx] = int(blockIdx.y * 1000 + blockIdx.x * 100 + threadIdx.y * 10 + threadIdx.x);
}

// Each thread writes its slot of shared memory, then reads a neighbour's slot (offset +1 or -1)
// with (sync = 1) or without (sync = 0) the barrier between.
__global__ void neighbour_kernel(int* out, int offset, int sync) {
  SG_SHARED(int, slot, 64);
  const int t = int(threadIdx.x);
  slot[t] = t;
  if (sync) __syncthreads();
  out[int(blockIdx.x) * 64 + t] = slot[(t + offset + 64) % 64];
}

// Host-compiled only (exceptions are not CUDA's): each thread throws and catches in one of two
// rounds split by barriers, unwinding on its own fiber's stack.
__global__ void unwinding_kernel(int* out) {
  const int t = int(threadIdx.x);
  int caught = 0;
  for (int round = 0; round < 2; ++round) {
    try {
      if ((t + round) % 3 == 0) throw t;
    } catch (int v) {
      caught += v == t;
    }
    __syncthreads();
  }
  out[int(blockIdx.x) * 64 + t] = caught;
}

}  // namespace

// Under AddressSanitizer (scripts/sanitize.sh) this also checks that the stack switches are
// annotated: unwinding on a stack ASan does not know draws a warning, which that script refuses.
TEST_CASE("emu fibers: an exception thrown and caught inside a thread unwinds on its own stack, across barriers", "[emu]") {
  std::vector<int> out(2 * 64, -1);
  cu::launch(unwinding_kernel, dim3(2), dim3(64), 0, nullptr, out.data());
  for (int g = 0; g < 2 * 64; ++g) {
    const int t = g % 64;
    CHECK(out[size_t(g)] == int(t % 3 == 0) + int((t + 1) % 3 == 0));
  }
}

TEST_CASE("emu threads run in turn between barriers, so a read that lacks its barrier meets the write missing", "[emu]") {
  for (int offset : {1, -1}) {
    INFO("offset " << offset);
    std::vector<int> out(2 * 64, 0);
    cu::launch(neighbour_kernel, dim3(2), dim3(64), 0, nullptr, out.data(), offset, 1);
    for (int g = 0; g < 2 * 64; ++g) CHECK(out[size_t(g)] == (g % 64 + offset + 64) % 64);
    // Without the barrier, some thread reads its neighbour's slot before the neighbour wrote it:
    // the poison (all bits set, -1), deterministically, whichever way the neighbour lies.
    cu::launch(neighbour_kernel, dim3(2), dim3(64), 0, nullptr, out.data(), offset, 0);
    int unwritten = 0;
    for (int v : out) unwritten += v == -1;
    CHECK(unwritten >= 1);
  }
}

TEST_CASE("emu built-ins: ballot, shuffles with widths, shared memory and atomics as documented", "[emu]") {
  const int n = 2 * 64;
  std::vector<unsigned> ballot(n);
  std::vector<int> down(n), seg(n), xr(n), shared_sum(n);
  int total = 0, biggest = -1;
  cu::launch(builtins_kernel, dim3(2), dim3(64), 0, nullptr, ballot.data(), down.data(), seg.data(), xr.data(),
             shared_sum.data(), &total, &biggest);
  int want_max = -1;
  for (int g = 0; g < n; ++g) {
    const int t = g % 64, lane = t % 32;
    INFO("thread " << g);
    CHECK(ballot[size_t(g)] == 0xaaaaaaaau);
    CHECK(down[size_t(g)] == (lane + 3 < 32 ? t + 3 : t));  // past the warp: the caller's own value
    CHECK(seg[size_t(g)] == (t & ~7) + 5);
    CHECK(xr[size_t(g)] == (t ^ 16));
    CHECK(shared_sum[size_t(g)] == 64 * 63 / 2);
    want_max = std::max(want_max, g * 3 % 101);
  }
  CHECK(total == n * (n - 1) / 2);
  CHECK(biggest == want_max);
}

TEST_CASE("emu 2-D grids and blocks give every thread its coordinates", "[emu]") {
  std::vector<int> out(3 * 2 * 4 * 2, -1);
  cu::launch(coordinates_kernel, dim3(3, 2), dim3(4, 2), 0, nullptr, out.data());
  for (int by = 0; by < 2; ++by)
    for (int bx = 0; bx < 3; ++bx)
      for (int ty = 0; ty < 2; ++ty)
        for (int tx = 0; tx < 4; ++tx)
          CHECK(out[size_t((bx + 3 * by) * 8 + tx + 4 * ty)] == by * 1000 + bx * 100 + ty * 10 + tx);
}
