// --trace: each rank records Chrome trace events on named tracks; rank 0 merges the parts into
// one file that Perfetto and chrome://tracing open (pid = rank, tid = track).
#include "tests/catch.h"
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/trace.h"
#include "tests/cli_support.h"

namespace fs = std::filesystem;
using nlohmann::json;
using sg::testing::ScratchDir;

namespace {

json load(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE(f.good());
  return json::parse(f);  // throws (fails the test) unless the whole file is valid JSON
}

// The name each (pid, tid) is given by its "thread_name" metadata event.
std::map<std::pair<int, int>, std::string> track_names(const json& trace) {
  std::map<std::pair<int, int>, std::string> names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") names[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"];
  return names;
}

std::vector<json> complete_events(const json& trace, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["name"] == name) out.push_back(e);
  return out;
}

// The format draws only nested slices: on every (pid, tid) two events are disjoint or one holds the other.
bool every_track_nests(const json& trace) {
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> by_track;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") {
      const double ts = e["ts"], dur = e["dur"];
      by_track[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back({ts, ts + dur});
    }
  for (const auto& [track, spans] : by_track)
    for (const auto& a : spans)
      for (const auto& b : spans) {
        const bool disjoint = a.second <= b.first || b.second <= a.first;
        const bool nested = (a.first <= b.first && b.second <= a.second) || (b.first <= a.first && a.second <= b.second);
        if (!disjoint && !nested) return false;
      }
  return true;
}

bool part_files_left(const fs::path& dir) {
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string n = f.path().filename().string();
    if (n.find(".rank") != std::string::npos || n.find(".tmp") != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("the trace recorder records nothing while it is off") {
  ScratchDir d("trace_off");
  const std::string path = (d.path / "t.json").string();
  sg::trace::stop();
  REQUIRE_FALSE(sg::trace::enabled());
  {
    sg::trace::Scope s("forward", "compute");
    sg::trace::complete("all_reduce", "comm: dp", 0, 5);
    sg::trace::counter("memory", {{"param", 1.0}});
  }
  sg::trace::write_rank_file(path);
  const json part = load(sg::trace::rank_file(path, 0));
  for (const auto& e : part["traceEvents"]) REQUIRE(e["ph"] == "M");
}

TEST_CASE("events of three ranks merge into one valid trace: every rank, every track named, slices nested") {
  ScratchDir d("trace_merge");
  const std::string path = (d.path / "merged.json").string();
  const int dp_group = 0;  // any address names a group
  for (int rank = 0; rank < 3; ++rank) {
    sg::trace::start(rank);
    sg::trace::name_group(&dp_group, "dp");
    {
      sg::trace::Scope step("step", "compute", {{"step", 1}});
      {
        sg::trace::Scope fwd("forward", "compute", {{"micro", 0}});
      }
      // Two all-gathers in flight at once (a prefetch): they overlap without nesting.
      const double t = sg::trace::now_us();
      sg::trace::complete("all_gather", sg::trace::comm_track(&dp_group, 3), t, 100, {{"bytes", 4096}, {"ranks", 3}});
      sg::trace::complete("all_gather", sg::trace::comm_track(&dp_group, 3), t + 50, 100, {{"bytes", 4096}, {"ranks", 3}});
      sg::trace::complete("reduce_scatter", sg::trace::comm_track(nullptr, 3), t + 10, 10, {{"unit", "h.0"}});
      sg::trace::counter("memory", {{"param", 1000.0 * (rank + 1)}, {"grad", 0.0}});
    }
    // Threads append concurrently (collectives complete on communication threads); their
    // overlapping slices take as many lanes of the "worker" track as they need.
    std::vector<std::thread> threads;
    for (int k = 0; k < 4; ++k)
      threads.emplace_back([] {
        for (int i = 0; i < 50; ++i) sg::trace::Scope s("backward", "worker");
      });
    for (auto& t : threads) t.join();
    sg::trace::write_rank_file(path);
    sg::trace::stop();
    REQUIRE(fs::exists(sg::trace::rank_file(path, rank)));
  }
  sg::trace::merge_rank_files(path, 3);

  const json trace = load(path);
  REQUIRE_FALSE(part_files_left(d.path));
  std::set<int> pids, named;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X") {
      pids.insert(e["pid"].get<int>());
      REQUIRE(e["dur"].get<double>() >= 0);
      REQUIRE(e.contains("ts"));
    }
    if (e["ph"] == "M" && e["name"] == "process_name") {
      REQUIRE(e["args"]["name"] == "rank " + std::to_string(e["pid"].get<int>()));
      named.insert(e["pid"].get<int>());
    }
  }
  REQUIRE(pids == std::set<int>{0, 1, 2});
  REQUIRE(named == std::set<int>{0, 1, 2});
  const auto names = track_names(trace);
  for (int rank = 0; rank < 3; ++rank) {
    std::set<std::string> mine;
    for (const auto& [key, name] : names)
      if (key.first == rank && name.rfind("worker", 0) != 0) mine.insert(name);
    // The second all-gather overlaps the first: it moves to a second lane of the dp track.
    REQUIRE(mine == std::set<std::string>{"compute", "comm: dp", "comm: dp (2)", "comm: group 1 (3 ranks)", "memory"});
  }
  REQUIRE(complete_events(trace, "all_gather").size() == 6);
  REQUIRE(complete_events(trace, "backward").size() == 3 * 4 * 50);
  REQUIRE(complete_events(trace, "reduce_scatter")[0]["args"]["unit"] == "h.0");
  REQUIRE(complete_events(trace, "step")[0]["args"]["step"] == 1);
  int counters = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "C") {
      ++counters;
      REQUIRE(e["args"]["param"].get<double>() == 1000.0 * (e["pid"].get<int>() + 1));
    }
  REQUIRE(counters == 3);
  REQUIRE(every_track_nests(trace));
}

TEST_CASE("merging names the rank whose part is missing") {
  ScratchDir d("trace_missing");
  const std::string path = (d.path / "t.json").string();
  sg::trace::start(0);
  sg::trace::write_rank_file(path);
  sg::trace::stop();
  REQUIRE_THROWS_WITH(sg::trace::merge_rank_files(path, 2), Catch::Contains("rank 1's part") && Catch::Contains(".rank1.json"));
  REQUIRE_FALSE(fs::exists(path));
}

TEST_CASE("train --trace on 2 ranks writes one merged trace: zero3's gathers and reduce-scatters, the pipeline's F/B actions", "[cli][mpi]") {
  ScratchDir d("trace_cli");
  const std::string small = " train --n-layer 2 --n-embd 32 --n-head 2 --seq-len 32 --batch-size 8 --micro-batch-size 2 "
                            "--threads 1 --steps 2 --eval-every 0 --eval-batches 1 --eval-problems 8";
  auto on_both_ranks = [](const std::vector<json>& events) {
    std::set<int> pids;
    for (const auto& e : events) pids.insert(e["pid"].get<int>());
    return pids == std::set<int>{0, 1};
  };

  // Trains with `flags` and --trace; the merged file, with no part file left beside it.
  auto traced_run = [&](const std::string& flags) {
    const fs::path path = d.path / "run.json";
    const auto r = sg::testing::run_shell(sg::testing::mpirun_shardgrad(2) + small + " " + flags + " --trace " + path.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    const json trace = load(path);
    REQUIRE_FALSE(part_files_left(d.path));
    REQUIRE(every_track_nests(trace));
    return trace;
  };

  SECTION("zero3") {
    const json trace = traced_run("--strategy zero3");
    const auto names = track_names(trace);
    for (const char* kind : {"all_gather", "reduce_scatter"}) {
      const auto events = complete_events(trace, kind);
      REQUIRE(on_both_ranks(events));
      for (const auto& e : events) {
        REQUIRE(names.at({e["pid"].get<int>(), e["tid"].get<int>()}).rfind("comm: ", 0) == 0);
        REQUIRE(e["args"]["bytes"].get<int64_t>() > 0);
        REQUIRE(e["args"]["ranks"] == 2);
      }
    }
    REQUIRE(on_both_ranks(complete_events(trace, "gather")));   // fsdp: waiting for a unit's parameters
    REQUIRE(on_both_ranks(complete_events(trace, "release")));  // and freeing them
    REQUIRE(complete_events(trace, "step").size() == 2 * 2);
    REQUIRE(complete_events(trace, "forward").size() == 2 * 2 * 2);  // ranks x steps x micro-batches
    REQUIRE(on_both_ranks(complete_events(trace, "optimizer")));
    bool memory = false;
    for (const auto& e : trace["traceEvents"]) memory = memory || (e["ph"] == "C" && e["args"].contains("param"));
    REQUIRE(memory);
  }

  SECTION("pipeline") {
    const json trace = traced_run("--pp 2");
    const auto names = track_names(trace);
    for (const char* phase : {"F", "B"}) {
      const auto actions = complete_events(trace, phase);
      REQUIRE(on_both_ranks(actions));
      REQUIRE(actions.size() == 2 * 2 * 4);  // steps x ranks (one stage each) x micro-batches (8 rows / 2)
      for (const auto& a : actions) {
        REQUIRE(names.at({a["pid"].get<int>(), a["tid"].get<int>()}) == "pipeline");
        REQUIRE(a["args"]["stage"] == a["pid"]);  // 2 stages on 2 ranks: stage s on rank s
      }
    }
    REQUIRE(on_both_ranks(complete_events(trace, "send")));
    REQUIRE(on_both_ranks(complete_events(trace, "recv")));
  }
}
