// Pipeline schedules as data: for each rank, the ordered list of (virtual stage, micro-batch,
// forward|backward) actions one executor runs. With p ranks and v chunks per rank, virtual
// stage s lives on rank s % p (chunk s / p): Megatron's interleaving; v = 1 is the plain pipeline.
//
//   gpipe       all forwards, then all backwards               bubble (p-1)/m, m activations alive
//   1f1b        warm-up forwards, then one forward/one backward,
//               then the remaining backwards                     bubble (p-1)/m, <= p alive
//   interleaved 1F1B over v chunks per rank (m % p == 0)         bubble (p-1)/(v m)
//
// simulate() plays a schedule with fixed per-action times and returns the timeline, from which
// the bubble fraction and the activations in flight are measured rather than assumed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sg::parallel::pp {

enum class Phase { forward, backward };

struct Action {
  int stage = 0;  // virtual stage, 0 .. p*v-1
  int micro = 0;  // micro-batch, 0 .. m-1
  Phase phase = Phase::forward;
  bool operator==(const Action&) const = default;
};

struct Schedule {
  std::string name;
  int ranks = 1, micro_batches = 1, chunks = 1;  // p, m, v
  std::vector<std::vector<Action>> per_rank;
  int rank_of(int stage) const { return stage % ranks; }
  int stages() const { return ranks * chunks; }
};

// Throws naming the flag: an unknown --pp-schedule, or --virtual-stages > 1 outside interleaved.
// make_schedule checks it too; a caller may check first, before building what the schedule splits.
void check_schedule(const std::string& kind, int chunks);
// Throws naming the impossible combination (m < 1, p < 1, interleaved with m % p != 0, ...).
// interleaved with one chunk is 1f1b (it would only hold more activations for the same bubble).
Schedule make_schedule(const std::string& kind, int ranks, int micro_batches, int chunks = 1);
// --micro-batch-size 0: the rows of one micro-batch, given this rank's rows per step. Without a
// pipeline, all of them; under one, the fewest micro-batches that are a multiple of p (interleaved
// needs it) and at least 4 per stage (GPipe's m >= 4p keeps the bubble (p-1)/m under a quarter), or
// the most such that the rows allow. When no multiple of p divides the rows, gpipe and 1f1b take
// the fewest micro-batches >= p (every row its own when the rows are fewer than p); interleaved is
// refused, naming the flags.
int64_t default_micro_batch_size(int64_t rows, int pp, const std::string& kind, int chunks);
Schedule gpipe(int ranks, int micro_batches);
Schedule one_f_one_b(int ranks, int micro_batches);
Schedule interleaved(int ranks, int micro_batches, int chunks);

struct TimedAction {
  Action action;
  double start = 0, end = 0;
};

struct Timeline {
  std::vector<std::vector<TimedAction>> per_rank;
  double makespan = 0;
  // Idle time over busy time, per rank averaged: (p-1)/m for GPipe and 1F1B.
  double bubble_fraction() const;
  // Most micro-batches whose forward ran on `rank` but whose backward has not (activations held).
  int peak_in_flight(int rank) const;
};

// Plays the schedule: an action starts when its rank is free and its input is ready (the forward
// of the previous stage; the backward of the next stage, or this stage's forward for the last).
// t_forward / t_backward are per virtual stage. Throws if the schedule deadlocks.
Timeline simulate(const Schedule& s, double t_forward, double t_backward);

}  // namespace sg::parallel::pp
