// Pipeline schedules: every rank's action list is complete and legal, and the simulated timeline
// shows the textbook bubble and activation memory: (p-1)/m for GPipe and 1F1B, (p-1)/(v m)
// interleaved; m micro-batches alive under GPipe, at most p under 1F1B.
#include "tests/catch.h"
#include <set>

#include "parallel/pp/schedule.h"

using namespace sg::parallel::pp;

namespace {
// Every (stage, micro) forward and backward appears exactly once, on the stage's rank, and
// each rank runs a micro-batch's backward of a stage after its forward.
void check_complete(const Schedule& s) {
  std::set<std::tuple<int, int, int>> seen;
  for (int r = 0; r < s.ranks; ++r) {
    std::set<std::pair<int, int>> forwarded;
    for (const Action& a : s.per_rank[size_t(r)]) {
      REQUIRE(s.rank_of(a.stage) == r);
      REQUIRE(seen.insert({a.stage, a.micro, int(a.phase)}).second);
      if (a.phase == Phase::forward) forwarded.insert({a.stage, a.micro});
      else REQUIRE(forwarded.count({a.stage, a.micro}) == 1);
    }
  }
  REQUIRE(seen.size() == size_t(2 * s.stages() * s.micro_batches));
}
}  // namespace

TEST_CASE("gpipe and 1f1b: a bubble of (p-1)/m, measured from the simulated timeline", "[pp]") {
  for (int p : {2, 4}) {
    for (int m : {4, 8, 12}) {
      for (const char* kind : {"gpipe", "1f1b"}) {
        INFO(kind << " p=" << p << " m=" << m);
        Schedule s = make_schedule(kind, p, m);
        check_complete(s);
        Timeline t = simulate(s, 1.0, 2.0);
        REQUIRE(t.makespan == Approx((m + p - 1) * 3.0));
        REQUIRE(t.bubble_fraction() == Approx(double(p - 1) / m));
      }
    }
  }
}

TEST_CASE("activations in flight: m under gpipe, at most p under 1f1b", "[pp]") {
  const int p = 4, m = 8;
  Timeline g = simulate(gpipe(p, m), 1, 2), o = simulate(one_f_one_b(p, m), 1, 2);
  for (int r = 0; r < p; ++r) {
    REQUIRE(g.peak_in_flight(r) == m);
    REQUIRE(o.peak_in_flight(r) == p - r);
  }
}

TEST_CASE("interleaved 1f1b over v chunks: the bubble shrinks to (p-1)/(v m)", "[pp]") {
  for (int v : {2, 3}) {
    for (int m : {4, 8}) {
      const int p = 4;
      INFO("p=" << p << " m=" << m << " v=" << v);
      Schedule s = interleaved(p, m, v);
      check_complete(s);
      // each chunk holds 1/v of a rank's layers, so its forward and backward take 1/v as long
      Timeline t = simulate(s, 1.0 / v, 2.0 / v);
      REQUIRE(t.bubble_fraction() == Approx(double(p - 1) / (v * m)));
      REQUIRE(t.bubble_fraction() < simulate(one_f_one_b(p, m), 1, 2).bubble_fraction());
    }
  }
}

TEST_CASE("interleaved over one chunk is 1f1b: the same bubble, 1f1b's activations in flight, any m", "[pp]") {
  const Schedule s = make_schedule("interleaved", 4, 6, 1);  // m = 6 is no multiple of p = 4
  CHECK(s.name == "1f1b");
  CHECK(s.per_rank == one_f_one_b(4, 6).per_rank);
  // interleaved(p, m, 1) itself warms up twice as deep for nothing: more activations held
  CHECK(simulate(interleaved(4, 8, 1), 1, 2).peak_in_flight(0) > simulate(make_schedule("interleaved", 4, 8, 1), 1, 2).peak_in_flight(0));
}

TEST_CASE("the default micro-batch: a multiple of the stages, at least 4 per stage, else the fewest that fill the pipeline", "[pp]") {
  CHECK(default_micro_batch_size(32, 1, "1f1b", 1) == 32);       // no pipeline: the whole batch
  CHECK(default_micro_batch_size(32, 2, "1f1b", 1) == 4);        // m = 8 = 4p
  CHECK(default_micro_batch_size(12, 4, "1f1b", 1) == 1);        // m = 12: short of 4p = 16, the most the rows allow
  CHECK(default_micro_batch_size(6, 4, "1f1b", 1) == 1);         // no multiple of 4 divides 6: m = 6 >= p
  CHECK(default_micro_batch_size(9, 4, "gpipe", 1) == 1);        // m = 9 (3 and 1 do not fill 4 stages)
  CHECK(default_micro_batch_size(10, 4, "1f1b", 1) == 2);        // m = 5, the fewest >= 4 dividing 10
  CHECK(default_micro_batch_size(3, 4, "1f1b", 1) == 1);         // fewer rows than stages: a row each
  CHECK(default_micro_batch_size(6, 4, "interleaved", 1) == 1);  // one chunk: 1f1b's rule
  REQUIRE_THROWS_WITH(default_micro_batch_size(6, 4, "interleaved", 2),
                      Catch::Contains("--pp-schedule interleaved needs a number of micro-batches that is a multiple of "
                                      "--pp 4, and none divides the rank's 6 rows"));
}

TEST_CASE("impossible pipelines are refused with the reason", "[pp]") {
  REQUIRE_THROWS_WITH(interleaved(4, 6, 2), Catch::Contains("multiple of the pipeline stages (4)"));
  REQUIRE_THROWS_WITH(make_schedule("zigzag", 2, 4), Catch::Contains("unknown schedule 'zigzag'"));
  REQUIRE_THROWS_WITH(gpipe(2, 0), Catch::Contains("at least one micro-batch"));
}

#include "bench/report/timeline_svg.h"

TEST_CASE("the timeline picture has one box per action and states the measured bubble", "[pp][report]") {
  Timeline t = simulate(one_f_one_b(2, 4), 1, 2);
  std::string svg = sg::report::timeline_svg(t, "1f1b");
  size_t boxes = 0;
  for (size_t p = svg.find("<title>"); p != std::string::npos; p = svg.find("<title>", p + 1)) ++boxes;
  REQUIRE(boxes == 2 * 2 * 4);
  REQUIRE(svg.find("bubble 25.0%") != std::string::npos);  // (p-1)/m = 1/4
  REQUIRE(svg.rfind("</svg>") != std::string::npos);
}

// The simulation follows the actions: a rank is tried again when an input it may wait on is
// done, not in sweeps over every rank (a sweep per stage of each backward wave: p² in all, minutes
// for `plan --pp 524288`). An order that can never run is still refused.
// (How fast the simulation is, since it wakes only the rank an action feeds, is not timed here:
// at 16384 stages it takes about a second, where sweeping every rank took minutes.)
TEST_CASE("a pipeline of 16384 stages simulates to the bubble formula and a deadlocked one is refused", "[pp]") {
  const int p = 16384;
  Timeline t = simulate(one_f_one_b(p, 2), 1, 2);
  CHECK(t.makespan == Approx(3.0 * (p - 1 + 2)));  // (p - 1 + m) forward-and-backward slots
  CHECK(t.bubble_fraction() == Approx(double(p - 1) / 2));
  // rank 0 runs micro-batch 0's backward before its forward: every rank waits on another
  Schedule stuck{"stuck", 2, 1, 1, {{{0, 0, Phase::backward}, {0, 0, Phase::forward}}, {{1, 0, Phase::forward}, {1, 0, Phase::backward}}}};
  REQUIRE_THROWS_WITH(simulate(stuck, 1, 2), Catch::Contains("deadlocks"));
}
