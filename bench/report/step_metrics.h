// Per-rank facts of one training step, for `--log-json` and `shardgrad bench`: every rank's ledger
// (current and peak bytes per category), its cumulative bytes per collective kind, and — under a
// pipeline — its busy time and the step's span, from which the bubble is measured.
#pragma once
#include <nlohmann/json.hpp>
#include <vector>

#include "core/device.h"
#include "parallel/comm/process_group.h"
#include "parallel/pp/schedule.h"

namespace sg::report {

// Collective over `gather` when it is non-null (every rank must call it, in step order); without
// it only this process's figures are reported. `counted`: the groups whose counters this rank's
// traffic lives in (summed; subgroups keep their own counters). `timeline`: the pipeline's actions
// of the step just run, of which row `timeline_row` (this rank's place in the pipeline; -1: its
// rank in `gather`) is this rank's, or null.
// Returns {"ranks": [{"rank", "mem": {cat: {current, peak}}, "comm": {kind: {calls, bytes}},
//          "busy_s"?, "span_s"?}, ...]} (meaningful on rank 0; the others get the same).
nlohmann::json step_metrics(Device device, const std::vector<const comm::ProcessGroup*>& counted,
                            comm::ProcessGroup* gather, const parallel::pp::Timeline* timeline,
                            int timeline_row = -1);

// The bubble measured from step_metrics' per-rank busy time and span: idle over busy, summed over
// ranks (the definition of Timeline::bubble_fraction), with the longest span as the makespan.
// Negative when the record has no pipeline timing.
double measured_bubble(const nlohmann::json& ranks);

}  // namespace sg::report
