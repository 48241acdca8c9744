// Tensor-parallel layers (Megatron-LM): each is a rank-local GEMM plus one mirrored collective
// from parallel/functional.h. p = tp group size, i = this rank.
//
//   ColumnParallelLinear  A = [A_1; ...; A_p] split by output rows (W is [out, in]):
//                         Y_i = X A_i^T + b_i; optionally Y = [Y_1 | ... | Y_p] (gather_output).
//                         X enters through copy_to_region, so dX is all-reduced in backward.
//   RowParallelLinear     A = [A_1 | ... | A_p] split by input columns; X = [X_1 | ... | X_p]
//                         arrives split: Y = sum_i X_i A_i^T (reduce_from_region) + b, b once.
//   VocabParallelEmbedding rows [i V/p, (i+1) V/p) of the table; ids outside give 0; all-reduce.
//   ParallelAttention     c_attn column-parallel with q, k, v each split, so rank i holds heads
//                         [i H/p, (i+1) H/p); c_proj row-parallel.
//   ParallelMLP           c_fc column-parallel, GELU on the local slice, c_proj row-parallel.
// A block is then 2 all-reduces forward (the two row-parallel outputs) and 2 backward (the two
// copy_to_region inputs).
//
// Sequence parallelism (Korthikanti et al.): outside the tensor-parallel regions (LayerNorms,
// residual adds, dropout) activations are split along the sequence, [B, T/p, C]. The column-
// parallel input then enters through all_gather_seq instead of copy_to_region and the row-
// parallel output leaves through reduce_scatter_seq instead of reduce_from_region: an all-reduce
// is a reduce-scatter plus an all-gather, so those bytes are the same and the activations p times
// smaller. What it adds: the backward gathers c_attn's and c_fc's sequence shards again (two more
// all-gathers per layer, as Megatron does, rather than keep them whole), and the replicated
// parameters (LayerNorms, row-parallel biases, wpe), which see only their rank's tokens, have
// their gradients summed over the group (sync_sequence_parallel_grads: one all-reduce a step).
//
// Every layer can copy its slice out of the unsharded layer (load_full) so that tests compare a
// sharded layer with the single-process one built from the same weights.
#pragma once
#include <memory>
#include <string>

#include "autograd/ops.h"
#include "models/gpt.h"
#include "models/module.h"
#include "parallel/comm/process_group.h"

namespace sg::parallel::tp {

using GroupPtr = std::shared_ptr<comm::ProcessGroup>;

// How a tensor is split over the tp group: along dim (-1: replicated), the dim first cut into
// `parts` equal blocks (q, k, v: 3), each block then split p ways; rank i keeps its piece of each.
struct Split {
  int64_t dim = -1;
  int64_t parts = 1;
  bool replicated() const { return dim < 0; }
};
// Rank `rank`'s piece of the full tensor (a copy; replicated tensors come back as they are).
Tensor shard_of(const Tensor& full, Split s, int rank, int size);
// shard_of(randn(full shape, seed, stream, mean, std), s, rank, size) written over local, without
// the full tensor: along dim 0 each part's piece is drawn in place; along another dim, a band of
// rows at a time (a temporary about local's size).
void normal_shard_(const Tensor& local, Split s, int rank, int size, uint64_t seed, uint64_t stream, double mean,
                   double std);
// The full tensor from every rank's piece (an all-gather over the group; not recorded).
Tensor unshard(const Tensor& local, Split s, comm::ProcessGroup& group);
// How GPT's parameters are split under tensor parallelism, by name ("h.0.attn.c_attn.weight").
Split gpt_param_split(const std::string& name);
// Under sequence parallelism, after backward: every replicated parameter's gradient (a partial
// sum over this rank's tokens) becomes the sum over the group. One all-reduce per parameter.
void sync_sequence_parallel_grads(const nn::Module& gpt, comm::ProcessGroup& group);

class ColumnParallelLinear : public nn::Module {
 public:
  // parts: the output dim is `parts` blocks each split p ways (c_attn's q, k, v: 3).
  ColumnParallelLinear(int64_t in, int64_t out, bool bias, GroupPtr group, bool gather_output = false,
                       int64_t parts = 1, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& x) const;
  Tensor forward_gelu(const Tensor& x) const;  // gelu(forward(x)), the GELU fused into the GEMM
  // x as this rank's GEMM takes it: all-gathered along T under sequence parallelism, else entering
  // the parallel region (identity forward, all-reduce of its gradient backward).
  Tensor input(const Tensor& x) const;
  // Under sequence parallelism, what the GEMM op gathers its input with, in the forward and again
  // in the backward, keeping the [B, T/p, in] shard instead of the whole sequence (Megatron's
  // choice: a second all-gather in the backward for p-fold smaller saved inputs); else none.
  Regather regather() const;
  void load_full(const nn::Linear& full);
  const char* type_name() const override { return "ColumnParallelLinear"; }
  Tensor weight, bias;  // [out/p, in], [out/p]
  GroupPtr group;
  bool gather_output;
  int64_t parts;
  bool sequence_parallel = false;  // x arrives as [B, T/p, in]: all-gathered along T
};

class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(int64_t in, int64_t out, bool bias, GroupPtr group, DType dtype = DType::f32,
                    Device device = Device::cpu());
  // x: this rank's [..., in/p] slice (the output of a column-parallel layer).
  Tensor forward(const Tensor& x) const;
  // This rank's partial product x W^T summed over the group (reduce-scattered along T under
  // sequence parallelism), then the bias: forward(x) is output(linear(x, weight)).
  Tensor output(const Tensor& partial) const;
  void load_full(const nn::Linear& full);
  const char* type_name() const override { return "RowParallelLinear"; }
  Tensor weight, bias;  // [out, in/p], [out] (replicated)
  GroupPtr group;
  bool sequence_parallel = false;  // the sum leaves as [B, T/p, out]: reduce-scattered along T
};

class VocabParallelEmbedding : public nn::Module {
 public:
  VocabParallelEmbedding(int64_t num, int64_t dim, GroupPtr group, DType dtype = DType::f32,
                         Device device = Device::cpu());
  Tensor forward(const Tensor& idx) const;  // idx [...] -> [..., dim], replicated
  void load_full(const nn::Embedding& full);
  const char* type_name() const override { return "VocabParallelEmbedding"; }
  int64_t vocab_start() const { return group->rank() * weight.size(0); }
  Tensor weight;  // [num/p, dim]: rows [vocab_start, vocab_start + num/p)
  GroupPtr group;
  bool sequence_parallel = false;  // idx [B, T] -> [B, T/p, dim]: reduce-scattered along T
};

// Cross-entropy over logits split along the vocabulary: this rank holds columns
// [vocab_start, vocab_start + Vl) of the padded vocabulary. Full logits are never gathered:
//   m = max_all(x), S = sum_all(exp(x - m)), x_t = sum_all(target logit if local) (3 all-reduces
//   of [rows]); loss_row = log S + m - x_t. Columns >= opt.vocab never count; targets equal to
//   opt.ignore_index contribute nothing. Backward, local: dx = (softmax(x) - onehot(t)) * dloss_row.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_start,
                                    comm::ProcessGroup& group, const CrossEntropyOptions& opt = {});

class ParallelAttention : public nn::Module {
 public:
  ParallelAttention(const nn::GPTConfig& c, GroupPtr group, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& x, bool recompute_core) const;
  void load_full(const nn::CausalSelfAttention& full);
  const char* type_name() const override { return "ParallelAttention"; }
  std::shared_ptr<ColumnParallelLinear> c_attn;
  std::shared_ptr<RowParallelLinear> c_proj;
  int64_t local_heads;
  double dropout;
  int64_t dropout_site = 0;  // its block's nn::attn_dropout_site
};

class ParallelMLP : public nn::Module {
 public:
  ParallelMLP(const nn::GPTConfig& c, GroupPtr group, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor forward(const Tensor& x) const;
  void load_full(const nn::MLP& full);
  const char* type_name() const override { return "ParallelMLP"; }
  std::shared_ptr<ColumnParallelLinear> c_fc;
  std::shared_ptr<RowParallelLinear> c_proj;
};

}  // namespace sg::parallel::tp
