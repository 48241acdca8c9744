// `shardgrad bench` results: one row per layout (its train flags, rank count, status), the figures
// measured from `train --log-json` (median step time and tokens/s after warm-up, peak ledger bytes
// per rank per category, bytes per collective kind per rank per step, measured bubble), the
// planner's prediction for the same layout, and the files written from them (JSON, CSV, HTML).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/report/planner.h"

namespace sg::report {

struct BenchLayout {
  std::string name;  // "zero2", "pp-1f1b", ...
  int ranks = 1;     // processes (mpirun -np); 1 runs without mpirun
  std::string args;  // train flags of this layout ("--strategy zero2")
};

// The default matrix for `ranks` processes: single, dp, ddp, zero1-3, fsdp variants, tp, tp+sp,
// every pipeline schedule, and a 3-D layout (those train refuses are reported as refused).
std::vector<BenchLayout> default_matrix(int ranks);
// [{"name": "...", "ranks": 2, "args": "--strategy ddp"}, ...]
std::vector<BenchLayout> matrix_from_json(const nlohmann::json& j, const std::string& file);  // file: for errors

// Summarises one layout's --log-json records (every step, rank 0's file), dropping the first
// `warmup` steps: {"steps", "step_ms", "tokens_per_s", "loss_last", "mem_peak": [per rank {cat: bytes}],
// "comm_per_step": [per rank {kind: bytes}], "bubble"?}.
nlohmann::json summarise_log(const std::vector<nlohmann::json>& steps, int warmup);
// A layout's `train --simulate --log-json` record as summarise_log's fields: "mem_peak", "mem_end"
// and "comm_per_step" (the last step's bytes) per rank, "simulated": true, and no timing.
nlohmann::json summarise_simulation(const nlohmann::json& record);

// One layout's row from its runs in `passes` passes over the matrix (bench --repeat), each a row
// {"name", "ranks", "args", "status", "measured"? | "reason"?, ...}: the first pass's row, with
// step_ms, tokens_per_s and bubble the medians over the passes and, for more than one,
// "passes" and "step_ms_range" [min, max] of the passes' medians. A pass that did not end "ok"
// gives the row its status and reason ("pass K: ...").
nlohmann::json combine_passes(const std::vector<nlohmann::json>& passes);

// Memory over time within the last traced step, from a merged `train --trace` file: per rank (the
// trace's pid), the "memory" counter samples whose time falls in that rank's last "step" event on
// the compute track (ended where an "evaluate" inside it starts): {"step", "ranks": [{"rank",
// "step_ms", "t_ms": [...from the step's start], "bytes": {category: [...]}}]}. Null when the trace
// has no step with samples.
nlohmann::json memory_timeline(const nlohmann::json& trace);

// The planner's layout for a bench row (its train flags read back), or false when the row's
// strategy is not one the planner models (dp over devices of one process).
bool planner_layout(const BenchLayout& row, int64_t batch, Layout& out);
// The value following `--flag` in a flag string: the first one ("" when absent; "1" for a bare toggle).
std::string flag_value(const std::string& args, const std::string& flag);
// The bucket (ddp) or stripe (zero1/zero2) bytes a row's --bucket-mb gives; train's 25 MiB without.
int64_t row_bucket_bytes(const BenchLayout& row);
// Gives every ddp, zero1 and zero2 row without a --bucket-mb of its own `--bucket-mb mb`.
void set_default_buckets(std::vector<BenchLayout>& matrix, const std::string& mb);

// One line per layout: name, ranks, status, medians, bubble, rank 0's peak per category and bytes
// per collective kind.
std::string results_csv(const nlohmann::json& results);

// One self-contained HTML page: stacked memory per rank per layout, throughput, communication per
// kind, each pipeline run's Gantt chart, memory over one step of each layout (its
// "memory_timeline"), and predicted against measured.
std::string results_html(const nlohmann::json& results);

}  // namespace sg::report
