// Axis reductions on the device: out[outer, inner] = sum / max / sum of squares over the middle
// axis of x[outer, n, inner]. f32 accumulation in a fixed order (thread stride, then the block's
// fixed tree), so repeated runs give identical bits. The CPU accumulates sums in f64.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

using kernels::Reduce;

SG_DEVICE float reduce_step(Reduce op, float acc, float v) {
  switch (op) {
    case Reduce::sum: return acc + v;
    case Reduce::sum_squares: return acc + v * v;
    case Reduce::max: return max_keep_nan(acc, v);
  }
  return acc;
}

// inner == 1: blocks of 256 threads over the rows of x[outer, n]. A row longer than kRowChunk is
// split over several blocks (block = row * splits + split) that write f32 partials; a second pass
// adds them up in split order (sums of sums, the max of maxima): still one fixed order, and the
// norm of a 38M-element gradient no longer runs on a single block.
constexpr int64_t kRowChunk = int64_t(1) << 16;

inline int64_t row_splits(int64_t n) { return n > kRowChunk ? std::min<int64_t>((n + kRowChunk - 1) / kRowChunk, 4096) : 1; }

// f32 workspace elements reduce() needs: the partials of split rows (0: none).
inline int64_t reduce_workspace(int64_t outer, int64_t n, int64_t inner) {
  return inner == 1 && row_splits(n) > 1 ? outer * row_splits(n) : 0;
}

template <class I, class O>
__global__ void reduce_rows_kernel(Reduce op, O* out, const I* x, int64_t n, int64_t splits) {
  SG_SHARED(float, scratch, 32);
  const int64_t row = int64_t(blockIdx.x) / splits, split = int64_t(blockIdx.x) % splits;
  const int64_t chunk = (n + splits - 1) / splits, begin = split * chunk, end = begin + chunk < n ? begin + chunk : n;
  const I* r = x + row * n;
  float acc = op == Reduce::max ? -INFINITY : 0.0f;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) acc = reduce_step(op, acc, to_f32(r[k]));
  acc = op == Reduce::max ? block_reduce<true>(acc, scratch) : block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = from_f32<O>(acc);
}

// inner > 1: a block owns kColumns neighbouring outputs of one outer index; its blockDim.y lanes
// (a power of two up to 32) split the n reduced rows (lane y takes rows y, y + lanes, ...) and a
// fixed tree in shared memory adds up their partials. A warp reads 32 neighbouring columns of a
// row (coalesced), and with n in the thousands (a bias gradient over B*T rows) the lanes keep
// many loads in flight where one thread per output would walk all n rows alone.
constexpr int kColumns = 32;

template <class T>
__global__ void __launch_bounds__(1024)
    reduce_columns_kernel(Reduce op, T* out, const T* x, int64_t n, int64_t inner, int64_t tiles) {
  SG_SHARED(float, partial, 32 * kColumns);
  const int64_t o = int64_t(blockIdx.x) / tiles, col = (int64_t(blockIdx.x) % tiles) * kColumns + threadIdx.x;
  const int lanes = int(blockDim.y), lane = int(threadIdx.y);
  float acc = op == Reduce::max ? -INFINITY : 0.0f;
  if (col < inner) {
    const T* base = x + o * n * inner + col;
    for (int64_t k = lane; k < n; k += lanes) acc = reduce_step(op, acc, to_f32(base[k * inner]));
  }
  float* mine = partial + lane * kColumns + threadIdx.x;
  *mine = acc;
  for (int s = lanes / 2; s > 0; s /= 2) {
    __syncthreads();
    if (lane < s) {
      const float other = mine[s * kColumns];
      *mine = op == Reduce::max ? max_keep_nan(*mine, other) : *mine + other;
    }
  }
  if (lane == 0 && col < inner) out[o * inner + col] = from_f32<T>(*mine);
}

// workspace: reduce_workspace(outer, n, inner) f32 elements (may be null when that is 0).
inline void reduce(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner,
                   Stream stream, float* workspace = nullptr) {
  if (outer * inner == 0) return;
  dispatch_storage(dtype, "reduce", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto* p = static_cast<const T*>(x);
    if (inner == 1) {
      const int64_t splits = row_splits(n);
      if (splits == 1)
        return launch(reduce_rows_kernel<T, T>, dim3(blocks_for(outer, 1)), dim3(256), 0, stream, op, o, p, n, int64_t(1));
      SG_CHECK(workspace, "reduce (cuda): a row of ", n, " elements needs the workspace reduce_workspace() sizes");
      launch(reduce_rows_kernel<T, float>, dim3(blocks_for(outer * splits, 1)), dim3(256), 0, stream, op, workspace, p, n,
             splits);
      const Reduce combine = op == Reduce::max ? Reduce::max : Reduce::sum;  // partial sums of squares add
      return launch(reduce_rows_kernel<float, T>, dim3(blocks_for(outer, 1)), dim3(256), 0, stream, combine, o,
                    static_cast<const float*>(workspace), splits, int64_t(1));
    }
    int lanes = 1;  // enough lanes that each walks at most ~32 rows, 32 at most
    while (lanes < 32 && int64_t(lanes) * 32 < n) lanes *= 2;
    const int64_t tiles = (inner + kColumns - 1) / kColumns;
    launch(reduce_columns_kernel<T>, dim3(blocks_for(outer * tiles, 1)), dim3(kColumns, unsigned(lanes)), 0, stream, op, o,
           p, n, inner, tiles);
  });
}

}  // namespace sg::cuda
