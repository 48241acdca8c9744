#include "parallel/watchdog.h"

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace sg::parallel {

namespace watchdog {
namespace {
using Clock = std::chrono::steady_clock;
std::mutex mu;
std::atomic<bool> armed{false};
double limit = 0;
double patience = 0;                  // a Patience's timeout (0: none alive)
const char* patience_flag = nullptr;  // and the flag that sets it
int my_rank = 0;
const char* phase = "startup";
std::map<uint64_t, std::string> waits;  // the waits in progress, oldest first
uint64_t next_wait = 0;
int64_t at_step = -1;
Clock::time_point last = Clock::now();
std::thread checker;

// This process's CPU seconds, all threads.
double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

void check_loop() {
  // Each tick, whether the process used a tenth of a core or more since the last one: busy.
  double cpu_before = cpu_seconds();
  Clock::time_point tick_before = Clock::now(), last_busy = tick_before;
  // A 100 ms sleep that took seconds: this process was stopped (SIGSTOP) or starved, for that long.
  double frozen_s = 0;
  Clock::time_point frozen_end{};
  while (armed.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> g(mu);
    const Clock::time_point now = Clock::now();
    if (const double gap = std::chrono::duration<double>(now - tick_before).count(); gap >= 2.0)
      frozen_s = gap, frozen_end = now;
    const double cpu_now = cpu_seconds();
    if (cpu_now - cpu_before >= 0.1 * std::chrono::duration<double>(now - tick_before).count()) last_busy = now;
    cpu_before = cpu_now, tick_before = now;
    double idle = std::chrono::duration<double>(now - last).count();
    // The timeout that applies now: a Patience's while one lives.
    const double timeout = patience > 0 ? patience : limit;
    const char* const flag = patience > 0 ? patience_flag : "--comm-timeout";
    if (!armed.load() || idle < timeout) continue;
    // Outside any wait, a rank that keeps computing (a long forward on a CPU) is not stuck: the
    // timeout bounds waits on peers and ranks that stopped, as PyTorch's bounds collectives. A hung
    // rank (asleep, deadlocked) uses no CPU: it fails `timeout` seconds after its last busy tick.
    if (waits.empty()) {
      idle = std::min(idle, std::chrono::duration<double>(now - last_busy).count());
      if (idle < timeout) continue;
    }
    if (!waits.empty() && frozen_end >= last && frozen_s >= std::max(2.0, timeout / 2)) {
      // Its peers waited on it: this process itself did not run (SIGSTOP, or starved of CPU), and
      // its own waits are stale.
      std::fprintf(stderr,
                   "shardgrad: rank %d: FAILED: this process was stopped for %.0f s (SIGSTOP, or starved of the "
                   "CPU) at step %lld; aborting the job (%s %.0f)\n",
                   my_rank, frozen_s, (long long)at_step + 1, flag, timeout);
    } else if (!waits.empty()) {
      // the outermost wait names the phase, the innermost the operation it is stuck in
      std::string what = waits.begin()->second;
      if (waits.size() > 1) what += " (" + waits.rbegin()->second + ")";
      std::fprintf(stderr,
                   "shardgrad: rank %d: no progress for %.0f s while waiting in %s at step %lld: a peer rank "
                   "stopped responding; aborting the job (%s %.0f)\n",
                   my_rank, idle, what.c_str(), (long long)at_step + 1, flag, timeout);
    } else {
      std::fprintf(stderr,
                   "shardgrad: rank %d: FAILED: no progress for %.0f s in %s at step %lld (not waiting on any "
                   "peer); aborting the job (%s %.0f)\n",
                   my_rank, idle, phase, (long long)at_step + 1, flag, timeout);
    }
    std::fflush(stderr);
    int up = 0;
    MPI_Initialized(&up);
    // The stuck rank and its waiting peers time out within moments of each other: a grace lets each
    // say its part before the first abort takes the job down. A waiting rank's is longer (a quarter
    // of the timeout, 1 to 5 s): the stuck rank's clock starts at its last busy moment (the files
    // it wrote before it hung in a save, say), later than its peers' last beat.
    const bool victim = !waits.empty() && !(frozen_end >= last && frozen_s >= std::max(2.0, timeout / 2));
    std::this_thread::sleep_for(std::chrono::duration<double>(victim ? std::clamp(timeout / 4, 1.0, 5.0) : 1.0));
    if (up) MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }
}
}  // namespace

void arm(double timeout_s, int rank) {
  if (timeout_s <= 0 || armed.exchange(true)) return;
  {
    std::lock_guard<std::mutex> g(mu);
    limit = timeout_s;
    my_rank = rank;
    last = Clock::now();
  }
  checker = std::thread(check_loop);
}

void disarm() {
  if (!armed.exchange(false)) return;
  if (checker.joinable()) checker.join();
}

void beat(const char* p, int64_t step) {
  std::lock_guard<std::mutex> g(mu);
  phase = p;
  at_step = step;
  last = Clock::now();
}

Waiting::Waiting(std::string what) {
  std::lock_guard<std::mutex> g(mu);
  id_ = next_wait++;
  waits.emplace(id_, std::move(what));
  last = Clock::now();
}

Waiting::~Waiting() {
  std::lock_guard<std::mutex> g(mu);
  waits.erase(id_);
  last = Clock::now();
}

Patience::Patience(double seconds, const char* flag) {
  std::lock_guard<std::mutex> g(mu);
  prev_seconds_ = patience;
  prev_flag_ = patience_flag;
  if (seconds > 0) patience = seconds, patience_flag = flag;
}

Patience::~Patience() {
  std::lock_guard<std::mutex> g(mu);
  patience = prev_seconds_;
  patience_flag = prev_flag_;
}
}  // namespace watchdog

Fault parse_fault(const std::string& spec) {
  Fault f;
  if (spec.empty()) return f;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto eq = item.find('=');
    SG_CHECK(eq != std::string::npos, "--inject-fault: '", item, "' is not key=value (expected rank=R,step=S,kind=K)");
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    try {
      if (k == "rank") f.rank = std::stoi(v);
      else if (k == "step") f.step = std::stoll(v);
      else if (k == "kind") f.kind = v;
      else if (k == "during") f.during = v;
      else if (k == "seconds") f.seconds = std::stod(v);
      else throw Error(str("--inject-fault: unknown key '", k, "' (expected rank, step, kind, seconds, during)"));
    } catch (const std::invalid_argument&) {
      throw Error(str("--inject-fault: ", k, "=", v, " is not a number"));
    }
  }
  SG_CHECK(f.rank >= 0 && f.step >= 1, "--inject-fault: needs rank >= 0 and step >= 1, got '", spec, "'");
  SG_CHECK(f.kind == "exit" || f.kind == "throw" || f.kind == "abort" || f.kind == "kill" || f.kind == "hang" ||
               f.kind == "nan" || f.kind == "slow",
           "--inject-fault: kind '", f.kind, "' is not one of exit, throw, abort, kill, hang, nan, slow");
  SG_CHECK(f.kind != "nan" || f.during.empty(), "--inject-fault: kind nan poisons a step's gradients, not a save or a load");
  SG_CHECK(f.during.empty() || f.during == "save" || f.during == "load", "--inject-fault: during '", f.during,
           "' is not 'save' or 'load' (omit it to fail at the start of the step)");
  SG_CHECK(f.kind == "slow" ? std::isfinite(f.seconds) && f.seconds > 0 : f.seconds == 0, "--inject-fault: ",
           f.kind == "slow" ? "kind slow needs seconds=N > 0" : "seconds=N is for kind slow");
  return f;
}

namespace {
std::mutex save_fault_mu;
Fault save_fault;  // armed by maybe_inject for this rank
int save_fault_rank = -1;

void fire(const Fault& f, int rank, int64_t step) {
  std::fprintf(stderr, "shardgrad: rank %d: injecting fault '%s' at step %lld%s\n", rank, f.kind.c_str(),
               (long long)step, f.during == "save" ? " while saving the checkpoint" : f.during == "load" ? " after reading its checkpoint" : "");
  std::fflush(stderr);
  if (f.kind == "nan") return;  // the trainer poisons this step's loss scale (NaN gradients)
  if (f.kind == "slow") {  // blocked, as in a write or an fsync to a slow disk, then on
    std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
    return;
  }
  if (f.kind == "exit") std::_Exit(7);  // at once, as a process ending itself: no destructors (a live
                                         // communication thread would turn std::exit into an abort)
  if (f.kind == "abort") std::abort();
  if (f.kind == "kill") ::kill(::getpid(), SIGKILL);
  if (f.kind == "throw") throw Error(str("injected fault at step ", step));
  if (f.kind == "hang") {
    watchdog::beat(f.during == "save" ? "the checkpoint save" : "forward/backward", step - 1);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}
}  // namespace

void maybe_inject(const Fault& f, int rank, int64_t step) {
  if (!f.active() || f.rank != rank || f.during == "load") return;
  if (f.during == "save") {
    std::lock_guard<std::mutex> g(save_fault_mu);
    save_fault = f;
    save_fault_rank = rank;
    return;
  }
  if (f.step == step) fire(f, rank, step);
}

void maybe_inject_in_save(int64_t step) {
  Fault f;
  int rank = -1;
  {
    std::lock_guard<std::mutex> g(save_fault_mu);
    if (!save_fault.active() || save_fault.step != step) return;
    f = save_fault;
    rank = save_fault_rank;
    save_fault = Fault{};
  }
  fire(f, rank, step);
}

void maybe_inject_in_load(const Fault& f, int rank, int64_t step) {
  if (f.active() && f.during == "load" && f.rank == rank && f.step == step) fire(f, rank, step);
}

}  // namespace sg::parallel
