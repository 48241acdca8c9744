// The ProcessGroup contract on the MPI backend, at 2 and 4 ranks. Every rank fills its inputs from
// its rank with one formula, so every rank can compute locally what the collective must return.
// Checks use CHECK, not REQUIRE, inside collectives: a rank that stopped early would leave the
// others waiting in the next collective.
#include "tests/catch.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "autograd/ops.h"
#include "parallel/comm/mesh.h"
#include "parallel/comm/mpi_backend.h"

using namespace sg;
using comm::CommKind;
using comm::ReduceOp;
using Clock = std::chrono::steady_clock;

namespace {

std::shared_ptr<comm::MpiProcessGroup> world() {
  static auto w = comm::MpiProcessGroup::world();  // shut down by comm::finalize in mpi_main
  return w;
}

const std::vector<DType> kDTypes = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64};
const std::vector<DType> kFloatDTypes = {DType::f32, DType::f64, DType::bf16, DType::f16};

// Rank r's element i. Floats are multiples of 0.25 below 8, exact in every format, so sums and
// averages over 4 ranks are exact too; the half-precision tolerance below is a safety margin.
double value(int rank, int64_t i, DType t) {
  if (is_floating(t)) return (rank + 1) * 0.5 + double(i % 13) * 0.25 - 1.5;
  return (rank + 1) * 3 + i % 13 - 5;
}

Tensor filled(int rank, int64_t n, DType t, int64_t first = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = value(rank, first + i, t);
  return to(from_vector<double>(v, {n}), t);
}

double reduce_expected(ReduceOp op, int nranks, int64_t i, DType t, const std::vector<int>& ranks = {}) {
  std::vector<int> rs = ranks;
  if (rs.empty())
    for (int r = 0; r < nranks; ++r) rs.push_back(r);
  double acc = op == ReduceOp::max ? -1e300 : 0;
  for (int r : rs) acc = op == ReduceOp::max ? std::max(acc, value(r, i, t)) : acc + value(r, i, t);
  return op == ReduceOp::avg ? acc / double(rs.size()) : acc;
}

void check_values(const Tensor& got, const std::vector<double>& want) {
  auto g = to_vector<double>(got);
  REQUIRE(g.size() == want.size());
  const double rel = is_half(got.dtype()) ? 1e-2 : got.dtype() == DType::f32 ? 1e-6 : 0;
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (std::abs(g[i] - want[i]) > rel * std::max(1.0, std::abs(want[i])) && bad++ < 3)
      FAIL_CHECK("element " << i << ": got " << g[i] << ", want " << want[i]);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("comm::init detects that the test main already initialised MPI, and is idempotent", "[comm]") {
  CHECK(comm::init() == MPI_THREAD_MULTIPLE);
  CHECK(comm::init() == MPI_THREAD_MULTIPLE);
  CHECK(comm::threaded());
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  CHECK(world()->size() == n);
  CHECK(world()->backend_name() == "mpi");
}

TEST_CASE("all_reduce sum, avg and max equal the local computation for every dtype and odd sizes", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  for (DType t : kDTypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && !is_floating(t)) continue;
      for (int64_t numel : {int64_t(1), int64_t(7), int64_t(1001), int64_t(37 * n + 1)}) {
        INFO(dtype_name(t) << " " << comm::reduce_op_name(op) << " of " << numel << " elements");
        Tensor x = filled(r, numel, t);
        pg->all_reduce(x, op)->wait();
        std::vector<double> want(static_cast<size_t>(numel));
        for (int64_t i = 0; i < numel; ++i) want[size_t(i)] = reduce_expected(op, n, i, t);
        check_values(x, want);
      }
    }
}

TEST_CASE("bf16 and f16 all_reduce of random values stays within rounding of the f64 sum", "[comm]") {
  auto pg = world();
  const int n = pg->size();
  const int64_t numel = 4099;
  for (DType t : {DType::bf16, DType::f16}) {
    INFO(dtype_name(t));
    // Every rank's input rounded to t, as it goes on the wire; the reference sums those in f64.
    std::vector<double> want(size_t(numel), 0.0), magnitude(size_t(numel), 0.0);
    for (int r = 0; r < n; ++r) {
      auto v = to_vector<double>(randn({numel}, 7, uint64_t(r), 0, 1, t));
      for (int64_t i = 0; i < numel; ++i) {
        want[size_t(i)] += v[size_t(i)];
        magnitude[size_t(i)] += std::abs(v[size_t(i)]);
      }
    }
    Tensor x = randn({numel}, 7, uint64_t(pg->rank()), 0, 1, t);
    pg->all_reduce(x)->wait();
    auto got = to_vector<double>(x);
    // Rounded once per reduction step (n - 1 steps), each off by at most u times a partial sum.
    const double u = t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    int bad = 0;
    for (int64_t i = 0; i < numel; ++i)
      if (std::abs(got[size_t(i)] - want[size_t(i)]) > (n - 1) * u * magnitude[size_t(i)] + 1e-30) ++bad;
    CHECK(bad == 0);
  }
}

TEST_CASE("reduce_scatter gives rank r the reduced chunk r", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  for (DType t : kDTypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && !is_floating(t)) continue;
      for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(1001)}) {
        INFO(dtype_name(t) << " " << comm::reduce_op_name(op) << ", chunks of " << chunk);
        Tensor in = filled(r, n * chunk, t), out = zeros({chunk}, t);
        pg->reduce_scatter(out, in, op)->wait();
        std::vector<double> want(static_cast<size_t>(chunk));
        for (int64_t i = 0; i < chunk; ++i) want[size_t(i)] = reduce_expected(op, n, r * chunk + i, t);
        check_values(out, want);
      }
    }
}

TEST_CASE("all_gather concatenates every rank's input in rank order, also in place", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  for (DType t : kDTypes)
    for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(1001)}) {
      INFO(dtype_name(t) << ", chunks of " << chunk);
      std::vector<double> want;
      for (int q = 0; q < n; ++q)
        for (int64_t i = 0; i < chunk; ++i) want.push_back(value(q, i, t));
      Tensor out = zeros({n * chunk}, t);
      pg->all_gather(out, filled(r, chunk, t))->wait();
      check_values(out, want);
      // FSDP's layout: the shard is this rank's slice of the flat buffer.
      Tensor flat = zeros({n * chunk}, t), shard = narrow(flat, 0, r * chunk, chunk);
      copy_(shard, filled(r, chunk, t));
      pg->all_gather(flat, shard)->wait();
      check_values(flat, want);
    }
}

TEST_CASE("broadcast from the last rank reaches every rank", "[comm]") {
  auto pg = world();
  const int root = pg->size() - 1;
  for (DType t : kDTypes) {
    INFO(dtype_name(t));
    Tensor x = filled(pg->rank(), 1001, t);
    pg->broadcast(x, root)->wait();
    std::vector<double> want;
    for (int64_t i = 0; i < 1001; ++i) want.push_back(value(root, i, t));
    check_values(x, want);
  }
}

TEST_CASE("reduce to the last rank: the root holds the sum, the others keep their input", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank(), root = n - 1;
  for (DType t : kDTypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      INFO(dtype_name(t) << " " << comm::reduce_op_name(op));
      Tensor x = filled(r, 7, t);
      pg->reduce(x, root, op)->wait();
      std::vector<double> want;
      for (int64_t i = 0; i < 7; ++i) want.push_back(r == root ? reduce_expected(op, n, i, t) : value(r, i, t));
      check_values(x, want);
    }
}

TEST_CASE("send/recv around a ring, with messages too big to go eagerly", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int64_t numel : {int64_t(7), int64_t(1) << 20}) {
    INFO(numel << " elements");
    Tensor out = filled(r, numel, DType::f32), in = zeros({numel});
    // Everybody sends first: with blocking sends on one queue this is the classic deadlock.
    auto s = pg->send(out, next, 3);
    auto q = pg->recv(in, prev, 3);
    q->wait();
    s->wait();
    CHECK(s->test());
    std::vector<double> want;
    for (int64_t i = 0; i < numel; ++i) want.push_back(value(prev, i, DType::f32));
    check_values(in, want);
  }
}

TEST_CASE("a send or recv whose Work is dropped finishes in the background: no deadlock, the data arrives",
          "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t numel = int64_t(1) << 20;  // past the eager size: a send waits for its receive
  {
    // Every rank drops its send before it receives (PyTorch's isend without wait). Waiting for
    // the send when its Work went would keep every rank from posting the receive a peer needs.
    Tensor out = filled(r, numel, DType::f32), in = zeros({numel});
    pg->send(out, next, 5);
    pg->recv(in, prev, 5)->wait();
    std::vector<double> want;
    for (int64_t i = 0; i < numel; ++i) want.push_back(value(prev, i, DType::f32));
    check_values(in, want);
  }
  {
    // A dropped receive does not block either (waiting in its destructor, every rank would sit
    // there before its send), and it still fills its CPU tensor, which MPI writes directly: by the
    // time a later receive from the same peer completes (messages match in order), it has too.
    Tensor first = zeros({numel}), second = zeros({3});
    pg->recv(first, prev, 6);
    auto s1 = pg->send(filled(r, numel, DType::f32), next, 6);
    auto s2 = pg->send(filled(r, 3, DType::f32), next, 6);
    pg->recv(second, prev, 6)->wait();
    s1->wait();
    s2->wait();
    pg->barrier()->wait();
    pg->send(zeros({1}), next, 7);  // any later send or recv completes the finished orphans
    pg->recv(zeros({1}), prev, 7)->wait();
    std::vector<double> want;
    for (int64_t i = 0; i < numel; ++i) want.push_back(value(prev, i, DType::f32));
    check_values(first, want);
  }
}

TEST_CASE("checked collectives name the rank whose call differs, on every rank, and leave the group usable", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  comm::ProcessGroup::check_collectives(true);
  struct Off {
    ~Off() { comm::ProcessGroup::check_collectives(false); }
  } off;
  // Rank 0 reduces 4 elements, the others 8: without the check, mismatched buffers.
  Tensor t = ones({r == 0 ? 4 : 8});
  const std::string other = r == 0 ? "rank 1 of the group called all_reduce of 8 f32 elements"
                                   : "rank 0 of the group called all_reduce of 4 f32 elements";
  REQUIRE_THROWS_WITH(pg->all_reduce(t), Catch::Contains(other) && Catch::Contains("the ranks' collectives differ"));
  // Rank 0 broadcasts while the others all-reduce: without the check, a hang.
  Tensor u = ones({6});
  auto mismatched = [&] { return r == 0 ? pg->broadcast(u, 0) : pg->all_reduce(u); };
  REQUIRE_THROWS_WITH(mismatched(), Catch::Contains(r == 0 ? "called all_reduce of 6" : "called broadcast of 6"));
  // Calls that agree go through, checked; the check's own all-gathers are not counted.
  pg->reset_counters();
  pg->all_reduce(u)->wait();
  pg->barrier()->wait();
  CHECK(to_vector<float>(u) == std::vector<float>(6, float(n)));
  CHECK(pg->counters()[comm::CommKind::all_gather].calls == 0);
}

TEST_CASE("barrier completes only when every rank has reached it", "[comm]") {
  auto pg = world();
  if (pg->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto t0 = Clock::now();
  pg->barrier()->wait();
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (pg->rank() != 0) CHECK(ms > 150);
}

TEST_CASE("several operations in flight complete in issue order with the right results", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  std::vector<Tensor> xs;
  std::vector<std::shared_ptr<comm::Work>> works;
  for (int k = 0; k < 8; ++k) {
    xs.push_back(filled(r, 1000 + 37 * k, DType::f32, k));
    works.push_back(pg->all_reduce(xs.back()));
  }
  Tensor gathered = zeros({n * 5}, DType::i64);
  works.push_back(pg->all_gather(gathered, filled(r, 5, DType::i64)));
  // FIFO: once an operation is done, everything issued before it is done.
  for (size_t k = works.size(); k-- > 0;) {
    works[k]->wait();
    for (size_t j = 0; j < k; ++j) CHECK(works[j]->test());
  }
  for (int k = 0; k < 8; ++k) {
    std::vector<double> want;
    for (int64_t i = 0; i < 1000 + 37 * k; ++i) want.push_back(reduce_expected(ReduceOp::sum, n, k + i, DType::f32));
    check_values(xs[size_t(k)], want);
  }
}

// Deterministic rather than a wall-clock race on an oversubscribed box: the other ranks join the
// all_reduce a second late, so rank 0's call must return at once, test() must stay false while rank
// 0 keeps computing, and only wait() may block. The speed-up from overlap is measured in the bench.
TEST_CASE("an all_reduce runs on the communication thread: the call returns, wait() is what blocks", "[comm]") {
  if (!comm::threaded()) {
    WARN("MPI did not provide MPI_THREAD_MULTIPLE: operations run inline, nothing to overlap");
    return;
  }
  auto pg = world();
  Tensor x = filled(pg->rank(), 4 << 20, DType::f32);  // 16 MiB
  pg->barrier()->wait();
  if (pg->rank() != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    pg->all_reduce(x)->wait();
    return;
  }
  auto t0 = Clock::now();
  auto work = pg->all_reduce(x);
  double launch_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  Tensor a = randn({128, 128}, 1, 1), acc = zeros({128, 128});
  for (int i = 0; i < 20; ++i) add_(acc, matmul(a, a));  // the caller's thread keeps computing
  bool done_early = work->test();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  done_early = done_early || work->test();
  work->wait();
  double total_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  CHECK(launch_ms < 300);
  CHECK_FALSE(done_early);
  CHECK(work->test());
  CHECK(total_ms > 500);
  CHECK(std::isfinite(sum_squares(acc)));
}

TEST_CASE("blocking collectives have completed when the call returns, interleaved with async ones in issue order", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  std::vector<Tensor> xs;
  std::vector<std::shared_ptr<comm::Work>> works;
  for (int k = 0; k < 6; ++k) {
    xs.push_back(filled(r, 257 + k, DType::f32));
    if (k % 2) {  // odd: blocking, behind the async one queued just before it
      auto w = pg->all_reduce(xs.back(), ReduceOp::sum, comm::Sync::blocking);
      CHECK(w->test());
    } else {
      works.push_back(pg->all_reduce(xs.back(), ReduceOp::sum));
    }
  }
  for (auto& w : works) w->wait();
  for (int k = 0; k < 6; ++k) {
    std::vector<double> want;
    for (int64_t i = 0; i < 257 + k; ++i) want.push_back(reduce_expected(ReduceOp::sum, n, i, DType::f32));
    check_values(xs[size_t(k)], want);
  }
  Tensor chunk = filled(r, 5, DType::i64), all = zeros({5 * n}, DType::i64);
  CHECK(pg->all_gather(all, chunk, comm::Sync::blocking)->test());
  CHECK(to_vector<double>(all)[size_t(5 * (n - 1))] == value(n - 1, 0, DType::i64));
  CHECK(pg->barrier(comm::Sync::blocking)->test());
  // a refused call throws from the call itself, as the async form does
  Tensor big = filled(r, 3, DType::f32);
  CHECK_THROWS_WITH(pg->broadcast(big, n, comm::Sync::blocking), Catch::Contains("root " + std::to_string(n)));
}

TEST_CASE("split into even and odd ranks: each subgroup reduces only its own ranks", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  auto sub = pg->split(r % 2, r);
  REQUIRE(sub != nullptr);
  std::vector<int> members;
  for (int q = r % 2; q < n; q += 2) members.push_back(q);
  CHECK(sub->size() == int(members.size()));
  CHECK(sub->rank() == r / 2);
  Tensor x = filled(r, 7, DType::f64);
  sub->all_reduce(x)->wait();
  std::vector<double> want;
  for (int64_t i = 0; i < 7; ++i) want.push_back(reduce_expected(ReduceOp::sum, n, i, DType::f64, members));
  check_values(x, want);
  // new_group: list order sets the new ranks; ranks not listed get no group.
  auto last_first = pg->new_group({n - 1, 0});
  CHECK((last_first != nullptr) == (r == 0 || r == n - 1));
  if (last_first) {
    CHECK(last_first->rank() == (r == n - 1 ? 0 : 1));
    Tensor y = filled(r, 3, DType::i32);
    last_first->broadcast(y, 0)->wait();  // from world rank n - 1
    check_values(y, {value(n - 1, 0, DType::i32), value(n - 1, 1, DType::i32), value(n - 1, 2, DType::i32)});
    // What a stuck wait says names the peer's world rank: the group's numbering is not the world's.
    CHECK(last_first->peer_name(0) == str("rank 0 (world rank ", n - 1, ")"));
    CHECK(last_first->peer_name(1) == "rank 1 (world rank 0)");
  }
  // The world's own numbering, and the same numbering split off again, name no world rank.
  CHECK(pg->peer_name(n - 1) == str("rank ", n - 1));
  CHECK(pg->split(0, r)->peer_name(n - 1) == str("rank ", n - 1));
  if (r % 2 == 1) CHECK(sub->peer_name(0) == "rank 0 (world rank 1)");
}

TEST_CASE("device mesh groups: tp innermost, each group ranked by its coordinate", "[comm][mesh]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  // At 4 ranks: 2x1x2 (dp x pp x tp) and 1x2x2; at 2 ranks: 1x1x2 and 2x1x1.
  std::vector<comm::DeviceMesh> meshes = n == 4 ? std::vector<comm::DeviceMesh>{{2, 1, 2}, {1, 2, 2}}
                                                : std::vector<comm::DeviceMesh>{{1, 1, n}, {n, 1, 1}};
  for (const auto& mesh : meshes) {
    INFO("mesh dp " << mesh.dp() << " pp " << mesh.pp() << " tp " << mesh.tp());
    auto g = comm::create_mesh_groups(mesh, *pg);
    CHECK(g.coord == mesh.coord_of(r));
    CHECK(mesh.rank_of(g.coord) == r);
    const std::pair<std::shared_ptr<comm::ProcessGroup>, std::vector<int>> axes[] = {
        {g.tp, mesh.tp_ranks(r)}, {g.pp, mesh.pp_ranks(r)}, {g.dp, mesh.dp_ranks(r)}};
    const int coord[] = {g.coord.tp, g.coord.pp, g.coord.dp};
    for (int a = 0; a < 3; ++a) {
      auto& [group, ranks] = axes[a];
      CHECK(group->size() == int(ranks.size()));
      CHECK(group->rank() == coord[a]);
      // Gathering the world ranks proves who is in the group, and in which order.
      Tensor who = zeros({int64_t(ranks.size())}, DType::i32);
      group->all_gather(who, full({1}, r, DType::i32))->wait();
      CHECK(to_vector<int32_t>(who) == std::vector<int32_t>(ranks.begin(), ranks.end()));
    }
  }
}

TEST_CASE("byte counters equal the standard algorithms' volumes for a known sequence of calls", "[comm]") {
  auto pg = world();
  const int64_t n = pg->size();
  const int r = pg->rank();
  pg->reset_counters();
  pg->all_reduce(filled(r, 1001, DType::f32));                              // 4004 B
  pg->all_reduce(filled(r, 7, DType::bf16), ReduceOp::avg);                 // 14 B
  pg->reduce_scatter(zeros({7}, DType::f64), filled(r, 7 * n, DType::f64)); // in: 56n B
  pg->all_gather(zeros({3 * n}, DType::i64), filled(r, 3, DType::i64));     // out: 24n B
  pg->broadcast(filled(r, 5, DType::f16), 0);                               // 10 B
  pg->reduce(filled(r, 11, DType::i32), int(n - 1));                        // 44 B
  auto s = pg->send(filled(r, 13, DType::f32), int((r + 1) % n));           // 52 B
  auto q = pg->recv(zeros({13}), int((r + n - 1) % n));
  pg->barrier()->wait();
  q->wait();
  s->wait();
  auto c = pg->counters();
  CHECK(c[CommKind::all_reduce] == comm::KindCount{2, 2 * (n - 1) * 4004 / n + 2 * (n - 1) * 14 / n});
  CHECK(c[CommKind::reduce_scatter] == comm::KindCount{1, (n - 1) * 56});
  CHECK(c[CommKind::all_gather] == comm::KindCount{1, (n - 1) * 24});
  CHECK(c[CommKind::broadcast] == comm::KindCount{1, 10});
  CHECK(c[CommKind::reduce] == comm::KindCount{1, 44});
  CHECK(c[CommKind::send] == comm::KindCount{1, 52});
  CHECK(c[CommKind::recv] == comm::KindCount{1, 52});
  CHECK(c[CommKind::barrier] == comm::KindCount{1, 0});
  CHECK(c.sent_bytes() == c.to_json()["all_reduce"]["bytes"].get<int64_t>() + (n - 1) * 80 + 10 + 44 + 52);
  CHECK(c.to_json()["send"]["calls"] == 1);
  // A subgroup counts its own traffic; the parent's counters do not move.
  auto sub = pg->split(0, r);
  sub->all_reduce(filled(r, 8, DType::f32))->wait();
  CHECK(sub->counters()[CommKind::all_reduce] == comm::KindCount{1, 2 * (n - 1) * 32 / n});
  CHECK(pg->counters()[CommKind::all_reduce].calls == 2);
  pg->reset_counters();
  CHECK(pg->counters().sent_bytes() == 0);
}

TEST_CASE("bad arguments are refused before any communication, naming the op, shapes and rank", "[comm]") {
  auto pg = world();
  const int n = pg->size(), r = pg->rank();
  pg->reset_counters();
  const std::string at = " (rank " + std::to_string(r) + " of " + std::to_string(n) + ")";
  CHECK_THROWS_WITH(pg->reduce_scatter(zeros({3}), zeros({10})),
                    "reduce_scatter: input has 10 elements, not " + std::to_string(n) + " x 3 (output [3])" + at);
  CHECK_THROWS_WITH(pg->all_gather(zeros({5}), zeros({3})),
                    "all_gather: output has 5 elements, not " + std::to_string(n) + " x 3 (input [3])" + at);
  Tensor m = zeros({4, 6});
  CHECK_THROWS_WITH(pg->all_reduce(transpose(m, 0, 1)),
                    Catch::Contains("all_reduce: tensor f32[6,4] on cpu is not contiguous") && Catch::EndsWith(at));
  CHECK_THROWS_WITH(pg->all_reduce(zeros({3}, DType::i32), ReduceOp::avg), Catch::Contains("avg of i32[3] on cpu"));
  CHECK_THROWS_WITH(pg->send(zeros({3}), r, 0), "send: destination " + std::to_string(r) + " is this rank" + at);
  CHECK_THROWS_WITH(pg->broadcast(zeros({3}), n), Catch::StartsWith("broadcast: root " + std::to_string(n) + " is not a rank"));
  CHECK_THROWS_WITH(pg->reduce_scatter(zeros({3}, DType::f64), zeros({3 * n})), Catch::Contains("differ in dtype"));
  CHECK_THROWS_WITH(pg->new_group({0, 0}), Catch::Contains("rank 0 is listed twice"));
  CHECK(pg->counters().sent_bytes() == 0);
  CHECK(pg->counters()[CommKind::all_reduce].calls == 0);
}

TEST_CASE("an MPI failure surfaces from wait(), naming the op, the peer and the rank", "[comm]") {
  auto pg = world();
  const int r = pg->rank();
  if (r == 0) pg->send(zeros({10}), 1, 9)->wait();
  if (r == 1)
    CHECK_THROWS_WITH(pg->recv(zeros({5}), 0, 9)->wait(),
                      Catch::StartsWith("recv from 0, tag 9: MPI error: ") && Catch::EndsWith(" (rank 1 of " +
                                                                                          std::to_string(pg->size()) + ")"));
}
