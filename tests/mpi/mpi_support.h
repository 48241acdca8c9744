// Shared by the multi-rank tests: the world group, summing a scalar over a group, and the
// contract check "same losses as the single-process run".
#pragma once
#include "tests/catch.h"
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/shard_state.h"

namespace sg::testing {

// One world group for the whole test executable (creating it is collective).
inline std::shared_ptr<comm::ProcessGroup> world() {
  static std::shared_ptr<comm::ProcessGroup> w = comm::MpiProcessGroup::world();
  return w;
}

inline double sum_over(comm::ProcessGroup& group, double x) {
  Tensor t = from_vector<double>({x}, {1});
  group.all_reduce(t)->wait();
  return item(t);
}

// f32 contract: every step's loss within relative 1e-5 of the single-process one (got may be a
// shorter run than the reference: its steps are compared).
inline void require_same_losses(const std::vector<double>& got, const std::vector<double>& reference) {
  REQUIRE(!got.empty());
  REQUIRE(got.size() <= reference.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i);
    REQUIRE(std::abs(got[i] - reference[i]) <= 1e-5 * std::abs(reference[i]));
  }
}

// f32 contract for gradients, by parameter name: each tensor within 1e-5 of the largest element of
// the reference's (max |got - ref| <= 1e-5 max |ref|). Every name of got must be in reference (a
// rank holding part of the model compares its part).
inline void require_same_gradients(const std::map<std::string, std::vector<float>>& got,
                                   const std::map<std::string, std::vector<float>>& reference) {
  REQUIRE(!got.empty());
  for (const auto& [name, g] : got) {
    INFO("gradient of " << name);
    REQUIRE(reference.count(name) == 1);
    const std::vector<float>& ref = reference.at(name);
    REQUIRE(g.size() == ref.size());
    float scale = 0, diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      scale = std::max(scale, std::abs(ref[i]));
      diff = std::max(diff, std::abs(g[i] - ref[i]));
    }
    REQUIRE(diff <= 1e-5f * scale + 1e-12f);
  }
}

// max |a - b| over the elements, relative to max |b| (state tensors, which cross zero).
inline double max_rel_diff(const Tensor& a, const Tensor& b) {
  std::vector<float> x = to_vector<float>(a), y = to_vector<float>(b);
  REQUIRE(x.size() == y.size());
  double d = 0, m = 1e-30;
  for (size_t i = 0; i < x.size(); ++i) {
    d = std::max(d, std::abs(double(x[i]) - double(y[i])));
    m = std::max(m, std::abs(double(y[i])));
  }
  return d / m;
}

// The largest relative difference of a step's loss (half-precision runs against the f32 one).
// bf16 compute against the f32 reference: bf16 keeps 8 significant bits, so every forward rounds
// at about 4e-3 relative; over 20 steps the losses stay within this relative bound per step.
constexpr double kBf16Bound = 2e-2;

inline double worst_loss_diff(const std::vector<double>& got, const std::vector<double>& reference) {
  REQUIRE(got.size() <= reference.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - reference[i]) / std::abs(reference[i]));
  return worst;
}

// Broadcasts root's integers to every rank of the group (the count first).
inline std::vector<int64_t> broadcast_ints(comm::ProcessGroup& group, const std::vector<int64_t>& v, int root) {
  Tensor n = from_vector<int64_t>({int64_t(v.size())}, {1});
  group.broadcast(n, root)->wait();
  const int64_t len = to_vector<int64_t>(n)[0];
  if (len == 0) return {};
  Tensor t = group.rank() == root ? from_vector<int64_t>(v, {len}) : zeros({len}, DType::i64);
  group.broadcast(t, root)->wait();
  return to_vector<int64_t>(t);
}

// Every rank's checkpoint pieces on every rank, in rank order: the pieces a sharded checkpoint
// would write, brought together so a test can ckpt::assemble them.
inline std::vector<ckpt::Piece> all_pieces(comm::ProcessGroup& group, const std::vector<ckpt::Piece>& mine) {
  std::vector<ckpt::Piece> out;
  for (int q = 0; q < group.size(); ++q) {
    const bool me = q == group.rank();
    const int64_t count = broadcast_ints(group, {me ? int64_t(mine.size()) : 0}, q)[0];
    for (int64_t i = 0; i < count; ++i) {
      // header: dtype, ndim, flat_lo, numel, global shape, box offset, box shape, name bytes
      std::vector<int64_t> h;
      if (me) {
        const ckpt::Piece& p = mine[size_t(i)];
        h = {int64_t(p.data.dtype()), int64_t(p.global_shape.size()), p.flat_lo, p.data.numel()};
        for (const Shape* s : {&p.global_shape, &p.box.offset, &p.box.shape}) h.insert(h.end(), s->begin(), s->end());
        for (char c : p.name) h.push_back(c);
      }
      h = broadcast_ints(group, h, q);
      ckpt::Piece p;
      const size_t nd = size_t(h[1]);
      auto shape_at = [&](size_t k) { return Shape(h.begin() + 4 + std::ptrdiff_t(k * nd), h.begin() + 4 + std::ptrdiff_t((k + 1) * nd)); };
      p.global_shape = shape_at(0);
      p.box = ckpt::Box{shape_at(1), shape_at(2)};
      p.flat_lo = h[2];
      for (size_t k = 4 + 3 * nd; k < h.size(); ++k) p.name.push_back(char(h[k]));
      p.data = me ? contiguous(mine[size_t(i)].data) : empty({h[3]}, DType(h[0]));
      group.broadcast(p.data, q)->wait();
      out.push_back(std::move(p));
    }
  }
  return out;
}

// `whole` (a test's run description: first, steps, init_seed, resume) resumed at step `first`
// from `source` for `steps` steps, started from other initial weights that the resume must
// overwrite.
template <class RunT>
RunT resumed_from(const RunT& whole, const ckpt::PieceSource& source, int first, int steps) {
  RunT r = whole;
  r.first = first;
  r.steps = steps;
  r.init_seed = 99;
  r.resume = &source;
  return r;
}

// The resumed run's losses are the uninterrupted run's from step `first`, bit for bit.
inline void require_resumed_losses(const std::vector<double>& got, const std::vector<double>& uninterrupted, int first) {
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << first + int(i));
    REQUIRE(got[i] == uninterrupted[size_t(first) + i]);
  }
}

// Half-precision losses stay within kBf16Bound of the f32 reference per step, and differ from it
// (the half precision really computed).
inline void require_half_precision_close(const std::vector<double>& got, const std::vector<double>& reference) {
  const double worst = worst_loss_diff(got, reference);
  INFO("worst relative loss difference " << worst);
  REQUIRE(worst <= kBf16Bound);
  REQUIRE(worst > 0);
}

}  // namespace sg::testing
