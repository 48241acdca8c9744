#include "bench/report/step_metrics.h"

#include <algorithm>

#include "core/ledger.h"
#include "autograd/ops.h"

namespace sg::report {

namespace {
// One rank's figures as a fixed-length row of doubles (int64 byte counts below 2^53 stay exact).
constexpr int kMemFields = 2 * (kNumMemCategories + 1), kCommFields = 2 * comm::kNumCommKinds;
constexpr int kRow = 1 + kMemFields + kCommFields + 3;
}  // namespace

nlohmann::json step_metrics(Device device, const std::vector<const comm::ProcessGroup*>& counted,
                            comm::ProcessGroup* gather, const parallel::pp::Timeline* timeline,
                            int timeline_row) {
  const int rank = gather ? gather->rank() : 0, size = gather ? gather->size() : 1;
  std::vector<double> row(kRow, 0.0);
  row[0] = rank;
  const MemStats m = Ledger::global().stats(device);
  for (int c = 0; c < kNumMemCategories; ++c) {
    row[size_t(1 + 2 * c)] = double(m.current[size_t(c)]);
    row[size_t(2 + 2 * c)] = double(m.peak[size_t(c)]);
  }
  row[size_t(kMemFields - 1)] = double(m.total_current);
  row[size_t(kMemFields)] = double(m.total_peak);
  comm::CommCounters sum;
  for (const comm::ProcessGroup* g : counted)
    if (g) {
      comm::CommCounters c = g->counters();
      for (int k = 0; k < comm::kNumCommKinds; ++k) {
        sum.kinds[size_t(k)].calls += c.kinds[size_t(k)].calls;
        sum.kinds[size_t(k)].bytes += c.kinds[size_t(k)].bytes;
      }
    }
  for (int k = 0; k < comm::kNumCommKinds; ++k) {
    row[size_t(1 + kMemFields + 2 * k)] = double(sum.kinds[size_t(k)].calls);
    row[size_t(2 + kMemFields + 2 * k)] = double(sum.kinds[size_t(k)].bytes);
  }
  const size_t tl = size_t(1 + kMemFields + kCommFields);
  const int row_of_mine = timeline_row >= 0 ? timeline_row : rank;
  if (timeline && size_t(row_of_mine) < timeline->per_rank.size()) {
    row[tl] = 1;
    for (const auto& a : timeline->per_rank[size_t(row_of_mine)]) {
      row[tl + 1] += a.end - a.start;
      row[tl + 2] = std::max(row[tl + 2], a.end);
    }
  }
  std::vector<double> all = row;
  if (gather && size > 1) {
    Tensor local = from_vector(row, {kRow});
    Tensor out = empty({int64_t(kRow) * size}, DType::f64);
    gather->all_gather(out, local, comm::Sync::blocking);
    all = to_vector<double>(out);
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < size; ++r) {
    const double* v = all.data() + size_t(r) * kRow;
    nlohmann::json j;
    j["rank"] = int(v[0]);
    for (int c = 0; c < kNumMemCategories; ++c)
      j["mem"][mem_category_name(MemCategory(c))] = {{"current", int64_t(v[1 + 2 * c])}, {"peak", int64_t(v[2 + 2 * c])}};
    j["mem"]["total"] = {{"current", int64_t(v[kMemFields - 1])}, {"peak", int64_t(v[kMemFields])}};
    for (int k = 0; k < comm::kNumCommKinds; ++k)
      j["comm"][comm::comm_kind_name(comm::CommKind(k))] = {{"calls", int64_t(v[1 + kMemFields + 2 * k])},
                                                             {"bytes", int64_t(v[2 + kMemFields + 2 * k])}};
    if (v[tl] > 0) {
      j["busy_s"] = v[tl + 1];
      j["span_s"] = v[tl + 2];
    }
    ranks.push_back(j);
  }
  return {{"ranks", ranks}};
}

double measured_bubble(const nlohmann::json& ranks) {
  double makespan = 0, busy = 0, idle = 0;
  int timed = 0;
  for (const auto& r : ranks)
    if (r.contains("span_s")) {
      makespan = std::max(makespan, r["span_s"].get<double>());
      ++timed;
    }
  if (!timed) return -1;
  for (const auto& r : ranks)
    if (r.contains("busy_s")) {
      busy += r["busy_s"].get<double>();
      idle += makespan - r["busy_s"].get<double>();
    }
  return busy > 0 ? idle / busy : -1;
}

}  // namespace sg::report
