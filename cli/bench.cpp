// shardgrad bench: runs a matrix of layouts (single, dp, ddp, zero1-3, fsdp variants, tp, tp+sp,
// every pipeline schedule, a 3-D layout, zero3 under a pipeline; or rows from a JSON file) for one model on this machine,
// each as its own `mpirun ... shardgrad train --log-json` job, and collects per layout the median
// step time and tokens/s after warm-up, peak ledger bytes per rank per category, bytes per
// collective kind per step and the measured bubble, next to the planner's prediction. Layouts
// train refuses are reported with its reason. Writes PREFIX.json, PREFIX.csv and one HTML page
// (PREFIX.html unless --report names another file or none; also from an earlier results file with
// --from). With --trace or a report every layout runs traced, and the last step's memory samples (the ledger per category
// after each forward, backward, gather, release, launch) go into the results for the report's
// memory-over-time charts.
#include <unistd.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench/report/bench_results.h"
#include "bench/report/planner.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "io/file.h"

namespace sg::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A JSON file named by `flag`: missing, unreadable or malformed files are refused, naming both.
json read_json_file(const std::string& path, const char* flag) {
  SG_CHECK(fs::is_regular_file(path), "bench: --", flag, " ", path, ": no such file");
  try {
    return json::parse(read_text(path));
  } catch (const json::exception& e) {
    throw Error(str("bench: --", flag, " ", path, " is not valid JSON: ", e.what()));
  }
}

// What results_html reads of a results file (--from), checked first so that a file of another
// shape is refused naming it and the field, not by the JSON library's bare words.
void check_results(const json& results, const std::string& path) {
  const auto need = [&](const json& j, const char* key, bool ok, const std::string& where, const char* what) {
    SG_CHECK(j.contains(key) && ok, "bench: --from ", path, ": ", where, "\"", key, "\" must be ", what);
  };
  SG_CHECK(results.is_object(), "bench: --from ", path, ": expected a bench results object {\"layouts\": [...], ...}, got ",
           results.type_name());
  need(results, "layouts", results.contains("layouts") && results["layouts"].is_array(), "", "an array of layouts");
  for (size_t i = 0; i < results["layouts"].size(); ++i) {
    const json& r = results["layouts"][i];
    const std::string at = str("layouts[", i, "]");
    SG_CHECK(r.is_object(), "bench: --from ", path, ": ", at, " must be an object, got ", r.type_name());
    const std::string where = at + ".";
    need(r, "name", r.contains("name") && r["name"].is_string(), where, "a string");
    need(r, "ranks", r.contains("ranks") && r["ranks"].is_number_integer(), where, "an integer");
    need(r, "status", r.contains("status") && r["status"].is_string(), where, "a string");
    if (r["status"] != "ok") continue;
    need(r, "measured", r.contains("measured") && r["measured"].is_object(), where, "an object (status ok)");
    const json& m = r["measured"];
    for (const char* key : {"mem_peak", "comm_per_step"})
      need(m, key, m.contains(key) && m[key].is_array() && !m[key].empty() && m[key][0].is_object(), where + "measured.",
           "a non-empty array of objects, one per rank");
    if (m.contains("tokens_per_s"))  // timed, not simulated
      need(m, "step_ms", m.contains("step_ms") && m["step_ms"].is_number(), where + "measured.", "a number");
    if (r.contains("timeline_svg")) need(r, "timeline_svg", r["timeline_svg"].is_string(), where, "a string");
    if (!r.contains("memory_timeline") || r["memory_timeline"].is_null()) continue;
    // The memory-over-time chart: every rank's sample times, and per category as many byte counts.
    const json& tl = r["memory_timeline"];
    need(r, "memory_timeline", tl.is_object() && tl.contains("ranks") && tl["ranks"].is_array() && !tl["ranks"].empty(),
         where, "an object with a non-empty \"ranks\" array");
    for (size_t k = 0; k < tl["ranks"].size(); ++k) {
      const json& rk = tl["ranks"][k];
      const bool times = rk.is_object() && rk.contains("t_ms") && rk["t_ms"].is_array();
      bool bytes = times && rk.contains("bytes") && rk["bytes"].is_object();
      if (bytes)
        for (const auto& [cat, v] : rk["bytes"].items()) bytes = bytes && v.is_array() && v.size() == rk["t_ms"].size();
      SG_CHECK(bytes, "bench: --from ", path, ": ", where, "memory_timeline.ranks[", k, "] must hold a \"t_ms\" array ",
               "and, per category, a \"bytes\" array of as many samples");
    }
  }
}

// The reason train gave: the text after "error: " on its first error line, else the rank the
// watchdog blamed (its FAILED line, or a wait that timed out), else shardgrad's last line; mpirun's
// own notices are left out.
std::string failure_reason(const std::string& output, int code) {
  std::istringstream in(output);
  std::string failed, waiting, last;
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("error: ");
    if (at != std::string::npos) return line.substr(at + 7);
    // shardgrad's diagnostics ("shardgrad: rank 1: ...", "shardgrad train: ..."), not its header
    if (line.rfind("shardgrad:", 0) != 0 && line.rfind("shardgrad train:", 0) != 0) continue;
    if (failed.empty() && line.find("FAILED:") != std::string::npos) failed = line.substr(line.find("rank"));
    if (waiting.empty() && line.find("while waiting in") != std::string::npos) waiting = line.substr(line.find("rank"));
    last = line;
  }
  if (!failed.empty()) return failed;
  if (!waiting.empty()) return waiting;
  if (code == 124) return "timed out";
  return "exit status " + std::to_string(code) + (last.empty() ? "" : ": " + last);
}

// ", rank 0's host N GiB (offloaded)" for a layout whose state went to host memory (--offload).
std::string host_note(const json& measured) {
  if (!measured.contains("mem_host_peak")) return "";
  return str(", rank 0's host ", double(measured["mem_host_peak"].value("total", int64_t(0))) / double(1 << 30),
             " GiB (offloaded)");
}

// The planner's figures for a row; `common` holds the flags every row shares (the micro-batch).
json predicted(report::BenchLayout row, const std::string& common, const report::ModelShape& model, int64_t batch,
               const std::string& dtype) {
  row.args += " " + common;  // the row's own flags come first and win
  report::PlanInput in;
  in.model = model;
  in.cluster = report::cluster_preset("cpu-local");
  in.cluster.gpus_per_node = std::max(in.cluster.gpus_per_node, row.ranks);  // ranks share the cores
  // A row's own --dtype and --batch-size win over the bench's, as they do in the run it predicts.
  const std::string row_dtype = report::flag_value(row.args, "dtype"), row_batch = report::flag_value(row.args, "batch-size");
  if (!row_batch.empty()) batch = std::stoll(row_batch);
  in.global_batch = batch;
  in.dtype = row_dtype.empty() ? dtype : row_dtype;
  if (!report::planner_layout(row, batch, in.layout)) return nullptr;
  in.bucket_bytes = report::row_bucket_bytes(row);
  try {
    report::Plan p = report::make_plan(in);
    const report::RankMemory& r0 = p.per_stage[0];
    double sent = 0;
    for (const auto& [kind, bytes] : p.comm)
      if (kind != "recv") sent += double(bytes);
    return {{"param", r0.param},           {"grad", r0.grad},        {"optim_state", r0.optim_state},
            {"activation", r0.activation}, {"buffers", r0.buffers},  {"comm", p.comm},
            {"comm_bytes", sent},          {"bubble", p.bubble},     {"step_s", p.step_s},
            {"model_flops_per_token", p.model_flops_per_token}};
  } catch (const Error& e) {
    return {{"refused", e.what()}};
  }
}

}  // namespace

int bench_main(int argc, char** argv) {
  Args a("bench", "Run a matrix of parallel layouts on this machine and compare them; write JSON, CSV and an HTML report.");
  a.flag("model", "tiny", "preset: tiny, gpt2, ...");
  a.flag("n-layer", "4", "layers (4: pipelines of 2 stages x 2 chunks)");
  a.flag("n-head", "4", "heads");
  a.flag("n-embd", "64", "width");
  a.flag("seq-len", "32", "tokens per row (also the block size)");
  a.flag("vocab-size", "64", "vocabulary (>= the synthetic task's)");
  a.flag("batch-size", "16", "global batch");
  a.flag("dtype", "fp32", "fp32 | bf16 | fp16 (half types: f32 master weights in the optimizer state)");
  a.flag("micro-batch-size", "4", "sequences per forward/backward in every layout");
  a.flag("steps", "10", "steps per layout");
  a.flag("warmup", "3", "first steps dropped from the medians");
  a.flag("repeat", "1", "passes over the whole matrix: each layout's step time is the median of its passes' medians, "
         "with their range");
  a.flag("ranks", "2", "processes of the default matrix's distributed layouts");
  a.flag("bucket-mb", "auto", "ddp's gradient buckets and zero1/zero2's stripes, in MiB, for the rows without their "
         "own (auto: a quarter of the model's gradient bytes, at most train's 25)");
  a.flag("layouts", "", "comma-separated names from the default matrix (default: all)");
  a.flag("matrix", "", "a JSON file: [{\"name\", \"ranks\", \"args\"}, ...] instead of the default matrix");
  a.flag("threads", "1", "CPU threads per rank");
  a.flag("mpirun", "mpirun --oversubscribe --allow-run-as-root --bind-to none", "the launcher, with its flags");
  a.flag("timeout", "300", "seconds per layout");
  a.flag("peak-tflops", "0", "the peak TFLOP/s of one rank's device in the training dtype (e.g. 989 for H100/H200 bf16 "
         "dense): each layout's measured MFU = tokens/s x model FLOPs per token / (ranks x peak); 0 = not reported");
  a.flag("out", "bench_results", "write PREFIX.json, PREFIX.csv and (unless --report says otherwise) PREFIX.html");
  a.flag("report", "", "write the HTML report here (default: PREFIX.html of --out; none: no report)");
  a.flag("from", "", "make the report from this results file instead of running");
  a.flag("work-dir", "", "where each layout's logs go (default: a temporary directory, removed)");
  a.flag("trace", "", "a directory: each layout's Chrome trace (train --trace) goes to DIR/<layout>.json "
                     "(with --report and no --trace, traces go to the work directory)");
  a.toggle("simulate", "run every layout as train --simulate (one process, the meta device): each rank's peak bytes "
           "per ledger category and bytes per collective kind at any model size (--model gpt2-xl: the preset's own "
           "shape, random tokens), no timing");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  // The HTML page comes with every run unless asked not to: PREFIX.html beside the JSON and CSV.
  const std::string report_path = a.str("report") == "none" ? std::string()
                                  : a.str("report").empty() ? a.str("out") + ".html"
                                                            : a.str("report");
  // The outputs' folders first: a bad path fails here, not after every layout has run.
  if (!report_path.empty()) io::make_parent_folder(report_path, "bench: --report");
  if (!a.str("from").empty()) {
    SG_CHECK(!report_path.empty(), "bench: --from makes a report; --report none leaves nothing to do");
    const json from = read_json_file(a.str("from"), "from");
    check_results(from, a.str("from"));
    std::string page;
    try {
      page = report::results_html(from);
    } catch (const json::exception& e) {  // a field of the wrong type deeper down
      throw Error(str("bench: --from ", a.str("from"), ": not a results file bench wrote: ", e.what()));
    }
    io::write_text_atomic(report_path, "bench: --report", page);
    std::printf("wrote %s\n", report_path.c_str());
    return 0;
  }
  io::make_parent_folder(a.str("out") + ".json", "bench: --out");
  const int ranks = int(a.i64("ranks"));
  SG_CHECK(ranks >= 1, "bench: --ranks must be >= 1");
  std::vector<report::BenchLayout> matrix =
      a.str("matrix").empty() ? report::default_matrix(ranks) : report::matrix_from_json(read_json_file(a.str("matrix"), "matrix"), a.str("matrix"));
  if (!a.str("layouts").empty()) {
    std::vector<report::BenchLayout> chosen;
    std::stringstream names(a.str("layouts"));
    for (std::string n; std::getline(names, n, ',');) {
      auto it = std::find_if(matrix.begin(), matrix.end(), [&](const auto& l) { return l.name == n; });
      SG_CHECK(it != matrix.end(), "bench: --layouts: no layout named '", n, "' in the matrix");
      chosen.push_back(*it);
    }
    matrix = chosen;
  }
  // timeout(1) is handed --timeout as it is: a word it cannot read would fail every layout
  SG_CHECK(a.f64("timeout") > 0, "bench: --timeout must be > 0 seconds, got ", a.str("timeout"));
  const int64_t steps = a.i64("steps"), warmup = a.i64("warmup"), batch = a.i64("batch-size");
  const double peak_flops = a.f64("peak-tflops") * 1e12;
  SG_CHECK(peak_flops >= 0, "bench: --peak-tflops must be >= 0");
  SG_CHECK(a.on("simulate") || steps > warmup, "bench: --steps must exceed --warmup");
  // The first step's counters also hold the setup's traffic (the parameters' broadcast), and its
  // time the first touch of every buffer: never a step to measure.
  SG_CHECK(a.on("simulate") || warmup >= 1, "bench: --warmup must be >= 1 (the first step carries the setup's ",
           "broadcast and first allocations), got ", warmup);
  SG_CHECK(a.i64("repeat") >= 1, "bench: --repeat must be >= 1, got ", a.i64("repeat"));
  const bool simulate = a.on("simulate");
  SG_CHECK(!simulate || (a.i64("repeat") == 1 && a.str("trace").empty() && a.f64("peak-tflops") == 0),
           "bench: --simulate counts bytes, which do not vary, and times nothing: --repeat, --trace and --peak-tflops ",
           "have no place with it");
  // The bench's small model by default; under --simulate, a --model preset keeps its own shape
  // unless a flag overrides it, and reads random tokens of its vocabulary.
  const bool preset_shape = simulate && a.given("model");
  report::ModelShape model = report::model_preset(a.str("model"));
  std::string shape_args;
  const auto shape = [&](const char* flag, int64_t& field) {
    if (preset_shape && !a.given(flag)) return;
    field = a.i64(flag);
    shape_args += str(" --", flag, " ", a.i64(flag));
  };
  shape("n-layer", model.n_layer);
  shape("n-head", model.n_head);
  shape("n-embd", model.n_embd);
  shape("vocab-size", model.vocab_size);
  if (!preset_shape || a.given("seq-len")) {
    model.seq_len = model.block_size = a.i64("seq-len");
    shape_args += " --seq-len " + a.str("seq-len") + " --block-size " + a.str("seq-len");
  }
  // ddp's buckets and ZeRO's stripes: by default a quarter of the model's gradient bytes, at most
  // train's 25 MiB, so that a small model spans several, as a large one does at 25 MiB (zero2 then
  // frees the full gradients stripe by stripe during the backward, as the ZeRO paper's Ψ/N needs).
  std::string bucket_mb = a.str("bucket-mb");
  if (bucket_mb == "auto") {
    const double grad_bytes = double(model.num_params()) * (a.str("dtype") == "fp32" ? 4.0 : 2.0);
    bucket_mb = str(std::min(25.0, grad_bytes / 4.0 / double(1 << 20)));
  } else {
    SG_CHECK(std::strtod(bucket_mb.c_str(), nullptr) > 0, "bench: --bucket-mb must be auto or a size in MiB > 0, got '",
             bucket_mb, "'");
  }
  report::set_default_buckets(matrix, bucket_mb);
  const std::string common = "--model " + a.str("model") + shape_args + (preset_shape ? " --data random" : "") +
                             " --batch-size " + a.str("batch-size") + " --micro-batch-size " + a.str("micro-batch-size") +
                             " --dtype " + a.str("dtype") + " --steps " + a.str("steps") + " --threads " + a.str("threads") +
                             " --eval-every 0 --eval-batches 1 --eval-problems 8";
  const fs::path work = a.str("work-dir").empty()
                            ? fs::temp_directory_path() / ("sg_bench_" + std::to_string(::getpid()))
                            : fs::path(a.str("work-dir"));
  fs::create_directories(work);
  // A temporary work directory goes however the bench ends, an error included.
  struct RemoveWhenDone {
    fs::path dir;
    ~RemoveWhenDone() {
      std::error_code ignored;
      if (!dir.empty()) fs::remove_all(dir, ignored);
    }
  } remove_work{a.str("work-dir").empty() ? work : fs::path()};
  // The report's memory-over-time charts read each layout's trace: --report traces into the work
  // directory when no --trace directory is given.
  const fs::path trace_dir = !a.str("trace").empty() ? fs::path(a.str("trace"))
                             : !report_path.empty() ? work / "traces" : fs::path();
  if (!trace_dir.empty()) fs::create_directories(trace_dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();

  json results;
  results["description"] = str("model ", a.str("model"), " (", model.n_layer, " layers, width ", model.n_embd, ", ",
                               model.n_head, " heads, seq ", model.seq_len, "), global batch ", a.str("batch-size"),
                               ", micro-batch ", a.str("micro-batch-size"), ", ", a.str("dtype"), ", ") +
                           (simulate ? std::string("simulated on the meta device (train --simulate): bytes only, no timing")
                                     : a.str("steps") + " steps (" + a.str("warmup") + " warm-up) per layout" +
                                           (a.i64("repeat") > 1 ? ", " + a.str("repeat") + " passes" : std::string()) +
                                           ", " + std::to_string(std::thread::hardware_concurrency()) + " CPU cores");
  results["command"] = "shardgrad bench";
  for (const auto& w : a.argv_copy) results["command"] = results["command"].get<std::string>() + " " + w;
  results["common_args"] = common;
  results["warmup"] = warmup;
  results["layouts"] = json::array();
  // One run of a layout: its row, measured or with the reason it did not run, and its progress line.
  const int64_t repeat = a.i64("repeat");
  auto run_layout = [&](const report::BenchLayout& row, size_t i, int64_t pass) {
    if (repeat > 1) std::printf("[pass %lld/%lld] ", (long long)pass + 1, (long long)repeat);
    std::printf("[%zu/%zu] %-16s %d rank(s)  %s ... ", i + 1, matrix.size(), row.name.c_str(), row.ranks, row.args.c_str());
    std::fflush(stdout);
    const fs::path log = work / (row.name + ".jsonl"), out = work / (row.name + ".out"), svg = work / (row.name + ".svg");
    fs::remove(log);
    fs::remove(svg);
    std::string cmd = "timeout " + a.str("timeout") + " ";
    const fs::path trace = trace_dir.empty() ? fs::path() : trace_dir / (row.name + ".json");
    if (simulate) {  // one process, the ranks its threads: no launcher, nothing timed
      cmd += "'" + self + "' train --simulate " + std::to_string(row.ranks) + " " + common + " " + row.args +
             " --log-json '" + log.string() + "'";
    } else {
      if (row.ranks > 1) cmd += a.str("mpirun") + " -x OMP_NUM_THREADS=" + a.str("threads") + " -np " + std::to_string(row.ranks) + " ";
      cmd += "'" + self + "' train " + common + " " + row.args + " --log-json '" + log.string() + "'";
      if (row.args.find("--pp ") != std::string::npos) cmd += " --timeline '" + svg.string() + "'";
      if (!trace.empty()) fs::remove(trace);
      if (!trace.empty()) cmd += " --trace '" + trace.string() + "'";
    }
    cmd += " > '" + out.string() + "' 2>&1";
    const int status = std::system(cmd.c_str());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    // The log's records up to the first line that is not JSON (one cut off when the layout was
    // killed): a run that exited 0 with such a line failed, naming the line.
    std::vector<json> records;
    std::string unreadable;
    {
      std::ifstream f(log);
      int64_t n = 0;
      for (std::string line; unreadable.empty() && std::getline(f, line);) {
        ++n;
        if (line.empty()) continue;
        try {
          records.push_back(json::parse(line));
        } catch (const json::exception& e) {
          unreadable = str("its log ", log.string(), " line ", n, " is not JSON: ", e.what());
        }
      }
    }
    json r = {{"name", row.name}, {"ranks", row.ranks}, {"args", row.args}};
    // A record that is JSON but not what train writes (a field missing or of another type) fails
    // the layout the same way, naming the log, instead of ending the bench.
    try {
      if (code == 0 && !unreadable.empty()) {
        r["status"] = "failed";
        r["reason"] = unreadable;
        std::printf("failed: %s\n", unreadable.c_str());
      } else if (code == 0 && !records.empty() && simulate) {
        r["status"] = "ok";
        r["measured"] = report::summarise_simulation(records[0]);
        double sent = 0;
        for (const auto& [kind, b] : r["measured"]["comm_per_step"][0].items()) sent += kind == "recv" ? 0 : b.get<double>();
        std::printf("rank 0: peak %.3f GiB, %.3f GiB sent per step%s\n",
                    double(r["measured"]["mem_peak"][0].value("total", int64_t(0))) / double(1 << 30), sent / double(1 << 30),
                    host_note(r["measured"]).c_str());
      } else if (code == 0 && !records.empty()) {
        r["status"] = "ok";
        r["measured"] = report::summarise_log(records, int(warmup));
        if (fs::exists(svg)) r["timeline_svg"] = read_text(svg);
        if (!trace.empty() && fs::exists(trace)) {
          if (!a.str("trace").empty()) r["trace"] = trace.string();
          try {
            json timeline = report::memory_timeline(json::parse(read_text(trace)));
            if (!timeline.is_null()) r["memory_timeline"] = timeline;
          } catch (const json::exception& e) {
            std::printf("(trace %s unreadable: %s) ", trace.string().c_str(), e.what());
          }
        }
        std::printf("%.2f ms/step, %.0f tok/s", r["measured"]["step_ms"].get<double>(),
                    r["measured"]["tokens_per_s"].get<double>());
        if (r["measured"].contains("bubble"))
          std::printf(", bubble %.1f%% of busy time", 100 * r["measured"]["bubble"].get<double>());
        std::printf("%s\n", host_note(r["measured"]).c_str());
      } else {
        // Refused: train said why before its setup was done (its header line); anything else that
        // ended the run (an error in a step, a process that died) failed.
        const std::string text = read_text(out);
        const bool refused = records.empty() && text.find("error: ") != std::string::npos &&
                             text.find("shardgrad train | model") == std::string::npos;
        r["status"] = code == 124 ? "timeout" : refused ? "refused" : "failed";
        r["reason"] = failure_reason(text, code);
        std::printf("%s: %s\n", r["status"].get<std::string>().c_str(), r["reason"].get<std::string>().c_str());
      }
    } catch (const json::exception& e) {
      r.erase("measured");
      r["status"] = "failed";
      r["reason"] = str("its log ", log.string(), " does not hold train's records: ", e.what());
      std::printf("\nfailed: %s\n", r["reason"].get<std::string>().c_str());
    }
    std::fflush(stdout);
    return r;
  };
  // --repeat passes over the whole matrix, so that a slow spell of the machine touches every
  // layout alike; a layout refused or failed once is not run again.
  std::vector<std::vector<json>> runs(matrix.size());
  for (int64_t pass = 0; pass < repeat; ++pass)
    for (size_t i = 0; i < matrix.size(); ++i)
      if (pass == 0 || runs[i].back()["status"] == "ok") runs[i].push_back(run_layout(matrix[i], i, pass));
  if (repeat > 1) std::printf("\nmedian over %lld passes (range of the passes' medians):\n", (long long)repeat);
  for (size_t i = 0; i < matrix.size(); ++i) {
    const report::BenchLayout& row = matrix[i];
    json r = report::combine_passes(runs[i]);
    if (repeat > 1 && r["status"] == "ok")
      std::printf("  %-16s %8.2f ms/step (%.2f-%.2f)\n", row.name.c_str(), r["measured"]["step_ms"].get<double>(),
                  r["measured"]["step_ms_range"][0].get<double>(), r["measured"]["step_ms_range"][1].get<double>());
    json p = predicted(row, common, model, batch, a.str("dtype"));
    if (!p.is_null()) r["predicted"] = p;
    // MFU as PaLM defines it: the model's FLOPs (6 per parameter per token, the position
    // embedding's excepted, plus attention; no recompute) over what the ranks' devices could do.
    if (peak_flops > 0 && r.contains("measured") && !p.is_null() && p.contains("model_flops_per_token")) {
      r["measured"]["mfu"] = r["measured"]["tokens_per_s"].get<double>() * p["model_flops_per_token"].get<double>() /
                             (double(row.ranks) * peak_flops);
      std::printf("  %-16s MFU %.2f%% of %g TFLOP/s per rank\n", row.name.c_str(), 100 * r["measured"]["mfu"].get<double>(),
                  peak_flops / 1e12);
    }
    results["layouts"].push_back(r);
  }
  const std::string prefix = a.str("out");
  // The command line's bytes may not be UTF-8 (a path in Latin-1): written with U+FFFD for them,
  // as train's --log-json is, rather than thrown away with every layout's results.
  io::write_text_atomic(prefix + ".json", "bench: --out", results.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
  io::write_text_atomic(prefix + ".csv", "bench: --out", report::results_csv(results));
  std::printf("wrote %s.json and %s.csv\n", prefix.c_str(), prefix.c_str());
  if (!report_path.empty()) {
    io::write_text_atomic(report_path, "bench: --report", report::results_html(results));
    std::printf("wrote %s\n", report_path.c_str());
  }
  // A layout that ran and failed (or timed out) fails the command, after the report is written;
  // one refused for this rank count or model is the matrix's business, not a failure.
  std::string broken;
  bool any_ran = false;
  for (const json& r : results["layouts"]) {
    if (r["status"] == "failed" || r["status"] == "timeout") broken += (broken.empty() ? "" : ", ") + r["name"].get<std::string>();
    any_ran |= r["status"] == "ok";
  }
  if (!broken.empty()) {
    std::fprintf(stderr, "bench: layouts that failed: %s (their reasons are above and in %s.json)\n", broken.c_str(),
                 prefix.c_str());
    return 1;
  }
  // Every layout refused: nothing was measured (a bad --dtype, a model the rank counts cannot split).
  if (!any_ran) {
    std::fprintf(stderr, "bench: every layout was refused: nothing measured (the reasons are above and in %s.json)\n",
                 prefix.c_str());
    return 1;
  }
  return 0;
}

}  // namespace sg::cli
