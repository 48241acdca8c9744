// The communication thread behind a process group: operations run one after another, in the order
// they were queued, on a thread of their own, so the caller keeps computing. Every rank queues a
// group's collectives in the same order, so FIFO on each rank keeps them matched across ranks.
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

// Completed by the queue's thread when its operation has run; wait() rethrows the operation's error.
class QueuedWork : public Work {
 public:
  void finish(std::exception_ptr err);
  void wait() override;
  bool test() override { return done_.load(std::memory_order_acquire); }

 private:
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
  std::shared_ptr<Work> push(std::function<void()> op);
  // Runs what is already queued (other ranks expect those collectives), then joins. Idempotent.
  void stop();
  // Runs `op` right here and returns its completed Work: the same contract, without a thread.
  static std::shared_ptr<Work> run_inline(const std::function<void()>& op);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the queue exists
};

}  // namespace sg::comm
