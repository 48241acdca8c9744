#include "parallel/comm/work_queue.h"

#include <chrono>

namespace sg::comm {

namespace {
// A hand-off to the queue's thread and back costs a futex wake-up each way (several us in a VM).
// wait() spins this long before sleeping, so an operation that finishes soon does not pay the
// second one; yield() leaves the core to others meanwhile. The queue's thread itself does not spin
// while idle: on an oversubscribed box (the tests run 4 ranks on 2 cores) that would take the core
// from the ranks' compute.
constexpr auto kWaitSpin = std::chrono::microseconds(50);

std::function<void()> completing(const std::shared_ptr<QueuedWork>& work, std::function<void()> op) {
  return [work, op = std::move(op)]() mutable {
    std::exception_ptr err;
    try {
      op();
    } catch (...) {
      err = std::current_exception();
    }
    op = nullptr;  // release the tensors the operation captured before anyone can see it done
    work->finish(err);
  };
}
}  // namespace

void QueuedWork::finish(std::exception_ptr err) {
  std::lock_guard<std::mutex> lock(mu_);
  err_ = err;
  done_.store(true, std::memory_order_release);
  cv_.notify_all();
}

void QueuedWork::wait() {
  const auto end = std::chrono::steady_clock::now() + kWaitSpin;
  while (!test() && std::chrono::steady_clock::now() < end) std::this_thread::yield();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return test(); });
  if (err_) std::rethrow_exception(err_);
}

WorkQueue::WorkQueue() : thread_([this] { loop(); }) {}

WorkQueue::~WorkQueue() { stop(); }

std::shared_ptr<Work> WorkQueue::push(std::function<void()> op) {
  auto work = std::make_shared<QueuedWork>();
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.push_back(completing(work, std::move(op)));
  cv_.notify_one();
  return work;
}

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> WorkQueue::run_inline(const std::function<void()>& op) {
  auto work = std::make_shared<QueuedWork>();
  completing(work, op)();
  return work;
}

void WorkQueue::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace sg::comm
