// Flash attention (kernels/cuda/attention.cuh, attention_tc.cuh) under emulation against the CPU
// table's attention: FMA kernels at head dims 8 to 128, f32, bf16 and f16; tensor-core forward and
// backward at 64 and 128, bf16 and f16; sequence lengths that are not a multiple of the tiles; q, k,
// v contiguous or packed in one [B, T, 3 H D] projection with out [B, T, H D] (AttentionArgs' strides).
// The op table's choice between the families and its contiguous detour (attention_any.cuh) too.
// Tolerances scale with the storage type's precision (tol<T>() in support.h: f16's is 8 times
// tighter than bf16's, 2^3 for its 3 more mantissa bits).
#include "tests/catch.h"
#include <limits>
#include <tuple>

#include "kernels/cuda/attention_any.cuh"
#include "tests/emu/support.h"

using namespace sg;
using namespace sg::emu_testing;

namespace {

// One attention problem: random inputs representable in T, the CPU table's f32 forward and
// backward on them (the reference), and the same inputs and output buffers in storage type T for
// a kernel, with the arguments for both sides. All contiguous [B, H, T, D].
template <class T>
struct AttentionCase {
  std::vector<float> q, k, v, dout, out_ref, lse_ref, dq_ref, dk_ref, dv_ref;
  std::vector<T> qs, ks, vs, dos, out, dq, dk, dv;
  std::vector<float> lse;
  kernels::AttentionArgs ref, g;
  AttentionCase(int64_t Tn, int64_t D, bool causal, uint32_t seed, int64_t B = 1, int64_t H = 2) {
    const int64_t n = B * H * Tn * D;
    q = rounded<T>(randn(size_t(n), seed)), k = rounded<T>(randn(size_t(n), seed + 1));
    v = rounded<T>(randn(size_t(n), seed + 2)), dout = rounded<T>(randn(size_t(n), seed + 3));
    out_ref.resize(size_t(n)), lse_ref.resize(size_t(B * H * Tn)), dq_ref.resize(size_t(n));
    dk_ref.resize(size_t(n)), dv_ref.resize(size_t(n));
    ref.dtype = DType::f32, ref.B = B, ref.H = H, ref.T = Tn, ref.D = D, ref.causal = causal;
    ref.scale = 1.0 / std::sqrt(double(D));
    ref.q = q.data(), ref.k = k.data(), ref.v = v.data(), ref.out = out_ref.data(), ref.lse = lse_ref.data();
    ref.dout = dout.data(), ref.dq = dq_ref.data(), ref.dk = dk_ref.data(), ref.dv = dv_ref.data();
    cpu::attention(ref);
    cpu::attention_backward(ref);

    qs = to_storage<T>(q), ks = to_storage<T>(k), vs = to_storage<T>(v), dos = to_storage<T>(dout);
    out.resize(size_t(n)), dq.resize(size_t(n)), dk.resize(size_t(n)), dv.resize(size_t(n));
    lse.resize(size_t(B * H * Tn));
    g = ref;
    g.dtype = dtype_of<T>();
    g.q = qs.data(), g.k = ks.data(), g.v = vs.data(), g.out = out.data(), g.lse = lse.data();
    g.dout = dos.data(), g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
  }
  std::vector<float> workspace() const { return std::vector<float>(size_t(cu::attention_backward_workspace(g))); }
};

// An AttentionCase's inputs as a GPT passes them: q, k, v the three parts of one packed
// [B, T, 3, H, D] projection (q_strides (3 T H D, D, 3 H D)), dq, dk, dv the three parts of one
// gradient buffer of that shape, out and dout [B, T, H, D] (o_strides (T H D, D, H D)). The outputs
// start as NaN, so an element no kernel writes fails the comparison; unpack() gathers one part of a
// packed buffer back into contiguous [B, H, T, D], element by element, for the reference's order.
template <class T>
struct PackedAttention {
  int64_t B, H, Tn, D;
  std::vector<T> qkv, dqkv, out, dout;
  std::vector<float> lse;
  kernels::AttentionArgs g;
  explicit PackedAttention(const AttentionCase<T>& c) : B(c.g.B), H(c.g.H), Tn(c.g.T), D(c.g.D) {
    const T nan = cu::from_f32<T>(std::numeric_limits<float>::quiet_NaN());
    const size_t n = size_t(B * H * Tn * D);
    qkv.assign(3 * n, nan), dqkv.assign(3 * n, nan), out.assign(n, nan), dout.assign(n, nan);
    lse.assign(size_t(B * H * Tn), std::numeric_limits<float>::quiet_NaN());
    pack(qkv, 3, 0, c.qs), pack(qkv, 3, 1, c.ks), pack(qkv, 3, 2, c.vs), pack(dout, 1, 0, c.dos);
    const int64_t HD = H * D;
    g = c.g;
    g.q = qkv.data(), g.k = qkv.data() + HD, g.v = qkv.data() + 2 * HD;
    g.dq = dqkv.data(), g.dk = dqkv.data() + HD, g.dv = dqkv.data() + 2 * HD;
    g.out = out.data(), g.dout = dout.data(), g.lse = lse.data();
    g.q_strides[0] = 3 * Tn * HD, g.q_strides[1] = D, g.q_strides[2] = 3 * HD;
    g.o_strides[0] = Tn * HD, g.o_strides[1] = D, g.o_strides[2] = HD;
  }
  // Element (b, h, t, d) of part p of a [B, T, parts, H, D] buffer, and the same of [B, H, T, D].
  size_t packed_at(int parts, int p, int64_t b, int64_t h, int64_t t, int64_t d) const {
    return size_t(((b * Tn + t) * parts + p) * H * D + h * D + d);
  }
  size_t contiguous_at(int64_t b, int64_t h, int64_t t, int64_t d) const {
    return size_t(((b * H + h) * Tn + t) * D + d);
  }
  template <class F>
  void each(F&& f) const {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < Tn; ++t)
          for (int64_t d = 0; d < D; ++d) f(b, h, t, d);
  }
  void pack(std::vector<T>& dst, int parts, int p, const std::vector<T>& src) const {
    each([&](auto b, auto h, auto t, auto d) {
      dst[packed_at(parts, p, b, h, t, d)] = src[contiguous_at(b, h, t, d)];
    });
  }
  std::vector<T> unpack(const std::vector<T>& src, int parts, int p) const {
    std::vector<T> dst(size_t(B * H * Tn * D));
    each([&](auto b, auto h, auto t, auto d) {
      dst[contiguous_at(b, h, t, d)] = src[packed_at(parts, p, b, h, t, d)];
    });
    return dst;
  }
  std::vector<float> workspace() const { return std::vector<float>(size_t(cu::attention_backward_workspace(g))); }
};

// The tensor-core bounds' absolute part (in units of tol<E>()), tightened for f16 so that P or dS
// rounded to bf16 instead of f16 as mma operands fails: at these seeds that mistake exceeds the
// tightened bound in every causal case (by up to 1.7x), while the f16 kernels stay under 0.53 of it.
template <class E>
constexpr double tc_scale(double bf16_scale) {
  return std::is_same_v<E, cu::f16> ? 0.3 * bf16_scale : bf16_scale;
}

}  // namespace

TEMPLATE_TEST_CASE("emu causal flash attention forward and backward match the CPU table", "[emu]", float, cu::bf16,
                   cu::f16) {
  using T = TestType;
  for (auto [Tn, D] : {std::pair<int64_t, int64_t>{37, 64}, {70, 64}, {37, 128}, {37, 8}, {70, 16}, {37, 32}}) {
    INFO("T " << Tn << " D " << D);
    AttentionCase<T> c(Tn, D, true, 60);
    cu::attention_forward(c.g, nullptr);
    check_close(c.out, c.out_ref, 2.0);
    check_close(c.lse, c.lse_ref, 1e-5, 1e-5);
    auto work = c.workspace();
    cu::attention_backward(c.g, work.data(), nullptr);
    check_close(c.dq, c.dq_ref, 4.0);
    check_close(c.dk, c.dk_ref, 4.0);
    check_close(c.dv, c.dv_ref, 4.0);
  }
}

// B = 2, H = 3 so that a wrong (b, h) split of the grid's head index fails, T = 77 ends inside a
// tile; out's layout differs from q's, so using one family's strides for the other fails too.
TEMPLATE_TEST_CASE("emu flash attention reads q, k, v from a packed [B, T, 3 H D] projection and writes out "
                   "[B, T, H D] and dq, dk, dv into a packed gradient",
                   "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  for (auto [D, causal] : {std::pair<int64_t, bool>{16, true}, {64, true}, {128, true}, {32, false}}) {
    INFO("D " << D << " causal " << causal);
    const AttentionCase<T> c(77, D, causal, 70, 2, 3);
    PackedAttention<T> p(c);
    cu::attention_forward(p.g, nullptr);
    check_close(p.unpack(p.out, 1, 0), c.out_ref, 2.0);
    check_close(p.lse, c.lse_ref, 1e-5, 1e-5);
    auto work = p.workspace();
    cu::attention_backward(p.g, work.data(), nullptr);
    check_close(p.unpack(p.dqkv, 3, 0), c.dq_ref, 4.0);
    check_close(p.unpack(p.dqkv, 3, 1), c.dk_ref, 4.0);
    check_close(p.unpack(p.dqkv, 3, 2), c.dv_ref, 4.0);
  }
}

TEST_CASE("emu flash attention refuses a head dim it has no kernel for", "[emu]") {
  kernels::AttentionArgs a;
  a.dtype = DType::f32, a.B = 1, a.H = 1, a.T = 4, a.D = 48;
  REQUIRE_THROWS_WITH(cu::attention_forward(a, nullptr), Catch::Contains("head dim 48"));
}

// The tensor-core forward (kernels/cuda/attention_tc.cuh): bf16 and f16, head dims 64 and 128,
// lengths that end inside a key tile (32 or 64 keys: FlashForward) and inside a 64-row block,
// causal and not. T = 150 gives three query blocks (taken last first), each with key tiles wholly
// below the diagonal (no mask), across it, and past the end. The outputs start as NaN each time.
TEMPLATE_TEST_CASE("emu tensor-core flash attention forward (mma m16n8k16) matches the CPU table", "[emu]", cu::bf16,
                   cu::f16) {
  using E = TestType;
  for (auto [Tn, D, causal] : {std::tuple<int64_t, int64_t, bool>{37, 64, true}, {70, 64, true}, {37, 128, true},
                               {70, 128, true}, {45, 64, false}, {150, 64, true}, {150, 64, false}}) {
    AttentionCase<E> c(Tn, D, causal, 90);
    for (const auto kind : {cu::FlashForward::keys32, cu::FlashForward::keys64}) {
      INFO("T " << Tn << " D " << D << " causal " << causal << " variant " << cu::name(kind));
      std::fill(c.out.begin(), c.out.end(), cu::from_f32<E>(std::numeric_limits<float>::quiet_NaN()));
      std::fill(c.lse.begin(), c.lse.end(), std::numeric_limits<float>::quiet_NaN());
      cu::attention_forward_tensor_cores(c.g, nullptr, kind);
      check_close(c.out, c.out_ref, tc_scale<E>(2.0));  // P V takes P rounded to E, as FlashAttention-2 does
      check_close(c.lse, c.lse_ref, 1e-5, 1e-5);
    }
  }
}

// The tensor-core backward (dk/dv per key block, dq per query block) against the CPU's f32
// gradients of the same bf16 or f16 inputs; P and dS are rounded to E as mma operands, hence the
// looser bound than the forward's. Head dim 128 runs 16-wide tiles (kTcBackwardTile), 64 runs
// 32-wide ones: both over lengths ending inside a tile, causal and not, and several blocks (T =
// 100 and 150: two and three).
TEMPLATE_TEST_CASE("emu tensor-core flash attention backward (mma m16n8k16) matches the CPU table", "[emu]", cu::bf16,
                   cu::f16) {
  using E = TestType;
  for (auto [Tn, D, causal] : {std::tuple<int64_t, int64_t, bool>{37, 64, true}, {70, 64, true}, {70, 128, true},
                               {45, 64, false}, {45, 128, false}, {150, 64, true}, {100, 128, true}}) {
    AttentionCase<E> c(Tn, D, causal, 93);
    auto work = c.workspace();
    cu::attention_forward_tensor_cores(c.g, nullptr);
    std::vector<E> first[3];  // dq, dk, dv of the first variant
    for (const auto kind : {cu::FlashBackward::free, cu::FlashBackward::dq_three, cu::FlashBackward::three}) {
      INFO("T " << Tn << " D " << D << " causal " << causal << " variant " << cu::name(kind));
      for (auto* g : {&c.dq, &c.dk, &c.dv})  // NaN where a variant writes nothing
        std::fill(g->begin(), g->end(), cu::from_f32<E>(std::numeric_limits<float>::quiet_NaN()));
      cu::attention_backward_tensor_cores(c.g, work.data(), nullptr, kind);
      check_close(c.dv, c.dv_ref, tc_scale<E>(4.0));
      check_close(c.dk, c.dk_ref, tc_scale<E>(4.0));
      check_close(c.dq, c.dq_ref, tc_scale<E>(4.0));
      if (kind == cu::FlashBackward::free) {
        first[0] = c.dq, first[1] = c.dk, first[2] = c.dv;
      } else {  // the same arithmetic, in fewer registers: the same bits
        CHECK(to_float(c.dq) == to_float(first[0]));
        CHECK(to_float(c.dk) == to_float(first[1]));
        CHECK(to_float(c.dv) == to_float(first[2]));
      }
    }
  }
}

// The packed GPT layout of the FMA test above through the tensor-core forward and backward (causal,
// as a GPT runs it; the contiguous tests above cover the non-causal masking).
TEMPLATE_TEST_CASE("emu tensor-core flash attention reads a packed [B, T, 3 H D] projection and writes out "
                   "[B, T, H D] and a packed gradient",
                   "[emu]", cu::bf16, cu::f16) {
  using E = TestType;
  for (int64_t D : {64, 128}) {
    INFO("D " << D);
    const AttentionCase<E> c(77, D, true, 95, 2, 3);
    PackedAttention<E> p(c);
    cu::attention_forward_tensor_cores(p.g, nullptr);
    check_close(p.unpack(p.out, 1, 0), c.out_ref, tc_scale<E>(2.0));
    check_close(p.lse, c.lse_ref, 1e-5, 1e-5);
    auto work = p.workspace();
    cu::attention_backward_tensor_cores(p.g, work.data(), nullptr);
    check_close(p.unpack(p.dqkv, 3, 0), c.dq_ref, tc_scale<E>(4.0));
    check_close(p.unpack(p.dqkv, 3, 1), c.dk_ref, tc_scale<E>(4.0));
    check_close(p.unpack(p.dqkv, 3, 2), c.dv_ref, tc_scale<E>(4.0));
  }
}

// q, k, v, out and dout one element past a 16-byte boundary: the tiles are staged element by
// element instead of in 16-byte pieces (attention_tc.cuh's TileCopy), with the same results.
TEMPLATE_TEST_CASE("emu tensor-core flash attention on inputs that are not 16-byte aligned", "[emu]", cu::bf16,
                   cu::f16) {
  using E = TestType;
  AttentionCase<E> c(70, 64, true, 97, 1, 2);
  // Each buffer shifted by one element inside a copy with one element in front.
  const auto shifted = [](const std::vector<E>& v) {
    std::vector<E> s(v.size() + 1, cu::from_f32<E>(0.0f));
    std::copy(v.begin(), v.end(), s.begin() + 1);
    return s;
  };
  auto q = shifted(c.qs), k = shifted(c.ks), v = shifted(c.vs), dout = shifted(c.dos);
  auto out = shifted(c.out), dq = shifted(c.dq), dk = shifted(c.dk), dv = shifted(c.dv);
  c.g.q = q.data() + 1, c.g.k = k.data() + 1, c.g.v = v.data() + 1, c.g.dout = dout.data() + 1;
  c.g.out = out.data() + 1, c.g.dq = dq.data() + 1, c.g.dk = dk.data() + 1, c.g.dv = dv.data() + 1;
  REQUIRE(!cu::aligned16(c.g.q));
  cu::attention_forward_tensor_cores(c.g, nullptr);
  auto work = c.workspace();
  cu::attention_backward_tensor_cores(c.g, work.data(), nullptr);
  const auto part = [](const std::vector<E>& s) { return std::vector<E>(s.begin() + 1, s.end()); };
  check_close(part(out), c.out_ref, tc_scale<E>(2.0));
  check_close(c.lse, c.lse_ref, 1e-5, 1e-5);
  check_close(part(dq), c.dq_ref, tc_scale<E>(4.0));
  check_close(part(dk), c.dk_ref, tc_scale<E>(4.0));
  check_close(part(dv), c.dv_ref, tc_scale<E>(4.0));
}

TEST_CASE("emu tensor-core flash attention refuses f32 and a scale that is not positive, naming them", "[emu]") {
  kernels::AttentionArgs a;
  a.dtype = DType::f32, a.B = 1, a.H = 1, a.T = 4, a.D = 64, a.scale = 0.125;
  REQUIRE_THROWS_WITH(cu::attention_forward_tensor_cores(a, nullptr), Catch::Contains("f32"));
  a.dtype = DType::bf16, a.scale = -0.125;  // the forward keeps the running max of the unscaled scores
  REQUIRE_THROWS_WITH(cu::attention_forward_tensor_cores(a, nullptr),
                      Catch::Contains("attention (tensor cores): scale -0.125 must be > 0"));
}

namespace {
// Each block writes where query_block / key_block put it: (head, first row) at its launch position
// (x + y gridDim.x, x fastest, the order in which the hardware hands blocks out).
__global__ void block_order_kernel(int64_t* out, bool causal, bool keys) {
  if (threadIdx.x != 0) return;
  const cu::RowBlock b = keys ? cu::key_block(causal) : cu::query_block(causal);
  const int64_t at = int64_t(blockIdx.x) + int64_t(blockIdx.y) * gridDim.x;
  out[2 * at] = b.bh, out[2 * at + 1] = b.row0;
}
}  // namespace

TEST_CASE("emu tensor-core attention grids take causal blocks heaviest first across heads, each block once",
          "[emu]") {
  const int64_t blocks = 5, heads = 3, T = blocks * cu::kTcRows;
  for (const bool keys : {false, true})
    for (const bool causal : {false, true}) {
      INFO((keys ? "key blocks (dk/dv)" : "query blocks (forward, dq)") << (causal ? ", causal" : ""));
      std::vector<int64_t> out(size_t(2 * blocks * heads), -1);
      cu::launch(block_order_kernel, dim3(unsigned(blocks), unsigned(heads)), dim3(32), 0, nullptr, out.data(), causal,
                 keys);
      std::vector<int> seen(size_t(blocks * heads), 0);
      // A block's work: the keys a query block sees, the queries that see a key block (causal).
      const auto work = [&](int64_t row0) { return keys ? T - row0 : row0 + cu::kTcRows; };
      for (int64_t i = 0; i < blocks * heads; ++i) {
        const int64_t bh = out[size_t(2 * i)], row0 = out[size_t(2 * i + 1)];
        REQUIRE(bh >= 0);
        REQUIRE(bh < heads);
        REQUIRE(row0 % cu::kTcRows == 0);
        REQUIRE(row0 >= 0);
        REQUIRE(row0 < T);
        ++seen[size_t(bh * blocks + row0 / cu::kTcRows)];
        if (!causal) {
          CHECK(bh == i / blocks);  // (x, y) as launched
          CHECK(row0 == i % blocks * cu::kTcRows);
        } else if (i > 0) {
          CHECK(work(row0) <= work(out[size_t(2 * i - 1)]));  // never heavier than the block before
        }
      }
      CHECK(seen == std::vector<int>(size_t(blocks * heads), 1));
      if (causal) CHECK(work(out[1]) == T);  // the first block is a heaviest one
    }
}

// The op table's choice (attention_any.cuh): bf16 and f16 at head dim 64 or 128 take the tensor
// cores where the device has mma.sync, the rest the FMA kernels. The two families round
// differently, so the bits tell which one ran.
TEST_CASE("emu attention takes the tensor cores exactly where they apply", "[emu]") {
  AttentionCase<cu::bf16> c(70, 64, true, 99);
  auto work = c.workspace();
  const auto forward = [&](auto&& kernel) {
    kernel();
    return to_float(c.out);
  };
  const auto backward = [&](auto&& kernel) {
    kernel();
    std::vector<float> all = to_float(c.dq), dk = to_float(c.dk), dv = to_float(c.dv);
    all.insert(all.end(), dk.begin(), dk.end());
    all.insert(all.end(), dv.begin(), dv.end());
    return all;
  };
  const auto fk = cu::FlashForward::keys32;
  const auto bk = cu::FlashBackward::free;
  const auto tc = forward([&] { cu::attention_forward_tensor_cores(c.g, nullptr, fk); });
  const auto fma = forward([&] { cu::attention_forward(c.g, nullptr); });
  REQUIRE(tc != fma);  // else the bits could not tell the families apart
  CHECK(forward([&] { cu::attention_forward_any(c.g, true, fk, nullptr); }) == tc);
  CHECK(forward([&] { cu::attention_forward_any(c.g, false, fk, nullptr); }) == fma);
  const auto tc_back = backward([&] { cu::attention_backward_tensor_cores(c.g, work.data(), nullptr, bk); });
  const auto fma_back = backward([&] { cu::attention_backward(c.g, work.data(), nullptr); });
  REQUIRE(tc_back != fma_back);
  CHECK(backward([&] { cu::attention_backward_any(c.g, work.data(), true, bk, nullptr); }) == tc_back);
  CHECK(backward([&] { cu::attention_backward_any(c.g, work.data(), false, bk, nullptr); }) == fma_back);

  kernels::AttentionArgs a = c.g;
  CHECK(cu::tensor_cores_take(a, true));
  a.dtype = DType::f16;
  CHECK(cu::tensor_cores_take(a, true));
  a.D = 128;
  CHECK(cu::tensor_cores_take(a, true));
  for (const int64_t D : {8, 16, 32}) {
    a.D = D;
    CHECK_FALSE(cu::tensor_cores_take(a, true));
  }
  a.D = 64, a.dtype = DType::f32;
  CHECK_FALSE(cu::tensor_cores_take(a, true));
  a.dtype = DType::bf16, a.scale = -0.125;  // the tensor-core forward needs scale > 0
  CHECK_FALSE(cu::tensor_cores_take(a, true));
}

// cuDNN's detour for a layout it refuses (with_contiguous_layouts): the packed GPT layout copied
// into contiguous buffers, the kernel run there, the results scattered back. The kernels take the
// packed strides directly too, with the same arithmetic, so both ways give the same bits; the
// detour's outputs start as NaN, so a result not scattered back fails.
TEMPLATE_TEST_CASE("emu attention on contiguous copies of a packed layout gives the packed call's bits", "[emu]",
                   float, cu::bf16) {
  using T = TestType;
  const AttentionCase<T> c(77, 64, true, 101, 2, 3);
  PackedAttention<T> direct(c), detour(c);
  auto work = direct.workspace();
  using Buffer = std::vector<std::byte>;
  int runs = 0;
  const auto contiguous = [&](const kernels::AttentionArgs& a) {
    ++runs;
    CHECK(a.q_layout().t == a.D);
    CHECK(a.o_layout().t == a.D);
    CHECK(a.q != detour.g.q);
  };
  cu::attention_forward_any(direct.g, true, cu::FlashForward::keys32, nullptr);
  cu::with_contiguous_layouts<Buffer>(detour.g, nullptr, false, [&](const kernels::AttentionArgs& a) {
    contiguous(a);
    cu::attention_forward_any(a, true, cu::FlashForward::keys32, nullptr);
  });
  CHECK(to_float(detour.out) == to_float(direct.out));
  CHECK(to_float(detour.lse) == to_float(direct.lse));
  cu::attention_backward_any(direct.g, work.data(), true, cu::FlashBackward::free, nullptr);
  cu::with_contiguous_layouts<Buffer>(detour.g, nullptr, true, [&](const kernels::AttentionArgs& a) {
    contiguous(a);
    CHECK(a.out != detour.g.out);
    cu::attention_backward_any(a, work.data(), true, cu::FlashBackward::free, nullptr);
  });
  CHECK(to_float(detour.dqkv) == to_float(direct.dqkv));
  CHECK(runs == 2);
}
