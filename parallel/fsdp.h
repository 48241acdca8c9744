// ZeRO stage 3 / FSDP (Rajbhandari et al., "ZeRO"; Zhao et al., "PyTorch FSDP"): parameters,
// gradients and optimizer state partitioned over the data-parallel group, in four modes.
//
// Units. A unit is a run of consecutive Blocks (one per Block, or — wrap_min_params — as many as
// it takes to reach that many parameters), plus a root unit for wte, wpe and ln_f (the tied head
// uses wte at the very end of forward and the embedding at the very end of backward, so the root
// stays gathered through both). For a model of one's own (the generic constructor) the units are
// the modules given, and the root holds every parameter outside them. A unit's parameters point,
// at their offsets, into one flat Storage of Ψu_p = S·Ns elements, S = ceil(Ψu/Ns), Ns the shard
// group's size (at most Ns-1 zero padding elements per unit). While sharded, the storage is
// released between uses (Storage::release): the only persistent copy of the parameters is this
// rank's shard, elements [r·S, (r+1)·S) of the flat vector, r this rank's place in its shard group.
//
// Modes (Ns ranks share a unit's shards; Nr = N/Ns replicas all-reduce the shard gradients):
//   full_shard     Ns = N. Gather before forward, release after it (reshard_after_forward), gather
//                  again before backward (an identity node on the unit's output), reduce-scatter
//                  from grad-ready hooks, release. all_gather 2·(N-1)/N·eΨp + reduce_scatter
//                  (N-1)/N·eΨp per micro-batch: the 3Ψ of the ZeRO paper.
//   shard_grad_op  Ns = N; units stay gathered from forward through backward (no re-gather):
//                  all_gather (N-1)/N·eΨp + reduce_scatter (N-1)/N·eΨp, ZeRO-2's 2Ψ, at the
//                  cost of every unit being gathered at the end of forward.
//   no_shard       Ns = 1, Nr = N: full replicas, each unit's gradients all-reduced (avg) once
//                  ready — DDP with one bucket per unit: all_reduce 2·(N-1)/N·eΨ.
//   hybrid (HSDP)  shards within groups of shard_group_size consecutive ranks (full_shard inside,
//                  or shard_grad_op with reshard_after_forward = false); the reduce-scattered
//                  shard gradient is then all-reduced across the Nr groups holding the same
//                  shard: shard group 3·(Ns-1)/Ns·eΨp, replicate group 2·(Nr-1)/Nr·eΨp/Ns.
// (e = bytes per element of the communicated dtype: the parameters' for gathers, reduce_dtype's
// for gradient reductions.) The communicated bytes are per micro-batch: every micro-batch gathers
// and reduces (the full gradient is never held) — unless set_sync(false) (PyTorch FSDP's
// no_sync): a unit whose gradients are ready is then released without a reduction, its
// parameters' full gradients accumulating until a backward with sync on reduces them, so the
// reductions are paid once a step for e_p·Ψ of full gradients held meanwhile.
//
// Memory per rank after the step (every unit released; Ψp = Σ Ψu_p; e_p = parameter dtype bytes,
// e_r = reduce dtype bytes):
//   param        e_p·Ψp/Ns   (the shards; no_shard: the full model, e_p·Ψ)
//   grad         e_r·Ψp/Ns   (the persistent shard gradients, in the reduce dtype)
//   optim_state  8Ψp/Ns with f32 parameters (AdamW m, v); 12Ψp/Ns with bf16/f16 parameters
//                (m, v and the f32 master shard that AdamW updates; the parameter shard is its
//                rounding)
// At peak, full_shard holds the root unit and up to limit_all_gathers Block units gathered on
// top; shard_grad_op every unit. A model built on a meta device (FsdpOptions::materialize_on,
// init) is given memory unit by unit while it is sharded: the setup's peak is the shards made so
// far plus one whole unit, never the whole model.
//
// Overlap. Collectives are asynchronous (Work handles): reductions run while backward continues
// and are collected by finish_gradients(); with forward_prefetch a unit's pre-forward issues the
// next units' all-gathers before its own compute, with backward_prefetch (full_shard) a unit's
// re-gather issues the next-in-backward units' — at most limit_all_gathers Block units hold
// gathered parameters at once (a unit about to run is always gathered).
//
// While this object lives the model's sharded parameters hold no bytes outside forward/backward:
// read them with gather_all()/release_all() or full_state_dict(). It leaves them as they are when
// it goes: gather_all() first keeps the whole parameters in the model (reading a released one is
// an error naming it).
//
// Tensor parallelism (dp × tp, the group given is the dp group): the units hold this rank's tp
// slices (a Block's ParallelAttention/ParallelMLP, the VocabParallelEmbedding's rows); every
// formula above is per tp rank, Ψ its slice count. The global norm sums
// grad_sum_squares(mesh_grad_weight(tp_rank, true)) over the whole world. With sequence
// parallelism the tp-replicated parameters' gradients (LayerNorms, row-parallel biases, wpe) are
// partial sums, each tp rank's over its own positions: the reduction over dp is linear, so
// sum_replicated_gradients(tp) sums them over tp afterwards, on the shards (every tp rank of a dp
// coordinate has the same units and segments), and the units' hooks need not wait for tp.
//
// Pipeline parallelism (dp × pp, FsdpOptions::holds): the units are this rank's stages' — runs of
// its own Blocks, "wte" alone (the tied embedding lives on the first and the last stage; the two
// ranks sum its shard gradient, tied_grad_shard(), segment for segment, since the unit is the same
// on both) and "root" (wpe on the first stage, ln_f on the last). The stages' embedding and head
// run outside GPT::forward, so the pipeline calls gather_roots() before a stage's forward; the two
// root units then stay gathered until finish_gradients(), their gradients accumulating over the
// micro-batches and reduced once (micro-batches' forwards and backwards interleave). Block units
// gather and release per action as without the pipeline under full_shard, hybrid resharding after
// forward and no_shard. Under shard_grad_op (and hybrid without resharding) a block unit too stays
// gathered from its first forward of the step to finish_gradients(), its gradients accumulating
// over the micro-batches and reduced once: all_gather and reduce_scatter (N-1)/N·eΨp a step
// whatever the micro-batch count (FSDP's reshard_after_forward = false under a pipeline), at the
// cost of the stage's parameters and their full gradients held all step. Prefetch follows
// the schedule: an action's first unit is gathered as the action begins, while it waits for the
// other stage (prefetch_action), and the next units of its chunk (a run of consecutive blocks)
// while the chunk computes; a rank's other chunks are never gathered ahead of their action.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/process_group.h"
#include "parallel/shard_state.h"
#include "parallel/zero.h"

namespace sg::parallel {

enum class FsdpMode : uint8_t { full_shard, shard_grad_op, no_shard, hybrid };
const char* fsdp_mode_name(FsdpMode m);

struct FsdpOptions {
  FsdpMode mode = FsdpMode::full_shard;
  int shard_group_size = 0;      // hybrid only: ranks per shard group (consecutive), divides N
  int64_t wrap_min_params = 0;   // 0: one unit per Block; else consecutive Blocks until >= this many
  // Unset: the mode's (full_shard and hybrid: true; shard_grad_op: false). Only hybrid may set it
  // either way (false = HSDP with ZeRO-2 inside the group).
  std::optional<bool> reshard_after_forward;
  bool forward_prefetch = false;
  bool backward_prefetch = false;
  int limit_all_gathers = 2;      // Block units gathered at once, counting prefetched ones (>= 1)
  std::optional<DType> reduce_dtype;  // gradient reduction and shard gradient dtype; unset: parameters'
  bool broadcast_from_rank0 = true;   // start every rank from rank 0's parameters
  // Under a pipeline: whether this rank holds a parameter (by model name); unset: it holds all.
  std::function<bool(const std::string& name)> holds;
  // Optimizer offload (ZeRO-Offload's split): m, v and an f32 master of the shard live on this
  // host device and AdamW runs there; the compute device keeps only the parameter and gradient
  // shards, and each step moves the gradient shard to the host and the updated parameters back.
  std::optional<Device> offload_optimizer;
  // With offload_optimizer: the parameter shards live on that host device too (the compute device
  // then holds parameters only while a unit is gathered); each gather first stages the shard to
  // the compute device (comm_buffer).
  bool offload_params = false;
  // A model built on a meta device (no memory; PyTorch FSDP's meta-device initialisation): each
  // unit's parameters are given memory on this device, in the unit's flat storage, and set by
  // `init` (the unit's parameters, by model name), one unit at a time before it is sharded, so that
  // no rank ever holds more than its shards and one whole unit. Parameters already on this device
  // are taken as they are.
  std::optional<Device> materialize_on;
  std::function<void(const std::vector<std::pair<std::string, Tensor>>& unit_params)> init;
};

class FullyShardedDataParallel {
 public:
  // Shards model's parameters into units and installs the forward hooks and grad-ready hooks.
  // The parameters' dtype (f32, bf16 or f16) is the compute dtype.
  FullyShardedDataParallel(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                           FsdpOptions opt = {});
  // Any module (FSDP over a model of one's own; no tensor or pipeline parallelism): each of
  // `units` — modules below `model`, none inside another, in the order their forwards run (the
  // order prefetch follows) — becomes a unit of its parameters, and every other parameter of the
  // model goes into a root unit, gathered for the model's forward and again from the start of its
  // backward (no root unit when the units hold every parameter). The units' forwards and the
  // model's must run through nn::Module::hooked, which calls the hooks FSDP installs. Unit names
  // are the modules' names in the model ("layers.2"). A parameter shared by two units is refused.
  FullyShardedDataParallel(nn::Module& model, const std::vector<nn::Module*>& units,
                           std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam, FsdpOptions opt = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Reduces every unit that backward left incomplete (parameters without a gradient count zero)
  // or that holds gradients accumulated under set_sync(false), and waits for every reduction:
  // every shard gradient then holds the group's average, and every sharded unit is released.
  void finish_gradients();
  // false (PyTorch FSDP's no_sync): the next backwards release each unit once its gradients are
  // ready but do not reduce them; the full .grad tensors accumulate. true (the default): a unit's
  // gradients (with what accumulated) are reduced as soon as they are ready. Not under a pipeline,
  // whose roots already accumulate and whose micro-batches interleave.
  void set_sync(bool sync);
  // Sequence parallelism, after finish_gradients(): all-reduces (sum) over tp_group, in one
  // packed buffer, the segments of this rank's shard gradients that belong to tp-replicated
  // parameters (tp::gpt_param_split).
  void sum_replicated_gradients(comm::ProcessGroup& tp_group);
  // Under a pipeline: gathers the root units ("wte", "root"; collective over the shard group)
  // before a stage's forward; they stay gathered until finish_gradients().
  void gather_roots();
  // Under a pipeline, as an action on blocks [first_block, last_block] begins and before it waits
  // for the other stage: with the prefetch of that direction on, issues the all-gather of the unit
  // the action runs first (forward: the one starting at first_block; backward: the one ending at
  // last_block), so that it overlaps the wait. Within limit_all_gathers, like every prefetch.
  void prefetch_action(int first_block, int last_block, bool forward);
  // All-gathers issued ahead of their unit's need so far (prefetch, in-action and across actions).
  int64_t gathers_ahead() const { return gathers_ahead_; }
  // Under a pipeline, after finish_gradients(): the tied embedding's shard gradient (the "wte"
  // unit's), undefined on a rank without it.
  Tensor tied_grad_shard();
  // sqrt(Σ over shards of the shard gradients' sums of squares): one 8-byte all_reduce over the
  // shard group (none under no_shard). The norm of the gradients as stored (before grad_scale).
  double grad_norm();
  // This rank's Σ weight(name)·g² over its shard gradients (unset weight: 1), no communication;
  // 0 on every replica but the first (hybrid, no_shard), so that summed over the whole world —
  // with mesh_grad_weight under tp — every element counts once.
  double grad_sum_squares(const GradWeight& weight = {});
  // AdamW on every shard (gradients multiplied by grad_scale first; f32 masters under bf16/f16).
  void step(double lr, double grad_scale = 1.0);
  // Drops any full .grad and zeroes the shard gradients (they keep their allocation).
  void zero_grad();
  // Gathers (collectively) every unit / releases them: to read or export the whole model.
  void gather_all();
  void release_all();

  // Checkpoint state as pieces of global tensors (parallel/shard_state.h; under tp through
  // ckpt::gpt_param_view with the tp rank's split): this rank's parameter
  // shard "<param>", its "<param>.exp_avg", "<param>.exp_avg_sq" and, with bf16/f16 parameters,
  // "<param>.master" (f32). Only the first replica group contributes (hybrid, no_shard), so over
  // all ranks every element appears exactly once (tp-replicated parameters: from tp rank 0).
  // Shares the shards' storage (no copy).
  std::vector<ckpt::Piece> state_pieces() const;
  // Fills this rank's shards (parameters, m, v, masters) from any layout's state; the master
  // shard is read from "<param>.master" when the source has it, else from "<param>".
  void load_state(const ckpt::PieceSource& src, int64_t optimizer_step);
  // The global tensors of state_pieces() (or only the parameters), gathered tensor by tensor to
  // rank 0 (a reduce of a zero-filled tensor to which each rank adds its pieces): rank 0 returns
  // them, the other ranks an empty map and never hold more than one tensor at a time. tp == 1.
  std::map<std::string, Tensor> full_state_dict(bool with_optimizer_state = true);

  FsdpMode mode() const { return opt_.mode; }
  int num_units() const { return int(units_.size()); }  // root first, then the Block runs in order
  const std::string& unit_name(int u) const { return units_[size_t(u)].name; }  // "root", "h.0", "h.0-1", ...
  int64_t unit_numel(int u) const { return units_[size_t(u)].numel; }           // Ψu
  int64_t unit_padded_numel(int u) const { return units_[size_t(u)].shard * shard_size(); }  // Ψu_p
  int64_t numel() const;         // Ψ = Σ Ψu
  int64_t padded_numel() const;  // Ψp = Σ Ψu_p
  int shard_size() const { return shard_ ? shard_->size() : 1; }          // Ns
  int replica_count() const { return replicate_ ? replicate_->size() : 1; }  // Nr
  // The groups the collectives run on (null when of size 1 by construction: no_shard has no shard
  // group, full_shard/shard_grad_op no replicate group). Each counts its own bytes.
  comm::ProcessGroup* shard_group() const { return shard_.get(); }
  comm::ProcessGroup* replicate_group() const { return replicate_.get(); }
  int64_t steps() const { return step_; }

 private:
  struct Segment {  // parameter `param`'s elements [lo, lo + len) at shard position `at`
    size_t param;
    int64_t lo, len, at;
  };
  struct Unit {
    std::string name;
    nn::Module* first = nullptr;  // pre_forward gathers (no hooks when null: the pipeline's roots)
    nn::Module* last = nullptr;   // post_forward releases and wraps
    bool hooked = false;          // this wrapper set first's and last's hooks
    bool root = false;
    int first_block = -1, last_block = -1;  // a block unit's run, h.first_block .. h.last_block
    bool deferred = false;        // reduced by finish_gradients() only (the pipeline's roots; shard_grad_op's units)
    std::vector<std::pair<std::string, Tensor>> params;
    std::vector<int64_t> offsets;       // of each parameter in the flat vector
    int64_t numel = 0, shard = 0;       // Ψu, S
    std::shared_ptr<Storage> flat;      // Ψu_p elements while gathered, released otherwise
    Tensor full;                        // a 1-D handle on `flat`
    Tensor shard_param;                 // S elements, the parameters' dtype (no_shard: == full)
    Tensor grad_shard;                  // S elements, the reduce dtype
    Tensor master, m, v;                // S elements each, f32 (master only for bf16/f16)
    std::vector<Segment> segments;      // this rank's shard, in order
    std::vector<char> marked;           // per parameter: gradient ready in this backward
    int ready = 0;
    bool gathered = false;              // bytes allocated (and, once `gathering` is done, valid)
    std::shared_ptr<comm::Work> gathering;
    Tensor staged;                      // offload_params: the shard on the compute device, in flight
  };
  struct Reduction {  // one unit's gradient reduction in flight
    size_t unit;
    Tensor in, out;   // comm_buffer: Ns·S packed gradients, S reduced
    std::shared_ptr<comm::Work> scatter, replicate;
  };
  void issue_gather(Unit& u);
  void wait_gather(Unit& u);
  void release(Unit& u);
  void prefetch(size_t k, bool backward);
  int gathered_blocks() const;
  void issue_ahead(Unit& u);  // a prefetch: issue_gather, counted in gathers_ahead_
  Tensor wrap(size_t k, const Tensor& y);  // identity node whose backward gathers unit k
  void on_grad_ready(size_t k, size_t param);
  void reduce(size_t k);
  void hold(Unit& u);  // set_sync(false): releases a unit whose gradients are ready, keeping them
  bool advance(Reduction& r, bool block);  // true once r has been added to its shard gradient
  void reap(bool all);
  template <class Fn>
  void for_state(Fn fn, bool once = false) const;
  // The groups and options (both public constructors), then the units: a GPT's (root, block runs)
  // or the given modules', then their flat storages, shards, state and hooks.
  FullyShardedDataParallel(nn::Module& module, nn::GPT* gpt, std::shared_ptr<comm::ProcessGroup> group,
                           optim::AdamWConfig adam, FsdpOptions opt);
  void gpt_units();
  void module_units(const std::vector<nn::Module*>& modules);
  void shard_units();
  // A parameter's place in its global tensor: a GPT's tp slice, else the whole tensor.
  ckpt::LocalView param_view(const std::string& name, const Shape& shape) const;
  int tp_rank() const { return gpt_ && gpt_->tp_group ? gpt_->tp_group->rank() : 0; }
  int tp_size() const { return gpt_ ? int(gpt_->config.tp) : 1; }

  nn::Module& module_;
  nn::GPT* gpt_ = nullptr;  // null: the units are modules given to the generic constructor
  std::shared_ptr<comm::ProcessGroup> world_, shard_, replicate_;
  optim::AdamWConfig adam_;
  FsdpOptions opt_;
  bool reshard_ = true;  // release after forward (and re-gather for backward)
  bool tagged_ = false;  // the parameters carry this wrapper's updated_by mark (cleared when it goes)
  bool sync_ = true;     // false: no_sync, gradients accumulate unreduced
  DType dtype_ = DType::f32, reduce_dtype_ = DType::f32;
  std::vector<Unit> units_;
  std::vector<Reduction> reductions_;  // issue order
  int64_t step_ = 0;
  int64_t gathers_ahead_ = 0;
  std::shared_ptr<bool> alive_;  // hooks and tape nodes may outlive us: they check this first
};

}  // namespace sg::parallel
