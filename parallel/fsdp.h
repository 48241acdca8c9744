// ZeRO stage 3 / FSDP FULL_SHARD (Rajbhandari et al., "ZeRO"; Zhao et al., "PyTorch FSDP"):
// parameters, gradients and optimizer state are all partitioned over the data-parallel group.
//
// Units. One unit per transformer Block, plus a root unit for wte, wpe and ln_f (the tied head
// uses wte at the very end of forward and the embedding at the very end of backward, so the root
// stays gathered through both). A unit's parameters point, at their offsets, into one flat
// Storage of Ψu_p = S·N elements, S = ceil(Ψu/N) (at most N-1 zero padding elements per unit).
// Between uses that storage is released (Storage::release): the only persistent copy of the
// parameters is this rank's shard, elements [r·S, (r+1)·S) of the flat vector.
//
// One step, per unit u (Block units; the root the same around the whole model):
//   forward   pre_forward: all_gather the shards into the reallocated flat storage; the block
//             runs; post_forward: release it, and wrap the output in an identity node whose
//             backward gathers the unit again (it runs before any node of the block in reverse).
//   backward  the identity gathers; the block's nodes read the parameters through the handles
//             the tape saved (same Storage, new bytes); when every parameter of the unit has its
//             gradient (grad-ready hooks, counted per unit), the gradients are packed into a flat
//             comm_buffer, reduce-scattered (avg) into the unit's persistent shard gradient, the
//             full gradients are freed and the unit is released.
//   step      AdamW on each shard (m, v: S elements each; weight decay per segment, >= 2-D
//             parameters only); no all-gather afterwards: the next forward gathers.
// Bytes per rank per step (Ψp = Σ Ψu_p, f32): all_gather 2·(N-1)/N·4Ψp (forward + backward),
// reduce_scatter (N-1)/N·4Ψp: the 3Ψ of the ZeRO paper. Collectives are issued and waited in
// order (no overlap with compute yet).
// Memory per rank after the step: param 4Ψp/N (shards), grad 4Ψp/N, optim_state 8Ψp/N; at peak
// the root unit and one Block unit are gathered on top of the shards.
// Gradient accumulation: every micro-batch gathers twice and reduce-scatters once, accumulating
// into the shard gradient, so traffic is multiplied by the number of micro-batches (the 3Ψ holds
// per micro-batch); the full gradient is never held.
//
// While this object lives the model's parameters hold no bytes outside forward/backward: read
// them with gather_all()/release_all(). f32, tp == 1 only.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "optim/optim.h"
#include "parallel/comm/process_group.h"

namespace sg::parallel {

class FullyShardedDataParallel {
 public:
  // Shards model's parameters into units (broadcasting rank 0's values first when asked) and
  // installs the forward hooks on the blocks and the model and the grad-ready hooks.
  FullyShardedDataParallel(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> group, optim::AdamWConfig adam,
                           bool broadcast_from_rank0 = true);
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Reduces every unit that backward left incomplete (parameters without a gradient count zero);
  // afterwards every shard gradient holds the group's average and every unit is released.
  void finish_gradients();
  // sqrt(Σ over ranks and units of the shard gradients' sums of squares): one 8-byte all_reduce.
  double grad_norm();
  // AdamW on every shard (gradients multiplied by grad_scale first).
  void step(double lr, double grad_scale = 1.0);
  // Drops any full .grad and zeroes the shard gradients (they keep their allocation).
  void zero_grad();
  // Gathers (collectively) every unit / releases them: to read or export the whole model.
  void gather_all();
  void release_all();

  int num_units() const { return int(units_.size()); }  // root first, then h.0, h.1, ...
  int64_t unit_numel(int u) const { return units_[size_t(u)].numel; }             // Ψu
  int64_t unit_padded_numel(int u) const { return units_[size_t(u)].shard * group_->size(); }  // Ψu_p
  int64_t numel() const;         // Ψ = Σ Ψu
  int64_t padded_numel() const;  // Ψp = Σ Ψu_p
  int64_t steps() const { return step_; }

 private:
  struct Segment {  // parameter `param`'s elements [lo, lo + len) at shard position `at`
    size_t param;
    int64_t lo, len, at;
  };
  struct Unit {
    std::string name;
    nn::Module* module = nullptr;
    std::vector<std::pair<std::string, Tensor>> params;
    std::vector<int64_t> offsets;       // of each parameter in the flat vector
    int64_t numel = 0, shard = 0;       // Ψu, S
    std::shared_ptr<Storage> flat;      // Ψu_p elements while gathered, released otherwise
    Tensor full;                        // a 1-D handle on `flat`
    Tensor shard_param, grad_shard, m, v;  // S elements each: param, grad, optim_state
    std::vector<Segment> segments;      // this rank's shard, in order
    std::vector<char> marked;           // per parameter: gradient ready in this backward
    int ready = 0;
    bool gathered = false;
  };
  void gather(Unit& u);
  void release(Unit& u);
  Tensor wrap(Unit& u, const Tensor& y);  // identity node whose backward gathers u
  void on_grad_ready(Unit& u, size_t param);
  void reduce(Unit& u);

  nn::GPT& model_;
  std::shared_ptr<comm::ProcessGroup> group_;
  optim::AdamWConfig adam_;
  std::vector<Unit> units_;
  int64_t step_ = 0;
  std::shared_ptr<bool> alive_;  // hooks and tape nodes may outlive us: they check this first
};

}  // namespace sg::parallel
