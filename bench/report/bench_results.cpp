#include "bench/report/bench_results.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <sstream>

#include "bench/report/step_metrics.h"
#include "core/error.h"
#include "parallel/pp/schedule.h"

namespace sg::report {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::string flag_value(const std::string& args, const std::string& flag) {
  std::istringstream in(args);
  std::vector<std::string> words{std::istream_iterator<std::string>(in), {}};
  for (size_t i = 0; i < words.size(); ++i)
    if (words[i] == "--" + flag) return i + 1 < words.size() && words[i + 1].rfind("--", 0) != 0 ? words[i + 1] : "1";
  return "";
}

std::vector<BenchLayout> default_matrix(int n) {
  const std::string N = std::to_string(n);
  // The layouts of more than one axis take --ranks when it fits them, else their smallest size.
  const int two_axes = n >= 4 && n % 2 == 0 ? n : 4, three_axes = n >= 8 && n % 4 == 0 ? n : 8;
  std::vector<BenchLayout> m = {
      {"single", 1, ""},
      {"dp", 1, "--strategy dp --devices cpu:0,cpu:1"},
      {"ddp", n, "--strategy ddp"},
      {"zero1", n, "--strategy zero1"},
      {"zero2", n, "--strategy zero2"},
      {"zero3", n, "--strategy zero3"},
      {"fsdp-grad-op", n, "--strategy fsdp-grad-op"},
      {"hsdp", two_axes, "--strategy hsdp --shard-group-size " + std::to_string(two_axes / 2)},
      {"tp", n, "--tp " + N},
      {"tp+sp", n, "--tp " + N + " --sequence-parallel"},
      {"pp-gpipe", n, "--pp " + N + " --pp-schedule gpipe"},
      {"pp-1f1b", n, "--pp " + N + " --pp-schedule 1f1b"},
      {"pp-interleaved", n, "--pp " + N + " --pp-schedule interleaved --virtual-stages 2"},
      {three_axes == 8 ? "3d-dp2-tp2-pp2" : "3d-dp" + std::to_string(three_axes / 4) + "-tp2-pp2", three_axes,
       "--strategy zero1 --tp 2 --pp 2"},
      {"zero3+pp", two_axes, "--strategy zero3 --pp 2"},
  };
  return m;
}

std::vector<BenchLayout> matrix_from_json(const nlohmann::json& j, const std::string& file) {
  SG_CHECK(j.is_array(), "bench: --matrix ", file, ": expected a JSON array of {name, ranks, args}");
  std::vector<BenchLayout> m;
  for (const auto& row : j) {
    SG_CHECK(row.contains("name") && row["name"].is_string(), "bench: --matrix ", file, ": every row needs a \"name\" string");
    BenchLayout b;
    b.name = row["name"].get<std::string>();
    SG_CHECK(!row.contains("ranks") || row["ranks"].is_number_integer(), "bench: --matrix ", file, ": row ", b.name,
             ": \"ranks\" must be an integer, got ", row["ranks"].dump());
    SG_CHECK(!row.contains("args") || row["args"].is_string(), "bench: --matrix ", file, ": row ", b.name,
             ": \"args\" must be one string of train flags (\"--strategy zero2 --tp 2\"), got ", row["args"].dump());
    b.ranks = row.value("ranks", 1);
    b.args = row.value("args", std::string());
    SG_CHECK(b.ranks >= 1, "bench: --matrix ", file, ": row ", b.name, ": ranks must be >= 1");
    m.push_back(b);
  }
  return m;
}

nlohmann::json summarise_log(const std::vector<nlohmann::json>& steps, int warmup) {
  nlohmann::json s;
  const size_t first = std::min(steps.size(), size_t(std::max(0, warmup)));
  std::vector<double> ms, bubbles;
  double tokens = 0;  // per step: the same every step
  for (size_t i = first; i < steps.size(); ++i) {
    ms.push_back(steps[i].at("step_ms").get<double>());
    tokens = steps[i].at("tokens_per_s").get<double>() * ms.back() / 1e3;
    if (steps[i].contains("ranks")) {
      const double b = measured_bubble(steps[i]["ranks"]);
      if (b >= 0) bubbles.push_back(b);
    }
  }
  s["steps"] = ms.size();
  s["step_ms"] = median(ms);
  // the median step's throughput: with an even count the median of the steps' own tokens/s is
  // another pair's mean, and would not be the step time printed beside it
  s["tokens_per_s"] = ms.empty() ? 0.0 : tokens * 1e3 / median(ms);
  if (!steps.empty()) s["loss_last"] = steps.back().at("loss");
  if (!bubbles.empty()) s["bubble"] = median(bubbles);
  // --offload: rank 0's host ledger (the offloaded state), its peaks over the measured steps
  if (!ms.empty() && steps.back().contains("mem_host")) {
    nlohmann::json host = nlohmann::json::object();
    for (size_t i = first; i < steps.size(); ++i) {
      if (!steps[i].contains("mem_host")) continue;
      for (const auto& [cat, v] : steps[i]["mem_host"].items())  // (a temporary's items() would dangle)
        host[cat] = std::max(host.value(cat, int64_t(0)), v.at("peak").get<int64_t>());
    }
    s["mem_host_peak"] = host;
  }
  if (ms.empty() || !steps.back().contains("ranks")) return s;
  // Peaks: the largest per-step peak over the measured steps, per rank and category.
  const auto& last = steps.back()["ranks"];
  nlohmann::json mem = nlohmann::json::array(), end = nlohmann::json::array(), comm = nlohmann::json::array();
  for (size_t r = 0; r < last.size(); ++r) {
    nlohmann::json pk = nlohmann::json::object(), held = nlohmann::json::object();
    for (size_t i = first; i < steps.size(); ++i)
      for (const auto& [cat, v] : steps[i]["ranks"][r]["mem"].items())
        pk[cat] = std::max(pk.value(cat, int64_t(0)), v["peak"].get<int64_t>());
    for (const auto& [cat, v] : last[r]["mem"].items()) held[cat] = v["current"].get<int64_t>();
    mem.push_back(pk);
    end.push_back(held);
    // The counters are cumulative: the measured steps' share is last minus the last warm-up step.
    nlohmann::json c = nlohmann::json::object();
    const nlohmann::json* before = first > 0 ? &steps[first - 1]["ranks"][r]["comm"] : nullptr;
    for (const auto& [kind, v] : last[r]["comm"].items()) {
      const int64_t b0 = before ? (*before)[kind]["bytes"].get<int64_t>() : 0;
      c[kind] = double(v["bytes"].get<int64_t>() - b0) / double(ms.size());
    }
    comm.push_back(c);
  }
  s["mem_peak"] = mem;
  s["mem_end"] = end;  // what each rank holds after the last step: the persistent model states
  s["comm_per_step"] = comm;
  return s;
}

nlohmann::json summarise_simulation(const nlohmann::json& record) {
  nlohmann::json s = {{"simulated", true}}, mem = nlohmann::json::array(), end = nlohmann::json::array(),
                 comm = nlohmann::json::array();
  for (const auto& r : record.at("ranks")) {
    mem.push_back(r.at("peak"));
    end.push_back(r.value("end", nlohmann::json::object()));
    nlohmann::json c = nlohmann::json::object();
    for (const auto& [kind, v] : r.at("comm").items()) c[kind] = double(v.at("bytes").get<int64_t>());
    comm.push_back(c);
  }
  s["mem_peak"] = mem;
  s["mem_end"] = end;  // held after the last step, as summarise_log's
  s["comm_per_step"] = comm;
  if (record.at("ranks").at(0).contains("host_peak")) s["mem_host_peak"] = record["ranks"][0]["host_peak"];  // rank 0's
  return s;
}

nlohmann::json combine_passes(const std::vector<nlohmann::json>& passes) {
  SG_CHECK(!passes.empty(), "bench: a layout with no runs");
  for (size_t k = 0; k < passes.size(); ++k)
    if (passes[k].value("status", std::string()) != "ok") {
      nlohmann::json r = passes[k];
      if (passes.size() > 1) r["reason"] = "pass " + std::to_string(k + 1) + ": " + r.value("reason", std::string());
      return r;
    }
  nlohmann::json r = passes[0];
  if (passes.size() == 1) return r;
  std::vector<double> ms, bubbles;
  double tokens = 0;  // per step
  for (const auto& p : passes) {
    const nlohmann::json& m = p.at("measured");
    ms.push_back(m.at("step_ms").get<double>());
    tokens = m.at("tokens_per_s").get<double>() * ms.back() / 1e3;
    if (m.contains("bubble")) bubbles.push_back(m["bubble"].get<double>());
  }
  nlohmann::json& m = r["measured"];
  m["step_ms"] = median(ms);
  m["tokens_per_s"] = tokens * 1e3 / median(ms);  // as summarise_log: the median step's
  if (!bubbles.empty()) m["bubble"] = median(bubbles);
  m["passes"] = passes.size();
  m["step_ms_range"] = {*std::min_element(ms.begin(), ms.end()), *std::max_element(ms.begin(), ms.end())};
  return r;
}

nlohmann::json memory_timeline(const nlohmann::json& trace) {
  if (!trace.contains("traceEvents")) return nullptr;
  const auto& events = trace["traceEvents"];
  struct Window {
    int64_t step = -1;
    double begin = 0, end = 0;
  };
  std::map<int, Window> windows;  // per rank: its last step
  for (const auto& e : events)
    if (e.value("ph", "") == "X" && e.value("name", "") == "step" && e.value("cat", "") == "compute") {
      Window w{e.contains("args") ? e["args"].value("step", int64_t(0)) : 0, e["ts"].get<double>(), 0};
      w.end = w.begin + e["dur"].get<double>();
      Window& have = windows[e["pid"].get<int>()];
      if (w.begin >= have.begin) have = w;
    }
  for (const auto& e : events)  // the last step's evaluation is not part of the step
    if (e.value("ph", "") == "X" && e.value("name", "") == "evaluate" && windows.count(e["pid"].get<int>())) {
      Window& w = windows[e["pid"].get<int>()];
      const double ts = e["ts"].get<double>();
      if (ts > w.begin && ts < w.end) w.end = ts;
    }
  nlohmann::json ranks = nlohmann::json::array();
  int64_t step = 0;
  for (const auto& [rank, w] : windows) {
    std::vector<std::pair<double, const nlohmann::json*>> samples;
    for (const auto& e : events)
      if (e.value("ph", "") == "C" && e.value("name", "") == "memory" && e["pid"].get<int>() == rank) {
        const double ts = e["ts"].get<double>();
        if (ts >= w.begin && ts <= w.end) samples.emplace_back(ts, &e["args"]);
      }
    if (samples.empty()) continue;
    std::stable_sort(samples.begin(), samples.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    nlohmann::json t = nlohmann::json::array(), bytes = nlohmann::json::object();
    for (const auto& [ts, args] : samples) {
      t.push_back((ts - w.begin) / 1e3);
      for (const auto& [cat, v] : args->items()) bytes[cat].push_back(v.get<int64_t>());
    }
    step = std::max(step, w.step);
    ranks.push_back({{"rank", rank}, {"step_ms", (w.end - w.begin) / 1e3}, {"t_ms", t}, {"bytes", bytes}});
  }
  if (ranks.empty()) return nullptr;
  return {{"step", step}, {"ranks", ranks}};
}

bool planner_layout(const BenchLayout& row, int64_t batch, Layout& out) {
  const std::string strategy = flag_value(row.args, "strategy");
  if (strategy == "dp") return false;
  out = Layout{};
  out.tp = flag_value(row.args, "tp").empty() ? 1 : std::stoi(flag_value(row.args, "tp"));
  out.pp = flag_value(row.args, "pp").empty() ? 1 : std::stoi(flag_value(row.args, "pp"));
  if (row.ranks % (out.tp * out.pp)) return false;
  out.dp = row.ranks / (out.tp * out.pp);
  out.strategy = strategy.empty() || strategy == "single" ? "ddp" : strategy;
  out.sequence_parallel = !flag_value(row.args, "sequence-parallel").empty();
  if (!flag_value(row.args, "pp-schedule").empty()) out.pp_schedule = flag_value(row.args, "pp-schedule");
  if (!flag_value(row.args, "virtual-stages").empty()) out.virtual_stages = std::stoi(flag_value(row.args, "virtual-stages"));
  if (!flag_value(row.args, "recompute").empty()) out.recompute = flag_value(row.args, "recompute");
  if (!flag_value(row.args, "grad-accumulation").empty()) out.grad_accumulation = flag_value(row.args, "grad-accumulation");
  if (!flag_value(row.args, "shard-group-size").empty()) out.shard_group_size = std::stoi(flag_value(row.args, "shard-group-size"));
  if (!flag_value(row.args, "offload").empty()) out.offload = flag_value(row.args, "offload");
  const std::string mbs = flag_value(row.args, "micro-batch-size");
  if (!mbs.empty() && mbs != "0") {
    out.micro_batch_size = std::stoll(mbs);
    return true;
  }
  try {  // train's own choice (the run itself refused a batch it cannot split)
    out.micro_batch_size = parallel::pp::default_micro_batch_size(batch / out.dp, out.pp, out.pp_schedule, out.virtual_stages);
  } catch (const Error&) {
    return false;
  }
  return true;
}

int64_t row_bucket_bytes(const BenchLayout& row) {
  const double mb = std::strtod(flag_value(row.args, "bucket-mb").c_str(), nullptr);
  return mb > 0 ? int64_t(mb * double(1 << 20)) : 25ll << 20;  // none (or one train refuses): train's default
}

void set_default_buckets(std::vector<BenchLayout>& matrix, const std::string& mb) {
  for (BenchLayout& row : matrix) {
    const std::string strategy = flag_value(row.args, "strategy");
    if ((strategy == "ddp" || strategy == "zero1" || strategy == "zero2") && flag_value(row.args, "bucket-mb").empty())
      row.args += " --bucket-mb " + mb;
  }
}

std::string results_csv(const nlohmann::json& results) {
  static const char* cats[] = {"param", "grad", "optim_state", "activation", "comm_buffer", "workspace", "total"};
  static const char* kinds[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send", "recv"};
  std::ostringstream o;
  o << "layout,ranks,status,step_ms,step_ms_min,step_ms_max,tokens_per_s,mfu,bubble";
  for (const char* c : cats) o << ",rank0_peak_" << c;
  for (const char* k : kinds) o << ",rank0_" << k << "_bytes_per_step";
  o << ",reason\n";
  for (const auto& r : results.at("layouts")) {
    o << r["name"].get<std::string>() << "," << r["ranks"].get<int>() << "," << r["status"].get<std::string>();
    const nlohmann::json m = r.value("measured", nlohmann::json::object());
    auto num = [&](const char* k) { return m.contains(k) ? std::to_string(m[k].get<double>()) : std::string(); };
    const bool ranged = m.contains("step_ms_range");  // --repeat: the passes' extremes; else the one median
    const std::string lo = ranged ? std::to_string(m["step_ms_range"][0].get<double>()) : num("step_ms");
    const std::string hi = ranged ? std::to_string(m["step_ms_range"][1].get<double>()) : num("step_ms");
    o << "," << num("step_ms") << "," << lo << "," << hi << "," << num("tokens_per_s") << "," << num("mfu") << ","
      << num("bubble");
    for (const char* c : cats)
      o << "," << (m.contains("mem_peak") && m["mem_peak"][0].contains(c) ? std::to_string(m["mem_peak"][0][c].get<int64_t>()) : "");
    for (const char* k : kinds)
      o << "," << (m.contains("comm_per_step") ? std::to_string(int64_t(m["comm_per_step"][0].value(k, 0.0))) : "");
    std::string reason = r.value("reason", std::string());
    std::replace(reason.begin(), reason.end(), '"', '\'');
    o << ",\"" << reason << "\"\n";
  }
  return o.str();
}

}  // namespace sg::report
