// The planner against theory (ZeRO's model-state memory, Megatron's bubble, Korthikanti's
// activations, the collectives' volumes) and against the engine itself: for small CPU layouts, the
// predicted param/grad/optimizer bytes and bytes per collective kind equal what `shardgrad train`
// measures in its ledger and counters.
#include "tests/catch.h"
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/report/planner.h"
#include "core/error.h"

namespace fs = std::filesystem;
using namespace sg::report;

namespace {

PlanInput raw(int64_t psi, int n, const std::string& strategy, const std::string& dtype = "bf16") {
  PlanInput in;
  in.model.params = psi;
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.cluster.nodes = 16;
  in.layout.dp = n;
  in.layout.strategy = strategy;
  in.global_batch = n;
  in.dtype = dtype;
  return in;
}

int64_t model_states(const Plan& p) { return p.worst.param + p.worst.grad + p.worst.optim_state; }

}  // namespace

TEST_CASE("model states per GPU are ZeRO's 2Ψ + 2Ψ + 12Ψ in mixed precision, the stage's part divided by N") {
  for (int64_t psi : {int64_t(1000), int64_t(123457), int64_t(7500000001)}) {
    for (int n : {1, 2, 8, 64}) {
      const int64_t part = (psi + n - 1) / n;  // the engine pads the flat vector to a multiple of N
      INFO("Ψ = " << psi << ", N = " << n);
      CHECK(model_states(make_plan(raw(psi, n, "ddp"))) == 16 * psi);
      CHECK(model_states(make_plan(raw(psi, n, "zero1"))) == 2 * psi + 2 * psi + 12 * part);
      CHECK(model_states(make_plan(raw(psi, n, "zero2"))) == 2 * psi + 14 * part);
      CHECK(model_states(make_plan(raw(psi, n, "zero3"))) == 16 * part);
      CHECK(model_states(make_plan(raw(psi, n, "fsdp"))) == 16 * part);
    }
  }
}

TEST_CASE("the ZeRO paper's 7.5B-parameter example on 64 GPUs: 120, 31.4, 16.6 and 1.9 GB") {
  const int64_t psi = 7500000000;
  CHECK(double(model_states(make_plan(raw(psi, 64, "ddp")))) / 1e9 == Approx(120.0).margin(0.05));
  CHECK(double(model_states(make_plan(raw(psi, 64, "zero1")))) / 1e9 == Approx(31.4).margin(0.05));
  CHECK(double(model_states(make_plan(raw(psi, 64, "zero2")))) / 1e9 == Approx(16.6).margin(0.05));
  CHECK(double(model_states(make_plan(raw(psi, 64, "zero3")))) / 1e9 == Approx(1.875).margin(0.05));
  // and so is zero3's total: a raw count has no FSDP units, so no gathered unit is added (it had
  // counted the whole model as one, 28 GB, which made zero3 look worse than zero2)
  CHECK(make_plan(raw(psi, 64, "zero3")).worst.total() / 1e9 == Approx(1.875).margin(0.05));
}

TEST_CASE("a raw parameter count is timed only with the tokens a row: 6 FLOPs a parameter a token") {
  PlanInput in = raw(7500000000, 64, "zero2");
  const Plan untimed = make_plan(in);
  CHECK_FALSE(untimed.timed());
  CHECK((untimed.compute_s == 0 && untimed.tokens_per_s == 0 && untimed.mfu == 0));
  CHECK(untimed.step_s == untimed.comm_exposed_s);  // what it can say: the exposed communication
  CHECK(untimed.comm_exposed_s > 0);
  in.model.seq_len = 2048;
  const Plan timed = make_plan(in);
  REQUIRE(timed.timed());
  const double tokens_per_rank = 2048;  // one row a rank
  CHECK(timed.compute_s == Approx(tokens_per_rank * 6 * 7500000000.0 / (in.cluster.peak_flops * in.cluster.efficiency)));
  CHECK(timed.tokens_per_s == Approx(64 * 2048 / timed.step_s));
}

TEST_CASE("fp32 training keeps no master copy: 4Ψ + 4Ψ + 8Ψ") {
  CHECK(model_states(make_plan(raw(1000, 1, "ddp", "fp32"))) == 16 * 1000);
  CHECK(make_plan(raw(1000, 4, "zero1", "fp32")).worst.optim_state == 8 * 250);
  CHECK(make_plan(raw(1000, 4, "zero2", "fp32")).worst.param == 4 * 1000);
  CHECK(make_plan(raw(1000, 4, "zero2", "fp32")).worst.grad == 4 * 250);
}

TEST_CASE("offloading the optimizer leaves no optimizer state on the GPU, offloading params needs sharded params") {
  PlanInput in = raw(1000000, 8, "zero3");
  in.layout.offload = "optimizer";
  CHECK(make_plan(in).worst.optim_state == 0);
  CHECK(make_plan(in).worst.param == 2 * 125000);
  in.layout.offload = "params";
  CHECK(make_plan(in).worst.param == 0);
  in.layout.strategy = "ddp";
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("shards") && Catch::Contains("ddp"));
}

TEST_CASE("data-parallel traffic per step: ddp 2(N-1)/N·Ψ, zero1/2 the same split in two, zero3 3Ψ") {
  const int64_t psi = 1000000, bytes = 4 * psi;  // fp32
  const Plan ddp = make_plan(raw(psi, 4, "ddp", "fp32"));
  CHECK(ddp.comm.at("all_reduce") == 2 * 3 * bytes / 4);
  const Plan z1 = make_plan(raw(psi, 4, "zero1", "fp32"));
  CHECK(z1.comm.at("reduce_scatter") == 3 * bytes / 4);
  CHECK(z1.comm.at("all_gather") == 3 * bytes / 4);
  const Plan z3 = make_plan(raw(psi, 4, "zero3", "fp32"));
  CHECK(z3.comm.at("all_gather") == 2 * 3 * bytes / 4);
  CHECK(z3.comm.at("reduce_scatter") == 3 * bytes / 4);
  // All inside one node of 8 GPUs; across two nodes the same bytes are inter-node.
  CHECK(z3.inter_bytes == 0);
  PlanInput wide = raw(psi, 16, "zero3", "fp32");
  CHECK(make_plan(wide).inter_bytes > 0);
  CHECK(make_plan(wide).intra_bytes == 0);
}

TEST_CASE("zero2 over M micro-batches: accumulating sharded reduce-scatters M times a step, unsharded once beside the full gradient, as under sequence parallelism") {
  PlanInput in = raw(1000000, 4, "zero2", "fp32");
  in.global_batch = 16;  // 4 rows a rank, one a micro-batch
  in.layout.micro_batch_size = 1;
  const Plan sharded = make_plan(in);
  in.layout.grad_accumulation = "unsharded";
  const Plan unsharded = make_plan(in);
  CHECK(sharded.comm.at("reduce_scatter") == 4 * unsharded.comm.at("reduce_scatter"));
  CHECK(unsharded.comm.at("reduce_scatter") == 3 * 4 * 1000000 / 4);
  CHECK(sharded.comm.at("all_gather") == unsharded.comm.at("all_gather"));
  CHECK(sharded.worst.grad == 4 * 1000000 / 4);  // the shard at the step, either way
  CHECK(unsharded.worst.grad == sharded.worst.grad);
  CHECK(unsharded.worst.buffers == sharded.worst.buffers + 4.0 * 1000000);  // + the full gradient
  CHECK(unsharded.input.layout.label().find("accum:unsharded") != std::string::npos);
  in.layout.grad_accumulation = "sharded";
  in.layout.tp = 2, in.layout.dp = 2, in.layout.sequence_parallel = true;  // reduced once a step, after the tp sum
  in.global_batch = 8;
  in.model.n_layer = 0;
  CHECK(make_plan(in).comm.at("reduce_scatter") == 4 * 1000000 / 2 / 2);  // (N-1)/N of 4Ψ/tp, once (not 4 times)
  in.layout = raw(1000000, 4, "zero1", "fp32").layout;
  in.layout.grad_accumulation = "unsharded";
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--grad-accumulation unsharded is for zero2 and the fsdp family"));
  // the fsdp family's no_sync: the reduce-scatters once a step, the gathers every micro-batch
  in.layout.strategy = "zero3", in.layout.micro_batch_size = 1, in.global_batch = 16, in.model.n_layer = 0;
  const Plan z3_sync = make_plan(in);
  in.layout.grad_accumulation = "sharded";
  const Plan z3 = make_plan(in);
  CHECK(z3.comm.at("reduce_scatter") == 4 * z3_sync.comm.at("reduce_scatter"));
  CHECK(z3.comm.at("all_gather") == z3_sync.comm.at("all_gather"));
  CHECK(z3_sync.worst.buffers > z3.worst.buffers);  // the full gradient held between micro-batches
  in.layout.grad_accumulation = "unsharded", in.layout.pp = 2, in.layout.dp = 2;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("not for pipelines"));
}

TEST_CASE("what the backward hides: ddp and unsharded zero2 reduce in the last micro-batch's backward, sharded zero2 in every one, a pipeline after the schedule") {
  PlanInput in = raw(100000000, 8, "ddp", "bf16");  // 2e8 bytes of bf16 gradient, 8 ranks in a node
  in.global_batch = 32;                             // 4 rows a rank
  in.model.seq_len = 1;                             // a token a row: timed (the compute is scaled below)
  const auto plan = [&](const char* strategy, int64_t mbs, const char* accumulation = "sharded", int pp = 1) {
    PlanInput x = in;
    x.layout.strategy = strategy, x.layout.micro_batch_size = mbs, x.layout.grad_accumulation = accumulation;
    x.layout.pp = pp, x.layout.dp = 8 / pp;
    return make_plan(x);
  };
  const double bw = in.cluster.intra_bandwidth;
  const double u = double(plan("zero2", 4).comm.at("all_gather")) / bw;  // one (N-1)/N pass over the gradient
  // the compute slowed until the step's backward takes 4u, twice ddp's all-reduce (2u)
  const double backward_at_1 = plan("ddp", 4).compute_s * 2.0 / 3.0;
  in.cluster.efficiency *= backward_at_1 / (4 * u);
  REQUIRE(plan("ddp", 4).compute_s * 2.0 / 3.0 == Approx(4 * u));
  CHECK(plan("ddp", 4).comm_exposed_s == Approx(0).margin(1e-12));  // one micro-batch: its backward hides it
  CHECK(plan("ddp", 1).comm_exposed_s == Approx(2 * u - u));        // 4: the last one's (u) hides half
  // zero2 over 4 micro-batches, sharded: 4u of reduce-scatter behind 4u of backward, then the
  // all-gather (u); unsharded: u behind the last micro-batch's u, then the all-gather
  CHECK(plan("zero2", 1).comm_exposed_s == Approx(u));
  CHECK(plan("zero2", 1, "unsharded").comm_exposed_s == Approx(u));
  // twice the reduce-scatters for half the backward: sharded's exceed what it hides
  in.cluster.efficiency *= 2;
  CHECK(plan("zero2", 1).comm_exposed_s == Approx(4 * u - 2 * u + u));
  CHECK(plan("zero2", 1, "unsharded").comm_exposed_s == Approx(u - 0.5 * u + u));
  // under a pipeline the reductions wait for the schedule's end: nothing hides them
  const Plan piped = plan("ddp", 1, "sharded", 2);
  CHECK(piped.comm_exposed_s >= double(piped.comm.at("all_reduce")) / bw);
}

TEST_CASE("hsdp shards inside a node and all-reduces the shards across nodes") {
  PlanInput in = raw(8000000, 16, "hsdp", "fp32");  // 2 nodes of 8
  const Plan p = make_plan(in);
  CHECK(p.worst.param == 4 * 8000000 / 8);
  // the shards across the 2 nodes, and the norm's partial sum inside a shard group of 8
  CHECK(p.comm.at("all_reduce") == 2 * 1 * (4 * 1000000) / 2 + 2 * 7 * 8 / 8);
  CHECK(p.inter_bytes > 0);
  CHECK(p.intra_bytes > 0);
}

TEST_CASE("the pipeline bubble is Megatron's (p-1)/m, and (p-1)/(v m) interleaved") {
  PlanInput in;
  in.model = model_preset("gpt2");
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.global_batch = 16;
  in.layout.pp = 4;
  in.layout.micro_batch_size = 1;
  for (const char* s : {"gpipe", "1f1b"}) {
    in.layout.pp_schedule = s;
    CHECK(make_plan(in).bubble == Approx(3.0 / 16));
  }
  in.layout.pp_schedule = "interleaved";
  in.layout.virtual_stages = 3;
  CHECK(make_plan(in).bubble == Approx(3.0 / (3 * 16)));
}

TEST_CASE("activations follow Korthikanti et al.: 34sbh + 5as²b per layer, /t with sequence parallelism") {
  PlanInput in;
  in.model.name = "hand";
  in.model.n_layer = 2, in.model.n_head = 4, in.model.n_embd = 64, in.model.seq_len = 128, in.model.block_size = 128;
  in.model.vocab_size = 64;
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.global_batch = 1;
  // Per layer 34·128·64 + 5·4·128²; two layers; plus the f32 logits, one copy (the fused classifier
  // stores no softmax and writes the gradient over them): 4·128·64.
  CHECK(make_plan(in).worst.activation == Approx(2 * (278528 + 327680) + 32768));
  in.layout.recompute = "selective";
  CHECK(make_plan(in).worst.activation == Approx(2 * 278528 + 32768));
  in.layout.recompute = "full";
  CHECK(make_plan(in).worst.activation == Approx(2 * (2 * 8192) + 32768));
  in.layout.recompute = "none";
  in.layout.tp = 2;
  CHECK(make_plan(in).worst.activation == Approx(2 * (8192 * (10 + 12) + 327680 / 2) + 32768 / 2));
  in.layout.sequence_parallel = true;
  CHECK(make_plan(in).worst.activation == Approx(2 * (278528 + 327680) / 2 + 32768 / 2));
  // GPipe holds every micro-batch of a step, 1F1B at most p on the first stage.
  in.layout = Layout{};
  in.layout.pp = 2;
  in.global_batch = 8;
  in.layout.pp_schedule = "gpipe";
  const double gpipe = make_plan(in).per_stage[0].activation;
  in.layout.pp_schedule = "1f1b";
  const double one_f_one_b = make_plan(in).per_stage[0].activation;
  CHECK(gpipe == Approx(8 * (278528 + 327680)));
  CHECK(one_f_one_b == Approx(2 * (278528 + 327680)));
}

TEST_CASE("impossible layouts are refused with the reason") {
  PlanInput in;
  in.model = model_preset("gpt2");
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.global_batch = 8;
  in.layout.tp = 8;
  in.layout.dp = 2;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("16 GPUs"));
  in.layout.dp = 1;
  in.model.n_head = 12;
  in.layout.tp = 8;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("12 heads cannot be split 8 ways"));
  in.layout.tp = 1;
  in.layout.pp = 5;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("12 layers"));
  in.layout.pp = 1;
  in.layout.micro_batch_size = 3;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--micro-batch-size 3"));
  in.layout.micro_batch_size = 1;
  // what train refuses: offloading ddp's optimizer, virtual stages outside an interleaved pipeline
  in.layout.offload = "optimizer";
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--offload is for the sharded strategies"));
  in.layout.offload = "none";
  in.layout.virtual_stages = 2;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--virtual-stages 2 is for the interleaved schedule"));
  in.layout.pp = 2;
  in.layout.pp_schedule = "interleaved";
  CHECK_NOTHROW(make_plan(in));
  CHECK_THROWS_WITH(cluster_preset("8xB200"), Catch::Contains("8xH100-NVLink-IB"));
}

TEST_CASE("search finds only layouts that fit, fastest first, and a model too big for ddp fits sharded") {
  PlanInput in;
  in.model = model_preset("gpt2-xl");
  in.cluster = cluster_preset("8xA100-NVLink-IB");
  in.cluster.gpu_memory = 24e9;
  in.global_batch = 64;
  in.layout.dp = 8;
  in.layout.micro_batch_size = 1;
  in.layout.recompute = "full";
  CHECK_FALSE(make_plan(in).fits);  // 1.56B params x 16 bytes = 25 GB of model states alone
  in.layout.strategy = "zero3";
  CHECK(make_plan(in).fits);
  std::vector<Plan> found = search_plans(in);
  REQUIRE(!found.empty());
  for (size_t i = 0; i < found.size(); ++i) {
    CHECK(found[i].fits);
    CHECK(found[i].world == 8);
    if (i) CHECK(found[i - 1].tokens_per_s >= found[i].tokens_per_s * (1 - 1e-9));  // ties (to rounding): less memory first
  }
  bool any_ddp = false, grad_op = false, grad_op_piped = false;
  for (const auto& p : found) {
    any_ddp |= p.input.layout.strategy == "ddp" && p.input.layout.tp * p.input.layout.pp == 1;
    if (p.input.layout.strategy == "fsdp-grad-op") (p.input.layout.pp == 1 ? grad_op : grad_op_piped) = true;
  }
  CHECK_FALSE(any_ddp);
  // zero2 accumulating unsharded (fewer bytes, the full gradient held) is searched beside sharded
  // wherever a rank runs several micro-batches; never where both would reduce once a step
  bool zero2_unsharded = false;
  for (const auto& p : found) {
    const Layout& l = p.input.layout;
    if (l.strategy != "zero2" || l.grad_accumulation != "unsharded") continue;
    zero2_unsharded = true;
    CHECK(l.pp == 1);
    CHECK_FALSE(l.sequence_parallel);
    CHECK(in.global_batch / l.dp > l.micro_batch_size);
  }
  CHECK(zero2_unsharded);
  CHECK(grad_op);  // a candidate: ZeRO-2's traffic with the parameters sharded between steps
  CHECK(grad_op_piped);  // and under a pipeline, where its units stay gathered all step
  // Under a pipeline fsdp-grad-op gathers and reduces each unit once a step, zero3 every
  // micro-batch: halving the micro-batches (mbs 1 -> 2) halves zero3's block traffic only.
  const auto gathered = [&](const char* strategy, int64_t mbs) {
    PlanInput x = in;
    x.layout.dp = 4, x.layout.pp = 2, x.layout.strategy = strategy, x.layout.micro_batch_size = mbs;
    return make_plan(x).comm.at("all_gather");
  };
  CHECK(gathered("fsdp-grad-op", 1) == gathered("fsdp-grad-op", 2));
  CHECK(gathered("zero3", 1) > gathered("zero3", 2));
}

TEST_CASE("under a pipeline the reductions left to the step's end are exposed: all of fsdp-grad-op's, zero3's roots'") {
  // Compute so slow that every gather and every per-micro-batch reduction hides behind it: what
  // stays exposed is the pipeline's sends and the reduce-scatters that finish_gradients runs after
  // the schedule (stage 0, wte, wpe and 6 blocks, sends the most).
  PlanInput in;
  in.model = model_preset("gpt2");
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.cluster.peak_flops = 1e6;
  in.layout.dp = 4, in.layout.pp = 2, in.layout.micro_batch_size = 1;
  in.global_batch = 32;  // 8 micro-batches a replica
  in.layout.strategy = "fsdp-grad-op";
  const Plan grad_op = make_plan(in);
  in.layout.strategy = "zero3";
  const Plan zero3 = make_plan(in);
  REQUIRE(zero3.micro_batches == 8);
  CHECK(zero3.comm.at("send") == grad_op.comm.at("send"));
  // fsdp-grad-op reduces the blocks and the roots once each; zero3 the blocks every micro-batch
  // (each hidden behind the next backward) and the roots once: the exposed times differ by the
  // blocks' one reduction.
  const double go = double(grad_op.comm.at("reduce_scatter")), z3 = double(zero3.comm.at("reduce_scatter"));
  const double blocks = (z3 - go) / (8 - 1);
  CHECK(blocks > 0);
  CHECK(grad_op.comm_exposed_s - zero3.comm_exposed_s == Approx(blocks / in.cluster.intra_bandwidth));
  // and with the sends alone exposed besides, grad-op's is the sends' and all its reductions'
  const double sends = double(grad_op.comm.at("send")) / in.cluster.intra_bandwidth;
  CHECK(grad_op.comm_exposed_s == Approx(sends + go / in.cluster.intra_bandwidth));
  CHECK(zero3.comm_exposed_s == Approx(sends + (go - blocks) / in.cluster.intra_bandwidth));
}

// ---- against the engine ----

namespace {

struct EngineRun {
  std::vector<nlohmann::json> steps;
  std::string output;
  int code = 0;
};

// The tiny CPU model both sides describe: 2 layers, width 32, 2 heads, 16 tokens, vocabulary 64.
const char* kTiny = "--n-layer 2 --n-embd 32 --n-head 2 --seq-len 16 --block-size 16 --vocab-size 64 --batch-size 8 "
                    "--threads 1 --eval-every 0 --eval-batches 1 --eval-problems 8 --steps 3";

EngineRun run_engine(int ranks, const std::string& flags) {
  static int n = 0;
  const fs::path dir = fs::temp_directory_path() / ("sg_planner_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  fs::create_directories(dir);
  std::string cmd = ranks > 1 ? std::string(SG_MPIEXEC) + " --oversubscribe --allow-run-as-root --bind-to none -x OMP_NUM_THREADS=1 -np " +
                                    std::to_string(ranks) + " "
                              : std::string();
  cmd += std::string(SG_BINARY) + " train " + kTiny + " " + flags + " --log-json " + (dir / "log.jsonl").string() +
         " > " + (dir / "out.txt").string() + " 2>&1";
  EngineRun r;
  const int status = std::system(cmd.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream out(dir / "out.txt");
  r.output.assign(std::istreambuf_iterator<char>(out), {});
  std::ifstream log(dir / "log.jsonl");
  for (std::string line; std::getline(log, line);)
    if (!line.empty()) r.steps.push_back(nlohmann::json::parse(line));
  fs::remove_all(dir);
  return r;
}

PlanInput tiny_plan(const Layout& l) {
  PlanInput in;
  in.model.name = "tiny";
  in.model.n_layer = 2, in.model.n_embd = 32, in.model.n_head = 2, in.model.seq_len = 16, in.model.block_size = 16;
  in.model.vocab_size = 64;
  in.cluster = cluster_preset("cpu-local");
  in.global_batch = 8;
  in.dtype = "fp32";
  in.layout = l;
  return in;
}

}  // namespace

TEST_CASE("the planner's param, grad and optimizer bytes and bytes per collective equal the engine's ledger and counters", "[cli][mpi]") {
  struct Case {
    const char* flags;
    Layout layout;
    int ranks;
    // zero2/zero3 keep a shard gradient; the others hold full ones at the step, which is then the
    // grad peak (a pipeline stage's input gradient is charged as an activation, not a gradient)
    bool grad_is_shard;
  };
  auto layout = [](int dp, int tp, int pp, const char* strategy, int64_t mbs) {
    Layout l;
    l.dp = dp, l.tp = tp, l.pp = pp, l.strategy = strategy, l.micro_batch_size = mbs;
    return l;
  };
  const std::vector<Case> cases = {
      {"", layout(1, 1, 1, "ddp", 8), 1, false},
      {"--strategy ddp", layout(2, 1, 1, "ddp", 4), 2, false},
      {"--strategy zero1", layout(2, 1, 1, "zero1", 4), 2, false},
      {"--strategy zero2", layout(2, 1, 1, "zero2", 4), 2, true},
      // two micro-batches a rank: sharded accumulation reduce-scatters each, unsharded once
      {"--strategy zero2 --micro-batch-size 2", layout(2, 1, 1, "zero2", 2), 2, true},
      {"--strategy zero2 --micro-batch-size 2 --grad-accumulation unsharded",
       [&] { Layout l = layout(2, 1, 1, "zero2", 2); l.grad_accumulation = "unsharded"; return l; }(), 2, true},
      {"--strategy zero3", layout(2, 1, 1, "zero3", 4), 2, true},
      {"--strategy zero3 --micro-batch-size 2", layout(2, 1, 1, "zero3", 2), 2, true},
      {"--strategy zero3 --micro-batch-size 2 --grad-accumulation unsharded",
       [&] { Layout l = layout(2, 1, 1, "zero3", 2); l.grad_accumulation = "unsharded"; return l; }(), 2, true},
      {"--strategy fsdp-grad-op --micro-batch-size 2", layout(2, 1, 1, "fsdp-grad-op", 2), 2, true},
      {"--pp 2 --micro-batch-size 2 --pp-schedule 1f1b", layout(1, 1, 2, "ddp", 2), 2, false},
      {"--pp 2 --micro-batch-size 2 --pp-schedule gpipe", layout(1, 1, 2, "ddp", 2), 2, false},
      {"--pp 2 --strategy zero3 --micro-batch-size 2", layout(2, 1, 2, "zero3", 2), 4, true},
      {"--pp 2 --strategy fsdp-grad-op --micro-batch-size 2", layout(2, 1, 2, "fsdp-grad-op", 2), 4, true},
      {"--pp 2 --strategy hsdp --shard-group-size 2 --micro-batch-size 2", layout(2, 1, 2, "hsdp", 2), 4, true},
      // shard groups of 2 inside one node of 4: the group's size comes from the flag, not the node
      {"--strategy hsdp --shard-group-size 2 --micro-batch-size 2",
       [&] { Layout l = layout(4, 1, 1, "hsdp", 2); l.shard_group_size = 2; return l; }(), 4, true},
      {"--strategy hsdp --shard-group-size 2 --micro-batch-size 1 --grad-accumulation unsharded", [&] {
         Layout l = layout(4, 1, 1, "hsdp", 1);
         l.shard_group_size = 2, l.grad_accumulation = "unsharded";
         return l;
       }(), 4, true},
      {"--tp 2", layout(1, 2, 1, "ddp", 8), 2, false},
      {"--tp 2 --micro-batch-size 4", layout(1, 2, 1, "ddp", 4), 2, false},
      {"--tp 2 --sequence-parallel", [&] { Layout l = layout(1, 2, 1, "ddp", 8); l.sequence_parallel = true; return l; }(), 2, false},
  };
  for (const Case& c : cases) {
    INFO("train " << c.flags << " on " << c.ranks << " rank(s)");
    PlanInput in = tiny_plan(c.layout);
    in.cluster.gpus_per_node = std::max(in.cluster.gpus_per_node, c.ranks);  // one node of this many ranks
    const Plan plan = make_plan(in);
    EngineRun run = run_engine(c.ranks, c.flags);
    INFO(run.output);
    REQUIRE(run.code == 0);
    REQUIRE(run.steps.size() == 3);
    const auto& last = run.steps[2]["ranks"];
    const auto& prev = run.steps[1]["ranks"];
    REQUIRE(int(last.size()) == c.ranks);
    for (int r = 0; r < c.ranks; ++r) {
      INFO("rank " << r);
      const RankMemory& want = plan.per_stage[size_t(r % c.layout.pp)];
      const auto& mem = last[size_t(r)]["mem"];
      CHECK(mem["param"]["current"].get<int64_t>() == want.param);
      CHECK(mem["optim_state"]["current"].get<int64_t>() == want.optim_state);
      if (c.grad_is_shard) CHECK(mem["grad"]["current"].get<int64_t>() == want.grad);
      else CHECK(mem["grad"]["peak"].get<int64_t>() == want.grad);
      if (r != 0) continue;  // plan.comm is pipeline rank 0's
      for (const auto& [kind, counted] : last[0]["comm"].items()) {
        const int64_t per_step = counted["bytes"].get<int64_t>() - prev[0]["comm"][kind]["bytes"].get<int64_t>();
        const int64_t predicted = plan.comm.count(kind) ? plan.comm.at(kind) : 0;
        INFO("collective " << kind);
        CHECK(per_step == predicted);
      }
    }
  }
}

// Past its limits (planner.h) the planner's int64 byte counts would overflow or its simulated
// schedule would run for minutes: each is refused naming the flag. Within them the counts hold:
// an all-reduce of 32 TB over a million ranks is 2(N-1)/N of it, not a wrapped product.
TEST_CASE("the planner refuses inputs past its limits by name and counts exactly up to them") {
  PlanInput in;
  in.model = model_preset("gpt2");
  in.cluster = cluster_preset("8xH100-NVLink-IB");
  in.global_batch = 8;
  in.layout.dp = 8;
  in.model.n_layer = 99999999999;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--n-layer must be in [1, 100000], got 99999999999"));
  CHECK_THROWS_WITH(search_plans(in), Catch::Contains("--n-layer must be in [1, 100000]"));  // not "none fit"
  in.model.n_layer = 12;
  in.model.vocab_size = int64_t(1) << 40;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--vocab-size must be in [1, 1073741824]"));
  in.model.vocab_size = 50257;
  in.model.n_layer = 100000, in.model.n_embd = 65536, in.model.n_head = 64;  // 5.2e15 parameters
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("more than the planner's 8796093022208 (2^43)"));
  in.model = model_preset("gpt2");
  in.global_batch = int64_t(1) << 40;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("more than the planner's 2^54"));
  in.global_batch = 8 << 20;  // a million micro-batches per rank
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("1048576 micro-batches a step, more than the planner's 65536"));
  in.global_batch = 8;
  in.cluster.nodes = 1 << 20;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("= 8388608 GPUs"));
  // dp x tp x pp past int: counted in int64, refused as more GPUs than the cluster has
  in.cluster.nodes = 1;
  in.layout.dp = 1 << 20, in.layout.tp = 1 << 12, in.layout.pp = 1 << 12;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("= 17592186044416 GPUs, the cluster has 8"));
  // a pipeline whose simulation would take minutes
  in = raw(1000000, 1, "ddp");
  in.layout.pp = 1024, in.global_batch = 2048, in.cluster.nodes = 128;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("--pp 1024 x --virtual-stages 1 x 2048 micro-batches = 2097152"));
  // ddp over 2^20 ranks of 2^43 parameters in bf16: 2 (N-1)/N x 2^44 bytes, past 2^63 if multiplied first
  in = raw(int64_t(1) << 43, 1 << 20, "ddp");
  in.cluster.nodes = 1 << 17;
  const Plan big = make_plan(in);
  const int64_t bytes = int64_t(1) << 44, n = 1 << 20;
  CHECK(big.comm.at("all_reduce") == 2 * (bytes / n) * (n - 1));
}
