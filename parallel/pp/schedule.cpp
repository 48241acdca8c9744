#include "parallel/pp/schedule.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace sg::parallel::pp {

static void check(int ranks, int m, int v) {
  SG_CHECK(ranks >= 1, "pipeline: --pp must be >= 1, got ", ranks);
  SG_CHECK(m >= 1, "pipeline: needs at least one micro-batch, got ", m);
  SG_CHECK(v >= 1, "pipeline: --virtual-stages must be >= 1, got ", v);
}

Schedule gpipe(int p, int m) {
  check(p, m, 1);
  Schedule s{"gpipe", p, m, 1, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) s.per_rank[size_t(r)].push_back({r, i, Phase::forward});
    for (int i = 0; i < m; ++i) s.per_rank[size_t(r)].push_back({r, i, Phase::backward});
  }
  return s;
}

Schedule one_f_one_b(int p, int m) {
  check(p, m, 1);
  Schedule s{"1f1b", p, m, 1, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    auto& a = s.per_rank[size_t(r)];
    const int warmup = std::min(p - r - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) a.push_back({r, f, Phase::forward});
    while (f < m) {  // steady state: one forward, one backward
      a.push_back({r, f++, Phase::forward});
      a.push_back({r, b++, Phase::backward});
    }
    while (b < m) a.push_back({r, b++, Phase::backward});  // cool-down
  }
  return s;
}

Schedule interleaved(int p, int m, int v) {
  check(p, m, v);
  SG_CHECK(m % p == 0, "pipeline: the interleaved schedule needs the micro-batches (", m,
           ") to be a multiple of the pipeline stages (", p, ")");
  Schedule s{"interleaved", p, m, v, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  const int total = m * v;  // actions of each kind per rank
  // The k-th forward of a rank runs chunk (k / p) % v on micro-batch (k / (p v)) p + k % p;
  // backwards walk the chunks in reverse.
  auto fwd = [&](int r, int k) { return Action{((k / p) % v) * p + r, (k / (p * v)) * p + k % p, Phase::forward}; };
  auto bwd = [&](int r, int k) { return Action{(v - 1 - (k / p) % v) * p + r, (k / (p * v)) * p + k % p, Phase::backward}; };
  for (int r = 0; r < p; ++r) {
    auto& a = s.per_rank[size_t(r)];
    const int warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
    int f = 0, b = 0;
    for (; f < warmup; ++f) a.push_back(fwd(r, f));
    while (f < total) {
      a.push_back(fwd(r, f++));
      a.push_back(bwd(r, b++));
    }
    while (b < total) a.push_back(bwd(r, b++));
  }
  return s;
}

void check_schedule(const std::string& kind, int chunks) {
  SG_CHECK(kind == "gpipe" || kind == "1f1b" || kind == "interleaved", "--pp-schedule: unknown schedule '", kind,
           "' (expected gpipe, 1f1b or interleaved)");
  SG_CHECK(chunks == 1 || kind == "interleaved", "--virtual-stages ", chunks, " is for --pp-schedule interleaved (",
           kind, " runs one chunk of layers per rank)");
}

Schedule make_schedule(const std::string& kind, int ranks, int m, int chunks) {
  check_schedule(kind, chunks);
  if (kind == "gpipe") return gpipe(ranks, m);
  // interleaved over one chunk is 1F1B with a warm-up twice as deep: as many activations held
  // for the same bubble (Megatron interleaves only with two virtual stages or more)
  if (kind == "1f1b" || chunks == 1) return one_f_one_b(ranks, m);
  return interleaved(ranks, m, chunks);
}

int64_t default_micro_batch_size(int64_t rows, int pp, const std::string& kind, int chunks) {
  if (pp <= 1 || rows < 1) return rows;
  int64_t best = 0;  // micro-batches per step
  for (int64_t m = pp; m <= rows; m += pp) {
    if (rows % m) continue;
    best = m;
    if (m >= 4 * pp) break;
  }
  if (best) return rows / best;
  SG_CHECK(kind != "interleaved" || chunks == 1, "--pp-schedule interleaved needs a number of micro-batches that is ",
           "a multiple of --pp ", pp, ", and none divides the rank's ", rows, " rows: give a --batch-size whose ",
           "per-rank rows are a multiple of ", pp);
  // The fewest micro-batches that still give every stage one (each row its own when there are
  // fewer rows than stages).
  for (int64_t m = std::min<int64_t>(pp, rows); m < rows; ++m)
    if (rows % m == 0) return rows / m;
  return 1;
}

Timeline simulate(const Schedule& s, double tf, double tb) {
  const int p = s.ranks, S = s.stages();
  Timeline t;
  t.per_rank.resize(size_t(p));
  std::map<std::tuple<int, int, int>, double> done;  // (stage, micro, phase) -> end time
  std::vector<size_t> next(size_t(p), 0);
  std::vector<double> free_at(size_t(p), 0.0);
  size_t remaining = 0;
  for (auto& a : s.per_rank) remaining += a.size();
  // The ranks to try: all at first, then a rank again whenever an action it may wait on has
  // finished. Each finished action wakes one rank, so the work follows the actions (sweeping every
  // rank until none moved took a sweep per stage of each backward wave: p² on a long pipeline).
  // The times do not depend on the order: an action starts when its rank and its input are done.
  std::vector<int> to_try;
  std::vector<char> waiting_to_try(size_t(p), 1);
  for (int r = p - 1; r >= 0; --r) to_try.push_back(r);
  while (!to_try.empty()) {
    const int r = to_try.back();
    to_try.pop_back();
    waiting_to_try[size_t(r)] = 0;
    while (next[size_t(r)] < s.per_rank[size_t(r)].size()) {
      const Action& a = s.per_rank[size_t(r)][next[size_t(r)]];
      SG_CHECK(s.rank_of(a.stage) == r, "pipeline: stage ", a.stage, " scheduled on rank ", r);
      // Which action's output this one consumes.
      std::tuple<int, int, int> dep{-1, -1, -1};
      if (a.phase == Phase::forward && a.stage > 0) dep = {a.stage - 1, a.micro, 0};
      if (a.phase == Phase::backward) dep = a.stage == S - 1 ? std::tuple{a.stage, a.micro, 0} : std::tuple{a.stage + 1, a.micro, 1};
      double ready = 0;
      if (std::get<0>(dep) >= 0) {
        auto it = done.find(dep);
        if (it == done.end()) break;  // input not produced yet: this rank waits until it is
        ready = it->second;
      }
      const double start = std::max(free_at[size_t(r)], ready);
      const double end = start + (a.phase == Phase::forward ? tf : tb);
      done[{a.stage, a.micro, a.phase == Phase::forward ? 0 : 1}] = end;
      free_at[size_t(r)] = end;
      t.per_rank[size_t(r)].push_back({a, start, end});
      ++next[size_t(r)];
      --remaining;
      // The rank whose action consumes this output: the next stage's forward, the previous
      // stage's backward (the last stage's backward follows its own forward, on this rank).
      const int consumer = a.phase == Phase::forward ? (a.stage + 1 < S ? s.rank_of(a.stage + 1) : r)
                           : a.stage > 0             ? s.rank_of(a.stage - 1)
                                                     : r;
      if (consumer != r && !waiting_to_try[size_t(consumer)]) {
        waiting_to_try[size_t(consumer)] = 1;
        to_try.push_back(consumer);
      }
    }
  }
  SG_CHECK(remaining == 0, "pipeline: schedule '", s.name, "' deadlocks (every rank waits on another)");
  for (double f : free_at) t.makespan = std::max(t.makespan, f);
  return t;
}

double Timeline::bubble_fraction() const {
  double idle = 0, busy = 0;
  for (const auto& r : per_rank) {
    double b = 0;
    for (const auto& a : r) b += a.end - a.start;
    busy += b;
    idle += makespan - b;
  }
  return busy > 0 ? idle / busy : 0;
}

int Timeline::peak_in_flight(int rank) const {
  int cur = 0, peak = 0;
  for (const auto& a : per_rank[size_t(rank)]) {
    cur += a.action.phase == Phase::forward ? 1 : -1;
    peak = std::max(peak, cur);
  }
  return peak;
}

}  // namespace sg::parallel::pp
