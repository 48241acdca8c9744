// The watchdog: a rank that stops making progress (it hangs, or a peer died and it waits forever
// in a collective) must not leave the job hanging. The training loop tells the watchdog what it
// is doing; a thread checks that it keeps moving. After `timeout` seconds in one phase the
// watchdog prints which rank is stuck, where, and at which step, and aborts the whole MPI job.
// A rank stuck in a collective is a victim; a rank stuck anywhere else is the one that failed,
// unless its process keeps using CPU: then it is computing (a long forward on a CPU), not stuck.
#pragma once
#include <cstdint>
#include <string>

namespace sg::parallel {

namespace watchdog {
// Starts the checking thread (idempotent). timeout_s <= 0 disables it.
void arm(double timeout_s, int rank);
void disarm();
// Marks progress and names the phase now running ("forward/backward", ...), at a step.
void beat(const char* phase, int64_t step);
// RAII: a phase spent waiting on other ranks; a timeout here blames a peer, not this rank. The
// trainer names its phases ("the gradient all-reduce"); every wait on a ProcessGroup operation
// names the operation ("an all_gather among the 2 ranks of its group"), so a wait inside a phase
// that names none (FSDP's gathers in forward, tensor parallelism's collectives) blames a peer too.
// Waits may nest and end in any order (several threads may wait at once).
class Waiting {
 public:
  explicit Waiting(std::string what);
  ~Waiting();
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  uint64_t id_;
};

// RAII: while it lives the watchdog allows `seconds` instead of the timeout, and names `flag` when
// it fires: a checkpoint's save or load, where a slow disk can stall a rank (blocked in a write or
// an fsync, using no CPU) for longer than any collective should take, and its peers at the
// barriers after. Not nested.
class Patience {
 public:
  Patience(double seconds, const char* flag);
  ~Patience();
  Patience(const Patience&) = delete;
  Patience& operator=(const Patience&) = delete;

 private:
  double prev_seconds_;
  const char* prev_flag_;
};
}  // namespace watchdog

// --inject-fault rank=R,step=S,kind=exit|throw|abort|kill|hang|nan|slow[,seconds=N][,during=save|load]:
// make rank R fail at the start of step S or, with during=save, inside the save of the checkpoint
// of step S (after some of its files are written, before its manifest), or with during=load once
// it has read its pieces of the checkpoint of step S that the run resumes. kind=nan makes rank R's
// gradients of step S NaN (the trainer's --on-nonfinite then stops or skips the step); kind=slow
// makes it stop N seconds there, using no CPU (blocked on a slow disk in a save or a load), then go on.
struct Fault {
  int rank = -1;
  int64_t step = -1;
  std::string kind;
  std::string during;  // "" (the step), "save" or "load"
  double seconds = 0;  // kind=slow's
  bool active() const { return rank >= 0; }
};
Fault parse_fault(const std::string& spec);  // throws naming the bad field
// Carries the fault out if it is for this rank at this step (exit/abort/kill never return). A
// during=save fault is armed instead, for maybe_inject_in_save.
void maybe_inject(const Fault& f, int rank, int64_t step);
// Called by the checkpoint writers once some files of the checkpoint of `step` are written:
// carries out the armed during=save fault when it is for this step.
void maybe_inject_in_save(int64_t step);
// Called once this rank has read its pieces of the checkpoint of `step`: carries out a during=load
// fault for this rank and step.
void maybe_inject_in_load(const Fault& f, int rank, int64_t step);

}  // namespace sg::parallel
