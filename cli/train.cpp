// shardgrad train: the single-process training loop (strategies wrap the same steps).
// One step: the loader's global batch -> micro-batches (gradient accumulation) -> forward/backward
// on a tape each -> global-norm clipping -> AdamW on f32 master weights -> progress line.
// ddp averages gradients over ranks; zero1/zero2 shard the optimizer state (and gradients) instead,
// and run AdamW on this rank's shard only (parallel/zero.h); zero3 shards the parameters too,
// gathering one unit (a block, or the root: embeddings and ln_f) at a time (parallel/fsdp.h).
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/trace.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "io/dataset.h"
#include "io/file.h"
#include "io/synthetic.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "models/gpt.h"
#include "optim/loss_scaler.h"
#include "optim/nonfinite.h"
#include "optim/optim.h"
#include "parallel/checkpoint.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/comm/nccl_backend.h"
#include "parallel/comm/sim_backend.h"
#include "bench/report/timeline_svg.h"
#include "bench/report/step_metrics.h"
#include "parallel/comm/mesh.h"
#include "parallel/ddp.h"
#include "parallel/pp/executor.h"
#include "parallel/tp/layers.h"
#include "parallel/dp.h"
#include "parallel/watchdog.h"
#include "parallel/fsdp.h"
#include "parallel/functional.h"
#include "parallel/zero.h"

namespace sg::cli {

namespace {

using nlohmann::json;

void declare_flags(Args& a) {
  a.flag("model", "tiny", "preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl");
  a.flag("n-layer", "0", "override the preset's layer count");
  a.flag("n-head", "0", "override the preset's head count");
  a.flag("n-embd", "0", "override the preset's width");
  a.flag("block-size", "0", "override the preset's longest sequence (rows of wpe)");
  a.flag("vocab-size", "0", "vocabulary (0 = the data's own: 256 bytes, 50257 GPT-2 tokens, the task's)");
  a.flag("seq-len", "0", "tokens per training row T (0 = the model's block size; synthetic task: one problem per row)");
  a.flag("dropout", "0", "dropout probability");
  a.flag("recompute", "none", "activation recompute: none, selective (the attention core: little to save, as flash "
         "attention stores no scores) or full (whole blocks)");
  a.flag("data", "synthetic", "synthetic | FILE.txt (bytes) | 'GLOB.bin' (llm.c token shards) | random[:V] (uniform "
         "ids, GPT-2's 50257 by default: for sizing and timing, nothing to learn)");
  a.toggle("shuffle", "draw rows at seeded random positions instead of reading sequentially");
  a.flag("batch-size", "0", "global batch: sequences per optimizer step (0 = 32; 128 one-problem rows on the synthetic task)");
  a.flag("micro-batch-size", "0", "sequences per forward/backward (0 = the per-rank batch; under --pp, enough "
         "micro-batches for at least 4 per stage); must divide --batch-size");
  a.flag("steps", "auto", "optimizer steps (auto: 1500 on the synthetic task, 1000 on file data)");
  a.flag("lr", "auto", "peak learning rate (auto: by model size, non-embedding parameters: 1e-2 below 1M, 1e-3 "
         "below 20M, then GPT-3's 6e-4 / 3e-4 / 2.5e-4 / 2e-4 for GPT-2's four sizes; 5e-3 on the synthetic task)");
  a.flag("lr-schedule", "cosine", "constant | cosine");
  a.flag("warmup-steps", "20", "linear warmup steps");
  a.flag("min-lr", "0", "final learning rate of the cosine schedule");
  a.flag("beta1", "0.9", "AdamW beta1");
  a.flag("beta2", "0.95", "AdamW beta2");
  a.flag("eps", "1e-8", "AdamW epsilon");
  a.flag("weight-decay", "0.1", "AdamW decoupled weight decay (matrices and embeddings only; 0 on the synthetic task unless given)");
  a.flag("clip", "1.0", "clip the global gradient norm to this (0 = off)");
  a.flag("seed", "1337", "seed for init, data order and dropout");
  a.flag("device", "cpu", "cpu or cuda:N");
  a.flag("dtype", "fp32", "fp32 | bf16 | fp16 (half types keep f32 master weights; fp16 uses loss scaling)");
  a.flag("attention", "flash", "fused attention on CUDA: flash (hand-written kernels) | cudnn (cuDNN's fused SDPA; bf16/fp16)");
  a.flag("init-from", "", "start from a Hugging Face-named GPT-2 .safetensors file");
  a.flag("save", "", "run directory for checkpoints (never overwritten)");
  a.flag("save-every", "0", "checkpoint every N steps (0 = only at the end, when --save is given)");
  a.flag("resume", "", "continue from a run directory or step directory");
  a.flag("eval-every", "250", "evaluate every N steps (0 = only at the end)");
  a.flag("eval-batches", "4", "validation batches per evaluation");
  a.flag("eval-problems", "200", "synthetic task: problems for the accuracy figure");
  a.flag("log-json", "", "write one JSON object per step to this file");
  a.flag("threads", "0", "CPU threads per rank (0 = OMP_NUM_THREADS if set, else the cores divided among the node's ranks)");
  a.flag("strategy", "single", "single | dp (one process, --devices) | ddp | zero1 | zero2 | zero3 | fsdp (= zero3) | fsdp-grad-op | hsdp | no-shard (all but single/dp: launch with mpirun -np N)");
  a.flag("shard-group-size", "0", "hsdp: ranks per shard group (parameters sharded inside, replicated across groups)");
  a.flag("wrap-min-params", "0", "fsdp family: one unit per block (0), or consecutive blocks until this many parameters");
  a.flag("reshard-after-forward", "default", "fsdp family: default | true | false (free gathered units after forward)");
  a.flag("prefetch", "none", "fsdp family: none | forward | backward | both (gather the next unit ahead)");
  a.flag("limit-all-gathers", "2", "fsdp family: at most this many block units gathered at once");
  a.flag("offload", "none", "fsdp family: none | optimizer (m, v and an f32 master on the host, AdamW there; the "
         "compute device (--device cuda:N, or cpu:1 to try it on a CPU) keeps the parameter and gradient shards) | "
         "params (the parameter shards on the host too, staged to the device for each gather)");
  a.flag("reduce-dtype", "param", "fsdp family: gradient reduction dtype: param | fp32 | bf16 | fp16");
  a.flag("tp", "1", "tensor-parallel ranks: heads, MLP and vocabulary split (launch with mpirun -np TP)");
  a.toggle("sequence-parallel", "with --tp: LayerNorm/dropout regions split along the sequence");
  a.flag("pp", "1", "pipeline stages (launch with mpirun -np PP)");
  a.flag("pp-schedule", "1f1b", "pipeline schedule: gpipe | 1f1b | interleaved");
  a.flag("virtual-stages", "1", "interleaved: model chunks per pipeline rank");
  a.flag("timeline", "", "pipeline: write the last step's measured timeline as an SVG picture");
  a.flag("profile-ops", "0", "time every op-table call of this step (1-based; 0 = off): calls, host ms and, on CUDA, device ms per entry, printed and put in --log-json");
  a.flag("trace", "", "write per-rank Chrome trace events (compute, collectives, gathers, pipeline actions), merged into this file");
  a.flag("keep", "0", "keep only the newest N checkpoints (0 = all)");
  a.flag("devices", "cpu:0,cpu:1", "dp: the devices to replicate over; the first one holds the model");
  a.flag("bucket-mb", "25", "ddp: gradient bucket size in MiB; zero1/zero2: one stripe's reduce-scatter input in MiB");
  a.flag("backend", "mpi", "collectives of multi-rank runs: mpi (CPU tensors, CUDA through host staging) | nccl (GPUs)");
  a.flag("rendezvous", "mpi", "how ranks find each other: mpi (launched by mpirun) | file:PATH (--backend nccl "
         "without MPI: each process started on its own with RANK, WORLD_SIZE, LOCAL_RANK in the environment)");
  a.flag("comm-timeout", "300", "seconds without progress before the watchdog aborts the job, naming the stuck rank");
  a.flag("inject-fault", "", "testing: rank=R,step=S,kind=exit|throw|abort|kill|hang|nan[,during=save]");
  a.flag("on-nonfinite", "stop", "a NaN/Inf loss or gradient: stop (naming the step and the tensor) or skip the step (counted)");
  a.toggle("find-unused-parameters", "ddp: allow parameters that get no gradient (their gradient counts as zero)");
  a.flag("simulate", "0", "dry run of N ranks as threads of this one process on the meta device (shapes and bytes, no "
         "values, no arithmetic): each rank's peak ledger bytes per category and bytes sent per collective kind over "
         "3 steps of this layout, as the engine would hold and send them (no mpirun; --log-json gets them as JSON)");
}

// The flags that say what a run trains on and how it learns (not where or on what layout). A
// checkpoint records those its run was given; `--resume` takes them where the command line does
// not give them, so `train --resume DIR --steps N` goes on with the run's own data, batch,
// schedule, optimizer and seed. A flag on the command line still wins (other data, a longer run).
const char* const kRunFlags[] = {"data",  "shuffle",      "seq-len",      "dropout", "batch-size", "steps",
                                 "lr",    "lr-schedule",  "warmup-steps", "min-lr",  "beta1",      "beta2",
                                 "eps",   "weight-decay", "clip",         "seed",    "dtype",      "eval-every",
                                 "eval-batches", "eval-problems", "on-nonfinite"};

// The checkpoint --resume names (nullptr for `--resume auto` before the first save).
std::unique_ptr<ckpt::Checkpoint> resume_checkpoint(const Args& a) {
  if (a.str("resume") == "auto") {
    SG_CHECK(!a.str("save").empty(), "train: --resume auto needs --save (the run directory to look in)");
    return std::filesystem::exists(a.str("save")) ? ckpt::open_checkpoint("auto:" + a.str("save")) : nullptr;
  }
  return a.str("resume").empty() ? nullptr : ckpt::open_checkpoint(a.str("resume"));
}

void inherit_run_flags(Args& a, const ckpt::Checkpoint* ck) {
  if (!ck || !ck->state().contains("train_flags")) return;  // older checkpoints recorded none
  for (const char* f : kRunFlags) {
    const json& saved = ck->state()["train_flags"];
    if (!a.given(f) && saved.contains(f)) a.inherit(f, saved[f].get<std::string>());
  }
}

// --micro-batch-size 0: the whole per-rank batch, except under a pipeline, where one micro-batch
// would leave every stage but one idle: then the fewest micro-batches, a multiple of the stages
// (the interleaved schedule needs it), that number at least 4 per stage (GPipe's m >= 4p keeps the
// bubble (p-1)/m under a quarter), or as many as the batch allows.
int64_t default_micro_batch(int64_t per_rank, int pp) {
  if (pp == 1) return per_rank;
  int64_t best = 0;  // micro-batches per step
  for (int64_t m = pp; m <= per_rank; m += pp) {
    if (per_rank % m) continue;
    best = m;
    if (m >= 4 * pp) break;
  }
  return best ? per_rank / best : per_rank;
}

int64_t positive(const Args& a, const std::string& f, int64_t min = 1) {
  int64_t v = a.i64(f);
  SG_CHECK(v >= min, "train: --", f, " must be >= ", min, ", got ", v);
  return v;
}

// The built-in synthetic addition task's own defaults, where those flags are not given. Its loss
// sits on a plateau (answers without carries) before it learns the task, and with the defaults
// for file data then (1000 steps at 1e-2 with decay 0.1) whether it left the plateau by the end
// depended on the seed and on last-bit differences in the arithmetic: of 9 seeds, 4 did. These
// took 8 of the 9 to >= 99.5% and the ninth to 84.5% (bench/RESULTS.md, "The default run").
constexpr int64_t kSyntheticSteps = 1500, kFileSteps = 1000;
constexpr double kSyntheticLr = 5e-3, kSyntheticWeightDecay = 0.0;
bool synthetic_data(const Args& a) { return a.str("data").rfind("synthetic", 0) == 0; }
double synthetic_default(const Args& a, const std::string& f, double synthetic_value) {
  return synthetic_data(a) && !a.given(f) ? synthetic_value : a.f64(f);
}

nn::GPTConfig model_config(const Args& a, int64_t data_vocab) {
  nn::GPTConfig c = nn::gpt_preset(a.str("model"));
  if (a.i64("n-layer")) c.n_layer = positive(a, "n-layer");
  if (a.i64("n-head")) c.n_head = positive(a, "n-head");
  if (a.i64("n-embd")) c.n_embd = positive(a, "n-embd");
  if (a.i64("block-size")) c.block_size = positive(a, "block-size");
  c.vocab_size = data_vocab;
  if (a.i64("vocab-size")) {
    c.vocab_size = positive(a, "vocab-size");  // below the data's: Trainer::setup asks the data
  }
  c.dropout = a.f64("dropout");
  if (a.i64("seq-len") > c.block_size && !a.i64("block-size")) c.block_size = a.i64("seq-len");
  c.validate();
  return c;
}

std::map<std::string, std::string> config_metadata(const nn::GPTConfig& c, const std::string& data) {
  return {{"format", "shardgrad-gpt2"},        {"n_layer", std::to_string(c.n_layer)},
          {"n_head", std::to_string(c.n_head)}, {"n_embd", std::to_string(c.n_embd)},
          {"block_size", std::to_string(c.block_size)}, {"vocab_size", std::to_string(c.vocab_size)},
          {"padded_vocab", std::to_string(c.vocab_rows())}, {"data", data}};
}

// The model config a checkpoint records (config_metadata above).
nn::GPTConfig config_from_metadata(const std::map<std::string, std::string>& m, const std::string& where) {
  auto get = [&](const char* k) -> int64_t {
    auto it = m.find(k);
    SG_CHECK(it != m.end(), "train: checkpoint ", where, " does not record '", k, "' in its metadata");
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      throw Error(str("train: checkpoint ", where, ": metadata '", k, "' is not a number: '", it->second, "'"));
    }
  };
  nn::GPTConfig c;
  c.name = "checkpoint";
  c.n_layer = get("n_layer");
  c.n_head = get("n_head");
  c.n_embd = get("n_embd");
  c.block_size = get("block_size");
  c.vocab_size = get("vocab_size");
  if (m.count("padded_vocab")) c.padded_vocab = get("padded_vocab");
  c.validate();
  return c;
}

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(int64_t(1) << 30));
  else if (b >= (1 << 20) || b == 0) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  else std::snprintf(buf, sizeof buf, "%lld B", (long long)b);
  return buf;
}

// The lowest and highest of the ranks' peak ledger bytes ("2.9-4.0 MiB"; one figure when equal).
std::string peak_range(const json& ranks) {
  int64_t lo = INT64_MAX, hi = 0;
  for (const auto& r : ranks) {
    const int64_t p = r["mem"]["total"]["peak"].get<int64_t>();
    lo = std::min(lo, p), hi = std::max(hi, p);
  }
  const std::string a = human_bytes(lo), b = human_bytes(hi);
  if (a == b) return b;
  const size_t unit_a = a.rfind(' '), unit_b = b.rfind(' ');
  return a.substr(unit_a) == b.substr(unit_b) ? a.substr(0, unit_a) + "-" + b : a + "-" + b;
}

// --profile-ops: the step's op-table calls by entry, the costliest first (device time on a GPU,
// host time on the CPU), and what the step spent outside the table.
void print_op_profile(const std::map<std::string, kernels::OpTime>& ops, double step_ms, int64_t step, Device d) {
  const bool gpu = d.is_cuda();
  std::vector<std::pair<std::string, kernels::OpTime>> rows(ops.begin(), ops.end());
  const auto cost = [&](const kernels::OpTime& o) { return gpu ? o.device_ms : o.host_ms; };
  std::sort(rows.begin(), rows.end(), [&](const auto& x, const auto& y) { return cost(x.second) > cost(y.second); });
  kernels::OpTime all;
  for (const auto& [name, o] : rows) {
    all.calls += o.calls;
    all.host_ms += o.host_ms;
    all.device_ms += o.device_ms;
    all.flops += o.flops;
  }
  std::printf("op profile, step %lld on %s: %.2f ms (%s)\n", (long long)step, d.str().c_str(), step_ms,
              gpu ? "device ms: the compute stream between events queued around each call"
                  : "host ms: wall time in each call");
  std::printf("  %-28s %7s %10s%s %7s %9s\n", "entry", "calls", "host ms", gpu ? " device ms" : "", "share",
              gpu ? "TFLOP/s" : "GFLOP/s");
  const auto line = [&](const std::string& name, const kernels::OpTime& o) {
    std::printf("  %-28s %7lld %10.3f", name.c_str(), (long long)o.calls, o.host_ms);
    if (gpu) std::printf(" %9.3f", o.device_ms);
    std::printf(" %6.1f%%", step_ms > 0 ? 100.0 * cost(o) / step_ms : 0.0);
    if (o.flops > 0 && cost(o) > 0) std::printf(" %9.1f", o.flops / (cost(o) * (gpu ? 1e9 : 1e6)));
    std::printf("\n");
  };
  for (const auto& [name, o] : rows) line(name, o);
  line("all entries", all);
  std::printf("  %-28s %7s %10.3f%s %6.1f%%\n", "outside the op table", "", step_ms - cost(all), gpu ? "          " : "",
              step_ms > 0 ? 100.0 * (step_ms - cost(all)) / step_ms : 0.0);
}

json op_profile_json(const std::map<std::string, kernels::OpTime>& ops) {
  json out = json::object();
  for (const auto& [name, o] : ops)
    out[name] = {{"calls", o.calls}, {"host_ms", o.host_ms}, {"device_ms", o.device_ms}, {"flops", o.flops}};
  return out;
}

json ledger_json(Device d) {
  MemStats s = Ledger::global().stats(d);
  json j;
  for (int c = 0; c < kNumMemCategories; ++c)
    j[mem_category_name(MemCategory(c))] = {{"current", s.current[size_t(c)]}, {"peak", s.peak[size_t(c)]}};
  j["total"] = {{"current", s.total_current}, {"peak", s.total_peak}};
  return j;
}

class Trainer {
 public:
  // resumed: the checkpoint --resume names (resume_checkpoint), opened once, or null.
  // sim: this rank's world under --simulate (the meta device, no values), or null.
  Trainer(const Args& a, std::unique_ptr<ckpt::Checkpoint> resumed, std::shared_ptr<comm::SimProcessGroup> sim = nullptr)
      : args_(a), resumed_(std::move(resumed)), sim_(std::move(sim)) {}
  int run();
  // --simulate: `steps` training steps on this rank's meta device. Returns {"rank", "peak":
  // {category: the largest per-step peak, "total": of the sum}, "comm": {kind: {calls, bytes} of
  // the last step}} and, on rank 0, "header": the run's model, data and layout line.
  json simulate(int64_t steps);

 private:
  void setup();
  double train_step(int64_t step, double lr, double& grad_norm, bool& applied);
  json evaluate();
  void save(int64_t next_step);
  std::vector<ckpt::Piece> state_pieces() const;
  ckpt::LocalView view_of(const std::string& name, const Shape& local_shape) const;
  void load_parameters(const ckpt::Checkpoint& ck);
  void load_optimizer(const ckpt::Checkpoint& ck, int64_t optimizer_step);
  void resume(const std::string& dir);

  const Args& args_;
  std::unique_ptr<ckpt::Checkpoint> resumed_;  // until setup takes it
  std::shared_ptr<comm::SimProcessGroup> sim_;
  std::string layout_label() const;  // "zero3 x 4", "tp 2 x pp 2 (4 ranks)", ...
  // Where --offload puts its state: the host, or under --simulate a meta device of the rank's own
  // standing for it (a ledger apart from the rank's compute device's, and no memory).
  Device host_device() const { return sim_ ? Device::meta((1 << 20) + rank_) : Device::cpu(0); }
  Device device_;
  DType dtype_ = DType::f32;
  io::DataOptions data_opt_;
  std::unique_ptr<io::Dataset> train_, val_;
  nn::GPTConfig cfg_;
  std::unique_ptr<nn::GPT> model_;
  io::NamedTensors master_;  // what the optimizer updates: the params (f32) or f32 copies (bf16/f16)
  std::unique_ptr<optim::AdamW> opt_;
  optim::LrSchedule sched_;
  optim::LossScaler scaler_;
  int64_t B_ = 0, T_ = 0, micro_ = 0, steps_ = 0, start_step_ = 0;
  uint64_t seed_ = 0;
  std::string save_dir_;
  // data parallelism: this rank's rows of the global batch, and the gradient averaging
  std::string strategy_ = "single";
  std::shared_ptr<comm::ProcessGroup> world_, metrics_;
  comm::MeshGroups groups_;  // dp, pp, tp: this rank's groups (dp alone: the world)
  std::shared_ptr<comm::ProcessGroup> dp_metrics_, mp_metrics_;  // losses over dp; norms over tp x pp
  // The global gradient norm when the model is split over tp x pp: tp-split parameters sum over
  // the tp group, replicated ones count once (tp rank 0), the tied embedding once (first stage).
  double model_parallel_grad_norm();
  // Sum over the data-parallel ranks of each one's share of the global batch's mean loss.
  double dp_loss(double share);
  double world_sum(double x);  // over every rank (metrics group)
  std::string device_spec_;    // --device, with "cuda" made cuda:<local rank> under --backend nccl
  // --threads 0: OMP_NUM_THREADS when set (mpirun -x OMP_NUM_THREADS=1), else the node's cores
  // shared by the ranks on it, so that 4 ranks on 2 cores do not run 2 threads each.
  static int default_threads() {
    if (const char* s = std::getenv("OMP_NUM_THREADS"); s && std::atoi(s) > 0) return std::atoi(s);
    int local = 1;
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"})
      if (const char* s = std::getenv(v); s && std::atoi(s) > 0) {
        local = std::atoi(s);
        break;
      }
    return std::max(1, int(std::max(1u, std::thread::hardware_concurrency())) / local);
  }
  // The data as a checkpoint records it: a file or glob made absolute, so that a resume or generate
  // started in another folder reads the same files.
  std::string saved_data_spec() const {
    const std::string& d = data_opt_.spec;
    return io::is_generated_spec(d) ? d : std::filesystem::absolute(d).lexically_normal().string();
  }
  static int local_rank() {    // this rank's place on its node, from the launcher
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"})
      if (const char* s = std::getenv(v)) return std::atoi(s);
    return 0;
  }
  bool accept_step(int64_t step, double loss, double grad_norm);
  optim::NonFinitePolicy nonfinite_ = optim::NonFinitePolicy::stop;
  int64_t nonfinite_skipped_ = 0;
  // The groups whose byte counters hold this rank's training traffic.
  std::vector<const comm::ProcessGroup*> traffic_groups() const {
    std::vector<const comm::ProcessGroup*> g{world_.get()};
    if (groups_.tp || groups_.pp) g = {groups_.dp.get(), groups_.pp.get(), groups_.tp.get()};
    if (fsdp_) {  // its own shard/replicate groups (split from the dp group) unless it uses that one
      for (const comm::ProcessGroup* x : {fsdp_->shard_group(), fsdp_->replicate_group()})
        if (x && x != groups_.dp.get()) g.push_back(x);
    }
    return g;
  }
  std::unique_ptr<parallel::DistributedDataParallel> ddp_;
  std::unique_ptr<parallel::DataParallel> dp_;
  int rank_ = 0, world_size_ = 1;
  parallel::Fault fault_;
  std::unique_ptr<parallel::ZeroOptimizer> zero_;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp_;  // zero3
  std::unique_ptr<parallel::pp::PipelineExecutor> pipe_;
  int tp_ = 1, pp_ = 1, dp_size_ = 1, dp_rank_ = 0;  // the mesh: rows are split over dp only
  bool lead() const { return rank_ == 0; }
  // The model's parameters this rank holds: all of them, or under --pp its stages'.
  io::NamedTensors held_parameters() const { return pipe_ ? pipe_->parameters() : model_->named_parameters(); }
  // bf16/f16 without ZeRO: the f32 masters take the held parameters' half gradients as they are.
  void take_half_gradients() {
    const io::NamedTensors params = held_parameters();
    for (size_t i = 0; i < params.size(); ++i) master_[i].second.set_grad(params[i].second.grad());
  }
  // Evaluation runs the whole model on rank 0; under tp/pp on every rank of the first data-parallel
  // replica, under zero3/fsdp on every rank (the forward is collective there); rank 0 reports.
  bool evaluates_here() const {
    if (fsdp_) return true;
    if (tp_ > 1 || pp_ > 1) return groups_.coord.dp == 0;
    return lead();
  }
  bool distributed() const { return strategy_ == "ddp" || zero_stage() > 0 || tp_ > 1 || pp_ > 1; }
  void write_timeline();
  double pipeline_step(int64_t step, const Tensor& idx, const Tensor& tgt, int64_t counted, double loss_scale, double lr,
                       double& grad_norm, bool& applied);
  // zero3 and the FSDP family all shard the parameters (stage 3's memory and more or less of its traffic).
  bool fsdp_family() const {
    return strategy_ == "zero3" || strategy_ == "fsdp" || strategy_ == "fsdp-grad-op" || strategy_ == "hsdp" ||
           strategy_ == "no-shard";
  }
  int zero_stage() const { return strategy_ == "zero1" ? 1 : strategy_ == "zero2" ? 2 : fsdp_family() ? 3 : 0; }
  parallel::FsdpOptions fsdp_options() const;
};

void Trainer::setup() {
  const Args& a = args_;
  const int64_t threads = a.i64("threads");
  SG_CHECK(threads >= 0, "train: --threads must be >= 0");
  const int nt = threads ? int(threads) : default_threads();
  omp_set_num_threads(nt);
  Eigen::setNbThreads(nt);

  strategy_ = a.str("strategy");
  SG_CHECK(strategy_ == "single" || strategy_ == "dp" || strategy_ == "ddp" || zero_stage() > 0, "train: --strategy '",
           strategy_, "' is not available (expected single, dp, ddp, zero1, zero2, zero3, fsdp, fsdp-grad-op, hsdp or no-shard)");
  tp_ = int(positive(a, "tp"));
  pp_ = int(positive(a, "pp"));
  // A flag of one strategy or layout, given where it would do nothing, is refused by name rather
  // than ignored.
  const auto only_for = [&](const char* flag, bool applies, const char* what) {
    SG_CHECK(!a.given(flag) || applies, "train: --", flag, " is for ", what, "; this run is --strategy ", strategy_,
             pp_ > 1 ? " --pp " + std::to_string(pp_) : std::string());
  };
  for (const char* flag : {"offload", "wrap-min-params", "reshard-after-forward", "prefetch", "limit-all-gathers",
                           "reduce-dtype"})
    only_for(flag, fsdp_family(), "the fsdp family (zero3, fsdp, fsdp-grad-op, hsdp, no-shard)");
  only_for("shard-group-size", strategy_ == "hsdp", "--strategy hsdp");
  only_for("bucket-mb", strategy_ == "ddp" || strategy_ == "zero1" || strategy_ == "zero2", "ddp, zero1 and zero2");
  only_for("find-unused-parameters", strategy_ == "ddp", "--strategy ddp");
  for (const char* flag : {"pp-schedule", "virtual-stages"}) only_for(flag, pp_ > 1, "pipelines (--pp > 1)");
  only_for("devices", strategy_ == "dp", "--strategy dp (one process, several devices)");
  for (const char* flag : {"save-every", "keep"}) SG_CHECK(!a.given(flag) || a.given("save"), "train: --", flag, " needs --save DIR");
  device_spec_ = a.str("device");
  SG_CHECK(a.str("backend") == "mpi" || a.str("backend") == "nccl", "train: --backend must be mpi or nccl, got '",
           a.str("backend"), "'");
  SG_CHECK(a.str("backend") == "mpi" || distributed(), "train: --backend nccl is for multi-rank strategies "
           "(--strategy ddp, zero*, fsdp*, --tp, --pp)");
  const std::string rdv = a.str("rendezvous");
  const bool file_rdv = rdv.rfind("file:", 0) == 0;
  SG_CHECK(rdv == "mpi" || file_rdv, "train: --rendezvous must be mpi or file:PATH, got '", rdv, "'");
  SG_CHECK(!file_rdv || a.str("backend") == "nccl", "train: --rendezvous ", rdv, " needs --backend nccl: the file "
           "carries NCCL's unique id, and without mpirun NCCL is what connects the ranks (under mpirun use the "
           "default --rendezvous mpi)");
  SG_CHECK(!file_rdv || rdv.size() > 5, "train: --rendezvous file: needs a path (file:PATH)");
  if (distributed()) {
    SG_CHECK(a.f64("comm-timeout") > 0, "train: --comm-timeout must be > 0");
    const bool nccl = a.str("backend") == "nccl";
    SG_CHECK(!nccl || a.str("device").rfind("cuda", 0) == 0, "train: --backend nccl carries CUDA tensors: pass "
             "--device cuda (each rank then uses cuda:<its local rank>) or --device cuda:N");
    if (sim_) {
      world_ = sim_;
      metrics_ = world_->split(0, sim_->rank());
      rank_ = sim_->rank();
      world_size_ = sim_->size();
    } else if (file_rdv) {
      // A launcher without MPI (torchrun-like) started each process on its own. The job's rank and
      // size are RANK/WORLD_SIZE, and the NCCL world from the file carries everything, the CPU-side
      // metrics too (staged through the device). MPI is never initialised: a singleton MPI_Init
      // would make each process a world of its own.
      const comm::LaunchEnv env = comm::launch_env();
      rank_ = env.rank;
      world_size_ = env.world_size;
      SG_CHECK(comm::nccl_available(), "train: --backend nccl: rank ", rank_,
               " sees no CUDA device (or this shardgrad was built without NCCL)");
      if (a.str("device") == "cuda") {
        SG_CHECK(env.local_rank >= 0, "train: --device cuda under --rendezvous file: needs LOCAL_RANK in the "
                 "environment (or pass --device cuda:N)");
        device_spec_ = "cuda:" + std::to_string(env.local_rank);
      }
      parallel::watchdog::arm(a.f64("comm-timeout"), rank_);  // a rank that never joins must not hang the rest
      {
        parallel::watchdog::Waiting w("the file rendezvous");
        world_ = comm::nccl_world_from_file(rdv.substr(5), parse_device(device_spec_).index, a.f64("comm-timeout"));
      }
      metrics_ = world_->split(0, rank_);  // losses and barriers: kept out of the gradient counters
    } else {
      comm::init();
      world_ = comm::MpiProcessGroup::world();
      metrics_ = world_->split(0, world_->rank());  // losses and barriers: kept out of the gradient counters
      rank_ = world_->rank();
      world_size_ = world_->size();
      if (nccl) {
        // NCCL carries the training collectives between the ranks' GPUs (unique id bootstrapped
        // over MPI); the few CPU-side metrics (losses, norms, barriers) stay on MPI.
        SG_CHECK(comm::nccl_available(), "train: --backend nccl: rank ", rank_,
                 " sees no CUDA device (or this shardgrad was built without NCCL)");
        if (a.str("device") == "cuda") device_spec_ = "cuda:" + std::to_string(local_rank());
        world_ = comm::nccl_world(*world_, parse_device(device_spec_).index);
      }
    }
    SG_CHECK(world_size_ % (tp_ * pp_) == 0, "train: --tp ", tp_, " x --pp ", pp_, " = ", tp_ * pp_,
             " ranks per model replica does not divide the ", world_size_, " ranks launched");
    dp_size_ = world_size_ / (tp_ * pp_);
    dp_rank_ = rank_ / (tp_ * pp_);
    if (!sim_) parallel::watchdog::arm(a.f64("comm-timeout"), rank_);
  }
  if (sim_) device_spec_ = Device::meta(rank_).str();  // a ledger of its own per simulated rank
  fault_ = parallel::parse_fault(a.str("inject-fault"));
  nonfinite_ = optim::parse_nonfinite_policy(a.str("on-nonfinite"));
  device_ = parse_device(device_spec_);
  std::vector<Device> dp_devices;
  if (strategy_ == "dp") {
    dp_devices = parallel::parse_devices(a.str("devices"));
    SG_CHECK(!a.given("device") || device_ == dp_devices[0], "train: --device ", device_.str(),
             " differs from the first of --devices (", dp_devices[0].str(), ")");
    device_ = dp_devices[0];
  }
  dtype_ = parse_dtype(a.str("dtype"));
  SG_CHECK(dtype_ == DType::f32 || dtype_ == DType::bf16 || dtype_ == DType::f16, "train: --dtype must be fp32, bf16 or fp16");
  kernels::select_attention(a.str("attention"), device_);
  seed_ = uint64_t(a.i64("seed"));
  const bool synthetic = synthetic_data(a);
  B_ = a.i64("batch-size") ? positive(a, "batch-size") : (synthetic ? 128 : 32);
  micro_ = a.i64("micro-batch-size") ? positive(a, "micro-batch-size")
                                      : default_micro_batch(B_ / std::max(1, dp_size_), pp_);
  SG_CHECK(B_ % dp_size_ == 0, "train: --batch-size ", B_, " is not divisible by ", dp_size_,
           " data-parallel ranks");
  SG_CHECK((B_ / dp_size_) % micro_ == 0, "train: --micro-batch-size ", micro_, " does not divide ",
           dp_size_ > 1 ? str("the per-rank batch ", B_ / dp_size_, " (--batch-size ", B_, " over ", dp_size_, " ranks)")
                           : str("--batch-size ", B_));
  steps_ = a.str("steps") != "auto" ? positive(a, "steps") : synthetic ? kSyntheticSteps : kFileSteps;
  positive(a, "eval-batches");
  SG_CHECK(a.i64("save-every") >= 0 && a.i64("eval-every") >= 0, "train: --save-every/--eval-every must be >= 0");
  SG_CHECK(a.i64("profile-ops") >= 0 && a.i64("profile-ops") <= steps_,
           "train: --profile-ops must be a step number from 1 to --steps (", steps_, ") or 0, got ", a.i64("profile-ops"));
  SG_CHECK(!a.i64("profile-ops") || strategy_ != "dp", "train: --profile-ops times the calls of the training thread; ",
           "--strategy dp runs its replicas on threads of their own (profile one device, or ddp under mpirun)");

  data_opt_.spec = a.str("data");
  data_opt_.seed = seed_;
  data_opt_.shuffle = a.on("shuffle");
  try {
    train_ = io::open_dataset(data_opt_);
    io::DataOptions vo = data_opt_;
    vo.split = io::Split::val;
    val_ = io::open_dataset(vo);
  } catch (const Error& e) {
    const auto& from_ck = a.inherited();
    if (std::find(from_ck.begin(), from_ck.end(), "data") == from_ck.end()) throw;
    throw Error(str(e.what(), " (--data ", data_opt_.spec, " is the checkpoint's; give --data to read it elsewhere)"));
  }

  // A checkpoint of any layout (sharded, or the older full format): this run reads its own slices.
  // --resume auto: the newest complete checkpoint of the --save directory.
  std::unique_ptr<ckpt::Checkpoint> ck = std::move(resumed_);
  if (ck) {
    cfg_ = config_from_metadata(ck->metadata(), ck->path());
    for (const char* f : {"n-layer", "n-head", "n-embd", "block-size", "vocab-size"}) {
      if (!a.given(f)) continue;
      int64_t want = a.i64(f);
      int64_t have = std::string(f) == "n-layer" ? cfg_.n_layer
                     : std::string(f) == "n-head" ? cfg_.n_head
                     : std::string(f) == "n-embd" ? cfg_.n_embd
                     : std::string(f) == "block-size" ? cfg_.block_size : cfg_.vocab_size;
      SG_CHECK(want == have, "train: --", f, " ", want, " does not match the checkpoint ", ck->path(), " (", have, ")");
    }
    cfg_.dropout = a.f64("dropout");
  } else if (!a.str("init-from").empty()) {
    io::SafetensorsFile f = io::load_safetensors(a.str("init-from"));
    cfg_ = nn::config_from_hf(f, a.i64("n-head"));
    cfg_.dropout = a.f64("dropout");
  } else {
    cfg_ = model_config(a, train_->vocab_size());
  }
  if (cfg_.vocab_size < train_->vocab_size()) {  // token shards of a smaller tokenizer; other data refuses
    train_->restrict_vocab(cfg_.vocab_size);
    val_->restrict_vocab(cfg_.vocab_size);
  }
  T_ = a.i64("seq-len") ? positive(a, "seq-len") : cfg_.block_size;
  // The task is evaluated with each prompt at position 0: rows of exactly one problem train that.
  if (auto* task = dynamic_cast<const io::SyntheticDataset*>(train_.get()); task && !a.i64("seq-len"))
    T_ = std::min(cfg_.block_size, task->task().problem_length());
  SG_CHECK(T_ <= cfg_.block_size, "train: --seq-len ", T_, " exceeds the model's block size ", cfg_.block_size);
  train_->check_batch(B_, T_);
  val_->check_batch(B_, T_);  // the final evaluation reads one batch of the held-out split
  // The mesh, refused before any work when it does not fit the model and the batch.
  comm::MeshPlan mesh = comm::validate_mesh(world_size_, tp_, pp_, cfg_.n_head, cfg_.n_layer, cfg_.vocab_rows(), B_, micro_);
  if (tp_ > 1 || pp_ > 1) {
    // Model parallelism composes with data parallelism over the mesh's dp axis: the rows are split
    // over dp, and DDP, ZeRO-1/2 or the FSDP family reduce over dp only.
    // fsdp-grad-op keeps a unit gathered from its forward to its backward, which a pipeline's
    // interleaved micro-batches would hold for the whole step (so does hsdp without resharding,
    // which FullyShardedDataParallel refuses under --pp).
    const bool fsdp_ok = strategy_ == "zero3" || strategy_ == "fsdp" || strategy_ == "hsdp" || strategy_ == "no-shard" ||
                         (strategy_ == "fsdp-grad-op" && pp_ == 1);
    SG_CHECK(strategy_ == "single" || strategy_ == "ddp" || strategy_ == "zero1" || strategy_ == "zero2" || fsdp_ok,
             "train: --strategy ", strategy_, " does not compose with ",
             pp_ > 1 ? "--pp" : "--tp", " yet (ddp, zero1, zero2, zero3, fsdp, hsdp and no-shard compose with any "
             "--tp/--pp, fsdp-grad-op with --tp)");
    SG_CHECK(mesh.mesh.dp() == 1 || strategy_ != "single", "train: --tp ", tp_, " x --pp ", pp_, " on ", world_size_,
             " ranks leaves dp = ", mesh.mesh.dp(),
             ": the data-parallel replicas need a --strategy (ddp, zero1, zero2, zero3, fsdp, hsdp or no-shard)");
  }
  if (tp_ > 1) {
    SG_CHECK(a.str("init-from").empty(), "train: --init-from is not available with --tp yet (use --resume with a checkpoint)");
    cfg_.tp = tp_;
    cfg_.sequence_parallel = a.on("sequence-parallel");
    SG_CHECK(!cfg_.sequence_parallel || T_ % tp_ == 0, "train: --sequence-parallel: --seq-len ", T_,
             " does not split over --tp ", tp_);
    cfg_.validate();
  }
  SG_CHECK(!a.on("sequence-parallel") || tp_ > 1, "train: --sequence-parallel needs --tp > 1");
  const int v = int(positive(a, "virtual-stages"));
  if (pp_ > 1) {
    SG_CHECK(cfg_.n_layer % (pp_ * v) == 0, "train: --pp ", pp_, " x --virtual-stages ", v, ": ", cfg_.n_layer,
             " layers do not split evenly into ", pp_ * v, " stages");
  }

  if (tp_ > 1 || pp_ > 1) {
    // dp x pp x tp, tp innermost; every group below is this rank's slice along one axis. Metrics
    // (losses, norms) travel on their own groups so the byte counters show only training traffic.
    groups_ = comm::create_mesh_groups(mesh.mesh, *world_);
    const comm::MeshCoord c = groups_.coord;
    dp_metrics_ = metrics_->split(c.pp * tp_ + c.tp, c.dp);
    mp_metrics_ = metrics_->split(c.dp, c.pp * tp_ + c.tp);
  } else if (world_) {
    groups_.dp = world_;  // data parallelism alone: the world is the dp group
    dp_metrics_ = metrics_;
  }
  model_ = std::make_unique<nn::GPT>(cfg_, dtype_, device_, tp_ > 1 ? groups_.tp : nullptr);
  model_->recompute = nn::parse_recompute(a.str("recompute"));
  if (ck) {
    load_parameters(*ck);
  } else if (!a.str("init-from").empty()) {
    load_hf_state(*model_, io::load_safetensors(a.str("init-from")));
  } else {
    model_->init_weights(seed_);
  }
  if (pp_ > 1) {
    auto sched = parallel::pp::make_schedule(a.str("pp-schedule"), pp_, int((B_ / dp_size_) / micro_), v);
    pipe_ = std::make_unique<parallel::pp::PipelineExecutor>(*model_, sched, groups_.pp);
  }
  if (dtype_ == DType::f32 || zero_stage()) {  // zero keeps f32 masters for its own shard only
    master_ = held_parameters();
  } else {
    MemScope scope(MemCategory::optim_state);  // f32 master weights are optimizer state (ZeRO's K)
    for (auto& [n, p] : held_parameters()) master_.emplace_back(n, to(p, DType::f32));
  }
  optim::AdamWConfig oc;
  oc.beta1 = a.f64("beta1");
  oc.beta2 = a.f64("beta2");
  oc.eps = a.f64("eps");
  oc.weight_decay = synthetic_default(a, "weight-decay", kSyntheticWeightDecay);
  SG_CHECK(oc.beta1 >= 0 && oc.beta1 < 1 && oc.beta2 >= 0 && oc.beta2 < 1, "train: --beta1/--beta2 must be in [0, 1)");
  SG_CHECK(oc.eps > 0 && oc.weight_decay >= 0, "train: --eps must be > 0 and --weight-decay >= 0");
  SG_CHECK(a.f64("clip") >= 0, "train: --clip must be >= 0");
  if (zero_stage() == 3) {
    parallel::watchdog::Waiting w("the parameter broadcast");
    fsdp_ = std::make_unique<parallel::FullyShardedDataParallel>(*model_, groups_.dp, oc, fsdp_options());
    if (pipe_) {
      pipe_->before_forward = [this](int) { fsdp_->gather_roots(); };
      pipe_->before_action = [this](int first, int last, bool forward) { fsdp_->prefetch_action(first, last, forward); };
    }
  } else if (zero_stage()) {
    parallel::ZeroOptions z;
    z.stage = zero_stage();
    SG_CHECK(a.f64("bucket-mb") > 0, "train: --bucket-mb must be > 0");
    z.bucket_bytes = int64_t(a.f64("bucket-mb") * double(1 << 20));
    zero_ = std::make_unique<parallel::ZeroOptimizer>(master_, groups_.dp, oc, z);
    parallel::watchdog::Waiting w("the parameter broadcast");
    zero_->broadcast_parameters();
  } else {
    opt_ = std::make_unique<optim::AdamW>(master_, oc);
    if (dtype_ != DType::f32) {  // the model's half weights, rewritten by every step
      std::vector<Tensor> copies;
      for (auto& [n, p] : held_parameters()) copies.push_back(p);
      opt_->set_copies(std::move(copies));
    }
  }
  if (strategy_ == "ddp") {
    parallel::DdpOptions d;
    SG_CHECK(a.f64("bucket-mb") > 0, "train: --bucket-mb must be > 0");
    d.bucket_bytes = int64_t(a.f64("bucket-mb") * double(1 << 20));
    d.find_unused_parameters = a.on("find-unused-parameters");
    ddp_ = std::make_unique<parallel::DistributedDataParallel>(held_parameters(), groups_.dp, d);
    parallel::watchdog::Waiting w("the parameter broadcast");
    ddp_->broadcast_parameters();
  }
  if (strategy_ == "dp") {
    SG_CHECK(micro_ % int64_t(dp_devices.size()) == 0, "train: dp: the micro-batch of ", micro_,
             " rows does not split over ", dp_devices.size(), " devices");
    dp_ = std::make_unique<parallel::DataParallel>(*model_, dp_devices);
  }
  sched_.kind = a.str("lr-schedule");
  sched_.lr = a.str("lr") != "auto"  ? a.f64("lr")
              : synthetic_data(a)      ? kSyntheticLr
                                       : optim::default_peak_lr(cfg_.non_embedding_params());
  sched_.min_lr = a.f64("min-lr");
  sched_.warmup_steps = a.i64("warmup-steps");
  sched_.total_steps = steps_;
  sched_.validate();
  dropout_generator() = DropoutGenerator::seeded(seed_ ^ 0xd50b5eedull);

  if (ck) {
    const json& s = ck->state();
    start_step_ = s.at("step").get<int64_t>();
    SG_CHECK(start_step_ <= steps_, "train: the checkpoint is at step ", start_step_, " but --steps is ", steps_);
    train_->set_position(s.at("train_position").get<int64_t>());
    dropout_generator().next_stream = s.at("dropout_stream").get<uint64_t>();
    scaler_.scale = s.value("loss_scale", scaler_.scale);
    scaler_.clean_steps = s.value("loss_scale_clean_steps", int64_t(0));
    scaler_.skipped_steps = s.value("skipped_steps", int64_t(0));
    nonfinite_skipped_ = s.value("nonfinite_skipped", int64_t(0));
    load_optimizer(*ck, s.at("optimizer_step").get<int64_t>());
    if (lead()) {
      std::string flags;
      for (const std::string& f : a.inherited()) flags += " " + a.spelled(f);
      std::printf("resumed from %s at step %lld%s\n", ck->path().c_str(), (long long)start_step_,
                  flags.empty() ? "" : (", with the run's" + flags).c_str());
      if (start_step_ == steps_)
        std::printf("the checkpoint is at the run's last step (--steps %lld): nothing to train; give a larger --steps "
                    "to go on\n", (long long)steps_);
      if (a.str("save").empty())
        std::printf("no --save: the steps after %lld are not checkpointed\n", (long long)start_step_);
    }
  } else if (a.str("resume") == "auto" && lead()) {
    std::printf("--resume auto: no checkpoint in %s yet; starting from step 0\n", a.str("save").c_str());
  }
  save_dir_ = a.str("save");
  SG_CHECK(a.i64("keep") >= 0, "train: --keep must be >= 0");
  if (!save_dir_.empty() && std::filesystem::exists(save_dir_) && save_dir_ != a.str("resume") &&
      std::filesystem::exists(std::filesystem::path(save_dir_) / "latest") && !ck) {
    throw Error(str("train: --save ", save_dir_, " already holds a run; choose another directory or --resume it"));
  }
  if (!a.str("trace").empty()) {  // started after a barrier: the ranks' clocks share an origin
    if (metrics_) metrics_->barrier()->wait();
    trace::start(rank_);
    for (auto [g, name] : std::vector<std::pair<const comm::ProcessGroup*, const char*>>{
             {groups_.dp.get(), "dp"}, {groups_.pp.get(), "pp"}, {groups_.tp.get(), "tp"},
             {fsdp_ ? fsdp_->shard_group() : nullptr, "shard"}, {fsdp_ ? fsdp_->replicate_group() : nullptr, "replicate"},
             {world_.get(), "world"}, {metrics_.get(), "metrics"}, {dp_metrics_.get(), "dp metrics"}, {mp_metrics_.get(), "mp metrics"}})
      trace::name_group(g, name);  // a group with two roles keeps the first name
  }
}

double Trainer::train_step(int64_t step, double lr, double& grad_norm, bool& applied) {
  io::Batch b = train_->next(B_, T_);
  const int64_t counted = count_targets(b.targets, -1);
  SG_CHECK(counted > 0, "train: step ", step, " has no targets to predict");
  double loss_scale = dtype_ == DType::f16 ? scaler_.scale : 1.0;
  if (fault_.kind == "nan" && fault_.rank == rank_ && fault_.step == step + 1)
    loss_scale = std::numeric_limits<double>::quiet_NaN();  // --inject-fault kind=nan: this rank's gradients
  // This rank's rows of the global batch (all of it without data parallelism).
  const int64_t local = B_ / dp_size_, n_micro = local / micro_;
  Tensor idx = to(narrow(b.inputs, 0, dp_rank_ * local, local), device_);
  Tensor tgt = to(narrow(b.targets, 0, dp_rank_ * local, local), device_);
  // Dropout's place: this step, this rank's first row of the global batch and (under sequence
  // parallelism) its first position; each micro-batch (pipeline action) moves the row on.
  DropoutPlace& place = dropout_generator().place;
  place = DropoutPlace{step, dp_rank_ * local, cfg_.sequence_parallel ? groups_.tp->rank() * (T_ / tp_) : 0};
  if (pipe_) return pipeline_step(step, idx, tgt, counted, loss_scale, lr, grad_norm, applied);
  // With ddp the gradients are averaged over ranks, so each rank's loss is scaled by the world
  // size: the average of the ranks' gradients is then the gradient of the global batch's mean.
  const double rank_scale = double(dp_size_);
  double loss_sum = 0;
  // Read after the backward passes, not between forward and backward: item() waits for the device,
  // and on a GPU the backward's first kernels would then start only after the host caught up.
  std::vector<Tensor> losses;
  for (int64_t m = 0; m < n_micro; ++m) {
    Tensor mi = narrow(idx, 0, m * micro_, micro_), mt = narrow(tgt, 0, m * micro_, micro_);
    place.row0 = dp_rank_ * local + m * micro_;
    if (ddp_) ddp_->set_sync(m == n_micro - 1);  // no_sync for all but the last micro-batch
    // under SP the replicated gradients are summed over tp before ZeRO reduces them over dp
    if (zero_) zero_->set_sync(m == n_micro - 1 && !cfg_.sequence_parallel);
    if (dp_) {
      trace::Scope ts("forward+backward", "compute", {{"micro", m}});
      loss_sum += dp_->forward_backward(mi, mt, loss_scale / double(counted)) / loss_scale;
      continue;
    }
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope scope(tape);
      // Sum over this micro-batch / tokens in the whole batch: the accumulated gradient is the
      // gradient of the global batch's mean loss, whatever the micro-batch split.
      trace::Scope ts("forward", "compute", {{"micro", m}});
      loss = model_->loss(mi, mt, true, rank_scale * loss_scale / double(counted));
      trace::memory(device_);
    }
    {
      trace::Scope ts("backward", "compute", {{"micro", m}});
      tape.backward(loss);
      trace::memory(device_);
    }
    losses.push_back(autograd::detach(loss));
  }
  for (const Tensor& l : losses) loss_sum += item(l) / (loss_scale * rank_scale);
  if (ddp_) {
    parallel::watchdog::Waiting w("the gradient all-reduce");
    ddp_->finish_gradients();
  }
  if (cfg_.sequence_parallel && !fsdp_) parallel::tp::sync_sequence_parallel_grads(*model_, *groups_.tp);
  loss_sum = dp_loss(loss_sum);
  if (fsdp_) {  // the units were reduce-scattered during backward, micro-batch by micro-batch
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      fsdp_->finish_gradients();
      if (cfg_.sequence_parallel) fsdp_->sum_replicated_gradients(*groups_.tp);
      grad_norm = tp_ > 1 ? std::sqrt(world_sum(fsdp_->grad_sum_squares(parallel::mesh_grad_weight(groups_.tp->rank(), true))))
                          : fsdp_->grad_norm();
    }
    grad_norm /= loss_scale;
    applied = accept_step(step, loss_sum, grad_norm);
    trace::Scope opt_scope("optimizer", "compute");
    if (applied) fsdp_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    fsdp_->zero_grad();
    return loss_sum;
  }
  if (zero_) {
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      if (cfg_.sequence_parallel) zero_->reduce_now();
      else zero_->finish_gradients();
      // partial sums of squares all-reduced over the shards (and the model-parallel ranks)
      grad_norm = (tp_ > 1 ? std::sqrt(world_sum(zero_->grad_sum_squares(parallel::mesh_grad_weight(groups_.tp->rank(), true))))
                           : zero_->grad_norm()) / loss_scale;
    }
    applied = accept_step(step, loss_sum, grad_norm);
    if (applied) {
      parallel::watchdog::Waiting w("the parameter all-gather");
      trace::Scope ts("optimizer", "compute");
      zero_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    }
    zero_->zero_grad();
    return loss_sum;
  }
  if (dtype_ != DType::f32) {
    // The f32 masters take the model's bf16/f16 gradients as they are: the norm divides by the
    // loss scale and the update's scale carries it, AdamW widens each gradient as it reads it and
    // writes the model's weights back in the same pass (AdamW::set_copies). No f32 gradient copies.
    take_half_gradients();
  }
  if (tp_ > 1) {
    grad_norm = model_parallel_grad_norm() / loss_scale;
  } else {
    std::vector<Tensor> ps;
    for (auto& [n, p] : master_) ps.push_back(p);
    grad_norm = optim::global_grad_norm(ps) / loss_scale;
  }
  applied = accept_step(step, loss_sum, grad_norm);
  if (applied) {
    trace::Scope ts("optimizer", "compute");
    opt_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
  }
  model_->zero_grad();
  for (auto& [n, p] : master_) p.set_grad(Tensor());
  return loss_sum;
}

// One pipeline step: the executor runs this rank's actions over the micro-batches; the tied
// embedding's two gradients are summed; the global norm sums every rank's share.
double Trainer::pipeline_step(int64_t step, const Tensor& idx, const Tensor& tgt, int64_t counted, double loss_scale,
                              double lr, double& grad_norm, bool& applied) {
  if (!args_.str("timeline").empty()) metrics_->barrier()->wait();  // a common time origin
  double loss;
  {  // its waits are the sends' and receives' own (ProcessGroup's): a stage that hangs in compute is blamed
    if (ddp_) ddp_->set_sync(false);  // micro-batch backwards interleave: reduce once at the end
    if (zero_) zero_->set_sync(false);
    // Scaled by dp like the plain path: the dp average of the ranks' gradients is the global mean's.
    trace::Scope ts("forward+backward", "compute");
    // fp16: the loss scale rides in the loss's scale as on the plain path.
    loss = pipe_->run(idx, tgt, loss_scale * double(dp_size_) / double(counted)) / (loss_scale * double(dp_size_));
    if (!fsdp_) pipe_->reduce_tied_embedding();  // fsdp: on the shard gradients, below
  }
  if (cfg_.sequence_parallel && !fsdp_) parallel::tp::sync_sequence_parallel_grads(*model_, *groups_.tp);
  if (ddp_) {
    parallel::watchdog::Waiting w("the gradient all-reduce");
    ddp_->reduce_now();
  }
  loss = dp_loss(loss);
  const int tpr = groups_.tp ? groups_.tp->rank() : 0;
  if (fsdp_) {  // the Block units were reduce-scattered during backward; the roots are now
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      fsdp_->finish_gradients();
      pipe_->sum_tied(fsdp_->tied_grad_shard());
      if (cfg_.sequence_parallel) fsdp_->sum_replicated_gradients(*groups_.tp);
    }
    grad_norm = std::sqrt(world_sum(fsdp_->grad_sum_squares(parallel::mesh_grad_weight(tpr, pipe_->holds_stage(0))))) /
                loss_scale;
    applied = accept_step(step, loss, grad_norm);
    trace::Scope opt_scope("optimizer", "compute");
    if (applied) fsdp_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    fsdp_->zero_grad();
    return loss;
  }
  if (zero_) {
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      zero_->reduce_now();
    }
    grad_norm = std::sqrt(world_sum(zero_->grad_sum_squares(parallel::mesh_grad_weight(tpr, pipe_->holds_stage(0))))) /
                loss_scale;
    applied = accept_step(step, loss, grad_norm);
    parallel::watchdog::Waiting w("the parameter all-gather");
    if (applied) zero_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    zero_->zero_grad();
    return loss;
  }
  if (dtype_ != DType::f32) take_half_gradients();
  grad_norm = model_parallel_grad_norm() / loss_scale;
  applied = accept_step(step, loss, grad_norm);
  trace::Scope opt_scope("optimizer", "compute");
  if (applied) opt_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
  for (auto& [n, p] : held_parameters()) p.set_grad(Tensor());
  for (auto& [n, p] : master_) p.set_grad(Tensor());
  return loss;
}

parallel::FsdpOptions Trainer::fsdp_options() const {
  const Args& a = args_;
  parallel::FsdpOptions o;
  o.mode = strategy_ == "fsdp-grad-op" ? parallel::FsdpMode::shard_grad_op
           : strategy_ == "hsdp"       ? parallel::FsdpMode::hybrid
           : strategy_ == "no-shard"   ? parallel::FsdpMode::no_shard
                                       : parallel::FsdpMode::full_shard;
  if (strategy_ == "hsdp") {
    const int64_t g = a.i64("shard-group-size");
    SG_CHECK(g != 0, "train: --strategy hsdp needs --shard-group-size G: the ranks of one shard group (e.g. the ranks of a "
             "node), dividing the ", dp_size_, " data-parallel ranks");
    SG_CHECK(g >= 1 && dp_size_ % g == 0, "train: --strategy hsdp: --shard-group-size ", g, " must divide the ",
             dp_size_, " data-parallel ranks");
    o.shard_group_size = int(g);
  }
  SG_CHECK(a.i64("wrap-min-params") >= 0, "train: --wrap-min-params must be >= 0");
  o.wrap_min_params = a.i64("wrap-min-params");
  const std::string r = a.str("reshard-after-forward");
  SG_CHECK(r == "default" || r == "true" || r == "false", "train: --reshard-after-forward must be default, true or false, got '", r, "'");
  if (r != "default") o.reshard_after_forward = r == "true";
  const std::string pf = a.str("prefetch");
  SG_CHECK(pf == "none" || pf == "forward" || pf == "backward" || pf == "both", "train: --prefetch must be none, forward, backward or both, got '", pf, "'");
  o.forward_prefetch = pf == "forward" || pf == "both";
  o.backward_prefetch = pf == "backward" || pf == "both";
  SG_CHECK(a.i64("limit-all-gathers") >= 1, "train: --limit-all-gathers must be >= 1");
  o.limit_all_gathers = int(a.i64("limit-all-gathers"));
  const std::string off = a.str("offload");
  SG_CHECK(off == "none" || off == "optimizer" || off == "params", "train: --offload must be none, optimizer or params, got '",
           off, "'");
  if (off != "none") {
    SG_CHECK(device_ != Device::cpu(0), "train: --offload ", off, " moves state from the compute device to the host "
             "(cpu:0): give a compute device (--device cuda:N, or cpu:1 on a CPU machine)");
    o.offload_optimizer = host_device();  // params: the parameter shards as well
    o.offload_params = off == "params";
  }
  const std::string rd = a.str("reduce-dtype");
  if (rd != "param") {
    const DType d = parse_dtype(rd);
    SG_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16, "train: --reduce-dtype must be param, fp32, bf16 or fp16");
    o.reduce_dtype = d;
  }
  if (pipe_) {  // this rank's stages only
    std::set<std::string> names;
    for (const auto& [n, p] : pipe_->parameters()) names.insert(n);
    o.holds = [names](const std::string& n) { return names.count(n) > 0; };
  }
  return o;
}

double Trainer::model_parallel_grad_norm() {
  std::vector<Tensor> grads;
  const bool first_stage = !pipe_ || pipe_->holds_stage(0);
  for (auto& [n, p] : master_) {
    if (n == "wte.weight" && !first_stage) continue;
    if (tp_ > 1 && parallel::tp::gpt_param_split(n).replicated() && groups_.tp->rank() != 0) continue;
    grads.push_back(p.grad());
  }
  Tensor t = from_vector<double>({sum_squares(grads)}, {1});
  mp_metrics_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return std::sqrt(item(t));
}

// Whether to apply this step. The norm is the same on every rank (all-reduced), so every rank
// decides alike. fp16: an overflow is the loss scaler's business (back off, skip). Otherwise a
// non-finite loss or norm stops the run naming the step and this rank's first non-finite tensor
// (--on-nonfinite stop), or skips the step and counts it (skip).
bool Trainer::accept_step(int64_t step, double loss, double grad_norm) {
  const bool finite = std::isfinite(grad_norm) && std::isfinite(loss);
  if (dtype_ == DType::f16) return scaler_.update(!finite);
  if (finite) return true;
  if (nonfinite_ == optim::NonFinitePolicy::skip) {
    ++nonfinite_skipped_;
    if (lead())
      std::printf("step %lld: non-finite %s: skipped (%lld skipped so far)\n", (long long)step + 1,
                  std::isfinite(loss) ? "gradient norm" : "loss", (long long)nonfinite_skipped_);
    return false;
  }
  io::NamedTensors grads;
  for (auto& [n, p] : held_parameters())
    if (p.grad().defined()) grads.emplace_back(n, p.grad());
  optim::NonFinite bad = optim::first_nonfinite(grads);  // the gradient first: the loss is its symptom
  if (!bad.found()) bad = optim::first_nonfinite(loss, {});
  throw Error(bad.found() ? str("train: ", optim::nonfinite_message(bad, step + 1), " (--on-nonfinite stop)")
                          : str("train: step ", step + 1, ": the gradient norm is not finite (loss ", loss,
                                "); this rank's gradients are finite: the bad one is on another rank or was already "
                                "reduced (--on-nonfinite stop)"));
}

double Trainer::world_sum(double x) {
  Tensor t = from_vector<double>({x}, {1});
  metrics_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return item(t);
}

double Trainer::dp_loss(double share) {
  if (dp_size_ == 1) return share;
  Tensor l = from_vector<double>({share}, {1});
  dp_metrics_->all_reduce(l, comm::ReduceOp::sum)->wait();
  return item(l);
}

// Gathers every rank's recorded (start, end) times of the last step and draws them (rank 0).
void Trainer::write_timeline() {
  const int pp_rank = groups_.pp->rank();
  const auto& mine = pipe_->last_timeline().per_rank[size_t(pp_rank)];
  std::vector<double> times;
  for (const auto& a : mine) times.insert(times.end(), {a.start, a.end});
  Tensor local = from_vector(times, {int64_t(times.size())});
  Tensor all = empty({int64_t(times.size()) * world_size_}, DType::f64);
  metrics_->all_gather(all, local)->wait();
  if (!lead()) return;
  auto sched = parallel::pp::make_schedule(args_.str("pp-schedule"), pp_, int((B_ / dp_size_) / micro_),
                                           int(args_.i64("virtual-stages")));
  parallel::pp::Timeline t;
  t.per_rank.resize(size_t(pp_));
  std::vector<double> v = to_vector<double>(all);
  for (int r = 0; r < pp_; ++r)
    for (size_t k = 0; k < sched.per_rank[size_t(r)].size(); ++k) {
      // pipeline rank r of the first replica (dp 0, tp 0) is world rank r * tp
      const size_t at = size_t(r) * size_t(tp_) * times.size() + 2 * k;
      const double start = v[at], end = v[at + 1];
      t.per_rank[size_t(r)].push_back({sched.per_rank[size_t(r)][k], start, end});
      t.makespan = std::max(t.makespan, end);
    }
  io::write_text_atomic(args_.str("timeline"), "train: --timeline",
                        report::timeline_svg(t, sched.name + " pipeline, measured: p=" + std::to_string(pp_) +
                                                    ", m=" + std::to_string(sched.micro_batches)));
  std::printf("timeline: measured bubble %.1f%% of busy time (formula (p-1)/(v m) = %.1f%%), written to %s\n",
              100.0 * t.bubble_fraction(), 100.0 * double(pp_ - 1) / double(sched.chunks * sched.micro_batches),
              args_.str("timeline").c_str());
}

json Trainer::evaluate() {
  autograd::NoGradGuard ng;
  DropoutOff eval_mode;  // the model as it is, without dropout
  trace::Scope ts("evaluate", "compute");
  json out;
  val_->set_position(0);  // the same held-out batches at every evaluation
  double total = 0;
  const int64_t nb = args_.i64("eval-batches");
  for (int64_t i = 0; i < nb; ++i) {
    io::Batch b = val_->next(B_, T_);
    const Tensor idx = to(b.inputs, device_), tgt = to(b.targets, device_);
    // The pipeline's loss is a sum (times scale), as in training: the mean over the counted targets.
    if (pipe_) total += item(pipe_->forward(idx, tgt, 1.0 / double(std::max<int64_t>(1, count_targets(b.targets, -1)))));
    else total += item(model_->loss(idx, tgt));
  }
  out["val_loss"] = total / double(nb);
  // Under sequence parallelism prompts of any length cannot be split over tp: loss only.
  auto* task = dynamic_cast<const io::SyntheticDataset*>(val_.get());
  if (task && !cfg_.sequence_parallel) {
    // Under tp and pp every rank of the replica runs the same prompts in lockstep and sees the whole
    // vocabulary: the pipeline's last stage sends its logits to every stage, the slices of the
    // logits are gathered over tp.
    auto logits_fn = [this](const Tensor& idx) {
      Tensor logits = pipe_ ? pipe_->forward(to(idx, device_)) : model_->forward(to(idx, device_));
      if (tp_ > 1) logits = parallel::all_gather_along(logits, -1, *groups_.tp);
      return to(logits, Device::cpu());
    };
    out["accuracy"] = io::synthetic_accuracy(task->task(), logits_fn, args_.i64("eval-problems"), cfg_.block_size, seed_ + 1);
    out["examples"] = io::synthetic_examples(task->task(), logits_fn, 4, cfg_.block_size, seed_ + 2);
  }
  return out;
}

// This rank's share of the training state as pieces of global tensors. Replicated copies are
// written once: parameters (and, without ZeRO, optimizer state) by the first data-parallel
// replica; tp-replicated tensors by tp rank 0; the tied embedding by the first pipeline stage.
std::vector<ckpt::Piece> Trainer::state_pieces() const {
  auto base_of = [](const std::string& n) {
    for (const char* suf : {".exp_avg_sq", ".exp_avg", ".master"}) {
      const std::string x(suf);
      if (n.size() > x.size() && n.compare(n.size() - x.size(), x.size(), x) == 0) return n.substr(0, n.size() - x.size());
    }
    return n;
  };
  auto unique_here = [&](const std::string& name) {
    const std::string base = base_of(name);
    if (pipe_ && base == "wte.weight" && !pipe_->holds_stage(0)) return false;
    if (tp_ > 1 && parallel::tp::gpt_param_split(base).replicated() && groups_.tp->rank() != 0) return false;
    return true;
  };
  std::vector<ckpt::Piece> out;
  auto add = [&](std::vector<ckpt::Piece> ps) {
    for (auto& p : ps)
      if (unique_here(p.name)) out.push_back(std::move(p));
  };
  if (fsdp_) {
    add(fsdp_->state_pieces());
    return out;
  }
  const auto params = held_parameters();
  if (dp_rank_ == 0)
    for (const auto& [n, p] : params) add(ckpt::pieces_of(view_of(n, p.shape()), p));
  if (zero_) {
    add(zero_->state_pieces([this](const std::string& n, const Shape& sh) { return view_of(n, sh); }));
  } else if (dp_rank_ == 0) {
    for (const auto& [n, t] : opt_->state()) {
      const std::string base = base_of(n);
      add(ckpt::pieces_of(ckpt::renamed(view_of(base, t.shape()), n), t));
    }
    if (dtype_ != DType::f32)
      for (const auto& [n, m] : master_) add(ckpt::pieces_of(ckpt::renamed(view_of(n, m.shape()), n + ".master"), m));
  }
  return out;
}

ckpt::LocalView Trainer::view_of(const std::string& name, const Shape& local_shape) const {
  return ckpt::gpt_param_view(name, local_shape, cfg_.vocab_size, tp_ > 1 ? groups_.tp->rank() : 0, tp_);
}

void Trainer::load_parameters(const ckpt::Checkpoint& ck) {
  autograd::NoGradGuard ng;
  for (auto& [n, p] : model_->named_parameters()) ckpt::read_local(ck, view_of(n, p.shape()), p);
}

void Trainer::load_optimizer(const ckpt::Checkpoint& ck, int64_t optimizer_step) {
  autograd::NoGradGuard ng;
  if (fsdp_) return fsdp_->load_state(ck, optimizer_step);
  if (zero_) return zero_->load_state(ck, optimizer_step, [this](const std::string& n, const Shape& sh) { return view_of(n, sh); });
  io::NamedTensors st;
  for (const auto& [n, m] : master_) {
    for (const char* suf : {".exp_avg", ".exp_avg_sq"}) {
      Tensor t = zeros(m.shape(), DType::f32, m.device());
      ckpt::read_local(ck, ckpt::renamed(view_of(n, m.shape()), n + suf), t);
      st.emplace_back(n + suf, t);
    }
    // f32 masters were saved exactly; a checkpoint without them (saved in f32) seeds them.
    if (dtype_ != DType::f32 && ck.has(n + ".master")) ckpt::read_local(ck, ckpt::renamed(view_of(n, m.shape()), n + ".master"), m);
    else if (dtype_ != DType::f32) ckpt::read_local(ck, view_of(n, m.shape()), m);
  }
  opt_->load_state(st, optimizer_step);
}

// Every rank writes its pieces; rank 0 commits the step directory (parallel/sharded_checkpoint.h).
void Trainer::save(int64_t next_step) {
  json s;
  s["step"] = next_step;
  s["optimizer_step"] = opt_ ? opt_->steps() : zero_ ? zero_->steps() : fsdp_->steps();
  s["train_position"] = train_->position();
  s["dropout_stream"] = dropout_generator().next_stream;
  s["loss_scale"] = scaler_.scale;
  s["loss_scale_clean_steps"] = scaler_.clean_steps;
  s["skipped_steps"] = scaler_.skipped_steps;
  s["nonfinite_skipped"] = nonfinite_skipped_;
  s["seed"] = seed_;
  s["dtype"] = dtype_name(dtype_);
  s["data"] = data_opt_.spec;
  s["argv"] = args_.argv_copy;
  json flags = json::object();
  for (const char* f : kRunFlags)
    if (args_.given(f)) flags[f] = std::string(f) == "data" ? saved_data_spec() : args_.str(f);
  s["train_flags"] = flags;
  s["layout"] = {{"strategy", strategy_}, {"world", world_size_}, {"dp", dp_size_}, {"tp", tp_}, {"pp", pp_}};
  const std::vector<ckpt::Piece> mine = state_pieces();
  const auto meta = config_metadata(cfg_, saved_data_spec());
  const int keep = int(args_.i64("keep"));
  std::string where;
  if (metrics_) {
    where = ckpt::save_sharded(save_dir_, next_step, mine, s, meta, *metrics_, keep);
  } else {
    where = ckpt::save_sharded(save_dir_, next_step, mine, s, meta, 0, 1, [] {}, keep);
  }
  if (lead()) std::printf("saved checkpoint %s\n", where.c_str());
}

std::string Trainer::layout_label() const {
  const std::string dp = strategy_ == "single" && dp_size_ == 1 ? "" : str(strategy_, " over dp ", dp_size_, " x ");
  return tp_ == 1 && pp_ == 1 ? str(strategy_, " x ", world_size_)
                              : str(dp, "tp ", tp_, cfg_.sequence_parallel ? "+sp" : "", " x pp ", pp_, " (",
                                    world_size_, " ranks)");
}

json Trainer::simulate(int64_t steps) {
  setup();
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
  json out = {{"rank", rank_}, {"peak", peak}, {"end", end}, {"comm", last_comm}};
  if (args_.str("offload") != "none") {  // the offloaded state's ledger, the last step's peaks
    json host = json::object();
    const json ledger = ledger_json(host_device());  // kept alive: items() iterates it
    for (const auto& [cat, v] : ledger.items()) host[cat] = v["peak"];
    out["host_peak"] = host;
  }
  if (lead())
    out["header"] = str("model ", cfg_.name, ": ", double(cfg_.num_params()) / 1e6, "M params | ", layout_label(),
                        " | ", dtype_name(dtype_), " | batch ", B_, " x ", T_, " tokens (micro-batch ", micro_, ") | ",
                        steps, steps == 1 ? " step" : " steps");
  return out;
}

int Trainer::run() {
  for (const char* flag : {"log-json", "timeline", "trace"})  // their folders exist before the work, not after it
    if (!args_.str(flag).empty()) io::make_parent_folder(args_.str(flag), std::string("train: --") + flag);
  setup();
  std::unique_ptr<std::ofstream> log;
  if (!args_.str("log-json").empty() && lead()) {
    log = std::make_unique<std::ofstream>(args_.str("log-json"), start_step_ ? std::ios::app : std::ios::trunc);
    SG_CHECK(log->good(), "train: cannot write --log-json ", args_.str("log-json"));
  }
  if (lead()) {
    // The whole model's size; under tp/pp rank 0 holds a part of it (before any dp sharding).
    const int64_t whole = cfg_.num_params(), held = model_->num_parameters();
    std::printf("shardgrad train | model %s: %lld layers, %lld heads, width %lld, vocab %lld (padded %lld), %.2fM params%s\n",
                cfg_.name.c_str(), (long long)cfg_.n_layer, (long long)cfg_.n_head, (long long)cfg_.n_embd,
                (long long)cfg_.vocab_size, (long long)cfg_.vocab_rows(), double(whole) / 1e6,
                held == whole ? "" : str(" (rank 0's tp/pp part: ", std::lround(held / 1e4) / 100.0, "M)").c_str());
    const std::string layout = layout_label();
    std::printf("data %s | batch %lld x %lld tokens (micro-batch %lld%s) | %s %s | %d threads | %s | steps %lld..%lld\n",
                train_->describe().c_str(), (long long)B_, (long long)T_, (long long)micro_,
                pp_ > 1 ? str(", ", B_ / dp_size_ / micro_, " per step").c_str() : "", device_.str().c_str(),
                dtype_name(dtype_), omp_get_max_threads(), layout.c_str(), (long long)start_step_, (long long)steps_);
    if (world_size_ == 1 && strategy_ != "single" && strategy_ != "dp")
      std::printf("note: --strategy %s on 1 rank shards and reduces nothing (launch it with mpirun -np N)\n",
                  strategy_.c_str());
  }
  std::fflush(stdout);
  const int64_t save_every = args_.i64("save-every"), eval_every = args_.i64("eval-every");
  for (int64_t step = start_step_; step < steps_; ++step) {
    const double lr = sched_.at(step);
    Ledger::global().reset_peaks(device_);
    trace::Scope step_scope("step", "compute", {{"step", step + 1}});
    trace::memory(device_);  // the step's starting point (bench's memory-over-time chart)
    parallel::watchdog::beat("forward/backward", step);
    parallel::maybe_inject(fault_, rank_, step + 1);
    auto t0 = std::chrono::steady_clock::now();
    double norm = 0;
    bool applied = true;
    std::optional<kernels::OpProfiler> profiler;
    if (step + 1 == args_.i64("profile-ops")) profiler.emplace(device_);
    const double loss = train_step(step, lr, norm, applied);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const bool profiled = profiler.has_value();
    std::map<std::string, kernels::OpTime> op_times;
    if (profiled) {
      op_times = profiler->take();
      profiler.reset();
    }
    const double tps = double(B_ * T_) / (ms / 1000.0);
    trace::memory(device_);
    // Every rank's ledger (collective): the line shows the range of the ranks' peaks, which differ
    // under pipelines and uneven shards.
    const json ranks = report::step_metrics(device_, traffic_groups(), metrics_.get(),
                                            pipe_ ? &pipe_->last_timeline() : nullptr, pipe_ ? groups_.pp->rank() : -1)["ranks"];
    const std::string peak = peak_range(ranks);
    if (lead())
      std::printf("step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %7.1f ms | %8.0f tok/s | peak%s %s%s\n",
                (long long)step + 1, (long long)steps_, loss, lr, norm, ms, tps, ranks.size() > 1 ? "/rank" : "",
                peak.c_str(), applied ? "" : dtype_ == DType::f16 ? " | skipped (overflow)" : " | skipped (non-finite)");
    if (profiled && lead()) print_op_profile(op_times, ms, step + 1, device_);
    std::fflush(stdout);
    json rec = {{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"step_ms", ms},
                {"tokens_per_s", tps}, {"mem", ledger_json(device_)}, {"skipped", !applied}};
    if (profiled) rec["op_profile"] = op_profile_json(op_times);
    if (args_.str("offload") != "none") rec["mem_host"] = ledger_json(Device::cpu(0));  // the offloaded state
    if (fsdp_) rec["fsdp"] = {{"gathers_ahead", fsdp_->gathers_ahead()}};  // since the start: --prefetch at work
    rec["ranks"] = ranks;
    const bool last = step + 1 == steps_;
    if (last && pipe_ && !args_.str("timeline").empty()) write_timeline();
    if (((eval_every && (step + 1) % eval_every == 0) || last) && evaluates_here()) {
      json ev = evaluate();
      if (lead()) {
        std::printf("eval  step %lld | val loss %.4f", (long long)step + 1, ev["val_loss"].get<double>());
        if (ev.contains("accuracy")) std::printf(" | task accuracy %.1f%%", 100.0 * ev["accuracy"].get<double>());
        std::printf("\n");
        if (last && ev.contains("examples"))
          for (const auto& line : ev["examples"]) std::printf("  %s\n", line.get<std::string>().c_str());
        std::fflush(stdout);
      }
      rec["eval"] = ev;
    }
    if (log) {
      *log << rec.dump() << "\n";
      log->flush();
    }
    if (!save_dir_.empty() && ((save_every && (step + 1) % save_every == 0) || last)) {
      parallel::watchdog::Waiting w("the checkpoint save");
      save(step + 1);  // collective: every rank writes its own pieces
    }
  }
  if (const std::string path = args_.str("trace"); !path.empty()) {  // every rank's part, merged by rank 0
    trace::finish(path, rank_, world_size_, [&] {
      parallel::watchdog::Waiting w("the trace barrier");
      if (metrics_) metrics_->barrier()->wait();
    });
    if (lead()) std::printf("trace: written to %s (open it in https://ui.perfetto.dev or chrome://tracing)\n", path.c_str());
  }
  return 0;
}

// --simulate N: the N ranks of the layout as threads, each a Trainer on its own meta device over
// a simulated world (parallel/comm/sim_backend.h), then one line per group of ranks whose bytes are
// equal. The figures are the engine's own ledger and counters: nothing is estimated.
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
                           "backend", "rendezvous"})
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
  std::printf("peaks: the largest of each category over the steps, and of their sum (peak total); exact bytes in "
              "--log-json\n");
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

}  // namespace

int train_main(int argc, char** argv) {
  Args a("train", "Train a GPT-2-family model. Defaults: the tiny model on the built-in synthetic addition task.");
  declare_flags(a);
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  if (a.given("simulate")) return simulate_main(a);
  std::unique_ptr<ckpt::Checkpoint> resumed = resume_checkpoint(a);
  inherit_run_flags(a, resumed.get());
  int rc = 0;
  try {
    Trainer t(a, std::move(resumed));
    rc = t.run();
  } catch (...) {
    // Without MPI (--rendezvous file:) nothing aborts the process on the way out: a watchdog
    // thread still running at exit would terminate it instead of letting main report the error.
    parallel::watchdog::disarm();
    throw;
  }
  parallel::watchdog::disarm();
  comm::finalize();  // a no-op unless this run initialised MPI
  return rc;
}

}  // namespace sg::cli
