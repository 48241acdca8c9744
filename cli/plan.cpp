// shardgrad plan: what a layout will do before running it. Today: the pipeline schedule — each
// rank's actions, the bubble measured on the simulated timeline against its formula, the
// activations each rank holds, and the timeline as an SVG picture.
#include <cstdio>
#include <fstream>

#include "bench/report/timeline_svg.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "parallel/pp/schedule.h"

namespace sg::cli {

int plan_main(int argc, char** argv) {
  Args a("plan", "Simulate a pipeline schedule: bubble, activations in flight, an SVG timeline.");
  a.flag("pp", "4", "pipeline stages (ranks)");
  a.flag("micro-batches", "8", "micro-batches per step");
  a.flag("pp-schedule", "1f1b", "gpipe | 1f1b | interleaved");
  a.flag("virtual-stages", "2", "interleaved: model chunks per rank");
  a.flag("backward-ratio", "2", "backward time / forward time");
  a.flag("svg", "", "write the timeline picture here");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const std::string kind = a.str("pp-schedule");
  const int p = int(a.i64("pp")), m = int(a.i64("micro-batches"));
  const int v = kind == "interleaved" ? int(a.i64("virtual-stages")) : 1;
  const double ratio = a.f64("backward-ratio");
  SG_CHECK(ratio > 0, "plan: --backward-ratio must be > 0");
  parallel::pp::Schedule s = parallel::pp::make_schedule(kind, p, m, v);
  // A chunk holds 1/v of a rank's layers: its actions take 1/v as long.
  parallel::pp::Timeline t = parallel::pp::simulate(s, 1.0 / v, ratio / v);
  const double formula = double(p - 1) / double(v * m);
  std::printf("%s schedule, %d stages x %d chunk(s), %d micro-batches\n", kind.c_str(), p, v, m);
  for (int r = 0; r < p; ++r) {
    std::printf("rank %d:", r);
    for (const auto& act : s.per_rank[size_t(r)])
      std::printf(" %c%d", act.phase == parallel::pp::Phase::forward ? 'F' : 'B', act.micro);
    std::printf("   (peak %d %s activations held)\n", t.peak_in_flight(r), v > 1 ? "chunk x micro-batch" : "micro-batch");
  }
  std::printf("bubble: %.4f of busy time (formula (p-1)/(v m) = %.4f); step = %.2f times one stage's forward\n",
              t.bubble_fraction(), formula, t.makespan);
  if (!a.str("svg").empty()) {
    std::ofstream f(a.str("svg"));
    SG_CHECK(f.good(), "plan: cannot write ", a.str("svg"));
    f << report::timeline_svg(t, kind + ", p=" + std::to_string(p) + ", m=" + std::to_string(m) +
                                     (v > 1 ? ", v=" + std::to_string(v) : ""));
    std::printf("wrote %s\n", a.str("svg").c_str());
  }
  return 0;
}

}  // namespace sg::cli
