// core/: views share storage, the ledger counts bytes per category, half conversions round to
// nearest even, parsers name what they refuse, and Philox is a pure function of its counter.
#include "tests/catch.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/philox.h"
#include "kernels/ops.h"

using namespace sg;
using Catch::Contains;

namespace {

Tensor iota(const Shape& s) {  // 0, 1, 2, ... in f32
  std::vector<float> v(size_t(shape_numel(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i);
  return from_vector(v, s);
}

// The value at a multi-index, read through strides and offset (how a view must be interpreted).
float at(const Tensor& t, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
  return t.data<float>()[off];
}

bool same_bytes(const Tensor& a, const Tensor& b) { return a.storage().get() == b.storage().get(); }

float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

// ---- views ----

TEST_CASE("views never copy: reshape, view, transpose, permute, narrow, expand, unsqueeze, squeeze", "[core]") {
  Tensor x = iota({2, 3, 4});  // x[i,j,k] = 12i + 4j + k

  Tensor r = reshape(x, {6, 4});
  CHECK(same_bytes(r, x));
  CHECK(r.strides() == Shape{4, 1});

  Tensor v = view(x, {2, -1});
  CHECK(same_bytes(v, x));
  CHECK(v.shape() == Shape{2, 12});

  Tensor t = transpose(x, 0, 2);
  CHECK(same_bytes(t, x));
  CHECK(t.shape() == Shape{4, 3, 2});
  CHECK(t.strides() == Shape{1, 4, 12});
  CHECK(at(t, {3, 1, 1}) == 12 + 4 + 3);

  Tensor p = permute(x, {1, 2, 0});
  CHECK(same_bytes(p, x));
  CHECK(p.strides() == Shape{4, 1, 12});
  CHECK(at(p, {2, 3, 1}) == 12 + 8 + 3);

  Tensor n = narrow(x, 1, 1, 2);
  CHECK(same_bytes(n, x));
  CHECK(n.offset() == 4);
  CHECK(n.strides() == Shape{12, 4, 1});
  CHECK(at(n, {1, 0, 2}) == 12 + 4 + 2);

  Tensor e = expand(iota({3, 1}), {2, 3, 5});
  CHECK(e.strides() == Shape{0, 1, 0});
  CHECK(at(e, {1, 2, 4}) == 2);

  Tensor u = unsqueeze(t, 1);  // a transposed tensor keeps its strides around the new dim
  CHECK(same_bytes(u, x));
  CHECK(u.shape() == Shape{4, 1, 3, 2});
  CHECK(at(u, {3, 0, 1, 1}) == 12 + 4 + 3);
  Tensor s = squeeze(u, 1);
  CHECK(same_bytes(s, x));
  CHECK(s.strides() == t.strides());

  auto parts = chunk(x, 2, 2);
  REQUIRE(parts.size() == 2);
  CHECK(same_bytes(parts[1], x));
  CHECK(parts[1].offset() == 2);
}

TEST_CASE("reshape and view of non-contiguous tensors split and merge only compatible dims", "[core]") {
  Tensor x = iota({4, 6});
  SECTION("splitting a transposed dim is a view with the right strides") {
    Tensor t = transpose(x, 0, 1);  // [6,4] strides [1,6]
    Tensor v = view(t, {3, 2, 4});
    CHECK(same_bytes(v, x));
    CHECK(v.strides() == Shape{2, 1, 6});
    for (int64_t a = 0; a < 3; ++a)
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t c = 0; c < 4; ++c) CHECK(at(v, {a, b, c}) == at(t, {2 * a + b, c}));
  }
  SECTION("a narrowed row block merges its rows, a column slice does not") {
    Tensor rows = narrow(x, 0, 1, 2);  // contiguous rows 1..2
    Tensor m = view(rows, {12});
    CHECK(same_bytes(m, x));
    CHECK(to_vector<float>(m)[0] == 6);
    Tensor cols = narrow(x, 1, 1, 4);  // [4,4] strides [6,1]
    Tensor split = view(cols, {2, 2, 2, 2});
    CHECK(split.strides() == Shape{12, 6, 2, 1});
    CHECK(at(split, {1, 1, 1, 1}) == 6 * 3 + 1 + 3);
    REQUIRE_THROWS_WITH(view(cols, {16}),
                        Contains("view: a tensor with shape [4,4] and strides [6,1] cannot be viewed as [16]"));
    Tensor copied = reshape(cols, {16});  // reshape copies instead
    CHECK_FALSE(same_bytes(copied, x));
    CHECK(to_vector<float>(copied)[5] == 6 + 2);
  }
  SECTION("size-1 dims with odd strides do not block a view") {
    Tensor t = transpose(unsqueeze(x, 1), 0, 1);  // [1,4,6]
    Tensor v = view(t, {2, 2, 6});
    CHECK(same_bytes(v, x));
    CHECK(to_vector<float>(v) == to_vector<float>(x));
  }
  SECTION("a permuted tensor merges only dims that are adjacent in memory") {
    Tensor y = iota({2, 3, 4});
    Tensor p = permute(y, {1, 0, 2});  // [3,2,4] strides [4,12,1]
    Tensor v = view(p, {3, 2, 2, 2});
    CHECK(v.strides() == Shape{4, 12, 2, 1});
    REQUIRE_THROWS_WITH(view(p, {3, 8}), Contains("cannot be viewed as [3,8]"));
    CHECK(to_vector<float>(reshape(p, {3, 8})) == to_vector<float>(contiguous(p)));
  }
  SECTION("an expanded tensor views its broadcast dims with stride 0 and copies to flatten") {
    Tensor e = expand(iota({3, 1}), {3, 4});
    Tensor v = view(e, {3, 2, 2});
    CHECK(v.strides() == Shape{1, 0, 0});
    REQUIRE_THROWS(view(e, {12}));
    CHECK(to_vector<float>(reshape(e, {12}))[5] == 1);
  }
}

TEST_CASE("reshape of any strided layout gives the values of reshaping its contiguous copy", "[core]") {
  // Every permutation of a narrowed [2,3,4,5] block, reshaped to every split/merge of its dims.
  Tensor base = iota({3, 3, 6, 5});
  Tensor block = narrow(narrow(base, 0, 1, 2), 2, 1, 4);  // [2,3,4,5], rows of 5 apart by 6*5
  std::vector<int64_t> perm = {0, 1, 2, 3};
  int viewed = 0, copied = 0;
  do {
    Tensor t = permute(block, perm);
    const Shape& s = t.shape();
    std::vector<Shape> targets = {{-1},
                                  {s[0] * s[1], s[2] * s[3]},
                                  {s[0], s[1] * s[2], s[3]},
                                  {s[0], s[1], s[2] * s[3]},
                                  {1, s[0], 1, s[1], s[2], s[3], 1},
                                  {s[0] * s[1] * s[2], s[3]}};
    for (const Shape& target : targets) {
      Tensor r = reshape(t, target);
      INFO("perm " << shape_str(perm) << " -> " << shape_str(target));
      CHECK(to_vector<float>(r) == to_vector<float>(reshape(contiguous(t), target)));
      (same_bytes(r, base) ? viewed : copied)++;
    }
  } while (std::next_permutation(perm.begin(), perm.end()));
  CHECK(viewed > 24);  // the size-1 insertions alone are views for every permutation
  CHECK(copied > 0);
}

TEST_CASE("contiguous() copies only when the layout needs it", "[core]") {
  Tensor x = iota({3, 5});
  CHECK(contiguous(x).impl() == x.impl());
  CHECK(contiguous(narrow(x, 0, 1, 2)).storage().get() == x.storage().get());
  Tensor t = transpose(x, 0, 1);
  Tensor c = contiguous(t);
  CHECK_FALSE(same_bytes(c, x));
  CHECK(c.is_contiguous());
  CHECK(c.strides() == Shape{3, 1});
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 3; ++j) CHECK(at(c, {i, j}) == at(x, {j, i}));
}

TEST_CASE("copy_ into non-contiguous destinations writes exactly the viewed elements", "[core]") {
  Tensor src = iota({3, 4});
  SECTION("a column slice from a transposed source") {
    Tensor dst = zeros({4, 6});
    copy_(narrow(dst, 1, 2, 3), transpose(src, 0, 1));  // dst[r, 2 + c] = src[c, r]
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 6; ++c) CHECK(at(dst, {r, c}) == ((c >= 2 && c < 5) ? at(src, {c - 2, r}) : 0.0f));
  }
  SECTION("a transposed column slice from a contiguous source") {
    Tensor dst = zeros({4, 6});
    copy_(transpose(narrow(dst, 1, 1, 3), 0, 1), src);  // dst[r, 1 + c] = src[c, r]
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 6; ++c) CHECK(at(dst, {r, c}) == ((c >= 1 && c < 4) ? at(src, {c - 1, r}) : 0.0f));
  }
  Tensor h = zeros({3, 4}, DType::bf16);
  copy_(narrow(h, 1, 1, 2), from_vector<float>({1.5f, -2, 3, 4.25f, 5, 6}, {3, 2}));  // converting, strided
  CHECK(to_vector<float>(h) == std::vector<float>{0, 1.5f, -2, 0, 0, 3, 4.25f, 0, 0, 5, 6, 0});
}

// ---- broadcasting and shape errors ----

TEST_CASE("broadcasting aligns trailing dims and names incompatible shapes", "[core]") {
  CHECK(broadcast_shapes({2, 1, 3}, {4, 1}, "add") == Shape{2, 4, 3});
  CHECK(broadcast_shapes({}, {3, 2}, "add") == Shape{3, 2});
  CHECK(broadcast_shapes({1}, {1}, "add") == Shape{1});
  REQUIRE_THROWS_WITH(add(zeros({2, 3}), zeros({4})), "add: shapes [2,3] and [4] do not broadcast (3 vs 4 at dim 1)");
  REQUIRE_THROWS_WITH(mul(zeros({5, 2}), zeros({3, 1, 3})), Contains("mul: shapes [5,2] and [3,1,3] do not broadcast"));
  REQUIRE_THROWS_WITH(add(zeros({2}), zeros({2}, DType::f64)), Contains("add: dtypes f32 and f64 differ"));
}

TEST_CASE("matmul names the shapes that do not chain", "[core]") {
  REQUIRE_THROWS_WITH(matmul(zeros({4, 8}), zeros({7, 3})), "matmul: shapes [4,8] and [7,3] do not chain (8 != 7)");
  REQUIRE_THROWS_WITH(matmul(zeros({2, 4, 8}), zeros({3, 8, 2})),
                      Contains("matmul of [2,4,8] and [3,8,2], batch dims: shapes [2] and [3] do not broadcast"));
  REQUIRE_THROWS_WITH(matmul(zeros({2, 2}, DType::i64), zeros({2, 2}, DType::i64)), Contains("matmul: expected a floating tensor"));
}

TEST_CASE("an op a device or dtype cannot do fails loudly, naming the op, dtype and device", "[core]") {
  REQUIRE_THROWS_WITH(exp(zeros({2}, DType::i32)), Contains("exp: expected a floating tensor, got i32[2] on cpu"));
  kernels::GemmArgs g;
  g.dtype = DType::bf16;
  REQUIRE_THROWS_WITH(kernels::table(Device::cpu()).gemm(g), "op 'gemm' does not support dtype bf16 on cpu");
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), copy_to_host)(nullptr, nullptr, 0, Device::cpu()),
                      "op 'copy_to_host' is not implemented on device cpu");
  try {
    zeros({2}, DType::f32, Device::cuda(0));  // fine with a GPU and its kernels; otherwise it must say why not
  } catch (const Error& e) {
#ifdef SG_WITH_CUDA
    CHECK_THAT(e.what(), Contains("cuda:0"));  // no device, or no kernel for the op yet: named either way
#else
    CHECK_THAT(e.what(), Contains("was shardgrad built with CUDA?"));
#endif
  }
}

// ---- memory ledger ----

TEST_CASE("the ledger charges each allocation to its MemScope's category, with current and peak bytes", "[core]") {
  // A device index of its own keeps other tests' allocations out of these numbers.
  const Device dev = Device::cpu(7);
  Ledger& L = Ledger::global();
  L.reset_peaks(dev);
  const MemStats base = L.stats(dev);
  auto cur = [&](MemCategory c) { return L.stats(dev).cur(c) - base.cur(c); };
  {
    Tensor p, a;
    {
      MemScope scope(MemCategory::param);
      p = empty({10}, DType::f32, dev);  // 40 bytes
      {
        MemScope inner(MemCategory::optim_state);
        Tensor m = empty({3}, DType::f64, dev);  // 24 bytes, freed at once
        CHECK(cur(MemCategory::optim_state) == 24);
      }
      CHECK(MemScope::current() == MemCategory::param);  // nested scopes restore
    }
    a = empty({5}, DType::bf16, dev);  // default category: activation, 10 bytes
    CHECK(cur(MemCategory::param) == 40);
    CHECK(cur(MemCategory::activation) == 10);
    CHECK(cur(MemCategory::optim_state) == 0);
    MemStats s = L.stats(dev);
    CHECK(s.pk(MemCategory::optim_state) - base.pk(MemCategory::optim_state) == 24);
    CHECK(s.total_current - base.total_current == 50);
    CHECK(s.total_peak >= base.total_current + 64);  // 40 + 24 were live together

    p.storage()->recategorize(MemCategory::grad);
    CHECK(cur(MemCategory::param) == 0);
    CHECK(cur(MemCategory::grad) == 40);
    CHECK(L.stats(dev).total_current - base.total_current == 50);
  }
  MemStats after = L.stats(dev);
  CHECK(after.cur(MemCategory::grad) == base.cur(MemCategory::grad));
  CHECK(after.cur(MemCategory::activation) == base.cur(MemCategory::activation));
  CHECK(after.pk(MemCategory::param) - base.pk(MemCategory::param) == 40);  // peaks survive frees
  L.reset_peaks(dev);
  CHECK(L.stats(dev).pk(MemCategory::param) == base.cur(MemCategory::param));
  CHECK(L.stats(dev).total_peak == base.total_current);
}

TEST_CASE("Storage::release frees the bytes and reallocate brings them back to every sharing handle", "[core]") {
  Ledger& L = Ledger::global();
  const Device dev = Device::cpu();
  const int64_t base = L.stats(dev).cur(MemCategory::param);
  Tensor p;
  {
    MemScope scope(MemCategory::param);
    p = iota({2, 3});
  }
  Tensor view = narrow(p, 1, 1, 2);  // shares the storage, as a tape's saved handle would
  REQUIRE(L.stats(dev).cur(MemCategory::param) - base == 24);
  p.storage()->release();
  CHECK(p.storage()->data() == nullptr);
  CHECK(p.storage()->nbytes() == 0);
  CHECK(L.stats(dev).cur(MemCategory::param) == base);
  p.storage()->release();  // twice: a no-op
  CHECK(L.stats(dev).cur(MemCategory::param) == base);
  p.storage()->reallocate(24);
  CHECK(p.storage()->category() == MemCategory::param);
  CHECK(L.stats(dev).cur(MemCategory::param) - base == 24);
  for (int i = 0; i < 6; ++i) p.data<float>()[i] = float(10 * i);
  CHECK(to_vector<float>(contiguous(view)) == std::vector<float>{10, 20, 40, 50});  // the view sees the new bytes
  p.storage()->reallocate(24);  // reallocating live bytes frees the old ones first
  CHECK(L.stats(dev).cur(MemCategory::param) - base == 24);
  p.storage()->release();
  p = Tensor();
  view = Tensor();  // destroying a released storage frees nothing twice
  CHECK(L.stats(dev).cur(MemCategory::param) == base);
}

// ---- dtypes and devices ----

TEST_CASE("f32 <-> bf16: exact values, round to nearest even, inf and nan", "[core]") {
  CHECK(f32_to_bf16(1.0f) == 0x3F80);
  CHECK(f32_to_bf16(-2.0f) == 0xC000);
  CHECK(f32_to_bf16(0.0f) == 0x0000);
  CHECK(f32_to_bf16(-0.0f) == 0x8000);
  CHECK(bf16_to_f32(0x3FC0) == 1.5f);
  CHECK(f32_to_bf16(bits_f32(0x3F808000)) == 0x3F80);  // 1 + 2^-8: tie, stays even
  CHECK(f32_to_bf16(bits_f32(0x3F818000)) == 0x3F82);  // tie between 0x3F81 and 0x3F82: goes even
  CHECK(f32_to_bf16(bits_f32(0x3F808001)) == 0x3F81);  // just above the tie: up
  CHECK(f32_to_bf16(bits_f32(0x3F807FFF)) == 0x3F80);  // just below: down
  CHECK(f32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(f32_to_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(f32_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // beyond bf16's largest: inf
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(bits_f32(0x7F800001)))));  // a NaN whose payload would round to inf
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = bf16_to_f32(uint16_t(h));
    if (!std::isnan(f) && f32_to_bf16(f) != h) FAIL("bf16 " << h << " does not round trip");
  }
}

TEST_CASE("f32 <-> f16: exact values, round to nearest even, overflow, subnormals, inf and nan", "[core]") {
  CHECK(f32_to_f16(1.0f) == 0x3C00);
  CHECK(f32_to_f16(-2.0f) == 0xC000);
  CHECK(f32_to_f16(65504.0f) == 0x7BFF);  // largest finite half
  CHECK(f32_to_f16(65519.0f) == 0x7BFF);
  CHECK(f32_to_f16(65520.0f) == 0x7C00);  // the tie above 65504 rounds to inf
  CHECK(f32_to_f16(1e6f) == 0x7C00);
  CHECK(f32_to_f16(-1e6f) == 0xFC00);
  CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);      // tie: even
  CHECK(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie: even (up)
  CHECK(f32_to_f16(1.0f + 1.5f * std::ldexp(1.0f, -11)) == 0x3C01);
  CHECK(f32_to_f16(std::ldexp(1.0f, -14)) == 0x0400);         // smallest normal
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);         // smallest subnormal
  CHECK(f32_to_f16(std::ldexp(1023.0f, -24)) == 0x03FF);      // largest subnormal
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);         // half the smallest: tie to even zero
  CHECK(f32_to_f16(std::ldexp(3.0f, -25)) == 0x0002);         // 1.5 units: tie to even 2
  CHECK(f32_to_f16(-std::ldexp(1.0f, -24)) == 0x8001);
  CHECK(f32_to_f16(std::ldexp(2047.0f, -25)) == 0x0400);      // rounds up into the normals
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_to_f32(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(std::signbit(f16_to_f32(0x8000)));
  CHECK(f16_to_f32(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(f16_to_f32(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(f16_to_f32(0x7E00)));
  CHECK(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  CHECK(f32_to_f16(std::numeric_limits<float>::infinity()) == 0x7C00);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_to_f32(uint16_t(h));
    if (!std::isnan(f) && f32_to_f16(f) != h) FAIL("f16 " << h << " does not round trip");
  }
}

TEST_CASE("parse_dtype and parse_device accept the CLI spellings and name what they refuse", "[core]") {
  CHECK(parse_dtype("fp32") == DType::f32);
  CHECK(parse_dtype("float32") == DType::f32);
  CHECK(parse_dtype("f64") == DType::f64);
  CHECK(parse_dtype("bf16") == DType::bf16);
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK(parse_dtype("fp16") == DType::f16);
  CHECK(parse_dtype("half") == DType::f16);
  CHECK(parse_dtype("int32") == DType::i32);
  CHECK(parse_dtype("i64") == DType::i64);
  REQUIRE_THROWS_WITH(parse_dtype("fp8"), Contains("unknown dtype 'fp8'"));
  REQUIRE_THROWS_WITH(parse_dtype(""), Contains("unknown dtype ''"));

  CHECK(parse_device("cpu") == Device::cpu());
  CHECK(parse_device("cpu:1") == Device::cpu(1));
  CHECK(parse_device("cuda") == Device::cuda(0));
  CHECK(parse_device("cuda:3") == Device::cuda(3));
  CHECK(parse_device("cuda:3").str() == "cuda:3");
  REQUIRE_THROWS_WITH(parse_device("gpu"), Contains("unknown device 'gpu'"));
  REQUIRE_THROWS_WITH(parse_device("cuda:"), Contains("device 'cuda:': bad index ''"));
  REQUIRE_THROWS_WITH(parse_device("cuda:x"), Contains("bad index 'x'"));
  REQUIRE_THROWS_WITH(parse_device("cuda:-1"), Contains("bad index '-1'"));
  REQUIRE_THROWS_WITH(parse_device("cpu:1x"), Contains("bad index '1x'"));
  REQUIRE_THROWS(parse_device(""));
}

// ---- Philox ----

TEST_CASE("Philox: a value is a pure function of (seed, stream, index), whatever the layout", "[core]") {
  CHECK(Philox::uniform(7, 3, 123) == Philox::uniform(7, 3, 123));
  CHECK(Philox::normal(7, 3, 123) == Philox::normal(7, 3, 123));
  CHECK(Philox::uniform(7, 3, 123) != Philox::uniform(7, 4, 123));
  CHECK(Philox::uniform(7, 3, 123) != Philox::uniform(8, 3, 123));
  CHECK(Philox::uniform(7, 3, 123) != Philox::uniform(7, 3, 124));

  auto whole = to_vector<float>(randn({100}, 11, 5));
  auto tail = to_vector<float>(randn({60}, 11, 5, 0, 1, DType::f32, Device::cpu(), 40));
  for (size_t i = 40; i < 100; ++i) CHECK(whole[i] == tail[i - 40]);
  CHECK(to_vector<float>(randn({10, 10}, 11, 5)) == whole);  // shape does not matter, only the counter
  auto shifted = to_vector<float>(randn({100}, 11, 5, 2.0, 3.0));
  for (size_t i = 0; i < 100; ++i) CHECK(shifted[i] == Approx(2.0 + 3.0 * whole[i]));
  auto in_f64 = to_vector<double>(randn({100}, 11, 5, 0, 1, DType::f64));
  for (size_t i = 0; i < 100; ++i) CHECK(float(in_f64[i]) == whole[i]);  // same draw in every dtype
}

TEST_CASE("normal_ writes randn's draws over a tensor in place, a half tensor a piece at a time", "[core]") {
  // 2^20 + 37 elements: the bf16 draw (computed in f32 on the CPU) spans two pieces.
  const int64_t n = (int64_t(1) << 20) + 37;
  Tensor h = zeros({n}, DType::bf16);
  normal_(h, 11, 5, 0.5, 2.0);
  CHECK(to_vector<float>(h) == to_vector<float>(to(randn({n}, 11, 5, 0.5, 2.0), DType::bf16)));
  // a contiguous piece of a tensor, from a counter on: the rows of the whole draw
  Tensor m = zeros({6, 4});
  normal_(narrow(m, 0, 2, 3), 11, 5, 0, 1, 8);
  const std::vector<float> whole = to_vector<float>(randn({6, 4}, 11, 5)), got = to_vector<float>(m);
  for (size_t i = 0; i < 24; ++i) CHECK(got[i] == (i >= 8 && i < 20 ? whole[i] : 0.0f));
  REQUIRE_THROWS_WITH(normal_(transpose(m, 0, 1), 1, 1), Catch::Contains("normal_: the tensor must be contiguous"));
}

TEST_CASE("Philox: 100k normals have mean 0 and std 1, uniforms stay within lo and hi", "[core]") {
  auto z = to_vector<double>(randn({100000}, 3, 9, 0, 1, DType::f64));
  double m = 0, s = 0;
  for (double v : z) m += v;
  m /= double(z.size());
  for (double v : z) s += (v - m) * (v - m);
  s = std::sqrt(s / double(z.size()));
  CHECK(std::abs(m) < 0.015);  // 5 standard errors
  CHECK(std::abs(s - 1) < 0.015);
  auto u = to_vector<double>(rand({100000}, 3, 10, -1, 3, DType::f64));
  double um = 0, lo = 1e9, hi = -1e9;
  for (double v : u) {
    um += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  CHECK(std::abs(um / double(u.size()) - 1.0) < 0.03);
  CHECK(lo >= -1);
  CHECK(hi < 3);
}

TEST_CASE("the meta device: shapes, dtypes and ledger bytes, no memory and no values", "[core]") {
  CHECK(parse_device("meta") == Device::meta());
  CHECK(parse_device("meta:3") == Device::meta(3));
  CHECK(Device::meta(3).str() == "meta:3");
  const Device m = Device::meta(7);
  {
    // A terabyte: charged to meta:7's ledger, with no byte behind it.
    Tensor huge = empty({int64_t(1) << 38}, DType::f32, m);
    CHECK(Ledger::global().stats(m).cur(MemCategory::activation) == int64_t(1) << 40);
    CHECK(huge.device() == m);
    Tensor other = empty({4}, DType::f32, m);
    CHECK(other.data_ptr() != huge.data_ptr());  // storages stay distinct
  }
  CHECK(Ledger::global().stats(m).cur(MemCategory::activation) == 0);
  CHECK(Ledger::global().stats(m).pk(MemCategory::activation) == (int64_t(1) << 40) + 16);

  // Ops give their shapes and dtypes; the values read back as zeros.
  Tensor a = to(from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}), m), b = to(from_vector<float>({1, 1, 1}, {3, 1}), m);
  Tensor c = matmul(a, b);
  CHECK(c.shape() == Shape{2, 1});
  CHECK(c.device() == m);
  CHECK(to_vector<float>(c) == std::vector<float>{0, 0});
  CHECK(to(gelu(a), DType::bf16).dtype() == DType::bf16);
  CHECK_THROWS_WITH(matmul(a, a), Contains("matmul"));  // shapes are still checked

  // The tape runs a backward there too: gradients of the leaves' shapes, charged as gradients.
  Tensor x = empty({3, 4}, DType::f32, m);
  x.set_requires_grad(true);
  autograd::Tape tape;
  Tensor loss;
  {
    autograd::TapeScope s(tape);
    loss = sum(square(matmul(x, transpose(x, 0, 1))));
  }
  tape.backward(loss);
  CHECK(x.grad().shape() == Shape{3, 4});
  CHECK(x.grad().device() == m);
  CHECK(x.grad().storage()->category() == MemCategory::grad);
  Ledger::global().reset_peaks(m);
}
