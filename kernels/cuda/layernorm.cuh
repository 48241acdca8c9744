// LayerNorm and RMSNorm on the device, forward and backward, optionally fused with the residual
// add that precedes them in a transformer block. One warp per row (C in the hundreds to
// thousands); statistics in f32; mean and rstd saved as f32 per row.
//   forward:  r = x (+ residual);  xhat = (r - mean) rstd;  y = xhat w + b
//             (RMSNorm: xhat = r rstd, rstd = 1/sqrt(mean(r^2) + eps), no mean, no bias)
//   backward: dx = (dr +) rstd (dy w - mean(dy w) - xhat mean(dy w xhat))   (RMS: no mean(dy w))
//             dw = sum_rows dy xhat, db = sum_rows dy  ('='), in a fixed order: per-chunk partial
//             sums over kRowsPerChunk rows (in the input-gradient kernel's own pass when C and the
//             alignment allow, else by a second kernel), then the chunks in order (no atomics)
#pragma once
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/variants.h"

namespace sg::cuda {

constexpr int kNormWarps = 4;  // rows per block
constexpr int64_t kRowsPerChunk = 32;

// W consecutive elements of a row as f32: one 16-byte load (W = Pack<T>::N) or one element.
template <int W, class T>
SG_DEVICE void load_w(float (&out)[W], const T* p) {
  if constexpr (W == 1) {
    out[0] = to_f32(p[0]);
  } else {
    const Pack<T> pk = load_pack(p);
    for (int e = 0; e < W; ++e) out[e] = to_f32(pk.v[e]);
  }
}
template <int W, class T>
SG_DEVICE void store_w(T* p, const float (&in)[W]) {
  if constexpr (W == 1) {
    p[0] = from_f32<T>(in[0]);
  } else {
    Pack<T> pk;
    for (int e = 0; e < W; ++e) pk.v[e] = from_f32<T>(in[e]);
    store_pack(p, pk);
  }
}

// One row, each lane taking W elements at a time (W = Pack<T>::N: 16-byte loads and stores, when
// the launcher found every row 16-byte aligned; 1 otherwise). y and residual_out never alias the
// inputs (restrict): the residual pass's next loads need not wait on its stores.
template <int W, class T, bool kRms>
SG_DEVICE void norm_forward_row(T* __restrict__ yr, float* mean, float* rstd, T* __restrict__ rr,
                                const T* __restrict__ xr, const T* __restrict__ res, const T* w, const T* b,
                                int64_t row, int64_t C, float eps, int lane) {
  const int64_t units = C / W;
  // With a residual, r = x + residual is stored first and the statistics use the stored (rounded)
  // r, so forward and backward see the same values. src is based on xr or rr (not a restrict
  // pointer assigned from another: the compiler must see the reads of r after its stores).
  const T* src = xr;
  if (res) {
    for (int64_t u = lane; u < units; u += 32) {
      float a[W], r[W];
      load_w<W>(a, xr + u * W);
      load_w<W>(r, res + u * W);
      for (int e = 0; e < W; ++e) r[e] += a[e];
      store_w<W>(rr + u * W, r);
    }
    src = rr;  // each lane reads back only what it wrote
  }
  float m = 0.0f;
  if constexpr (!kRms) {
    for (int64_t u = lane; u < units; u += 32) {
      float a[W];
      load_w<W>(a, src + u * W);
      for (int e = 0; e < W; ++e) m += a[e];
    }
    m = warp_sum(m) / float(C);
  }
  float v = 0.0f;
  for (int64_t u = lane; u < units; u += 32) {
    float a[W];
    load_w<W>(a, src + u * W);
    for (int e = 0; e < W; ++e) v += (a[e] - m) * (a[e] - m);
  }
  const float s = rsqrtf(warp_sum(v) / float(C) + eps);
  for (int64_t u = lane; u < units; u += 32) {
    float a[W], g[W], o[W];
    load_w<W>(a, src + u * W);
    load_w<W>(g, w + u * W);
    for (int e = 0; e < W; ++e) o[e] = (a[e] - m) * s * g[e];
    if (!kRms && b) {
      float c[W];
      load_w<W>(c, b + u * W);
      for (int e = 0; e < W; ++e) o[e] += c[e];
    }
    store_w<W>(yr + u * W, o);
  }
  if (lane == 0) {
    if (mean) mean[row] = m;
    rstd[row] = s;
  }
}

template <class T, bool kRms>
__global__ void norm_forward_kernel(T* y, float* mean, float* rstd, T* residual_out, const T* x, const T* residual,
                                    const T* w, const T* b, int64_t rows, int64_t C, float eps, bool packed) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t row = int64_t(blockIdx.x) * kNormWarps + int(threadIdx.x) / 32;
  if (row >= rows) return;  // whole warps leave together; this kernel has no block barrier
  const int64_t at = row * C;
  T* rr = residual ? residual_out + at : nullptr;
  const T* res = residual ? residual + at : nullptr;
  if (packed)
    norm_forward_row<Pack<T>::N, T, kRms>(y + at, mean, rstd, rr, x + at, res, w, b, row, C, eps, lane);
  else
    norm_forward_row<1, T, kRms>(y + at, mean, rstd, rr, x + at, res, w, b, row, C, eps, lane);
}

// Unit u = lane + 32 k of a row (W elements each) through f(u, k): with kUnits = 0 any number of
// units per lane; with kUnits > 0 at most kUnits, the loop unrolled so that k is a constant and
// per-unit state stays in registers.
template <int kUnits, class F>
SG_DEVICE void for_lane_units(int64_t units, int lane, F&& f) {
  if constexpr (kUnits == 0) {
    int k = 0;
    for (int64_t u = lane; u < units; u += 32, ++k) f(u, k);
  } else {
    SG_UNROLL(kUnits)
    for (int k = 0; k < kUnits; ++k)
      if (const int64_t u = lane + 32 * int64_t(k); u < units) f(u, k);
  }
}

// A lane's 16-byte packs of dr, read with the first pass's dy and x (kAhead) rather than in the
// second pass, so all of a row's reads from memory are in flight at once.
template <class T, int kUnits, bool kAhead>
struct RowAhead {
  Pack<T> a[kUnits];
};
template <class T, int kUnits>
struct RowAhead<T, kUnits, false> {};

// One row's input gradient, W elements at a time as in the forward (16-byte packs when every row
// of dx, dr, dy, x and w starts 16-byte aligned). The second pass reads dy and x again (from L1 or
// L2) and hands each unit's dy and xhat to acc(k, dy, xhat) (the fused kernels' dw/db sums;
// nothing for the plain kernel). kAhead: dr read in the first pass (16-byte units, kUnits > 0).
template <int W, int kUnits, bool kAhead, class T, bool kRms, class Acc>
SG_DEVICE void norm_backward_dx_row(T* o, const T* a, const T* g, const T* xr, const T* w, float m, float s, int64_t C,
                                    int lane, Acc&& acc) {
  static_assert(!kAhead || (kUnits > 0 && W == Pack<T>::N), "dr ahead needs 16-byte units, a fixed number a lane");
  const int64_t units = C / W;
  RowAhead<T, kUnits, kAhead> ahead;
  float mean_g = 0.0f, mean_gx = 0.0f;
  for_lane_units<kUnits>(units, lane, [&](int64_t u, int k) {
    float gv[W], wv[W], xv[W];
    if constexpr (kAhead)
      if (a) ahead.a[k] = load_pack(a + u * W);
    load_w<W>(gv, g + u * W);
    load_w<W>(wv, w + u * W);
    load_w<W>(xv, xr + u * W);
    for (int e = 0; e < W; ++e) {
      const float gw = gv[e] * wv[e];
      mean_g += gw;
      mean_gx += gw * (xv[e] - m) * s;
    }
  });
  mean_g = kRms ? 0.0f : warp_sum(mean_g) / float(C);
  mean_gx = warp_sum(mean_gx) / float(C);
  for_lane_units<kUnits>(units, lane, [&](int64_t u, int k) {
    float gv[W], wv[W], xh[W], d[W];
    load_w<W>(gv, g + u * W);
    load_w<W>(wv, w + u * W);
    load_w<W>(xh, xr + u * W);
    for (int e = 0; e < W; ++e) {
      xh[e] = (xh[e] - m) * s;
      d[e] = s * (gv[e] * wv[e] - mean_g - xh[e] * mean_gx);
    }
    if (a) {  // may be o: each lane reads its elements before writing them
      float av[W];
      if constexpr (kAhead)
        for (int e = 0; e < W; ++e) av[e] = to_f32(ahead.a[k].v[e]);
      else
        load_w<W>(av, a + u * W);
      for (int e = 0; e < W; ++e) d[e] += av[e];
    }
    store_w<W>(o + u * W, d);
    acc(k, gv, xh);
  });
}

template <class T, bool kRms>
__global__ void norm_backward_dx_kernel(T* dx, const T* dr, const T* dy, const T* x, const T* w, const float* mean,
                                        const float* rstd, int64_t rows, int64_t C, bool packed) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t row = int64_t(blockIdx.x) * kNormWarps + int(threadIdx.x) / 32;
  if (row >= rows) return;
  const int64_t at = row * C;
  const float m = kRms ? 0.0f : mean[row], s = rstd[row];
  const T* a = dr ? dr + at : nullptr;
  const auto none = [](int, const auto&, const auto&) {};
  if (packed)
    norm_backward_dx_row<Pack<T>::N, 0, false, T, kRms>(dx + at, a, dy + at, x + at, w, m, s, C, lane, none);
  else norm_backward_dx_row<1, 0, false, T, kRms>(dx + at, a, dy + at, x + at, w, m, s, C, lane, none);
}

// The input gradient and the dw/db partials in one pass over dy and x, for 16-byte rows of at most
// 32 * kFusedCols columns. A block takes one chunk of kRowsPerChunk rows, each of its kFusedWarps
// warps every kFusedWarps-th row; the second pass over a row, which has dy and xhat in registers,
// adds dy xhat and dy into the lane's sums for its columns (kFusedCols registers each), and the
// warps' sums are then added in warp order into the chunk's partials: what
// norm_backward_partial_kernel computes by reading dy and x again, in a fixed order too.
constexpr int kFusedWarps = 8;
constexpr int kFusedCols = 32;  // columns per lane: C <= 1024

constexpr bool norm_backward_fuses(int64_t C, bool packed) {
  return packed && C <= 32 * kFusedCols;
}

// The choice that runs for rows of C columns (packed: 16-byte rows): split where the in-kernel
// sums cannot.
constexpr NormBackward norm_backward_runs(NormBackward kind, int64_t C, bool packed) {
  return norm_backward_fuses(C, packed) ? kind : NormBackward::split;
}

template <class T, bool kRms>
__global__ void norm_backward_fused_kernel(T* dx, float* partial, const T* dr, const T* dy, const T* x, const T* w,
                                           const float* mean, const float* rstd, int64_t rows, int64_t C) {
  constexpr int W = Pack<T>::N, kUnits = kFusedCols / W;
  SG_SHARED(float, sums, 2 * 32 * kFusedCols);  // [dw | db][C]
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t chunk = blockIdx.x, chunks = gridDim.x, units = C / W;
  float sw[kUnits][W], sb[kUnits][W];
  for (int k = 0; k < kUnits; ++k)
    for (int e = 0; e < W; ++e) sw[k][e] = sb[k][e] = 0.0f;
  const int64_t first = chunk * kRowsPerChunk, end = first + kRowsPerChunk < rows ? first + kRowsPerChunk : rows;
  const auto acc = [&](int k, const float(&gv)[W], const float(&xh)[W]) {
    for (int e = 0; e < W; ++e) {
      sw[k][e] += gv[e] * xh[e];
      sb[k][e] += gv[e];
    }
  };
  for (int64_t row = first + warp; row < end; row += kFusedWarps) {
    const int64_t at = row * C;
    const float m = kRms ? 0.0f : mean[row], s = rstd[row];
    norm_backward_dx_row<W, kUnits, false, T, kRms>(dx + at, dr ? dr + at : nullptr, dy + at, x + at, w, m, s, C, lane,
                                                     acc);
  }
  // The warps' sums in warp order: warp 0 stores, each later one adds, a barrier between turns.
  // A lane's W sums are adjacent, W floats from the next lane's: 16-byte accesses where W allows
  // (a 2-way bank conflict where W scalar ones are 8-way at W = 8).
  constexpr int P = W % Pack<float>::N == 0 ? Pack<float>::N : 1;
  for (int turn = 0; turn < kFusedWarps; ++turn) {
    if (warp == turn)
      for_lane_units<kUnits>(units, lane, [&](int64_t u, int k) {
        for (int h = 0; h < W; h += P) {
          float* pw = sums + u * W + h;
          float* pb = pw + C;
          if constexpr (P > 1) {
            Pack<float> a, b;
            if (turn > 0) a = load_pack(pw), b = load_pack(pb);
            for (int e = 0; e < P; ++e) {
              a.v[e] = turn == 0 ? sw[k][h + e] : a.v[e] + sw[k][h + e];
              b.v[e] = turn == 0 ? sb[k][h + e] : b.v[e] + sb[k][h + e];
            }
            store_pack(pw, a);
            store_pack(pb, b);
          } else {
            *pw = turn == 0 ? sw[k][h] : *pw + sw[k][h];
            *pb = turn == 0 ? sb[k][h] : *pb + sb[k][h];
          }
        }
      });
    __syncthreads();
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    partial[chunk * C + c] = sums[c];
    partial[(chunks + chunk) * C + c] = sums[C + c];
  }
}

// The fused kernel's work with each warp's column sums in shared memory instead of registers
// (NormBackward::smem, smem_ahead): far fewer registers a thread, so more warps an SM, for
// 64 C bytes of shared memory a block (48 KiB at C = 768). A warp adds its rows into its own slice
// in row order and the slices are added in warp order: the fused kernel's sums, bit for bit. In a
// slice the lane's W sums of one array lie as W / 4 float4s, each in a run of the warp's lanes
// (slot (q, u) at (q units + u) 4), so each float4 access of a warp is conflict-free.
constexpr int64_t norm_backward_smem_bytes(int64_t C) { return int64_t(kFusedWarps) * 2 * C * int64_t(sizeof(float)); }

// Registers: 63 a thread for bf16 at 4 blocks an SM; 80 with dr ahead at 3 (ptxas, sm_90).
template <class T, bool kRms, bool kAhead>
__global__ void __launch_bounds__(32 * kFusedWarps, kAhead ? 3 : 4)
    norm_backward_smem_kernel(T* dx, float* partial, const T* dr, const T* dy, const T* x, const T* w,
                              const float* mean, const float* rstd, int64_t rows, int64_t C) {
  constexpr int W = Pack<T>::N, P = Pack<float>::N, kUnits = kFusedCols / W;
  static_assert(W % P == 0, "a unit's sums are whole float4s");
  SG_DYNAMIC_SHARED(float, sums);  // [kFusedWarps][dw | db][C], each [C] as above
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t chunk = blockIdx.x, chunks = gridDim.x, units = C / W;
  float* mine = sums + int64_t(warp) * 2 * C;
  const auto slot = [&](int64_t u, int q) { return mine + (q * units + u) * P; };
  for_lane_units<kUnits>(units, lane, [&](int64_t u, int) {  // a lane clears and later adds only its own slots
    const Pack<float> zero{};
    for (int q = 0; q < W / P; ++q) {
      store_pack(slot(u, q), zero);
      store_pack(slot(u, q) + C, zero);
    }
  });
  const auto acc = [&](int k, const float(&gv)[W], const float(&xh)[W]) {
    const int64_t u = lane + 32 * int64_t(k);
    for (int q = 0; q < W / P; ++q) {
      Pack<float> sw = load_pack(slot(u, q)), sb = load_pack(slot(u, q) + C);
      for (int e = 0; e < P; ++e) {
        sw.v[e] += gv[q * P + e] * xh[q * P + e];
        sb.v[e] += gv[q * P + e];
      }
      store_pack(slot(u, q), sw);
      store_pack(slot(u, q) + C, sb);
    }
  };
  const int64_t first = chunk * kRowsPerChunk, end = first + kRowsPerChunk < rows ? first + kRowsPerChunk : rows;
  for (int64_t row = first + warp; row < end; row += kFusedWarps) {
    const int64_t at = row * C;
    const float m = kRms ? 0.0f : mean[row], s = rstd[row];
    norm_backward_dx_row<W, kUnits, kAhead, T, kRms>(dx + at, dr ? dr + at : nullptr, dy + at, x + at, w, m, s, C, lane,
                                                    acc);
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const int64_t j = c % W, at = ((j / P) * units + c / W) * P + j % P;
    float sw = sums[at], sb = sums[C + at];
    for (int v = 1; v < kFusedWarps; ++v) {
      sw += sums[v * 2 * C + at];
      sb += sums[v * 2 * C + C + at];
    }
    partial[chunk * C + c] = sw;
    partial[(chunks + chunk) * C + c] = sb;
  }
}

// partial[chunk][c] = sum over the chunk's rows of dy xhat; partial[chunks + chunk][c] of dy.
template <class T, bool kRms>
__global__ void norm_backward_partial_kernel(float* partial, const T* dy, const T* x, const float* mean,
                                             const float* rstd, int64_t rows, int64_t C) {
  // chunks on x (up to 2^31 - 1: any row count), columns on y (C / 128 blocks)
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x, chunk = blockIdx.x, chunks = gridDim.x;
  if (c >= C) return;
  float dw = 0.0f, db = 0.0f;
  const int64_t end = (chunk + 1) * kRowsPerChunk < rows ? (chunk + 1) * kRowsPerChunk : rows;
  for (int64_t r = chunk * kRowsPerChunk; r < end; ++r) {
    const float g = to_f32(dy[r * C + c]);
    dw += g * (to_f32(x[r * C + c]) - (kRms ? 0.0f : mean[r])) * rstd[r];
    db += g;
  }
  partial[chunk * C + c] = dw;
  partial[(chunks + chunk) * C + c] = db;
}

// dw[c], db[c]: the chunks' partials added up. A block takes 32 columns; each of its kFinishLanes
// warps adds every kFinishLanes-th chunk (coalesced rows of 32 floats, many loads in flight), then
// one warp adds the warps' sums in a fixed order: deterministic, and 24 blocks of 16 warps at
// C = 768 where one thread per column walking all the chunks left most of the GPU idle.
constexpr int kFinishLanes = 16;
template <class T>
__global__ void __launch_bounds__(32 * kFinishLanes)
    norm_backward_finish_kernel(T* dw, T* db, const float* partial, int64_t chunks, int64_t C) {
  SG_SHARED(float, sums, 2 * kFinishLanes * 32);
  const int tx = int(threadIdx.x) % 32, ty = int(threadIdx.x) / 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  float sw = 0.0f, sb = 0.0f;
  if (c < C)
    for (int64_t k = ty; k < chunks; k += kFinishLanes) {
      sw += partial[k * C + c];
      sb += partial[(chunks + k) * C + c];
    }
  sums[ty * 32 + tx] = sw;
  sums[(kFinishLanes + ty) * 32 + tx] = sb;
  __syncthreads();
  if (ty != 0 || c >= C) return;
  sw = sb = 0.0f;
  for (int y = 0; y < kFinishLanes; ++y) {
    sw += sums[y * 32 + tx];
    sb += sums[(kFinishLanes + y) * 32 + tx];
  }
  dw[c] = from_f32<T>(sw);
  if (db) db[c] = from_f32<T>(sb);
}

// Workspace (f32 elements) the backward launchers need for rows x C.
inline int64_t norm_backward_workspace(int64_t rows, int64_t C) {
  return 2 * C * ((rows + kRowsPerChunk - 1) / kRowsPerChunk);
}

template <class T, bool kRms>
void norm_forward(T* y, float* mean, float* rstd, T* residual_out, const T* x, const T* residual, const T* w,
                  const T* b, int64_t rows, int64_t C, double eps, Stream stream) {
  // 16-byte packs when every row of every operand starts 16-byte aligned.
  const bool packed = C % Pack<T>::N == 0 && aligned16(y) && aligned16(x) && aligned16(w) && (!b || aligned16(b)) &&
                      (!residual || (aligned16(residual) && aligned16(residual_out)));
  launch(norm_forward_kernel<T, kRms>, dim3(blocks_for(rows, kNormWarps)), dim3(32 * kNormWarps), 0, stream, y, mean,
         rstd, residual_out, x, residual, w, b, rows, C, float(eps), packed);
}

// kind: where dw/db are summed (kernels/cuda/variants.h), as norm_backward_runs resolves it.
template <class T, bool kRms>
void norm_backward(T* dx, T* dw, T* db, const T* dr, const T* dy, const T* x, const T* w, const float* mean,
                   const float* rstd, int64_t rows, int64_t C, float* workspace, Stream stream, NormBackward kind) {
  const bool packed = C % Pack<T>::N == 0 && aligned16(dx) && aligned16(dy) && aligned16(x) && aligned16(w) &&
                      (!dr || aligned16(dr));
  const unsigned chunks = blocks_for(rows, int(kRowsPerChunk));
  kind = norm_backward_runs(kind, C, packed);
  const dim3 grid(chunks), block(32 * kFusedWarps);
  const size_t smem = size_t(norm_backward_smem_bytes(C));
  switch (kind) {
    case NormBackward::fused:
      launch(norm_backward_fused_kernel<T, kRms>, grid, block, 0, stream, dx, workspace, dr, dy, x, w, mean, rstd,
             rows, C);
      break;
    case NormBackward::smem:
      launch(norm_backward_smem_kernel<T, kRms, false>, grid, block, smem, stream, dx, workspace, dr, dy, x, w, mean,
             rstd, rows, C);
      break;
    case NormBackward::smem_ahead:
      launch(norm_backward_smem_kernel<T, kRms, true>, grid, block, smem, stream, dx, workspace, dr, dy, x, w, mean,
             rstd, rows, C);
      break;
    case NormBackward::split:
      launch(norm_backward_dx_kernel<T, kRms>, dim3(blocks_for(rows, kNormWarps)), dim3(32 * kNormWarps), 0, stream,
             dx, dr, dy, x, w, mean, rstd, rows, C, packed);
      launch(norm_backward_partial_kernel<T, kRms>, dim3(chunks, blocks_for(C, 128)), dim3(128), 0, stream, workspace,
             dy, x, mean, rstd, rows, C);
      break;
  }
  launch(norm_backward_finish_kernel<T>, dim3(blocks_for(C, 32)), dim3(32 * kFinishLanes), 0, stream, dw, db,
         static_cast<const float*>(workspace), int64_t(chunks), C);
}

// The op-table LayerNorm: y, mean, rstd ('='); b may be null.
template <class T>
void layernorm_forward(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b, int64_t rows, int64_t C,
                       double eps, Stream stream) {
  norm_forward<T, false>(y, mean, rstd, static_cast<T*>(nullptr), x, static_cast<const T*>(nullptr), w, b, rows, C,
                         eps, stream);
}

// residual_out = x + residual, then y = LayerNorm(residual_out): one pass instead of two. With
// residual null it is layernorm_forward (residual_out not written).
template <class T>
void residual_layernorm_forward(T* residual_out, T* y, float* mean, float* rstd, const T* x, const T* residual,
                                const T* w, const T* b, int64_t rows, int64_t C, double eps, Stream stream) {
  norm_forward<T, false>(y, mean, rstd, residual_out, x, residual, w, b, rows, C, eps, stream);
}

// The op-table backward: dx, dw, db all '='. workspace: norm_backward_workspace(rows, C) floats.
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const float* mean,
                        const float* rstd, int64_t rows, int64_t C, float* workspace, Stream stream,
                        NormBackward kind = NormBackward::fused) {
  norm_backward<T, false>(dx, dw, db, static_cast<const T*>(nullptr), dy, x, w, mean, rstd, rows, C, workspace,
                          stream, kind);
}

// Backward of residual_layernorm_forward: dx = dr + the LayerNorm's input gradient ('='), the
// gradient of both x and residual; dr is the gradient that reached residual_out from later in the
// network (null for none; it may be dx). dw, db '='. r is the saved residual_out.
template <class T>
void residual_layernorm_backward(T* dx, T* dw, T* db, const T* dr, const T* dy, const T* r, const T* w,
                                 const float* mean, const float* rstd, int64_t rows, int64_t C, float* workspace,
                                 Stream stream, NormBackward kind = NormBackward::fused) {
  norm_backward<T, false>(dx, dw, db, dr, dy, r, w, mean, rstd, rows, C, workspace, stream, kind);
}

template <class T>
void rmsnorm_forward(T* y, float* rstd, const T* x, const T* w, int64_t rows, int64_t C, double eps, Stream stream) {
  norm_forward<T, true>(y, static_cast<float*>(nullptr), rstd, static_cast<T*>(nullptr), x,
                        static_cast<const T*>(nullptr), w, static_cast<const T*>(nullptr), rows, C, eps, stream);
}

// dx, dw '='.
template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const float* rstd, int64_t rows, int64_t C,
                      float* workspace, Stream stream, NormBackward kind = NormBackward::fused) {
  norm_backward<T, true>(dx, dw, static_cast<T*>(nullptr), static_cast<const T*>(nullptr), dy, x, w,
                         static_cast<const float*>(nullptr), rstd, rows, C, workspace, stream, kind);
}

}  // namespace sg::cuda
