#include "parallel/comm/sim_backend.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/error.h"

namespace sg::comm {

// What the rank threads share: the group sizes, and the split calls in progress, each keyed by
// (group, the split's number on that group).
struct SimWorld {
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int next_group = 1;  // the world is group 0
  struct Split {
    std::vector<std::optional<std::pair<int, int>>> posted;  // (color, key) per rank of the group
    int count = 0;                                           // ranks that have posted
    std::map<int, int> child;                                // color -> the subgroup's id
    std::map<int, std::vector<std::tuple<int, int>>> members;  // color -> (key, rank), sorted
    int taken = 0;                                           // ranks that have their answer
  };
  std::map<std::pair<int, int>, Split> splits;
};

namespace {
class DoneWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};
std::shared_ptr<Work> done() { return std::make_shared<DoneWork>(); }
}  // namespace

SimProcessGroup::SimProcessGroup(std::shared_ptr<SimWorld> world, int group_id, int rank, int size)
    : ProcessGroup(rank, size), world_(std::move(world)), group_id_(group_id) {}

std::shared_ptr<Work> SimProcessGroup::do_all_reduce(const Tensor&, ReduceOp) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_reduce_scatter(const Tensor&, const Tensor&, ReduceOp) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_all_gather(const Tensor&, const Tensor&) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_broadcast(const Tensor&, int) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_reduce(const Tensor&, int, ReduceOp) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_send(const Tensor&, int, int) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_recv(const Tensor&, int, int) { return done(); }
std::shared_ptr<Work> SimProcessGroup::do_barrier() { return done(); }

std::shared_ptr<ProcessGroup> SimProcessGroup::do_split(int color, int key) {
  SimWorld& w = *world_;
  const auto id = std::make_pair(group_id_, splits_++);
  std::unique_lock<std::mutex> lock(w.mu);
  SimWorld::Split& s = w.splits[id];
  s.posted.resize(size_t(size()));
  s.posted[size_t(rank())] = {color, key};
  // Woken once, by the last to post: with thousands of rank threads, a wake-up per post would
  // cost each split N² checks.
  if (++s.count == size()) w.cv.notify_all();
  const auto all_posted = [&] { return w.aborted || s.count == size(); };
  // The ranks are threads that only compute shapes: a minute without the others means one is lost.
  SG_CHECK(w.cv.wait_for(lock, std::chrono::minutes(1), all_posted), "split (simulated): the other ranks of group ",
           group_id_, " did not reach split number ", id.second, " within a minute", at());
  if (w.aborted) throw SimWorldAborted(str("split (simulated): another rank of the simulated world failed", at()));
  std::shared_ptr<ProcessGroup> out;
  if (color >= 0) {
    // (key, rank), as MPI_Comm_split orders them: sorted once per colour, by its first rank here
    auto [found, first] = s.members.try_emplace(color);
    std::vector<std::tuple<int, int>>& members = found->second;
    if (first) {
      for (int r = 0; r < size(); ++r)
        if (s.posted[size_t(r)]->first == color) members.emplace_back(s.posted[size_t(r)]->second, r);
      std::sort(members.begin(), members.end());
    }
    const int new_rank =
        int(std::lower_bound(members.begin(), members.end(), std::make_tuple(key, rank())) - members.begin());
    auto [it, fresh] = s.child.try_emplace(color, w.next_group);
    if (fresh) ++w.next_group;
    out = std::make_shared<SimProcessGroup>(world_, it->second, new_rank, int(members.size()));
  }
  if (++s.taken == size()) w.splits.erase(id);
  return out;
}

std::vector<std::shared_ptr<SimProcessGroup>> simulated_world(int n) {
  SG_CHECK(n >= 1, "simulated world: ", n, " ranks (need at least 1)");
  auto w = std::make_shared<SimWorld>();
  std::vector<std::shared_ptr<SimProcessGroup>> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(std::make_shared<SimProcessGroup>(w, 0, r, n));
  return ranks;
}

void SimProcessGroup::abort() const {
  std::lock_guard<std::mutex> lock(world_->mu);
  world_->aborted = true;
  world_->cv.notify_all();
}

}  // namespace sg::comm
