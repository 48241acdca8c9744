// Causal flash attention forward on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate),
// head dim 64 or 128, bf16 storage only; the same contract as attention_forward in attention.cuh
// (out '=' bf16 [B, H, T, D], lse '=' f32 [B, H, T]), which stays the path for f32 and the backward.
// Schedule (FlashAttention-2): a block of 4 warps owns 64 query rows, 16 per warp; per tile of 32
// keys each warp computes S = scale Q K^T (16 x 32) in registers, masks it, updates its running row
// max m and sum l (the four lanes of a quad share a row), turns S into P = exp(S - m) and feeds P
// as bf16 A fragments straight from the accumulators into O += P V. Rows are normalised once at
// the end: O / l, lse = m + log l. P is rounded to bf16 for P V; l sums the unrounded P.
#pragma once
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/mma.cuh"

namespace sg::cuda {

constexpr int kTcRows = 64;  // query rows per block: 16 per warp, 4 warps
constexpr int kTcKeys = 32;  // keys per shared-memory tile
constexpr int kTcThreads = 128;  // kTcRows / 16 warps

// Rows [r0, r0 + count) of a [T, D] head into shared memory with row stride ld (rows past T: 0).
template <int D>
SG_DEVICE void stage_rows_bf16(bf16* dst, int ld, const bf16* src, int64_t r0, int count, int64_t rows) {
  for (int e = int(threadIdx.x); e < count * D; e += int(blockDim.x)) {
    const int r = e / D, c = e % D;
    dst[r * ld + c] = r0 + r < rows ? src[(r0 + r) * D + c] : from_f32<bf16>(0.0f);
  }
}

template <int D>
__global__ void __launch_bounds__(kTcThreads) attention_forward_tc_kernel(bf16* out, float* lse, const bf16* q,
                                                                   const bf16* k, const bf16* v, int64_t T_,
                                                                   float scale, bool causal) {
  constexpr int ld = D + 8;  // padding staggers rows across shared-memory banks; keeps pairs 4-byte aligned
  SG_SHARED(bf16, qs, kTcRows * ld);
  SG_SHARED(bf16, ks, kTcKeys * ld);
  SG_SHARED(bf16, vs, kTcKeys * ld);
  const int64_t head = int64_t(blockIdx.y) * T_ * D, row0 = int64_t(blockIdx.x) * kTcRows;
  const int warp = int(threadIdx.x) / 32, t = mma_thread_in_group();
  const int64_t rows[2] = {row0 + warp * 16 + mma_group(), row0 + warp * 16 + mma_group() + 8};

  stage_rows_bf16<D>(qs, ld, q + head, row0, kTcRows, T_);
  __syncthreads();
  FragA qf[D / 16];
  for (int kk = 0; kk < D / 16; ++kk) qf[kk] = load_a_row_major(qs + warp * 16 * ld + 16 * kk, ld);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  FragC o[D / 8];
  const int64_t last = causal ? (row0 + kTcRows < T_ ? row0 + kTcRows : T_) : T_;
  for (int64_t j0 = 0; j0 < last; j0 += kTcKeys) {
    __syncthreads();  // the previous tile is no longer read
    stage_rows_bf16<D>(ks, ld, k + head, j0, kTcKeys, T_);
    stage_rows_bf16<D>(vs, ld, v + head, j0, kTcKeys, T_);
    __syncthreads();

    FragC s[kTcKeys / 8];
    for (int n = 0; n < kTcKeys / 8; ++n)
      for (int kk = 0; kk < D / 16; ++kk) mma(s[n], qf[kk], load_b_col_major(ks + n * 8 * ld + 16 * kk, ld));

    // Key 0 is in the first tile and visible to every row, so m is finite after it.
    float m_new[2] = {m[0], m[1]};
    for (int n = 0; n < kTcKeys / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        const int64_t col = j0 + 8 * n + 2 * t + (i & 1);
        const bool hidden = col >= T_ || (causal && col > rows[i / 2]);
        s[n].x[i] = hidden ? -INFINITY : s[n].x[i] * scale;
        m_new[i / 2] = fmaxf(m_new[i / 2], s[n].x[i]);
      }
    float correction[2];
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(kFullMask, m_new[h], 1));
      m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(kFullMask, m_new[h], 2));
      correction[h] = expf(m[h] - m_new[h]);
      m[h] = m_new[h];
      l[h] *= correction[h];  // l is this lane's share of the row sum until the end
    }
    for (int n = 0; n < kTcKeys / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        s[n].x[i] = expf(s[n].x[i] - m[i / 2]);
        l[i / 2] += s[n].x[i];
      }
    for (int dn = 0; dn < D / 8; ++dn)
      for (int i = 0; i < 4; ++i) o[dn].x[i] *= correction[i / 2];
    for (int kk = 0; kk < kTcKeys / 16; ++kk) {
      const FragA p = a_from_accumulators(s[2 * kk], s[2 * kk + 1]);
      for (int dn = 0; dn < D / 8; ++dn) mma(o[dn], p, load_b_row_major(vs + 16 * kk * ld + 8 * dn, ld));
    }
  }

  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
  }
  for (int dn = 0; dn < D / 8; ++dn)
    for (int i = 0; i < 4; ++i)
      if (rows[i / 2] < T_) out[head + rows[i / 2] * D + 8 * dn + 2 * t + (i & 1)] = from_f32<bf16>(o[dn].x[i] / l[i / 2]);
  for (int h = 0; h < 2; ++h)
    if (t == 0 && rows[h] < T_) lse[int64_t(blockIdx.y) * T_ + rows[h]] = m[h] + logf(l[h]);
}

// a.lse must be f32; writes out and lse ('='). bf16 only: tensor cores take no f32 operands here.
inline bool tensor_core_head_dim(int64_t D) { return D == 64 || D == 128; }

inline void attention_forward_tensor_cores(const kernels::AttentionArgs& a, Stream stream) {
  if (a.dtype != DType::bf16) kernels::unsupported("attention (tensor cores)", a.dtype, "cuda");
  SG_CHECK(tensor_core_head_dim(a.D), "attention (tensor cores): head dim ", a.D, " is not supported (64 or 128)");
  auto body = [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    launch(attention_forward_tc_kernel<D>, dim3(blocks_for(a.T, kTcRows), unsigned(a.B * a.H)), dim3(kTcThreads), 0,
           stream, static_cast<bf16*>(a.out), static_cast<float*>(a.lse), static_cast<const bf16*>(a.q),
           static_cast<const bf16*>(a.k), static_cast<const bf16*>(a.v), a.T, float(a.scale), a.causal);
  };
  if (a.D == 64) body(std::integral_constant<int, 64>{});
  else body(std::integral_constant<int, 128>{});
}

}  // namespace sg::cuda
