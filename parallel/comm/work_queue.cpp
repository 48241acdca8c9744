#include "parallel/comm/work_queue.h"

#include <chrono>

namespace sg::comm {

// What the queue's thread and the callers in wait() share. `busy` is the exclusion: whoever sets
// it (under mu) runs the head of the queue, and nobody else starts one until it is cleared.
struct QueueState {
  std::mutex mu;
  std::condition_variable cv;  // the thread sleeps here
  std::deque<std::function<void()>> tasks;
  bool busy = false;
  bool stop = false;
  int64_t by_callers = 0;
};

namespace {
// A caller that finds its operation already running on the thread spins this long (yielding the
// core to others) before it sleeps, so an operation that finishes soon does not also pay the
// wake-up on the way back. The queue's thread itself never spins while idle: on an oversubscribed
// box (the tests run 4 ranks on 2 cores) that would take the core from the ranks' compute.
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

// Runs the head of the queue outside the lock; the caller holds `lock`, has checked that the queue
// is not empty and nobody is busy, and holds the lock again on return. The operation's Work is
// finished before busy is cleared, so "not done and not busy" means "still queued".
void run_head(QueueState& s, std::unique_lock<std::mutex>& lock) {
  std::function<void()> task = std::move(s.tasks.front());
  s.tasks.pop_front();
  s.busy = true;
  lock.unlock();
  task();  // never throws: completing() hands the error to the Work
  task = nullptr;
  lock.lock();
  s.busy = false;
  // The thread may have woken while we were busy and gone back to sleep: hand it the rest.
  if (!s.tasks.empty() || s.stop) s.cv.notify_one();
}
}  // namespace

void QueuedWork::finish(std::exception_ptr err) {
  std::lock_guard<std::mutex> lock(mu_);
  err_ = err;
  done_.store(true, std::memory_order_release);
  cv_.notify_all();
}

void QueuedWork::wait() {
  if (auto q = queue_.lock(); q && !test()) {
    // Not started and nobody running one: run the queue up to this operation here.
    std::unique_lock<std::mutex> lock(q->mu);
    while (!test() && !q->busy && !q->tasks.empty()) {
      run_head(*q, lock);
      ++q->by_callers;
    }
  }
  const auto end = std::chrono::steady_clock::now() + kWaitSpin;
  while (!test() && std::chrono::steady_clock::now() < end) std::this_thread::yield();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return test(); });
  if (err_) std::rethrow_exception(err_);
}

WorkQueue::WorkQueue() : state_(std::make_shared<QueueState>()), thread_([this] { loop(); }) {}

WorkQueue::~WorkQueue() { stop(); }

std::shared_ptr<Work> WorkQueue::push(std::function<void()> op, bool caller_waits) {
  auto work = std::make_shared<QueuedWork>();
  work->queue_ = state_;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->tasks.push_back(completing(work, std::move(op)));
  // Whoever is busy hands the queue on when it is done (run_head); a caller about to wait runs it.
  if (!state_->busy && !caller_waits) state_->cv.notify_one();
  return work;
}

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> WorkQueue::run_inline(const std::function<void()>& op) {
  auto work = std::make_shared<QueuedWork>();
  completing(work, op)();
  return work;
}

int64_t WorkQueue::run_by_callers() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->by_callers;
}

void WorkQueue::loop() {
  const DeviceErrorsElsewhere elsewhere;  // a staging copy's wait leaves bad-index errors to the model's threads
  QueueState& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    s.cv.wait(lock, [&] { return !s.busy && (s.stop || !s.tasks.empty()); });
    if (s.tasks.empty()) return;  // stopping, everything run
    run_head(s, lock);
  }
}

}  // namespace sg::comm
