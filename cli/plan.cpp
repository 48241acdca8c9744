// shardgrad plan: what a layout will cost before running it — memory per GPU by category,
// communication per step per link class, the pipeline bubble, step time, MFU and whether it fits
// (bench/report/planner.h) — or, with --search, every layout of the cluster that fits, fastest
// first. With --pp > 1 it also simulates the pipeline schedule: each rank's actions, the bubble
// measured on the simulated timeline against its formula, and the timeline as an SVG (--svg).
#include <cstdio>

#include "bench/report/planner.h"
#include "bench/report/timeline_svg.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "io/file.h"
#include "parallel/pp/schedule.h"

namespace sg::cli {

namespace {

// The plan's pipeline schedule, simulated: each rank's actions and the bubble against its
// formula (printed unless --json, whose output is the JSON alone), and its timeline as --svg.
void simulate_schedule(const Args& a, const report::Plan& plan) {
  const report::Layout& l = plan.input.layout;
  const std::string kind = l.pp_schedule;
  const int p = l.pp, m = int(plan.micro_batches);
  const int v = kind == "interleaved" ? l.virtual_stages : 1;
  parallel::pp::Schedule s = parallel::pp::make_schedule(kind, p, m, v);
  // A chunk holds 1/v of a rank's layers: its actions take 1/v as long.
  parallel::pp::Timeline t = parallel::pp::simulate(s, 1.0 / v, a.f64("backward-ratio") / v);
  const bool text = !a.on("json");
  if (text) {
    const double formula = double(p - 1) / double(v * m);
    std::printf("\n%s schedule, %d stages x %d chunk(s), %d micro-batches\n", kind.c_str(), p, v, m);
    for (int r = 0; r < p; ++r) {
      std::printf("rank %d:", r);
      for (const auto& act : s.per_rank[size_t(r)])
        std::printf(" %c%d", act.phase == parallel::pp::Phase::forward ? 'F' : 'B', act.micro);
      std::printf("   (peak %d %s activations held)\n", t.peak_in_flight(r), v > 1 ? "chunk x micro-batch" : "micro-batch");
    }
    std::printf("bubble: %.4f of busy time (formula (p-1)/(v m) = %.4f); step = %.2f times one stage's forward\n",
                t.bubble_fraction(), formula, t.makespan);
  }
  if (!a.str("svg").empty()) {
    io::write_text_atomic(a.str("svg"), "plan: --svg",
                          report::timeline_svg(t, kind + ", p=" + std::to_string(p) + ", m=" + std::to_string(m) +
                                                      (v > 1 ? ", v=" + std::to_string(v) : "")));
    std::fprintf(text ? stdout : stderr, "wrote %s\n", a.str("svg").c_str());
  }
}

// The `train --simulate` line that runs this layout on the meta device: the engine's exact bytes
// per rank where the plan has the papers' formulas.
std::string simulate_command(const report::Plan& plan) {
  const report::PlanInput& in = plan.input;
  const int world = plan.world;
  const report::ModelShape& m = in.model;
  const report::Layout& l = in.layout;
  const std::string preset = m.name.substr(0, m.name.find(" ("));  // "gpt2-xl (modified)": its dims follow
  std::string c = str("shardgrad train --simulate ", world, " --model ", preset, " --n-layer ", m.n_layer, " --n-head ", m.n_head, " --n-embd ",
                      m.n_embd, " --block-size ", m.block_size, " --vocab-size ", m.vocab_size, " --seq-len ", m.seq_len,
                      " --data ", m.vocab_size == 50257 ? std::string("random") : str("random:", m.vocab_size),
                      " --dtype ", in.dtype, " --batch-size ", in.global_batch, " --micro-batch-size ",
                      l.micro_batch_size, " --strategy ", l.strategy);
  if (l.strategy == "hsdp") c += str(" --shard-group-size ", plan.shard_group);  // the plan's (a node's, by default)
  if (l.offload != "none") c += " --offload " + l.offload;
  if (l.grad_accumulation != "sharded") c += " --grad-accumulation " + l.grad_accumulation;
  if (l.tp > 1) c += str(" --tp ", l.tp, l.sequence_parallel ? " --sequence-parallel" : "");
  if (l.pp > 1) c += str(" --pp ", l.pp, " --pp-schedule ", l.pp_schedule, " --virtual-stages ", l.virtual_stages);
  if (l.recompute != "none") c += " --recompute " + l.recompute;
  return c;
}

}  // namespace

int plan_main(int argc, char** argv) {
  Args a("plan", "Predict memory per GPU, traffic, bubble, step time and MFU of a layout; --search ranks the layouts that fit.");
  a.flag("model", "gpt2", "preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl");
  a.flag("n-layer", "0", "override the preset's layer count");
  a.flag("n-head", "0", "override the preset's head count");
  a.flag("n-embd", "0", "override the preset's width");
  a.flag("block-size", "0", "override the preset's longest sequence (rows of wpe)");
  a.flag("vocab-size", "0", "override the preset's vocabulary");
  a.flag("seq-len", "0", "tokens per row (0 = the block size)");
  a.flag("params", "0", "a raw parameter count instead of a model shape (model states and dp traffic only; the "
         "compute time with --seq-len)");
  a.flag("batch-size", "64", "global batch: sequences per optimizer step");
  a.flag("micro-batch-size", "1", "sequences per forward/backward");
  a.flag("dtype", "bf16", "fp32 | bf16 | fp16 (half types: f32 master weights in the optimizer state)");
  a.flag("optimizer", "adamw", "adamw (m and v in f32)");
  a.flag("cluster", "8xH100-NVLink-IB", "8xH100-NVLink-IB | 8xH200-NVLink-IB | 8xA100-NVLink-IB | cpu-local");
  a.flag("gpus-per-node", "0", "override the preset's GPUs per node");
  a.flag("nodes", "1", "nodes");
  a.flag("gpu-memory", "0", "override: GB per GPU");
  a.flag("intra-bandwidth", "0", "override: GB/s one GPU sends inside a node");
  a.flag("inter-bandwidth", "0", "override: GB/s one GPU sends across nodes");
  a.flag("peak-tflops", "0", "override: peak TFLOP/s per GPU in --dtype");
  a.flag("efficiency", "0", "override: achieved fraction of the peak in the model's compute");
  a.flag("dp", "0", "data-parallel degree (0 = every GPU of the cluster over tp x pp)");
  a.flag("tp", "1", "tensor-parallel degree");
  a.toggle("sequence-parallel", "with --tp: LayerNorm/dropout activations split along the sequence");
  a.flag("pp", "1", "pipeline stages");
  a.flag("strategy", "ddp", "ddp | zero1 | zero2 | zero3 | fsdp | fsdp-grad-op | hsdp");
  a.flag("shard-group-size", "0", "hsdp: dp ranks per shard group (0 = the dp ranks of one node)");
  a.flag("pp-schedule", "1f1b", "gpipe | 1f1b | interleaved");
  a.flag("virtual-stages", "1", "interleaved: model chunks per pipeline rank");
  a.flag("recompute", "none", "none | selective | full");
  a.flag("offload", "none", "none | optimizer | params");
  a.flag("grad-accumulation", "sharded", "zero2 and the fsdp family over several micro-batches: sharded (a "
         "reduce-scatter each) | unsharded (no_sync: full gradients accumulate, one reduce-scatter a step)");
  a.toggle("search", "enumerate the layouts of the cluster that fit and rank them by estimated throughput");
  a.flag("top", "10", "--search: how many layouts to show");
  a.toggle("json", "print machine-readable JSON instead of the text report");
  a.flag("micro-batches", "0", "micro-batches per step on each rank: sets --micro-batch-size to the rank's rows / M "
         "(0 = as --micro-batch-size gives)");
  a.flag("backward-ratio", "2", "pipeline simulation: backward time / forward time");
  a.flag("svg", "", "pipeline simulation: write the timeline picture here");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  report::PlanInput in;
  if (a.i64("params")) {
    SG_CHECK(a.i64("params") > 0, "plan: --params must be > 0");
    for (const char* f : {"model", "n-layer", "n-head", "n-embd", "block-size", "vocab-size"})
      SG_CHECK(!a.given(f), "plan: --params ", a.i64("params"), " is a raw parameter count; --", f,
               " shapes a model instead: give one or the other");
    in.model.params = a.i64("params");
    in.model.name = std::to_string(a.i64("params")) + " params";
    // tokens a row, for the compute time (6 FLOPs a parameter a token); none given: not estimated
    SG_CHECK(a.i64("seq-len") >= 0, "plan: --seq-len must be >= 0");
    SG_CHECK(a.i64("seq-len") > 0 || !a.on("search"), "plan: --search ranks layouts by tokens/s: with --params, ",
             "give --seq-len (the tokens a row)");
    in.model.seq_len = a.i64("seq-len");
  } else {
    in.model = report::model_preset(a.str("model"));
    auto set = [&](const char* f, int64_t& field) {
      if (a.i64(f) < 0) throw Error(str("plan: --", f, " must be >= 0"));
      if (a.i64(f)) field = a.i64(f);
    };
    set("n-layer", in.model.n_layer);
    set("n-head", in.model.n_head);
    set("n-embd", in.model.n_embd);
    set("block-size", in.model.block_size);
    set("vocab-size", in.model.vocab_size);
    in.model.seq_len = a.i64("seq-len") ? a.i64("seq-len") : in.model.block_size;
    SG_CHECK(in.model.n_embd % in.model.n_head == 0, "plan: --n-embd ", in.model.n_embd, " is not divisible by ",
             in.model.n_head, " heads");
    if (a.given("n-layer") || a.given("n-head") || a.given("n-embd") || a.given("vocab-size")) in.model.name += " (modified)";
  }
  SG_CHECK(a.str("optimizer") == "adamw", "plan: --optimizer '", a.str("optimizer"), "' (only adamw is modelled)");
  // The counts the layout keeps as int: each within the planner's limit before it is narrowed or
  // multiplied (a --tp of 2^32 + 1 is not tp 1); the rest of the limits are make_plan's.
  const auto count = [&](const char* flag, int64_t lo) {
    const int64_t v = a.i64(flag);
    SG_CHECK(v >= lo && v <= report::kMaxRanks, "plan: --", flag, " must be in [", lo, ", ", report::kMaxRanks,
             "] (2^20), got ", v);
    return int(v);
  };
  const int tp = count("tp", 1), pp = count("pp", 1), dp = count("dp", 0), virtual_stages = count("virtual-stages", 1);
  const int nodes = count("nodes", 1), gpus_per_node = count("gpus-per-node", 0), shard_group = count("shard-group-size", 0);
  SG_CHECK(int64_t(tp) * pp <= report::kMaxRanks, "plan: --tp ", tp, " x --pp ", pp, " = ", int64_t(tp) * pp,
           " GPUs per replica, more than the planner's ", report::kMaxRanks, " (2^20)");
  SG_CHECK(a.f64("backward-ratio") > 0, "plan: --backward-ratio must be > 0, got ", a.str("backward-ratio"));
  SG_CHECK(a.str("svg").empty() || (pp > 1 && !a.on("search")), "plan: --svg draws one layout's pipeline schedule: ",
           a.on("search") ? "not with --search" : "give --pp > 1");
  if (!a.str("svg").empty()) io::make_parent_folder(a.str("svg"), "plan: --svg");
  if (a.on("search"))  // the layouts are what it enumerates: a layout flag would be silently replaced
    for (const char* f : {"dp", "tp", "sequence-parallel", "pp", "strategy", "shard-group-size", "pp-schedule",
                          "virtual-stages", "recompute", "offload", "grad-accumulation", "micro-batch-size",
                          "micro-batches"})
      SG_CHECK(!a.given(f), "plan: --search tries the layouts itself (every tp, pp, strategy, schedule, recompute and ",
               "micro-batch size that fits): --", f, " would be ignored; drop it, or plan that one layout without --search");
  in.cluster = report::cluster_preset(a.str("cluster"));
  if (gpus_per_node) in.cluster.gpus_per_node = gpus_per_node;
  in.cluster.nodes = nodes;
  for (const char* f : {"gpu-memory", "intra-bandwidth", "inter-bandwidth", "peak-tflops", "efficiency"})
    SG_CHECK(!a.given(f) || a.f64(f) > 0, "plan: --", f, " must be > 0, got ", a.str(f), " (leave it out for the "
             "cluster preset's)");
  if (a.f64("gpu-memory") > 0) in.cluster.gpu_memory = a.f64("gpu-memory") * 1e9;
  if (a.f64("intra-bandwidth") > 0) in.cluster.intra_bandwidth = a.f64("intra-bandwidth") * 1e9;
  if (a.f64("inter-bandwidth") > 0) in.cluster.inter_bandwidth = a.f64("inter-bandwidth") * 1e9;
  if (a.f64("peak-tflops") > 0) in.cluster.peak_flops = a.f64("peak-tflops") * 1e12;
  if (a.f64("efficiency") > 0) in.cluster.efficiency = a.f64("efficiency");
  SG_CHECK(in.cluster.efficiency <= 1, "plan: --efficiency must be in (0, 1]");
  for (const char* f : {"gpus-per-node", "gpu-memory", "intra-bandwidth", "inter-bandwidth", "peak-tflops", "efficiency"})
    if (a.given(f)) {
      in.cluster.name += " (modified)";
      break;
    }
  in.global_batch = a.i64("batch-size");
  SG_CHECK(in.global_batch >= 1, "plan: --batch-size must be >= 1");
  in.dtype = a.str("dtype");
  report::check_input(in);  // the model, batch and cluster within the planner's limits: world below fits an int
  report::Layout& l = in.layout;
  l.tp = tp;
  l.pp = pp;
  const int world = in.cluster.gpus_per_node * in.cluster.nodes;
  if (dp) {
    l.dp = dp;
  } else {
    SG_CHECK(world % (l.tp * l.pp) == 0, "plan: --tp ", l.tp, " x --pp ", l.pp, " does not divide the cluster's ",
             world, " GPUs (give --dp)");
    l.dp = world / (l.tp * l.pp);
  }
  l.sequence_parallel = a.on("sequence-parallel");
  l.strategy = a.str("strategy");
  l.shard_group_size = shard_group;
  l.pp_schedule = a.str("pp-schedule");
  l.virtual_stages = virtual_stages;
  l.recompute = a.str("recompute");
  l.offload = a.str("offload");
  l.grad_accumulation = a.str("grad-accumulation");
  l.micro_batch_size = a.i64("micro-batch-size");
  if (const int64_t M = a.i64("micro-batches"); M != 0) {  // one count for the layout and its schedule
    const int64_t rows = in.global_batch / l.dp;
    SG_CHECK(M > 0 && in.global_batch % l.dp == 0 && rows % M == 0, "plan: --micro-batches ", M,
             " does not divide the rank's ", rows, " rows (--batch-size ", in.global_batch, " over dp ", l.dp, ")");
    SG_CHECK(!a.given("micro-batch-size") || l.micro_batch_size == rows / M, "plan: --micro-batches ", M,
             " means micro-batches of ", rows / M, " rows, but --micro-batch-size is ", l.micro_batch_size);
    l.micro_batch_size = rows / M;
  }

  if (a.on("search")) {
    SG_CHECK(a.i64("top") >= 1, "plan: --top must be >= 1, got ", a.i64("top"));
    std::vector<report::Plan> found = report::search_plans(in);
    const size_t top = size_t(a.i64("top"));
    if (a.on("json")) {  // an empty list when nothing fits, and the same exit status as the text
      nlohmann::json j = nlohmann::json::array();
      for (size_t i = 0; i < found.size() && i < top; ++i) j.push_back(found[i].to_json());
      std::printf("%s\n", j.dump(2).c_str());
      return found.empty() ? 1 : 0;
    }
    std::printf("%zu layouts of %d GPUs fit %s (%s, global batch %lld); the fastest %zu:\n", found.size(), world,
                in.model.name.c_str(), in.dtype.c_str(), (long long)in.global_batch, std::min(top, found.size()));
    std::printf("(bubble: idle time over busy time, (p-1)/(v m) for the schedules here)\n");
    std::printf("%4s  %-52s %10s %8s %7s %10s %12s\n", "rank", "layout", "GiB/GPU", "bubble", "MFU", "step s", "tokens/s");
    for (size_t i = 0; i < found.size() && i < top; ++i) {
      const report::Plan& p = found[i];
      std::printf("%4zu  %-52s %10.2f %7.1f%% %6.1f%% %10.4f %12.0f\n", i + 1, p.input.layout.label().c_str(),
                  p.worst.total() / double(1ll << 30), 100 * p.bubble, 100 * p.mfu, p.step_s, p.tokens_per_s);
    }
    return found.empty() ? 1 : 0;
  }
  report::Plan plan = report::make_plan(in);
  if (a.on("json")) {
    if (l.pp > 1) simulate_schedule(a, plan);  // for --svg's file alone, before the JSON
    std::printf("%s\n", plan.to_json().dump(2).c_str());
  } else {
    std::printf("%s", report::describe(plan).c_str());
    if (in.model.has_shape() && (l.offload == "none" || report::shards_params(l.strategy))) {  // train offloads the FSDP family only
      if (plan.world <= 4096)
        std::printf("this engine's own bytes for the layout, per rank (the formulas above are the papers'):\n  %s\n",
                    simulate_command(plan).c_str());
      else
        std::printf("(the engine's own bytes: train --simulate runs at most 4096 ranks; this layout has %d)\n", plan.world);
    }
    if (l.pp > 1) simulate_schedule(a, plan);
  }
  return 0;
}

}  // namespace sg::cli
