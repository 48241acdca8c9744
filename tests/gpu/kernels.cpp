// Every entry of the CUDA op table on cuda:0 against the CPU op table, on small irregular sizes,
// f32, bf16 and f16 (the CPU computes in f32 on the rounded inputs). Exits 77
// (CTest: skipped) on a machine without a CUDA device or on a build without SG_CUDA_KERNELS.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <thread>
#include <tuple>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/cuda/gemm_choices.h"
#include "kernels/cuda/runtime.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "optim/optim.h"
#include "tests/gpu/support.h"

#ifdef SG_CUDA_KERNELS
using namespace sg;
using kernels::Dims;
using namespace sg::gpu_testing;

namespace {

cudaStream_t stream0() { return cuda::compute_stream(Device::cuda(0)); }  // the op table's stream

double rtol(DType dt) { return dt == DType::f32 ? 1e-4 : 2e-2; }

const std::vector<DType> kFloat = {DType::f32, DType::bf16, DType::f16};

// The embedding of idx over a [rows, C] table of randn(seed), and its '+=' backward into randn(seed
// + 2) from randn(seed + 1), on cuda:0 against the CPU, for every float dtype; half_atol bounds the
// backward's sums in bf16/f16.
void check_embedding(const std::vector<int64_t>& idx, int64_t C_, int64_t rows, uint32_t seed, double half_atol) {
  const int64_t n = int64_t(idx.size());
  const auto weight = randn(size_t(rows * C_), seed), dout = randn(size_t(n * C_), seed + 1),
             dw0 = randn(size_t(rows * C_), seed + 2);
  for (DType dt : kFloat) {
    INFO(dtype_name(dt) << " C " << C_);
    Tensor gi = to(from_vector(idx, {n}), gpu), ci = from_vector(idx, {n});
    Tensor gwt = put(weight, dt, gpu), cwt = put(rounded(weight, dt), DType::f32, host);
    Tensor gout = buffer(n * C_, dt, gpu), cout = buffer(n * C_, DType::f32, host);
    G().embedding(dt, DType::i64, gout.data_ptr(), gi.data_ptr(), gwt.data_ptr(), n, C_, rows);
    C().embedding(DType::f32, DType::i64, cout.data_ptr(), ci.data_ptr(), cwt.data_ptr(), n, C_, rows);
    check_close(get(gout), get(cout), 0, 0);
    Tensor gdo = put(dout, dt, gpu), cdo = put(rounded(dout, dt), DType::f32, host);
    Tensor cdw = put(rounded(dw0, dt), DType::f32, host);
    C().embedding_backward(DType::f32, DType::i64, cdw.data_ptr(), cdo.data_ptr(), ci.data_ptr(), n, C_, rows);
    std::vector<float> first;
    // each way the backward can sum a run (cuda::set_embedding_backward_kind): the same bits
    for (cuda::EmbeddingBackward kind : {cuda::EmbeddingBackward::columns, cuda::EmbeddingBackward::packs}) {
      INFO("variant " << cuda::name(kind));
      cuda::set_embedding_backward_kind(kind);
      Tensor gdw = put(dw0, dt, gpu);
      G().embedding_backward(dt, DType::i64, gdw.data_ptr(), gdo.data_ptr(), gi.data_ptr(), n, C_, rows);
      const std::vector<float> got = get(gdw);
      check_close(got, get(cdw), rtol(dt), dt == DType::f32 ? 1e-5 : half_atol);
      if (first.empty()) first = got;
      else CHECK(got == first);
    }
    cuda::set_embedding_backward_kind(cuda::EmbeddingBackward::columns);
  }
}

}  // namespace

TEST_CASE("fill, copy_strided and the casts match the CPU", "[gpu][kernels]") {
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64}) {
    INFO(dtype_name(dt));
    Tensor d = buffer(1001, dt, gpu), c = buffer(1001, dt, host);
    G().fill(d.data_ptr(), dt, 1001, 3.25);
    C().fill(c.data_ptr(), dt, 1001, 3.25);
    REQUIRE(get(d) == get(c));
  }
  // A transposed [37, 19] view of a [19, 37] matrix, into every storage type.
  const auto v = randn(19 * 37, 1);
  for (DType src : kFloat)
    for (DType dst : {DType::f32, DType::bf16, DType::f16}) {
      INFO(dtype_name(src) << " -> " << dtype_name(dst));
      Tensor s = put(v, src, gpu), sc = put(v, src, host);
      Tensor d = buffer(37 * 19, dst, gpu), c = buffer(37 * 19, dst, host);
      G().copy_strided(d.data_ptr(), dst, s.data_ptr(), src, {37, 19}, {1, 37});
      C().copy_strided(c.data_ptr(), dst, sc.data_ptr(), src, {37, 19}, {1, 37});
      REQUIRE(get(d) == get(c));
    }
}

TEST_CASE("copy_ into a strided view (a narrow() slice, a transposed slice) writes exactly its elements", "[gpu][kernels]") {
  // The backward of narrow() on the last dim (q, k, v out of one qkv) writes such views.
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    INFO(dtype_name(dt));
    const auto v = randn(5 * 6 * 12, 40), src = randn(5 * 6 * 4, 41);
    Tensor g = view(put(v, dt, gpu), {5, 6, 12}), c = view(put(v, dt, host), {5, 6, 12});
    const DType sdt = dt == DType::i64 ? dt : DType::f32;  // floats convert on the way
    copy_(narrow(g, 2, 4, 4), view(put(src, sdt, gpu), {5, 6, 4}));
    copy_(narrow(c, 2, 4, 4), view(put(src, sdt, host), {5, 6, 4}));
    REQUIRE(get(g) == get(c));
    copy_(transpose(narrow(g, 1, 1, 3), 0, 2), transpose(narrow(c, 1, 2, 3), 0, 2));  // cross-device, strided both sides
    copy_(transpose(narrow(c, 1, 1, 3), 0, 2), transpose(narrow(c, 1, 2, 3), 0, 2));
    REQUIRE(get(g) == get(c));
  }
}

TEST_CASE("binary ops, contiguous and broadcast, match the CPU", "[gpu][kernels]") {
  const Dims shape = {5, 7, 9};
  const auto a = randn(5 * 7 * 9, 2), b = randn(7 * 9, 3, 1.0f, 3.0f);  // b away from 0 for div
  for (DType dt : kFloat)
    for (auto op : {kernels::Binary::add, kernels::Binary::sub, kernels::Binary::mul, kernels::Binary::div,
                    kernels::Binary::max, kernels::Binary::min}) {
      INFO(dtype_name(dt) << " op " << int(op));
      Tensor ga = put(a, dt, gpu), gb = put(b, dt, gpu), out = buffer(315, dt, gpu);
      Tensor ca = put(rounded(a, dt), DType::f32, host), cb = put(rounded(b, dt), DType::f32, host);
      Tensor ref = buffer(315, DType::f32, host);
      G().binary(op, dt, out.data_ptr(), ga.data_ptr(), {63, 9, 1}, gb.data_ptr(), {0, 9, 1}, shape);
      C().binary(op, DType::f32, ref.data_ptr(), ca.data_ptr(), {63, 9, 1}, cb.data_ptr(), {0, 9, 1}, shape);
      check_close(get(out), rounded(get(ref), dt), rtol(dt), 1e-6);
      // contiguous (the 128-bit path): a op a
      G().binary(op, dt, out.data_ptr(), ga.data_ptr(), {63, 9, 1}, ga.data_ptr(), {63, 9, 1}, shape);
      C().binary(op, DType::f32, ref.data_ptr(), ca.data_ptr(), {63, 9, 1}, ca.data_ptr(), {63, 9, 1}, shape);
      check_close(get(out), rounded(get(ref), dt), rtol(dt), 1e-6);
    }
}

TEST_CASE("unary ops and their derivatives match the CPU", "[gpu][kernels]") {
  const int64_t n = 1003;
  const auto x = randn(n, 4, 0.5f, 1.5f);  // mostly positive: log, sqrt, rsqrt, pow stay defined
  for (DType dt : kFloat) {
    for (int k = 0; k <= int(kernels::Unary::square); ++k) {
      const auto op = kernels::Unary(k);
      INFO(dtype_name(dt) << " unary " << k);
      Tensor gx = put(x, dt, gpu), out = buffer(n, dt, gpu);
      Tensor cx = put(rounded(x, dt), DType::f32, host), ref = buffer(n, DType::f32, host);
      G().unary(op, dt, out.data_ptr(), gx.data_ptr(), n, 1.7);
      C().unary(op, DType::f32, ref.data_ptr(), cx.data_ptr(), n, 1.7);
      check_close(get(out), rounded(get(ref), dt), rtol(dt), 1e-5);
    }
    const auto dy = randn(n, 5);
    for (auto op : {kernels::Unary::relu, kernels::Unary::gelu, kernels::Unary::silu, kernels::Unary::tanh,
                    kernels::Unary::exp}) {
      INFO(dtype_name(dt) << " unary_backward " << int(op));
      Tensor gx = put(x, dt, gpu), gdy = put(dy, dt, gpu), dx = buffer(n, dt, gpu);
      Tensor cx = put(rounded(x, dt), DType::f32, host), cdy = put(rounded(dy, dt), DType::f32, host);
      Tensor ref = buffer(n, DType::f32, host);
      G().unary_backward(op, dt, dx.data_ptr(), gdy.data_ptr(), gx.data_ptr(), n);
      C().unary_backward(op, DType::f32, ref.data_ptr(), cdy.data_ptr(), cx.data_ptr(), n);
      check_close(get(dx), rounded(get(ref), dt), rtol(dt), 1e-5);
    }
  }
}

TEST_CASE("reductions over rows and over a middle axis match the CPU", "[gpu][kernels]") {
  for (DType dt : kFloat)
    for (auto op : {kernels::Reduce::sum, kernels::Reduce::max, kernels::Reduce::sum_squares})
      for (Dims s : {Dims{3, 777, 1}, Dims{4, 33, 5}, Dims{2, 5000, 70}, Dims{2, 70001, 1}}) {
        INFO(dtype_name(dt) << " reduce " << int(op) << " [" << s[0] << "," << s[1] << "," << s[2] << "]");
        const auto x = randn(size_t(s[0] * s[1] * s[2]), 6);
        Tensor gx = put(x, dt, gpu), out = buffer(s[0] * s[2], dt, gpu);
        Tensor cx = put(rounded(x, dt), DType::f32, host), ref = buffer(s[0] * s[2], DType::f32, host);
        G().reduce(op, dt, out.data_ptr(), gx.data_ptr(), s[0], s[1], s[2]);
        C().reduce(op, DType::f32, ref.data_ptr(), cx.data_ptr(), s[0], s[1], s[2]);
        check_close(get(out), rounded(get(ref), dt), rtol(dt), 1e-3);
      }
}

TEST_CASE("gemm through cuBLASLt matches the CPU for every transpose, batched, with alpha and beta", "[gpu][kernels]") {
  const int64_t M = 37, N = 45, K = 29, batch = 3;
  for (DType dt : kFloat)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        INFO(dtype_name(dt) << " trans_a " << ta << " trans_b " << tb);
        const auto a = randn(size_t(batch * M * K), 7), b = randn(size_t(batch * K * N), 8),
                   c = randn(size_t(batch * M * N), 9);
        kernels::GemmArgs g;
        g.dtype = dt, g.trans_a = ta, g.trans_b = tb, g.M = M, g.N = N, g.K = K;
        g.lda = ta ? M : K, g.ldb = tb ? K : N, g.ldc = N;
        g.alpha = 0.7, g.beta = 0.3, g.batch = batch, g.stride_a = M * K, g.stride_b = K * N, g.stride_c = M * N;
        Tensor ga = put(a, dt, gpu), gb = put(b, dt, gpu), gc = put(c, dt, gpu);
        Tensor ca = put(rounded(a, dt), DType::f32, host), cb = put(rounded(b, dt), DType::f32, host),
               cc = put(rounded(c, dt), DType::f32, host);
        kernels::GemmArgs h = g;
        g.A = ga.data_ptr(), g.B = gb.data_ptr(), g.C = gc.data_ptr();
        h.dtype = DType::f32, h.A = ca.data_ptr(), h.B = cb.data_ptr(), h.C = cc.data_ptr();
        G().gemm(g);
        C().gemm(h);
        check_close(get(gc), rounded(get(cc), dt), rtol(dt), dt == DType::f32 ? 1e-4 : 3e-2);
      }
}

TEST_CASE("TF32 GEMM stays within TF32 rounding of the CPU", "[gpu][kernels]") {
  const int64_t M = 64, N = 48, K = 80;
  const auto a = randn(size_t(M * K), 10), b = randn(size_t(K * N), 11);
  Tensor ga = put(a, DType::f32, gpu), gb = put(b, DType::f32, gpu), gc = buffer(M * N, DType::f32, gpu);
  Tensor ca = put(a, DType::f32, host), cb = put(b, DType::f32, host), cc = buffer(M * N, DType::f32, host);
  kernels::GemmArgs g;
  g.dtype = DType::f32, g.M = M, g.N = N, g.K = K, g.lda = K, g.ldb = N, g.ldc = N;
  kernels::GemmArgs h = g;
  g.A = ga.data_ptr(), g.B = gb.data_ptr(), g.C = gc.data_ptr();
  h.A = ca.data_ptr(), h.B = cb.data_ptr(), h.C = cc.data_ptr();
  cuda::set_allow_tf32(true);
  G().gemm(g);
  cuda::set_allow_tf32(false);
  C().gemm(h);
  check_close(get(gc), get(cc), 0, 5e-3 * std::sqrt(double(K)));
}

// The table's gemm with its epilogue (bias, GELU, the saved pre-activation, or a residual added
// last, with or without a bias): fused into cuBLASLt where it fits (N = 40), run as separate
// kernels where it does not (N = 36 with pre_gelu; a bias at a 2-byte offset). The residual is
// cuBLASLt's beta = 1 source with the output as D; at a 2-byte offset of its own it asks for an
// algorithm for a less aligned C (or the bare GEMM and an add where there is none). The CPU table
// applies the same epilogue after its GEMM.
TEST_CASE("gemm with bias, GELU and residual epilogues equals the CPU's, fused or not", "[gpu][kernels]") {
  const int64_t M = 33, K = 24;
  for (DType dt : kFloat)
    for (int64_t N : {int64_t(40), int64_t(36)})
      for (int last : {0, 1, 2, 3})  // 0 bias only, 1 bias + GELU, 2 bias + residual, 3 residual alone
        for (int offset : {0, 1, 2}) {  // 1: the bias 2 bytes off; 2: the residual 2 bytes off
          const bool gelu = last == 1, residual = last >= 2, with_bias = last != 3;
          if ((offset == 1 && !with_bias) || (offset == 2 && !residual)) continue;
          INFO(dtype_name(dt) << " N " << N << " bias " << with_bias << " gelu " << gelu << " residual " << residual
                              << " offset " << offset);
          const auto x = randn(size_t(M * K), 12), w = randn(size_t(N * K), 13, 0.3f), bias = randn(size_t(N + 1), 14),
                     res = randn(size_t(M * N + 1), 15);
          Tensor gx = put(x, dt, gpu), gw = put(w, dt, gpu), gbias = put(bias, dt, gpu), gres = put(res, dt, gpu);
          Tensor cx = put(rounded(x, dt), DType::f32, host), cw = put(rounded(w, dt), DType::f32, host),
                 cbias = put(rounded(bias, dt), DType::f32, host), cres = put(rounded(res, dt), DType::f32, host);
          Tensor out = buffer(M * N, dt, gpu), pre = buffer(M * N, dt, gpu);
          Tensor cout = buffer(M * N, DType::f32, host), cpre = buffer(M * N, DType::f32, host);
          const size_t bias_skip = offset == 1 ? 1 : 0, res_skip = offset == 2 ? 1 : 0;
          auto args = [&](DType t, Tensor& xx, Tensor& ww, Tensor& bb, Tensor& rr, Tensor& o, Tensor& p) {
            kernels::GemmArgs g;
            g.dtype = t;
            g.trans_b = true;
            g.M = M, g.N = N, g.K = K;
            g.A = xx.data_ptr(), g.lda = K, g.B = ww.data_ptr(), g.ldb = K, g.C = o.data_ptr(), g.ldc = N;
            g.bias = with_bias ? static_cast<const char*>(bb.data_ptr()) + bias_skip * dtype_size(t) : nullptr;
            g.gelu = gelu;
            g.pre_gelu = gelu ? p.data_ptr() : nullptr;
            g.residual = residual ? static_cast<const char*>(rr.data_ptr()) + res_skip * dtype_size(t) : nullptr;
            return g;
          };
          G().gemm(args(dt, gx, gw, gbias, gres, out, pre));
          C().gemm(args(DType::f32, cx, cw, cbias, cres, cout, cpre));
          const double tol = dt == DType::f32 ? 1e-4 : 3e-2;
          check_close(get(out), rounded(get(cout), dt), rtol(dt), tol);
          if (gelu) check_close(get(pre), rounded(get(cpre), dt), rtol(dt), tol);
          if (residual && N == 40 && offset == 0)
            std::printf("cuBLASLt fused residual%s (%s): %s\n", with_bias ? " + bias" : "", dtype_name(dt),
                        cuda::gemm_fused(args(dt, gx, gw, gbias, gres, out, pre), stream0()) ? "yes" : "NO (separate kernels)");
        }
  // an epilogue that breaks GemmArgs' rules is refused by name
  Tensor a = buffer(4, DType::f32, gpu), c = buffer(4, DType::f32, gpu);
  kernels::GemmArgs g;
  g.dtype = DType::f32;
  g.M = 2, g.N = 2, g.K = 2, g.A = a.data_ptr(), g.lda = 2, g.B = a.data_ptr(), g.ldb = 2, g.C = c.data_ptr(), g.ldc = 2;
  g.gelu = true;
  g.beta = 1.0;
  REQUIRE_THROWS_WITH(G().gemm(g), Catch::Contains("gemm (cuda): the GELU epilogue needs beta = 0"));
}

// GEMM tuning (SG_GEMM_TUNE): the first call of a shape times several algorithms on its own
// operands. A call that reads its output (beta != 0: gradient accumulation) must see the real C
// afterwards, not C plus the timing runs' products; a residual call must still add it once.
TEST_CASE("gemm with tuning on reads its real output once: beta accumulation and a residual", "[gpu][kernels]") {
  cuda::set_gemm_tuning(true);
  const int64_t M = 512, N = 384, K = 256;  // shapes no other test uses: their first call tunes
  for (DType dt : kFloat)
    for (int mode : {0, 1, 2}) {  // 0 beta 0; 1 C = A B^T + 0.5 C; 2 C = A B^T + R (the residual)
      INFO(dtype_name(dt) << " mode " << mode);
      const auto a = randn(size_t(M * K), 40), b = randn(size_t(N * K), 41, 0.2f), c = randn(size_t(M * N), 42),
                 r = randn(size_t(M * N), 43);
      Tensor ga = put(a, dt, gpu), gb = put(b, dt, gpu), gc = put(c, dt, gpu), gr = put(r, dt, gpu);
      Tensor ca = put(rounded(a, dt), DType::f32, host), cb = put(rounded(b, dt), DType::f32, host),
             cc = put(rounded(c, dt), DType::f32, host), cr = put(rounded(r, dt), DType::f32, host);
      auto args = [&](DType t, Tensor& x, Tensor& w, Tensor& o, Tensor& res) {
        kernels::GemmArgs g;
        g.dtype = t, g.trans_b = true, g.M = M, g.N = N - 8 * mode, g.K = K;  // a shape of its own per mode
        g.lda = K, g.ldb = K, g.ldc = g.N;  // a residual epilogue takes a contiguous C
        g.A = x.data_ptr(), g.B = w.data_ptr(), g.C = o.data_ptr();
        g.beta = mode == 1 ? 0.5 : 0.0;
        g.residual = mode == 2 ? res.data_ptr() : nullptr;
        return g;
      };
      G().gemm(args(dt, ga, gb, gc, gr));
      C().gemm(args(DType::f32, ca, cb, cc, cr));
      check_close(get(gc), rounded(get(cc), dt), rtol(dt), dt == DType::f32 ? 1e-4 : 3e-2);
    }
  cuda::set_gemm_tuning(false);
}

// SG_GEMM_TUNE_FILE: a tuned call adds its shape to the file; once the process forgets its
// choices, the same GEMM with tuning off runs the saved algorithm (counted) and gives the tuned
// call's bits; a file tuned on another card is refused, naming the file.
TEST_CASE("gemm tuning file: a tuned shape is saved, then run from the file with tuning off; another card's file is refused",
          "[gpu][kernels]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("sg_gpu_tune_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "gemm.tune").string();
  const int64_t M = 520, N = 264, K = 136;  // a shape no other test uses
  const auto a = randn(size_t(M * K), 50), b = randn(size_t(N * K), 51, 0.2f);
  Tensor ga = put(a, DType::bf16, gpu), gb = put(b, DType::bf16, gpu);
  auto run = [&] {
    Tensor gc = buffer(M * N, DType::bf16, gpu);
    kernels::GemmArgs g;
    g.dtype = DType::bf16, g.trans_b = true, g.M = M, g.N = N, g.K = K, g.lda = K, g.ldb = K, g.ldc = N;
    g.A = ga.data_ptr(), g.B = gb.data_ptr(), g.C = gc.data_ptr();
    G().gemm(g);
    return get(gc);  // bf16 widened exactly: equal floats are equal bits
  };
  cuda::set_gemm_tuning_file(path);
  cuda::set_gemm_tuning(true);
  const std::vector<float> tuned = run();
  cuda::set_gemm_tuning(false);
  REQUIRE(fs::exists(path));
  const cuda::GemmChoices saved = cuda::read_gemm_choices(path);
  const auto it = std::find_if(saved.choices.begin(), saved.choices.end(),
                               [&](const auto& e) { return e.first.M == M && e.first.N == N && e.first.K == K; });
  REQUIRE(it != saved.choices.end());
  INFO(cuda::format_gemm_choices(saved));
  CHECK(it->second.ms >= 0);  // 0: the heuristic's only candidate, not timed
  CHECK_THAT(saved.device, Catch::Contains(" sm_"));

  cuda::forget_gemm_choices();
  const int64_t before = cuda::gemm_choices_from_file();
  CHECK(run() == tuned);
  CHECK(cuda::gemm_choices_from_file() == before + 1);

  cuda::GemmChoices other = saved;
  other.device = "Another Card sm_70";
  cuda::write_gemm_choices(path, other);
  cuda::set_gemm_tuning_file(path);  // read again at the next GEMM
  cuda::forget_gemm_choices();
  REQUIRE_THROWS_WITH(run(), Catch::Contains(path) && Catch::Contains("was tuned with cuBLASLt") &&
                                 Catch::Contains("Another Card sm_70"));
  cuda::set_gemm_tuning_file("");
  cuda::forget_gemm_choices();
  CHECK(run() == run());  // without the file: the heuristic's choice again
  fs::remove_all(dir);
}

// The backward epilogues: C = (A B) * GELU'(pre) with C's column sums (cuBLASLt DGELU_BGRAD, an
// MLP's dpre and c_fc bias gradient), and the row sums of op(A) beside the product (BGRADB, a
// weight gradient's bias gradient), op(A) transposed or not. Fused where cuBLASLt takes them
// (N = 40, 16-byte aligned vectors), as separate kernels where it does not (N = 36 with a
// pre-activation; vectors one element off). The CPU applies the same epilogues after its GEMM.
TEST_CASE("gemm's backward epilogues (dgelu, bias_grad, row_sums_a) equal the CPU's, fused or not", "[gpu][kernels]") {
  const int64_t M = 33, K = 24;
  for (DType dt : kFloat)
    for (int64_t N : {int64_t(40), int64_t(36)})
      for (bool offset : {false, true}) {
        INFO(dtype_name(dt) << " N " << N << " vectors at +1 element " << offset);
        const size_t skip = offset ? 1 : 0;
        const auto a = randn(size_t(M * K), 31), b = randn(size_t(K * N), 32, 0.3f), pre = randn(size_t(M * N), 33, 1.5f);
        Tensor ga = put(a, dt, gpu), gb = put(b, dt, gpu), gpre = put(pre, dt, gpu);
        Tensor ca = put(rounded(a, dt), DType::f32, host), cb = put(rounded(b, dt), DType::f32, host),
               cpre = put(rounded(pre, dt), DType::f32, host);
        const double tol = dt == DType::f32 ? 1e-4 : 5e-2;
        const auto at = [](const Tensor& t, DType d, size_t k) {
          return static_cast<char*>(const_cast<void*>(t.data_ptr())) + k * dtype_size(d);
        };
        {  // dgelu with the bias gradient: C [M, N] = A [M, K] B [K, N]
          Tensor out = buffer(M * N, dt, gpu), bg = buffer(N + 1, dt, gpu);
          Tensor cout = buffer(M * N, DType::f32, host), cbg = buffer(N + 1, DType::f32, host);
          auto args = [&](DType t, Tensor& aa, Tensor& bb, Tensor& pp, Tensor& o, Tensor& v) {
            kernels::GemmArgs g;
            g.dtype = t;
            g.M = M, g.N = N, g.K = K;
            g.A = aa.data_ptr(), g.lda = K, g.B = bb.data_ptr(), g.ldb = N, g.C = o.data_ptr(), g.ldc = N;
            g.dgelu_pre = pp.data_ptr();
            g.bias_grad = at(v, t, skip);
            return g;
          };
          G().gemm(args(dt, ga, gb, gpre, out, bg));
          C().gemm(args(DType::f32, ca, cb, cpre, cout, cbg));
          if (!offset && N == 40)  // whether cuBLASLt took DGELU_BGRAD (the table falls back if not): for the log
            std::printf("cuBLASLt fused dgelu + bias_grad (%s): %s\n", dtype_name(dt),
                        cuda::gemm_fused(args(dt, ga, gb, gpre, out, bg), stream0()) ? "yes" : "NO (separate kernels)");
          check_close(get(out), rounded(get(cout), dt), rtol(dt), tol);
          check_close(get(bg), rounded(get(cbg), dt), rtol(dt), tol * 4);
        }
        for (bool trans : {true, false}) {  // row sums of op(A) [M, K], stored [K, M] when transposed
          INFO("trans_a " << trans);
          Tensor src = trans ? contiguous(transpose(view(ga, {M, K}), 0, 1)) : ga;
          Tensor csrc = trans ? contiguous(transpose(view(ca, {M, K}), 0, 1)) : ca;
          Tensor out = buffer(M * N, dt, gpu), rs = buffer(M + 1, dt, gpu);
          Tensor cout = buffer(M * N, DType::f32, host), crs = buffer(M + 1, DType::f32, host);
          auto args = [&](DType t, Tensor& aa, Tensor& bb, Tensor& o, Tensor& v) {
            kernels::GemmArgs g;
            g.dtype = t;
            g.trans_a = trans;
            g.M = M, g.N = N, g.K = K;
            g.A = aa.data_ptr(), g.lda = trans ? M : K, g.B = bb.data_ptr(), g.ldb = N, g.C = o.data_ptr(), g.ldc = N;
            g.row_sums_a = at(v, t, skip);
            return g;
          };
          G().gemm(args(dt, src, gb, out, rs));
          C().gemm(args(DType::f32, csrc, cb, cout, crs));
          if (!offset && N == 40)
            std::printf("cuBLASLt fused row_sums_a, trans_a %d (%s): %s\n", int(trans), dtype_name(dt),
                        cuda::gemm_fused(args(dt, src, gb, out, rs), stream0()) ? "yes" : "NO (separate kernels)");
          check_close(get(out), rounded(get(cout), dt), rtol(dt), tol);
          check_close(get(rs), rounded(get(crs), dt), rtol(dt), tol * 4);
        }
      }
}

TEST_CASE("softmax and log-softmax, forward and backward, match the CPU", "[gpu][kernels]") {
  const int64_t rows = 13, cols = 301;
  const auto x = randn(size_t(rows * cols), 15, 2.0f), dy = randn(size_t(rows * cols), 16);
  for (DType dt : kFloat)
    for (bool log : {false, true}) {
      INFO(dtype_name(dt) << " log " << log);
      Tensor gx = put(x, dt, gpu), gy = buffer(rows * cols, dt, gpu), gdy = put(dy, dt, gpu),
             gdx = buffer(rows * cols, dt, gpu);
      Tensor cx = put(rounded(x, dt), DType::f32, host), cy = buffer(rows * cols, DType::f32, host),
             cdy = put(rounded(dy, dt), DType::f32, host), cdx = buffer(rows * cols, DType::f32, host);
      G().softmax(dt, gy.data_ptr(), gx.data_ptr(), rows, cols, log);
      C().softmax(DType::f32, cy.data_ptr(), cx.data_ptr(), rows, cols, log);
      check_close(get(gy), rounded(get(cy), dt), rtol(dt), 1e-5);
      // backward from the same (device-rounded) y on both sides
      Tensor cy_dev = put(get(gy), DType::f32, host);
      G().softmax_backward(dt, gdx.data_ptr(), gdy.data_ptr(), gy.data_ptr(), rows, cols, log);
      C().softmax_backward(DType::f32, cdx.data_ptr(), cdy.data_ptr(), cy_dev.data_ptr(), rows, cols, log);
      check_close(get(gdx), rounded(get(cdx), dt), rtol(dt), dt == DType::f32 ? 1e-5 : 1e-2);
    }
}

// C = 97: element by element; 64 and 768 (GPT-2 small): 16-byte packs and the fused dw/db backward
// (300 rows: 10 row chunks); 1024: the smem kinds' 64 KiB of shared memory (over the 48 KiB
// default); 1280 (GPT-2 large): packs, with dw/db in a second kernel (norm_backward_fuses). Every
// place the backward can sum dw/db (cuda::set_norm_backward).
TEST_CASE("layernorm and rmsnorm, forward and backward, match the CPU", "[gpu][kernels]") {
  for (auto [rows, C_, kind] : {std::tuple{int64_t(37), int64_t(97), cuda::NormBackward::fused},
                                {37, 64, cuda::NormBackward::fused}, {29, 768, cuda::NormBackward::fused},
                                {300, 768, cuda::NormBackward::fused}, {300, 768, cuda::NormBackward::smem},
                                {300, 768, cuda::NormBackward::smem_ahead}, {300, 768, cuda::NormBackward::split},
                                {41, 1024, cuda::NormBackward::smem}, {41, 1024, cuda::NormBackward::smem_ahead},
                                {9, 1280, cuda::NormBackward::fused}}) {
    INFO("rows " << rows << " C " << C_ << " backward " << cuda::name(kind));
    cuda::set_norm_backward(kind);
    const auto x = randn(size_t(rows * C_), 17, 1.5f, 0.5f), w = randn(size_t(C_), 18, 0.2f, 1.0f),
               b = randn(size_t(C_), 19), dy = randn(size_t(rows * C_), 20);
    for (DType dt : kFloat) {
      INFO(dtype_name(dt));
      const double tol = dt == DType::f32 ? 1e-4 : 3e-2;
      Tensor gx = put(x, dt, gpu), gw = put(w, dt, gpu), gb = put(b, dt, gpu), gdy = put(dy, dt, gpu);
      Tensor cx = put(rounded(x, dt), DType::f32, host), cw = put(rounded(w, dt), DType::f32, host),
             cb = put(rounded(b, dt), DType::f32, host), cdy = put(rounded(dy, dt), DType::f32, host);
      // mean and rstd are f32 for every dtype (kernels::stats_dtype)
      Tensor gy = buffer(rows * C_, dt, gpu), gm = buffer(rows, DType::f32, gpu), gr = buffer(rows, DType::f32, gpu);
      Tensor cy = buffer(rows * C_, DType::f32, host), cm = buffer(rows, DType::f32, host),
             cr = buffer(rows, DType::f32, host);
      G().layernorm(dt, gy.data_ptr(), gm.data_ptr(), gr.data_ptr(), gx.data_ptr(), gw.data_ptr(), gb.data_ptr(), rows,
                    C_, 1e-5);
      C().layernorm(DType::f32, cy.data_ptr(), cm.data_ptr(), cr.data_ptr(), cx.data_ptr(), cw.data_ptr(),
                    cb.data_ptr(), rows, C_, 1e-5);
      check_close(get(gy), rounded(get(cy), dt), tol, tol);
      check_close(get(gm), get(cm), 1e-5, 1e-5);  // from the same (rounded) inputs, in f32 on both sides
      check_close(get(gr), get(cr), 1e-5, 1e-5);
      Tensor gdx = buffer(rows * C_, dt, gpu), gdw = buffer(C_, dt, gpu), gdb = buffer(C_, dt, gpu);
      Tensor cdx = buffer(rows * C_, DType::f32, host), cdw = buffer(C_, DType::f32, host),
             cdb = buffer(C_, DType::f32, host);
      G().layernorm_backward(dt, gdx.data_ptr(), gdw.data_ptr(), gdb.data_ptr(), gdy.data_ptr(), gx.data_ptr(),
                             gw.data_ptr(), gm.data_ptr(), gr.data_ptr(), rows, C_);
      C().layernorm_backward(DType::f32, cdx.data_ptr(), cdw.data_ptr(), cdb.data_ptr(), cdy.data_ptr(), cx.data_ptr(),
                             cw.data_ptr(), cm.data_ptr(), cr.data_ptr(), rows, C_);
      check_close(get(gdx), get(cdx), tol, tol);
      check_close(get(gdw), get(cdw), tol, 10 * tol);  // sums over 37 rows
      check_close(get(gdb), get(cdb), tol, 10 * tol);
  
      // the residual add fused in: r = x + dy as stored, then y = LayerNorm(r); backward adds dr = x
      auto plus = [](std::vector<float> a, const std::vector<float>& b) {
        for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
        return a;
      };
      Tensor gsum = buffer(rows * C_, dt, gpu), csum = put(rounded(plus(get(cx), get(cdy)), dt), DType::f32, host);
      G().residual_layernorm(dt, gsum.data_ptr(), gy.data_ptr(), gm.data_ptr(), gr.data_ptr(), gx.data_ptr(),
                             gdy.data_ptr(), gw.data_ptr(), gb.data_ptr(), rows, C_, 1e-5);
      C().layernorm(DType::f32, cy.data_ptr(), cm.data_ptr(), cr.data_ptr(), csum.data_ptr(), cw.data_ptr(),
                    cb.data_ptr(), rows, C_, 1e-5);
      check_close(get(gsum), get(csum), 0, 0);
      check_close(get(gy), rounded(get(cy), dt), tol, tol);
      G().residual_layernorm_backward(dt, gdx.data_ptr(), gdw.data_ptr(), gdb.data_ptr(), gx.data_ptr(), gdy.data_ptr(),
                                      gsum.data_ptr(), gw.data_ptr(), gm.data_ptr(), gr.data_ptr(), rows, C_);
      C().layernorm_backward(DType::f32, cdx.data_ptr(), cdw.data_ptr(), cdb.data_ptr(), cdy.data_ptr(), csum.data_ptr(),
                             cw.data_ptr(), cm.data_ptr(), cr.data_ptr(), rows, C_);
      check_close(get(gdx), plus(get(cdx), get(cx)), tol, tol);
      check_close(get(gdw), get(cdw), tol, 10 * tol);
  
      G().rmsnorm(dt, gy.data_ptr(), gr.data_ptr(), gx.data_ptr(), gw.data_ptr(), rows, C_, 1e-6);
      C().rmsnorm(DType::f32, cy.data_ptr(), cr.data_ptr(), cx.data_ptr(), cw.data_ptr(), rows, C_, 1e-6);
      check_close(get(gy), rounded(get(cy), dt), tol, tol);
      check_close(get(gr), get(cr), 1e-5, 1e-5);
      G().rmsnorm_backward(dt, gdx.data_ptr(), gdw.data_ptr(), gdy.data_ptr(), gx.data_ptr(), gw.data_ptr(),
                           gr.data_ptr(), rows, C_);
      C().rmsnorm_backward(DType::f32, cdx.data_ptr(), cdw.data_ptr(), cdy.data_ptr(), cx.data_ptr(), cw.data_ptr(),
                           cr.data_ptr(), rows, C_);
      check_close(get(gdx), get(cdx), tol, tol);
      check_close(get(gdw), get(cdw), tol, 10 * tol);
    }
  }
  cuda::set_norm_backward(cuda::NormBackward::fused);
}

TEST_CASE("embedding forward and '+=' backward match the CPU; a bad index throws", "[gpu][kernels]") {
  const int64_t n = 29, C_ = 67, rows = 50;
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = (i * 17 + 3) % rows;
  idx[5] = idx[9] = idx[20] = 7;  // repeated rows accumulate
  const auto weight = randn(size_t(rows * C_), 21);
  check_embedding(idx, C_, rows, 21, 5e-2);
  // A bad index is reported at the host's next wait for the device (a read here), not by the op.
  std::vector<int32_t> bad = {0, 3, 50, 2};
  Tensor gb = to(from_vector(bad, {4}), gpu), gw = put(weight, DType::f32, gpu), out = buffer(4 * C_, DType::f32, gpu);
  auto embed = [&](const Tensor& i) {
    G().embedding(DType::f32, DType::i32, out.data_ptr(), i.data_ptr(), gw.data_ptr(), 4, C_, rows);
  };
  REQUIRE_NOTHROW(embed(gb));
  REQUIRE_THROWS_WITH(get(out),
                      Catch::Contains("embedding (cuda): 1 of 4 indices out of range for a table of 50 rows") &&
                          Catch::Contains("found at the host's next wait for cuda:0"));
  REQUIRE_NOTHROW(get(out));  // reported once: the slots were cleared and the device still works
  Tensor good = to(from_vector(std::vector<int32_t>{0, 3, 49, 2}, {4}), gpu);
  embed(good);
  REQUIRE_NOTHROW(get(out));
  // Two failures before a wait: the first in queue order is reported, with its own count.
  Tensor worse = to(from_vector(std::vector<int32_t>{-1, 3, 50, 2}, {4}), gpu);
  embed(worse);
  embed(gb);
  REQUIRE_THROWS_WITH(get(out), Catch::Contains("2 of 4 indices out of range"));
  // More checked ops than there are slots between two waits: the op that finds every slot pending
  // waits once, and a bad index before it, or after it, is still reported.
  embed(gb);
  for (int i = 0; i < cuda::kDeferredChecks - 1; ++i) embed(good);
  REQUIRE_THROWS_WITH(embed(good), Catch::Contains("1 of 4 indices out of range"));
  for (int i = 0; i < cuda::kDeferredChecks + 10; ++i) embed(good);
  embed(worse);
  REQUIRE_THROWS_WITH(get(out), Catch::Contains("2 of 4 indices out of range"));
  // A communication thread's wait (DeviceErrorsElsewhere) leaves the failure to the next other
  // wait; any other thread's wait reports it (DataParallel's replica threads queue the forward,
  // the main thread waits).
  auto waits_in_a_thread = [&](bool comm) {
    bool threw = false;
    std::thread t([&] {
      std::optional<DeviceErrorsElsewhere> elsewhere;
      if (comm) elsewhere.emplace();
      try {
        (void)get(out);
      } catch (const Error&) {
        threw = true;
      }
    });
    t.join();
    return threw;
  };
  embed(gb);
  CHECK_FALSE(waits_in_a_thread(true));
  REQUIRE_THROWS_WITH(get(out), Catch::Contains("1 of 4 indices out of range"));
  std::thread([&] { embed(gb); }).join();
  CHECK(waits_in_a_thread(false));
  REQUIRE_NOTHROW(get(out));
  // The backward over the same bad indices skips them: the table gets the good rows' sums and
  // nothing outside it is written (a guard row on each side).
  const auto d4 = randn(size_t(4 * C_), 27);
  Tensor gd4 = put(d4, DType::f32, gpu);
  std::vector<float> want(size_t((rows + 2) * C_), 1.0f);
  Tensor gdw = put(want, DType::f32, gpu);
  float* table_rows = static_cast<float*>(gdw.data_ptr()) + C_;  // after the first guard row
  G().embedding_backward(DType::f32, DType::i32, table_rows, gd4.data_ptr(), gb.data_ptr(), 4, C_, rows);
  for (int i : {0, 1, 3})
    for (int64_t c = 0; c < C_; ++c) want[size_t((1 + bad[size_t(i)]) * C_ + c)] += d4[size_t(i * C_ + c)];
  check_close(get(gdw), want, 0, 0);
}

// Rows of 16-byte packs (C = 64), and one row taken by 12 positions: a long run of the sorted
// backward, summed by one block.
TEST_CASE("embedding on packed rows with a long run of one row matches the CPU", "[gpu][kernels]") {
  const int64_t n = 29, rows = 50;
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = i >= 10 && i < 22 ? 3 : (i * 17 + 3) % rows;
  check_embedding(idx, 64, rows, 24, 1e-1);  // 12 half-rounded terms in row 3
}

// Checks cross_entropy, its backward and the fused classifier on rows x Vp logits against the CPU.
static void check_classifier(int64_t rows, int64_t Vp, int64_t V) {
  const int64_t ignore = -100;
  const auto logits = randn(size_t(rows * Vp), 24, 2.0f), dloss = randn(size_t(rows), 25);
  std::vector<int64_t> t(rows);
  for (int64_t r = 0; r < rows; ++r) t[size_t(r)] = (r * 31 + 1) % V;
  for (int64_t r : {3, 11})
    if (r < rows) t[size_t(r)] = ignore;
  for (DType dt : kFloat) {
    INFO(dtype_name(dt) << " rows " << rows << " Vp " << Vp << " V " << V);
    const double tol = dt == DType::f32 ? 1e-5 : 2e-2;
    Tensor gt = to(from_vector(t, {rows}), gpu), ct = from_vector(t, {rows});
    Tensor gx = put(logits, dt, gpu), cx = put(rounded(logits, dt), DType::f32, host);
    // loss, lse and dloss are f32 for every dtype (kernels::stats_dtype)
    Tensor gl = buffer(rows, DType::f32, gpu), gs = buffer(rows, DType::f32, gpu), cl = buffer(rows, DType::f32, host),
           cs = buffer(rows, DType::f32, host);
    G().cross_entropy(dt, DType::i64, gl.data_ptr(), gs.data_ptr(), gx.data_ptr(), gt.data_ptr(), rows, Vp, V, ignore);
    C().cross_entropy(DType::f32, DType::i64, cl.data_ptr(), cs.data_ptr(), cx.data_ptr(), ct.data_ptr(), rows, Vp, V,
                      ignore);
    check_close(get(gl), get(cl), 1e-5, 1e-5);  // from the same (rounded) logits, in f32 on both sides
    check_close(get(gs), get(cs), 1e-5, 1e-5);
    Tensor gd = put(dloss, DType::f32, gpu), cd = put(dloss, DType::f32, host);
    Tensor gdx = buffer(rows * Vp, dt, gpu), cdx = buffer(rows * Vp, DType::f32, host);
    G().cross_entropy_backward(dt, DType::i64, gdx.data_ptr(), gd.data_ptr(), gx.data_ptr(), gs.data_ptr(),
                               gt.data_ptr(), rows, Vp, V, ignore);
    C().cross_entropy_backward(DType::f32, DType::i64, cdx.data_ptr(), cd.data_ptr(), cx.data_ptr(), cs.data_ptr(),
                               ct.data_ptr(), rows, Vp, V, ignore);
    check_close(get(gdx), rounded(get(cdx), dt), tol, dt == DType::f32 ? 1e-6 : 5e-3);
    // The fused classifier, in place over the logits, against the CPU's fused entry: the row read
    // twice (streaming) and staged in shared memory (where the row fits; else it streams).
    const double d = 0.0625;
    C().cross_entropy_fused(DType::f32, DType::i64, cl.data_ptr(), cdx.data_ptr(), cx.data_ptr(), ct.data_ptr(), d,
                            rows, Vp, V, ignore);
    for (auto kind : cuda::kClassifiers) {
      INFO("classifier " << cuda::name(kind));
      cuda::set_classifier(kind);
      Tensor gy = put(logits, dt, gpu);
      G().cross_entropy_fused(dt, DType::i64, gl.data_ptr(), gy.data_ptr(), gy.data_ptr(), gt.data_ptr(), d, rows, Vp,
                              V, ignore);
      check_close(get(gl), get(cl), 1e-5, 1e-5);
      check_close(get(gy), rounded(get(cdx), dt), tol, dt == DType::f32 ? 1e-6 : 5e-3);
    }
    cuda::set_classifier(cuda::Classifier::streaming);
  }
}

TEST_CASE("cross_entropy over a padded vocabulary, forward and backward, matches the CPU", "[gpu][kernels]") {
  check_classifier(21, 136, 129);
  check_classifier(5, 50304, 50257);  // GPT-2's: 6288 16-byte pieces of bf16/f16, 12 or 13 a thread
  check_classifier(4, 50264, 50257);
  // staged: a bf16/f16 row of 48.9-49.2 KB plus the kernel's static shared memory passes 48 KiB
  // (its launch failed when only the dynamic part decided the opt-in)
  check_classifier(3, 24568, 24500);
  const int64_t rows = 21, Vp = 136, V = 129, ignore = -100;
  const auto logits = randn(size_t(rows * Vp), 24, 2.0f);
  std::vector<int32_t> bad(size_t(rows), 1);
  bad[7] = int32_t(V);
  Tensor gb = to(from_vector(bad, {rows}), gpu), gx = put(logits, DType::f32, gpu);
  Tensor gl = buffer(rows, DType::f32, gpu), gs = buffer(rows, DType::f32, gpu);
  // Reported at the next wait for the device (reading the loss), not by the op.
  G().cross_entropy(DType::f32, DType::i32, gl.data_ptr(), gs.data_ptr(), gx.data_ptr(), gb.data_ptr(), rows, Vp, V,
                    ignore);
  REQUIRE_THROWS_WITH(get(gl), Catch::Contains("cross_entropy (cuda): 1 of 21 targets out of range [0, 129)"));
  for (auto kind : cuda::kClassifiers) {
    INFO("classifier " << cuda::name(kind));
    cuda::set_classifier(kind);
    G().cross_entropy_fused(DType::f32, DType::i32, gl.data_ptr(), gx.data_ptr(), gx.data_ptr(), gb.data_ptr(), 1.0,
                            rows, Vp, V, ignore);
    REQUIRE_THROWS_WITH(get(gl), Catch::Contains("cross_entropy (cuda): 1 of 21 targets out of range [0, 129)"));
    REQUIRE_NOTHROW(get(gl));
  }
  cuda::set_classifier(cuda::Classifier::streaming);
}

TEST_CASE("dropout and Philox fills give the CPU's numbers", "[gpu][kernels]") {
  const int64_t n = 1001;
  const auto x = randn(size_t(n), 26);
  Tensor gx = put(x, DType::f32, gpu), cx = put(x, DType::f32, host);
  Tensor go = buffer(n, DType::f32, gpu), co = buffer(n, DType::f32, host);
  G().dropout(DType::f32, go.data_ptr(), gx.data_ptr(), n, 0.3, 42, 7, n, 0);
  C().dropout(DType::f32, co.data_ptr(), cx.data_ptr(), n, 0.3, 42, 7, n, 0);
  check_close(get(go), get(co), 1e-6, 0);  // the same mask, bit for bit
  G().dropout(DType::f32, go.data_ptr(), gx.data_ptr(), n, 0.3, 42, 7, 91, 300);  // rows of 91, from index 300
  C().dropout(DType::f32, co.data_ptr(), cx.data_ptr(), n, 0.3, 42, 7, 91, 300);
  check_close(get(go), get(co), 1e-6, 0);
  G().random(DType::f32, go.data_ptr(), n, false, -2.0, 3.0, 5, 1, 100);
  C().random(DType::f32, co.data_ptr(), n, false, -2.0, 3.0, 5, 1, 100);
  REQUIRE(get(go) == get(co));
  G().random(DType::f32, go.data_ptr(), n, true, 0.5, 2.0, 5, 1, 100);
  C().random(DType::f32, co.data_ptr(), n, true, 0.5, 2.0, 5, 1, 100);
  check_close(get(go), get(co), 1e-5, 1e-5);  // device logf/cosf may differ in the last ulp
}

TEST_CASE("adamw matches the CPU over several steps", "[gpu][kernels]") {
  const int64_t n = 5003;
  const auto p = randn(size_t(n), 27), g = randn(size_t(n), 28);
  Tensor gp = put(p, DType::f32, gpu), gg = put(g, DType::f32, gpu), gm = buffer(n, DType::f32, gpu),
         gv = buffer(n, DType::f32, gpu);
  Tensor cp = put(p, DType::f32, host), cg = put(g, DType::f32, host), cm = buffer(n, DType::f32, host),
         cv = buffer(n, DType::f32, host);
  for (int64_t step = 1; step <= 3; ++step) {
    kernels::AdamWArgs a;
    a.dtype = DType::f32, a.n = n, a.lr = 1e-2, a.weight_decay = 0.1, a.grad_scale = 0.5, a.step = step;
    kernels::AdamWArgs c = a;
    a.param = gp.data_ptr(), a.grad = gg.data_ptr(), a.m = gm.data_ptr(), a.v = gv.data_ptr();
    c.param = cp.data_ptr(), c.grad = cg.data_ptr(), c.m = cm.data_ptr(), c.v = cv.data_ptr();
    G().adamw(a);
    C().adamw(c);
  }
  check_close(get(gp), get(cp), 1e-5, 1e-6);
  check_close(get(gm), get(cm), 1e-5, 1e-7);
  check_close(get(gv), get(cv), 1e-5, 1e-7);
}

TEST_CASE("adamw_many and sum_squares_many match the CPU on many tensors in one call", "[gpu][kernels]") {
  // 30 tensors (two launches of the multi-tensor kernels), one empty, weight decay on every other.
  std::vector<Tensor> gp, gg, gm, gv, cp, cg, cm, cv;
  std::vector<kernels::AdamWArgs> ga, ca;
  std::vector<const void*> gptr, cptr;
  std::vector<int64_t> ns;
  std::vector<double> w;
  for (int t = 0; t < 30; ++t) {
    const int64_t n = t == 3 ? 0 : 97 * t + 11 + (t == 8 ? 20000 : 0);
    const auto p = randn(size_t(n), 600 + t), g = randn(size_t(n), 700 + t);
    gp.push_back(put(p, DType::f32, gpu)), gg.push_back(put(g, DType::f32, gpu));
    cp.push_back(put(p, DType::f32, host)), cg.push_back(put(g, DType::f32, host));
    gm.push_back(buffer(n, DType::f32, gpu)), gv.push_back(buffer(n, DType::f32, gpu));
    cm.push_back(buffer(n, DType::f32, host)), cv.push_back(buffer(n, DType::f32, host));
    kernels::AdamWArgs a;
    a.dtype = DType::f32, a.n = n, a.lr = 1e-2, a.weight_decay = t % 2 ? 0.1 : 0.0, a.grad_scale = 0.5, a.step = 3;
    kernels::AdamWArgs c = a;
    a.param = gp[t].data_ptr(), a.grad = gg[t].data_ptr(), a.m = gm[t].data_ptr(), a.v = gv[t].data_ptr();
    c.param = cp[t].data_ptr(), c.grad = cg[t].data_ptr(), c.m = cm[t].data_ptr(), c.v = cv[t].data_ptr();
    ga.push_back(a), ca.push_back(c);
    gptr.push_back(gg[t].data_ptr()), cptr.push_back(cg[t].data_ptr()), ns.push_back(n), w.push_back(t % 5 ? 1.0 : 0.0);
  }
  G().adamw_many(ga.data(), int64_t(ga.size()));
  C().adamw_many(ca.data(), int64_t(ca.size()));
  for (size_t t = 0; t < gp.size(); ++t) {
    INFO("tensor " << t);
    check_close(get(gp[t]), get(cp[t]), 1e-5, 1e-6);
    check_close(get(gv[t]), get(cv[t]), 1e-5, 1e-7);
  }
  const double got = G().sum_squares_many(DType::f32, gptr.data(), ns.data(), w.data(), int64_t(ns.size()));
  const double want = C().sum_squares_many(DType::f32, cptr.data(), ns.data(), w.data(), int64_t(ns.size()));
  CHECK(got == Approx(want).epsilon(1e-5));
  CHECK(got == G().sum_squares_many(DType::f32, gptr.data(), ns.data(), w.data(), int64_t(ns.size())));  // same bits
}

// Mixed precision through optim::AdamW on cuda:0 against the CPU: f32 masters, the model's bf16
// or f16 gradients read as they are, and the model's weights written in the update's own pass.
TEST_CASE("AdamW with half gradients and half copies on cuda:0 matches the CPU", "[gpu][kernels]") {
  for (DType half : {DType::bf16, DType::f16}) {
    INFO(dtype_name(half));
    const int64_t n = 61 * 82;
    auto run = [&](Device dev) {
      Tensor w = to(from_vector(randn(size_t(n), 95), {61, 82}), dev), b = to(from_vector(randn(37, 96), {37}), dev);
      w.set_requires_grad(true), b.set_requires_grad(true);
      Tensor cw = to(w, half), cb = to(b, half);
      optim::AdamWConfig cfg;
      cfg.weight_decay = 0.1;
      optim::AdamW opt({{"w", w}, {"b", b}}, cfg);
      opt.set_copies({cw, cb});
      for (int s = 0; s < 3; ++s) {
        w.set_grad(to(to(from_vector(randn(size_t(n), 97 + s), {61, 82}), half), dev));
        b.set_grad(to(to(from_vector(randn(37, 99 + s), {37}), half), dev));
        opt.step(1e-2, 0.5);
      }
      return std::vector<std::vector<float>>{get(w), get(b), get(cw), get(cb)};
    };
    const auto cpu = run(host), dev = run(gpu);
    for (size_t i = 0; i < cpu.size(); ++i) {
      INFO("result " << i);
      check_close(dev[i], cpu[i], i < 2 ? 1e-5 : 1e-2, i < 2 ? 1e-6 : 1e-3);
    }
  }
}

TEST_CASE("pinned host tensors are page-locked, cached, and carry data to and from the device", "[gpu][kernels]") {
  (void)G();  // brings the CUDA backend up, which registers the pinned allocator
  REQUIRE(pinned_allocator() != nullptr);
  void* first = nullptr;
  {
    Tensor h = Tensor::empty_pinned({1000}, DType::f32);
    REQUIRE(h.storage()->pinned());
    cudaPointerAttributes at{};
    REQUIRE(cudaPointerGetAttributes(&at, h.data_ptr()) == cudaSuccess);
    CHECK(at.type == cudaMemoryTypeHost);
    first = h.data_ptr();
    const auto v = randn(1000, 90);
    copy_(h, from_vector(v, {1000}));
    Tensor d = to(h, gpu);
    Tensor back = Tensor::empty_pinned({1000}, DType::f32);
    copy_(back, mul(d, 2.0));
    const auto got = to_vector<float>(back);
    for (size_t i = 0; i < v.size(); ++i) REQUIRE(got[i] == 2.0f * v[i]);
  }  // back, then h, go back to the cache; the last one in is the first one out
  Tensor again = Tensor::empty_pinned({1000}, DType::f32);
  CHECK(again.data_ptr() == first);
}

TEST_CASE("ops on views at an offset into a block find their device without a driver query", "[gpu][kernels]") {
  // device_of answers from the caching allocator's block map, interior pointers included.
  Tensor x = put(randn(4096, 91), DType::f32, gpu);
  Tensor v = narrow(x, 0, 1234, 1000);
  CHECK(cuda::device_of(v.data_ptr(), "test") == gpu);
  check_close(get(mul(v, 3.0)), get(mul(narrow(to(x, host), 0, 1234, 1000), 3.0)), 0, 0);
  int local = 0;
  CHECK_THROWS_WITH(cuda::device_of(&local, "test op"), Catch::Contains("test op (cuda): pointer"));
}

// T = 77: two query blocks and a ragged tail at every head dim; T = 1024 (GPT-2's) on the tensor
// cores: many key tiles per query block, causal tiles off the diagonal.
TEST_CASE("flash attention, causal or not, forward and backward, matches the CPU", "[gpu][kernels]") {
  for (int64_t T : {77, 1024})
  for (int64_t D : {8, 16, 32, 64, 128})  // bf16 and f16 at 64 and 128: the tensor-core kernels
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (bool causal : {true, false}) {
      if (T > 77 && (D < 64 || dt != DType::bf16)) continue;
      const int64_t B = T > 77 ? 1 : 2, H = T > 77 ? 2 : 3;
      INFO(dtype_name(dt) << " T " << T << " D " << D << (causal ? " causal" : " full"));
      // f16 keeps 3 more mantissa bits than bf16: a bound 6x tighter (2^3 = 8, less some headroom).
      const double tol = dt == DType::f32 ? 2e-4 : dt == DType::bf16 ? 3e-2 : 5e-3;
      const size_t n = size_t(B * H * T * D);
      const auto q = randn(n, 29), k = randn(n, 30), v = randn(n, 31), dout = randn(n, 32);
      Tensor gq = put(q, dt, gpu), gk = put(k, dt, gpu), gv = put(v, dt, gpu), gdo = put(dout, dt, gpu);
      Tensor cq = put(rounded(q, dt), DType::f32, host), ck = put(rounded(k, dt), DType::f32, host),
             cv = put(rounded(v, dt), DType::f32, host), cdo = put(rounded(dout, dt), DType::f32, host);
      Tensor go = buffer(int64_t(n), dt, gpu), gl = buffer(B * H * T, DType::f32, gpu);  // lse: f32 for every dtype
      Tensor co = buffer(int64_t(n), DType::f32, host), cl = buffer(B * H * T, DType::f32, host);
      Tensor gdq = buffer(int64_t(n), dt, gpu), gdk = buffer(int64_t(n), dt, gpu), gdv = buffer(int64_t(n), dt, gpu);
      Tensor cdq = buffer(int64_t(n), DType::f32, host), cdk = buffer(int64_t(n), DType::f32, host),
             cdv = buffer(int64_t(n), DType::f32, host);
      kernels::AttentionArgs a;
      a.dtype = dt, a.B = B, a.H = H, a.T = T, a.D = D, a.causal = causal, a.scale = 1.0 / std::sqrt(double(D));
      kernels::AttentionArgs c = a;
      c.dtype = DType::f32;
      a.q = gq.data_ptr(), a.k = gk.data_ptr(), a.v = gv.data_ptr(), a.out = go.data_ptr(), a.lse = gl.data_ptr();
      a.dout = gdo.data_ptr(), a.dq = gdq.data_ptr(), a.dk = gdk.data_ptr(), a.dv = gdv.data_ptr();
      c.q = cq.data_ptr(), c.k = ck.data_ptr(), c.v = cv.data_ptr(), c.out = co.data_ptr(), c.lse = cl.data_ptr();
      c.dout = cdo.data_ptr(), c.dq = cdq.data_ptr(), c.dk = cdk.data_ptr(), c.dv = cdv.data_ptr();
      C().attention(c);
      // each key tile of the tensor-core forward (cuda::set_flash_forward_kind; 64 keys at head dim
      // 64 only), into NaN: the 32-key one, whose out and lse the backward then reads, last
      for (const auto kind : {cuda::FlashForward::keys64, cuda::FlashForward::keys32}) {
        INFO("forward variant " << cuda::name(kind));
        cuda::set_flash_forward_kind(kind);
        fill_(go, std::numeric_limits<double>::quiet_NaN());
        fill_(gl, std::numeric_limits<double>::quiet_NaN());
        G().attention(a);
        check_close(get(go), rounded(get(co), dt), tol, tol);
        check_close(get(gl), get(cl), tol, tol);
      }
      C().attention_backward(c);
      // each register budget of the tensor-core backward (cuda::set_flash_backward_kind): the same bits
      std::vector<float> first[3];
      for (const auto kind : {cuda::FlashBackward::free, cuda::FlashBackward::dq_three, cuda::FlashBackward::three}) {
        INFO("variant " << cuda::name(kind));
        cuda::set_flash_backward_kind(kind);
        for (Tensor* g : {&gdq, &gdk, &gdv}) fill_(*g, std::numeric_limits<double>::quiet_NaN());
        G().attention_backward(a);  // from the forward's own out and lse
        const std::vector<float> got[3] = {get(gdq), get(gdk), get(gdv)};
        check_close(got[0], get(cdq), tol, tol);
        check_close(got[1], get(cdk), tol, tol);
        check_close(got[2], get(cdv), tol, tol);
        if (kind == cuda::FlashBackward::free) {
          for (int i = 0; i < 3; ++i) first[i] = got[i];
        } else {
          for (int i = 0; i < 3; ++i) CHECK(got[i] == first[i]);
        }
      }
      cuda::set_flash_backward_kind(cuda::FlashBackward::free);
    }
}

// sg::attention_qkv: the kernels read q, k, v in place from the packed [B, T, 3C] projection and
// write y as [B, T, C] and d(qkv) as one packed buffer (AttentionArgs' strides). On cuda:0 against
// the CPU, through autograd, on the flash kernels (FMA at D = 32, tensor cores at D = 64 and 128) and cuDNN,
// whose strided plans are also bypassed once (staged: the op table's contiguous copies, the path a
// cuDNN that refuses these strides takes).
TEST_CASE("attention_qkv on packed projections matches the CPU, forward and backward", "[gpu][kernels]") {
  const int64_t B = 2, T = 77;
  for (int64_t D : {32, 64, 128})
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int path : {0, 1, 2}) {  // flash, cudnn, cudnn staged
        const bool cudnn = path > 0;
        if (cudnn && (dt == DType::f32 || D != 64)) continue;
#ifndef SG_WITH_CUDNN
        if (cudnn) continue;
#endif
        INFO(dtype_name(dt) << " D " << D << (path == 0 ? " flash" : path == 1 ? " cudnn" : " cudnn staged"));
        const int64_t H = 3, C = H * D;
        const double tol = dt == DType::f32 ? 2e-4 : dt == DType::bf16 ? 3e-2 : 5e-3;
        const auto x = randn(size_t(B * T * 3 * C), 51), w = randn(size_t(B * T * C), 52);
        auto run = [&](Device dev) {
          const DType t = dev.is_cuda() ? dt : DType::f32;
          Tensor qkv = reshape(put(dev.is_cuda() ? x : rounded(x, dt), t, dev), {B, T, 3 * C});
          qkv.set_requires_grad(true);
          autograd::Tape tape;
          Tensor y;
          {
            autograd::TapeScope scope(tape);
            y = attention_qkv(qkv, H);
          }
          Tensor dy = reshape(put(dev.is_cuda() ? w : rounded(w, dt), t, dev), {B, T, C});
          tape.backward({y}, {dy});
          return std::pair{get(y), get(qkv.grad())};
        };
        const auto cpu = run(host);
        if (cudnn) cuda::set_attention_backend(cuda::AttentionBackend::cudnn);
#ifdef SG_WITH_CUDNN
        cuda::force_cudnn_contiguous_layouts(path == 2);
#endif
        const auto dev = run(gpu);
#ifdef SG_WITH_CUDNN
        if (path == 1) {  // whether that ran in place or on copies: a speed question, said for the log
          kernels::AttentionArgs a;
          a.dtype = dt, a.B = B, a.H = H, a.T = T, a.D = D, a.scale = 1.0 / std::sqrt(double(D));
          a.q_strides[0] = 3 * T * C, a.q_strides[1] = D, a.q_strides[2] = 3 * C;
          a.o_strides[0] = T * C, a.o_strides[1] = D, a.o_strides[2] = C;
          std::printf("cuDNN plans for packed q/k/v strides (%s): forward %s, backward %s\n", dtype_name(dt),
                      cuda::cudnn_attention_takes_layout(a, gpu, false) ? "yes" : "NO (copies)",
                      cuda::cudnn_attention_takes_layout(a, gpu, true) ? "yes" : "NO (copies)");
        }
#endif
        cuda::set_attention_backend(cuda::AttentionBackend::flash);
#ifdef SG_WITH_CUDNN
        cuda::force_cudnn_contiguous_layouts(false);
#endif
        check_close(dev.first, rounded(cpu.first, dt), tol, tol);
        check_close(dev.second, cpu.second, tol, tol);
      }
}

TEST_CASE("the op profiler gives each CUDA entry's stream time; the entries' times add up to the stream's", "[gpu][kernels]") {
  // Three f32 GEMMs of 2 x 2048^3 FLOPs and one fill of 16 MB, queued back to back: the GPU is
  // behind the host throughout, so the spans between the profiler's events cover the stream's
  // time between two outer marks, and the GEMMs take most of it.
  const int64_t n = 2048;
  Tensor a = put(randn(size_t(n * n), 1), DType::f32, gpu), b = put(randn(size_t(n * n), 2), DType::f32, gpu),
         c = buffer(n * n, DType::f32, gpu);
  kernels::GemmArgs g;
  g.dtype = DType::f32, g.M = n, g.N = n, g.K = n, g.lda = n, g.ldb = n, g.ldc = n;
  g.A = a.data_ptr(), g.B = b.data_ptr(), g.C = c.data_ptr();
  G().gemm(g);  // the heuristic's answer and the workspace, outside the window
  cuda::sync(gpu);
  cuda::StreamMarks outer(gpu);
  std::map<std::string, kernels::OpTime> ops;
  float window = 0;
  {
    kernels::OpProfiler profiler(gpu);
    const int first = outer.mark();
    for (int i = 0; i < 3; ++i) G().gemm(g);
    G().fill(c.data_ptr(), DType::f32, n * n, 0.0);
    const int last = outer.mark();
    ops = profiler.take();
    window = outer.elapsed_ms(first, last);
  }
  REQUIRE(ops.size() == 2);
  CHECK(ops["gemm"].calls == 3);
  CHECK(ops["fill"].calls == 1);
  CHECK(ops["gemm"].flops == 3 * 2 * double(n) * double(n) * double(n));
  const double sum = ops["gemm"].device_ms + ops["fill"].device_ms;
  std::printf("op profiler: 3 f32 GEMMs %.3f ms, fill %.3f ms on the stream (host %.3f + %.3f ms); window %.3f ms\n",
              ops["gemm"].device_ms, ops["fill"].device_ms, ops["gemm"].host_ms, ops["fill"].host_ms, window);
  CHECK(ops["gemm"].device_ms > ops["fill"].device_ms);
  CHECK(ops["fill"].device_ms > 0);
  CHECK(sum <= window * 1.001 + 1e-3);
  CHECK(sum >= 0.9 * window);
  CHECK(get(c) == std::vector<float>(size_t(n * n), 0.0f));  // the wrapped fill did its work
}

#endif  // SG_CUDA_KERNELS

int main(int argc, char** argv) {
#ifndef SG_CUDA_KERNELS
  std::printf("built without SG_CUDA_KERNELS: the CUDA kernel tests are skipped\n");
  return 77;
#else
  if (sg::cuda::device_count() == 0) {
    std::printf("no CUDA device: the CUDA kernel tests are skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
#endif
}
