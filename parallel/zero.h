// ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models"): data parallelism whose optimizer state — and, at stage 2, gradients — are
// partitioned over the group instead of replicated.
//
// Layout. The parameters, in registration order, form one logical flat vector of Ψ elements,
// padded with zeros to Ψp = ceil(Ψ/N)·N (at most N-1 padding elements). Each rank owns S = Ψp/N
// of them, kept per segment (a parameter's piece inside the shard), which is also where the
// weight-decay mask lives: a segment decays iff its parameter is >= 2-D.
//
// Buckets are stripes, and stripes are contiguous in the flat vector. A reduce-scatter needs N
// equal chunks, chunk r landing on rank r: stripe k is the flat range [N·k·c, N·(k+1)·c) (the
// last one shorter), and rank r owns its r-th c elements, its window. A rank's shard is its
// windows one after another, so shard position k·c + j is flat element N·k·c + r·c + j (the
// padding is the end of the last stripe). Summed over stripes, the reduce-scatters cover Ψp
// exactly once: (N-1)/N·Ψp·dtype bytes per step, and the all-gather of the updated shards the same
// — together DDP's 2Ψ. A stripe holds consecutive parameters, so it is complete as soon as the
// backward has finished them: at stage 2 the stripes launch all along the backward, last layers
// first, and each full gradient is freed as its stripes go, instead of all of them being held
// until the backward's end (as they were when each rank owned one contiguous range, which made
// every stripe wait for the first parameters: stage 2's gradient peak was then 4Ψ + 4Ψp/N).
//
// Memory per rank, f32 parameters with AdamW (K = 8 bytes per element for m and v; no master copy):
//   stage 1: param 4Ψ, grad 4Ψ,           optim_state 8Ψp/N
//   stage 2: param 4Ψ, grad 4Ψp/N (after finish_gradients), optim_state 8Ψp/N
// With bf16/f16 parameters the f32 master weights are partitioned too (optim_state 12Ψp/N) and
// gradients travel and are kept in the parameters' dtype. With offload_optimizer the compute
// device's optim_state is 0 and the host's 12Ψp/N (m, v and an f32 master, whatever the dtype).
//
// Stage 1: full gradients stay on every rank; finish_gradients() reduce-scatters (avg) the stripes
// after backward and writes this rank's averaged elements back into its own .grad pieces.
// Stage 2: each parameter's grad-ready hook counts down the stripes it touches; a stripe whose
// parameters are all ready is copied into an in-flight buffer (comm_buffer, freed on completion)
// and reduce-scattered straight into the persistent shard gradient (grad, S elements), at most two
// stripes in flight (a third waits for the oldest to complete); a
// parameter's full .grad is freed as soon as every stripe touching it has been copied.
// Gradient accumulation, two ways at stage 2 (train's --grad-accumulation):
//   sharded (DeepSpeed's ZeRO-2; PyTorch FSDP without no_sync): sync on for every backward and
//     reduce_micro_batch() after each but the last: every micro-batch reduce-scatters its stripes
//     from the hooks and they add into the shard gradient, so no full gradient outlives its stripe
//     (grad 4Ψp/N beside one stripe in flight) for M·(N-1)/N·4Ψp bytes of reduce-scatter a step of
//     M micro-batches;
//   unsharded (set_sync(false) until the last micro-batch, PyTorch's no_sync): the full .grad
//     tensors accumulate locally and only the last backward communicates — the bytes above once a
//     step — at the cost of holding the full 4Ψ gradient beside the shard while accumulating.
// Stage 1 always accumulates the full gradients (it holds them anyway) and reduces once.
//
// Model parallelism (dp × tp × pp, parallel/comm/mesh.h). A ZeroOptimizer takes this rank's
// parameters — its tp slices, its pipeline stages' (pp::PipelineExecutor::parameters()) — over the
// dp group: every tp/pp coordinate has its own flat vector, Ψ its own parameter count. Gradients
// that other ranks must complete first — the pipeline's tied wte (first + last stage) and, under
// sequence parallelism, the replicated parameters (summed over tp) — must be summed before they
// are reduced over dp: run the backward(s) under set_sync(false), sum them, then reduce_now().
// Traffic: the same bytes as above, but at stage 2 every stripe launches after backward (no
// overlap with it) and the full 4Ψ gradient is held until then, as at stage 1. The global norm
// sums grad_sum_squares(mesh_grad_weight(...)) over every rank of the world (one all-reduce).
//
// Checkpoints: state_pieces() are this rank's m, v (and masters) as pieces of global tensors
// ("<param>.exp_avg", "<param>.exp_avg_sq", "<param>.master"; parallel/shard_state.h); the
// parameters are replicated and not among them — the caller writes them once. load_state() reads
// this rank's shard back from any layout's state.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optim/optim.h"
#include "parallel/comm/process_group.h"
#include "parallel/shard_state.h"

namespace sg::parallel {

// A parameter's weight in a sum of squares, by name (1: counted, 0: counted by another rank).
using GradWeight = std::function<double(const std::string& name)>;
// The weights that count every gradient element of a dp × tp × pp GPT exactly once when every
// rank's grad_sum_squares is summed over the world: the tensor-parallel-replicated parameters
// (tp::gpt_param_split(name).replicated()) on tp rank 0 only, the tied "wte.weight" on the
// pipeline's first stage only.
GradWeight mesh_grad_weight(int tp_rank, bool first_stage);

struct ZeroOptions {
  int stage = 1;                      // 1: optimizer state partitioned; 2: gradients too
  int64_t bucket_bytes = 25ll << 20;  // --bucket-mb: bytes of one stripe's reduce-scatter input
  // ZeRO-Offload (Ren et al.; DeepSpeed's offload_optimizer): m, v and an f32 master of the shard
  // live on this host device and AdamW runs there; each step moves the shard's gradient to the
  // host and the updated shard back (the all-gather's input). The compute device keeps the
  // parameters and the (stage 2: shard) gradients, and no optimizer state.
  std::optional<Device> offload_optimizer;
};

// Memory on `where` for what travels to and from the `compute` device: page-locked host memory
// when the one is the host and the other a GPU (offloaded optimizer state and masters, gradients
// going to a host step), so those copies run at full bus bandwidth.
Tensor transfer_buffer(const Shape& shape, DType dtype, Device where, Device compute);
// An offloaded step's gradient: g widened to f32 in a transfer buffer on `host` (comm_buffer).
Tensor offloaded_gradient(const Tensor& g, Device host);

class ZeroOptimizer {
 public:
  using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
  ZeroOptimizer(NamedTensors params, std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                ZeroOptions opt);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Makes every rank start from rank 0's parameters (and re-seeds the f32 master shard).
  void broadcast_parameters();
  // false: backward only accumulates locally into the full .grad tensors; true: the next backward
  // reduces (stage 2 from the grad-ready hooks).
  void set_sync(bool sync) { sync_ = sync; }
  // Waits for (stage 1: issues, then waits for) every stripe's reduce-scatter: this rank's shard
  // then holds the gradient averaged over the group. Parameters without a gradient count zero
  // (their shard is stepped, weight decay included, as DeepSpeed's flat partitions are; a single
  // process's AdamW skips them). Stage 1 reduces here, so backwards before this call simply
  // accumulate; at stage 2 a second backward with sync on (a parameter ready twice) is an error,
  // as in PyTorch's DDP: accumulate under set_sync(false). The error waits for the stripes in
  // flight and drops the step's reduction and gradients, so the next step starts clean. At stage
  // 2 a call with no gradient anywhere (a second call without a backward between) is refused: it
  // would zero the shard.
  void finish_gradients();
  // Stage 2, accumulating in the shard: call after each micro-batch's backward but the last, sync
  // on for all of them (finish_gradients() ends the step as usual). Launches the stripes the hooks
  // have not (those holding a parameter without a gradient) and readies the hooks for the next
  // backward; the reduce-scatters in flight go on while it computes, and each adds into the shard
  // gradient when it completes (a micro-batch's first reduction of a stripe in a step writes it).
  void reduce_micro_batch();
  // After backward(s) run under set_sync(false): reduce-scatters every stripe now (stage 2 then
  // frees the full gradients) and turns sync back on. The pipeline and sequence parallelism use
  // it: their gradients are complete only once summed across stages / the tp group.
  void reduce_now();
  // sqrt(Σ over ranks of this shard's sum of squares): one 8-byte f64 all_reduce. Call after
  // finish_gradients(); the norm is of the gradients as stored (before any grad_scale).
  double grad_norm();
  // This shard's Σ weight(name)·g² (unset weight: every parameter 1), no communication: summed
  // over the dp group it is grad_norm()²; with mesh_grad_weight, summed over the whole dp × tp × pp
  // world it is the model's. Call after finish_gradients()/reduce_now().
  double grad_sum_squares(const GradWeight& weight = {}) const;
  // AdamW on the owned shard (gradients multiplied by grad_scale first), then the updated shards
  // are all-gathered into every rank's full parameters. After finish_gradients()/reduce_now():
  // called with a backward's reductions unfinished (stage 2) it throws, dropping those gradients.
  void step(double lr, double grad_scale = 1.0);
  // Drops the full .grad tensors and zeroes the shard gradient (stage 2 keeps its allocation).
  void zero_grad();

  // How a parameter (its name and local shape) maps onto its global tensor; unset: the whole
  // tensor under its own name (ckpt::whole_view). For a GPT: ckpt::gpt_param_view with the
  // vocabulary size, which drops wte's padding rows.
  using ViewOf = std::function<ckpt::LocalView(const std::string& name, const Shape& local_shape)>;
  // This rank's "<param>.exp_avg", "<param>.exp_avg_sq" and, with bf16/f16 parameters,
  // "<param>.master" (f32) runs, as pieces sharing the shard's storage (no copy). Over all ranks
  // every element appears exactly once.
  std::vector<ckpt::Piece> state_pieces(const ViewOf& view = {}) const;
  // Fills this rank's shard of m, v (and masters: from "<param>.master" when the source has it,
  // else from the parameters as they are, which the caller loads first) and the step counter.
  void load_state(const ckpt::PieceSource& src, int64_t optimizer_step, const ViewOf& view = {});
  // Every parameter (rank 0's copy) and the global tensors of state_pieces(), gathered to rank 0
  // tensor by tensor (a reduce of a zero-filled tensor to which each rank adds its runs): rank 0
  // returns them, the other ranks an empty map and never hold more than one tensor at a time.
  std::map<std::string, Tensor> full_state_dict(const ViewOf& view = {});

  int stage() const { return opt_.stage; }
  int64_t numel() const { return psi_; }           // Ψ
  int64_t padded_numel() const { return psi_p_; }  // Ψp
  int64_t shard_numel() const { return shard_; }   // S = Ψp / N
  int num_stripes() const { return int(stripes_.size()); }
  int64_t steps() const { return step_; }
  comm::ProcessGroup& group() { return *group_; }

 private:
  struct Segment {  // parameter `param`'s elements [lo, lo + len) at shard position `at`
    size_t param;
    int64_t lo, len, at;
  };
  struct Stripe {
    int64_t begin = 0, len = 0;  // shard positions [begin, begin + len) of every rank
    std::vector<size_t> params;  // every parameter with an element in the stripe
    int pending = 0;             // stage 2: of those, how many still lack their gradient
    bool launched = false;
    bool reduced = false;        // stage 2: a micro-batch of this step has reduce-scattered it
    bool adds = false;           // in flight: its output, the buffer's tail, adds into the shard
    Tensor buffer;               // in flight: N·len input elements, then len output (stage 1, adds)
    std::shared_ptr<comm::Work> work;
  };
  // Where rank q's part of stripe s starts in the flat vector: the stripe is the flat range
  // [N·begin, N·(begin + len)), rank q's window its q-th len elements.
  int64_t window(int q, const Stripe& s) const { return group_->size() * s.begin + q * s.len; }
  // Calls fn(param, lo, len, pos) for every parameter piece inside flat range [begin, end).
  template <class Fn>
  void for_pieces(int64_t begin, int64_t end, Fn fn) const;
  void on_grad_ready(size_t param);
  void launch(size_t stripe);
  void complete(Stripe& s);
  void complete_through(size_t stripe);  // completes the stripes in flight, oldest first, up to it
  void reap();
  void reset_stripes();  // every stripe unlaunched, every parameter unmarked: a step's start
  void abandon_step();   // after an error: waits for stripes in flight, drops them and every .grad
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;  // (suffix, S-element shard)

  NamedTensors params_;
  std::shared_ptr<comm::ProcessGroup> group_;
  optim::AdamWConfig adam_;
  ZeroOptions opt_;
  DType dtype_;
  int64_t psi_ = 0, psi_p_ = 0, shard_ = 0;
  std::vector<int64_t> offsets_;  // flat offset of each parameter
  std::vector<Segment> segments_;  // this rank's shard, in order
  std::vector<Stripe> stripes_;
  std::vector<std::vector<size_t>> stripes_of_;  // per parameter
  std::vector<int> unlaunched_;                  // per parameter: stripes touching it not yet copied
  std::vector<char> marked_;
  std::vector<size_t> in_flight_;
  Tensor grad_shard_;           // stage 2: S elements, the parameters' dtype (grad)
  Tensor master_, m_, v_;       // S elements each, f32 (optim_state); master_ for bf16/f16 or offloaded
  Device device_;               // the parameters' (the compute device; m_ and v_ may be offloaded)
  bool sync_ = true;
  int64_t step_ = 0;
  std::shared_ptr<bool> alive_;  // hooks outlive us on the parameters: they check this first
};

}  // namespace sg::parallel
