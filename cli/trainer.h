// The trainer behind `shardgrad train`: one rank's training run, whatever the layout.
//   trainer_setup.cpp       the run's flags -> world, device, data, model, optimizer, resumed state
//   trainer.cpp             the step loop, one training step, evaluation, the progress line
//   trainer_checkpoint.cpp  this rank's pieces of a sharded checkpoint, and reading them back
//   simulate.cpp            --simulate N: N Trainers as threads on the meta device
#pragma once

#include <nlohmann/json.hpp>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/args.h"
#include "io/dataset.h"
#include "io/multiple_choice.h"
#include "models/gpt.h"
#include "optim/loss_scaler.h"
#include "optim/nonfinite.h"
#include "optim/optim.h"
#include "parallel/comm/mesh.h"
#include "parallel/comm/sim_backend.h"
#include "parallel/ddp.h"
#include "parallel/dp.h"
#include "parallel/fsdp.h"
#include "parallel/pp/executor.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/watchdog.h"
#include "parallel/zero.h"

namespace sg::cli {

// "1.50 GiB", "12.0 MiB", "3.0 KiB", "17 B".
std::string human_bytes(int64_t b);
// The device's ledger: {category: {"current", "peak"}, "total": {...}}.
nlohmann::json ledger_json(Device d);

// The flags that say what a run trains on and how it learns (trainer_checkpoint.cpp). A checkpoint
// records those its run was given; --resume takes them where the command line does not.
void inherit_run_flags(Args& a, const ckpt::Checkpoint* ck);
// The checkpoint --resume names (nullptr for `--resume auto` before the first save).
std::unique_ptr<ckpt::Checkpoint> resume_checkpoint(const Args& a);
// False in every process but the first of an mpirun (OMPI_COMM_WORLD_RANK) or a launcher's
// (RANK) job: for notes printed before the world is joined.
bool first_launched_rank();
// The model config a checkpoint records; `where` names it in errors.
nn::GPTConfig config_from_metadata(const std::map<std::string, std::string>& m, const std::string& where);
// Resume is strict, as PyTorch's load_state_dict: a tensor in the checkpoint that is neither one of
// the model's parameters nor their optimizer state (.exp_avg, .exp_avg_sq, .master) is refused,
// naming it, rather than ignored. (Missing tensors are refused where they are read.)
void refuse_unknown_tensors(const ckpt::Checkpoint& ck, const nn::GPTConfig& c);

// --simulate N (simulate.cpp).
int simulate_main(const Args& a);

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
  nlohmann::json simulate(int64_t steps);

 private:
  // setup, in order (trainer_setup.cpp); each stage refuses bad flags by name before any work.
  void setup();
  void configure();               // threads, strategy and the flags that apply to it, backend, rendezvous
  void configure_loss_scaling();  // fp16: --initial-loss-scale, --loss-scale-window, ... into scaler_
  double peak_flops() const;      // --peak-tflops for all the devices the run trains on, in FLOP/s (0: no MFU)
  void join_world();              // the ranks' world: MPI, NCCL over MPI or a file, or --simulate's threads
  void choose_device_and_batch(); // device, dtype, batch and micro-batch, steps
  void open_data();
  void build_model(const ckpt::Checkpoint* ck);  // config, mesh groups, weights, pipeline
  void refuse_what_cannot_fit() const;  // a layout this machine's memory could never hold, before building it
  void configure_samples();       // --sample-tokens, --tokenizer: what the samples decode with
  void configure_hellaswag();     // --hellaswag's examples, read and checked against the vocabulary
  void build_optimizer();         // masters, AdamW / ZeRO / FSDP, DDP or dp, the schedule
  void restore(const ckpt::Checkpoint* ck);      // the resumed step's state; --save's directory
  void agree_on_resumed_step(const ckpt::Checkpoint* ck);  // every rank resumes the same step, or refuses
  void start_trace();
  parallel::FsdpOptions fsdp_options() const;

  // one step (trainer.cpp)
  double train_step(int64_t step, double lr, double& grad_norm, bool& applied);
  double pipeline_step(int64_t step, const Tensor& idx, const Tensor& tgt, int64_t counted, double loss_scale, double lr,
                       double& grad_norm, bool& applied);
  // The global gradient norm when the model is split over tp x pp: tp-split parameters sum over
  // the tp group, replicated ones count once (tp rank 0), the tied embedding once (first stage).
  double model_parallel_grad_norm();
  bool accept_step(int64_t step, double loss, double grad_norm);
  // Sum over the data-parallel ranks of each one's share of the global batch's mean loss.
  double dp_loss(double share) { return dp_sums({share})[0]; }
  std::vector<double> dp_sums(std::vector<double> shares);  // element-wise over the data-parallel ranks
  // This rank's share of n evaluation items (held-out batches, HellaSwag examples): items dp_rank,
  // dp_rank + dp, ..., run by the replica's tp/pp ranks together. Under zero3/fsdp a forward gathers
  // over the data-parallel ranks, so a rank whose share is shorter than `most` then runs forwards
  // that count nothing until it has made as many as the others.
  struct EvalShare {
    std::vector<int64_t> items;
    int64_t most = 0;  // the longest share's length
  };
  EvalShare eval_share(int64_t n) const;
  double world_sum(double x);  // over every rank (metrics group)
  // With --save, SIGUSR1, SIGTERM and SIGINT ask the run to stop: the signal this rank or any other has
  // received (0: none), agreed over the ranks after every step so that all stop at the same one.
  int agreed_stop_signal();
  nlohmann::json evaluate(int64_t step);
  // The whole vocabulary's logits of idx [B, n] on the host (or the device), every rank of a model
  // replica calling it in lockstep: the pipeline's last stage sends them to every stage, tp's slices
  // are gathered. Under sequence parallelism idx is padded at its end to a multiple of tp first
  // (causal attention: no position before the padding sees it), so any length runs.
  Tensor eval_logits(const Tensor& idx, bool on_host = true);
  // --hellaswag: {"accuracy" (lowest mean loss, llm.c's and acc_norm), "accuracy_sum" (lowest
  // summed loss), "correct", "examples", "per_rank" (the examples each data-parallel rank
  // scored), "seconds"}; every rank scores its share (eval_share), the sums are over dp.
  nlohmann::json hellaswag();
  // --sample-tokens tokens drawn after the held-out split's first ones: {"sample_prompt",
  // "sample", "sample_ids"}, the same on every rank of the replica (same logits, same draws).
  nlohmann::json sample(int64_t step);
  int64_t sample_prompt_length() const;  // the tokens sample() reads from the held-out split
  void write_timeline();
  std::string layout_label() const;  // "zero3 x 4", "tp 2 x pp 2 (4 ranks)", ...

  // checkpoints (trainer_checkpoint.cpp)
  void save(int64_t next_step);
  std::vector<ckpt::Piece> state_pieces() const;
  ckpt::LocalView view_of(const std::string& name, const Shape& local_shape) const;
  void load_parameters(const ckpt::Checkpoint& ck);
  void load_optimizer(const ckpt::Checkpoint& ck, int64_t optimizer_step);
  // The data as a checkpoint records it: a file or glob made absolute, so that a resume or generate
  // started in another folder reads the same files.
  std::string saved_data_spec() const {
    const std::string& d = data_opt_.spec;
    return io::is_generated_spec(d) ? d : std::filesystem::absolute(d).lexically_normal().string();
  }

  // What this rank is and holds.
  bool lead() const { return rank_ == 0; }
  // Whether the run saves a checkpoint after step n (1-based): --save, at every --save-every and
  // at the last step.
  bool saves_after(int64_t n) const {
    const int64_t every = args_.i64("save-every");
    return !args_.str("save").empty() && (n == steps_ || n == stop_at_ || (every > 0 && n % every == 0));
  }
  // Where --offload puts its state: the host, or under --simulate a meta device of the rank's own
  // standing for it (a ledger apart from the rank's compute device's, and no memory).
  Device host_device() const { return sim_ ? Device::meta((1 << 20) + rank_) : Device::cpu(0); }
  // Where a pipeline rank builds its model before materialising its stages' parameters on the
  // compute device, and an FSDP-family rank before its wrapper gives memory to one unit at a time:
  // a meta device of its own (a ledger that no report reads).
  Device staging_device() const { return Device::meta((2 << 20) + rank_); }
  // The model's parameters this rank holds: all of them, or under --pp its stages'.
  io::NamedTensors held_parameters() const { return pipe_ ? pipe_->parameters() : model_->named_parameters(); }
  // bf16/f16 without ZeRO: the f32 masters take the held parameters' half gradients as they are.
  void take_half_gradients() {
    const io::NamedTensors params = held_parameters();
    for (size_t i = 0; i < params.size(); ++i) master_[i].second.set_grad(params[i].second.grad());
  }
  // Every rank evaluates: the held-out batches and the HellaSwag examples are split over the
  // data-parallel ranks (eval_share), as llm.c splits them. The prompts (task accuracy, samples)
  // run the whole model on rank 0; under tp/pp on every rank of the first data-parallel replica,
  // under zero3/fsdp on every rank (the forward is collective there). Rank 0 reports.
  bool runs_prompts() const {
    if (fsdp_) return true;
    if (tp_ > 1 || pp_ > 1) return groups_.coord.dp == 0;
    return lead();
  }
  // --offload optimizer|params: whether the optimizer state goes to the host (checked: a value
  // it knows, and a compute device other than the host).
  bool offload_state() const;
  bool distributed() const { return strategy_ == "ddp" || zero_stage() > 0 || tp_ > 1 || pp_ > 1; }
  // zero3 and the FSDP family all shard the parameters (stage 3's memory and more or less of its traffic).
  bool fsdp_family() const {
    return strategy_ == "zero3" || strategy_ == "fsdp" || strategy_ == "fsdp-grad-op" || strategy_ == "hsdp" ||
           strategy_ == "no-shard";
  }
  int zero_stage() const { return strategy_ == "zero1" ? 1 : strategy_ == "zero2" ? 2 : fsdp_family() ? 3 : 0; }
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
  static int local_rank() {  // this rank's place on its node, from the launcher
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"})
      if (const char* s = std::getenv(v)) return std::atoi(s);
    return 0;
  }

  const Args& args_;
  std::unique_ptr<ckpt::Checkpoint> resumed_;  // until setup takes it
  std::shared_ptr<comm::SimProcessGroup> sim_;
  // the run
  Device device_;
  std::vector<Device> dp_devices_;  // --strategy dp: the replicas' devices, device_ first
  DType dtype_ = DType::f32;
  io::DataOptions data_opt_;
  std::unique_ptr<io::Dataset> train_, val_;
  int64_t sample_tokens_ = 0, sample_vocab_ = 0;  // --sample-tokens; ids that may be drawn
  std::function<std::string(const std::vector<int64_t>&)> sample_decode_;  // the data's, or --tokenizer's
  std::vector<io::ChoiceExample> choices_;  // --hellaswag's examples
  nn::GPTConfig cfg_;
  std::unique_ptr<nn::GPT> model_;
  io::NamedTensors master_;  // what the optimizer updates: the params (f32) or f32 copies (bf16/f16)
  std::unique_ptr<optim::AdamW> opt_;
  optim::LrSchedule sched_;
  optim::LossScaler scaler_;
  // zero2 accumulating in the shard (--grad-accumulation sharded): every micro-batch reduces.
  bool shard_accumulation_ = false;
  // the fsdp family accumulating unsharded (--grad-accumulation unsharded, FSDP's no_sync): only
  // the last micro-batch reduces.
  bool fsdp_no_sync_ = false;
  int64_t B_ = 0, T_ = 0, micro_ = 0, steps_ = 0, start_step_ = 0, stop_at_ = 0;  // stop_at_: --stop-at, 0 = none
  uint64_t seed_ = 0;
  std::string save_dir_;
  parallel::Fault fault_;
  bool resuming_ = false;  // the run resumes a checkpoint (whose values replace any initialisation)
  optim::NonFinitePolicy nonfinite_ = optim::NonFinitePolicy::stop;
  int64_t nonfinite_skipped_ = 0;
  bool overflowed_ = false;  // the last step was skipped for fp16 gradients that overflowed (the scaler's)
  // the layout: rows are split over dp only
  std::string strategy_ = "single";
  int rank_ = 0, world_size_ = 1;
  int tp_ = 1, pp_ = 1, dp_size_ = 1, dp_rank_ = 0;
  std::string device_spec_;  // --device, with "cuda" made cuda:<local rank> under --backend nccl
  std::shared_ptr<comm::ProcessGroup> world_, metrics_;
  comm::MeshGroups groups_;  // dp, pp, tp: this rank's groups (dp alone: the world)
  std::shared_ptr<comm::ProcessGroup> dp_metrics_, mp_metrics_;  // losses over dp; norms over tp x pp
  std::unique_ptr<parallel::DistributedDataParallel> ddp_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::unique_ptr<parallel::ZeroOptimizer> zero_;
  std::unique_ptr<parallel::FullyShardedDataParallel> fsdp_;  // zero3 and the FSDP family
  std::unique_ptr<parallel::pp::PipelineExecutor> pipe_;
};

}  // namespace sg::cli
