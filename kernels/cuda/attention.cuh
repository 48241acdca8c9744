// Causal flash attention on the device, forward and backward, tiled with an online softmax
// (FlashAttention-2's schedule), head dim 8, 16, 32, 64 or 128, f32 / bf16 / f16 storage, f32 math.
// This version uses plain FMAs, one thread per query (forward, dq) or key (dk, dv) row with K/V or
// Q/dO tiles staged in shared memory; the tensor-core (mma.sync m16n8k16) version, bf16 and f16 at
// head dim 64 or 128, is attention_tc.cuh.
// Layout (kernels::AttentionArgs): q, k, v, dq, dk, dv are [B, H, T, D] at the element strides
// a.q_layout() (batch, head, time), out and dout at a.o_layout(); the head dim is contiguous in all.
// Zero strides mean contiguous [B, H, T, D]; a GPT passes q, k, v as pointers into its packed
// [B, T, 3 H D] projection and out as [B, T, H D], so no head split or merge copies are needed.
// lse and the backward's workspace (Dv) stay contiguous [B, H, T] f32.
//   forward:  S = scale Q K^T (causal), lse = rowwise logsumexp S, O = softmax(S) V
//   backward: P = exp(S - lse), Dv = rowsum(dO o O), dS = P o (dO V^T - Dv),
//             dV = P^T dO, dQ = scale dS K, dK = scale dS^T Q                        (all '=')
// The backward recomputes S twice (once per key block for dK/dV, once per query block for dQ)
// instead of accumulating dQ with float atomics: no atomics, deterministic results.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

constexpr int kAttnRows = 64;  // query (or key) rows per block: one per thread
constexpr int kAttnTile = 32;  // rows of the tile staged in shared memory per step

// Where one family of tensors (q-family or o-family) keeps its heads: grid row blockIdx.y = b H + h
// is head (b, h), which starts b sb + h sh elements in; its rows lie st apart, the head dim is
// contiguous. Built on the host from AttentionArgs, passed to the kernels by value.
struct HeadLayout {
  int64_t H, sb, sh, st;
  SG_HOST_DEVICE int64_t head(int64_t bh) const { return bh / H * sb + bh % H * sh; }
};
inline HeadLayout head_layout(const kernels::AttentionArgs& a, kernels::AttentionArgs::Strides s) {
  return {a.H, s.b, s.h, s.t};
}
inline HeadLayout q_heads(const kernels::AttentionArgs& a) { return head_layout(a, a.q_layout()); }
inline HeadLayout o_heads(const kernels::AttentionArgs& a) { return head_layout(a, a.o_layout()); }

// Stages rows [r0, r0 + kAttnTile) of a [T, D] head with row stride st into contiguous shared f32
// (rows past T read as 0).
template <class T, int D>
SG_DEVICE void stage_tile(float* dst, const T* src, int64_t st, int64_t r0, int64_t rows) {
  for (int e = int(threadIdx.x); e < kAttnTile * D; e += int(blockDim.x)) {
    const int64_t r = r0 + e / D;
    dst[e] = r < rows ? to_f32(src[r * st + e % D]) : 0.0f;
  }
}

// Stages the K/V tiles (heads with row stride st) a block of query rows [row0, row0 + kAttnRows)
// needs into shared memory, one tile at a time, and calls visit(k_j, v_j) (rows of the tile) for
// each key j query row i attends to, in key order. Every thread takes part in the staging and the
// barriers.
template <class T, int D, class Visit>
SG_DEVICE void for_each_key(const T* k, const T* v, int64_t st, float* ks, float* vs, int64_t T_, int64_t row0,
                            int64_t i, bool causal, Visit&& visit) {
  const int64_t last = causal ? (row0 + kAttnRows < T_ ? row0 + kAttnRows : T_) : T_;
  for (int64_t j0 = 0; j0 < last; j0 += kAttnTile) {
    __syncthreads();  // the previous tile is no longer read
    stage_tile<T, D>(ks, k, st, j0, T_);
    stage_tile<T, D>(vs, v, st, j0, T_);
    __syncthreads();
    if (i >= T_) continue;
    for (int jj = 0; jj < kAttnTile; ++jj) {
      const int64_t j = j0 + jj;
      if (j >= T_ || (causal && j > i)) break;
      visit(ks + jj * D, vs + jj * D);
    }
  }
}

template <class T, int D>
__global__ void attention_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, HeadLayout ql,
                                         HeadLayout ol, int64_t T_, float scale, bool causal) {
  SG_SHARED(float, ks, kAttnTile * D);
  SG_SHARED(float, vs, kAttnTile * D);
  const int64_t bh = blockIdx.y, qh = ql.head(bh), oh = ol.head(bh), row0 = int64_t(blockIdx.x) * kAttnRows;
  const int64_t i = row0 + threadIdx.x;
  const bool live = i < T_;
  float qi[D], acc[D];
  for (int d = 0; d < D; ++d) {
    qi[d] = live ? to_f32(q[qh + i * ql.st + d]) * scale : 0.0f;
    acc[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for_each_key<T, D>(k + qh, v + qh, ql.st, ks, vs, T_, row0, i, causal, [&](const float* kj, const float* vj) {
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += qi[d] * kj[d];
    const float m_new = fmaxf(m, s), correction = expf(m - m_new), p = expf(s - m_new);
    l = l * correction + p;
    for (int d = 0; d < D; ++d) acc[d] = acc[d] * correction + p * vj[d];
    m = m_new;
  });
  if (!live) return;
  for (int d = 0; d < D; ++d) out[oh + i * ol.st + d] = from_f32<T>(acc[d] / l);
  lse[bh * T_ + i] = m + logf(l);
}

// Dv[i] = dO_i . O_i for the rows i = (b H + h) T + t of out and dout (layout ol); Dv contiguous.
template <class T, int D>
__global__ void attention_dot_kernel(float* dvec, const T* out, const T* dout, HeadLayout ol, int64_t T_,
                                     int64_t rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const int64_t at = ol.head(i / T_) + i % T_ * ol.st;
  float s = 0.0f;
  for (int d = 0; d < D; ++d) s += to_f32(out[at + d]) * to_f32(dout[at + d]);
  dvec[i] = s;
}

// One thread per key row j: dK_j, dV_j over the query tiles that see j.
template <class T, int D>
__global__ void attention_dkdv_kernel(T* dk, T* dv, const T* q, const T* k, const T* v, const T* dout,
                                      const float* lse, const float* dvec, HeadLayout ql, HeadLayout ol, int64_t T_,
                                      float scale, bool causal) {
  SG_SHARED(float, qs, kAttnTile * D);
  SG_SHARED(float, dos, kAttnTile * D);
  const int64_t bh = blockIdx.y, qh = ql.head(bh), oh = ol.head(bh), row0 = int64_t(blockIdx.x) * kAttnRows;
  const int64_t j = row0 + threadIdx.x;
  const bool live = j < T_;
  const float* lse_h = lse + bh * T_;
  const float* dvec_h = dvec + bh * T_;
  float kj[D], vj[D], dkj[D], dvj[D];
  for (int d = 0; d < D; ++d) {
    kj[d] = live ? to_f32(k[qh + j * ql.st + d]) : 0.0f;
    vj[d] = live ? to_f32(v[qh + j * ql.st + d]) : 0.0f;
    dkj[d] = dvj[d] = 0.0f;
  }
  const int64_t first = causal ? row0 / kAttnTile * kAttnTile : 0;  // queries before row0 never see these keys
  for (int64_t i0 = first; i0 < T_; i0 += kAttnTile) {
    __syncthreads();
    stage_tile<T, D>(qs, q + qh, ql.st, i0, T_);
    stage_tile<T, D>(dos, dout + oh, ol.st, i0, T_);
    __syncthreads();
    if (!live) continue;
    for (int ii = 0; ii < kAttnTile; ++ii) {
      const int64_t i = i0 + ii;
      if (i >= T_) break;
      if (causal && i < j) continue;
      float s = 0.0f, dp = 0.0f;
      for (int d = 0; d < D; ++d) {
        s += qs[ii * D + d] * kj[d];
        dp += dos[ii * D + d] * vj[d];
      }
      const float p = expf(s * scale - lse_h[i]), ds = p * (dp - dvec_h[i]);
      for (int d = 0; d < D; ++d) {
        dvj[d] += p * dos[ii * D + d];
        dkj[d] += scale * ds * qs[ii * D + d];
      }
    }
  }
  if (!live) return;
  for (int d = 0; d < D; ++d) {
    dk[qh + j * ql.st + d] = from_f32<T>(dkj[d]);
    dv[qh + j * ql.st + d] = from_f32<T>(dvj[d]);
  }
}

// One thread per query row i: dQ_i over the key tiles i sees.
template <class T, int D>
__global__ void attention_dq_kernel(T* dq, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                    const float* dvec, HeadLayout ql, HeadLayout ol, int64_t T_, float scale,
                                    bool causal) {
  SG_SHARED(float, ks, kAttnTile * D);
  SG_SHARED(float, vs, kAttnTile * D);
  const int64_t bh = blockIdx.y, qh = ql.head(bh), oh = ol.head(bh), row0 = int64_t(blockIdx.x) * kAttnRows;
  const int64_t i = row0 + threadIdx.x;
  const bool live = i < T_;
  float qi[D], doi[D], dqi[D];
  for (int d = 0; d < D; ++d) {
    qi[d] = live ? to_f32(q[qh + i * ql.st + d]) : 0.0f;
    doi[d] = live ? to_f32(dout[oh + i * ol.st + d]) : 0.0f;
    dqi[d] = 0.0f;
  }
  const float lse_i = live ? lse[bh * T_ + i] : 0.0f, dv_i = live ? dvec[bh * T_ + i] : 0.0f;
  for_each_key<T, D>(k + qh, v + qh, ql.st, ks, vs, T_, row0, i, causal, [&](const float* kj, const float* vj) {
    float s = 0.0f, dp = 0.0f;
    for (int d = 0; d < D; ++d) {
      s += qi[d] * kj[d];
      dp += doi[d] * vj[d];
    }
    const float ds = expf(s * scale - lse_i) * (dp - dv_i);
    for (int d = 0; d < D; ++d) dqi[d] += scale * ds * kj[d];
  });
  if (!live) return;
  for (int d = 0; d < D; ++d) dq[qh + i * ql.st + d] = from_f32<T>(dqi[d]);
}

// The FMA kernels keep a row of q (or k, v) in registers: the head dim is a compile-time size.
template <class Body>
void dispatch_head_dim(int64_t D, Body&& body) {
  if (D == 8) return body(std::integral_constant<int, 8>{});
  if (D == 16) return body(std::integral_constant<int, 16>{});
  if (D == 32) return body(std::integral_constant<int, 32>{});
  if (D == 64) return body(std::integral_constant<int, 64>{});
  if (D == 128) return body(std::integral_constant<int, 128>{});
  throw Error(str("attention (cuda): head dim ", D, " is not supported (8, 16, 32, 64 or 128)"));
}

// a.lse must be f32; forward writes out and lse ('=').
inline void attention_forward(const kernels::AttentionArgs& a, Stream stream) {
  dispatch_storage(a.dtype, "attention", [&](auto tag) {
    dispatch_head_dim(a.D, [&](auto dim) {
      using T = decltype(tag);
      constexpr int D = decltype(dim)::value;
      launch(attention_forward_kernel<T, D>, dim3(blocks_for(a.T, kAttnRows), blocks_for(a.B * a.H, 1)), dim3(kAttnRows),
             0, stream, static_cast<T*>(a.out), static_cast<float*>(a.lse), static_cast<const T*>(a.q),
             static_cast<const T*>(a.k), static_cast<const T*>(a.v), q_heads(a), o_heads(a), a.T, float(a.scale),
             a.causal);
    });
  });
}

// Workspace (f32 elements) of the backward: one per query row.
inline int64_t attention_backward_workspace(const kernels::AttentionArgs& a) { return a.B * a.H * a.T; }

inline void attention_backward(const kernels::AttentionArgs& a, float* workspace, Stream stream) {
  dispatch_storage(a.dtype, "attention_backward", [&](auto tag) {
    dispatch_head_dim(a.D, [&](auto dim) {
      using T = decltype(tag);
      constexpr int D = decltype(dim)::value;
      auto q = static_cast<const T*>(a.q), k = static_cast<const T*>(a.k), v = static_cast<const T*>(a.v);
      auto dout = static_cast<const T*>(a.dout);
      auto lse = static_cast<const float*>(a.lse);
      const float* dvec = workspace;
      const HeadLayout ql = q_heads(a), ol = o_heads(a);
      const dim3 grid(blocks_for(a.T, kAttnRows), blocks_for(a.B * a.H, 1)), block(kAttnRows);
      launch(attention_dot_kernel<T, D>, dim3(blocks_for(a.B * a.H * a.T, 256)), dim3(256), 0, stream, workspace,
             static_cast<const T*>(a.out), dout, ol, a.T, a.B * a.H * a.T);
      launch(attention_dkdv_kernel<T, D>, grid, block, 0, stream, static_cast<T*>(a.dk), static_cast<T*>(a.dv), q, k,
             v, dout, lse, dvec, ql, ol, a.T, float(a.scale), a.causal);
      launch(attention_dq_kernel<T, D>, grid, block, 0, stream, static_cast<T*>(a.dq), q, k, v, dout, lse, dvec, ql,
             ol, a.T, float(a.scale), a.causal);
    });
  });
}

}  // namespace sg::cuda
