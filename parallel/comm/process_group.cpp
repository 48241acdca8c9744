#include "parallel/comm/process_group.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>

#include "autograd/ops.h"
#include "core/error.h"
#include "core/hash.h"
#include "core/trace.h"
#include "parallel/watchdog.h"

namespace sg::comm {

namespace {
// Set while a blocking operation is handed to the backend, on the issuing thread only.
thread_local bool t_issuing_blocking = false;
}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::all_reduce: return "all_reduce";
    case CommKind::reduce_scatter: return "reduce_scatter";
    case CommKind::all_gather: return "all_gather";
    case CommKind::broadcast: return "broadcast";
    case CommKind::reduce: return "reduce";
    case CommKind::send: return "send";
    case CommKind::recv: return "recv";
    case CommKind::barrier: return "barrier";
  }
  return "?";
}

int64_t CommCounters::sent_bytes() const {
  int64_t total = 0;
  for (int k = 0; k < kNumCommKinds; ++k)
    if (CommKind(k) != CommKind::recv) total += kinds[size_t(k)].bytes;
  return total;
}

nlohmann::json CommCounters::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 0; k < kNumCommKinds; ++k)
    j[comm_kind_name(CommKind(k))] = {{"calls", kinds[size_t(k)].calls}, {"bytes", kinds[size_t(k)].bytes}};
  return j;
}

namespace {
// ⌊bytes · k / n⌋ without forming bytes · k, which passes int64 for a planner's terabytes on a
// million ranks: with bytes = q·n + r it is q·k + ⌊r·k / n⌋ (r·k < n·k stays small).
int64_t times_fraction(int64_t bytes, int64_t k, int64_t n) { return bytes / n * k + bytes % n * k / n; }
}  // namespace

int64_t all_reduce_bytes(int64_t tensor_bytes, int n) { return times_fraction(tensor_bytes, 2 * int64_t(n - 1), n); }
int64_t reduce_scatter_bytes(int64_t input_bytes, int n) { return times_fraction(input_bytes, n - 1, n); }
int64_t all_gather_bytes(int64_t output_bytes, int n) { return times_fraction(output_bytes, n - 1, n); }

ProcessGroup::ProcessGroup(int rank, int size) : rank_(rank), size_(size) {
  SG_CHECK(size >= 1 && rank >= 0 && rank < size, "ProcessGroup: rank ", rank, " is not in a group of ", size);
}

std::string ProcessGroup::at() const { return str(" (rank ", rank_, " of ", size_, ")"); }

bool ProcessGroup::issuing_blocking() { return t_issuing_blocking; }

CommCounters ProcessGroup::counters() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

void ProcessGroup::reset_counters() {
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_ = CommCounters{};
}

void ProcessGroup::count(CommKind k, int64_t bytes) {
  const std::string closed = closed_reason();
  SG_CHECK(closed.empty(), comm_kind_name(k), ": ", closed, at());
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_[k].calls += 1;
  counters_[k].bytes += bytes;
}

namespace {
std::atomic<int> g_check_collectives{-1};  // -1: not yet read from the environment
}  // namespace

void ProcessGroup::check_collectives(bool on) { g_check_collectives = on ? 1 : 0; }

bool ProcessGroup::checking_collectives() {
  if (g_check_collectives < 0) {
    const char* e = std::getenv("SHARDGRAD_CHECK_COLLECTIVES");
    g_check_collectives = e && *e && std::string(e) != "0" ? 1 : 0;
  }
  return g_check_collectives == 1;
}

std::vector<std::vector<int64_t>> ProcessGroup::gather_uncounted(const std::vector<int64_t>& v) {
  const int64_t n = int64_t(v.size());
  std::vector<int64_t> each;  // this rank's v in every slot: what a backend that moves no values leaves
  for (int q = 0; q < size_; ++q) each.insert(each.end(), v.begin(), v.end());
  Tensor all = from_vector<int64_t>(each, {n * size_});
  if (size_ > 1) {
    parallel::watchdog::Waiting waiting(str("a check that the ", size_, " ranks of its group agree"));
    do_all_gather(all, from_vector<int64_t>(v, {n}))->wait();
  }
  const std::vector<int64_t> flat = to_vector<int64_t>(all);
  std::vector<std::vector<int64_t>> out;
  for (int q = 0; q < size_; ++q) out.emplace_back(flat.begin() + q * n, flat.begin() + (q + 1) * n);
  return out;
}

void ProcessGroup::check_same_call(CommKind k, int64_t numel, DType dtype, int64_t detail) {
  if (size_ == 1 || !checking_collectives() || !closed_reason().empty()) return;  // a closed group: count() says so
  const std::vector<int64_t> mine = {int64_t(k), numel, int64_t(dtype), detail, checked_calls_++};
  const auto all = gather_uncounted(mine);
  auto describe = [&](const std::vector<int64_t>& f) {
    return str(comm_kind_name(CommKind(f[0])), " of ", f[1], " ", dtype_name(DType(f[2])), " elements (op/root ", f[3],
               ", call ", f[4] + 1, " checked on this group)");
  };
  for (int q = 0; q < size_; ++q)
    SG_CHECK(all[size_t(q)] == mine, comm_kind_name(k), ": rank ", q, " of the group called ", describe(all[size_t(q)]),
             " where this rank called ", describe(mine), ": the ranks' collectives differ (SHARDGRAD_CHECK_COLLECTIVES)",
             at());
}

namespace {
constexpr size_t kShownDims = 4;
// A parameter as integers: name hash, dtype, rank (number of dims), numel, its first kShownDims dims.
std::vector<int64_t> parameter_fingerprint(const std::string& name, const Tensor& p) {
  std::vector<int64_t> f = {int64_t(fnv1a(name) >> 1), int64_t(p.dtype()), p.dim(), p.numel()};
  for (size_t d = 0; d < kShownDims; ++d) f.push_back(int64_t(d) < p.dim() ? p.size(int64_t(d)) : -1);
  return f;
}
std::string describe_fingerprint(const int64_t* f) {
  std::string dims;
  for (int64_t d = 0; d < f[2]; ++d) dims += str(d ? "," : "", d < int64_t(kShownDims) ? str(f[4 + d]) : "...");
  return str(dtype_name(DType(f[1])), "[", dims, "]");
}
}  // namespace

void ProcessGroup::check_same_parameters(const char* who, const std::vector<std::pair<std::string, Tensor>>& params) {
  if (size_ == 1 || !closed_reason().empty()) return;
  const int64_t width = 4 + int64_t(kShownDims);
  std::vector<int64_t> each;
  uint64_t h = kFnvBasis;
  for (const auto& [n, p] : params) {
    const auto f = parameter_fingerprint(n, p);
    each.insert(each.end(), f.begin(), f.end());
    for (int64_t v : f) h = fnv1a(std::to_string(v), h);
  }
  const auto summary = gather_uncounted({int64_t(params.size()), int64_t(h >> 1)});
  const int64_t mine = int64_t(params.size());
  bool same = true;
  for (int q = 0; q < size_; ++q) {
    SG_CHECK(summary[size_t(q)][0] == mine, who, ": rank ", q, " of the group has ", summary[size_t(q)][0],
             " parameters where this rank has ", mine, ": every rank must wrap the same model", at());
    same = same && summary[size_t(q)][1] == summary[size_t(rank_)][1];
  }
  if (same) return;
  const auto all = gather_uncounted(each);  // the counts agree: the same length everywhere
  for (int64_t i = 0; i < mine; ++i)
    for (int q = 0; q < size_; ++q) {
      const int64_t* theirs = all[size_t(q)].data() + i * width;
      const int64_t* ours = each.data() + i * width;
      if (std::equal(ours, ours + width, theirs)) continue;
      const bool renamed = theirs[0] != ours[0];
      throw Error(str(who, ": parameter ", i, " ('", params[size_t(i)].first, "', ", describe_fingerprint(ours),
                      " here) is ", renamed ? "named differently and " : "", describe_fingerprint(theirs),
                      " on rank ", q, " of the group: every rank must wrap the same model", at()));
    }
}

void ProcessGroup::check_tensor(const char* op, const char* role, const Tensor& t) const {
  SG_CHECK(t.defined(), op, ": ", role, " is undefined", at());
  std::string name = t.name().empty() ? std::string(role) : str(role, " '", t.name(), "'");
  SG_CHECK(t.is_contiguous(), op, ": ", name, " ", t.describe(), " is not contiguous (strides ",
           shape_str(t.strides()), "); pass contiguous(t)", at());
}

void ProcessGroup::check_peer(const char* op, const char* what, int peer, bool allow_self) const {
  SG_CHECK(peer >= 0 && peer < size_, op, ": ", what, " ", peer, " is not a rank of this group of ", size_, at());
  // A rank's operations run in order on one queue: a message to itself would wait for itself.
  SG_CHECK(allow_self || peer != rank_, op, ": ", what, " ", peer, " is this rank", at());
}

namespace {
// With tracing on: the collective as one event on its group's track, from issue to the first
// wait() or test() that sees it done. `bytes`: the tensor the kind's formula names (B).
class TracedWork final : public Work {
 public:
  TracedWork(std::shared_ptr<Work> w, std::string track, CommKind k, int64_t bytes, int n)
      : inner_(std::move(w)), track_(std::move(track)), kind_(k), bytes_(bytes), n_(n), start_(trace::now_us()) {}
  void wait() override {
    inner_->wait();
    done();
  }
  bool test() override {
    const bool d = inner_->test();
    if (d) done();
    return d;
  }

 private:
  void done() {
    if (recorded_.exchange(true)) return;
    trace::complete(comm_kind_name(kind_), track_, start_, trace::now_us() - start_, {{"bytes", bytes_}, {"ranks", n_}});
  }
  std::shared_ptr<Work> inner_;
  std::string track_;
  CommKind kind_;
  int64_t bytes_;
  int n_;
  double start_;
  std::atomic<bool> recorded_{false};
};

std::shared_ptr<Work> traced(const ProcessGroup* g, CommKind k, size_t bytes, std::shared_ptr<Work> w) {
  if (!trace::enabled()) return w;
  return std::make_shared<TracedWork>(std::move(w), trace::comm_track(g, g->size()), k, int64_t(bytes), g->size());
}

// A Work whose wait() tells the watchdog that this rank waits on its peers, and in what: a
// rank stuck there blames a peer, not itself.
class WatchedWork final : public Work {
 public:
  WatchedWork(std::shared_ptr<Work> w, std::string what) : w_(std::move(w)), what_(std::move(what)) {}
  void wait() override {
    parallel::watchdog::Waiting g(what_);
    w_->wait();
  }
  bool test() override { return w_->test(); }

 private:
  std::shared_ptr<Work> w_;
  std::string what_;
};


// Hands the operation to the backend (start) with the caller's intent visible to it, and waits
// for a blocking one before returning (the MPI backend runs a blocking one inside start()).
template <class Start>
std::shared_ptr<Work> issue(Sync sync, const std::string& what, Start start) {
  struct Flag {
    explicit Flag(bool on) { t_issuing_blocking = on; }
    ~Flag() { t_issuing_blocking = false; }
  };
  std::shared_ptr<Work> w;
  if (sync == Sync::blocking) {
    parallel::watchdog::Waiting g(what);
    {
      Flag flag(true);
      w = start();
    }
    w->wait();
    return w;
  }
  return std::make_shared<WatchedWork>(start(), what);
}

bool overlap(const Tensor& a, const Tensor& b) {
  if (a.storage() != b.storage()) return false;
  auto pa = static_cast<const char*>(a.data_ptr()), pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}
}  // namespace

std::string ProcessGroup::collective_name(CommKind k) const {
  const std::string name = comm_kind_name(k);
  return str(name[0] == 'a' ? "an " : "a ", name, " among the ", size_, " ranks of its group",
             world_ranks_.empty() ? "" : str(" (world ranks ", shape_str(world_ranks_), ")"));
}

int ProcessGroup::backend_max_tag() const { return std::numeric_limits<int>::max(); }
int ProcessGroup::max_tag() const { return tag_limit_ >= 0 ? std::min(tag_limit_, backend_max_tag()) : backend_max_tag(); }
void ProcessGroup::limit_tags(int max) {
  SG_CHECK(max >= 1, "limit_tags: ", max, " leaves no tag", at());
  tag_limit_ = max;
}

std::string ProcessGroup::peer_name(int q) const {
  return str("rank ", q, world_ranks_.empty() ? "" : str(" (world rank ", world_ranks_[size_t(q)], ")"));
}

void ProcessGroup::learn_world_ranks(int world_rank) {
  const auto all = gather_uncounted({world_rank});
  std::vector<int> ranks;
  bool identity = true, all_same = size_ > 1;
  for (int q = 0; q < size_; ++q) {
    ranks.push_back(int(all[size_t(q)][0]));
    identity = identity && ranks.back() == q;
    all_same = all_same && ranks.back() == ranks.front();
  }
  // all the same: a backend that moves no values (sim); the identity: the world's own numbering
  if (!identity && !all_same) world_ranks_ = ranks;
}

std::shared_ptr<Work> ProcessGroup::all_reduce(const Tensor& t, ReduceOp op, Sync sync) {
  check_tensor("all_reduce", "tensor", t);
  SG_CHECK(op != ReduceOp::avg || is_floating(t.dtype()), "all_reduce: avg of ", t.describe(),
           " would not be exact; use sum and divide", at());
  check_same_call(CommKind::all_reduce, t.numel(), t.dtype(), int64_t(op));
  count(CommKind::all_reduce, all_reduce_bytes(int64_t(t.nbytes()), size_));
  return issue(sync, collective_name(CommKind::all_reduce),
               [&] { return traced(this, CommKind::all_reduce, t.nbytes(), do_all_reduce(t, op)); });
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, Sync sync) {
  check_tensor("reduce_scatter", "output", out);
  check_tensor("reduce_scatter", "input", in);
  SG_CHECK(out.dtype() == in.dtype() && out.device() == in.device(), "reduce_scatter: output ", out.describe(),
           " and input ", in.describe(), " differ in dtype or device", at());
  SG_CHECK(in.numel() == int64_t(size_) * out.numel(), "reduce_scatter: input has ", in.numel(), " elements, not ",
           size_, " x ", out.numel(), " (output ", shape_str(out.shape()), ")", at());
  SG_CHECK(!overlap(out, in), "reduce_scatter: output and input share memory", at());
  SG_CHECK(op != ReduceOp::avg || is_floating(in.dtype()), "reduce_scatter: avg of ", in.describe(),
           " would not be exact; use sum and divide", at());
  check_same_call(CommKind::reduce_scatter, in.numel(), in.dtype(), int64_t(op));
  count(CommKind::reduce_scatter, reduce_scatter_bytes(int64_t(in.nbytes()), size_));
  return issue(sync, collective_name(CommKind::reduce_scatter),
               [&] { return traced(this, CommKind::reduce_scatter, in.nbytes(), do_reduce_scatter(out, in, op)); });
}

std::shared_ptr<Work> ProcessGroup::all_gather(const Tensor& out, const Tensor& in, Sync sync) {
  check_tensor("all_gather", "output", out);
  check_tensor("all_gather", "input", in);
  SG_CHECK(out.dtype() == in.dtype() && out.device() == in.device(), "all_gather: output ", out.describe(),
           " and input ", in.describe(), " differ in dtype or device", at());
  SG_CHECK(out.numel() == int64_t(size_) * in.numel(), "all_gather: output has ", out.numel(), " elements, not ",
           size_, " x ", in.numel(), " (input ", shape_str(in.shape()), ")", at());
  // In place is allowed when the input is exactly this rank's chunk of the output (FSDP shards).
  const char* own_chunk = static_cast<const char*>(out.data_ptr()) + size_t(rank_) * in.nbytes();
  SG_CHECK(!overlap(out, in) || in.data_ptr() == own_chunk, "all_gather: input overlaps the output but is not its chunk ",
           rank_, at());
  check_same_call(CommKind::all_gather, out.numel(), out.dtype(), 0);
  count(CommKind::all_gather, all_gather_bytes(int64_t(out.nbytes()), size_));
  return issue(sync, collective_name(CommKind::all_gather),
               [&] { return traced(this, CommKind::all_gather, out.nbytes(), do_all_gather(out, in)); });
}

std::shared_ptr<Work> ProcessGroup::broadcast(const Tensor& t, int root, Sync sync) {
  check_tensor("broadcast", "tensor", t);
  check_peer("broadcast", "root", root, true);
  check_same_call(CommKind::broadcast, t.numel(), t.dtype(), root);
  count(CommKind::broadcast, size_ > 1 ? int64_t(t.nbytes()) : 0);
  return issue(sync, collective_name(CommKind::broadcast),
               [&] { return traced(this, CommKind::broadcast, t.nbytes(), do_broadcast(t, root)); });
}

std::shared_ptr<Work> ProcessGroup::reduce(const Tensor& t, int root, ReduceOp op, Sync sync) {
  check_tensor("reduce", "tensor", t);
  check_peer("reduce", "root", root, true);
  SG_CHECK(op != ReduceOp::avg || is_floating(t.dtype()), "reduce: avg of ", t.describe(),
           " would not be exact; use sum and divide", at());
  check_same_call(CommKind::reduce, t.numel(), t.dtype(), root * 16 + int64_t(op));
  count(CommKind::reduce, size_ > 1 ? int64_t(t.nbytes()) : 0);
  return issue(sync, collective_name(CommKind::reduce),
               [&] { return traced(this, CommKind::reduce, t.nbytes(), do_reduce(t, root, op)); });
}

std::shared_ptr<Work> ProcessGroup::send(const Tensor& t, int dst, int tag) {
  check_tensor("send", "tensor", t);
  check_peer("send", "destination", dst, false);
  SG_CHECK(tag >= 0 && tag <= max_tag(), "send: tag ", tag, tag < 0 ? " is negative" : str(" is above the ", backend_name(),
           " backend's largest tag ", max_tag(), backend_name() == "mpi" ? " (MPI_TAG_UB)" : ""), at());
  count(CommKind::send, int64_t(t.nbytes()));
  return std::make_shared<WatchedWork>(traced(this, CommKind::send, t.nbytes(), do_send(t, dst, tag)),
                                       str("a send to ", peer_name(dst), " of its ", size_, "-rank group"));
}

std::shared_ptr<Work> ProcessGroup::recv(const Tensor& t, int src, int tag) {
  check_tensor("recv", "tensor", t);
  check_peer("recv", "source", src, false);
  SG_CHECK(tag >= 0 && tag <= max_tag(), "recv: tag ", tag, tag < 0 ? " is negative" : str(" is above the ", backend_name(),
           " backend's largest tag ", max_tag(), backend_name() == "mpi" ? " (MPI_TAG_UB)" : ""), at());
  count(CommKind::recv, int64_t(t.nbytes()));
  return std::make_shared<WatchedWork>(traced(this, CommKind::recv, t.nbytes(), do_recv(t, src, tag)),
                                       str("a recv from ", peer_name(src), " of its ", size_, "-rank group"));
}

std::shared_ptr<Work> ProcessGroup::barrier(Sync sync) {
  check_same_call(CommKind::barrier, 0, DType::f32, 0);
  count(CommKind::barrier, 0);
  return issue(sync, collective_name(CommKind::barrier),
               [&] { return traced(this, CommKind::barrier, 0, do_barrier()); });
}

std::shared_ptr<ProcessGroup> ProcessGroup::split(int color, int key) {
  auto child = do_split(color, key);
  if (child) child->learn_world_ranks(world_ranks_.empty() ? rank_ : world_ranks_[size_t(rank_)]);
  return child;
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  SG_CHECK(!ranks.empty(), "new_group: empty rank list", at());
  for (size_t i = 0; i < ranks.size(); ++i) {
    SG_CHECK(ranks[i] >= 0 && ranks[i] < size_, "new_group: rank ", ranks[i], " in ", shape_str(ranks),
             " is not a rank of this group of ", size_, at());
    SG_CHECK(std::count(ranks.begin(), ranks.end(), ranks[i]) == 1, "new_group: rank ", ranks[i], " is listed twice in ",
             shape_str(ranks), at());
  }
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  bool member = it != ranks.end();
  return split(member ? 0 : -1, member ? int(it - ranks.begin()) : 0);
}

}  // namespace sg::comm
