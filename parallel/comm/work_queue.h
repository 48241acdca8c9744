// The communication thread behind a process group: operations run one after another, in the order
// they were queued, never two at once, so every rank issues a group's collectives in one order.
//
// Who runs an operation: the queue's thread, which is woken for it and runs it while the caller
// keeps computing (the overlap), or the caller itself, when it wait()s for an operation the thread
// has not started while the thread is idle: it then runs the queue from its head up to its own
// operation, on its own thread. An operation pushed with `caller_waits` (a blocking collective)
// does not wake the thread at all: waking a sleeping thread costs the waker ~5-10 us in a VM, and
// the caller is about to run it anyway (or the busy thread takes it next). Order and exclusion are
// the same either way: only the head of the queue is ever taken, and only while nobody runs one.
// This needs MPI_THREAD_MULTIPLE (MPI calls from more than one thread), like the thread itself.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "parallel/comm/process_group.h"

namespace sg::comm {

class WorkQueue;
struct QueueState;

// Completed when its operation has run; wait() rethrows the operation's error.
class QueuedWork : public Work {
 public:
  void finish(std::exception_ptr err);
  void wait() override;
  bool test() override { return done_.load(std::memory_order_acquire); }

 private:
  friend class WorkQueue;
  std::weak_ptr<QueueState> queue_;  // empty for run_inline; expired once the queue has stopped
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr err_;
};

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();  // stop()
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `op`; its Work completes (with op's exception, if it throws) once it has run.
  // caller_waits: the caller wait()s for it at once, so the thread is not woken for it.
  std::shared_ptr<Work> push(std::function<void()> op, bool caller_waits = false);
  // Runs what is already queued (other ranks expect those collectives), then joins. Idempotent.
  void stop();
  // Runs `op` right here and returns its completed Work: the same contract, without a thread.
  static std::shared_ptr<Work> run_inline(const std::function<void()>& op);
  // How many operations callers ran themselves in wait() (the rest ran on the thread).
  int64_t run_by_callers() const;

 private:
  void loop();
  std::shared_ptr<QueueState> state_;
  std::thread thread_;  // last: starts once the state exists
};

}  // namespace sg::comm
