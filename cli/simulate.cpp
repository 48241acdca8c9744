// --simulate N: the N ranks of the layout as threads, each a Trainer on its own meta device over
// a simulated world (parallel/comm/sim_backend.h), then one line per group of ranks whose bytes are
// equal. The figures are the engine's own ledger and counters: nothing is estimated.
#include <cstdio>
#include <fstream>
#include <thread>

#include "bench/report/step_metrics.h"
#include "cli/trainer.h"
#include "io/file.h"

namespace sg::cli {

using nlohmann::json;

namespace {
// A device's ledger as {category: peak bytes}.
json peaks(Device d) {
  json out = json::object();
  const json ledger = ledger_json(d);  // kept alive: items() iterates it
  for (const auto& [cat, v] : ledger.items()) out[cat] = v["peak"];
  return out;
}
}  // namespace

json Trainer::simulate(int64_t steps) {
  setup();
  // The setup's own peaks (the model built and initialised, the optimizer's state): under --pp a
  // rank's parameters peak at its stages' share, never at the whole model.
  const json setup_peak = peaks(device_);
  steps = std::min(steps, steps_);
  json peak = json::object(), end, last_comm;
  for (int64_t step = 0; step < steps; ++step) {
    Ledger::global().reset_peaks(device_);
    Ledger::global().reset_peaks(host_device());
    const json before = report::step_metrics(device_, traffic_groups(), nullptr, nullptr)["ranks"][0]["comm"];
    double norm = 0;
    bool applied = true;
    train_step(step, sched_.at(step), norm, applied);
    const json after = report::step_metrics(device_, traffic_groups(), nullptr, nullptr)["ranks"][0];
    end = json::object();
    for (const auto& [cat, v] : after["mem"].items()) {
      peak[cat] = std::max(peak.value(cat, int64_t(0)), v["peak"].get<int64_t>());
      end[cat] = v["current"];
    }
    last_comm = json::object();
    for (const auto& [kind, v] : after["comm"].items())
      last_comm[kind] = {{"calls", v["calls"].get<int64_t>() - before[kind]["calls"].get<int64_t>()},
                         {"bytes", v["bytes"].get<int64_t>() - before[kind]["bytes"].get<int64_t>()}};
  }
  json out = {{"rank", rank_}, {"peak", peak}, {"end", end}, {"comm", last_comm}, {"setup_peak", setup_peak}};
  if (args_.str("offload") != "none") {  // the offloaded state's ledger, the last step's peaks
    out["host_peak"] = peaks(host_device());
  }
  if (lead())
    out["header"] = str("model ", cfg_.name, ": ", double(cfg_.num_params()) / 1e6, "M params | ", layout_label(),
                        " | ", dtype_name(dtype_), " | batch ", B_, " x ", T_, " tokens (micro-batch ", micro_, ") | ",
                        steps, steps == 1 ? " step" : " steps");
  return out;
}

int simulate_main(const Args& given) {
  // A GPT-2 preset sized on the synthetic task would shrink to its 13 tokens and rows: without
  // --data, a preset other than tiny reads random tokens of GPT-2's vocabulary.
  Args a = given;
  if (!a.given("data") && a.str("model") != "tiny") a.inherit("data", "random");
  const int64_t n = a.i64("simulate");
  SG_CHECK(n >= 1 && n <= 4096, "train: --simulate takes the number of ranks to simulate (1 to 4096), got ", n);
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"})
    if (const char* s = std::getenv(v); s && std::atoi(s) > 1)
      throw Error("train: --simulate runs every rank in this one process; start it without mpirun");
  // What needs values, files or a real device has nothing to do on the meta device.
  for (const char* flag : {"device", "devices", "resume", "save", "trace", "timeline", "profile-ops", "inject-fault",
                           "backend", "rendezvous", "sample-tokens", "tokenizer", "hellaswag"})
    SG_CHECK(!a.given(flag), "train: --", flag, " is not available with --simulate (a dry run on the meta device: ",
             "shapes and bytes, no values)");
  const std::string strategy = a.str("strategy");
  SG_CHECK(strategy != "dp", "train: --simulate: --strategy dp replicates over devices of one process; simulate ddp");
  SG_CHECK(n == 1 || strategy != "single" || a.i64("tp") > 1 || a.i64("pp") > 1, "train: --simulate ", n,
           " with --strategy single would be ", n, " copies of one rank; give a multi-rank strategy, --tp or --pp");
  const auto world = comm::simulated_world(int(n));
  std::vector<json> result(static_cast<size_t>(n));
  std::vector<std::exception_ptr> error(static_cast<size_t>(n));
  {
    std::vector<std::thread> threads;
    for (int64_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          Trainer t(a, nullptr, world[size_t(r)]);
          result[size_t(r)] = t.simulate(3);
        } catch (...) {
          error[size_t(r)] = std::current_exception();
          world[size_t(r)]->abort();
        }
      });
    for (auto& t : threads) t.join();
  }
  // The first rank's own error, not a rank that stopped because another failed.
  std::exception_ptr first;
  for (const auto& e : error) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const comm::SimWorldAborted&) {
      if (!first) first = e;
    }  // any other error propagates from here
  }
  if (first) std::rethrow_exception(first);

  std::printf("shardgrad train --simulate %lld | %s | meta device: no values, no arithmetic\n", (long long)n,
              result[0]["header"].get<std::string>().c_str());
  const char* cats[] = {"param", "grad", "optim_state", "activation", "comm_buffer", "workspace", "total"};
  std::printf("%-12s", "ranks");
  for (const char* c : cats) std::printf(" %12s", std::string(c) == "total" ? "peak total" : c);
  std::printf("  bytes sent in the last step\n");
  // Consecutive ranks with the same bytes share a line.
  for (int64_t r = 0; r < n;) {
    int64_t e = r + 1;
    while (e < n && result[size_t(e)]["peak"] == result[size_t(r)]["peak"] &&
           result[size_t(e)]["comm"] == result[size_t(r)]["comm"] &&
           result[size_t(e)].value("host_peak", json()) == result[size_t(r)].value("host_peak", json()))
      ++e;
    std::printf("%-12s", (e - r == 1 ? std::to_string(r) : str(r, "-", e - 1)).c_str());
    for (const char* c : cats) std::printf(" %12s", human_bytes(result[size_t(r)]["peak"].value(c, int64_t(0))).c_str());
    std::string sent;
    for (const auto& [kind, v] : result[size_t(r)]["comm"].items())
      if (v["bytes"].get<int64_t>() > 0 && kind != "recv")
        sent += str(sent.empty() ? "" : ", ", kind, " ", human_bytes(v["bytes"].get<int64_t>()));
    std::printf("  %s\n", sent.empty() ? "none" : sent.c_str());
    if (result[size_t(r)].contains("host_peak"))
      std::printf("%-12s host (--offload): optimizer state %s, parameters %s\n", "",
                  human_bytes(result[size_t(r)]["host_peak"].value("optim_state", int64_t(0))).c_str(),
                  human_bytes(result[size_t(r)]["host_peak"].value("param", int64_t(0))).c_str());
    r = e;
  }
  std::printf("peaks: the largest of each category over the steps, and of their sum (peak total); exact bytes, and "
              "the setup's own peaks, in --log-json\n");
  if (const std::string path = a.str("log-json"); !path.empty()) {
    io::make_parent_folder(path, "train: --log-json");
    std::ofstream f(path);
    SG_CHECK(f.good(), "train: cannot write --log-json ", path);
    const std::string run = result[0]["header"].get<std::string>();
    for (auto& r : result) r.erase("header");
    f << json({{"simulate", n}, {"run", run}, {"ranks", result}}).dump() << "\n";
  }
  return 0;
}

}  // namespace sg::cli
