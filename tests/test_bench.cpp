// shardgrad bench: the log summary (medians after warm-up, per-step traffic from cumulative
// counters, peaks), the HTML report on a small results file, and the command itself on a small
// matrix, including a layout train refuses.
#include <algorithm>
#include "tests/catch.h"
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "bench/report/bench_results.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One --log-json record with two ranks: rank r's peaks are base·(r+1); the counters cumulative.
json record(int step, double ms, int64_t mem_base, int64_t all_reduce_total) {
  json ranks = json::array();
  for (int r = 0; r < 2; ++r)
    ranks.push_back({{"rank", r},
                     {"mem", {{"param", {{"current", step}, {"peak", mem_base * (r + 1)}}},
                              {"activation", {{"current", 0}, {"peak", 3 * mem_base}}}}},
                     {"comm", {{"all_reduce", {{"calls", step}, {"bytes", all_reduce_total * (r + 1)}}}}},
                     {"busy_s", 1.0 + r},
                     {"span_s", 2.0}});
  return {{"step", step}, {"loss", 5.0 - step}, {"step_ms", ms}, {"tokens_per_s", 1000.0 / ms}, {"ranks", ranks}};
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Runs `shardgrad bench` (2 layers, `steps` steps, 1 warm-up) on `matrix`, written to
// dir/matrix.json, with --out dir/res and --report dir/report.html; its output goes to dir/out.txt.
int run_bench(const fs::path& dir, const json& matrix, int steps, const std::string& extra = "") {
  fs::create_directories(dir);
  std::ofstream(dir / "matrix.json") << matrix.dump();
  const std::string mpirun = std::string(SG_MPIEXEC) + " --oversubscribe --allow-run-as-root --bind-to none";
  const std::string cmd = std::string(SG_BINARY) + " bench --n-layer 2 --steps " + std::to_string(steps) +
                          " --warmup 1 " + extra + " --matrix " + (dir / "matrix.json").string() + " --mpirun '" + mpirun +
                          "' --out " + (dir / "results" / "res").string() + " --report " + (dir / "html" / "report.html").string() + " > " +
                          (dir / "out.txt").string() + " 2>&1";
  return std::system(cmd.c_str());
}

}  // namespace

TEST_CASE("a layout's summary drops warm-up steps: medians, largest peaks, bytes per measured step") {
  // Warm-up steps are slow and move 100 bytes each; measured steps move 40 bytes each.
  std::vector<json> log = {record(1, 90, 10, 100), record(2, 80, 10, 200), record(3, 4, 20, 240),
                           record(4, 6, 50, 280), record(5, 5, 30, 320)};
  json s = sg::report::summarise_log(log, 2);
  CHECK(s["steps"] == 3);
  CHECK(s["step_ms"].get<double>() == 5.0);
  CHECK(s["tokens_per_s"].get<double>() == Approx(200.0));
  CHECK(s["loss_last"].get<double>() == 0.0);
  CHECK(s["mem_peak"][0]["param"] == 50);
  CHECK(s["mem_peak"][1]["param"] == 100);
  CHECK(s["mem_peak"][0]["activation"] == 150);
  CHECK(s["mem_end"][1]["param"] == 5);  // held after the last step
  CHECK(s["comm_per_step"][0]["all_reduce"].get<double>() == 40.0);
  CHECK(s["comm_per_step"][1]["all_reduce"].get<double>() == 80.0);
  // Busy 1 s and 2 s in a 2 s step: idle (1 + 0) over busy (1 + 2).
  CHECK(s["bubble"].get<double>() == Approx(1.0 / 3.0));
  // An even count of steps: the throughput is the median step's (median 5.5 ms: 181.8 tokens/s,
  // not the mean of the middle two steps' own 200 and 166.7)
  log.push_back(record(6, 7, 30, 360));
  s = sg::report::summarise_log(log, 2);
  CHECK(s["step_ms"].get<double>() == 5.5);
  CHECK(s["tokens_per_s"].get<double>() == Approx(1000.0 / 5.5));
  CHECK_FALSE(s.contains("mem_host_peak"));
  // --offload: rank 0's host ledger, its largest peak over the measured steps
  for (size_t i = 0; i < log.size(); ++i) {
    json cat = json::object();
    cat["current"] = 7;
    cat["peak"] = i == 0 ? 900 : 100 + int64_t(i);
    log[i]["mem_host"] = json::object({{"optim_state", cat}});
  }
  s = sg::report::summarise_log(log, 2);
  CHECK(s["mem_host_peak"]["optim_state"] == 105);  // not the warm-up step's 900
}

TEST_CASE("bench --repeat: medians over the passes with their range, the first pass's bytes, a failed pass named") {
  auto pass = [](double ms, double bubble, int64_t param) {
    json m = {{"step_ms", ms}, {"tokens_per_s", 1000.0 / ms}, {"bubble", bubble}, {"mem_peak", {{{"param", param}}}}};
    return json{{"name", "pp"}, {"ranks", 2}, {"args", "--pp 2"}, {"status", "ok"}, {"measured", m}};
  };
  const json r = sg::report::combine_passes({pass(9, 0.3, 10), pass(5, 0.2, 10), pass(7, 0.4, 11)});
  CHECK(r["status"] == "ok");
  CHECK(r["measured"]["step_ms"].get<double>() == 7.0);
  CHECK(r["measured"]["tokens_per_s"].get<double>() == Approx(1000.0 / 7));
  CHECK(r["measured"]["bubble"].get<double>() == 0.3);
  CHECK(r["measured"]["passes"] == 3);
  CHECK(r["measured"]["step_ms_range"] == json::array({5.0, 9.0}));
  CHECK(r["measured"]["mem_peak"][0]["param"] == 10);  // the first pass's
  CHECK_FALSE(sg::report::combine_passes({pass(9, 0.3, 10)})["measured"].contains("step_ms_range"));
  json failed = {{"name", "pp"}, {"status", "timeout"}, {"reason", "timed out"}};
  const json f = sg::report::combine_passes({pass(9, 0.3, 10), failed});
  CHECK(f["status"] == "timeout");
  CHECK(f["reason"] == "pass 2: timed out");
  const std::string csv = sg::report::results_csv({{"layouts", {r}}});
  CHECK(csv.find("pp,2,ok,7.000000,5.000000,9.000000,") != std::string::npos);
}

TEST_CASE("the report of a small results file is one HTML page with every chart, layout and refusal") {
  json results;
  results["description"] = "two layouts and a refused one";
  json ok1 = {{"name", "ddp"}, {"ranks", 2}, {"status", "ok"}, {"args", "--strategy ddp"}};
  ok1["measured"] = sg::report::summarise_log({record(1, 9, 10, 100), record(2, 8, 10, 200)}, 1);
  ok1["predicted"] = {{"param", 2}, {"optim_state", 20}, {"activation", 30}, {"comm_bytes", 100}};
  json ok2 = {{"name", "pp-1f1b"}, {"ranks", 2}, {"status", "ok"}, {"args", "--pp 2"}};
  ok2["measured"] = ok1["measured"];
  ok2["predicted"] = ok1["predicted"];
  ok2["predicted"]["bubble"] = 0.25;
  ok2["timeline_svg"] = "<svg xmlns='http://www.w3.org/2000/svg' id='the-gantt'><rect width='4' height='4'/></svg>";
  json refused = {{"name", "tp3"}, {"ranks", 3}, {"status", "refused"}, {"args", "--tp 3"},
                  {"reason", "--tp 3: 4 heads cannot be split 3 ways"}};
  results["layouts"] = {ok1, ok2, refused};
  const std::string html = sg::report::results_html(results);
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(html.find("</html>") != std::string::npos);
  CHECK(count(html, "<svg") == count(html, "</svg>"));
  CHECK(count(html, "<table") == count(html, "</table>"));
  for (const char* id : {"chart-memory", "chart-throughput", "chart-comm", "table-layouts", "table-refused", "the-gantt"})
    CHECK(html.find(std::string("id='") + id + "'") != std::string::npos);
  CHECK(html.find("ddp / rank 1") != std::string::npos);
  CHECK(html.find("pp-1f1b / rank 0") != std::string::npos);
  CHECK(html.find("4 heads cannot be split 3 ways") != std::string::npos);
  // param: predicted / held after the step (exact), then the step's peak; the bubble: the
  // schedule's / measured
  CHECK(html.find("<td title='param'>2 B / 2 B (0%); peak 10 B</td>") != std::string::npos);
  CHECK(html.find("<td>25 % / 33.3 %</td>") != std::string::npos);
  CHECK(html.find("<td>8 ms</td>") != std::string::npos);  // the step after the warm-up
  CHECK(html.find("<script") == std::string::npos);  // self-contained, static
  const std::string csv = sg::report::results_csv(results);
  CHECK(count(csv, "\n") == 4);
  CHECK(csv.find("tp3,3,refused") != std::string::npos);
}

TEST_CASE("the default matrix's multi-axis layouts take --ranks when it fits them, else their smallest size") {
  std::map<std::string, sg::report::BenchLayout> at64, at2;
  for (const auto& l : sg::report::default_matrix(64)) at64[l.name] = l;
  for (const auto& l : sg::report::default_matrix(2)) at2[l.name] = l;
  CHECK(at64["hsdp"].ranks == 64);
  CHECK(at64["hsdp"].args.find("--shard-group-size 32") != std::string::npos);
  CHECK(at64["zero3+pp"].ranks == 64);
  CHECK(at64["3d-dp16-tp2-pp2"].ranks == 64);
  CHECK(at2["hsdp"].ranks == 4);
  CHECK(at2["zero3+pp"].ranks == 4);
  CHECK(at2["3d-dp2-tp2-pp2"].ranks == 8);
}

TEST_CASE("the default matrix has every strategy, tensor and pipeline layout, and a 3-D one") {
  std::vector<std::string> names;
  for (const auto& l : sg::report::default_matrix(2)) names.push_back(l.name);
  for (const char* n : {"single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp-grad-op", "hsdp", "tp", "tp+sp",
                        "pp-gpipe", "pp-1f1b", "pp-interleaved", "3d-dp2-tp2-pp2", "zero3+pp"})
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
  // The planner reads each row's layout from its train flags: hsdp's shard group is the flag's 2
  // ranks of its 4, not every rank of the (one-node) machine.
  for (const auto& row : sg::report::default_matrix(2)) {
    if (row.name != "hsdp") continue;
    sg::report::Layout l;
    REQUIRE(sg::report::planner_layout(row, 16, l));
    CHECK(l.dp == 4);
    CHECK(l.strategy == "hsdp");
    CHECK(l.shard_group_size == 2);
  }
}

TEST_CASE("bench names the rank that failed a layout and exits non-zero once the report is written", "[cli][mpi]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_fail_" + std::to_string(::getpid()));
  json matrix = json::array(
      {{{"name", "single"}, {"ranks", 1}, {"args", ""}},
       {{"name", "ddp-hang"}, {"ranks", 2}, {"args", "--strategy ddp --comm-timeout 3 --inject-fault rank=1,step=2,kind=hang"}},
       {{"name", "ddp-exit"}, {"ranks", 2}, {"args", "--strategy ddp --inject-fault rank=1,step=1,kind=exit"}},
       {{"name", "ddp-throw"}, {"ranks", 2}, {"args", "--strategy ddp --inject-fault rank=0,step=1,kind=throw"}}});
  const int status = run_bench(dir, matrix, 3);
  const std::string out = read_text(dir / "out.txt");
  INFO(out);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(out.find("bench: layouts that failed: ddp-hang, ddp-exit, ddp-throw") != std::string::npos);
  json res = json::parse(read_text(dir / "results" / "res.json"));  // written all the same
  REQUIRE(res["layouts"].size() == 4);
  CHECK(res["layouts"][0]["status"] == "ok");
  CHECK(res["layouts"][1]["status"] == "failed");
  CHECK(res["layouts"][1]["reason"].get<std::string>().find("rank 1: FAILED: no progress for ") == 0);
  CHECK(res["layouts"][2]["status"] == "failed");  // it died before its first step: not a refusal
  CHECK(res["layouts"][2]["reason"].get<std::string>() == "exit status 7: shardgrad: rank 1: injecting fault 'exit' at step 1");
  CHECK(res["layouts"][2]["reason"].get<std::string>().find("ORTE") == std::string::npos);
  // an error in the first step, after setup: failed too, with train's words
  CHECK(res["layouts"][3]["status"] == "failed");
  CHECK(res["layouts"][3]["reason"].get<std::string>().find("injected fault at step 1") != std::string::npos);
  fs::remove_all(dir);
}

// ZeRO's order on the page: the tiny model inside one 25 MiB stripe would make zero2 hold its full
// gradient and its shard at once, above zero1; the bench's automatic stripes (a quarter of the
// gradient) let zero2 free the full gradients along the backward, as at a real model's size.
TEST_CASE("bench gives ddp/zero1/zero2 rows a quarter of the gradient as their buckets, so zero2's measured gradient peak falls below zero1's", "[cli][mpi]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_buckets_" + std::to_string(::getpid()));
  json matrix = json::array({{{"name", "zero1"}, {"ranks", 2}, {"args", "--strategy zero1"}},
                             {{"name", "zero2"}, {"ranks", 2}, {"args", "--strategy zero2"}},
                             {{"name", "zero2-25"}, {"ranks", 2}, {"args", "--strategy zero2 --bucket-mb 25"}}});
  const int status = run_bench(dir, matrix, 3, "--n-layer 4 --report none");  // the default model's 4 layers
  INFO(read_text(dir / "out.txt"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const json res = json::parse(read_text(dir / "results" / "res.json"));
  REQUIRE(res["layouts"].size() == 3);
  const auto grad_peak = [&](int i) { return res["layouts"][i]["measured"]["mem_peak"][0]["grad"].get<int64_t>(); };
  const int64_t full = res["layouts"][0]["predicted"]["grad"].get<int64_t>();  // zero1 keeps 4Ψ
  CHECK(grad_peak(0) == full);
  CHECK(grad_peak(1) < full);                  // stripes: never the whole gradient
  CHECK(grad_peak(2) == full + full / 2);      // one stripe: the full gradient beside the shard
  CHECK(read_text(dir / "out.txt").find("--strategy zero2 --bucket-mb 0.") != std::string::npos);
  CHECK(read_text(dir / "out.txt").find("--strategy zero2 --bucket-mb 25 ") != std::string::npos);  // its own, kept
  for (int i = 1; i < 3; ++i)
    CHECK(res["layouts"][i]["measured"]["comm_per_step"][0]["reduce_scatter"].get<double>() ==
          res["layouts"][i]["predicted"]["comm"]["reduce_scatter"].get<double>());
  const std::string bad = std::string(SG_BINARY) + " bench --bucket-mb none --layouts zero2 > " + (dir / "bad.txt").string() + " 2>&1";
  CHECK(std::system(bad.c_str()) != 0);
  CHECK(read_text(dir / "bad.txt").find("bench: --bucket-mb must be auto or a size in MiB > 0, got 'none'") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("shardgrad bench runs a matrix file, measures every layout and reports the one train refuses", "[cli][mpi]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_test_" + std::to_string(::getpid()));
  json matrix = json::array({{{"name", "single"}, {"ranks", 1}, {"args", ""}},
                             {{"name", "zero2"}, {"ranks", 2}, {"args", "--strategy zero2"}},
                             {{"name", "pp-1f1b"}, {"ranks", 2}, {"args", "--pp 2 --pp-schedule 1f1b"}},
                             {{"name", "tp3"}, {"ranks", 3}, {"args", "--tp 3"}}});
  const int status = run_bench(dir, matrix, 4, "--peak-tflops 0.5 --repeat 2");
  INFO(read_text(dir / "out.txt"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  json res = json::parse(read_text(dir / "results" / "res.json"));  // bench made the folders
  REQUIRE(res["layouts"].size() == 4);
  // measured MFU: tokens/s x the model's FLOPs per token over the ranks' peak (0.5 TFLOP/s each)
  for (int i = 0; i < 3; ++i) {
    const json& r = res["layouts"][i];
    const double flops = r["predicted"]["model_flops_per_token"].get<double>();
    CHECK(flops > 6.0 * 1000);  // 6 per parameter per token at least
    CHECK(r["measured"]["mfu"].get<double>() ==
          Approx(r["measured"]["tokens_per_s"].get<double>() * flops / (r["ranks"].get<double>() * 0.5e12)));
    CHECK(r["measured"]["mfu"].get<double>() > 0);
    CHECK(r["measured"]["mfu"].get<double>() < 1);
  }
  for (int i = 0; i < 3; ++i) {
    const json& r = res["layouts"][i];
    INFO(r.dump());
    CHECK(r["status"] == "ok");
    CHECK(r["measured"]["steps"] == 3);
    CHECK(r["measured"]["passes"] == 2);  // --repeat 2
    CHECK(r["measured"]["step_ms_range"][0].get<double>() <= r["measured"]["step_ms"].get<double>());
    CHECK(r["measured"]["step_ms"].get<double>() <= r["measured"]["step_ms_range"][1].get<double>());
    CHECK(r["measured"]["step_ms"].get<double>() > 0);
    CHECK(r["measured"]["mem_peak"].size() == r["ranks"].get<size_t>());
    // The planner's model states equal what the ledger held (fp32, rank 0).
    CHECK(r["measured"]["mem_peak"][0]["param"] == r["predicted"]["param"]);
    CHECK(r["measured"]["mem_peak"][0]["optim_state"] == r["predicted"]["optim_state"]);
  }
  const json& zero2 = res["layouts"][1];
  CHECK(zero2["measured"]["comm_per_step"][0]["reduce_scatter"].get<double>() ==
        zero2["predicted"]["comm"]["reduce_scatter"].get<double>());
  CHECK(res["layouts"][2].contains("timeline_svg"));
  CHECK(res["layouts"][2]["measured"].contains("bubble"));
  CHECK(res["layouts"][3]["status"] == "refused");
  CHECK(read_text(dir / "out.txt").find("[pass 2/2] [4/4]") == std::string::npos);  // a refusal is not run again
  CHECK(read_text(dir / "out.txt").find("[pass 2/2] [3/4]") != std::string::npos);
  CHECK(res["layouts"][3]["reason"].get<std::string>().find("heads") != std::string::npos);
  CHECK(count(read_text(dir / "results" / "res.csv"), "\n") == 5);
  const std::string html = read_text(dir / "html" / "report.html");
  CHECK(html.find("chart-memory") != std::string::npos);
  CHECK(html.find("1f1b pipeline, measured") != std::string::npos);
  // A report that cannot be written (its folder would be inside a file) is refused before any
  // layout runs, naming the flag and the reason.
  std::ofstream(dir / "a_file") << "x";
  const std::string bad = std::string(SG_BINARY) + " bench --layouts single --out " + (dir / "res2").string() +
                          " --report " + (dir / "a_file" / "report.html").string() + " > " + (dir / "bad.txt").string() +
                          " 2>&1";
  const int bad_status = std::system(bad.c_str());
  const std::string bad_out = read_text(dir / "bad.txt");
  INFO(bad_out);
  CHECK((WIFEXITED(bad_status) && WEXITSTATUS(bad_status) != 0));
  CHECK(bad_out.find("bench: --report " + (dir / "a_file" / "report.html").string() + ": cannot create the folder") !=
        std::string::npos);
  CHECK(bad_out.find("[1/1]") == std::string::npos);
  // a matrix whose every layout train refuses measured nothing: the command fails, saying so
  const int none = run_bench(dir / "none", json::array({{{"name", "tp3"}, {"ranks", 3}, {"args", "--tp 3"}}}), 2);
  CHECK((WIFEXITED(none) && WEXITSTATUS(none) != 0));
  CHECK(read_text(dir / "none" / "out.txt").find("bench: every layout was refused: nothing measured") != std::string::npos);
  // a matrix file that is missing or not JSON is refused naming the flag and the file
  std::ofstream(dir / "broken.json") << "[{\"name\": ";
  std::ofstream(dir / "args.json") << "[{\"name\": \"z2\", \"ranks\": 2, \"args\": [\"--strategy\", \"zero2\"]}]";
  for (const auto& [file, why] : {std::pair<std::string, std::string>{(dir / "none.json").string(), ": no such file"},
                                  {(dir / "broken.json").string(), " is not valid JSON"},
                                  {(dir / "args.json").string(), ": row z2: \"args\" must be one string of train flags"}}) {
    const std::string cmd = std::string(SG_BINARY) + " bench --matrix " + file + " > " + (dir / "m.txt").string() + " 2>&1";
    const int st = std::system(cmd.c_str());
    CHECK((WIFEXITED(st) && WEXITSTATUS(st) != 0));
    CHECK(read_text(dir / "m.txt").find("bench: --matrix " + file + why) != std::string::npos);
  }
  fs::remove_all(dir);
}

namespace {

json x_event(int pid, const char* name, double ts, double dur, json args = json::object()) {
  return {{"ph", "X"}, {"name", name}, {"cat", "compute"}, {"pid", pid}, {"tid", 1}, {"ts", ts}, {"dur", dur}, {"args", args}};
}
json mem_event(int pid, double ts, int64_t param, int64_t activation) {
  return {{"ph", "C"}, {"name", "memory"}, {"cat", "memory"}, {"pid", pid}, {"tid", 9}, {"ts", ts},
          {"args", {{"param", param}, {"activation", activation}}}};
}

}  // namespace

TEST_CASE("memory over time: the last step's samples per rank, its evaluation left out, drawn per layout") {
  json events = json::array();
  for (int pid = 0; pid < 2; ++pid) {
    events.push_back(x_event(pid, "step", 0, 1000, {{"step", 1}}));
    events.push_back(mem_event(pid, 500, 999, 999));  // step 1: not the last
    events.push_back(x_event(pid, "step", 2000, 1000, {{"step", 2}}));
    events.push_back(mem_event(pid, 2000, 10, 0));
    events.push_back(mem_event(pid, 2300, 30 + pid, 5));  // a gather
    events.push_back(mem_event(pid, 2600, 10, 0));        // its release
    events.push_back(x_event(pid, "evaluate", 2800, 150));
    events.push_back(mem_event(pid, 2900, 40, 40));  // inside the evaluation: not the step's
  }
  const json tl = sg::report::memory_timeline({{"traceEvents", events}});
  REQUIRE(!tl.is_null());
  CHECK(tl["step"] == 2);
  REQUIRE(tl["ranks"].size() == 2);
  const json& r1 = tl["ranks"][1];
  CHECK(r1["rank"] == 1);
  CHECK(r1["step_ms"].get<double>() == Approx(0.8));
  CHECK(r1["t_ms"] == json({0.0, 0.3, 0.6}));
  CHECK(r1["bytes"]["param"] == json({10, 31, 10}));
  CHECK(r1["bytes"]["activation"] == json({0, 5, 0}));
  CHECK(sg::report::memory_timeline({{"traceEvents", json::array()}}).is_null());

  json results;
  json ok = {{"name", "zero3"}, {"ranks", 2}, {"status", "ok"}, {"args", "--strategy zero3"}};
  ok["measured"] = sg::report::summarise_log({record(1, 9, 10, 100), record(2, 8, 10, 200)}, 1);
  ok["memory_timeline"] = tl;
  results["layouts"] = {ok};
  const std::string html = sg::report::results_html(results);
  CHECK(html.find("id='chart-memtime-zero3' data-samples='3'") != std::string::npos);
  CHECK(html.find("rank 1 · 3 samples") != std::string::npos);
  CHECK(html.find(">0.8 ms</text>") != std::string::npos);  // the step's span
  CHECK(html.find("id='table-refused'") == std::string::npos);  // nothing refused: no empty table
  CHECK(html.find("None: every layout ran.") != std::string::npos);
  CHECK(count(html, "<svg") == count(html, "</svg>"));
}

TEST_CASE("bench --report draws memory over one step of each layout: zero3's gathers rise and fall, single and dp stay flat while their activations climb, gpipe holds every micro-batch's and 1f1b two",
          "[cli][mpi]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_memtime_" + std::to_string(::getpid()));
  json matrix = json::array({{{"name", "single"}, {"ranks", 1}, {"args", ""}},
                             {{"name", "dp"}, {"ranks", 1}, {"args", "--strategy dp --devices cpu:0,cpu:1"}},
                             {{"name", "zero3"}, {"ranks", 2}, {"args", "--strategy zero3"}},
                             {{"name", "pp-gpipe"}, {"ranks", 2}, {"args", "--pp 2 --pp-schedule gpipe"}},
                             {{"name", "pp-1f1b"}, {"ranks", 2}, {"args", "--pp 2 --pp-schedule 1f1b"}}});
  const int status = run_bench(dir, matrix, 3, "--micro-batch-size 2");  // m = 8 micro-batches of 2 rows
  INFO(read_text(dir / "out.txt"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const json res = json::parse(read_text(dir / "results" / "res.json"));
  const std::string html = read_text(dir / "html" / "report.html");
  for (const json& r : res["layouts"]) {
    const std::string name = r["name"].get<std::string>();
    INFO(name);
    REQUIRE(r.contains("memory_timeline"));
    CHECK(!r.contains("trace"));  // traced into the work directory, which is gone
    const json& tl = r["memory_timeline"];
    CHECK(tl["step"] == 3);
    REQUIRE(tl["ranks"].size() == r["ranks"].get<size_t>());
    const json& r0 = tl["ranks"][0];
    CHECK(r0["t_ms"].size() >= 3);
    const std::string svg = "id='chart-memtime-" + name + "' data-samples='";
    const auto at = html.find(svg);
    REQUIRE(at != std::string::npos);
    CHECK(std::stoi(html.substr(at + svg.size())) == int(r0["t_ms"].size()));
    std::vector<int64_t> param = r0["bytes"]["param"].get<std::vector<int64_t>>();
    const auto top = std::max_element(param.begin(), param.end());
    if (name != "zero3") {
      CHECK(*top == param.front());
      CHECK(*std::min_element(param.begin(), param.end()) == param.front());  // flat: nothing gathered
      const std::vector<int64_t> act = r0["bytes"]["activation"].get<std::vector<int64_t>>();
      CHECK(*std::max_element(act.begin(), act.end()) > act.front() + 100000);  // the forward's, sampled
    } else {
      CHECK(*top > param.front());                                       // rises: a unit gathered
      CHECK(*std::min_element(top, param.end()) < *top);                 // and falls: released
    }
    if (name.rfind("pp-", 0) != 0) continue;
    // A sample after each of the stage's 16 actions (8 forwards, 8 backwards), and at the step's
    // start and end. The first stage's activations: one micro-batch's after its first forward;
    // gpipe holds all 8 before the first backward, 1f1b never more than 2 (p).
    CHECK(r0["t_ms"].size() >= 18);
    const std::vector<int64_t> act = r0["bytes"]["activation"].get<std::vector<int64_t>>();
    const double one = double(act[1] - act[0]), most = double(*std::max_element(act.begin(), act.end()) - act[0]);
    if (name == "pp-gpipe") CHECK(most > 7.5 * one);
    else CHECK(most < 2.5 * one);
    // The last stage sends each backward's input gradient upstream (2 x 32 x 64 f32: 16 KiB); a
    // completed send gives it back. Under 1f1b the next forward's input cannot arrive before the
    // first stage has received it, so at most ~2 are held (all 8 were, kept to the step's end).
    if (name == "pp-1f1b") {
      const std::vector<int64_t> grad = tl["ranks"][1]["bytes"]["grad"].get<std::vector<int64_t>>();
      const auto first = std::find_if(grad.begin(), grad.end(), [](int64_t g) { return g > 0; });
      REQUIRE(first != grad.end());
      CHECK(*std::max_element(grad.begin(), grad.end()) <= *first + 2 * 16384);
    }
  }
  CHECK(count(html, "<svg") == count(html, "</svg>"));
  fs::remove_all(dir);
}

// bench --simulate: the matrix at a real model's size, each layout a train --simulate of its
// ranks, charted like a measured run but without timing.
TEST_CASE("bench --simulate charts GPT-2 medium's bytes per rank for every layout, with ZeRO's divisions and no timing", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_sim_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string cmd = std::string(SG_BINARY) + " bench --simulate --model gpt2-medium --seq-len 256 --ranks 4 " +
                          "--layouts single,ddp,zero1,zero2,zero3,tp+sp,pp-interleaved --out " + (dir / "res").string() +
                          " --report " + (dir / "r.html").string() + " > " + (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(read_text(dir / "out.txt"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const json res = json::parse(read_text(dir / "res.json"));
  REQUIRE(res["layouts"].size() == 7);
  std::map<std::string, json> by_name;
  for (const auto& r : res["layouts"]) {
    INFO(r["name"]);
    REQUIRE(r["status"] == "ok");
    CHECK(r["measured"]["simulated"] == true);
    CHECK_FALSE(r["measured"].contains("tokens_per_s"));
    by_name[r["name"].get<std::string>()] = r["measured"];
  }
  CHECK(by_name["tp+sp"]["mem_peak"].size() == 4);
  const auto peak = [&](const char* layout, const char* cat) {
    return double(by_name[layout]["mem_peak"][0][cat].get<int64_t>());
  };
  // GPT-2 medium in f32: ZeRO-1 divides the optimizer state by 4, ZeRO-3 the parameters' shard too
  // (plus the gathered units at the peak); ddp and single hold it all.
  CHECK(peak("ddp", "optim_state") == peak("single", "optim_state"));
  CHECK(peak("zero1", "optim_state") == Approx(peak("ddp", "optim_state") / 4).epsilon(1e-4));
  CHECK(peak("zero3", "param") < peak("ddp", "param") / 2);
  CHECK(peak("zero2", "grad") < peak("zero1", "grad"));
  CHECK(by_name["ddp"]["comm_per_step"][0]["all_reduce"].get<double>() > 0);
  const std::string html = read_text(dir / "r.html");
  CHECK(html.find("id='chart-memory'") != std::string::npos);
  CHECK(html.find("id='chart-comm'") != std::string::npos);
  CHECK(html.find("id='chart-throughput'") == std::string::npos);  // nothing was timed
  // each memory bar is labelled with the peak of the sum, not the sum of the categories' peaks
  CHECK(html.find("' fill='#444'>peak ") != std::string::npos);
  CHECK(html.find("simulated on the meta device") != std::string::npos);
  fs::remove_all(dir);
}

// The page comes with every run: PREFIX.html beside PREFIX.json unless --report names another file
// or none; --from redraws it the same way.
TEST_CASE("bench writes its HTML page beside the results by default, and none by request", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_page_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto bench = [&](const std::string& args) {
    const std::string cmd = std::string(SG_BINARY) + " bench --simulate --layouts single,zero3 " + args + " > " +
                            (dir / "out.txt").string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    INFO(read_text(dir / "out.txt"));
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
  };
  REQUIRE(bench("--out " + (dir / "a").string()) == 0);
  CHECK(fs::exists(dir / "a.json"));
  CHECK(read_text(dir / "a.html").find("id='chart-memory'") != std::string::npos);
  CHECK(read_text(dir / "out.txt").find("wrote " + (dir / "a.html").string()) != std::string::npos);
  REQUIRE(bench("--out " + (dir / "b").string() + " --report none") == 0);
  CHECK(fs::exists(dir / "b.json"));
  CHECK_FALSE(fs::exists(dir / "b.html"));
  CHECK(read_text(dir / "out.txt").find(".html") == std::string::npos);
  REQUIRE(bench("--from " + (dir / "b.json").string() + " --out " + (dir / "c").string()) == 0);
  CHECK(read_text(dir / "c.html").find("id='chart-memory'") != std::string::npos);
  CHECK(bench("--from " + (dir / "b.json").string() + " --report none") != 0);
  CHECK(read_text(dir / "out.txt").find("--report none leaves nothing to do") != std::string::npos);
  fs::remove_all(dir);
}

// A layout's log cut off mid-record (a layout killed while writing) fails that layout, naming the
// log and its line; the layouts before it keep their results, the files are written and the
// temporary work directory (under TMPDIR) is removed. The launcher here runs each layout as one
// process and, for the row "cut", writes half a record and exits 0; for "odd", records without
// step_ms.
TEST_CASE("bench fails a layout whose log line is cut off and keeps the others' results", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_cut_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "tmp");
  std::ofstream(dir / "launcher.sh") << "#!/bin/sh\n"
                                        "while [ \"$1\" != \"${1#-}\" ]; do case \"$1\" in -x|-np) shift 2;; *) shift;; esac; done\n"
                                        "log=''; prev=''; for w in \"$@\"; do [ \"$prev\" = --log-json ] && log=\"$w\"; prev=\"$w\"; done\n"
                                        "case \"$log\" in *cut.jsonl) printf '{\"step\": 1, \"lo' > \"$log\"; exit 0;;\n"
                                        "  *odd.jsonl) printf '{\"step\": 1}\\n{\"step\": 2}\\n' > \"$log\"; exit 0;; esac\n"
                                        "exec \"$@\"\n";
  fs::permissions(dir / "launcher.sh", fs::perms::owner_all);
  std::ofstream(dir / "m.json")
      << R"([{"name":"good","ranks":2,"args":""},{"name":"cut","ranks":2,"args":""},{"name":"odd","ranks":2,"args":""}])";
  const std::string cmd = "TMPDIR=" + (dir / "tmp").string() + " " + SG_BINARY + " bench --n-layer 1 --steps 2 --warmup 1 " +
                          "--report none --matrix " + (dir / "m.json").string() + " --mpirun " + (dir / "launcher.sh").string() +
                          " --out " + (dir / "res").string() + " > " + (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(read_text(dir / "out.txt"));
  CHECK(WEXITSTATUS(status) == 1);  // a layout failed
  REQUIRE(fs::exists(dir / "res.json"));
  const json res = json::parse(read_text(dir / "res.json"));
  REQUIRE(res["layouts"].size() == 3);
  CHECK(res["layouts"][0]["status"] == "ok");
  CHECK(res["layouts"][1]["status"] == "failed");
  CHECK(res["layouts"][1]["reason"].get<std::string>().find("cut.jsonl line 1 is not JSON") != std::string::npos);
  // JSON, but not train's records (no step_ms): failed the same way, naming the log
  CHECK(res["layouts"][2]["status"] == "failed");
  CHECK(res["layouts"][2]["reason"].get<std::string>().find("odd.jsonl does not hold train's records") != std::string::npos);
  CHECK(fs::is_empty(dir / "tmp"));
  fs::remove_all(dir);
}

// Flags refused before any layout runs, and results files of another shape named with the field.
TEST_CASE("bench refuses a bad --timeout up front and names the file and field of a bad --from", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_flags_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto bench = [&](const std::string& args) {
    const std::string cmd = std::string(SG_BINARY) + " bench " + args + " > " + (dir / "out.txt").string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    return std::pair<int, std::string>{WEXITSTATUS(status), read_text(dir / "out.txt")};
  };
  auto [code, out] = bench("--simulate --layouts single --timeout abc --out " + (dir / "r").string());
  INFO(out);
  CHECK(code == 1);
  CHECK(out.find("bench: --timeout expects a number, got 'abc'") != std::string::npos);
  CHECK(out.find("[1/1]") == std::string::npos);  // nothing ran
  std::tie(code, out) = bench("--layouts single --warmup 0 --out " + (dir / "r").string());
  CHECK(code == 1);
  CHECK(out.find("bench: --warmup must be >= 1") != std::string::npos);
  CHECK(out.find("[1/1]") == std::string::npos);
  const std::string from = (dir / "e.json").string();
  for (const auto& [text, reason] :
       std::vector<std::pair<std::string, std::string>>{{"{}", ": \"layouts\" must be an array of layouts"},
                                                        {"[]", ": expected a bench results object"},
                                                        {R"({"layouts":[{"name":"x"}]})", ": layouts[0].\"ranks\" must be an integer"},
                                                        {R"({"layouts":[{"name":"x","ranks":1,"status":"ok","measured":{}}]})",
                                                         ": layouts[0].measured.\"mem_peak\" must be a non-empty array"},
                                                        // a memory chart whose samples do not line up
                                                        {R"({"layouts":[{"name":"x","ranks":1,"status":"ok","measured":)"
                                                         R"({"mem_peak":[{}],"comm_per_step":[{}]},"memory_timeline":)"
                                                         R"({"ranks":[{"t_ms":[0,1],"bytes":{"param":[5]}}]}}]})",
                                                         ": layouts[0].memory_timeline.ranks[0] must hold a \"t_ms\" array"}}) {
    std::ofstream(from) << text;
    auto [c, o] = bench("--from " + from + " --report " + (dir / "r.html").string());
    INFO(text << "\n" << o);
    CHECK(c == 1);
    CHECK(o.find("bench: --from " + from + reason) != std::string::npos);
  }
  fs::remove_all(dir);
}

// A command line that is not UTF-8 (a Latin-1 path) is written with U+FFFD in the results' "command",
// not thrown out with every layout's results after they ran.
TEST_CASE("bench writes its results when its command line is not UTF-8", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_latin1_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string prefix = (dir / "res").string() + "\xe9";
  const std::string cmd = std::string(SG_BINARY) + " bench --simulate --layouts single --report none --out '" + prefix +
                          "' > " + (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(read_text(dir / "out.txt"));
  CHECK(WEXITSTATUS(status) == 0);
  REQUIRE(fs::exists(prefix + ".json"));
  const json res = json::parse(read_text(prefix + ".json"));
  CHECK(res["command"].get<std::string>().find("res\xef\xbf\xbd") != std::string::npos);  // U+FFFD
  CHECK(res["layouts"][0]["status"] == "ok");
  fs::remove_all(dir);
}

// A matrix row's own --dtype and --batch-size shape its prediction as they shape its run (the
// bench's were taken: 4 bytes a parameter for a bf16 row, half the micro-batches' gradients).
TEST_CASE("bench predicts a matrix row with its own --dtype and --batch-size", "[cli]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_bench_rowflags_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "m.json") << R"([{"name": "bf16", "ranks": 2, "args": "--strategy zero2 --dtype bf16"},
                                       {"name": "b32", "ranks": 2, "args": "--strategy zero2 --batch-size 32"},
                                       {"name": "off", "ranks": 2, "args": "--strategy zero2 --offload optimizer"}])";
  const std::string cmd = std::string(SG_BINARY) + " bench --simulate --matrix " + (dir / "m.json").string() +
                          " --out " + (dir / "r").string() + " > " + (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(read_text(dir / "out.txt"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const json res = json::parse(read_text(dir / "r.json"));
  REQUIRE(res["layouts"].size() == 3);
  // the offloaded optimizer state: none on the device, predicted or measured, and shown on the host
  const json& off = res["layouts"][2]["measured"];
  CHECK(off["mem_host_peak"]["optim_state"].get<int64_t>() > 0);
  CHECK(res["layouts"][2]["predicted"]["optim_state"] == 0);
  CHECK(read_text(dir / "out.txt").find("GiB (offloaded)") != std::string::npos);
  CHECK(read_text(dir / "r.html").find("; host ") != std::string::npos);
  for (const auto& r : res["layouts"]) {
    INFO(r["name"]);
    const json &m = r["measured"], &p = r["predicted"];
    for (const char* cat : {"param", "optim_state"}) {  // (zero2's grad peak holds the bucket's full gradients)
      INFO(cat);
      CHECK(p[cat].get<double>() == double(m["mem_peak"][0][cat].get<int64_t>()));
    }
    CHECK(p["comm"]["reduce_scatter"].get<double>() == m["comm_per_step"][0]["reduce_scatter"].get<double>());
  }
  fs::remove_all(dir);
}
