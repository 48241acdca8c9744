#include "core/trace.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/ledger.h"

namespace sg::trace {

namespace detail {
std::atomic<bool> enabled{false};
}

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Event {
  char ph;  // 'X' or 'C'
  std::string name;
  int track;
  double ts, dur;  // microseconds
  json args;
};

struct Recorder {
  std::mutex mu;
  int rank = 0;
  Clock::time_point origin = Clock::now();
  std::vector<Event> events;
  std::vector<std::string> tracks;
  std::map<const void*, std::string> groups;  // group -> its track
  int unnamed_groups = 0;

  int track(std::string_view name) {  // caller holds mu
    auto it = std::find(tracks.begin(), tracks.end(), name);
    if (it != tracks.end()) return int(it - tracks.begin());
    tracks.emplace_back(name);
    return int(tracks.size()) - 1;
  }
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

json to_json(Args args) {
  json j = json::object();
  for (const Arg& a : args)
    std::visit([&](const auto& v) {
      if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string_view>) j[a.key] = std::string(v);
      else j[a.key] = v;
    }, a.value);
  return j;
}

// Tracks in the same order on every rank: compute, pipeline, fsdp, comm: ..., others, memory.
int track_rank(const std::string& t) {
  if (t == "compute") return 0;
  if (t == "pipeline") return 1;
  if (t == "fsdp") return 2;
  if (t.rfind("comm: ", 0) == 0) return 3;
  if (t == "memory") return 5;
  return 4;
}

json metadata(const char* what, int rank, int tid, json args) {
  json m = {{"ph", "M"}, {"name", what}, {"pid", rank}, {"args", std::move(args)}};
  if (tid >= 0) m["tid"] = tid;
  return m;
}

void write_events(std::ostream& f, const std::vector<json>& events) {
  f << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  for (size_t i = 0; i < events.size(); ++i) f << events[i].dump() << (i + 1 < events.size() ? ",\n" : "\n");
  f << "]}\n";
}

}  // namespace

void start(int rank) {
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.rank = rank;
    r.origin = Clock::now();
    r.events.clear();
    r.tracks.clear();
    r.groups.clear();
    r.unnamed_groups = 0;
  }
  detail::enabled = true;
}

void stop() {
  detail::enabled = false;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.clear();
}

double now_us() { return std::chrono::duration<double, std::micro>(Clock::now() - recorder().origin).count(); }

void complete(std::string_view name, std::string_view track, double ts_us, double dur_us, Args args) {
  if (!enabled()) return;
  Recorder& r = recorder();
  json a = to_json(args);
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back(Event{'X', std::string(name), r.track(track), ts_us, dur_us, std::move(a)});
}

namespace {
void push_counter(std::string_view name, json values) {
  Recorder& r = recorder();
  const double ts = now_us();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back(Event{'C', std::string(name), r.track(name), ts, 0, std::move(values)});
}
}  // namespace

void counter(std::string_view name, std::initializer_list<std::pair<std::string_view, double>> values) {
  if (!enabled()) return;
  json a = json::object();
  for (const auto& [k, v] : values) a[std::string(k)] = v;
  push_counter(name, std::move(a));
}

void memory(Device device) {
  if (!enabled()) return;
  const MemStats s = Ledger::global().stats(device);
  json a = json::object();
  for (int c = 0; c < kNumMemCategories; ++c) a[mem_category_name(MemCategory(c))] = s.current[size_t(c)];
  push_counter("memory", std::move(a));
}

std::string comm_track(const void* group, int group_size) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.groups.find(group);
  if (it != r.groups.end()) return it->second;
  std::string t = "comm: group " + std::to_string(++r.unnamed_groups) + " (" + std::to_string(group_size) + " ranks)";
  r.groups.emplace(group, t);
  return t;
}

void name_group(const void* group, std::string name) {
  if (!group) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.groups.emplace(group, "comm: " + name);
}

struct Scope::Open {
  std::string name, track;
  double start;
  json args;
};

Scope::Scope(std::string_view name, std::string_view track, Args args) {
  if (!enabled()) return;
  open_ = std::make_unique<Open>(Open{std::string(name), std::string(track), now_us(), to_json(args)});
}

Scope::~Scope() {
  if (!open_ || !enabled()) return;
  const double end = now_us();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back(Event{'X', std::move(open_->name), r.track(open_->track), open_->start, end - open_->start,
                           std::move(open_->args)});
}

void write_rank_file(const std::string& path) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<int> order(r.tracks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return std::make_pair(track_rank(r.tracks[size_t(a)]), r.tracks[size_t(a)]) <
           std::make_pair(track_rank(r.tracks[size_t(b)]), r.tracks[size_t(b)]);
  });
  std::vector<const Event*> sorted;
  for (const Event& e : r.events) sorted.push_back(&e);
  // Parents before children: by start, the longer first.
  std::stable_sort(sorted.begin(), sorted.end(), [](const Event* a, const Event* b) {
    return a->ts != b->ts ? a->ts < b->ts : a->dur > b->dur;
  });
  std::vector<json> out;
  out.push_back(metadata("process_name", r.rank, -1, {{"name", "rank " + std::to_string(r.rank)}}));
  out.push_back(metadata("process_sort_index", r.rank, -1, {{"sort_index", r.rank}}));
  int next_tid = 1;
  for (int t : order) {
    // Lanes of this track: each a stack of the ends of the slices open at the current start; an
    // event joins the first lane where it nests inside (or follows) what is open.
    std::vector<std::vector<double>> lanes;
    std::vector<json> events;
    for (const Event* e : sorted) {
      if (e->track != t) continue;
      size_t lane = 0;
      if (e->ph == 'X') {
        const double end = e->ts + e->dur;
        for (; lane < lanes.size(); ++lane) {
          auto& open = lanes[lane];
          while (!open.empty() && open.back() <= e->ts) open.pop_back();
          if (open.empty() || open.back() >= end) break;
        }
        if (lane == lanes.size()) lanes.emplace_back();
        lanes[lane].push_back(end);
      }
      json j = {{"ph", std::string(1, e->ph)}, {"name", e->name}, {"cat", r.tracks[size_t(t)]},
                {"pid", r.rank},               {"tid", next_tid + int(lane)}, {"ts", e->ts}, {"args", e->args}};
      if (e->ph == 'X') j["dur"] = e->dur;
      events.push_back(std::move(j));
    }
    const int n_lanes = std::max<int>(1, int(lanes.size()));
    for (int l = 0; l < n_lanes; ++l) {
      const std::string name = r.tracks[size_t(t)] + (l ? " (" + std::to_string(l + 1) + ")" : "");
      out.push_back(metadata("thread_name", r.rank, next_tid + l, {{"name", name}}));
      out.push_back(metadata("thread_sort_index", r.rank, next_tid + l, {{"sort_index", next_tid + l}}));
    }
    out.insert(out.end(), std::make_move_iterator(events.begin()), std::make_move_iterator(events.end()));
    next_tid += n_lanes;
  }
  const std::string part = rank_file(path, r.rank);
  std::ofstream f(part);
  SG_CHECK(f.good(), "trace: cannot write ", part);
  write_events(f, out);
  f.close();
  SG_CHECK(f.good(), "trace: writing ", part, " failed");
}

std::string rank_file(const std::string& path, int rank) { return path + ".rank" + std::to_string(rank) + ".json"; }

void merge_rank_files(const std::string& path, int ranks) {
  std::vector<json> all;
  for (int r = 0; r < ranks; ++r) {
    const std::string part = rank_file(path, r);
    std::ifstream f(part);
    SG_CHECK(f.good(), "trace: rank ", r, "'s part ", part, " is missing");
    json j;
    try {
      j = json::parse(f);
    } catch (const json::exception& e) {
      throw Error(str("trace: rank ", r, "'s part ", part, " is not valid JSON: ", e.what()));
    }
    for (auto& e : j.at("traceEvents")) all.push_back(std::move(e));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    SG_CHECK(f.good(), "trace: cannot write ", tmp);
    write_events(f, all);
    f.close();
    SG_CHECK(f.good(), "trace: writing ", tmp, " failed");
  }
  std::filesystem::rename(tmp, path);
  for (int r = 0; r < ranks; ++r) std::filesystem::remove(rank_file(path, r));
}

}  // namespace sg::trace
