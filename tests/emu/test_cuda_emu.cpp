// The hand-written CUDA kernels (kernels/cuda/*.cuh), compiled by the host compiler against the
// emulation layer (kernels/emu) and run on CPU threads, against the CPU op table. Sizes are small
// and irregular (odd tails, rows that are not a multiple of a warp, padded vocabularies) and every
// kernel runs in f32 and bf16 (f16 where the kernel takes it). Inputs for half types are rounded
// first, so the CPU reference sees exactly what the kernel sees; tolerances then cover the f32
// math (f32) or the rounding of the output (half types).
#include "tests/catch.h"
#include <algorithm>
#include <limits>
#include <tuple>

#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/classifier.cuh"
#include "kernels/cuda/dropout.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/global_norm.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/softmax.cuh"
#include "tests/emu/support.h"

using namespace sg;
using namespace sg::emu_testing;
using kernels::Binary;
using kernels::Dims;
using kernels::Unary;

// ---------------------------------------------------------------- elementwise, gelu

TEMPLATE_TEST_CASE("emu unary ops and their derivatives match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t n = 1029;  // 128 packs of 8 halves (or 257 of 4 floats) and a tail
  const auto x = rounded<T>(randn(size_t(n), 1, 1.5f));
  const auto pos = rounded<T>(randn(size_t(n), 2, 0.3f, 2.0f));  // for log/sqrt/rsqrt/pow
  const auto dy = rounded<T>(randn(size_t(n), 3));
  for (Unary op : {Unary::neg, Unary::exp, Unary::log, Unary::sqrt, Unary::rsqrt, Unary::tanh, Unary::relu,
                   Unary::gelu, Unary::silu, Unary::abs, Unary::scale, Unary::add_scalar, Unary::pow, Unary::square}) {
    const bool needs_positive = op == Unary::log || op == Unary::sqrt || op == Unary::rsqrt || op == Unary::pow;
    const auto& in = needs_positive ? pos : x;
    INFO("unary op " << int(op));
    for (int64_t offset : {0, 1}) {  // 16-byte aligned (packs + tail) and misaligned (scalar path)
      std::vector<float> want(static_cast<size_t>(n - offset));
      cpu::unary(op, DType::f32, want.data(), in.data() + offset, n - offset, 1.7);
      const auto xs = to_storage<T>(in);
      std::vector<T> got(static_cast<size_t>(n));
      cu::unary(op, dtype_of<T>(), got.data() + offset, xs.data() + offset, n - offset, 1.7, nullptr);
      check_close(std::vector<T>(got.begin() + offset, got.end()), want);
    }
    if (op == Unary::relu || op == Unary::gelu || op == Unary::silu || op == Unary::tanh || op == Unary::exp) {
      std::vector<float> want(static_cast<size_t>(n));
      cpu::unary_backward(op, DType::f32, want.data(), dy.data(), x.data(), n);
      const auto dys = to_storage<T>(dy), xs = to_storage<T>(x);
      std::vector<T> got(static_cast<size_t>(n));
      cu::unary_backward(op, dtype_of<T>(), got.data(), dys.data(), xs.data(), n, nullptr);
      check_close(got, want, 4.0);
    }
  }
}

TEMPLATE_TEST_CASE("emu gelu forward and backward launchers match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t n = 1003;
  const auto x = rounded<T>(randn(size_t(n), 4, 2.0f)), dy = rounded<T>(randn(size_t(n), 5));
  std::vector<float> y_ref(static_cast<size_t>(n)), dx_ref(static_cast<size_t>(n));
  cpu::unary(Unary::gelu, DType::f32, y_ref.data(), x.data(), n, 0);
  cpu::unary_backward(Unary::gelu, DType::f32, dx_ref.data(), dy.data(), x.data(), n);
  const auto xs = to_storage<T>(x), dys = to_storage<T>(dy);
  std::vector<T> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
  cu::gelu_forward(y.data(), xs.data(), n, nullptr);
  cu::gelu_backward(dx.data(), dys.data(), xs.data(), n, nullptr);
  check_close(y, y_ref);
  check_close(dx, dx_ref, 4.0);
}

TEMPLATE_TEST_CASE("emu binary ops broadcast like the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const Dims shape = {3, 5, 37};
  const auto a = rounded<T>(randn(3 * 5 * 37, 6)), b = rounded<T>(randn(5 * 37, 7, 1.0f, 3.0f));
  const auto c = rounded<T>(randn(3 * 5 * 37, 8, 1.0f, 3.0f));
  const Dims dense = {5 * 37, 37, 1}, bcast = {0, 37, 1}, col = {5 * 37, 1, 0};  // b over dim 0; a column of a
  for (Binary op : {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::max, Binary::min}) {
    INFO("binary op " << int(op));
    for (int layout = 0; layout < 3; ++layout) {
      const auto& rhs = layout == 0 ? c : b;
      const Dims& as = layout == 2 ? col : dense;
      const Dims& bs = layout == 0 ? dense : bcast;
      std::vector<float> want(3 * 5 * 37);
      cpu::binary(op, DType::f32, want.data(), a.data(), as, rhs.data(), bs, shape);
      const auto av = to_storage<T>(a), bv = to_storage<T>(rhs);
      std::vector<T> got(3 * 5 * 37);
      cu::binary(op, dtype_of<T>(), got.data(), av.data(), as, bv.data(), bs, shape, nullptr);
      check_close(got, want);
    }
  }
}

TEST_CASE("emu fill and strided copy convert like the CPU table", "[emu]") {
  const Dims shape = {4, 3, 7};
  const Dims transposed = {1, 28, 4};  // a [7,3,4] array read as its transpose [4,3,7]
  const auto src = rounded<cu::bf16>(randn(84, 9));
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (DType st : {DType::f32, DType::bf16, DType::f16}) {
      INFO(dtype_name(st) << " -> " << dtype_name(dt));
      std::vector<unsigned char> s(84 * dtype_size(st)), want(84 * dtype_size(dt)), got(84 * dtype_size(dt));
      cpu::copy_strided(s.data(), st, src.data(), DType::f32, {84}, {1});
      cpu::copy_strided(want.data(), dt, s.data(), st, shape, transposed);
      cu::copy_strided(got.data(), dt, s.data(), st, shape, transposed, nullptr);
      REQUIRE(got == want);  // every conversion rounds to nearest even on both sides: bit-exact
    }
  }
  // The scatter into a strided view: the [4,3,7] elements written through the transposed strides.
  for (DType dt : {DType::bf16, DType::f32, DType::i64}) {
    INFO("scatter " << dtype_name(dt));
    std::vector<unsigned char> s(84 * dtype_size(dt)), want(84 * dtype_size(dt), 0xab), got(84 * dtype_size(dt), 0xab);
    cpu::copy_strided(s.data(), dt, src.data(), DType::f32, {84}, {1});
    cpu::scatter_strided(want.data(), transposed, s.data(), dt, shape);
    cu::scatter_strided(got.data(), transposed, s.data(), dt, shape, nullptr);
    REQUIRE(got == want);
    std::vector<unsigned char> back(84 * dtype_size(dt));  // reading it back through the same strides
    cpu::copy_strided(back.data(), dt, want.data(), dt, shape, transposed);
    REQUIRE(back == s);
  }
  // Attention's head split [2,5,3,16] -> [2,3,5,16] and back: the 16-byte-unit path (bf16: 8 per
  // unit, f32: 4), and a row of 12 bf16 that is not whole units (the element path).
  for (auto [dt, D] : {std::pair<DType, int64_t>{DType::bf16, 16}, {DType::f32, 16}, {DType::bf16, 12}}) {
    INFO("head split " << dtype_name(dt) << " D " << D);
    const Dims heads = {2, 3, 5, D}, split = {5 * 3 * D, D, 3 * D, 1};
    const size_t bytes = size_t(2 * 3 * 5 * D) * dtype_size(dt);
    std::vector<unsigned char> s(bytes), want(bytes), got(bytes), back(bytes, 0xab), back_want(bytes, 0xab);
    cpu::copy_strided(s.data(), dt, rounded<cu::bf16>(randn(size_t(2 * 3 * 5 * D), 12)).data(), DType::f32,
                      {2 * 3 * 5 * D}, {1});
    Dims units = heads, unit_strides = split;  // which path this case takes
    REQUIRE(cu::as_16_byte_units(dtype_size(dt), got.data(), s.data(), units, unit_strides) == (D == 16));
    cpu::copy_strided(want.data(), dt, s.data(), dt, heads, split);
    cu::copy_strided(got.data(), dt, s.data(), dt, heads, split, nullptr);
    REQUIRE(got == want);
    cpu::scatter_strided(back_want.data(), split, want.data(), dt, heads);
    cu::scatter_strided(back.data(), split, got.data(), dt, heads, nullptr);
    REQUIRE(back == back_want);
    REQUIRE(back == s);
  }
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
    INFO(dtype_name(dt));
    std::vector<unsigned char> want(37 * 8), got(37 * 8);
    cpu::fill(want.data(), dt, 37, -2.75);
    cu::fill(got.data(), dt, 37, -2.75, nullptr);
    REQUIRE(got == want);
  }
  // Same-dtype strided copies of the other widths (4 and 8 bytes an element, integers included).
  for (DType dt : {DType::i32, DType::i64, DType::f64}) {
    INFO("copy " << dtype_name(dt));
    std::vector<unsigned char> s(84 * dtype_size(dt)), want(84 * dtype_size(dt)), got(84 * dtype_size(dt));
    cpu::copy_strided(s.data(), dt, src.data(), DType::f32, {84}, {1});
    cpu::copy_strided(want.data(), dt, s.data(), dt, shape, transposed);
    cu::copy_strided(got.data(), dt, s.data(), dt, shape, transposed, nullptr);
    REQUIRE(got == want);
  }
}

TEST_CASE("emu grid-stride kernels: every thread's later strides, as past 2048 blocks on a GPU", "[emu]") {
  // A grid capped at 2 blocks of 256: each thread takes about 10 strides over 5005 elements.
  struct Cap {
    Cap() { cu::g_emu_max_grid_blocks = 2; }
    ~Cap() { cu::g_emu_max_grid_blocks = 2048; }
  } cap;
  const Dims shape = {5, 7, 143}, transposed = {1, 5 * 143, 5};  // a [143,7,5] array read as its transpose
  const int64_t n = 5 * 7 * 143;
  const auto x = rounded<cu::bf16>(randn(size_t(n), 31)), y = rounded<cu::bf16>(randn(size_t(n), 32));
  const auto xs = to_storage<cu::bf16>(x), ys = to_storage<cu::bf16>(y);
  for (int64_t offset : {0, 1}) {  // packs and a tail, then the scalar path
    INFO("map, offset " << offset);
    std::vector<float> want(size_t(n - offset));
    cpu::unary(Unary::tanh, DType::f32, want.data(), x.data() + offset, n - offset, 0);
    std::vector<cu::bf16> got(static_cast<size_t>(n));
    cu::unary(Unary::tanh, DType::bf16, got.data() + offset, xs.data() + offset, n - offset, 0, nullptr);
    check_close(std::vector<cu::bf16>(got.begin() + offset, got.end()), want);
  }
  {
    INFO("binary, broadcast");
    const Dims dense = {7 * 143, 143, 1}, bcast = {0, 143, 1};
    std::vector<float> want(static_cast<size_t>(n));
    cpu::binary(Binary::mul, DType::f32, want.data(), x.data(), dense, y.data(), bcast, shape);
    std::vector<cu::bf16> got(static_cast<size_t>(n));
    cu::binary(Binary::mul, DType::bf16, got.data(), xs.data(), dense, ys.data(), bcast, shape, nullptr);
    check_close(got, want);
  }
  for (DType dt : {DType::bf16, DType::f32}) {
    INFO("copy and scatter " << dtype_name(dt));
    const size_t bytes = size_t(n) * dtype_size(dt);
    std::vector<unsigned char> s(bytes), want(bytes, 0xab), got(bytes, 0xab);
    cpu::copy_strided(s.data(), dt, x.data(), DType::f32, {n}, {1});
    cpu::copy_strided(want.data(), dt, s.data(), dt, shape, transposed);
    cu::copy_strided(got.data(), dt, s.data(), dt, shape, transposed, nullptr);
    REQUIRE(got == want);
    std::fill(want.begin(), want.end(), 0xab);
    std::fill(got.begin(), got.end(), 0xab);
    cpu::scatter_strided(want.data(), transposed, s.data(), dt, shape);
    cu::scatter_strided(got.data(), transposed, s.data(), dt, shape, nullptr);
    REQUIRE(got == want);
    cpu::fill(want.data(), dt, n, 0.5);
    cu::fill(got.data(), dt, n, 0.5, nullptr);
    REQUIRE(got == want);
  }
}

TEMPLATE_TEST_CASE("emu GEMM epilogues cuBLASLt cannot fuse run apart with the CPU GEMM's values", "[emu]", float,
                   cu::bf16) {
  // The op table's fallback (kernels/cuda/gemm_epilogue.cuh): the bare product (here the CPU's),
  // then the epilogue's kernels, against the CPU GEMM with the whole epilogue; irregular sizes.
  using T = TestType;
  const int64_t M = 37, N = 24, K = 19;
  const auto a = rounded<T>(randn(size_t(M * K), 41)), b = rounded<T>(randn(size_t(K * N), 42));
  const auto bias = rounded<T>(randn(size_t(N), 43)), res = rounded<T>(randn(size_t(M * N), 44));
  const auto pre0 = rounded<T>(randn(size_t(M * N), 45));
  const auto as = to_storage<T>(a), bs = to_storage<T>(b), biass = to_storage<T>(bias), ress = to_storage<T>(res);
  const auto pres = to_storage<T>(pre0);
  std::vector<float> work;
  // The CPU table's GEMM takes f32, not bf16: the product of the values T holds, rounded to T
  const auto bare = [&](const kernels::GemmArgs& g) {
    kernels::GemmArgs f = g;
    std::vector<float> product(size_t(M * N));
    f.dtype = DType::f32, f.A = a.data(), f.B = b.data(), f.C = product.data();
    cpu::gemm(f);
    const auto stored = to_storage<T>(product);
    std::copy(stored.begin(), stored.end(), static_cast<T*>(g.C));
  };
  const auto scratch = [&](size_t floats, auto&& use) {
    work.assign(floats + 1, 0.0f);
    use(work.data());
  };
  enum Kind { bias_gelu, bias_residual, dgelu_bias_grad, row_sums, row_sums_transposed };
  for (Kind kind : {bias_gelu, bias_residual, dgelu_bias_grad, row_sums, row_sums_transposed}) {
    INFO("epilogue " << int(kind));
    // want: f32 on the CPU, every input as T holds it; got: T storage through the fallback
    std::vector<float> c_ref(size_t(M * N)), pre_ref(size_t(M * N)), vec_ref(size_t(std::max(M, N)));
    std::vector<T> c(size_t(M * N)), pre(size_t(M * N)), vec(size_t(std::max(M, N)));
    const bool trans = kind == row_sums_transposed;
    const auto args = [&](DType dt, const void* A, const void* B, const void* bi, const void* r, void* C, void* P,
                          const void* dpre, void* v) {
      kernels::GemmArgs g{dt};
      g.trans_a = trans;
      g.M = M, g.N = N, g.K = K;
      g.A = A, g.lda = trans ? M : K;  // op(A) [M, K]: stored [K, M] when transposed
      g.B = B, g.ldb = N, g.C = C, g.ldc = N;
      if (kind == bias_gelu) g.bias = bi, g.gelu = true, g.pre_gelu = P;
      if (kind == bias_residual) g.bias = bi, g.residual = r;
      if (kind == dgelu_bias_grad) g.dgelu_pre = dpre, g.bias_grad = v;
      if (kind == row_sums || kind == row_sums_transposed) g.row_sums_a = v;
      return g;
    };
    cpu::gemm(args(DType::f32, a.data(), b.data(), bias.data(), res.data(), c_ref.data(), pre_ref.data(), pre0.data(),
                   vec_ref.data()));
    cu::gemm_epilogue_apart(args(dtype_of<T>(), as.data(), bs.data(), biass.data(), ress.data(), c.data(), pre.data(),
                                 pres.data(), vec.data()),
                            bare, scratch, nullptr);
    check_close(c, c_ref, 4.0);
    if (kind == bias_gelu) check_close(pre, pre_ref, 4.0);
    if (kind == dgelu_bias_grad) check_close(std::vector<T>(vec.begin(), vec.begin() + N),
                                             std::vector<float>(vec_ref.begin(), vec_ref.begin() + N), 16.0);
    if (kind == row_sums || kind == row_sums_transposed)
      check_close(std::vector<T>(vec.begin(), vec.begin() + M), std::vector<float>(vec_ref.begin(), vec_ref.begin() + M),
                  16.0);
  }
}

// ---------------------------------------------------------------- reductions, softmax

TEMPLATE_TEST_CASE("emu axis reductions match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const auto x = rounded<T>(randn(2 * 555 * 37, 10, 1.0f, 0.5f));
  for (kernels::Reduce op : {kernels::Reduce::sum, kernels::Reduce::max, kernels::Reduce::sum_squares}) {
    // inner > 1 with 1, 2 and 32 lanes over the reduced rows and a partial column tile
    for (auto [outer, n, inner] : {std::tuple<int64_t, int64_t, int64_t>{3, 37, 5}, {15, 37, 1}, {1, 555, 1},
                                   {2, 555, 37}, {5, 3, 70}}) {
      INFO("op " << int(op) << " outer " << outer << " n " << n << " inner " << inner);
      std::vector<float> want(static_cast<size_t>(outer * inner));
      cpu::reduce(op, DType::f32, want.data(), x.data(), outer, n, inner);
      const auto xs = to_storage<T>(x);
      std::vector<T> got(static_cast<size_t>(outer * inner));
      cu::reduce(op, dtype_of<T>(), got.data(), xs.data(), outer, n, inner, nullptr);
      check_close(got, want, 10.0);
    }
    // Rows longer than one block's chunk: split over blocks, partials added in a second pass.
    const int64_t n = 2 * cu::kRowChunk + 777;
    // f16 stops at 65504: halved inputs keep this row's sum of squares (1.25 n at mean 1) inside it
    const float mean = std::is_same_v<T, cu::f16> ? 0.5f : 1.0f;
    const auto y = rounded<T>(randn(size_t(2 * n), 11, mean, mean / 2));
    std::vector<float> want(2), work(size_t(cu::reduce_workspace(2, n, 1)));
    REQUIRE(work.size() == 6);
    cpu::reduce(op, DType::f32, want.data(), y.data(), 2, n, 1);
    const auto ys = to_storage<T>(y);
    std::vector<T> got(2);
    cu::reduce(op, dtype_of<T>(), got.data(), ys.data(), 2, n, 1, nullptr, work.data());
    check_close(got, want, 10.0);
  }
}

TEST_CASE("emu max reductions and binary max/min keep a NaN from any position, as the CPU table does", "[emu]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto x = randn(2 * 555 * 37, 12);
  for (size_t i : {size_t(0), size_t(38), size_t(555 * 37 + 5), size_t(2 * 555 * 37 - 1), size_t(777)}) x[i] = nan;
  for (auto [outer, n, inner] : {std::tuple<int64_t, int64_t, int64_t>{3, 37, 5}, {15, 37, 1}, {1, 555, 1},
                                 {2, 555, 37}, {5, 3, 70}, {2, 555 * 37, 1}}) {
    INFO("outer " << outer << " n " << n << " inner " << inner);
    std::vector<float> want(static_cast<size_t>(outer * inner)), got(want.size());
    cpu::reduce(kernels::Reduce::max, DType::f32, want.data(), x.data(), outer, n, inner);
    REQUIRE(std::count_if(want.begin(), want.end(), [](float v) { return std::isnan(v); }) > 0);
    std::vector<float> work(size_t(cu::reduce_workspace(outer, n, inner)));
    cu::reduce(kernels::Reduce::max, DType::f32, got.data(), x.data(), outer, n, inner, nullptr, work.data());
    check_close(got, want, 0.0, 0.0);
  }
  const std::vector<float> a = {1, nan, 3, nan}, b = {2, 0, nan, nan};
  for (Binary op : {Binary::max, Binary::min}) {
    std::vector<float> want(4), got(4);
    cpu::binary(op, DType::f32, want.data(), a.data(), {1}, b.data(), {1}, {4});
    cu::binary(op, DType::f32, got.data(), a.data(), {1}, b.data(), {1}, {4}, nullptr);
    CHECK(want[0] == (op == Binary::max ? 2.f : 1.f));
    for (int i = 1; i < 4; ++i) CHECK(std::isnan(want[size_t(i)]));
    check_close(got, want, 0.0, 0.0);
  }
}

TEMPLATE_TEST_CASE("emu softmax and log-softmax forward and backward match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t rows = 3, cols = 300;  // more columns than threads: each thread strides
  const auto x = rounded<T>(randn(rows * cols, 11, 3.0f)), dy = rounded<T>(randn(rows * cols, 12));
  for (bool log : {false, true}) {
    INFO("log " << log);
    std::vector<float> y_ref(rows * cols), dx_ref(rows * cols);
    cpu::softmax(DType::f32, y_ref.data(), x.data(), rows, cols, log);
    const auto y_in = rounded<T>(y_ref);  // the backward reads y in storage precision
    cpu::softmax_backward(DType::f32, dx_ref.data(), dy.data(), y_in.data(), rows, cols, log);
    const auto xs = to_storage<T>(x), dys = to_storage<T>(dy), ys = to_storage<T>(y_in);
    std::vector<T> y(rows * cols), dx(rows * cols);
    cu::softmax(dtype_of<T>(), y.data(), xs.data(), rows, cols, log, nullptr);
    cu::softmax_backward(dtype_of<T>(), dx.data(), dys.data(), ys.data(), rows, cols, log, nullptr);
    check_close(y, y_ref, 0.1);
    check_close(dx, dx_ref, 0.1);
  }
}

// ---------------------------------------------------------------- classifier

TEMPLATE_TEST_CASE("emu fused classifier matches cross_entropy and its backward on a padded vocabulary", "[emu]",
                   float, cu::bf16, cu::f16) {
  using T = TestType;
  // Rows of 16-byte pieces plus a tail (Vp 64, 3008), rows that start off a 16-byte boundary (Vp
  // 61, 3005: element by element), and a vocabulary that gives every warp of the block several
  // logits (3001: the running max and sum are rescaled and merged across warps); 20008: a thread
  // loops over up to 5 (bf16/f16) or 10 (f32) pieces, past the unrolled 4.
  for (auto [V, Vp] : {std::pair<int64_t, int64_t>{53, 64}, {53, 61}, {3001, 3008}, {3001, 3005}, {20001, 20008}}) {
    INFO("V " << V << " Vp " << Vp);
    const int64_t rows = 5, ignore = -100;
    auto logits = rounded<T>(randn(rows * Vp, 13, 2.0f));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = V; j < Vp; ++j) logits[size_t(r * Vp + j)] = 1e4f;  // padding must be ignored
    const std::vector<int64_t> targets = {7, ignore, 52, 0, 31};
    const std::vector<float> dloss = {0.25f, 0.5f, -1.0f, 2.0f, 0.125f};
    std::vector<float> loss_ref(rows), lse_ref(rows), dl_ref(rows * Vp);
    cpu::cross_entropy(DType::f32, DType::i64, loss_ref.data(), lse_ref.data(), logits.data(), targets.data(), rows, Vp,
                       V, ignore);
    cpu::cross_entropy_backward(DType::f32, DType::i64, dl_ref.data(), dloss.data(), logits.data(), lse_ref.data(),
                                targets.data(), rows, Vp, V, ignore);
    const auto xs = to_storage<T>(logits);
    std::vector<float> loss(rows), lse(rows);
    int bad = 0;
    cu::cross_entropy(dtype_of<T>(), DType::i64, loss.data(), lse.data(), xs.data(), targets.data(), rows, Vp, V, ignore,
                      &bad, nullptr);
    check_close(loss, loss_ref, 1e-5, 1e-5);
    check_close(lse, lse_ref, 1e-5, 1e-5);
    CHECK(bad == 0);
    std::vector<T> dl(rows * Vp);
    cu::cross_entropy_backward(dtype_of<T>(), DType::i64, dl.data(), dloss.data(), xs.data(), lse.data(),
                               targets.data(), rows, Vp, V, ignore, nullptr);
    check_close(dl, dl_ref, 0.1);
    const std::vector<int32_t> t32(targets.begin(), targets.end());  // i32 targets: the same bits
    std::vector<T> dl32(rows * Vp);
    cu::cross_entropy_backward(dtype_of<T>(), DType::i32, dl32.data(), dloss.data(), xs.data(), lse.data(), t32.data(),
                               rows, Vp, V, ignore, nullptr);
    CHECK(to_float(dl32) == to_float(dl));

    // Fused forward+backward (one dloss for every row), in place over the logits, with i32 targets,
    // against the CPU's fused entry.
    const float d = -0.375f;
    std::vector<float> loss_fused_ref(rows), dl_fused_ref(rows * Vp);
    cpu::cross_entropy_fused(DType::f32, DType::i64, loss_fused_ref.data(), dl_fused_ref.data(), logits.data(),
                             targets.data(), d, rows, Vp, V, ignore);
    CHECK(loss_fused_ref == loss_ref);
    // Each way of reading the row (cuda::Classifier), in place and into a separate buffer; the
    // row staged in shared memory where it is whole 16-byte pieces (the others stream).
    CHECK(cu::classifier_stages<T>(xs.data(), xs.data(), Vp) == (Vp % cu::Pack<T>::N == 0));
    std::vector<T> streamed;  // the streaming kernel's dlogits: reversed gives the same bits
    for (auto kind : cu::kClassifiers) {
      for (bool in_place : {true, false}) {
        INFO(cu::name(kind) << ", in place " << in_place);
        auto src = xs;
        std::vector<T> out(rows * Vp);
        T* dst = in_place ? src.data() : out.data();
        std::vector<float> loss2(rows), lse2(rows);
        cu::classifier_forward_backward(dtype_of<T>(), DType::i32, loss2.data(), lse2.data(), dst, src.data(),
                                        t32.data(), d, rows, Vp, V, ignore, &bad, nullptr, kind);
        check_close(loss2, loss_ref, 1e-5, 1e-5);
        check_close(lse2, lse_ref, 1e-5, 1e-5);
        const auto& got = in_place ? src : out;
        check_close(got, dl_fused_ref, 0.1);
        if (!in_place) CHECK(to_float(src) == to_float(xs));  // the logits only read
        if (kind == cu::Classifier::streaming) streamed = got;
        if (kind == cu::Classifier::reversed) CHECK(to_float(got) == to_float(streamed));
        CHECK(bad == 0);
      }
    }
  }
  // GPT-2's padded vocabulary stages in bf16 (98 KiB a row), not in f32 (196 KiB: two blocks an SM
  // would not fit)
  CHECK(cu::classifier_stages<T>(nullptr, nullptr, 50304) == (sizeof(T) == 2));
}

TEST_CASE("emu classifier counts targets out of range instead of reading past the row", "[emu]") {
  const int64_t rows = 2, V = 5, Vp = 8;
  const auto logits = randn(rows * Vp, 14);
  const std::vector<int32_t> targets = {5, -1};
  std::vector<float> loss(rows, 7.0f), lse(rows);
  int bad = 0;
  cu::cross_entropy(DType::f32, DType::i32, loss.data(), lse.data(), logits.data(), targets.data(), rows, Vp, V, -100,
                    &bad, nullptr);
  CHECK(bad == 2);
  CHECK(loss[0] == 0.0f);
  CHECK(loss[1] == 0.0f);
}

TEST_CASE("emu classifier gives a NaN loss for a row with a NaN logit, as the CPU does", "[emu]") {
  // The NaN sits in one thread's stretch of a row that several warps share, away from the target:
  // the running max drops it (comparisons with NaN are false), so only the sums can carry it.
  const int64_t rows = 3, V = 3001, Vp = 3008;
  auto logits = randn(rows * Vp, 15);
  logits[size_t(1 * Vp + 1234)] = std::nanf("");
  const std::vector<int64_t> targets = {7, 52, 0};
  std::vector<float> loss_ref(rows), lse_ref(rows), loss(rows), lse(rows);
  cpu::cross_entropy(DType::f32, DType::i64, loss_ref.data(), lse_ref.data(), logits.data(), targets.data(), rows, Vp,
                     V, -100);
  int bad = 0;
  cu::cross_entropy(DType::f32, DType::i64, loss.data(), lse.data(), logits.data(), targets.data(), rows, Vp, V, -100,
                    &bad, nullptr);
  REQUIRE(std::isnan(loss_ref[1]));
  CHECK(std::isnan(loss[1]));
  CHECK(std::isnan(lse[1]));
  CHECK_THAT(loss[0], Catch::Matchers::WithinRel(loss_ref[0], 1e-5f));
  CHECK_THAT(loss[2], Catch::Matchers::WithinRel(loss_ref[2], 1e-5f));
}

// ---------------------------------------------------------------- layernorm, rmsnorm

TEMPLATE_TEST_CASE("emu layernorm forward and backward match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  // 70 rows: three row chunks, a partial block; 549: 18 chunks, more than the finish kernel's 16 warps;
  // C = 64 (and 100 for f32): the 16-byte paths, where the backward's input-gradient kernel also
  // sums dw/db (up to C = 1024: 4 or 8 units a lane); C = 37 (and 100 for bf16) the element paths
  // and the separate dw/db kernel; C = 1032: 16-byte rows too wide for the fused backward; C = 768:
  // GPT-2's rows (48 KiB of shared memory for the smem kinds' sums, 64 KiB at 1024).
  for (auto [rows, C] : {std::pair<int64_t, int64_t>{3, 37}, {70, 100}, {549, 37}, {9, 64}, {70, 64}, {41, 1024},
                         {41, 1032}, {45, 768}}) {
    INFO("rows " << rows << " C " << C);
    const bool packed = C % cu::Pack<T>::N == 0;
    CHECK(cu::norm_backward_fuses(C, packed) == (packed && C <= 1024));
    const auto x = rounded<T>(randn(rows * C, 15, 2.0f, 1.0f)), dy = rounded<T>(randn(rows * C, 16));
    const auto w = rounded<T>(randn(C, 17, 0.5f, 1.0f)), b = rounded<T>(randn(C, 18));
    std::vector<float> y_ref(rows * C), mean_ref(rows), rstd_ref(rows), dx_ref(rows * C), dw_ref(C), db_ref(C);
    cpu::layernorm(DType::f32, y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), b.data(), rows, C,
                   1e-5);
    cpu::layernorm_backward(DType::f32, dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(), w.data(),
                            mean_ref.data(), rstd_ref.data(), rows, C);
    const auto xs = to_storage<T>(x), dys = to_storage<T>(dy), ws = to_storage<T>(w), bs = to_storage<T>(b);
    std::vector<T> y(rows * C), dx(rows * C), dw(C), db(C);
    std::vector<float> mean(rows), rstd(rows), work(static_cast<size_t>(cu::norm_backward_workspace(rows, C)));
    cu::layernorm_forward(y.data(), mean.data(), rstd.data(), xs.data(), ws.data(), bs.data(), rows, C, 1e-5, nullptr);
    check_close(y, y_ref, 4.0);
    check_close(mean, mean_ref, 1e-5, 1e-5);
    check_close(rstd, rstd_ref, 1e-5, 1e-5);
    cu::layernorm_backward(dx.data(), dw.data(), db.data(), dys.data(), xs.data(), ws.data(), mean.data(), rstd.data(),
                           rows, C, work.data(), nullptr);
    check_close(dx, dx_ref, 4.0);
    check_close(dw, dw_ref, 8.0);
    check_close(db, db_ref, 8.0);
    // The other places dw/db are summed: the same input gradient, bit for bit (the same
    // arithmetic); the shared-memory sums bit for bit too (each warp's rows in row order, the warps
    // in warp order, as the registers' sums); the second kernel's in its own order.
    for (auto kind : {cu::NormBackward::smem, cu::NormBackward::smem_ahead, cu::NormBackward::split}) {
      const auto runs = cu::norm_backward_runs(kind, C, packed);
      INFO("asked " << cu::name(kind) << ", runs " << cu::name(runs));
      CHECK(runs == (!packed || C > 1024 ? cu::NormBackward::split : kind));
      std::vector<T> dx2(rows * C), dw2(C), db2(C);
      cu::layernorm_backward(dx2.data(), dw2.data(), db2.data(), dys.data(), xs.data(), ws.data(), mean.data(),
                             rstd.data(), rows, C, work.data(), nullptr, kind);
      CHECK(to_float(dx2) == to_float(dx));
      if (runs != cu::NormBackward::split) {
        CHECK(to_float(dw2) == to_float(dw));
        CHECK(to_float(db2) == to_float(db));
      }
      check_close(dw2, dw_ref, 8.0);
      check_close(db2, db_ref, 8.0);
    }
  }
}

TEMPLATE_TEST_CASE("emu residual layernorm equals the add then the CPU layernorm, and its backward accumulates",
                   "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t rows = 5, C = GENERATE(70, 64);  // 64: the forward's 16-byte path
  // each place the backward sums dw/db (70: every one runs split)
  const auto kind = GENERATE(cu::NormBackward::fused, cu::NormBackward::smem, cu::NormBackward::smem_ahead,
                             cu::NormBackward::split);
  INFO("C " << C << " backward " << cu::name(kind));
  const auto x = rounded<T>(randn(rows * C, 19)), res = rounded<T>(randn(rows * C, 20, 1.0f, 0.5f));
  const auto w = rounded<T>(randn(C, 21, 0.5f, 1.0f)), b = rounded<T>(randn(C, 22));
  const auto dy = rounded<T>(randn(rows * C, 23)), dres0 = rounded<T>(randn(rows * C, 24));
  std::vector<float> sum(rows * C);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = x[i] + res[i];
  sum = rounded<T>(sum);  // the kernel normalises the stored (rounded) residual
  std::vector<float> y_ref(rows * C), mean_ref(rows), rstd_ref(rows), dx_ref(rows * C), dw_ref(C), db_ref(C);
  cpu::layernorm(DType::f32, y_ref.data(), mean_ref.data(), rstd_ref.data(), sum.data(), w.data(), b.data(), rows, C,
                 1e-5);
  cpu::layernorm_backward(DType::f32, dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), sum.data(), w.data(),
                          mean_ref.data(), rstd_ref.data(), rows, C);
  for (size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += dres0[i];
  const auto xs = to_storage<T>(x), rs = to_storage<T>(res), ws = to_storage<T>(w), bs = to_storage<T>(b);
  const auto dys = to_storage<T>(dy);
  std::vector<T> r(rows * C), y(rows * C), dw(C), db(C);
  std::vector<float> mean(rows), rstd(rows), work(static_cast<size_t>(cu::norm_backward_workspace(rows, C)));
  cu::residual_layernorm_forward(r.data(), y.data(), mean.data(), rstd.data(), xs.data(), rs.data(), ws.data(),
                                 bs.data(), rows, C, 1e-5, nullptr);
  check_close(r, sum);
  check_close(y, y_ref, 4.0);
  // dr in place (dx aliases it), dr apart from dx, and no dr at all
  auto dres = to_storage<T>(dres0);
  cu::residual_layernorm_backward(dres.data(), dw.data(), db.data(), static_cast<const T*>(dres.data()), dys.data(),
                                  r.data(), ws.data(), mean.data(), rstd.data(), rows, C, work.data(), nullptr, kind);
  check_close(dres, dx_ref, 4.0);
  check_close(dw, dw_ref, 8.0);
  check_close(db, db_ref, 8.0);
  const auto dr = to_storage<T>(dres0);
  std::vector<T> dx(rows * C);
  cu::residual_layernorm_backward(dx.data(), dw.data(), db.data(), dr.data(), dys.data(), r.data(), ws.data(),
                                  mean.data(), rstd.data(), rows, C, work.data(), nullptr, kind);
  check_close(dx, dx_ref, 4.0);
  check_close(dr, rounded<T>(dres0));  // read, not written
  cu::residual_layernorm_backward(dx.data(), dw.data(), db.data(), static_cast<const T*>(nullptr), dys.data(),
                                  r.data(), ws.data(), mean.data(), rstd.data(), rows, C, work.data(), nullptr, kind);
  for (size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] -= dres0[i];
  check_close(dx, dx_ref, 4.0);
}

TEMPLATE_TEST_CASE("emu rmsnorm forward and backward match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t rows = 37, C = GENERATE(45, 48);  // 48: the forward's 16-byte path
  const auto kind = GENERATE(cu::NormBackward::fused, cu::NormBackward::smem, cu::NormBackward::smem_ahead,
                             cu::NormBackward::split);
  INFO("C " << C << " backward " << cu::name(kind));
  const auto x = rounded<T>(randn(rows * C, 25, 2.0f)), dy = rounded<T>(randn(rows * C, 26));
  const auto w = rounded<T>(randn(C, 27, 0.5f, 1.0f));
  std::vector<float> y_ref(rows * C), rstd_ref(rows), dx_ref(rows * C), dw_ref(C);
  cpu::rmsnorm(DType::f32, y_ref.data(), rstd_ref.data(), x.data(), w.data(), rows, C, 1e-6);
  cpu::rmsnorm_backward(DType::f32, dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), rstd_ref.data(), rows,
                        C);
  const auto xs = to_storage<T>(x), dys = to_storage<T>(dy), ws = to_storage<T>(w);
  std::vector<T> y(rows * C), dx(rows * C), dw(C);
  std::vector<float> rstd(rows), work(static_cast<size_t>(cu::norm_backward_workspace(rows, C)));
  cu::rmsnorm_forward(y.data(), rstd.data(), xs.data(), ws.data(), rows, C, 1e-6, nullptr);
  cu::rmsnorm_backward(dx.data(), dw.data(), dys.data(), xs.data(), ws.data(), rstd.data(), rows, C, work.data(),
                       nullptr, kind);
  check_close(y, y_ref, 4.0);
  check_close(rstd, rstd_ref, 1e-5, 1e-5);
  check_close(dx, dx_ref, 4.0);
  check_close(dw, dw_ref, 8.0);
}

// ---------------------------------------------------------------- embedding

TEMPLATE_TEST_CASE("emu embedding gathers rows and its backward sums repeated rows like the CPU table", "[emu]", float,
                   cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t rows = 11, n = 9;
  for (int64_t C : {int64_t(37), int64_t(64)}) {  // 64: 128-bit packs; 37: scalar rows
    INFO("C " << C);
    const auto w = rounded<T>(randn(rows * C, 28)), dout = rounded<T>(randn(n * C, 29));
    const auto dw0 = rounded<T>(randn(rows * C, 30));
    const std::vector<int64_t> idx = {3, 10, 3, 0, 7, 3, 10, 1, 3};  // repeats: the order of the sum matters
    std::vector<float> out_ref(n * C), dw_ref = dw0;
    cpu::embedding(DType::f32, DType::i64, out_ref.data(), idx.data(), w.data(), n, C, rows);
    cpu::embedding_backward(DType::f32, DType::i64, dw_ref.data(), dout.data(), idx.data(), n, C, rows);
    const auto ws = to_storage<T>(w), douts = to_storage<T>(dout);
    std::vector<T> out(n * C);
    int bad = 0;
    cu::embedding_forward(dtype_of<T>(), DType::i64, out.data(), idx.data(), ws.data(), n, C, rows, &bad, nullptr);
    CHECK(bad == 0);
    check_close(out, out_ref, 0.0);  // a gather: exact
    const std::vector<int32_t> idx32(idx.begin(), idx.end());  // the same with i32 indices
    std::vector<T> out32(n * C);
    cu::embedding_forward(dtype_of<T>(), DType::i32, out32.data(), idx32.data(), ws.data(), n, C, rows, &bad, nullptr);
    CHECK(bad == 0);
    check_close(out32, out_ref, 0.0);
    std::vector<uint64_t> work((cu::embedding_backward_workspace(n, rows) + 7) / 8);
    std::vector<T> first;
    for (cu::EmbeddingBackward kind : {cu::EmbeddingBackward::columns, cu::EmbeddingBackward::packs}) {
      INFO("variant " << cu::name(kind) << (cu::embedding_packs_fit<T>(dw0.data(), douts.data(), C) ? "" : " (columns)"));
      auto dw = to_storage<T>(dw0);
      cu::embedding_backward(dtype_of<T>(), DType::i64, dw.data(), douts.data(), idx.data(), n, C, rows, work.data(),
                             nullptr, kind);
      if constexpr (std::is_same_v<T, float>) {
        REQUIRE(to_float(dw) == dw_ref);  // the CPU's order: bit-identical
      } else {
        check_close(dw, dw_ref, 8.0);
      }
      if (first.empty()) first = dw;
      else REQUIRE(to_float(dw) == to_float(first));  // each column in position order either way
    }
  }
  // A count the sort's 32-bit indices cannot hold is refused before the workspace is sized.
  REQUIRE_THROWS_WITH(cu::embedding_backward_workspace(int64_t(1) << 31, rows), Catch::Contains("at most 2^31 - 1 per call"));
  // int32 indices, 300 tokens over 17 rows (long runs after the sort, past the packs kernel's group
  // of 8), C over two column blocks: 150 (no whole packs: columns), 160 and 1088 (packs; 1088 in
  // bf16 is 136 of them, two blocks of threads).
  const int64_t n2 = 300, rows2 = 17;
  std::vector<int32_t> idx2(n2);
  for (int64_t i = 0; i < n2; ++i) idx2[size_t(i)] = int32_t((i * 7 + i / 13) % rows2);
  for (int64_t C2 : {int64_t(150), int64_t(160), int64_t(1088)}) {
    INFO("C " << C2);
    const auto dout2 = rounded<T>(randn(n2 * C2, 31));
    const std::vector<float> dw2_start = rounded<T>(randn(rows2 * C2, 32));
    std::vector<float> dw2_ref = dw2_start;
    cpu::embedding_backward(DType::f32, DType::i32, dw2_ref.data(), dout2.data(), idx2.data(), n2, C2, rows2);
    std::vector<uint64_t> work((cu::embedding_backward_workspace(n2, rows2) + 7) / 8);
    const auto douts2 = to_storage<T>(dout2);
    std::vector<T> first;
    for (cu::EmbeddingBackward kind : {cu::EmbeddingBackward::columns, cu::EmbeddingBackward::packs}) {
      INFO("variant " << cu::name(kind));
      auto dw2 = to_storage<T>(dw2_start);
      if (kind == cu::EmbeddingBackward::packs) REQUIRE(cu::embedding_packs_fit<T>(dw2.data(), douts2.data(), C2) == (C2 != 150));
      cu::embedding_backward(dtype_of<T>(), DType::i32, dw2.data(), douts2.data(), idx2.data(), n2, C2, rows2,
                             work.data(), nullptr, kind);
      if constexpr (std::is_same_v<T, float>) {
        REQUIRE(to_float(dw2) == dw2_ref);
      } else {
        check_close(dw2, dw2_ref, 8.0);
      }
      if (first.empty()) first = dw2;
      else REQUIRE(to_float(dw2) == to_float(first));
    }
  }
}

TEMPLATE_TEST_CASE("emu embedding zero-fills and counts indices outside the table, its backward skips them", "[emu]",
                   float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t rows = 16, C = 24, guard = 3;  // guard rows before and after the table must stay as they are
  // Out of range: negative, num_rows itself (the backward's sort key for "skip"), past it, and one
  // whose low bits name row 0 / row 15 (so a sort over too few bits would mix it into their runs).
  const std::vector<int64_t> idx = {15, -1, 3, 16, 0, 48, 3, int64_t(1) << 40, 15, 0, 47, 3};
  const int64_t n = int64_t(idx.size());
  std::vector<int64_t> good;
  std::vector<float> dout_good;
  const auto w = rounded<T>(randn(rows * C, 33)), dout = rounded<T>(randn(n * C, 34));
  for (int64_t i = 0; i < n; ++i)
    if (idx[size_t(i)] >= 0 && idx[size_t(i)] < rows) {
      good.push_back(idx[size_t(i)]);
      dout_good.insert(dout_good.end(), dout.begin() + i * C, dout.begin() + (i + 1) * C);
    }
  std::vector<T> out(size_t(n * C));
  int bad = 0;
  cu::embedding_forward(dtype_of<T>(), DType::i64, out.data(), idx.data(), to_storage<T>(w).data(), n, C, rows, &bad,
                        nullptr);
  CHECK(bad == 5);
  for (int64_t i : {1, 3, 5, 7, 10})
    for (int64_t c = 0; c < C; ++c) CHECK(cu::to_f32(out[size_t(i * C + c)]) == 0.0f);

  const auto all = rounded<T>(randn((rows + 2 * guard) * C, 35));
  std::vector<float> ref(all.begin() + guard * C, all.begin() + (guard + rows) * C);
  cpu::embedding_backward(DType::f32, DType::i64, ref.data(), dout_good.data(), good.data(), int64_t(good.size()), C,
                          rows);
  std::vector<uint64_t> work((cu::embedding_backward_workspace(n, rows) + 7) / 8);
  const auto douts = to_storage<T>(dout);
  for (cu::EmbeddingBackward kind : {cu::EmbeddingBackward::columns, cu::EmbeddingBackward::packs}) {
    INFO("variant " << cu::name(kind));
    auto dw = to_storage<T>(all);
    REQUIRE(cu::embedding_packs_fit<T>(dw.data() + guard * C, douts.data(), C));  // C = 24: whole packs
    cu::embedding_backward(dtype_of<T>(), DType::i64, dw.data() + guard * C, douts.data(), idx.data(), n, C, rows,
                           work.data(), nullptr, kind);
    const auto got = to_float(dw);
    const auto rows_of = [&](const std::vector<float>& v, int64_t first, int64_t count) {
      return std::vector<float>(v.begin() + first * C, v.begin() + (first + count) * C);
    };
    REQUIRE(rows_of(got, 0, guard) == rows_of(all, 0, guard));
    REQUIRE(rows_of(got, guard + rows, guard) == rows_of(all, guard + rows, guard));
    const std::vector<float> table(got.begin() + guard * C, got.end() - guard * C);
    if constexpr (std::is_same_v<T, float>) {
      REQUIRE(table == ref);  // the good indices' sums, in the CPU's order
    } else {
      check_close(table, ref, tol<T>(), tol<T>() * 8.0);
    }
  }
  // The radix sort's key width: every row and the skip key num_rows fit, nothing more.
  CHECK(cu::sort_key_bits(15) == 4);
  CHECK(cu::sort_key_bits(16) == 5);
  CHECK(cu::sort_key_bits(50304) == 16);
  CHECK(cu::sort_key_bits(65535) == 16);
  CHECK(cu::sort_key_bits(65536) == 17);
  CHECK(cu::sort_key_bits(0) == 1);
}

// ---------------------------------------------------------------- dropout, Philox fills

TEMPLATE_TEST_CASE("emu dropout and Philox fills draw the CPU table's numbers", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t n = 1001;
  const auto x = rounded<T>(randn(n, 31));
  std::vector<float> want(n);
  cpu::dropout(DType::f32, want.data(), x.data(), n, 0.3, 1234, 99, n, 0);
  const auto xs = to_storage<T>(x);
  std::vector<T> got(n), back(n);
  cu::dropout(dtype_of<T>(), got.data(), xs.data(), n, 0.3, 1234, 99, n, 0, nullptr);
  cu::dropout_backward(dtype_of<T>(), back.data(), xs.data(), n, 0.3, 1234, 99, n, 0, nullptr);
  int64_t dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    REQUIRE((cu::to_f32(got[size_t(i)]) == 0.0f) == (want[size_t(i)] == 0.0f));  // the same mask
    dropped += want[size_t(i)] == 0.0f;
  }
  CHECK(dropped > 250);
  CHECK(dropped < 350);
  if constexpr (std::is_same_v<T, float>) REQUIRE(to_float(got) == want);
  check_close(got, want);
  check_close(back, want);
  {
    // rows of 77 (13 of them): row r on stream 99 + r, element j at index 500 + j, as the CPU
    const int64_t row_len = 77;
    std::vector<float> rows_want(n);
    cpu::dropout(DType::f32, rows_want.data(), x.data(), n, 0.3, 1234, 99, row_len, 500);
    std::vector<T> rows_got(n);
    cu::dropout(dtype_of<T>(), rows_got.data(), xs.data(), n, 0.3, 1234, 99, row_len, 500, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = Philox::uniform(1234, 99 + uint64_t(i / row_len), 500 + uint64_t(i % row_len)) >= 0.3f;
      REQUIRE((rows_want[size_t(i)] != 0.0f) == keep);
      REQUIRE((cu::to_f32(rows_got[size_t(i)]) != 0.0f) == keep);
    }
    check_close(rows_got, rows_want);
  }
  for (bool normal : {false, true}) {
    std::vector<float> ref(n);
    cpu::random(DType::f32, ref.data(), n, normal, -0.5, 2.0, 77, 5, 1000);
    std::vector<T> r(n);
    cu::random(dtype_of<T>(), r.data(), n, normal, -0.5, 2.0, 77, 5, 1000, nullptr);
    if constexpr (std::is_same_v<T, float>) REQUIRE(to_float(r) == ref);
    check_close(r, ref);
  }
}

// ---------------------------------------------------------------- AdamW, global norm

namespace {
// One tensor's parameter and moments after the emulated update against the CPU table's.
void check_adamw_state(const std::vector<float>& p, const std::vector<float>& m, const std::vector<float>& v,
                       const std::vector<float>& p_ref, const std::vector<float>& m_ref,
                       const std::vector<float>& v_ref) {
  check_close(p, p_ref, 1e-6, 1e-7);
  check_close(m, m_ref, 1e-6, 1e-7);
  check_close(v, v_ref, 1e-6, 1e-9);
}
}  // namespace

TEST_CASE("emu multi-tensor AdamW (the adamw_many entry) matches the CPU table on every tensor", "[emu]") {
  // 30 tensors (two launches), sizes with tails, one empty; every third takes no weight decay.
  // Every fourth parameter starts one float into its buffer: those tensors take the one-element
  // path, the others four elements at a time (and the one-element path for their tails).
  std::vector<std::vector<float>> p, g, m, v, p_ref, m_ref, v_ref;
  std::vector<size_t> sizes, offsets;
  for (int t = 0; t < 30; ++t) {
    const size_t n = t == 4 ? 0 : size_t(37 * t + 5 + (t == 7 ? 9000 : 0)), off = t % 4 == 1 ? 1 : 0;
    sizes.push_back(n), offsets.push_back(off);
    p.push_back(randn(n + off, 100 + t));
    g.push_back(randn(n, 200 + t));
    m.push_back(randn(n, 300 + t, 0.1f));
    v.push_back(rounded<float>(randn(n, 400 + t, 0.1f)));
    for (auto& x : v.back()) x = x * x;
  }
  p_ref = p, m_ref = m, v_ref = v;
  std::vector<kernels::AdamWArgs> args, ref;
  for (size_t t = 0; t < p.size(); ++t) {
    kernels::AdamWArgs a;
    a.dtype = DType::f32;
    a.n = int64_t(sizes[t]);
    a.lr = 3e-3, a.beta1 = 0.9, a.beta2 = 0.95, a.eps = 1e-8, a.weight_decay = t % 3 ? 0.1 : 0.0;
    a.grad_scale = 0.5, a.step = 7;
    a.param = p_ref[t].data() + offsets[t], a.grad = g[t].data(), a.m = m_ref[t].data(), a.v = v_ref[t].data();
    ref.push_back(a);
    a.param = p[t].data() + offsets[t], a.m = m[t].data(), a.v = v[t].data();
    args.push_back(a);
  }
  cpu::adamw_many(ref.data(), int64_t(ref.size()));
  cu::adamw_many(args.data(), int64_t(args.size()), nullptr);
  for (size_t t = 0; t < p.size(); ++t) {
    INFO("tensor " << t);
    check_adamw_state(p[t], m[t], v[t], p_ref[t], m_ref[t], v_ref[t]);
  }
  // Only weight_decay may differ between tensors: anything else is refused, naming the tensor.
  args[5].step = 8;
  REQUIRE_THROWS_WITH(cu::adamw_many(args.data(), int64_t(args.size()), nullptr),
                      Catch::Contains("tensor 5 of 30"));
  REQUIRE_THROWS_WITH(cpu::adamw_many(args.data(), int64_t(args.size())),
                      Catch::Contains("only weight_decay may differ"));
}

TEST_CASE("emu AdamW on bf16 weights with f32 moments follows the f32 update", "[emu]") {
  const int64_t n = 1003;
  const auto p = rounded<cu::bf16>(randn(n, 40)), g = rounded<cu::bf16>(randn(n, 41));
  std::vector<float> p_ref = p, m_ref(n, 0.0f), v_ref(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  kernels::AdamWArgs a;
  a.dtype = DType::f32, a.n = n, a.lr = 1e-2, a.weight_decay = 0.1, a.step = 1;
  a.param = p_ref.data(), a.grad = g.data(), a.m = m_ref.data(), a.v = v_ref.data();
  cpu::adamw(a);
  auto pb = to_storage<cu::bf16>(p);
  const auto gb = to_storage<cu::bf16>(g);
  cu::adamw_multi<cu::bf16>({{pb.data(), gb.data(), m.data(), v.data(), n, 0.1}}, {1e-2, 0.9, 0.999, 1e-8, 1.0, 1},
                            nullptr);
  check_close(pb, p_ref);
  check_close(m, m_ref, 1e-6, 1e-7);
}

// Mixed precision through the adamw_many entry: f32 masters, bf16 or f16 gradients read as they are,
// and the updated masters rounded into a copy in the same pass (one tensor without a copy, one
// whose copy starts one element into its buffer: the one-element path).
TEMPLATE_TEST_CASE("emu AdamW on f32 masters reads half gradients and writes half copies like the CPU table", "[emu]",
                   cu::bf16, cu::f16) {
  using H = TestType;
  std::vector<std::vector<float>> p, m, v, p_ref, m_ref, v_ref;
  std::vector<std::vector<H>> g, copy, copy_ref;
  for (int t = 0; t < 5; ++t) {
    const size_t n = size_t(301 * t + 7);
    p.push_back(randn(n, 600 + t));
    g.push_back(to_storage<H>(rounded<H>(randn(n, 610 + t))));
    m.push_back(std::vector<float>(n, 0.01f)), v.push_back(std::vector<float>(n, 0.02f));
    copy.push_back(std::vector<H>(n + (t == 3))), copy_ref.push_back(std::vector<H>(n + (t == 3)));
  }
  p_ref = p, m_ref = m, v_ref = v;
  std::vector<kernels::AdamWArgs> args, ref;
  for (size_t t = 0; t < p.size(); ++t) {
    kernels::AdamWArgs a;
    a.dtype = DType::f32, a.grad_dtype = dtype_of<H>();
    a.n = int64_t(p[t].size()), a.lr = 3e-3, a.weight_decay = t % 2 ? 0.1 : 0.0, a.grad_scale = 0.5, a.step = 3;
    a.grad = g[t].data();
    a.param = p_ref[t].data(), a.m = m_ref[t].data(), a.v = v_ref[t].data();
    a.copy = t == 2 ? nullptr : copy_ref[t].data() + (t == 3);
    ref.push_back(a);
    a.param = p[t].data(), a.m = m[t].data(), a.v = v[t].data(), a.copy = t == 2 ? nullptr : copy[t].data() + (t == 3);
    args.push_back(a);
  }
  cpu::adamw_many(ref.data(), int64_t(ref.size()));
  cu::adamw_many(args.data(), int64_t(args.size()), nullptr);
  for (size_t t = 0; t < p.size(); ++t) {
    INFO("tensor " << t);
    check_adamw_state(p[t], m[t], v[t], p_ref[t], m_ref[t], v_ref[t]);
    if (t == 2) continue;
    check_close(to_float(copy[t]), to_float(copy_ref[t]), 1e-2, 1e-3);
    check_close(std::vector<H>(copy[t].begin() + (t == 3), copy[t].end()), p_ref[t]);  // the master, rounded
  }
}

TEMPLATE_TEST_CASE("emu global norm of many weighted tensors is the CPU sum of squares, the same bits every run",
                   "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  std::vector<std::vector<T>> data;
  std::vector<cu::NormTensor> list;
  double want = 0;
  // Tensor 5 starts one element into its buffer: not 16-byte aligned, read element by element
  // (the others take 16-byte loads and their chunks' tails element by element).
  for (int t = 0; t < 27; ++t) {
    const auto x = rounded<T>(randn(size_t(t == 3 ? 10000 : 13 * t + 1), 500 + t));
    const int64_t skip = t == 5 ? 1 : 0;
    const float weight = t % 4 == 1 ? 0.0f : t % 4 == 2 ? 0.5f : 1.0f;
    std::vector<float> partial(1);
    cpu::reduce(kernels::Reduce::sum_squares, DType::f32, partial.data(), x.data() + skip, 1, int64_t(x.size()) - skip, 1);
    want += weight * partial[0];
    data.push_back(to_storage<T>(x));
    list.push_back({nullptr, int64_t(x.size()) - skip, weight});
  }
  for (size_t t = 0; t < data.size(); ++t) list[t].data = data[t].data() + (t == 5 ? 1 : 0);
  REQUIRE(!cu::aligned16(list[5].data));
  REQUIRE(cu::aligned16(list[3].data));
  std::vector<float> work(static_cast<size_t>(cu::global_norm_workspace(list)));
  float got = -1, again = -2;
  cu::global_norm_squared<T>(&got, list, work.data(), nullptr);
  cu::global_norm_squared<T>(&again, list, work.data(), nullptr);
  CHECK(got == Approx(want).epsilon(1e-5));
  CHECK(got == again);
}

// The CUDA op table's sum_squares_many reads what norm_tensors keeps. A tensor of weight 0 holds
// NaN and an empty one has no data: read, either turns the sum into NaN or faults.
TEST_CASE("emu sum_squares_many's list leaves out empty tensors and those of weight 0", "[emu]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a = randn(300, 510), b = randn(77, 511), poisoned(64, nan);
  const void* xs[] = {a.data(), poisoned.data(), nullptr, b.data()};
  const int64_t ns[] = {300, 64, 0, 77};
  const double weights[] = {1.0, 0.0, 1.0, 0.5};
  const auto list = cu::norm_tensors(xs, ns, weights, 4);
  REQUIRE(list.size() == 2);
  CHECK(list[0].data == a.data());
  CHECK(list[1].data == b.data());
  CHECK(list[1].weight == 0.5f);
  std::vector<float> work(size_t(cu::global_norm_workspace(list)));
  float got = -1;
  cu::global_norm_squared<float>(&got, list, work.data(), nullptr);
  const double want = cpu::sum_squares_many(DType::f32, xs, ns, weights, 4);  // the CPU table skips them too
  REQUIRE(std::isfinite(want));
  CHECK(got == Approx(want).epsilon(1e-5));
}

TEST_CASE("emu relu keeps NaN, as the CPU table and PyTorch do", "[emu]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {nan, -1.0f, 2.0f, -nan};
  std::vector<float> got(x.size(), 7.0f), want(x.size(), 7.0f);
  cu::unary(Unary::relu, DType::f32, got.data(), x.data(), int64_t(x.size()), 0, nullptr);
  cpu::unary(Unary::relu, DType::f32, want.data(), x.data(), int64_t(x.size()), 0);
  for (size_t i : {size_t(0), size_t(3)}) {
    CHECK(std::isnan(got[i]));
    CHECK(std::isnan(want[i]));
  }
  CHECK(got[1] == 0.0f);
  CHECK(got[2] == 2.0f);
}
