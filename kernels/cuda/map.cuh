// The elementwise map every pointwise op family uses: out[i] = f(a[i] [, b[i]]) in f32 over
// storage type T, 128-bit packs where all pointers are 16-byte aligned, then a scalar tail.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

template <int Arity, class T, class F>
SG_DEVICE T map_apply(const F& f, T a, T b) {
  if constexpr (Arity == 1) return from_f32<T>(f(to_f32(a)));
  else return from_f32<T>(f(to_f32(a), to_f32(b)));
}

template <int Arity, class T, class F>
// out may be a (an in-place update: each element is read before it is written, by the same thread).
__global__ void map_kernel(F f, T* out, const T* a, const T* __restrict__ b, int64_t n,
                           bool vectorised) {
  constexpr int N = Pack<T>::N;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = vectorised ? n / N : 0;
  for (int64_t p = first; p < packs; p += stride) {
    const Pack<T> pa = load_pack(a + p * N);
    Pack<T> pb = pa;
    if constexpr (Arity == 2) pb = load_pack(b + p * N);
    Pack<T> po;
    for (int k = 0; k < N; ++k) po.v[k] = map_apply<Arity>(f, pa.v[k], pb.v[k]);
    store_pack(out + p * N, po);
  }
  for (int64_t i = packs * N + first; i < n; i += stride) out[i] = map_apply<Arity>(f, a[i], Arity == 2 ? b[i] : a[i]);
}

// Grid-stride launches: enough blocks to cover n once, at most max_grid_blocks() (the loop does the
// rest). Under emulation the cap is a variable, so that a test can lower it and have every thread
// take several strides, as the real grid's do past 2048 x 256 items (tests/emu).
constexpr int kMapThreads = 256;
#ifdef __CUDACC__
constexpr int64_t max_grid_blocks() { return 2048; }
#else
inline int64_t g_emu_max_grid_blocks = 2048;
inline int64_t max_grid_blocks() { return g_emu_max_grid_blocks; }
#endif

inline unsigned grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > max_grid_blocks() ? max_grid_blocks() : blocks));
}

template <int Arity, class T, class F>
void map(const F& f, T* out, const T* a, const T* b, int64_t n, Stream stream) {
  if (n <= 0) return;
  const bool vec = aligned16(out) && aligned16(a) && (Arity == 1 || aligned16(b));
  launch(map_kernel<Arity, T, F>, dim3(grid_for(vec ? n / Pack<T>::N + 1 : n, kMapThreads)), dim3(kMapThreads), 0,
         stream, f, out, a, b, n, vec);
}

}  // namespace sg::cuda
