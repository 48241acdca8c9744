// The planner: what a layout costs before it runs — memory per GPU by category, bytes per step per
// collective kind and link class, the pipeline bubble, step time, MFU, and whether it fits.
//
// Model states (bytes per rank; d = bytes of the training dtype, E = elements this rank's
// tensor/pipeline shard holds, N = data-parallel degree), after ZeRO (Rajbhandari et al.):
//   params d·E, grads d·E, optimizer 8·E (AdamW m, v in f32) + 4·E f32 master weights when d < 4
//   (K = 12 in mixed precision: 2Ψ + 2Ψ + 12Ψ), the sharded ones divided by N as the engine pads
//   them: zero1 optimizer ⌈E/N⌉; zero2 also grads; zero3/fsdp everything, ⌈Eu/N⌉ per unit
//   (a unit per block plus a root unit of embeddings and ln_f). "grad" is what the optimizer step
//   sees (for zero2/3 the persistent shard, not the transient full gradients).
// Activations per layer and micro-batch (Korthikanti et al., "Reducing Activation Recomputation in
// Large Transformer Models", 2-byte activations, scaled by d/2 here): s·b·h·(34 + 5·a·s/h) without
// tensor parallelism; s·b·h·(10 + 24/t + 5·a·s/(h·t)) with it; s·b·h/t·(34 + 5·a·s/h) with sequence
// parallelism; selective recompute drops the 5·a·s²·b attention term; full recompute keeps 2·s·b·h
// (/t with sequence parallelism). A pipeline rank holds as many micro-batch·chunk activations as
// the simulated schedule has in flight on it (parallel/pp/schedule.h), each L/(p·v) layers.
// Communication (bytes one rank puts on the wire per step, counted as ProcessGroup counts them):
//   ddp 2(N-1)/N·dE all-reduce; zero1/2 (N-1)/N·dEp reduce-scatter + the same all-gather;
//   zero3/fsdp per micro-batch 2·(N-1)/N·dEp all-gather + (N-1)/N·dEp reduce-scatter (3Ψ);
//   tensor parallelism 4 all-reduces of b·s·h·d per layer and micro-batch (or with sequence
//   parallelism 4 all-gathers + 4 reduce-scatters, the same bytes); the pipeline one b·s·h·d send
//   per stage boundary and micro-batch each way.
// Time: model FLOPs per token 6·(Ψ − wpe) + 12·L·s·h (plus the recomputed forward), at
// efficiency × peak; the pipeline adds the bubble (p−1)/(v·m) of the schedule; communication time
// is bytes / the bandwidth of the link class its group spans, partly hidden behind backward where
// the strategy overlaps it (never a pipeline's once-a-step reductions, which follow its schedule).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sg::report {

struct ModelShape {
  std::string name = "custom";
  int64_t n_layer = 0, n_head = 0, n_embd = 0, seq_len = 0, block_size = 0, vocab_size = 0;
  int64_t params = 0;  // a raw parameter count: used when the shape is not known (n_layer == 0)
  bool has_shape() const { return n_layer > 0; }
  int64_t vocab_rows(int64_t tp = 1) const;  // wte's rows, padded as nn::GPTConfig pads them
  int64_t num_params() const;                                         // Ψ
};
// A GPT-2 preset (tiny, gpt2, ..., gpt2-xl) with seq_len = block_size.
ModelShape model_preset(const std::string& name);

struct Cluster {
  std::string name = "custom";
  int gpus_per_node = 8, nodes = 1;
  double gpu_memory = 80e9;        // bytes per GPU
  double intra_bandwidth = 450e9;  // bytes/s one GPU sends inside a node
  double inter_bandwidth = 50e9;   // bytes/s one GPU sends across nodes
  double peak_flops = 989e12;      // per GPU, in the training dtype
  double host_bandwidth = 25e9;    // bytes/s to host memory (offload)
  double efficiency = 0.5;         // achieved fraction of peak_flops in the model's compute
};
// 8xH100-NVLink-IB, 8xH200-NVLink-IB, 8xA100-NVLink-IB, cpu-local. Throws naming the choices.
Cluster cluster_preset(const std::string& name);

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  bool sequence_parallel = false;
  std::string strategy = "ddp";  // ddp | zero1 | zero2 | zero3 | fsdp | fsdp-grad-op | hsdp
  int shard_group_size = 0;      // hsdp: dp ranks per shard group (train's --shard-group-size); 0 = a node's
  std::string pp_schedule = "1f1b";
  int virtual_stages = 1;
  std::string recompute = "none";  // none | selective | full
  std::string offload = "none";    // none | optimizer | params
  // zero2 and the fsdp family over several micro-batches: sharded (each micro-batch reduce-scatters
  // into the shard) or unsharded (no_sync: full gradients accumulate, one reduction a step); zero2
  // under a pipeline or sequence parallelism always reduces once, unsharded; the fsdp family
  // under a pipeline only sharded (train's --grad-accumulation).
  std::string grad_accumulation = "sharded";
  // Whether zero2 reduce-scatters every micro-batch (see grad_accumulation).
  bool reduces_every_micro_batch() const {
    return strategy == "zero2" && grad_accumulation == "sharded" && pp == 1 && !sequence_parallel;
  }
  int64_t micro_batch_size = 1;
  std::string label() const;  // "dp2 tp2 pp1 zero2 mb4 ..."
};

struct PlanInput {
  ModelShape model;
  Cluster cluster;
  Layout layout;
  int64_t global_batch = 8;
  std::string dtype = "bf16";        // fp32 | bf16 | fp16
  int64_t bucket_bytes = 25ll << 20;  // ddp bucket / zero stripe (buffers estimate)
};

struct RankMemory {
  int64_t param = 0, grad = 0, optim_state = 0;  // model states, bytes
  double activation = 0, buffers = 0;            // estimates, bytes
  double total() const { return double(param + grad + optim_state) + activation + buffers; }
};

struct Plan {
  PlanInput input;
  int world = 1, nodes_used = 1;
  int64_t micro_batches = 1;            // per data-parallel rank per step
  int shard_group = 1;                  // the dp ranks that share the sharded states (hsdp: one group)
  std::vector<RankMemory> per_stage;    // one per pipeline rank (all dp/tp ranks of a stage alike)
  RankMemory worst;                     // the pipeline rank with the most bytes
  std::map<std::string, int64_t> comm;  // per collective kind, bytes pipeline rank 0 sends per step
  double intra_bytes = 0, inter_bytes = 0;  // per step, the busiest rank, by link class
  double bubble = 0;                        // idle over busy time of the schedule
  double compute_s = 0, comm_exposed_s = 0, step_s = 0, tokens_per_s = 0, mfu = 0;  // 0 where not timed()
  double model_flops_per_token = 0;
  bool fits = false;
  // A step's compute needs the tokens a row: a model's shape, or a raw count's --seq-len.
  bool timed() const { return input.model.has_shape() || input.model.seq_len > 0; }
  std::vector<std::string> notes;
  nlohmann::json to_json() const;
};

// zero3 and the FSDP family: the parameters are sharded (only each unit's shard kept between steps).
bool shards_params(const std::string& strategy);

// The planner's limits. Past them its int64 byte counts could overflow (8·micro-batches·4Ψ for
// the FSDP family's gathers, 40·tokens·width·layers for tp's) or the simulated schedule, one
// action at a time, would run for minutes. plan refuses a flag beyond them by name.
constexpr int64_t kMaxRanks = int64_t(1) << 20;   // dp, tp, pp, virtual stages, nodes, GPUs per node, and products
constexpr int64_t kMaxLayers = 100000;
constexpr int64_t kMaxWidth = int64_t(1) << 20;   // n_embd
constexpr int64_t kMaxVocab = int64_t(1) << 30;
constexpr int64_t kMaxBlock = int64_t(1) << 24;   // block size (and so the sequence length)
constexpr int64_t kMaxParams = int64_t(1) << 43;  // Ψ, about 8.8e12
constexpr int64_t kMaxMicroBatches = int64_t(1) << 16;   // per rank and step
constexpr int64_t kMaxScheduleActions = int64_t(1) << 20;  // pp × virtual stages × micro-batches
constexpr double kMaxTokenWork = 0x1p54;  // tokens per step × width × layers

// Throws sg::Error naming the flag when the model, the batch or the cluster is beyond the limits
// above, or the model has no parameters. make_plan checks it first; search_plans too, before it
// tries any layout (else every candidate would be refused and the search would find none).
void check_input(const PlanInput& in);

// Throws sg::Error naming the reason when the layout is impossible (heads that do not split,
// layers that do not divide into stages, a batch that does not split, too few GPUs, ...).
Plan make_plan(const PlanInput& in);
// Every layout of the cluster's GPUs (dp × tp × pp = all of them, tp within a node) over the
// strategies, schedules, recompute modes and micro-batch sizes that fit, fastest first.
std::vector<Plan> search_plans(const PlanInput& base);

// A human-readable report of one plan (what `shardgrad plan` prints).
std::string describe(const Plan& p);

}  // namespace sg::report
