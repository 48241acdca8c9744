// Causal flash attention on tensor cores (mma.sync m16n8k16, bf16 or f16 in, f32 accumulate), head
// dim 64 or 128, bf16 or f16 storage (the element type E of every kernel); the same contract as
// attention.cuh (out '=' E [B, H, T, D], lse '=' f32 [B, H, T]; backward dq, dk, dv '='), which
// stays the path for f32 and other head dims. The same layout too: q, k, v, dq, dk, dv at the
// strides a.q_layout(), out and dout at a.o_layout() (HeadLayout), the head dim contiguous; lse and
// the Dv workspace contiguous [B, H, T] f32.
// Forward (FlashAttention-2): a block of 4 warps owns 64 query rows, 16 per warp; per tile of 32
// keys (64 under FlashForward::keys64, head dim 64) each warp computes S = scale Q K^T (16 x 32) in
// registers, masks it, updates its running row
// max m and sum l (the four lanes of a quad share a row), turns S into P = exp(S - m) and feeds P
// as A fragments of E straight from the accumulators into O += P V. Rows are normalised once at
// the end: O / l, lse = m + log l. P is rounded to E for P V; l sums the unrounded P.
// Every kernel turns S into P with one multiply-add and exp2 (the scale times log2(e), with the
// running max or lse folded in; the forward keeps the max of the raw S, so it needs scale > 0; lse
// itself stays natural), masks only the tiles that cross the causal diagonal or the end of the
// sequence, and the causal grids take their blocks heaviest first across all heads (forward and
// dq: the last query rows, which see the most keys; dk/dv: the first keys, which the most queries
// see), so that the grid's tail is its lightest blocks.
// Backward, two kernels and no atomics (deterministic), with P rebuilt from the saved lse:
//   dk/dv: a block owns 64 keys, 16 per warp, K and V held as A fragments; per tile of 32 queries
//          (16 at head dim 128, kTcBackwardTile)
//          S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T o (dP^T - Dv),
//          dV += P^T dO, dK += scale dS^T Q;
//   dq:    a block owns 64 queries like the forward; per tile of 32 keys (16 at head dim 128)
//          S = Q K^T, P, dP = dO V^T,
//          dS = P o (dP - Dv), dQ += scale dS K.
// Dv = rowsum(dO o O) comes from attention.cuh's dot kernel. P and dS are rounded to E as the
// A operands of the second products (P lies in [0, 1]; dS, like the stored gradients, must fit in
// E's range, which for f16 ends at 65504).
#pragma once
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/variants.h"

namespace sg::cuda {

constexpr int kTcRows = 64;  // query rows per block: 16 per warp, 4 warps
constexpr int kTcKeys = 32;  // keys per shared-memory tile (forward; the default of its kKeys)
// Keys (dq) or queries (dk/dv) per shared-memory tile of the backward kernels. Head dim 128 takes
// 16: at 32 its register state (K and V or Q and dO as fragments, two 16 x D accumulators, two
// S-sized tiles and the next tile's loads) passes 255 registers and ptxas spills (444 bytes in
// dk/dv, 56 in dq); a 16-wide tile halves the S-sized part and the loads in flight.
template <int D>
constexpr int kTcBackwardTile = D == 128 ? 16 : 32;
constexpr int kTcThreads = 128;  // kTcRows / 16 warps
constexpr float kLog2e = 1.4426950408889634f;

// The head (b * H + h) and first row of a block on a grid of (row blocks, B * H): kTcRows query rows
// (forward, dq) or keys (dk/dv). Causal: blocks in launch order (x fastest) take every head's
// heaviest block, then every head's next heaviest, and so on, so that the grid's tail is its
// lightest blocks (longest first: the last wave is short). A query block is heavier the later its
// rows (it sees more keys), a key block the earlier (more queries see it). Not causal: (x, y).
struct RowBlock {
  int64_t bh, row0;
};
SG_DEVICE RowBlock heaviest_first(bool causal, bool later_is_heavier) {
  if (!causal) return {int64_t(blockIdx.y), int64_t(blockIdx.x) * kTcRows};
  const int64_t heads = gridDim.y, order = int64_t(blockIdx.x) + int64_t(blockIdx.y) * gridDim.x;
  const int64_t rank = order / heads;  // 0: the heaviest
  return {order % heads, (later_is_heavier ? int64_t(gridDim.x) - 1 - rank : rank) * kTcRows};
}
SG_DEVICE RowBlock query_block(bool causal) { return heaviest_first(causal, true); }
SG_DEVICE RowBlock key_block(bool causal) { return heaviest_first(causal, false); }

// kCount rows of a [T, D] head (rows st elements apart) on their way into shared memory, held in
// this thread's registers in between: fetch() issues every global load the thread owns before
// any of them is stored, so their latencies overlap (a load and a shared store through generic
// pointers are otherwise kept in order, one round trip each); put() stores them, row stride ld,
// rows past T as 0. The loops fetch tile j + 1 before computing on tile j, so the loads also
// overlap that work. 16-byte pieces when every row starts 16-byte aligned, else element by element
// into the same registers. All kTcThreads threads of the block take part.
template <class E, int D, int kCount>
struct TileCopy {
  static constexpr int kPer = 8;  // elements in a 16-byte piece
  static constexpr int kPieces = kCount * D / kPer, kEach = (kPieces + kTcThreads - 1) / kTcThreads;
  static_assert(D % kPer == 0, "TileCopy: head dims of whole 16-byte pieces");
  Pack<uint32_t> regs[kEach];

  SG_DEVICE void fetch(const E* src, int64_t st, int64_t r0, int64_t rows) {
    const bool whole = st % kPer == 0 && aligned16(src);
    for (int i = 0; i < kEach; ++i) {
      const int e = int(threadIdx.x) + i * kTcThreads, r = e / (D / kPer), c = e % (D / kPer) * kPer;
      Pack<uint32_t>& p = regs[i];
      if (e >= kPieces || r0 + r >= rows) {
        for (int w = 0; w < 4; ++w) p.v[w] = 0;
      } else if (whole) {
        p = load_pack(reinterpret_cast<const uint32_t*>(src + (r0 + r) * st + c));
      } else {
        const E* at = src + (r0 + r) * st + c;
        for (int w = 0; w < 4; ++w) p.v[w] = pack_x2(at[2 * w], at[2 * w + 1]);
      }
    }
  }
  SG_DEVICE void put(E* dst, int ld) const {
    for (int i = 0; i < kEach; ++i) {
      const int e = int(threadIdx.x) + i * kTcThreads, r = e / (D / kPer), c = e % (D / kPer) * kPer;
      if (e < kPieces) store_pack(reinterpret_cast<uint32_t*>(dst + r * ld + c), regs[i]);
    }
  }
};

// This warp's 16 of the block's kTcRows rows [r0, r0 + kTcRows) of a [T, D] head with row stride
// st, as A fragments (one per 16 columns), staged through buf (kTcRows * (D + 8) elements of shared
// memory, 16-byte aligned). Every thread of the block takes part; buf may be reused as soon as it
// returns.
template <class E, int D>
SG_DEVICE void load_warp_rows(FragA<E> (&f)[D / 16], E* buf, const E* src, int64_t st, int64_t r0, int64_t rows) {
  constexpr int ld = D + 8;
  TileCopy<E, D, kTcRows> copy;
  copy.fetch(src, st, r0, rows);
  __syncthreads();  // buf is no longer read
  copy.put(buf, ld);
  __syncthreads();
  const int warp = int(threadIdx.x) / 32;
  for (int kk = 0; kk < D / 16; ++kk) f[kk] = load_a_row_major(buf + warp * 16 * ld + 16 * kk, ld);
}

// acc[n] = a tile^T over the head dim: this warp's 16 rows (a, one fragment per 16 columns) against
// the 8 N rows of a staged tile, 8 rows per accumulator (S = Q K^T and its kin).
// One ldmatrix.x4 per n-tile and two k-steps.
template <class E, int D, int N>
SG_DEVICE void mma_tile_t(FragC (&acc)[N], const FragA<E> (&a)[D / 16], const E* tile, int ld) {
  for (int n = 0; n < N; ++n)
    for (int kk = 0; kk < D / 16; kk += 2) {
      FragB<E> b0, b1;
      load_b_col_major_x2(b0, b1, tile + n * 8 * ld + 16 * kk, ld);
      mma(acc[n], a[kk], b0);
      mma(acc[n], a[kk + 1], b1);
    }
}

// acc[dn] += a rows of a staged tile, over the tile's 16 rows at `rows` (O += P V and its kin).
// One ldmatrix.x4.trans per two n-tiles (instead of eight 16-bit loads per n-tile).
template <class E, int D>
SG_DEVICE void mma_rows(FragC (&acc)[D / 8], const FragA<E>& a, const E* rows, int ld) {
  for (int dn = 0; dn < D / 8; dn += 2) {
    FragB<E> b0, b1;
    load_b_row_major_x2(b0, b1, rows + 8 * dn, ld);
    mma(acc[dn], a, b0);
    mma(acc[dn + 1], a, b1);
  }
}

inline bool tensor_core_head_dim(int64_t D) { return D == 64 || D == 128; }
inline bool tensor_core_dtype(DType dt) { return dt == DType::bf16 || dt == DType::f16; }

// Runs body(E{}, integral_constant<int, D>) for the element types (bf16, f16) and head dims the
// tensor-core kernels take; refuses the others, naming them. tc_op: the op, "(tensor cores)" added.
template <class Body>
void dispatch_tensor_cores(DType dtype, int64_t D, const char* tc_op, Body&& body) {
  if (!tensor_core_dtype(dtype)) kernels::unsupported(tc_op, dtype, "cuda");
  SG_CHECK(tensor_core_head_dim(D), tc_op, ": head dim ", D, " is not supported (64 or 128)");
  auto with_dim = [&](auto tag) {
    if (D == 64) body(tag, std::integral_constant<int, 64>{});
    else body(tag, std::integral_constant<int, 128>{});
  };
  if (dtype == DType::bf16) with_dim(bf16{});
  else with_dim(f16{});
}

template <class E, int D, int kKeys = kTcKeys>
__global__ void __launch_bounds__(kTcThreads) attention_forward_tc_kernel(E* out, float* lse, const E* q, const E* k,
                                                                          const E* v, HeadLayout ql, HeadLayout ol,
                                                                          int64_t T_, float scale, bool causal) {
  constexpr int ld = D + 8;  // padding staggers rows across shared-memory banks; keeps pairs 4-byte aligned
  SG_SHARED(E, qs, kTcRows * ld);
  SG_SHARED(E, ks, kKeys * ld);
  SG_SHARED(E, vs, kKeys * ld);
  const RowBlock qb = query_block(causal);
  const int64_t bh = qb.bh, qh = ql.head(bh), oh = ol.head(bh), row0 = qb.row0;
  const int warp = int(threadIdx.x) / 32, t = mma_thread_in_group();
  const int64_t rows[2] = {row0 + warp * 16 + mma_group(), row0 + warp * 16 + mma_group() + 8};
  const float scale2 = scale * kLog2e;  // exp(scale (s - m)) = exp2(scale2 s - scale2 m)

  FragA<E> qf[D / 16];
  load_warp_rows<E, D>(qf, qs, q + qh, ql.st, row0, T_);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // m: the row max of the raw S (scale > 0)
  FragC o[D / 8];
  const int64_t last = causal ? (row0 + kTcRows < T_ ? row0 + kTcRows : T_) : T_;
  TileCopy<E, D, kKeys> kc, vc;
  kc.fetch(k + qh, ql.st, 0, T_);
  vc.fetch(v + qh, ql.st, 0, T_);
  for (int64_t j0 = 0; j0 < last; j0 += kKeys) {
    __syncthreads();  // the previous tile is no longer read
    kc.put(ks, ld);
    vc.put(vs, ld);
    __syncthreads();
    if (j0 + kKeys < last) {  // the next tile's loads, in flight while this one is computed on
      kc.fetch(k + qh, ql.st, j0 + kKeys, T_);
      vc.fetch(v + qh, ql.st, j0 + kKeys, T_);
    }

    FragC s[kKeys / 8];
    mma_tile_t<E, D>(s, qf, ks, ld);

    // Key 0 is in the first tile and visible to every row, so m is finite after it. Only a tile
    // with a key past the block's first row (causal) or past the end needs the mask.
    const bool edge = (causal && j0 + kKeys - 1 > row0) || j0 + kKeys > T_;
    float m_new[2] = {m[0], m[1]};
    for (int n = 0; n < kKeys / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        if (edge) {
          const int64_t col = j0 + 8 * n + 2 * t + (i & 1);
          if (col >= T_ || (causal && col > rows[i / 2])) s[n].x[i] = -INFINITY;
        }
        m_new[i / 2] = fmaxf(m_new[i / 2], s[n].x[i]);
      }
    float correction[2], m_scaled[2];
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(kFullMask, m_new[h], 1));
      m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(kFullMask, m_new[h], 2));
      correction[h] = exp2f((m[h] - m_new[h]) * scale2);
      m[h] = m_new[h];
      m_scaled[h] = m[h] * scale2;
      l[h] *= correction[h];  // l is this lane's share of the row sum until the end
    }
    for (int n = 0; n < kKeys / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        s[n].x[i] = exp2f(fmaf(s[n].x[i], scale2, -m_scaled[i / 2]));
        l[i / 2] += s[n].x[i];
      }
    for (int dn = 0; dn < D / 8; ++dn)
      for (int i = 0; i < 4; ++i) o[dn].x[i] *= correction[i / 2];
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const FragA<E> p = a_from_accumulators<E>(s[2 * kk], s[2 * kk + 1]);
      mma_rows<E, D>(o, p, vs + 16 * kk * ld, ld);
    }
  }

  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
  }
  for (int dn = 0; dn < D / 8; ++dn)
    for (int i = 0; i < 4; ++i)
      if (rows[i / 2] < T_)
        out[oh + rows[i / 2] * ol.st + 8 * dn + 2 * t + (i & 1)] = from_f32<E>(o[dn].x[i] / l[i / 2]);
  for (int h = 0; h < 2; ++h)
    if (t == 0 && rows[h] < T_) lse[bh * T_ + rows[h]] = m[h] * scale + logf(l[h]);
}

// a.lse must be f32; writes out and lse ('='). bf16 or f16: tensor cores take no f32 operands here;
// scale > 0 (the running max is kept over the unscaled scores).
inline void attention_forward_tensor_cores(const kernels::AttentionArgs& a, Stream stream,
                                           FlashForward kind = FlashForward::keys32) {
  SG_CHECK(a.scale > 0, "attention (tensor cores): scale ", a.scale, " must be > 0");
  dispatch_tensor_cores(a.dtype, a.D, "attention (tensor cores)", [&](auto tag, auto dim) {
    using E = decltype(tag);
    constexpr int D = decltype(dim)::value;
    auto kernel = attention_forward_tc_kernel<E, D>;
    if constexpr (D == 64)  // head dim 128 at 64 keys would pass the 48 KiB of static shared memory
      if (kind == FlashForward::keys64) kernel = attention_forward_tc_kernel<E, D, 64>;
    launch(kernel, dim3(blocks_for(a.T, kTcRows), blocks_for(a.B * a.H, 1)), dim3(kTcThreads),
           0, stream, static_cast<E*>(a.out), static_cast<float*>(a.lse), static_cast<const E*>(a.q),
           static_cast<const E*>(a.k), static_cast<const E*>(a.v), q_heads(a), o_heads(a), a.T, float(a.scale),
           a.causal);
  });
}

// A [kCount] slice of a per-row f32 vector times factor (rows past T: 0), fetched to a register of
// the first kCount threads and put into shared memory later, as TileCopy does.
template <int kCount>
struct RowValues {
  float value = 0.0f;
  SG_DEVICE void fetch(const float* src, int64_t r0, int64_t rows, float factor = 1.0f) {
    const int e = int(threadIdx.x);
    value = e < kCount && r0 + e < rows ? src[r0 + e] * factor : 0.0f;
  }
  SG_DEVICE void put(float* dst) const {
    if (int(threadIdx.x) < kCount) dst[threadIdx.x] = value;
  }
};

// kMinBlocks: the backward kernels' blocks resident per SM that ptxas fits their registers to
// (__launch_bounds__' second argument; 0 leaves it to ptxas, which takes 176 for dq where 1 would
// let it take 214). FlashBackward (variants.h) picks it, at head dim 64 only.
template <class E, int D, int kMinBlocks = 0>
__global__ void __launch_bounds__(kTcThreads, kMinBlocks) attention_dkdv_tc_kernel(E* dk, E* dv, const E* q, const E* k,
                                                                       const E* v, const E* dout, const float* lse,
                                                                       const float* dvec, HeadLayout ql,
                                                                       HeadLayout ol, int64_t T_, float scale,
                                                                       bool causal) {
  constexpr int ld = D + 8, kQueries = kTcBackwardTile<D>;
  SG_SHARED(E, kv, kTcRows * ld);  // this block's keys, then its values
  SG_SHARED(E, qs, kQueries * ld);
  SG_SHARED(E, dos, kQueries * ld);
  SG_SHARED(float, lse_s, kQueries);
  SG_SHARED(float, dvec_s, kQueries);
  const RowBlock kb = key_block(causal);
  const int64_t bh = kb.bh, qh = ql.head(bh), oh = ol.head(bh), key0 = kb.row0;
  const float* lse_h = lse + bh * T_;
  const float* dvec_h = dvec + bh * T_;
  const int warp = int(threadIdx.x) / 32, t = mma_thread_in_group();
  const int64_t keys[2] = {key0 + warp * 16 + mma_group(), key0 + warp * 16 + mma_group() + 8};
  const float scale2 = scale * kLog2e;  // S in base 2, against lse log2(e) in lse_s

  FragA<E> kf[D / 16], vf[D / 16];
  load_warp_rows<E, D>(kf, kv, k + qh, ql.st, key0, T_);
  load_warp_rows<E, D>(vf, kv, v + qh, ql.st, key0, T_);

  FragC dkc[D / 8], dvc[D / 8];
  // Queries before this block's first key see none of its keys.
  const int64_t first = causal ? key0 / kQueries * kQueries : 0;
  TileCopy<E, D, kQueries> qc, doc;
  RowValues<kQueries> lc, dc;
  const auto fetch = [&](int64_t i0) {
    qc.fetch(q + qh, ql.st, i0, T_);
    doc.fetch(dout + oh, ol.st, i0, T_);
    lc.fetch(lse_h, i0, T_, kLog2e);
    dc.fetch(dvec_h, i0, T_);
  };
  fetch(first);
  for (int64_t i0 = first; i0 < T_; i0 += kQueries) {
    __syncthreads();  // the previous tile is no longer read
    qc.put(qs, ld);
    doc.put(dos, ld);
    lc.put(lse_s);
    dc.put(dvec_s);
    __syncthreads();
    if (i0 + kQueries < T_) fetch(i0 + kQueries);  // in flight while this tile is computed on

    FragC st[kQueries / 8], dpt[kQueries / 8];  // S^T and dP^T: 16 keys x kQueries queries
    mma_tile_t<E, D>(st, kf, qs, ld);
    mma_tile_t<E, D>(dpt, vf, dos, ld);
    // Only a tile with a query before the block's last key (causal) or past the end needs the
    // mask (keys past the end are never written).
    const bool edge = (causal && i0 < key0 + kTcRows - 1) || i0 + kQueries > T_;
    for (int n = 0; n < kQueries / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        const int c = 8 * n + 2 * t + (i & 1);
        float p = exp2f(st[n].x[i] * scale2 - lse_s[c]);
        if (edge) {
          const int64_t query = i0 + c, key = keys[i / 2];
          if (query >= T_ || (causal && key > query)) p = 0.0f;
        }
        st[n].x[i] = p;                              // P^T
        dpt[n].x[i] = p * (dpt[n].x[i] - dvec_s[c]);  // dS^T
      }
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const FragA<E> p = a_from_accumulators<E>(st[2 * kk], st[2 * kk + 1]);
      const FragA<E> ds = a_from_accumulators<E>(dpt[2 * kk], dpt[2 * kk + 1]);
      mma_rows<E, D>(dvc, p, dos + 16 * kk * ld, ld);
      mma_rows<E, D>(dkc, ds, qs + 16 * kk * ld, ld);
    }
  }
  for (int dn = 0; dn < D / 8; ++dn)
    for (int i = 0; i < 4; ++i) {
      const int64_t key = keys[i / 2];
      if (key >= T_) continue;
      const int64_t at = qh + key * ql.st + 8 * dn + 2 * t + (i & 1);
      dk[at] = from_f32<E>(scale * dkc[dn].x[i]);
      dv[at] = from_f32<E>(dvc[dn].x[i]);
    }
}

template <class E, int D, int kMinBlocks = 0>
__global__ void __launch_bounds__(kTcThreads, kMinBlocks) attention_dq_tc_kernel(E* dq, const E* q, const E* k, const E* v,
                                                                     const E* dout, const float* lse,
                                                                     const float* dvec, HeadLayout ql,
                                                                     HeadLayout ol, int64_t T_, float scale,
                                                                     bool causal) {
  constexpr int ld = D + 8, kKeys = kTcBackwardTile<D>;
  SG_SHARED(E, rows_s, kTcRows * ld);  // this block's queries, then its output gradients
  SG_SHARED(E, ks, kKeys * ld);
  SG_SHARED(E, vs, kKeys * ld);
  const RowBlock qb = query_block(causal);
  const int64_t bh = qb.bh, qh = ql.head(bh), oh = ol.head(bh), row0 = qb.row0;
  const int warp = int(threadIdx.x) / 32, t = mma_thread_in_group();
  const int64_t rows[2] = {row0 + warp * 16 + mma_group(), row0 + warp * 16 + mma_group() + 8};
  const float scale2 = scale * kLog2e;  // S in base 2, against lse log2(e)
  float row_lse[2], row_dvec[2];
  for (int h = 0; h < 2; ++h) {
    const bool live = rows[h] < T_;
    row_lse[h] = live ? lse[bh * T_ + rows[h]] * kLog2e : 0.0f;
    row_dvec[h] = live ? dvec[bh * T_ + rows[h]] : 0.0f;
  }

  FragA<E> qf[D / 16], dof[D / 16];
  load_warp_rows<E, D>(qf, rows_s, q + qh, ql.st, row0, T_);
  load_warp_rows<E, D>(dof, rows_s, dout + oh, ol.st, row0, T_);

  FragC dqc[D / 8];
  const int64_t last = causal ? (row0 + kTcRows < T_ ? row0 + kTcRows : T_) : T_;
  TileCopy<E, D, kKeys> kc, vc;
  kc.fetch(k + qh, ql.st, 0, T_);
  vc.fetch(v + qh, ql.st, 0, T_);
  for (int64_t j0 = 0; j0 < last; j0 += kKeys) {
    __syncthreads();
    kc.put(ks, ld);
    vc.put(vs, ld);
    __syncthreads();
    if (j0 + kKeys < last) {
      kc.fetch(k + qh, ql.st, j0 + kKeys, T_);
      vc.fetch(v + qh, ql.st, j0 + kKeys, T_);
    }

    FragC s[kKeys / 8], dp[kKeys / 8];  // S and dP: 16 queries x kKeys keys
    mma_tile_t<E, D>(s, qf, ks, ld);
    mma_tile_t<E, D>(dp, dof, vs, ld);
    // As in the forward: only tiles crossing the diagonal or the end are masked (rows past the end
    // are never written).
    const bool edge = (causal && j0 + kKeys - 1 > row0) || j0 + kKeys > T_;
    for (int n = 0; n < kKeys / 8; ++n)
      for (int i = 0; i < 4; ++i) {
        float p = exp2f(s[n].x[i] * scale2 - row_lse[i / 2]);
        if (edge) {
          const int64_t key = j0 + 8 * n + 2 * t + (i & 1);
          if (key >= T_ || (causal && key > rows[i / 2])) p = 0.0f;
        }
        dp[n].x[i] = p * (dp[n].x[i] - row_dvec[i / 2]);  // dS
      }
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const FragA<E> ds = a_from_accumulators<E>(dp[2 * kk], dp[2 * kk + 1]);
      mma_rows<E, D>(dqc, ds, ks + 16 * kk * ld, ld);
    }
  }
  for (int dn = 0; dn < D / 8; ++dn)
    for (int i = 0; i < 4; ++i)
      if (rows[i / 2] < T_) dq[qh + rows[i / 2] * ql.st + 8 * dn + 2 * t + (i & 1)] = from_f32<E>(scale * dqc[dn].x[i]);
}

// a.lse must be the forward's f32 lse; writes dq, dk, dv ('='). workspace:
// attention_backward_workspace(a) f32 elements (Dv). kind: the blocks per SM the two kernels are
// built for at head dim 64 (variants.h; the same values either way).
inline void attention_backward_tensor_cores(const kernels::AttentionArgs& a, float* workspace, Stream stream,
                                            FlashBackward kind = FlashBackward::free) {
  dispatch_tensor_cores(a.dtype, a.D, "attention_backward (tensor cores)", [&](auto tag, auto dim) {
    using E = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const auto *q = static_cast<const E*>(a.q), *k = static_cast<const E*>(a.k), *v = static_cast<const E*>(a.v);
    const auto* dout = static_cast<const E*>(a.dout);
    const auto* lse = static_cast<const float*>(a.lse);
    const HeadLayout ql = q_heads(a), ol = o_heads(a);
    launch(attention_dot_kernel<E, D>, dim3(blocks_for(a.B * a.H * a.T, 256)), dim3(256), 0, stream, workspace,
           static_cast<const E*>(a.out), dout, ol, a.T, a.B * a.H * a.T);
    const dim3 grid(blocks_for(a.T, kTcRows), blocks_for(a.B * a.H, 1)), block(kTcThreads);
    auto dkdv = attention_dkdv_tc_kernel<E, D>;
    auto dq = attention_dq_tc_kernel<E, D>;
    if constexpr (D == 64) {
      if (kind == FlashBackward::three) dkdv = attention_dkdv_tc_kernel<E, D, 3>;
      if (kind != FlashBackward::free) dq = attention_dq_tc_kernel<E, D, 3>;
    }
    launch(dkdv, grid, block, 0, stream, static_cast<E*>(a.dk), static_cast<E*>(a.dv), q, k, v, dout, lse,
           static_cast<const float*>(workspace), ql, ol, a.T, float(a.scale), a.causal);
    launch(dq, grid, block, 0, stream, static_cast<E*>(a.dq), q, k, v, dout, lse,
           static_cast<const float*>(workspace), ql, ol, a.T, float(a.scale), a.causal);
  });
}

}  // namespace sg::cuda
