// The pipeline executor: runs one rank's action list (schedule.h) for one training step.
//
// Virtual stage s holds blocks [s L/S, (s+1) L/S) of the GPT; stage 0 also the token and position
// embeddings, the last stage also ln_f, the tied head and the loss. A forward action takes its
// input (tokens, or the activation received from the previous stage), records the stage on its
// own tape (one per micro-batch and stage in flight) and sends the output on; a backward action
// receives the output's gradient (or starts from the loss), runs that tape backward and sends the
// input's gradient back. Parameters accumulate gradients over the micro-batches.
//
// The tied embedding lives on the first and the last stage: both copies start equal (same seed)
// and stay equal because their gradients are summed between the two ranks before the step.
// Each action's start and end are recorded, so the bubble is measured, not assumed.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "models/gpt.h"
#include "parallel/comm/process_group.h"
#include "parallel/pp/schedule.h"

namespace sg::parallel::pp {

// Whether `rank` of the schedule holds GPT parameter `name` of a model of n_layer blocks: one of
// its stages uses it (wte: the first and the last stage; wpe: the first; ln_f: the last; h.<i>.*:
// its block's stage). A rank that builds its model on a meta device materialises these alone.
bool holds_parameter(const Schedule& schedule, int rank, const std::string& name, int64_t n_layer);

class PipelineExecutor {
 public:
  using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
  // model: a full GPT built from the same seed on every rank; the parameters of stages this rank
  // does not hold are released (the ledger then shows only this rank's share). Or a GPT built on a
  // meta device whose held parameters (holds_parameter) were materialised and initialised: the
  // rank never holds the whole model (what `train --pp` does).
  PipelineExecutor(nn::GPT& model, Schedule schedule, std::shared_ptr<comm::ProcessGroup> pp_group);

  // One step over this rank's rows [m * micro, T]: returns the mean loss of those rows (summed
  // loss * scale, the same on every rank of the pipeline). Gradients are left in the parameters.
  double run(const Tensor& idx, const Tensor& targets, double scale);
  // Forward only, for evaluation (call it under NoGradGuard; no tape, no timeline): the whole batch
  // at once, every rank of the pipeline running its stages in stage order and sending each output
  // on. Returns on every rank of the pipeline the last stage's result, as f32: with targets, the
  // loss (the sum over the targets that are not -1, times scale); without, the logits (under tp,
  // this rank's vocabulary slice, as GPT::forward gives them).
  Tensor forward(const Tensor& idx, const Tensor& targets = Tensor(), double scale = 1.0);
  // Sums the two copies of the tied embedding's gradient (first and last stage).
  void reduce_tied_embedding();
  // The same for a tensor that both holders hold alike (FSDP's shard gradient of the tied
  // embedding), in place; nothing on the other ranks.
  void sum_tied(const Tensor& t);
  // This rank's parameters (those of its stages); the tied embedding appears on both its holders.
  const NamedTensors& parameters() const { return owned_; }
  // Sum of squared gradients of this rank's parameters, the tied embedding counted only on the
  // first stage: all-reduce it over the pipeline for the global norm.
  double grad_sum_squares() const;
  const Timeline& last_timeline() const { return timeline_; }
  bool holds_stage(int s) const { return schedule_.rank_of(s) == group_->rank(); }
  // Called before every stage's forward (training and evaluation) with the stage: FSDP gathers
  // the embedding and head parameters there, which run outside GPT::forward.
  std::function<void(int stage)> before_forward;
  // Called as each training action begins, before it waits for what another stage sends, with
  // the blocks its stage runs [first_block, last_block] and its phase: FSDP's prefetch issues the
  // all-gather of the action's first unit there, so that it overlaps the wait.
  std::function<void(int first_block, int last_block, bool forward)> before_action;

 private:
  // Stage s on input (tokens for stage 0); the last stage returns the loss, or the logits when
  // targets are undefined.
  Tensor stage_forward(int s, const Tensor& input, const Tensor& targets, double scale);
  int blocks_per_stage() const;
  int tag(int stage, int micro, bool grad) const;
  // Stage `stage`'s input activation for micro-batch `micro` ([rows, T or T/tp, C]), received from
  // the previous stage's rank; idx gives T and the device.
  Tensor receive_input(int stage, int micro, const Tensor& idx, int64_t rows);
  // The gradient of stage `stage`'s output for micro-batch `micro`, received from the next stage's rank.
  Tensor receive_output_grad(const Tensor& output, int stage, int micro);
  // The other holder of the tied embedding (the first stage's rank for the last stage's, and the
  // reverse), or -1 on every other rank and when one rank holds both.
  int tied_peer() const;
  // t + the peer's t (the two ranks add in opposite order; the sums are equal).
  Tensor add_peer(const Tensor& t, int peer);

  nn::GPT& model_;
  Schedule schedule_;
  std::shared_ptr<comm::ProcessGroup> group_;
  NamedTensors owned_;
  Timeline timeline_;
};

}  // namespace sg::parallel::pp
