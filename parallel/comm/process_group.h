// ProcessGroup: the collectives every parallel strategy is built on, independent of the backend.
//
// All operations work in place on contiguous tensors and return a Work handle at once: the
// network is touched by wait(), never by the call (except that send/recv post their request).
// Every rank of a group must issue the group's collectives in the same order, as with MPI and NCCL.
// The public calls validate their arguments (naming the op, the shapes and this rank) and count
// bytes before handing the operation to the backend, so every backend counts the same way.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace sg::comm {

enum class ReduceOp : uint8_t { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

enum class CommKind : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, reduce, send, recv, barrier };
constexpr int kNumCommKinds = 8;
const char* comm_kind_name(CommKind k);

// What one rank put on the wire, per collective kind, by the standard algorithm's volume.
// With n = group size and B = bytes of the tensor named below (numel * dtype size), per call:
//   all_reduce      2(n-1)·B / n  (ring: reduce-scatter + all-gather; B = the tensor), rounded down
//   reduce_scatter  (n-1)·B / n   (B = the full input, n chunks; equals (n-1)·output bytes)
//   all_gather      (n-1)·B / n   (B = the full output; equals (n-1)·input bytes)
//   broadcast       B on every rank (pipelined chain: each rank forwards the buffer once)
//   reduce          B on every rank (the same chain run backwards)
//   send            B on the sender
//   recv            B on the receiver: the one kind that counts bytes received, not sent
//   barrier         calls only, 0 bytes
// With n == 1 nothing moves: collectives count their call and 0 bytes.
// Counted when the operation is issued (after validation), not when it completes.
struct KindCount {
  int64_t calls = 0;
  int64_t bytes = 0;
  bool operator==(const KindCount&) const = default;
};

struct CommCounters {
  std::array<KindCount, kNumCommKinds> kinds{};

  const KindCount& operator[](CommKind k) const { return kinds[size_t(k)]; }
  KindCount& operator[](CommKind k) { return kinds[size_t(k)]; }
  int64_t sent_bytes() const;  // every kind but recv
  // {"all_reduce": {"calls": 3, "bytes": 6006}, ...}: every kind, zeros included.
  nlohmann::json to_json() const;
};

int64_t all_reduce_bytes(int64_t tensor_bytes, int n);
int64_t reduce_scatter_bytes(int64_t input_bytes, int n);
int64_t all_gather_bytes(int64_t output_bytes, int n);

// How the caller uses an operation. async (the default): it keeps the Work and computes while the
// operation runs. blocking: the call returns once the operation has completed (its Work is done;
// an error is thrown from the call). A backend may run a blocking operation on the caller's
// thread: the MPI backend does, rather than wake its communication thread for it and be woken
// back (a fixed ~10 us in a VM, a tenth of a 1 MiB all-reduce).
enum class Sync : uint8_t { async, blocking };

// An operation in flight. wait() blocks until it has completed and rethrows its error, if any;
// test() never blocks. Both may be called any number of times.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend_name() const = 0;
  // The largest message tag send/recv take: MPI's MPI_TAG_UB (the standard guarantees only 32767;
  // Open MPI over UCX allows 2^23 - 1), or lower after limit_tags (tests: a smaller MPI's limit).
  int max_tag() const;
  void limit_tags(int max);

  // t = op over ranks of t. avg is refused for integer dtypes (it would not be exact).
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, Sync sync = Sync::async);
  // in has size() * out.numel() elements; rank r receives chunk r of the reduced input.
  std::shared_ptr<Work> reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::sum,
                                       Sync sync = Sync::async);
  // out has size() * in.numel() elements: every rank's in, concatenated in rank order.
  std::shared_ptr<Work> all_gather(const Tensor& out, const Tensor& in, Sync sync = Sync::async);
  std::shared_ptr<Work> broadcast(const Tensor& t, int root, Sync sync = Sync::async);
  // Only root's t receives the result; the others' tensors are left as they were.
  std::shared_ptr<Work> reduce(const Tensor& t, int root, ReduceOp op = ReduceOp::sum, Sync sync = Sync::async);
  // Point to point, non-blocking as MPI's Isend/Irecv: t must not change (send) or be read (recv)
  // before the Work completes. Messages between two ranks match in the order they were posted
  // (MPI also checks the tag; NCCL does not use it). On NCCL a send is issued with the rank's next
  // recv in one group, so ranks that both send before they receive do not wait on each other.
  // A Work dropped unfinished does not block (PyTorch's isend without wait): on MPI the request
  // finishes in the background and t must stay as it is (send) or unread (recv) until it has; a
  // dropped recv into a CUDA tensor is copied there when a later send, recv or barrier (or
  // comm::finalize) reaps it. Its errors are printed, not thrown.
  std::shared_ptr<Work> send(const Tensor& t, int dst, int tag = 0);
  std::shared_ptr<Work> recv(const Tensor& t, int src, int tag = 0);
  // Completes once every rank has reached it, after this rank's earlier operations.
  std::shared_ptr<Work> barrier(Sync sync = Sync::async);

  // Collective over this group (MPI_Comm_split): ranks with the same color form a subgroup,
  // ordered by key (ties by rank here). color < 0 means "in no subgroup" and returns nullptr.
  std::shared_ptr<ProcessGroup> split(int color, int key);
  // Collective over this group: a subgroup of the listed ranks (of this group), in list order;
  // ranks not listed get nullptr.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

  // Checked collectives (PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): before each collective the
  // ranks all-gather what they are about to call (kind, element count, dtype, op or root) and a
  // rank that differs is named on every rank, instead of mismatched buffers or a hang. Off by
  // default (one extra small all-gather per collective, not counted); on when the environment has
  // SHARDGRAD_CHECK_COLLECTIVES=1, or through this call (for every group of the process).
  static void check_collectives(bool on);
  static bool checking_collectives();
  // Every rank's copy of v (the same length on every rank), in rank order: a blocking all-gather
  // left out of the counters, for checks that the ranks agree (the checked collectives, the
  // pipeline's schedule). A backend that moves no values (sim) returns this rank's v in each slot.
  std::vector<std::vector<int64_t>> gather_uncounted(const std::vector<int64_t>& v);
  // Refuses, on every rank alike, parameters that differ across the group — in number, or a
  // parameter's name, dtype or shape — naming the first difference and the rank that has it
  // (PyTorch DDP's check of parameter shapes across processes). Data-parallel wrappers call it
  // before their first collective, which would otherwise mix mismatched buffers. Uncounted.
  void check_same_parameters(const char* who, const std::vector<std::pair<std::string, Tensor>>& params);
  // "rank 1", or "rank 1 (world rank 3)" in a group split off the world whose numbering differs:
  // how the watchdog's waits name a peer, so the stuck process can be found.
  std::string peer_name(int q) const;

  // Each group keeps its own counters; a subgroup's traffic is not added to its parent's.
  CommCounters counters() const;
  void reset_counters();

 protected:
  ProcessGroup(int rank, int size);
  // Backends implement these; arguments are already validated and counted.
  virtual std::shared_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_all_gather(const Tensor& out, const Tensor& in) = 0;
  virtual std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) = 0;
  virtual std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_send(const Tensor& t, int dst, int tag) = 0;
  virtual std::shared_ptr<Work> do_recv(const Tensor& t, int src, int tag) = 0;
  virtual std::shared_ptr<Work> do_barrier() = 0;
  virtual std::shared_ptr<ProcessGroup> do_split(int color, int key) = 0;
  // Why this group takes no more operations ("" while it does): checked before an operation is
  // counted, so a refused one never shows in the counters.
  virtual std::string closed_reason() const { return ""; }
  // The backend's own tag limit (INT_MAX where tags are not used, as on NCCL).
  virtual int backend_max_tag() const;

  // " (rank 1 of 4)": ends every error this group raises, so a log line names its rank.
  std::string at() const;

  // Inside a do_* call: whether the caller waits for this operation at once (Sync::blocking).
  static bool issuing_blocking();

 private:
  void check_tensor(const char* op, const char* name, const Tensor& t) const;
  // check_collectives: every rank calls the same collective on the same shape (detail: op or root).
  void check_same_call(CommKind k, int64_t numel, DType dtype, int64_t detail);
  int64_t checked_calls_ = 0;
  void check_peer(const char* op, const char* what, int peer, bool allow_self) const;
  void count(CommKind k, int64_t bytes);

  // "an all_gather among the 2 ranks of its group (world ranks [1,3])": what a rank waits in.
  std::string collective_name(CommKind k) const;
  // Collective over this (new) group: records every member's world rank when they differ from
  // the group's own numbering.
  void learn_world_ranks(int world_rank);

  int rank_, size_;
  int tag_limit_ = -1;  // limit_tags (-1: the backend's)
  std::vector<int> world_ranks_;  // by group rank; empty: the world's own numbering (or unknown)
  mutable std::mutex counters_mu_;
  CommCounters counters_;
};

}  // namespace sg::comm
