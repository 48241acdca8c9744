// Trainer::setup: the run's flags, refused by name where they do not fit, become this rank's world,
// device, data, model, optimizer and (with --resume) the checkpoint's state, in that order.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <optional>
#include <set>
#include <thread>

#include <unistd.h>

#include "autograd/ops.h"
#include "cli/trainer.h"
#include "core/trace.h"
#include "io/gpt2_tokenizer.h"
#include "io/synthetic.h"
#include "kernels/ops.h"
#include "parallel/checkpoint.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/comm/nccl_backend.h"

namespace sg::cli {

using nlohmann::json;

namespace {

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
  SG_CHECK(c.dropout >= 0 && c.dropout < 1, "train: --dropout ", a.str("dropout"), " is outside [0, 1)");
  if (a.i64("seq-len") > c.block_size && !a.i64("block-size")) c.block_size = a.i64("seq-len");
  c.validate();
  return c;
}

}  // namespace

void Trainer::setup() {
  configure();
  join_world();
  choose_device_and_batch();
  open_data();
  // A checkpoint of any layout (sharded, or the older full format): this run reads its own slices.
  // --resume auto: the newest complete checkpoint of the --save directory, or none yet.
  const std::unique_ptr<ckpt::Checkpoint> ck = std::move(resumed_);
  {
    // A rank reading its pieces from a slow disk, and its peers waiting for it at the barrier that
    // ends the reading: --checkpoint-timeout's when given.
    parallel::watchdog::Patience patience(ck ? args_.f64("checkpoint-timeout") : 0, "--checkpoint-timeout");
    build_model(ck.get());
    configure_samples();
    configure_hellaswag();
    build_optimizer();
    restore(ck.get());
    if (ck && metrics_ && world_size_ > 1 && !sim_) {
      parallel::watchdog::Waiting w("the checkpoint load barrier");
      metrics_->barrier()->wait();
    }
  }
  start_trace();
}

// fp16's loss scaling, as PyTorch's GradScaler (Megatron's flag names). Given with another dtype
// the flags are refused (inherited from an fp16 checkpoint resumed in bf16 they are left unused).
void Trainer::configure_loss_scaling() {
  const Args& a = args_;
  const auto typed = [&](const char* f) {  // on this command line, not inherited from a checkpoint
    const auto& inh = a.inherited();
    return a.given(f) && std::find(inh.begin(), inh.end(), f) == inh.end();
  };
  for (const char* f : {"initial-loss-scale", "loss-scale-window", "loss-scale-growth", "loss-scale-backoff",
                        "min-loss-scale", "loss-scale"})
    SG_CHECK(dtype_ == DType::f16 || !typed(f), "train: --", f, " applies to --dtype fp16 only (", a.str("dtype"),
             " trains without loss scaling)");
  const double fixed = a.f64("loss-scale"), init = a.f64("initial-loss-scale"), min = a.f64("min-loss-scale");
  const double growth = a.f64("loss-scale-growth"), backoff = a.f64("loss-scale-backoff");
  SG_CHECK(fixed == 0 || (std::isfinite(fixed) && fixed > 0), "train: --loss-scale must be > 0 (or 0: dynamic), got ", fixed);
  // A fixed scale takes none of the dynamic one's flags (they would be read and then ignored).
  for (const char* f : {"initial-loss-scale", "min-loss-scale", "loss-scale-window", "loss-scale-growth",
                        "loss-scale-backoff"})
    SG_CHECK(!fixed || !typed(f), "train: --loss-scale ", fixed, " is a fixed scale; --", f,
             " is for a dynamic one (give one of them)");
  SG_CHECK(std::isfinite(init) && init > 0, "train: --initial-loss-scale must be > 0, got ", init);
  SG_CHECK(fixed || (std::isfinite(min) && min > 0 && min <= init), "train: --min-loss-scale must be > 0 and at most ",
           "--initial-loss-scale (", init, "), got ", min);
  SG_CHECK(std::isfinite(growth) && growth >= 1, "train: --loss-scale-growth must be >= 1, got ", growth);
  SG_CHECK(backoff > 0 && backoff <= 1, "train: --loss-scale-backoff must be in (0, 1], got ", backoff);
  scaler_.scale = fixed ? fixed : init;
  scaler_.growth_interval = positive(a, "loss-scale-window");
  scaler_.growth_factor = fixed ? 1.0 : growth;
  scaler_.backoff_factor = fixed ? 1.0 : backoff;
  scaler_.min_scale = fixed ? fixed : min;
}

double Trainer::peak_flops() const {
  const std::string v = args_.str("peak-tflops");
  double tflops = 0;
  if (v == "auto") {
    tflops = is_half(dtype_) ? kernels::half_peak_tflops(device_) : 0;
  } else {
    tflops = args_.f64("peak-tflops");
    SG_CHECK(std::isfinite(tflops) && tflops >= 0, "train: --peak-tflops must be auto or >= 0, got ", v);
  }
  const size_t devices = strategy_ == "dp" ? dp_devices_.size() : size_t(world_size_);
  return tflops * 1e12 * double(devices);
}

void Trainer::configure() {
  const Args& a = args_;
  const int64_t threads = a.i64("threads");
  SG_CHECK(threads >= 0, "train: --threads must be >= 0");
  // More threads than a few per core only thrash (libgomp fails to create tens of thousands).
  const int64_t most = 4 * int64_t(std::max(1u, std::thread::hardware_concurrency()));
  SG_CHECK(threads <= most, "train: --threads ", threads, " is more than 4 per core of this machine's ", most / 4,
           " (at most ", most, "; 0 picks a count)");
  const int nt = threads ? int(threads) : default_threads();
  // Eigen's GEMM follows the calling thread's OpenMP setting when Eigen::setNbThreads was never
  // called. Setting it would fix one count for every thread: --strategy dp's replica threads
  // would each run 2-thread GEMMs on 2 cores, whose busy-waits made a step 70x slower.
  omp_set_num_threads(nt);

  strategy_ = a.str("strategy");
  SG_CHECK(strategy_ == "single" || strategy_ == "dp" || strategy_ == "ddp" || zero_stage() > 0, "train: --strategy '",
           strategy_, "' is not available (expected single, dp, ddp, zero1, zero2, zero3, fsdp, fsdp-grad-op, hsdp or no-shard)");
  tp_ = int(positive(a, "tp"));
  pp_ = int(positive(a, "pp"));
  SG_CHECK(strategy_ != "dp" || (tp_ == 1 && pp_ == 1), "train: --strategy dp (replicas on the devices of one ",
           "process) does not compose with ", pp_ > 1 ? "--pp" : "--tp", "; run ddp under mpirun");
  SG_CHECK(!a.on("sequence-parallel") || tp_ > 1, "train: --sequence-parallel needs --tp > 1");
  // A flag of one strategy or layout, given where it would do nothing, is refused by name rather
  // than ignored.
  const auto only_for = [&](const char* flag, bool applies, const char* what) {
    SG_CHECK(!a.given(flag) || applies, "train: --", flag, " is for ", what, "; this run is --strategy ", strategy_,
             pp_ > 1 ? " --pp " + std::to_string(pp_) : std::string());
  };
  for (const char* flag : {"wrap-min-params", "reshard-after-forward", "prefetch", "limit-all-gathers", "reduce-dtype"})
    only_for(flag, fsdp_family(), "the fsdp family (zero3, fsdp, fsdp-grad-op, hsdp, no-shard)");
  only_for("offload", zero_stage() > 0, "the sharded strategies (zero1, zero2 and the fsdp family)");
  SG_CHECK(a.str("offload") != "params" || fsdp_family(), "train: --offload params moves parameter shards to the host; ",
           "--strategy ", strategy_, " keeps whole parameters on every rank (offload the optimizer, or shard the "
           "parameters: zero3 or the fsdp family)");
  only_for("shard-group-size", strategy_ == "hsdp", "--strategy hsdp");
  only_for("bucket-mb", strategy_ == "ddp" || strategy_ == "zero1" || strategy_ == "zero2", "ddp, zero1 and zero2");
  only_for("find-unused-parameters", strategy_ == "ddp", "--strategy ddp");
  only_for("grad-accumulation", strategy_ == "zero2" || fsdp_family(), "zero2 and the fsdp family (ddp and zero1 "
           "accumulate full gradients)");
  SG_CHECK(a.str("grad-accumulation") == "sharded" || a.str("grad-accumulation") == "unsharded",
           "train: --grad-accumulation must be sharded or unsharded, got '", a.str("grad-accumulation"), "'");
  const bool unsharded = a.str("grad-accumulation") == "unsharded";
  // A pipeline's tied embedding and sequence parallelism's replicated parameters have their
  // gradients complete only once summed across stages / the tp group, after the last backward.
  const bool deferred = pp_ > 1 || a.on("sequence-parallel");
  SG_CHECK(!a.given("grad-accumulation") || unsharded || !deferred || fsdp_family(),
           "train: --grad-accumulation sharded needs every gradient complete after each micro-batch's backward; under ",
           pp_ > 1 ? "--pp" : "--sequence-parallel", " zero2 sums some across ", pp_ > 1 ? "stages" : "the tp group",
           " after the last one and reduces once a step (unsharded)");
  SG_CHECK(!unsharded || !fsdp_family() || pp_ == 1, "train: --grad-accumulation unsharded (FSDP's no_sync) is not for "
           "pipelines: their micro-batches interleave (fsdp-grad-op under --pp reduces its units once a step)");
  shard_accumulation_ = strategy_ == "zero2" && !unsharded && !deferred;
  fsdp_no_sync_ = fsdp_family() && unsharded;
  for (const char* flag : {"pp-schedule", "virtual-stages", "timeline"}) only_for(flag, pp_ > 1, "pipelines (--pp > 1)");
  only_for("devices", strategy_ == "dp", "--strategy dp (one process, several devices)");
  for (const char* flag : {"save-every", "keep"}) SG_CHECK(!a.given(flag) || a.given("save"), "train: --", flag, " needs --save DIR");
  // --resume auto beside --init-from is launch's restart of a run that started from the file.
  SG_CHECK(a.str("init-from").empty() || a.str("resume").empty() || a.str("resume") == "auto", "train: give --init-from ",
           "(start a run from a file) or --resume (continue a run), not both");
  device_spec_ = a.str("device");
  SG_CHECK(a.str("backend") == "mpi" || a.str("backend") == "nccl", "train: --backend must be mpi or nccl, got '",
           a.str("backend"), "'");
  SG_CHECK(a.str("backend") == "mpi" || distributed(), "train: --backend nccl is for multi-rank strategies "
           "(--strategy ddp, zero*, fsdp*, --tp, --pp)");
  const comm::Rendezvous rdv = comm::parse_rendezvous(a.str("rendezvous"));
  SG_CHECK(rdv.kind == comm::Rendezvous::Kind::mpi || a.str("backend") == "nccl", "train: --rendezvous ", rdv.spec,
           " needs --backend nccl: it carries NCCL's unique id, and without mpirun NCCL is what connects the ranks "
           "(under mpirun use the default --rendezvous mpi)");
  // mpirun -np N of a one-process strategy runs N copies of one run, each its own lead (run() says
  // so): the files they write would be written N times over, the checkpoints' commits colliding.
  const char* launched = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (!distributed() && launched && std::atoi(launched) > 1)
    for (const char* flag : {"save", "log-json", "trace"})
      SG_CHECK(a.str(flag).empty(), "train: mpirun started ", launched, " processes, but --strategy ", strategy_,
               " trains in each on its own, and all ", launched, " would write --", flag, " ", a.str(flag),
               ": give --strategy ddp, zero1/2/3, fsdp..., --tp or --pp to train one model together, or run one process");
}

void Trainer::join_world() {
  const Args& a = args_;
  const comm::Rendezvous rdv = comm::parse_rendezvous(a.str("rendezvous"));
  SG_CHECK(a.f64("checkpoint-timeout") >= 0, "train: --checkpoint-timeout must be >= 0 (0: --comm-timeout's), got ",
           a.str("checkpoint-timeout"));
  SG_CHECK(a.f64("comm-timeout") > 0, "train: --comm-timeout must be > 0");  // in one process too: a flag is checked
  if (distributed()) {
    const bool nccl = a.str("backend") == "nccl";
    SG_CHECK(!nccl || a.str("device").rfind("cuda", 0) == 0, "train: --backend nccl carries CUDA tensors: pass "
             "--device cuda (each rank then uses cuda:<its local rank>) or --device cuda:N");
    if (sim_) {
      world_ = sim_;
      metrics_ = world_->split(0, sim_->rank());
      rank_ = sim_->rank();
      world_size_ = sim_->size();
    } else if (rdv.kind != comm::Rendezvous::Kind::mpi) {
      // A launcher without MPI (torchrun-like) started each process on its own. The job's rank and
      // size are RANK/WORLD_SIZE, and the NCCL world from the file or rank 0's port carries
      // everything, the CPU-side metrics too (staged through the device). MPI is never
      // initialised: a singleton MPI_Init would make each process a world of its own.
      const comm::LaunchEnv env = comm::launch_env(rdv);
      rank_ = env.rank;
      world_size_ = env.world_size;
      SG_CHECK(comm::nccl_available(), "train: --backend nccl: rank ", rank_,
               " sees no CUDA device (or this shardgrad was built without NCCL)");
      if (a.str("device") == "cuda") {
        SG_CHECK(env.local_rank >= 0, "train: --device cuda under --rendezvous ", rdv.spec, " needs LOCAL_RANK in the "
                 "environment (or pass --device cuda:N)");
        device_spec_ = "cuda:" + std::to_string(env.local_rank);
      }
      parallel::watchdog::arm(a.f64("comm-timeout"), rank_);  // a rank that never joins must not hang the rest
      {
        parallel::watchdog::Waiting w("the rendezvous " + rdv.spec);
        world_ = comm::nccl_world_from_rendezvous(rdv, parse_device(device_spec_).index, a.f64("comm-timeout"));
      }
      metrics_ = world_->split(0, rank_);  // losses and barriers: kept out of the gradient counters
    } else {
      // Joining is collective: a rank stalled before it would hang the others in MPI_Init, so the
      // watchdog is on first (the rank as mpirun numbers it, until MPI says).
      const char* launched_rank = std::getenv("OMPI_COMM_WORLD_RANK");
      parallel::watchdog::arm(a.f64("comm-timeout"), launched_rank ? std::atoi(launched_rank) : 0);
      {
        parallel::watchdog::Waiting w("MPI's initialisation (every rank joins)");
        comm::init();
        world_ = comm::MpiProcessGroup::world();
        metrics_ = world_->split(0, world_->rank());  // losses and barriers: kept out of the gradient counters
      }
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
}

// What a rank holds at the least: its share of the parameters (the whole model unless the layout
// splits it), one micro-batch's logits and a step's token ids. Past the machine's RAM and swap the run
// could only fail later: a bare bad_alloc in the first step, or a model built a layer at a time
// until the kernel's OOM killer ends the job. Sizes in double: the flags may overflow int64.
void Trainer::refuse_what_cannot_fit() const {
  if (sim_) return;  // --simulate sizes any layout on the meta device
  const double host = double(host_memory_bytes()), elem = double(dtype_size(dtype_));
  if (host == 0) return;
  const double split = double(tp_) * pp_ * (zero_stage() == 3 ? dp_size_ : 1);
  std::vector<std::pair<std::string, double>> parts = {
      {str("a step's token ids (--batch-size ", B_, " x --seq-len ", T_, ")"),
       double(B_) * double(T_) * 2 * sizeof(int64_t)}};  // inputs and targets, as read
  if (device_.type == DeviceType::cpu) {
    parts.emplace_back(str("the model's ", cfg_.num_params(), " parameters in ", dtype_name(dtype_),
                           split > 1 ? str(", its 1/", split, " share") : std::string(), " (", cfg_.n_layer,
                           " layers, width ", cfg_.n_embd, ", vocab ", cfg_.vocab_size, ")"),
                       double(cfg_.num_params()) * elem / split);
    parts.emplace_back(str("one micro-batch's logits (--micro-batch-size ", micro_, " x --seq-len ", T_, " x ",
                           cfg_.vocab_rows() / tp_, " vocabulary rows)"),
                       double(micro_) * double(T_) * double(cfg_.vocab_rows()) / tp_ * elem);
  }
  double need = 0;
  for (const auto& p : parts) need += p.second;
  if (need <= host) return;
  const auto gib = [](double b) { return str(std::fixed, std::setprecision(2), b / double(1 << 30), " GiB"); };
  std::string what;
  for (const auto& [name, bytes] : parts)
    if (bytes >= need / 100) what += str(what.empty() ? "" : "; ", name, ": ", gib(bytes));
  throw Error(str("train: a rank needs at least ", gib(need), " of host memory, more than this machine's ", gib(host),
                  " (RAM and swap): ", what));
}

void Trainer::choose_device_and_batch() {
  const Args& a = args_;
  fault_ = parallel::parse_fault(a.str("inject-fault"));
  nonfinite_ = optim::parse_nonfinite_policy(a.str("on-nonfinite"));
  device_ = parse_device(device_spec_);
  SG_CHECK(sim_ || !device_.is_meta(), "train: --device ", device_.str(), " holds no values (it sizes a layout): ",
           "use train --simulate N for that");
  if (strategy_ == "dp") {
    dp_devices_ = parallel::parse_devices(a.str("devices"));
    for (const Device& d : dp_devices_)
      SG_CHECK(!d.is_meta(), "train: --devices ", a.str("devices"), ": ", d.str(), " holds no values (it sizes a layout: ",
               "train --simulate N)");
    SG_CHECK(!a.given("device") || device_ == dp_devices_[0], "train: --device ", device_.str(),
             " differs from the first of --devices (", dp_devices_[0].str(), ")");
    device_ = dp_devices_[0];
  }
  dtype_ = model_dtype(a);
  configure_loss_scaling();
  (void)peak_flops();  // a bad --peak-tflops is refused before any work
  kernels::select_attention(a.str("attention"), device_);
  seed_ = uint64_t(a.i64("seed"));
  const bool synthetic = synthetic_data(a);
  B_ = a.i64("batch-size") ? positive(a, "batch-size") : (synthetic ? 128 : 32);
  micro_ = a.i64("micro-batch-size") ? positive(a, "micro-batch-size")
                                      : parallel::pp::default_micro_batch_size(B_ / std::max(1, dp_size_), pp_,
                                                                               a.str("pp-schedule"),
                                                                               int(a.i64("virtual-stages")));
  SG_CHECK(B_ % dp_size_ == 0, "train: --batch-size ", B_, " is not divisible by ", dp_size_,
           " data-parallel ranks");
  SG_CHECK((B_ / dp_size_) % micro_ == 0, "train: --micro-batch-size ", micro_, " does not divide ",
           dp_size_ > 1 ? str("the per-rank batch ", B_ / dp_size_, " (--batch-size ", B_, " over ", dp_size_, " ranks)")
                           : str("--batch-size ", B_));
  SG_CHECK(strategy_ != "dp" || micro_ % int64_t(dp_devices_.size()) == 0, "train: --strategy dp: the micro-batch of ",
           micro_, " rows (--micro-batch-size", a.i64("micro-batch-size") ? "" : " 0: the batch", ") does not split over ",
           "the ", dp_devices_.size(), " --devices");
  steps_ = a.str("steps") != "auto" ? positive(a, "steps") : synthetic ? kSyntheticSteps : kFileSteps;
  stop_at_ = a.i64("stop-at");
  SG_CHECK(stop_at_ >= 0 && stop_at_ <= steps_, "train: --stop-at must be a step from 1 to --steps (", steps_,
           ") or 0, got ", stop_at_);
  // A fault that could never fire would let a resilience test pass without testing anything.
  SG_CHECK(!fault_.active() || fault_.rank < world_size_, "train: --inject-fault rank=", fault_.rank, ": the job has ",
           world_size_, world_size_ == 1 ? " rank" : " ranks");
  SG_CHECK(!fault_.active() || fault_.step <= steps_, "train: --inject-fault step=", fault_.step, ": the run has ",
           steps_, " steps (--steps)");
  SG_CHECK(!fault_.active() || fault_.during != "load" || resumed_, "train: --inject-fault during=load: the run ",
           "resumes no checkpoint (give --resume, or --resume auto with a --save directory that holds one)");
  if (fault_.active() && fault_.during == "save") {
    SG_CHECK(saves_after(fault_.step), "train: --inject-fault step=", fault_.step,
             ",during=save: that step saves no checkpoint (--save ",
             a.given("save") ? str("--save-every ", a.i64("save-every"), " --steps ", steps_) : std::string("not given"),
             ")");
  }
  positive(a, "eval-batches");
  SG_CHECK(a.i64("save-every") >= 0 && a.i64("eval-every") >= 0, "train: --save-every/--eval-every must be >= 0");
  SG_CHECK(a.i64("profile-ops") >= 0 && a.i64("profile-ops") <= steps_,
           "train: --profile-ops must be a step number from 1 to --steps (", steps_, ") or 0, got ", a.i64("profile-ops"));
  SG_CHECK(!a.i64("profile-ops") || strategy_ != "dp", "train: --profile-ops times the calls of the training thread; ",
           "--strategy dp runs its replicas on threads of their own (profile one device, or ddp under mpirun)");
}

void Trainer::open_data() {
  const Args& a = args_;
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
  SG_CHECK(!data_opt_.shuffle || !io::is_generated_spec(data_opt_.spec), "train: --shuffle draws a file's rows at ",
           "random; --data ", data_opt_.spec, " is generated, row by row, and has nothing to shuffle");
  if (dynamic_cast<const io::SyntheticDataset*>(train_.get())) positive(a, "eval-problems");  // the task's accuracy
}

// What --sample-tokens' samples are drawn among and decoded with: the data's own tokens (text
// bytes, the synthetic task), or GPT-2's tokenizer for token shards.
void Trainer::configure_samples() {
  const Args& a = args_;
  sample_tokens_ = a.i64("sample-tokens");
  SG_CHECK(sample_tokens_ >= 0 && sample_tokens_ < (int64_t(1) << 20), "train: --sample-tokens must be in 0..",
           (1 << 20) - 1, ", got ", sample_tokens_);
  std::string tokenizer = a.str("tokenizer");
  // A --tokenizer the checkpoint gave serves the samples while they are still drawn from token
  // shards; one this command line turns off (--sample-tokens 0) or leaves (other --data) is unused,
  // not refused: the refusals below are for flags typed here.
  const auto& from_ck = a.inherited();
  if (std::find(from_ck.begin(), from_ck.end(), "tokenizer") != from_ck.end() &&
      (sample_tokens_ == 0 || !io::is_shard_spec(data_opt_.spec)))
    tokenizer.clear();
  SG_CHECK(tokenizer.empty() || sample_tokens_ > 0, "train: --tokenizer shows --sample-tokens' samples as text; give "
           "--sample-tokens N too");
  if (sample_tokens_ == 0) return;
  const std::string& data = data_opt_.spec;
  SG_CHECK(!io::is_generated_spec(data) || data.rfind("synthetic", 0) == 0, "train: --sample-tokens: random tokens "
           "(--data ", data, ") have no text to show");
  val_->check_batch(1, sample_prompt_length());  // the prompt: refused now, not at the first evaluation
  if (!tokenizer.empty()) {
    SG_CHECK(io::is_shard_spec(data), "train: --tokenizer is for GPT-2 token shards; --data ", data,
             " brings its own tokens");
    auto bpe = std::make_shared<io::Gpt2Tokenizer>(io::Gpt2Tokenizer::load(tokenizer));
    SG_CHECK(bpe->vocab_size() <= cfg_.vocab_size, "train: --tokenizer ", bpe->source(), " has ", bpe->vocab_size(),
             " tokens, more than the model's vocabulary of ", cfg_.vocab_size);
    sample_vocab_ = bpe->vocab_size();
    sample_decode_ = [bpe](const std::vector<int64_t>& ids) { return bpe->decode(ids); };
    return;
  }
  try {
    (void)val_->decode({0});
  } catch (const Error&) {
    if (!io::is_shard_spec(data)) throw;
    throw Error(str("train: --sample-tokens: the token shards ", data, " carry no tokenizer; pass --tokenizer DIR "
                    "(a folder with GPT-2's vocab.json and merges.txt)"));
  }
  sample_vocab_ = std::min(val_->vocab_size(), cfg_.vocab_size);
  sample_decode_ = [this](const std::vector<int64_t>& ids) { return val_->decode(ids); };
}

void Trainer::configure_hellaswag() {
  const std::string file = args_.str("hellaswag");
  const int64_t limit = args_.i64("hellaswag-examples");
  SG_CHECK(limit >= 0, "train: --hellaswag-examples must be >= 0 (0 = all), got ", limit);
  SG_CHECK(!file.empty() || !args_.given("hellaswag-examples"), "train: --hellaswag-examples limits --hellaswag's "
           "examples; give --hellaswag FILE too");
  if (file.empty()) return;
  try {
    choices_ = io::read_choice_file(file, limit);
  } catch (const Error& e) {
    const auto& from_ck = args_.inherited();
    if (std::find(from_ck.begin(), from_ck.end(), "hellaswag") == from_ck.end()) throw;
    throw Error(str(e.what(), " (--hellaswag ", file, " is the checkpoint's; give --hellaswag to read it elsewhere, "
                    "or --hellaswag '' for none)"));
  }
  SG_CHECK(!choices_.empty(), "train: --hellaswag ", file, " holds no examples");
  if (lead() && limit > int64_t(choices_.size()))
    std::printf("note: --hellaswag-examples %lld: %s holds %zu; all are scored\n", (long long)limit, file.c_str(),
                choices_.size());
  io::check_choice_tokens(choices_, cfg_.vocab_size, str("train: --hellaswag ", file),
                          str(" (the model's; --data ", data_opt_.spec, " trains on other tokens than the file's?)"));
}

void Trainer::build_model(const ckpt::Checkpoint* ck) {
  const Args& a = args_;
  // The model a checkpoint or --init-from loads: a shape flag (or --model's preset) given beside it
  // must agree with it, not be ignored (launch's restarts repeat the first command's flags).
  const auto agree = [&](const std::string& source) {
    const auto of = [](const nn::GPTConfig& c, const std::string& f) {
      return f == "n-layer" ? c.n_layer : f == "n-head" ? c.n_head : f == "n-embd" ? c.n_embd
             : f == "block-size" ? c.block_size : c.vocab_size;
    };
    const nn::GPTConfig preset = nn::gpt_preset(a.str("model"));
    for (const char* f : {"n-layer", "n-head", "n-embd", "block-size", "vocab-size"}) {
      if (a.given(f)) {
        SG_CHECK(a.i64(f) == of(cfg_, f), "train: --", f, " ", a.i64(f), " does not match ", source, " (", of(cfg_, f), ")");
      } else if (a.given("model") && std::string(f) != "block-size" && std::string(f) != "vocab-size") {
        // the preset's shape; its block size may have grown with --seq-len, and --seq-len is
        // checked against what is loaded anyway
        SG_CHECK(of(preset, f) == of(cfg_, f), "train: --model ", a.str("model"), " (", f, " ", of(preset, f),
                 ") does not match ", source, " (", of(cfg_, f), ")");
      }
    }
    cfg_.dropout = a.f64("dropout");
  };
  if (ck) {
    cfg_ = config_from_metadata(ck->metadata(), ck->path());
    refuse_unknown_tensors(*ck, cfg_);
    agree("the checkpoint " + ck->path());
  } else if (!a.str("init-from").empty()) {
    SG_CHECK(!std::filesystem::is_directory(a.str("init-from")), "train: --init-from ", a.str("init-from"), " is a folder: ",
             "it takes one .safetensors file (a Hugging Face GPT-2's, or what shardgrad export writes); a checkpoint ",
             "folder goes on with --resume, or starts another run once exported (shardgrad export DIR --out FILE)");
    // the header's shapes: the tensors are read once the model says which it holds
    const io::SafetensorsFile f = io::load_safetensors(a.str("init-from"), [](const std::string&) { return false; });
    cfg_ = nn::config_from_hf(f, a.i64("n-head"));
    agree("--init-from " + a.str("init-from"));
  } else {
    cfg_ = model_config(a, train_->vocab_size());
  }
  // Token shards of another tokenizer (their ids are uint16: up to 65536) take the model's
  // vocabulary, smaller or larger; other data refuses a smaller one.
  if (cfg_.vocab_size < train_->vocab_size() || (io::is_shard_spec(data_opt_.spec) && cfg_.vocab_size != train_->vocab_size())) {
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
  // --eval-batches of a file read in order are consecutive batches: fewer tokens than they need
  // would wrap around and count one batch several times
  if (!data_opt_.shuffle && !io::is_generated_spec(data_opt_.spec)) {
    const int64_t nb = a.i64("eval-batches");
    try {
      val_->check_batch(B_ * nb, T_);
    } catch (const Error&) {
      throw Error(str("train: --eval-batches ", nb, " of ", B_, " x ", T_, " tokens need ", B_ * nb * T_ + 1,
                      " held-out tokens in order, more than --data ", data_opt_.spec, "'s val split holds: give ",
                      "fewer --eval-batches (or --shuffle, which draws the rows)"));
    }
  }
  // The schedule's flags before the layer split, which --virtual-stages changes.
  if (pp_ > 1) {
    const int v = int(positive(a, "virtual-stages"));
    parallel::pp::check_schedule(a.str("pp-schedule"), v);
    const int64_t m = (B_ / dp_size_) / micro_;
    SG_CHECK(a.str("pp-schedule") != "interleaved" || v == 1 || m % pp_ == 0, "train: --pp-schedule interleaved needs ",
             "the micro-batches per step to be a multiple of --pp ", pp_, ", but ", B_ / dp_size_, " rows per rank",
             dp_size_ > 1 ? str(" (--batch-size ", B_, " over ", dp_size_, " data-parallel ranks)") : str(" (--batch-size)"),
             " in micro-batches of ", micro_, " (--micro-batch-size", a.i64("micro-batch-size") ? "" : " 0: chosen", ") are ",
             m);
  }
  // The mesh, refused before any work when it does not fit the model and the batch.
  cfg_.tp = tp_;  // the vocabulary's padding follows the split (nn::padded_vocab_rows)
  comm::MeshPlan mesh = comm::validate_mesh(world_size_, tp_, pp_, cfg_.n_head, cfg_.n_layer, cfg_.vocab_rows(), B_, micro_);
  if (tp_ > 1 || pp_ > 1) {
    // Model parallelism composes with data parallelism over the mesh's dp axis: the rows are split
    // over dp, and DDP, ZeRO-1/2 or the FSDP family (all of it) reduce over dp only.
    SG_CHECK(mesh.mesh.dp() == 1 || strategy_ != "single", "train: --tp ", tp_, " x --pp ", pp_, " on ", world_size_,
             " ranks leaves dp = ", mesh.mesh.dp(),
             ": the data-parallel replicas need a --strategy (ddp, zero1, zero2, zero3, fsdp, hsdp or no-shard)");
  }
  if (tp_ > 1) {
    cfg_.sequence_parallel = a.on("sequence-parallel");
    SG_CHECK(!cfg_.sequence_parallel || T_ % tp_ == 0, "train: --sequence-parallel: ",
             a.i64("seq-len") ? str("--seq-len ", T_) : str("rows of ", T_, " tokens (", dynamic_cast<const io::SyntheticDataset*>(train_.get()) ? "the synthetic task's problem length" : "the block size", "; no --seq-len given)"),
             " do not split over --tp ", tp_, (T_ + tp_ - 1) / tp_ * tp_ <= cfg_.block_size
                 ? str(": give --seq-len ", (T_ + tp_ - 1) / tp_ * tp_, " (a multiple of ", tp_, ")")
                 : str(": give a --seq-len that is a multiple of ", tp_));
    cfg_.validate();
  }
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
  // A pipeline rank builds the model on a meta device of its own (no memory, a ledger apart) and
  // gives memory to its stages' parameters alone: it never holds the whole model.
  std::optional<parallel::pp::Schedule> sched;
  if (pp_ > 1) sched = parallel::pp::make_schedule(a.str("pp-schedule"), pp_, int((B_ / dp_size_) / micro_), v);
  // A pipeline rank gives memory to its stages' parameters alone; the FSDP family to one unit at a
  // time, as it shards them (fsdp_options): neither ever holds the whole model.
  const bool staged = sched || zero_stage() == 3;
  resuming_ = ck != nullptr;
  refuse_what_cannot_fit();
  try {
    model_ = std::make_unique<nn::GPT>(cfg_, dtype_, staged ? staging_device() : device_, tp_ > 1 ? groups_.tp : nullptr);
    if (sched && zero_stage() != 3)
      for (auto& [n, p] : model_->named_parameters())
        if (parallel::pp::holds_parameter(*sched, groups_.pp->rank(), n, cfg_.n_layer)) nn::materialize(p, device_);
  } catch (const Error& e) {  // out of memory, most likely: say for what, with the flags that size it
    throw Error(str("train: the model's ", cfg_.num_params(), " parameters (", cfg_.n_layer, " layers, width ",
                    cfg_.n_embd, ", vocab ", cfg_.vocab_size, ")", sched ? str(", its stages' on this rank,") : "",
                    " in ", dtype_name(dtype_), " on ", device_.str(), " do not fit: ", e.what()));
  }
  model_->recompute = nn::parse_recompute(a.str("recompute"));
  if (ck) {
    load_parameters(*ck);
  } else if (!a.str("init-from").empty()) {
    load_hf_state(*model_, io::load_safetensors(a.str("init-from"), nn::hf_tensors_held(*model_)));
  } else {
    model_->init_weights(seed_);
  }
  if (sched) pipe_ = std::make_unique<parallel::pp::PipelineExecutor>(*model_, *sched, groups_.pp);
}

bool Trainer::offload_state() const {
  const std::string off = args_.str("offload");
  SG_CHECK(off == "none" || off == "optimizer" || off == "params", "train: --offload must be none, optimizer or params, got '",
           off, "'");
  SG_CHECK(off == "none" || device_ != Device::cpu(0), "train: --offload ", off, " moves state from the compute device ",
           "to the host (cpu:0): give a compute device (--device cuda:N, or cpu:1 on a CPU machine)");
  return off != "none";
}

void Trainer::build_optimizer() {
  const Args& a = args_;
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
    if (offload_state()) z.offload_optimizer = host_device();
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
    dp_ = std::make_unique<parallel::DataParallel>(*model_, dp_devices_);
  }
  sched_.kind = a.str("lr-schedule");
  sched_.lr = a.str("lr") != "auto"  ? a.f64("lr")
              : synthetic_data(a)      ? kSyntheticLr
                                       : optim::default_peak_lr(cfg_.non_embedding_params());
  sched_.min_lr = a.f64("min-lr");
  sched_.warmup_steps = a.i64("warmup-steps");
  sched_.total_steps = steps_;
  sched_.decay_steps = a.i64("decay-steps");
  sched_.validate();
  dropout_generator() = DropoutGenerator::seeded(seed_ ^ 0xd50b5eedull);
}

// Every rank opened its checkpoint on its own, before the world was joined (--resume auto takes
// the newest step each one sees): they must have found the same step, or none alike.
void Trainer::agree_on_resumed_step(const ckpt::Checkpoint* ck) {
  if (!metrics_ || world_size_ == 1 || sim_) return;
  int64_t mine = 0;
  if (ck && ck->state().contains("step")) {
    const auto& st = ck->state()["step"];
    SG_CHECK(st.is_number_integer(), "train: checkpoint ", ck->path(), ": its training state is malformed: step is ",
             st.dump(), ", not an integer");
    mine = st.get<int64_t>();
  }
  Tensor t = from_vector<int64_t>({mine, -mine}, {2});
  metrics_->all_reduce(t, comm::ReduceOp::max)->wait();
  const std::vector<int64_t> v = to_vector<int64_t>(t);
  SG_CHECK(v[0] == -v[1], "train: the ranks resume from different steps (", -v[1], " to ", v[0], "; this rank from ",
           ck ? str("step ", mine, ", ", ck->path()) : std::string("none"), "): they do not see the same checkpoints "
           "(a --save or --resume folder not on a shared filesystem, or one still being written)");
}

void Trainer::restore(const ckpt::Checkpoint* ck) {
  const Args& a = args_;
  agree_on_resumed_step(ck);
  if (ck) {
    const json& s = ck->state();
    int64_t optimizer_step = 0;
    try {  // a hand-edited or foreign manifest: the file and nlohmann's words for the field
      start_step_ = s.at("step").get<int64_t>();
      // Saved before 2026-11-29, a row-drawing source's position counted batches of the run's
      // --batch-size, which resume inherits (B_ here, unless given again).
      const int64_t position = s.at("train_position").get<int64_t>();
      train_->set_position(train_->draws_rows() && !s.contains("train_position_in_rows") ? position * B_ : position);
      dropout_generator().next_stream = s.at("dropout_stream").get<uint64_t>();
      // The scaler goes on where an fp16 run left it (a fixed scale stays fixed); a run without one
      // (bf16, fp32) left none, and an fp16 resume of it starts from the flags, as a new run would.
      if (s.value("dtype", std::string(dtype_name(DType::f16))) == dtype_name(DType::f16)) {
        const double saved = s.value("loss_scale", scaler_.scale);
        if (!a.f64("loss-scale")) {
          const auto& inh = a.inherited();
          const bool typed = a.given("initial-loss-scale") &&
                             std::find(inh.begin(), inh.end(), "initial-loss-scale") == inh.end();
          if (typed && saved != scaler_.scale && lead())
            std::printf("note: the checkpoint's loss scale %g goes on (--initial-loss-scale %g starts a new run's)\n",
                        saved, scaler_.scale);
          scaler_.scale = saved;
        }
        scaler_.clean_steps = s.value("loss_scale_clean_steps", int64_t(0));
        scaler_.skipped_steps = s.value("skipped_steps", int64_t(0));
      }
      nonfinite_skipped_ = s.value("nonfinite_skipped", int64_t(0));
      optimizer_step = s.at("optimizer_step").get<int64_t>();
    } catch (const json::exception& e) {
      throw Error(str("train: checkpoint ", ck->path(), ": its training state is malformed: ", e.what()));
    }
    SG_CHECK(start_step_ <= steps_, "train: the checkpoint is at step ", start_step_, " but --steps is ", steps_);
    SG_CHECK(!stop_at_ || stop_at_ > start_step_, "train: --stop-at ", stop_at_, " is not after the checkpoint's step ",
             start_step_, ": nothing to train (give a later step, or leave --stop-at out)");
    // Nor would a fault or a profile at a step the checkpoint is past ever happen.
    SG_CHECK(!fault_.active() || (fault_.during == "load" ? fault_.step == start_step_ : fault_.step > start_step_),
             "train: --inject-fault step=", fault_.step, fault_.during == "load" ? ",during=load: the run resumes the "
             "checkpoint of step " : ": the run resumes after the checkpoint's step ", start_step_, ", so it would never fire");
    SG_CHECK(!a.i64("profile-ops") || a.i64("profile-ops") > start_step_, "train: --profile-ops ", a.i64("profile-ops"),
             ": the run resumes after the checkpoint's step ", start_step_, ", so that step is not run");
    parallel::watchdog::beat("the checkpoint load", start_step_ - 1);  // a stall is named at the checkpoint's step
    load_optimizer(*ck, optimizer_step);
    parallel::maybe_inject_in_load(fault_, rank_, start_step_);  // testing: this rank's pieces read
    if (lead()) {
      std::string flags;
      for (const std::string& f : a.inherited()) flags.append(" ").append(a.spelled(f));
      std::printf("resumed from %s at step %lld%s\n", ck->path().c_str(), (long long)start_step_,
                  flags.empty() ? "" : (", with the run's" + flags).c_str());
      if (!a.str("init-from").empty())
        std::printf("--init-from %s is not read: the run goes on from its checkpoint\n", a.str("init-from").c_str());
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
  SG_CHECK(a.i64("keep") >= 0 && a.i64("keep") <= INT_MAX, "train: --keep must be in [0, ", INT_MAX, "] (0 = all), got ",
           a.i64("keep"));
  if (save_dir_.empty()) return;
  // What would stop the run at its first save is refused before the first step.
  namespace fs = std::filesystem;
  SG_CHECK(!fs::exists(save_dir_) || fs::is_directory(save_dir_), "train: --save ", save_dir_,
           " is a file, not a run directory");
  {
    std::error_code ec;
    fs::create_directories(save_dir_, ec);
    SG_CHECK(fs::is_directory(save_dir_), "train: --save ", save_dir_, ": cannot create it (", ec.message(), ")");
    SG_CHECK(::access(save_dir_.c_str(), W_OK | X_OK) == 0, "train: --save ", save_dir_, ": cannot write there (",
             std::strerror(errno), ")");
  }
  // Another run's checkpoints would mix with this one's (and --keep would delete them): a folder
  // that holds any is refused unless the checkpoint resumed came from it.
  std::error_code same_ec;
  const bool own = ck && fs::equivalent(fs::path(ck->path()).parent_path(), save_dir_, same_ec);
  if (!own && (fs::exists(fs::path(save_dir_) / "latest") || !ckpt::step_dirs(save_dir_).empty())) {
    throw Error(str("train: --save ", save_dir_, " already holds a run; choose another directory or --resume it"));
  }
  // Saves a failed run left unfinished (.tmp-step_...: never committed, never read) go, once this
  // run owns the folder; on a large model each can hold gigabytes.
  if (lead()) {
    std::error_code ec;
    std::vector<fs::path> unfinished;  // listed first: removing while iterating is unspecified
    for (const auto& e : fs::directory_iterator(save_dir_, ec))
      if (e.path().filename().string().rfind(".tmp-step_", 0) == 0) unfinished.push_back(e.path());
    int64_t removed = 0;
    for (const fs::path& u : unfinished) removed += fs::remove_all(u, ec) > 0;
    if (removed)
      std::printf("removed %lld unfinished save%s from %s (.tmp-step_...)\n", (long long)removed, removed > 1 ? "s" : "",
                  save_dir_.c_str());
  }
  // A run resumed from an earlier step of its own directory would meet the later steps'
  // checkpoints: the run it rewinds, which `--resume auto` (the newest step) would go back to.
  for (const auto& [step, dir] : ckpt::step_dirs(save_dir_)) {
    if (step <= start_step_) continue;
    const std::string damage = ckpt::checkpoint_files_problem(dir.string());
    SG_CHECK(!damage.empty(), "train: --save ", save_dir_, " already holds ", dir.filename().string(),
             ", later than the step this run resumes at (", start_step_, "): its checkpoints would mix with that "
             "run's, and --resume auto would go back to the newest; checkpoints are never overwritten: give another "
             "--save, move the later steps away, or resume the newest (--resume auto)");
    if (step > steps_ || !saves_after(step)) continue;  // damaged, but not saved again by this run
    // A damaged step (a file lost after its save) is kept, under another name, and saved again:
    // a launch restart goes on by itself. The other ranks leave it to the lead.
    if (!lead()) continue;
    fs::path aside = dir;
    aside += ".damaged";
    for (int k = 2; fs::exists(aside); ++k) (aside = dir) += ".damaged." + std::to_string(k);
    std::error_code ec;
    fs::rename(dir, aside, ec);
    SG_CHECK(!ec, "train: cannot move the damaged ", dir.string(), " (", damage, ") to ", aside.string(), ": ",
             ec.message(), "; move it away to save that step again");
    std::printf("moved the damaged %s (%s) to %s: this run saves that step again\n", dir.string().c_str(),
                damage.c_str(), aside.filename().string().c_str());
  }
}

void Trainer::start_trace() {
  const Args& a = args_;
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
  if (offload_state()) {
    o.offload_optimizer = host_device();  // params: the parameter shards as well
    o.offload_params = a.str("offload") == "params";
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
  // The model was built on the staging device: each unit is given memory and its values (the seed's,
  // or --init-from's tensors of the unit alone) one at a time. Resumed, its shards are then read
  // from the checkpoint (load_state): the unit is neither initialised nor broadcast.
  o.materialize_on = device_;
  o.broadcast_from_rank0 = !resuming_;  // a resumed unit holds nothing yet: its shards are read
  o.init = [this](const io::NamedTensors& unit) {
    if (resuming_) return;
    if (const std::string file = args_.str("init-from"); !file.empty()) {
      std::set<std::string> names;
      for (const auto& [n, p] : unit) names.insert(n);
      nn::load_hf_state(*model_, io::load_safetensors(file, nn::hf_tensors_of(names)),
                        [&](const std::string& n) { return names.count(n) != 0; });
    } else {
      for (const auto& [n, p] : unit) model_->init_parameter(n, p, seed_);
    }
  };
  return o;
}

}  // namespace sg::cli
