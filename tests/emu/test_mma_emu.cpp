// The tensor-core wrapper (kernels/cuda/mma.cuh) under emulation: every lane loads only the
// fragment elements the PTX ISA assigns it, the emulated mma.sync pools them by that layout, and
// D must equal A B + C computed directly, for bf16 and for f16 operands. A load helper or an
// emulated layout that disagrees with the documented one scrambles D, and an f16 half widened as
// bf16 (or the reverse) gives values of another magnitude altogether, so these tests fail.
#include "tests/catch.h"

#include "kernels/cuda/mma.cuh"
#include "tests/emu/support.h"

using namespace sg;
using namespace sg::emu_testing;

namespace {

// Two warps per block, each with its own matrices: a [16][16], b as given by b_k_major ([k][n] when
// true, [n][k] otherwise), c and d [16][8].
template <class E>
__global__ void mma_kernel(float* d, const E* a, const E* b, const float* c, bool b_k_major) {
  const int w = int(threadIdx.x) / 32;
  const cu::FragA<E> fa = cu::load_a_row_major(a + w * 256, 16);
  const cu::FragB<E> fb = b_k_major ? cu::load_b_row_major(b + w * 128, 8) : cu::load_b_col_major(b + w * 128, 16);
  cu::FragC acc = cu::load_c_row_major(c + w * 128, 8);
  cu::mma(acc, fa, fb);
  cu::store_c_row_major(d + w * 128, 8, acc);
}

// One warp: S = A B1 as two 16x8 tiles (B1 [16][16], k-major), P = E(S) re-used as an A
// fragment straight from the accumulators, D = P B2 (B2 [16][8], k-major).
template <class E>
__global__ void chained_mma_kernel(float* d, const E* a, const E* b1, const E* b2) {
  const cu::FragA<E> fa = cu::load_a_row_major(a, 16);
  cu::FragC left, right, out;
  cu::mma(left, fa, cu::load_b_row_major(b1, 16));
  cu::mma(right, fa, cu::load_b_row_major(b1 + 8, 16));
  cu::mma(out, cu::a_from_accumulators<E>(left, right), cu::load_b_row_major(b2, 8));
  cu::store_c_row_major(d, 8, out);
}

// One warp stages a [16][56] tile (112-byte rows) in shared memory and loads B fragments from it
// twice, with ldmatrix (the _x2 loaders) and with the per-lane loaders: n-major for k-steps at
// columns 16 and 32 of rows 8..15, k-major (transposed on the way) for n-tiles at columns 24 and 32
// of rows 0..15. Each lane writes its 8 + 8 registers to out[lane][16].
template <class E>
__global__ void ldmatrix_kernel(uint32_t* out, const E* tile) {
  constexpr int ld = 56;
  SG_SHARED(E, s, 16 * ld);
  for (int i = int(threadIdx.x); i < 16 * ld; i += 32) s[i] = tile[i];
  __syncthreads();
  uint32_t* o = out + threadIdx.x * 16;
  cu::FragB<E> f[4];
  cu::load_b_col_major_x2(f[0], f[1], s + 8 * ld + 16, ld);
  cu::load_b_row_major_x2(f[2], f[3], s + 24, ld);
  const cu::FragB<E> g[4] = {cu::load_b_col_major(s + 8 * ld + 16, ld), cu::load_b_col_major(s + 8 * ld + 32, ld),
                             cu::load_b_row_major(s + 24, ld), cu::load_b_row_major(s + 32, ld)};
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < 2; ++r) o[2 * i + r] = f[i].x[r], o[8 + 2 * i + r] = g[i].x[r];
}

// out[M][N] = x[M][K] y[K][N] (+ z), in double.
std::vector<float> matmul(const std::vector<float>& x, const std::vector<float>& y, int M, int K, int N,
                          const float* z = nullptr) {
  std::vector<float> out(size_t(M * N));
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = z ? z[i * N + j] : 0.0;
      for (int k = 0; k < K; ++k) s += double(x[size_t(i * K + k)]) * y[size_t(k * N + j)];
      out[size_t(i * N + j)] = float(s);
    }
  return out;
}

}  // namespace

// The products of two bf16 or two f16 are exact in f32, so D differs from the f64 reference only by
// the f32 sum.
TEMPLATE_TEST_CASE("emu mma m16n8k16: D = A B + C with each lane holding its documented fragments", "[emu]",
                   cu::bf16, cu::f16) {
  using E = TestType;
  const bool b_k_major = GENERATE(false, true);
  INFO((b_k_major ? "B loaded k-major (load_b_row_major)" : "B loaded n-major (load_b_col_major)"));
  const auto a = rounded<E>(randn(2 * 256, 70)), b = rounded<E>(randn(2 * 128, 71));
  const auto c = randn(2 * 128, 72);
  std::vector<float> d(2 * 128), want;
  // b holds B [16][8] per warp in the layout the kernel is told; the reference needs [k][n].
  for (int w = 0; w < 2; ++w) {
    std::vector<float> aw(a.begin() + w * 256, a.begin() + (w + 1) * 256), bw(128);
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8; ++n) bw[size_t(k * 8 + n)] = b[size_t(w * 128 + (b_k_major ? k * 8 + n : n * 16 + k))];
    const auto dw = matmul(aw, bw, 16, 16, 8, c.data() + w * 128);
    want.insert(want.end(), dw.begin(), dw.end());
  }
  const auto as = to_storage<E>(a), bs = to_storage<E>(b);
  cu::launch(mma_kernel<E>, dim3(1), dim3(64), 0, nullptr, d.data(), as.data(), bs.data(), c.data(), b_k_major);
  check_close(d, want, 1e-5, 1e-4);
}

TEMPLATE_TEST_CASE("emu mma: accumulators of two n-tiles re-used as the A fragment of the next mma (P V)", "[emu]",
                   cu::bf16, cu::f16) {
  using E = TestType;
  const auto a = rounded<E>(randn(256, 80)), b1 = rounded<E>(randn(256, 81));
  const auto b2 = rounded<E>(randn(128, 82));
  const auto p = rounded<E>(matmul(a, b1, 16, 16, 16));
  const auto want = matmul(p, b2, 16, 16, 8);
  std::vector<float> d(128);
  const auto as = to_storage<E>(a), b1s = to_storage<E>(b1), b2s = to_storage<E>(b2);
  cu::launch(chained_mma_kernel<E>, dim3(1), dim3(32), 0, nullptr, d.data(), as.data(), b1s.data(), b2s.data());
  // S is rounded to E on both sides; a last-bit difference in S can flip one rounding of P, by one
  // unit in the last place of E (2^-8 relative for bf16, 2^-11 for f16).
  const double rtol = std::is_same_v<E, cu::bf16> ? 1e-2 : 1.5e-3;
  check_close(d, want, rtol, 5 * rtol);
}

// ldmatrix.x4 as the PTX ISA describes it (lanes 8i..8i+7 address matrix i's rows; register i of
// lane l holds row l/4, columns 2(l%4) and +1, or the transpose's) gives every lane the same
// registers as the per-lane loaders, whose layout the mma test above checks against A B + C.
TEMPLATE_TEST_CASE("emu ldmatrix (x4, x4.trans) loads the fragments the per-lane loaders load", "[emu]", cu::bf16,
                   cu::f16) {
  using E = TestType;
  std::vector<float> tile(16 * 56);
  for (size_t i = 0; i < tile.size(); ++i) {  // small nonzero integers (exact in bf16 and f16), neighbours differ
    const int v = int(i * 37 % 250) - 125;
    tile[i] = float(v >= 0 ? v + 1 : v);
  }
  const auto ts = to_storage<E>(tile);
  std::vector<uint32_t> out(32 * 16, 0);
  cu::launch(ldmatrix_kernel<E>, dim3(1), dim3(32), 0, nullptr, out.data(), ts.data());
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 8; ++r) {
      INFO("lane " << lane << " register " << r);
      CHECK(out[size_t(lane * 16 + r)] == out[size_t(lane * 16 + 8 + r)]);
      CHECK(out[size_t(lane * 16 + r)] != 0u);
    }
}
