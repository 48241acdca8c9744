// What every hand-written kernel in kernels/cuda/ includes: the CUDA dialect (real under nvcc,
// emulated on CPU fibers by kernels/emu otherwise), the one launch helper, the storage types
// and their f32 conversions, 128-bit packs, and warp/block reductions.
//
// Rules that keep one source valid in both worlds:
//   - launch every kernel with sg::cuda::launch(kernel, grid, block, shmem, stream, args...);
//   - declare shared memory with SG_SHARED(type, name, count) / SG_DYNAMIC_SHARED(type, name);
//   - blockDim.x a multiple of 32 wherever warp shuffles or block reductions are used;
//   - every thread of a block reaches every __syncthreads (no early return before one).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/ops.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/runtime.h"
#define SG_DEVICE __device__ __forceinline__
#define SG_HOST_DEVICE __host__ __device__ __forceinline__
#define SG_SHARED(T, name, count) __shared__ __align__(16) T name[count]
// Unroll the next loop by n (nvcc); the emulation's host compiler ignores it.
#define SG_UNROLL(n) _Pragma(SG_STRINGIFY(unroll n))
#define SG_STRINGIFY(x) #x
#define SG_DYNAMIC_SHARED(T, name)                  \
  extern __shared__ __align__(16) unsigned char sg_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(sg_dynamic_smem_)
#else
#include "kernels/emu/emu.h"
#define SG_DEVICE inline
#define SG_HOST_DEVICE inline
#define SG_SHARED(T, name, count) T* name = ::sg::emu::shared_array<T>(count)
#define SG_UNROLL(n)
#define SG_DYNAMIC_SHARED(T, name) T* name = ::sg::emu::dynamic_shared<T>()
#endif

namespace sg::cuda {

#ifdef __CUDACC__
using bf16 = __nv_bfloat16;
using f16 = __half;
using Stream = cudaStream_t;

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, Stream stream, A... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // (their product could wrap in 32 bits)
  SG_CHECK(grid.y <= 65535 && grid.z <= 65535, "CUDA launch: grid (", grid.x, ", ", grid.y, ", ", grid.z,
           "): gridDim.y and gridDim.z are at most 65535 (the emulation refuses it too)");
  if (shmem > 0) allow_dynamic_shared(reinterpret_cast<const void*>(kernel), shmem);  // static + dynamic > 48 KiB
  kernel<<<grid, block, shmem, stream>>>(static_cast<P>(args)...);
  SG_CUDA_CHECK(cudaGetLastError());
}

SG_HOST_DEVICE float to_f32(bf16 v) { return __bfloat162float(v); }
SG_HOST_DEVICE float to_f32(f16 v) { return __half2float(v); }
template <class T>
SG_HOST_DEVICE T from_f32(float f) {
  if constexpr (std::is_same_v<T, bf16>) return __float2bfloat16(f);
  else if constexpr (std::is_same_v<T, f16>) return __float2half(f);
  else return T(f);
}
#else
using emu::bf16;
using emu::f16;
using emu::launch;
using emu::Stream;
using emu::to_f32;

template <class T>
inline T from_f32(float f) {
  if constexpr (std::is_same_v<T, bf16>) return emu::bf16_from(f);
  else if constexpr (std::is_same_v<T, f16>) return emu::f16_from(f);
  else return T(f);
}
#endif

SG_HOST_DEVICE float to_f32(float v) { return v; }

constexpr unsigned kFullMask = 0xffffffffu;

// Blocks of `threads` covering n items (gridDim.x: at most 2^31 - 1).
inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  SG_CHECK(blocks < (int64_t(1) << 31), "CUDA launch: ", n, " items in blocks of ", threads, " need ", blocks,
           " blocks; gridDim.x is at most 2^31 - 1");
  return unsigned(blocks);
}

SG_HOST_DEVICE bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
SG_HOST_DEVICE bool aligned16(const void* p) { return aligned_to(p, 16); }

// Count elements of T accessed as one vector load or store: by default 16 bytes (ld.global.v4),
// the widest; Pack<bf16, 4> is 8 bytes, beside a Pack<float, 4> of the same elements.
template <class T, int Count = int(16 / sizeof(T))>
struct alignas(Count * sizeof(T)) Pack {
  static constexpr int N = Count;
  T v[N];
};
// The emulation checks the alignment the device's vector access needs (it faults otherwise).
template <class T, int Count = Pack<T>::N>
SG_DEVICE Pack<T, Count> load_pack(const T* p) {
#ifndef __CUDACC__
  if (!aligned_to(p, sizeof(Pack<T, Count>)))
    sg::emu::fail("load_pack: address not aligned to the vector (a fault on the device)");
#endif
  return *reinterpret_cast<const Pack<T, Count>*>(p);
}
template <class T, int Count>
SG_DEVICE void store_pack(T* p, const Pack<T, Count>& x) {
#ifndef __CUDACC__
  if (!aligned_to(p, sizeof(Pack<T, Count>)))
    sg::emu::fail("store_pack: address not aligned to the vector (a fault on the device)");
#endif
  if constexpr (sizeof(Pack<T, Count>) == 8) {  // as one 64-bit word: nvcc splits 4 halves into 4 stores
    unsigned long long bits;
    memcpy(&bits, &x, 8);
    *reinterpret_cast<unsigned long long*>(p) = bits;
  } else {
    *reinterpret_cast<Pack<T, Count>*>(p) = x;
  }
}

// A 16-byte load and store marked evict-first in L1 and L2 (ld/st.global.cs): the last use of the
// bytes, which should not push out bytes still to be read. Plain accesses under the emulation.
template <class T>
SG_DEVICE Pack<T> load_pack_last_use(const T* p) {
#ifdef __CUDACC__
  static_assert(sizeof(Pack<T>) == sizeof(int4));
  const int4 bits = __ldcs(reinterpret_cast<const int4*>(p));
  Pack<T> x;
  memcpy(&x, &bits, sizeof x);
  return x;
#else
  return load_pack(p);
#endif
}
template <class T>
SG_DEVICE void store_pack_last_use(T* p, const Pack<T>& x) {
#ifdef __CUDACC__
  int4 bits;
  memcpy(&bits, &x, sizeof bits);
  __stcs(reinterpret_cast<int4*>(p), bits);
#else
  store_pack(p, x);
#endif
}

SG_DEVICE float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
// max that keeps a NaN from either side, as the CPU's and PyTorch's max do (fmaxf drops it).
SG_DEVICE float max_keep_nan(float a, float b) { return (b > a || b != b) ? b : a; }
SG_DEVICE float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = max_keep_nan(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum (or max) over the whole block, returned to every thread. scratch: 32 floats of shared
// memory. The summation tree is fixed by the block size, so results are run-to-run deterministic.
template <bool kMax = false>
SG_DEVICE float block_reduce(float v, float* scratch) {
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float neutral = kMax ? -INFINITY : 0.0f;
  v = lane < warps ? scratch[lane] : neutral;
  return kMax ? warp_max(v) : warp_sum(v);
}

// Runs body(T{}) for the storage types the kernels take: f32, bf16, f16.
template <class Body>
void dispatch_storage(DType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case DType::f32: body(float{}); break;
    case DType::bf16: body(bf16{}); break;
    case DType::f16: body(f16{}); break;
    default: kernels::unsupported(op, dtype, "cuda");
  }
}

}  // namespace sg::cuda
