// Chrome trace events (the Trace Event Format, which Perfetto and chrome://tracing open) for one
// process: "X" complete events on named tracks and "C" counters, written per rank and merged by
// rank 0 into one file where pid = rank and tid = track ("compute", "comm: <group>", "pipeline",
// "fsdp", and the "memory" counter of the ledger's bytes per category).
//
// Off by default: every call then costs one branch. Thread-safe: collectives complete on other
// threads. Events on a track that overlap without nesting (two collectives in flight) are moved to
// extra lanes of that track when the file is written, since the format draws only nested slices.
#pragma once
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <variant>

#include "core/device.h"

namespace sg::trace {

namespace detail {
extern std::atomic<bool> enabled;
}
inline bool enabled() { return detail::enabled.load(std::memory_order_relaxed); }

// Starts recording for this rank with an empty buffer, times measured from now (call it right
// after a barrier so the ranks share an origin). stop() ends recording and drops the events.
void start(int rank);
void stop();

double now_us();  // microseconds since start()

// A trace argument: shown with the event ("bytes", "unit", "micro", ...).
struct Arg {
  const char* key;
  std::variant<int64_t, double, std::string_view> value;
  Arg(const char* k, int64_t v) : key(k), value(v) {}
  Arg(const char* k, int v) : key(k), value(int64_t(v)) {}
  Arg(const char* k, size_t v) : key(k), value(int64_t(v)) {}
  Arg(const char* k, double v) : key(k), value(v) {}
  Arg(const char* k, std::string_view v) : key(k), value(v) {}
  Arg(const char* k, const char* v) : key(k), value(std::string_view(v)) {}
};
using Args = std::initializer_list<Arg>;

// One "X" event: `name` on `track` from ts_us for dur_us.
void complete(std::string_view name, std::string_view track, double ts_us, double dur_us, Args args = {});
// One "C" event: a counter with one series per value, on its own track `name`.
void counter(std::string_view name, std::initializer_list<std::pair<std::string_view, double>> values);
// The "memory" counter: the ledger's current bytes per category on `device`.
void memory(Device device);

// The track of a process group's collectives: "comm: <name>" for a group named by name_group(),
// else "comm: group <k> (<n> ranks)" in the order groups are first seen.
std::string comm_track(const void* group, int group_size);
void name_group(const void* group, std::string name);  // null groups and second names are ignored

// Records the enclosing block as one "X" event (nothing when tracing is off).
class Scope {
 public:
  Scope(std::string_view name, std::string_view track, Args args = {});
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  struct Open;
  std::unique_ptr<Open> open_;  // null when tracing is off
};

// The part file rank `rank` writes for the merged file `path`: PATH.rank<N>.json.
std::string rank_file(const std::string& path, int rank);
// This rank's events, with the "rank N" and track name metadata, as its part of `path`.
void write_rank_file(const std::string& path);
// Rank 0, after every rank has written its part (a barrier): one file with all ranks' events,
// written atomically (PATH.tmp, then renamed); the parts are deleted. Names a missing part.
void merge_rank_files(const std::string& path, int ranks);
// The end of a traced run on every rank: writes this rank's part, runs `barrier`, and rank 0
// merges. Stops recording.
template <class Barrier>
void finish(const std::string& path, int rank, int ranks, Barrier&& barrier) {
  write_rank_file(path);
  stop();
  barrier();
  if (rank == 0) merge_rank_files(path, ranks);
}

}  // namespace sg::trace
