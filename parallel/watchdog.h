// The watchdog: a rank that stops making progress (it hangs, or a peer died and it waits forever
// in a collective) must not leave the job hanging. The training loop tells the watchdog what it
// is doing; a thread checks that it keeps moving. After `timeout` seconds in one phase the
// watchdog prints which rank is stuck, where, and at which step, and aborts the whole MPI job.
// A rank stuck in a collective is a victim; a rank stuck anywhere else is the one that failed.
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
// RAII: a phase spent waiting on other ranks; a timeout here blames a peer, not this rank.
class Waiting {
 public:
  explicit Waiting(const char* what);
  ~Waiting();

 private:
  const char* prev_;
};
}  // namespace watchdog

// --inject-fault rank=R,step=S,kind=exit|throw|abort|kill|hang: make rank R fail at step S.
struct Fault {
  int rank = -1;
  int64_t step = -1;
  std::string kind;
  bool active() const { return rank >= 0; }
};
Fault parse_fault(const std::string& spec);  // throws naming the bad field
// Carries the fault out if it is for this rank at this step (exit/abort/kill never return).
void maybe_inject(const Fault& f, int rank, int64_t step);

}  // namespace sg::parallel
