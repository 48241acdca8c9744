// Embedding on the device: row gather forward, deterministic scatter-add backward.
//   forward:  out[i, :] = weight[idx[i], :]            ('='; 128-bit packs when rows are aligned)
//   backward: dweight[idx[i], :] += dout[i, :]          ('+=')
// The backward first sorts the token positions by row, stably (CUB's radix sort on the GPU, over
// only the bits a row of the table needs; a std::stable_sort under the emulation, where memory is
// the host's), then gives each run of equal rows x 128 columns to one block: a thread adds its
// column of the run's dout rows in position order, loading them kRunGroup at a time. Every table
// row's sum is thus formed in exactly the CPU's order, with no float atomics, so results do not
// depend on scheduling, and the work spreads over (distinct rows x C) threads instead of C threads
// walking all n tokens. Indices outside the table (which the forward counted and reports at the
// host's next wait) sort last under one key, num_rows, and are skipped: nothing is written outside
// dweight.
#pragma once
#include <algorithm>

#include "kernels/cuda/classifier.cuh"  // dispatch_index
#include "kernels/cuda/variants.h"
#ifdef __CUDACC__
#include <cub/device/device_radix_sort.cuh>
#endif

namespace sg::cuda {

template <class T, class I>
__global__ void embedding_forward_kernel(T* out, const I* idx, const T* weight, int64_t C, int64_t num_rows,
                                         bool vectorised, int* bad_indices) {
  const int64_t i = blockIdx.x, r = int64_t(idx[i]);
  T* o = out + i * C;
  if (r < 0 || r >= num_rows) {  // zeros, and counted for the caller to report
    if (threadIdx.x == 0 && bad_indices) atomicAdd(bad_indices, 1);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = from_f32<T>(0.0f);
    return;
  }
  const T* w = weight + r * C;
  constexpr int N = Pack<T>::N;
  const int64_t packs = vectorised ? C / N : 0;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) store_pack(o + p * N, load_pack(w + p * N));
  for (int64_t c = packs * N + threadIdx.x; c < C; c += blockDim.x) o[c] = w[c];
}

// Positions of one run whose dout values a thread has in flight at once. Real text repeats a few
// tokens hundreds of times per batch (Zipf), and a one-at-a-time loop waits a dependent
// rows/pos/dout round trip per position; in groups of kRunGroup the loads of a group overlap and
// the adds still go in position order.
constexpr int kRunGroup = 8;

// Called with rows[] sorted stably and pos[] the matching token positions: block (k, y) works only
// when k starts a run of equal rows inside the table; its threads take columns
// y*blockDim.x + threadIdx.x.
template <class T>
__global__ void embedding_backward_kernel(T* dweight, const T* dout, const uint32_t* rows, const int* pos, int64_t n,
                                          int64_t C, uint32_t num_rows) {
  const int64_t k = blockIdx.x;
  const uint32_t r = rows[k];
  if (r >= num_rows || (k > 0 && r == rows[k - 1])) return;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  T* d = dweight + int64_t(r) * C + c;
  float acc = to_f32(*d);
  for (int64_t j = k; j < n && rows[j] == r; j += kRunGroup) {
    bool in[kRunGroup];  // sorted: the run is contiguous, so a position past its end ends it
    T v[kRunGroup];
    SG_UNROLL(kRunGroup) for (int u = 0; u < kRunGroup; ++u) in[u] = j + u < n && rows[j + u] == r;
    SG_UNROLL(kRunGroup) for (int u = 0; u < kRunGroup; ++u) v[u] = in[u] ? dout[int64_t(pos[j + u]) * C + c] : T{};
    SG_UNROLL(kRunGroup) for (int u = 0; u < kRunGroup; ++u)
      if (in[u]) acc += to_f32(v[u]);  // in position order, as the CPU adds
    if (!in[kRunGroup - 1]) break;  // the run ended inside this group: no round trip to find it
  }
  *d = from_f32<T>(acc);
}

// As embedding_backward_kernel with a thread per Pack<T> of columns (16 bytes; C a multiple of the
// pack, dweight and dout 16-byte aligned): thread p of block (k, y) sums columns
// [N (y*blockDim.x + p), + N) of run k, kPackRunGroup positions' loads in flight at once, each
// column in position order (the column kernel's sums, bit for bit).
constexpr int kPackRunGroup = 8;  // 16: 182 registers a thread in bf16 (ptxas), 8: 102

template <class T>
__global__ void embedding_backward_packs_kernel(T* dweight, const T* dout, const uint32_t* rows, const int* pos,
                                                int64_t n, int64_t C, uint32_t num_rows) {
  const int64_t k = blockIdx.x;
  const uint32_t r = rows[k];
  if (r >= num_rows || (k > 0 && r == rows[k - 1])) return;
  constexpr int N = Pack<T>::N;
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (c >= C) return;
  T* d = dweight + int64_t(r) * C + c;
  const Pack<T> start = load_pack<T>(d);
  float acc[N];
  SG_UNROLL(N) for (int e = 0; e < N; ++e) acc[e] = to_f32(start.v[e]);
  for (int64_t j = k; j < n && rows[j] == r; j += kPackRunGroup) {
    bool in[kPackRunGroup];  // sorted: the run is contiguous, so a position past its end ends it
    Pack<T> v[kPackRunGroup];
    SG_UNROLL(kPackRunGroup) for (int u = 0; u < kPackRunGroup; ++u) in[u] = j + u < n && rows[j + u] == r;
    SG_UNROLL(kPackRunGroup) for (int u = 0; u < kPackRunGroup; ++u)
      if (in[u]) v[u] = load_pack<T>(dout + int64_t(pos[j + u]) * C + c);
    SG_UNROLL(kPackRunGroup) for (int u = 0; u < kPackRunGroup; ++u)
      if (in[u]) SG_UNROLL(N) for (int e = 0; e < N; ++e) acc[e] += to_f32(v[u].v[e]);  // position order
    if (!in[kPackRunGroup - 1]) break;
  }
  Pack<T> out;
  SG_UNROLL(N) for (int e = 0; e < N; ++e) out.v[e] = from_f32<T>(acc[e]);
  store_pack(d, out);
}

// Whether the packs kernel takes these rows.
template <class T>
SG_HOST_DEVICE bool embedding_packs_fit(const void* dweight, const void* dout, int64_t C) {
  return C % Pack<T>::N == 0 && aligned16(dweight) && aligned16(dout);
}

// The sort's input: keys[i] = idx[i] for a row of the table, num_rows (sorted last, skipped) for
// any other index; pos[i] = i.
template <class I>
__global__ void sort_keys_kernel(uint32_t* keys, int* pos, const I* idx, int64_t n, int64_t num_rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t r = int64_t(idx[i]);
  keys[i] = uint32_t(r >= 0 && r < num_rows ? r : num_rows);
  pos[i] = int(i);
}

// The radix sort's end bit: enough bits for every key, num_rows included.
inline int sort_key_bits(int64_t num_rows) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= num_rows) ++bits;
  return bits;
}

// The workspace of embedding_backward for n indices, byte offsets of its 256-byte aligned pieces:
// the sorted keys (at 0), the keys in, the positions in and out, and the sort's own scratch.
struct EmbeddingSortSpace {
  size_t keys_in = 0, pos_in = 0, pos_out = 0, sort = 0, sort_bytes = 0, total = 0;
};
inline EmbeddingSortSpace embedding_sort_space(int64_t n, int64_t num_rows) {
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  EmbeddingSortSpace s;
#ifdef __CUDACC__
  SG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, s.sort_bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const int*>(nullptr),
                                                static_cast<int*>(nullptr), int(n), 0, sort_key_bits(num_rows)));
#else
  (void)num_rows;
#endif
  const size_t piece = up(size_t(n) * 4);  // uint32 keys and int positions alike
  s.keys_in = piece;
  s.pos_in = 2 * piece;
  s.pos_out = 3 * piece;
  s.sort = 4 * piece;
  s.total = s.sort + up(s.sort_bytes);
  return s;
}

// The sizes embedding_backward takes (the sort's indices and keys are 32-bit); checked before the
// workspace is sized, whose query would otherwise see a truncated count.
inline void check_embedding_backward_sizes(int64_t n, int64_t num_rows) {
  SG_CHECK(n < (int64_t(1) << 31), "embedding_backward (cuda): ", n, " indices; at most 2^31 - 1 per call");
  SG_CHECK(num_rows >= 0 && num_rows <= int64_t(UINT32_MAX), "embedding_backward (cuda): a table of ", num_rows,
           " rows; at most 2^32 - 1 (the sort's keys are 32-bit)");
}

inline size_t embedding_backward_workspace(int64_t n, int64_t num_rows) {
  check_embedding_backward_sizes(n, num_rows);
  return embedding_sort_space(n, num_rows).total;
}

// rows_out, pos_out = (the keys of idx, 0..n-1) sorted by key, stably, over the low `bits` bits.
template <class I>
void sort_rows(uint32_t* rows_out, int* pos_out, const I* idx, int64_t n, int64_t num_rows, uint32_t* keys_in,
               int* pos_in, void* scratch, size_t scratch_bytes, Stream stream) {
  launch(sort_keys_kernel<I>, dim3(blocks_for(n, 256)), dim3(256), 0, stream, keys_in, pos_in, idx, n, num_rows);
#ifdef __CUDACC__
  SG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch, scratch_bytes, keys_in, rows_out, pos_in, pos_out, int(n), 0,
                                                sort_key_bits(num_rows), stream));
#else
  (void)scratch, (void)scratch_bytes, (void)stream;
  std::copy(pos_in, pos_in + n, pos_out);
  std::stable_sort(pos_out, pos_out + n, [&](int a, int b) { return keys_in[a] < keys_in[b]; });
  for (int64_t k = 0; k < n; ++k) rows_out[k] = keys_in[pos_out[k]];
#endif
}

inline void embedding_forward(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n,
                              int64_t C, int64_t num_rows, int* bad_indices, Stream stream) {
  dispatch_storage(dtype, "embedding", [&](auto tag) {
    dispatch_index(idx_dtype, "embedding", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      const bool vec = aligned16(out) && aligned16(weight) && (C * int64_t(sizeof(T))) % 16 == 0;
      launch(embedding_forward_kernel<T, I>, dim3(blocks_for(n, 1)), dim3(128), 0, stream, static_cast<T*>(out),
             static_cast<const I*>(idx), static_cast<const T*>(weight), C, num_rows, vec, bad_indices);
    });
  });
}

// workspace: embedding_backward_workspace(n, num_rows) bytes, 256-byte aligned. kind: which run
// kernel (kernels/cuda/variants.h); packs falls back to columns where its rows do not fit.
inline void embedding_backward(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx,
                               int64_t n, int64_t C, int64_t num_rows, void* workspace, Stream stream,
                               EmbeddingBackward kind = EmbeddingBackward::columns) {
  check_embedding_backward_sizes(n, num_rows);
  dispatch_storage(dtype, "embedding_backward", [&](auto tag) {
    dispatch_index(idx_dtype, "embedding_backward", [&](auto itag) {
      using T = decltype(tag);
      using I = decltype(itag);
      const EmbeddingSortSpace sp = embedding_sort_space(n, num_rows);
      auto* base = static_cast<unsigned char*>(workspace);
      auto *rows = reinterpret_cast<uint32_t*>(base), *keys_in = reinterpret_cast<uint32_t*>(base + sp.keys_in);
      auto *pos_in = reinterpret_cast<int*>(base + sp.pos_in), *pos_out = reinterpret_cast<int*>(base + sp.pos_out);
      sort_rows(rows, pos_out, static_cast<const I*>(idx), n, num_rows, keys_in, pos_in, base + sp.sort,
                sp.sort_bytes, stream);
      if (kind == EmbeddingBackward::packs && embedding_packs_fit<T>(dweight, dout, C)) {
        const int64_t packs = C / Pack<T>::N;
        const int threads = int(std::min<int64_t>(128, (packs + 31) / 32 * 32));
        launch(embedding_backward_packs_kernel<T>, dim3(blocks_for(n, 1), blocks_for(packs, threads)), dim3(threads),
               0, stream, static_cast<T*>(dweight), static_cast<const T*>(dout), static_cast<const uint32_t*>(rows),
               static_cast<const int*>(pos_out), n, C, uint32_t(num_rows));
        return;
      }
      launch(embedding_backward_kernel<T>, dim3(blocks_for(n, 1), blocks_for(C, 128)), dim3(128), 0, stream,
             static_cast<T*>(dweight), static_cast<const T*>(dout), static_cast<const uint32_t*>(rows),
             static_cast<const int*>(pos_out), n, C, uint32_t(num_rows));
    });
  });
}

}  // namespace sg::cuda
