#include "parallel/comm/nccl_backend.h"

#include <cstdlib>
#include <utility>

#include "core/error.h"

// ---- the launcher's environment (any build) ----

namespace sg::comm {

namespace {
// The variable as a non-negative integer; -1 when it is not set.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  SG_CHECK(*end == 0 && x >= 0 && x <= (1L << 30), "--rendezvous file: ", name, "='", v,
           "' is not a non-negative integer");
  return int(x);
}
}  // namespace

LaunchEnv launch_env() {
  LaunchEnv e;
  e.rank = env_int("RANK");
  e.world_size = env_int("WORLD_SIZE");
  e.local_rank = env_int("LOCAL_RANK");
  for (auto [name, v] : {std::pair{"RANK", e.rank}, std::pair{"WORLD_SIZE", e.world_size}})
    SG_CHECK(v >= 0, "--rendezvous file: needs ", name, " in the environment (set by the launcher: torchrun, "
             "or by hand for each process)");
  SG_CHECK(e.world_size >= 1, "--rendezvous file: WORLD_SIZE must be >= 1, got 0");
  SG_CHECK(e.rank < e.world_size, "--rendezvous file: RANK ", e.rank, " is not below WORLD_SIZE ", e.world_size);
  return e;
}

}  // namespace sg::comm

#ifdef SG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
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
class StreamWork : public Work {
 public:
  StreamWork(cudaEvent_t e, int device, std::vector<Tensor> held, std::vector<Staged> results)
      : event_(e), device_(device), held_(std::move(held)), results_(std::move(results)) {}
  ~StreamWork() override {
    // A destructor cannot throw: an error here was already raised by wait()/test(), or the
    // process is going down with the communicator.
    if (!held_.empty() && !done_) (void)cudaEventSynchronize(event_);
    (void)cudaEventDestroy(event_);
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    SG_CUDA_CHECK(cudaSetDevice(device_));
    SG_CUDA_CHECK(cudaEventSynchronize(event_));
    complete();
  }
  bool test() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    SG_CUDA_CHECK(e);
    complete();
    return true;
  }

 private:
  void complete() {
    for (auto& r : results_) copy_(r.host, r.device);  // device -> host, synchronous
    results_.clear();
    held_.clear();
    done_ = true;
  }
  std::mutex mu_;
  cudaEvent_t event_;
  int device_;
  std::vector<Tensor> held_;
  std::vector<Staged> results_;
  bool done_ = false;
};

}  // namespace

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(ncclComm_t comm, int rank, int size, int device) : ProcessGroup(rank, size), comm_(comm), device_(device) {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclProcessGroup() override {
    // Destructors cannot throw; the errors a finished job could meet here change nothing.
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    (void)ncclCommDestroy(comm_);
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
      return t.data_ptr();
    }

   private:
    friend class NcclProcessGroup;
    const NcclProcessGroup& g_;
    std::vector<Tensor> held_;
    std::vector<Staged> results_;
  };

  // Orders the communication stream after everything issued so far on the compute stream, runs
  // `issue` there, and returns a Work on its completion (which copies staged results back).
  template <class F>
  std::shared_ptr<Work> on_stream(Operands& ops, F issue) {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    cudaStream_t compute = cuda::compute_stream(Device::cuda(device_));
    cudaEvent_t ready, done;
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(ready, compute));
    SG_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    SG_CUDA_CHECK(cudaEventDestroy(ready));
    issue();
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(done, stream_));
    return std::make_shared<StreamWork>(done, device_, std::move(ops.held_), std::move(ops.results_));
  }
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
    Operands ops(*this);
    void* p = ops.add(t, true, false);
    return on_stream(ops, [&] { SG_NCCL_CHECK(ncclSend(p, size_t(t.numel()), nccl_type(t.dtype()), dst, comm_, stream_)); });
  }
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int) override {
    Operands ops(*this);
    void* p = ops.add(t, false, true);
    return on_stream(ops, [&] { SG_NCCL_CHECK(ncclRecv(p, size_t(t.numel()), nccl_type(t.dtype()), src, comm_, stream_)); });
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
};

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

std::shared_ptr<ProcessGroup> nccl_world_from_file(const std::string& path, int device, double timeout_s) {
  const LaunchEnv env = launch_env();
  ncclUniqueId id;
  if (env.rank == 0) {
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
  } else {
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      std::ifstream f(path, std::ios::binary);
      if (f.good() && f.read(reinterpret_cast<char*>(&id), sizeof id) && f.gcount() == sizeof id) break;
      SG_CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s,
               "--rendezvous file:", path, ": rank ", env.rank, " waited ", timeout_s, " s for the id from rank 0");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  auto world = init_with_id(id, env.rank, env.world_size, device);
  // ncclCommInitRank returns once every rank has joined, so every rank has read the id.
  if (env.rank == 0) std::filesystem::remove(path);
  return world;
}

bool nccl_available() { return cuda::device_count() > 0; }

}  // namespace sg::comm

#else  // built without NCCL

namespace sg::comm {

std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup&, int) {
  throw Error("nccl: this shardgrad was built without CUDA/NCCL (configure on a machine with the CUDA toolkit)");
}
std::shared_ptr<ProcessGroup> nccl_world_from_file(const std::string&, int, double) {
  throw Error("--rendezvous: this shardgrad was built without CUDA/NCCL");
}
bool nccl_available() { return false; }
}  // namespace sg::comm

#endif

