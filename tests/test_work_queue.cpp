// The communication thread's queue (parallel/comm/work_queue.h), without MPI: operations run in
// queue order and never two at once, whether the queue's thread runs them or a caller that waits
// for one the thread has not started; an operation nobody waits for runs on the thread.
#include "tests/catch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "parallel/comm/work_queue.h"

using sg::comm::Work;
using sg::comm::WorkQueue;

TEST_CASE("queued operations run in order and one at a time, by the thread or by a caller in wait()", "[comm]") {
  WorkQueue q;
  const auto caller = std::this_thread::get_id();
  std::atomic<int> running{0}, most_at_once{0};
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  std::vector<std::shared_ptr<Work>> works;
  const int n = 3000;
  for (int i = 0; i < n; ++i) {
    works.push_back(q.push([&, i] {
      most_at_once = std::max(most_at_once.load(), ++running);
      order.push_back(i);  // unsynchronised on purpose: the queue's exclusion is what protects it
      ran_on.push_back(std::this_thread::get_id());
      --running;
    }));
    if (i % 3 == 2) works.back()->wait();  // a blocking collective; the two before it were async
  }
  for (auto& w : works) w->wait();
  REQUIRE(most_at_once == 1);
  REQUIRE(int(order.size()) == n);
  for (int i = 0; i < n; ++i) REQUIRE(order[size_t(i)] == i);
  // the caller took some (it waited right after queueing), and only the caller and one thread ran any
  REQUIRE(q.run_by_callers() > 0);
  std::vector<std::thread::id> threads;
  for (auto id : ran_on)
    if (id != caller && std::find(threads.begin(), threads.end(), id) == threads.end()) threads.push_back(id);
  REQUIRE(threads.size() <= 1);
}

TEST_CASE("an operation nobody waits for runs on the queue's thread while the caller goes on", "[comm]") {
  WorkQueue q;
  std::atomic<bool> ran_elsewhere{false};
  const auto caller = std::this_thread::get_id();
  auto w = q.push([&] { ran_elsewhere = std::this_thread::get_id() != caller; });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!w->test() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(w->test());
  REQUIRE(ran_elsewhere);
  REQUIRE(q.run_by_callers() == 0);
}

TEST_CASE("an operation's error comes back from wait(), whoever ran it, stop() runs what is queued", "[comm]") {
  WorkQueue q;
  auto bad = q.push([] { throw std::runtime_error("all_reduce: MPI error (rank 1 of 2)"); });
  REQUIRE_THROWS_WITH(bad->wait(), "all_reduce: MPI error (rank 1 of 2)");
  REQUIRE_THROWS_WITH(bad->wait(), "all_reduce: MPI error (rank 1 of 2)");  // every time
  std::atomic<int> done{0};
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 50; ++i) works.push_back(q.push([&] { ++done; }));
  q.stop();
  REQUIRE(done == 50);
  for (auto& w : works) REQUIRE(w->test());
}

TEST_CASE("an operation the caller waits for at once runs on the caller's thread, the idle thread left asleep", "[comm]") {
  WorkQueue q;
  q.push([] {})->wait();
  const auto caller = std::this_thread::get_id();
  int on_caller = 0;
  for (int i = 0; i < 100; ++i) {
    std::thread::id ran;
    q.push([&] { ran = std::this_thread::get_id(); }, /*caller_waits=*/true)->wait();
    on_caller += ran == caller;
  }
  // all of them but for a spurious wake-up of the thread's condition variable, which Linux rarely has
  REQUIRE(on_caller >= 95);
}
