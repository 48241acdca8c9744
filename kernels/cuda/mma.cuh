// Warp-level tensor-core MMA: D = A B + C with A 16x16 and B 16x8 in bf16 or f16 (the element type
// E of the fragments), C and D 16x8 in f32 (mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.
// {bf16,f16}.f32, sm_80+). Under nvcc it is one inline PTX instruction; under kernels/emu the warp's
// 32 lanes pool their fragments and compute the same product (sg::emu::mma_m16n8k16_bf16 / _f16).
//
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; the same
// for both element types), per lane with g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group):
//   A (row-major 16x16), 4 registers of two elements, lower column in the low half:
//     a.x[0] = A[g][2t, 2t+1]      a.x[1] = A[g+8][2t, 2t+1]
//     a.x[2] = A[g][2t+8, 2t+9]    a.x[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, "col": k runs along a register), 2 registers of two elements, lower k in the low half:
//     b.x[0] = B[2t, 2t+1][g]      b.x[1] = B[2t+8, 2t+9][g]
//   C, D (16x8 f32):
//     c.x[0], c.x[1] = C[g][2t, 2t+1]      c.x[2], c.x[3] = C[g+8][2t, 2t+1]
// The plain loaders below are per-lane loads from shared (or any) memory; the _x2 ones use
// ldmatrix (shared memory only, 16-byte aligned rows). Every lane of the warp must call mma() and
// ldmatrix together (.aligned), which the emulation checks.
#pragma once
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

// The A and B fragments carry their element type E (bf16 or f16) so that mma() picks the matching
// instruction; the registers are the same 32-bit pairs either way.
template <class E>
struct FragA {
  uint32_t x[4];
};
template <class E>
struct FragB {
  uint32_t x[2];
};
struct FragC {
  float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
};

// The 16 bits of a bf16 or f16.
template <class E>
SG_DEVICE uint32_t half_bits(E v) {
#ifdef __CUDACC__
  if constexpr (std::is_same_v<E, bf16>) return __bfloat16_as_ushort(v);
  else return __half_as_ushort(v);
#else
  return v.bits;
#endif
}

// Two elements as one 32-bit register, lo in the low half.
template <class E>
SG_DEVICE uint32_t pack_x2(E lo, E hi) {
  return half_bits(lo) | half_bits(hi) << 16;
}
// p[0] and p[1] (p 4-byte aligned) as one register.
template <class E>
SG_DEVICE uint32_t load_x2(const E* p) {
#ifdef __CUDACC__
  return *reinterpret_cast<const uint32_t*>(p);
#else
  // one 32-bit load on the device, which faults unless p is 4-byte aligned: the emulation says so
  if (reinterpret_cast<uintptr_t>(p) & 3) sg::emu::fail("load_x2: address not 4-byte aligned (a fault on the device)");
  return pack_x2(p[0], p[1]);
#endif
}

SG_DEVICE int mma_group() { return int(threadIdx.x) % 32 / 4; }
SG_DEVICE int mma_thread_in_group() { return int(threadIdx.x) % 4; }

// A from a row-major 16x16 tile: element (r, c) at a[r * ld + c]; ld even.
template <class E>
SG_DEVICE FragA<E> load_a_row_major(const E* a, int ld) {
  const int g = mma_group(), t = mma_thread_in_group();
  FragA<E> f;
  f.x[0] = load_x2(a + g * ld + 2 * t);
  f.x[1] = load_x2(a + (g + 8) * ld + 2 * t);
  f.x[2] = load_x2(a + g * ld + 2 * t + 8);
  f.x[3] = load_x2(a + (g + 8) * ld + 2 * t + 8);
  return f;
}

// B (k x n = 16x8) stored n-major: element (k, n) at b[n * ld + k]; ld even. This is K as stored
// ([key][dim]) when computing Q K^T.
template <class E>
SG_DEVICE FragB<E> load_b_col_major(const E* b, int ld) {
  const int g = mma_group(), t = mma_thread_in_group();
  FragB<E> f;
  f.x[0] = load_x2(b + g * ld + 2 * t);
  f.x[1] = load_x2(b + g * ld + 2 * t + 8);
  return f;
}

// B (k x n = 16x8) stored k-major: element (k, n) at b[k * ld + n]. This is V as stored
// ([key][dim]) when computing P V; the pairs along k are gathered from two rows.
template <class E>
SG_DEVICE FragB<E> load_b_row_major(const E* b, int ld) {
  const int g = mma_group(), t = mma_thread_in_group();
  FragB<E> f;
  f.x[0] = pack_x2(b[(2 * t) * ld + g], b[(2 * t + 1) * ld + g]);
  f.x[1] = pack_x2(b[(2 * t + 8) * ld + g], b[(2 * t + 9) * ld + g]);
  return f;
}
// ldmatrix.x4 (kTrans: .trans) from shared memory: lanes 8i .. 8i+7 give the 16-byte rows of 8x8
// matrix i; register i of each lane gets row lane/4, columns 2 (lane % 4) and +1 of matrix i (of
// its transpose with kTrans). One instruction for four 32-bit fragment registers, where the loads
// above take four (or eight 16-bit ones for load_b_row_major).
template <bool kTrans, class E>
SG_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const E* row) {
#ifdef __CUDACC__
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#elif defined(__CUDA_ARCH__)
  __trap();  // built for sm_80 and newer, as mma()
#endif
#else
  emu::ldmatrix_x4(r, row, kTrans);
#endif
}

// load_b_col_major for k-steps kk and kk + 1 at once (b at the n-tile's first row, k-step kk's
// first column; 16-byte aligned rows in shared memory): matrices 0..3 are the columns
// [0, 8), [8, 16), [16, 24), [24, 32) of the n-tile's 8 rows.
template <class E>
SG_DEVICE void load_b_col_major_x2(FragB<E>& k0, FragB<E>& k1, const E* b, int ld) {
  const int lane = int(threadIdx.x) % 32;
  uint32_t r[4];
  ldmatrix_x4<false>(r, b + (lane & 7) * ld + 8 * (lane >> 3));
  k0.x[0] = r[0], k0.x[1] = r[1], k1.x[0] = r[2], k1.x[1] = r[3];
}

// load_b_row_major for n-tiles dn and dn + 1 at once (b at row 0, column 8 dn; 16-byte aligned
// rows in shared memory), transposed on the way: matrices 0..3 are rows [0, 8) and [8, 16) of
// columns [0, 8), then of columns [8, 16).
template <class E>
SG_DEVICE void load_b_row_major_x2(FragB<E>& n0, FragB<E>& n1, const E* b, int ld) {
  const int lane = int(threadIdx.x) % 32;
  uint32_t r[4];
  ldmatrix_x4<true>(r, b + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 8 * (lane >> 4));
  n0.x[0] = r[0], n0.x[1] = r[1], n1.x[0] = r[2], n1.x[1] = r[3];
}

// C from / D to a row-major 16x8 f32 tile: element (r, c) at p[r * ld + c].
SG_DEVICE FragC load_c_row_major(const float* p, int ld) {
  const int g = mma_group(), t = mma_thread_in_group();
  FragC f;
  f.x[0] = p[g * ld + 2 * t];
  f.x[1] = p[g * ld + 2 * t + 1];
  f.x[2] = p[(g + 8) * ld + 2 * t];
  f.x[3] = p[(g + 8) * ld + 2 * t + 1];
  return f;
}
SG_DEVICE void store_c_row_major(float* p, int ld, const FragC& f) {
  const int g = mma_group(), t = mma_thread_in_group();
  p[g * ld + 2 * t] = f.x[0];
  p[g * ld + 2 * t + 1] = f.x[1];
  p[(g + 8) * ld + 2 * t] = f.x[2];
  p[(g + 8) * ld + 2 * t + 1] = f.x[3];
}

// The A fragment of a 16x16 tile whose left and right 16x8 halves are accumulators `left` and
// `right`, rounded to E. The C layout of two adjacent n-tiles is the A layout of one k-tile,
// so a softmax P computed in registers feeds P V without a trip through shared memory.
template <class E>
SG_DEVICE FragA<E> a_from_accumulators(const FragC& left, const FragC& right) {
  FragA<E> f;
  f.x[0] = pack_x2(from_f32<E>(left.x[0]), from_f32<E>(left.x[1]));
  f.x[1] = pack_x2(from_f32<E>(left.x[2]), from_f32<E>(left.x[3]));
  f.x[2] = pack_x2(from_f32<E>(right.x[0]), from_f32<E>(right.x[1]));
  f.x[3] = pack_x2(from_f32<E>(right.x[2]), from_f32<E>(right.x[3]));
  return f;
}

// d = a b + d, in place (the accumulator is both C and D).
template <class E>
SG_DEVICE void mma(FragC& d, const FragA<E>& a, const FragB<E>& b) {
  static_assert(std::is_same_v<E, bf16> || std::is_same_v<E, f16>, "mma: bf16 or f16 operands");
#ifdef __CUDACC__
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// One statement per element type: the instruction names the type, and asm takes only a literal.
#define SG_MMA_M16N8K16(type)                                                                                \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                                       \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                     \
               : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])                                      \
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]))
  if constexpr (std::is_same_v<E, bf16>) SG_MMA_M16N8K16("bf16");
  else SG_MMA_M16N8K16("f16");
#undef SG_MMA_M16N8K16
#elif defined(__CUDA_ARCH__)
  __trap();  // m16n8k16 mma.sync needs sm_80 or newer
#endif
#else
  float out[4];
  if constexpr (std::is_same_v<E, bf16>) emu::mma_m16n8k16_bf16(out, a.x, b.x, d.x);
  else emu::mma_m16n8k16_f16(out, a.x, b.x, d.x);
  for (int i = 0; i < 4; ++i) d.x[i] = out[i];
#endif
}

}  // namespace sg::cuda
