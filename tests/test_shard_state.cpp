// Pieces of global tensors: every layout's local tensors and flat runs cut into pieces that
// reassemble the global tensor exactly, and read back into any other layout.
#include "tests/catch.h"
#include <numeric>

#include "autograd/ops.h"
#include "parallel/shard_state.h"
#include "parallel/tp/layers.h"

using namespace sg;
using namespace sg::ckpt;

namespace {
Tensor numbered(const Shape& s) { return reshape(arange(std::accumulate(s.begin(), s.end(), int64_t(1), std::multiplies<>()), DType::f32), s); }
bool same(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && to_vector<float>(a) == to_vector<float>(b); }
}  // namespace

TEST_CASE("tensor-parallel pieces reassemble the global tensor and read back per rank", "[shard]") {
  const Shape g{12, 5};  // c_attn-like: 3 blocks of 4 rows, each split 2 ways
  Tensor full_t = numbered(g);
  for (int64_t dim : {0, 1}) {
    const int64_t blocks = dim == 0 ? 3 : 1;
    const Shape gs = dim == 0 ? g : Shape{5, 12};
    Tensor global = dim == 0 ? full_t : numbered(gs);
    std::vector<Piece> all;
    MemorySource src;
    src.add("w", global);
    for (int r = 0; r < 2; ++r) {
      LocalView v = split_view("w", gs, dim, blocks, r, 2);
      Tensor local = parallel::tp::shard_of(global, {dim, blocks}, r, 2);
      REQUIRE(local.shape() == v.local_shape);
      for (auto& p : pieces_of(v, local)) all.push_back(p);
      Tensor back = zeros(v.local_shape);
      read_local(src, v, back);
      CHECK(same(back, local));
    }
    auto out = assemble(all);
    CHECK(same(out.at("w"), global));
  }
}

TEST_CASE("a rank's piece of a drawn tensor is drawn without the whole tensor, equal to the whole draw's piece", "[shard]") {
  // c_attn-like (3 parts along dim 0), c_fc-like (dim 0), c_proj-like (dim 1, rows a band at a
  // time: 7 rows over 2 and 3 ranks leave a short last band); f32 and bf16.
  const std::vector<std::pair<Shape, parallel::tp::Split>> cases = {
      {{12, 5}, {0, 3}}, {{6, 7}, {0, 1}}, {{7, 12}, {1, 1}}, {{12}, {0, 3}}, {{4, 5}, {}}};
  for (DType dt : {DType::f32, DType::bf16})
    for (const auto& [full, split] : cases)
      for (int size : {2, 3}) {
        if (!split.replicated() && full[size_t(split.dim)] % (split.parts * size) != 0) continue;
        for (int r = 0; r < size; ++r) {
          INFO(shape_str(full) << " split dim " << split.dim << " x" << split.parts << ", rank " << r << " of " << size);
          const Tensor want = parallel::tp::shard_of(randn(full, 3, 77, 0.0, 0.02, dt), split, r, size);
          Tensor got = zeros(want.shape(), dt);
          parallel::tp::normal_shard_(got, split, r, size, 3, 77, 0.0, 0.02);
          CHECK(same(got, want));
        }
      }
}

TEST_CASE("flat runs across blocks and padding rows cut into pieces (ZeRO/FSDP shards)", "[shard]") {
  // wte: 10 real rows padded to 12 locally, split over 2 tp ranks (rows 6..11 on rank 1, 4 real).
  Tensor wte = numbered({10, 3});
  MemorySource src;
  src.add("wte.weight", wte);
  std::vector<Piece> all;
  for (int r = 0; r < 2; ++r) {
    LocalView v = gpt_param_view("wte.weight", {6, 3}, 10, r, 2);
    CHECK(v.global_shape == Shape{10, 3});
    Tensor local = zeros({6, 3});
    read_local(src, v, local);
    std::vector<float> lv = to_vector<float>(local);
    for (int64_t row = 0; row < 6; ++row)
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t grow = r * 6 + row;
        CHECK(lv[size_t(row * 3 + c)] == (grow < 10 ? float(grow * 3 + c) : 0.0f));
      }
    // Three uneven flat runs of the local tensor, as three ZeRO ranks would own them.
    Tensor flat = reshape(local, {18});
    for (auto [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {7, 5}, {12, 6}}) {
      Tensor run = contiguous(narrow(flat, 0, lo, n));
      for (auto& p : pieces_of(v, lo, run)) all.push_back(p);
      Tensor back = zeros({n});
      read_local(src, v, lo, back);
      CHECK(same(back, run));
    }
  }
  CHECK(same(assemble(all).at("wte.weight"), wte));
  // c_attn under tp 2: a flat run crossing the q/k boundary of rank 1's local tensor.
  Tensor w = numbered({12, 2});
  src.add("h.0.attn.c_attn.weight", w);
  LocalView v = gpt_param_view("h.0.attn.c_attn.weight", {6, 2}, 10, 1, 2);
  Tensor local = parallel::tp::shard_of(w, {0, 3}, 1, 2);
  Tensor run = contiguous(narrow(reshape(local, {12}), 0, 3, 6));
  auto ps = pieces_of(v, 3, run);
  CHECK(ps.size() == 3);
  Tensor back = zeros({6});
  read_local(src, v, 3, back);
  CHECK(same(back, run));
}

TEST_CASE("missing tensors, wrong shapes and incomplete pieces are refused by name", "[shard]") {
  MemorySource src;
  src.add("a", zeros({4, 2}));
  Tensor out = zeros({2, 2});
  CHECK_THROWS_WITH(read_local(src, whole_view("b", {2, 2}), out), Catch::Contains("'b' is missing"));
  CHECK_THROWS_WITH(read_local(src, whole_view("a", {2, 2}), out), Catch::Contains("'a' has shape [4,2]"));
  LocalView v = whole_view("a", {4, 2});
  auto ps = pieces_of(v, 0, contiguous(narrow(reshape(numbered({4, 2}), {8}), 0, 0, 5)));
  CHECK_THROWS_WITH(assemble(ps), Catch::Contains("'a' is incomplete: pieces cover 5 of 8"));
}

TEST_CASE("copy_overlap fills a request of one layout from the pieces of another, element for element", "[shard]") {
  Tensor g = numbered({6, 4});
  // stored: flat runs of the whole tensor (as ZeRO/FSDP ranks hold them), uneven
  LocalView whole = whole_view("w", {6, 4});
  std::vector<Piece> stored;
  Tensor flat = reshape(g, {24});
  for (auto [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 11}, {16, 8}})
    for (auto& p : pieces_of(whole, lo, contiguous(narrow(flat, 0, lo, n)))) stored.push_back(p);
  // asked: rank 1's columns under a split along dim 1, then a run inside that box
  LocalView cols = split_view("w", {6, 4}, 1, 1, 1, 2);
  const Box& box = cols.parts[0].box;
  for (auto [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 12}, {3, 7}}) {
    Tensor out = full({n}, -1.0);
    int64_t copied = 0;
    for (const Piece& p : stored) {
      auto [plo, phi] = run_extent(p.global_shape, p.box, p.flat_lo, p.data.numel());
      auto [rlo, rhi] = run_extent({6, 4}, box, lo, n);
      if (phi <= rlo || rhi <= plo) continue;
      copied += copy_overlap(p, box, lo, out);
    }
    CHECK(copied == n);
    CHECK(same(out, box_run(g, box, lo, n)));
  }
}
