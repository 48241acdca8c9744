#include "parallel/comm/nccl_backend.h"

#include <cstdlib>
#include <utility>

#include "core/error.h"

#ifdef SG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <functional>
#include <thread>
#include <vector>

#include "autograd/ops.h"
#include "kernels/cuda/runtime.h"

#define SG_NCCL_CHECK(call)                                                                                  \
  do {                                                                                                       \
    ncclResult_t sg_r_ = (call);                                                                             \
    if (sg_r_ != ncclSuccess)                                                                                \
      throw ::sg::Error(::sg::str(#call, " failed: ", ncclGetErrorString(sg_r_), " (", __FILE__, ":", __LINE__, ")")); \
  } while (0)

namespace sg::comm {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

// A CPU tensor's stand-in on the group's device (comm_buffer): copied in when the operation
// reads it, copied back by the Work when the operation writes it.
struct Staged {
  Tensor host, device;
};

// One operation on the communication stream: its completion event, the device copies of CPU
// tensors it uses (held until the event has passed, since the caching allocator would otherwise
// hand their blocks to the compute stream while NCCL still uses them), and the results to copy
// back to the host once, by whichever of wait() and test() first sees the event done.
//
// Waiting polls the event and, between polls, the communicator's asynchronous error state: a
// peer that died or a network failure makes NCCL report an error instead of completing, and the
// communicator is then aborted (its kernels stop; it can no longer be used or destroyed) and the
// error thrown, instead of a wait that never returns (the watchdog's timeout remains the last
// resort for a peer that is merely stuck).
class StreamWork : public Work {
 public:
  StreamWork(cudaEvent_t e, int device, ncclComm_t comm, std::shared_ptr<std::atomic<bool>> aborted,
             std::vector<Tensor> held, std::vector<Staged> results)
      : event_(e), device_(device), comm_(comm), aborted_(std::move(aborted)), held_(std::move(held)),
        results_(std::move(results)) {}
  ~StreamWork() override {
    // A destructor cannot throw: an error here was already raised by wait()/test(), or the
    // process is going down with the communicator. While an error unwinds the stack the operation
    // may wait for a peer that will never join it (the group then aborts its communicator): no
    // wait, and its tensors are parked for good rather than handed back to the allocator while a
    // kernel may still use them.
    if (!held_.empty() && !done_ && !aborted_->load()) {
      // A wait that fails (a kernel fault) proves nothing about the operation: parked as well.
      if (std::uncaught_exceptions() != 0 || cudaEventSynchronize(event_) != cudaSuccess) {
        static std::mutex parked_mu;
        static std::vector<Tensor>* parked = new std::vector<Tensor>;  // never freed
        std::lock_guard<std::mutex> lock(parked_mu);
        parked->insert(parked->end(), held_.begin(), held_.end());
      } else {
        // Done, but dropped unwaited: its results still reach their CPU tensors, as the MPI
        // backend's dropped receives do (a copy that fails here has nobody to tell).
        try {
          for (auto& r : results_) copy_(r.host, r.device);
        } catch (...) {
        }
      }
    }
    (void)cudaEventDestroy(event_);
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    SG_CUDA_CHECK(cudaSetDevice(device_));
    // Spins for the first 50 us (a sleep lasts ~50 us on Linux, longer than many collectives
    // take), then sleeps between polls.
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    for (;;) {
      const cudaError_t e = cudaEventQuery(event_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) SG_CUDA_CHECK(e);
      check_async();
      if (std::chrono::steady_clock::now() > spin_until) std::this_thread::sleep_for(std::chrono::microseconds(10));
    }
    complete();
  }
  bool test() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) {
      check_async();
      return false;
    }
    SG_CUDA_CHECK(e);
    complete();
    return true;
  }

 private:
  void check_async() {
    if (aborted_->load()) throw Error("nccl: the communicator was aborted after an earlier error; this operation cannot complete");
    ncclResult_t r = ncclSuccess;
    SG_NCCL_CHECK(ncclCommGetAsyncError(comm_, &r));
    if (r == ncclSuccess || r == ncclInProgress) return;
    const std::string detail = ncclGetLastError(comm_);
    if (!aborted_->exchange(true)) (void)ncclCommAbort(comm_);
    throw Error(str("nccl: a collective or transfer failed asynchronously: ", ncclGetErrorString(r),
                    detail.empty() ? std::string() : " (" + detail + ")",
                    "; the communicator was aborted (a peer may have died or lost its network)"));
  }
  void complete() {
    for (auto& r : results_) copy_(r.host, r.device);  // device -> host, synchronous
    results_.clear();
    held_.clear();
    done_ = true;
  }
  std::mutex mu_;
  cudaEvent_t event_;
  int device_;
  ncclComm_t comm_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  std::vector<Tensor> held_;
  std::vector<Staged> results_;
  bool done_ = false;
};

}  // namespace

class NcclProcessGroup;

namespace {

// A send whose NCCL call is not issued yet (NcclProcessGroup::do_send): the StreamWork arrives
// when the group issues it; wait() issues it first if it is still pending. test() never does: a
// send issued alone, outside the group with this rank's next recv, could wait on a peer that
// sends to this rank first (the pipeline polls its sends between actions).
class DeferredWork : public Work {
 public:
  explicit DeferredWork(NcclProcessGroup* g) : g_(g) {}
  void wait() override;
  bool test() override;
  void issued(std::shared_ptr<Work> w) {
    std::lock_guard<std::mutex> lock(mu_);
    inner_ = std::move(w);
  }

 private:
  std::shared_ptr<Work> inner();
  NcclProcessGroup* g_;
  std::mutex mu_;
  std::shared_ptr<Work> inner_;
};

}  // namespace

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(ncclComm_t comm, int rank, int size, int device) : ProcessGroup(rank, size), comm_(comm), device_(device) {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclProcessGroup() override {
    // Destructors cannot throw; the errors a finished job could meet here change nothing. While an
    // error unwinds the stack, the peers may never match what is pending or running (a pipeline
    // recv, a collective): flushing, synchronising or destroying would wait for them and hide the
    // error behind the watchdog's timeout, so the communicator is aborted instead.
    if (std::uncaught_exceptions() > 0 && !aborted_->exchange(true)) (void)ncclCommAbort(comm_);
    if (!aborted_->load()) {
      try {
        flush_sends();
      } catch (...) {
      }
    }
    (void)cudaSetDevice(device_);
    if (!aborted_->load()) {  // an aborted communicator's kernels were stopped; it is freed already
      (void)cudaStreamSynchronize(stream_);
      (void)ncclCommDestroy(comm_);
    }
    (void)cudaStreamDestroy(stream_);
  }
  std::string backend_name() const override { return "nccl"; }

 protected:
  // The tensors of one operation, each as NCCL will see it: a CUDA tensor of this group's device
  // as it is, a CPU tensor through a device copy (Staged).
  class Operands {
   public:
    Operands(const NcclProcessGroup& g) : g_(g) {}
    // `reads`: the operation reads t (copy it in); `writes`: it writes t on this rank (copy back).
    void* add(const Tensor& t, bool reads, bool writes) {
      if (t.device().is_cpu()) {
        Tensor d;
        {
          MemScope scope(MemCategory::comm_buffer);
          d = Tensor::empty(t.shape(), t.dtype(), Device::cuda(g_.device_));
        }
        if (reads) copy_(d, t);  // host -> device on the compute stream, which the collective waits for
        held_.push_back(d);
        if (writes) results_.push_back({t, d});
        return d.data_ptr();
      }
      SG_CHECK(t.device().is_cuda() && t.device().index == g_.device_, "nccl: tensor ", t.describe(),
               " is neither on the CPU nor on this group's device cuda:", g_.device_, g_.at());
      held_.push_back(t);  // its block stays out of the allocator's reach until NCCL is done with it
      return t.data_ptr();
    }

   private:
    friend class NcclProcessGroup;
    const NcclProcessGroup& g_;
    std::vector<Tensor> held_;
    std::vector<Staged> results_;
  };

  // Orders the communication stream after everything issued so far on the compute stream.
  void after_compute() {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    cudaStream_t compute = cuda::compute_stream(Device::cuda(device_));
    cudaEvent_t ready;
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(ready, compute));
    SG_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    SG_CUDA_CHECK(cudaEventDestroy(ready));
  }
  // A Work on the completion of what the communication stream holds so far (staged results are
  // copied back by it).
  std::shared_ptr<Work> done_work(Operands& ops) {
    cudaEvent_t done;
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(done, stream_));
    return std::make_shared<StreamWork>(done, device_, comm_, aborted_, std::move(ops.held_), std::move(ops.results_));
  }
  // Runs `issue` on the communication stream after the compute stream's work so far (and after
  // any pending sends), and returns a Work on its completion.
  template <class F>
  std::shared_ptr<Work> on_stream(Operands& ops, F issue) {
    check_usable();
    flush_sends();
    after_compute();
    issue();
    return done_work(ops);
  }

  // Point to point. An ncclSend blocks the communication stream until the peer's matching recv
  // runs, and ops on one stream run in order, so two ranks that each send before they receive
  // (1F1B's crossing activations and gradients, the tied embedding's exchange) would wait for
  // each other for ever. NCCL's rule: sends and recvs that must progress together go in one
  // ncclGroupStart/End. So a send is held back (its operands staged and held at once) and issued
  // in one group with this rank's next recv, or alone before any other operation and when its
  // Work is waited on or tested: MPI's non-blocking send semantics. NCCL matches point-to-point
  // messages by their order between two ranks; the tag is not used.
  struct PendingSend {
    Operands ops;
    void* p;
    size_t count;
    ncclDataType_t type;
    int dst;
    std::shared_ptr<DeferredWork> work;
  };
  // Issues every pending send, with `recv` (when given) in the same NCCL group.
  void issue_pending(const std::function<void()>& recv) {
    check_usable();
    std::vector<PendingSend> sends;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      sends.swap(pending_);
    }
    if (sends.empty() && !recv) return;
    after_compute();
    SG_NCCL_CHECK(ncclGroupStart());
    try {
      for (auto& s : sends) SG_NCCL_CHECK(ncclSend(s.p, s.count, s.type, s.dst, comm_, stream_));
      if (recv) recv();
    } catch (...) {
      (void)ncclGroupEnd();  // the group is closed whatever failed inside it
      throw;
    }
    SG_NCCL_CHECK(ncclGroupEnd());
    for (auto& s : sends) s.work->issued(done_work(s.ops));
  }
  void flush_sends() { issue_pending(nullptr); }
  // An aborted communicator is freed: nothing may be issued on it any more.
  void check_usable() const {
    SG_CHECK(!aborted_->load(), "nccl: this group's communicator was aborted after an earlier error; no further "
             "operation can run on it", at());
  }

 public:
  // DeferredWork's way in: issues its send (and any others pending) if it is still pending.
  void flush_pending_sends() { flush_sends(); }

 protected:
  std::shared_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override {
    Operands ops(*this);
    void* p = ops.add(t, true, true);
    return on_stream(ops, [&] {
      SG_NCCL_CHECK(ncclAllReduce(p, p, size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    Operands ops(*this);
    void* src = ops.add(in, true, false);
    void* dst = ops.add(out, false, true);
    return on_stream(ops, [&] {
      SG_NCCL_CHECK(ncclReduceScatter(src, dst, size_t(out.numel()), nccl_type(out.dtype()), nccl_op(op), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_all_gather(const Tensor& out, const Tensor& in) override {
    // Staged, an input that is the output's own chunk gets a copy of its own: NCCL takes
    // out-of-place as well as in-place.
    Operands ops(*this);
    void* src = ops.add(in, true, false);
    void* dst = ops.add(out, false, true);
    return on_stream(ops, [&] {
      SG_NCCL_CHECK(ncclAllGather(src, dst, size_t(in.numel()), nccl_type(in.dtype()), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) override {
    Operands ops(*this);
    void* p = ops.add(t, rank() == root, rank() != root);
    return on_stream(ops, [&] {
      SG_NCCL_CHECK(ncclBroadcast(p, p, size_t(t.numel()), nccl_type(t.dtype()), root, comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) override {
    Operands ops(*this);
    void* p = ops.add(t, true, rank() == root);  // the others' tensors are left as they were
    return on_stream(ops, [&] {
      SG_NCCL_CHECK(ncclReduce(p, p, size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op), root, comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_send(const Tensor& t, int dst, int) override {
    check_usable();
    PendingSend s{Operands(*this), nullptr, size_t(t.numel()), nccl_type(t.dtype()), dst,
                  std::make_shared<DeferredWork>(this)};
    s.p = s.ops.add(t, true, false);
    auto work = s.work;
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.push_back(std::move(s));
    return work;
  }
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int) override {
    Operands ops(*this);
    void* p = ops.add(t, false, true);
    issue_pending([&] { SG_NCCL_CHECK(ncclRecv(p, size_t(t.numel()), nccl_type(t.dtype()), src, comm_, stream_)); });
    return done_work(ops);
  }
  std::shared_ptr<Work> do_barrier() override {
    // A one-element all-reduce on the communication stream, waited for on the host; what it sums
    // is never read.
    Tensor one;
    {
      MemScope scope(MemCategory::comm_buffer);
      one = Tensor::empty({1}, DType::f32, Device::cuda(device_));
    }
    auto w = do_all_reduce(one, ReduceOp::sum);
    w->wait();
    return w;
  }
  std::shared_ptr<ProcessGroup> do_split(int color, int key) override {
    check_usable();
    flush_sends();
    ncclComm_t sub = nullptr;
    SG_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (color < 0) return nullptr;
    int r = 0, n = 0;
    SG_NCCL_CHECK(ncclCommUserRank(sub, &r));
    SG_NCCL_CHECK(ncclCommCount(sub, &n));
    return std::make_shared<NcclProcessGroup>(sub, r, n, device_);
  }

 private:
  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
  std::mutex pending_mu_;
  std::vector<PendingSend> pending_;
};

namespace {
std::shared_ptr<Work> DeferredWork::inner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inner_) return inner_;
  }
  g_->flush_pending_sends();
  std::lock_guard<std::mutex> lock(mu_);
  SG_CHECK(inner_, "nccl: internal: a pending send was not issued by the flush");
  return inner_;
}
void DeferredWork::wait() { inner()->wait(); }
bool DeferredWork::test() {
  std::shared_ptr<Work> w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = inner_;
  }
  return w && w->test();  // still pending: not done
}
}  // namespace

static std::shared_ptr<ProcessGroup> init_with_id(const ncclUniqueId& id, int rank, int size, int device) {
  SG_CHECK(device >= 0 && device < cuda::device_count(), "nccl: rank ", rank, " wants cuda:", device, " but ",
           cuda::device_count(), " CUDA devices are visible");
  SG_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm;
  SG_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  return std::make_shared<NcclProcessGroup>(comm, rank, size, device);
}

std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup& bootstrap, int device) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (bootstrap.rank() == 0) SG_NCCL_CHECK(ncclGetUniqueId(&id));
  static_assert(sizeof(ncclUniqueId) % 4 == 0, "the id travels as i32 words");
  std::vector<int32_t> words(sizeof id / 4);
  std::memcpy(words.data(), &id, sizeof id);
  Tensor t = from_vector(words, {int64_t(words.size())});
  bootstrap.broadcast(t, 0)->wait();
  std::memcpy(&id, t.data_ptr(), sizeof id);
  return init_with_id(id, bootstrap.rank(), bootstrap.size(), device);
}

namespace {
// Rank 0's id through the file (rendezvous.h); on the others, read once it is there.
ncclUniqueId id_from_file(const std::string& path, int rank, double timeout_s) {
  ncclUniqueId id;
  if (rank == 0) {
    SG_CHECK(!std::filesystem::exists(path), "--rendezvous file:", path, " already exists: a file left by an earlier "
             "job would hand the other ranks a dead id; remove it or give this job a fresh path");
    SG_NCCL_CHECK(ncclGetUniqueId(&id));
    std::string tmp = path + ".tmp-" + std::to_string(::getpid());
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(&id), sizeof id);
      f.close();
      SG_CHECK(f.good(), "--rendezvous file:", path, ": cannot write ", tmp);
    }
    std::filesystem::rename(tmp, path);  // others never see a partial id
    return id;
  }
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f.good() && f.read(reinterpret_cast<char*>(&id), sizeof id) && f.gcount() == sizeof id) return id;
    SG_CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s,
             "--rendezvous file:", path, ": rank ", rank, " waited ", timeout_s, " s for the id from rank 0");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Rank 0's id served over TCP to the ranks that connect (rendezvous.h's tcp_share).
ncclUniqueId id_over_tcp(const Rendezvous& how, const LaunchEnv& env, double timeout_s) {
  ncclUniqueId id;
  std::vector<uint8_t> bytes;
  if (env.rank == 0) {
    SG_NCCL_CHECK(ncclGetUniqueId(&id));
    bytes.resize(sizeof id);
    std::memcpy(bytes.data(), &id, sizeof id);
  }
  bytes = tcp_share(how.host, how.port, env.rank, env.world_size, bytes, sizeof id, timeout_s);
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}
}  // namespace

std::shared_ptr<ProcessGroup> nccl_world_from_rendezvous(const Rendezvous& how, int device, double timeout_s) {
  SG_CHECK(how.kind != Rendezvous::Kind::mpi, "nccl_world_from_rendezvous: --rendezvous mpi bootstraps over MPI "
           "(nccl_world)");
  const LaunchEnv env = launch_env(how);
  const ncclUniqueId id = how.kind == Rendezvous::Kind::file ? id_from_file(how.path, env.rank, timeout_s)
                                                             : id_over_tcp(how, env, timeout_s);
  auto world = init_with_id(id, env.rank, env.world_size, device);
  // ncclCommInitRank returns once every rank has joined, so every rank has read the id.
  if (env.rank == 0 && how.kind == Rendezvous::Kind::file) std::filesystem::remove(how.path);
  return world;
}

bool nccl_available() { return cuda::device_count() > 0; }

}  // namespace sg::comm

#else  // built without NCCL

namespace sg::comm {

std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup&, int) {
  throw Error("nccl: this shardgrad was built without CUDA/NCCL (configure on a machine with the CUDA toolkit)");
}
std::shared_ptr<ProcessGroup> nccl_world_from_rendezvous(const Rendezvous&, int, double) {
  throw Error("--rendezvous: this shardgrad was built without CUDA/NCCL");
}
bool nccl_available() { return false; }
}  // namespace sg::comm

#endif

