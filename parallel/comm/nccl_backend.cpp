#include "parallel/comm/nccl_backend.h"

#ifdef SG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

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

class EventWork : public Work {
 public:
  EventWork(cudaEvent_t e, int device) : event_(e), device_(device) {}
  ~EventWork() override { cudaEventDestroy(event_); }
  void wait() override {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    SG_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  bool test() override {
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    SG_CUDA_CHECK(e);
    return true;
  }

 private:
  cudaEvent_t event_;
  int device_;
};

}  // namespace

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(ncclComm_t comm, int rank, int size, int device) : ProcessGroup(rank, size), comm_(comm), device_(device) {
    SG_CUDA_CHECK(cudaSetDevice(device_));
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclProcessGroup() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  std::string backend_name() const override { return "nccl"; }

 protected:
  // Orders the communication stream after everything issued so far on the compute stream, runs
  // `issue` there, and returns a Work on its completion.
  template <class F>
  std::shared_ptr<Work> on_stream(const Tensor& t, F issue) {
    SG_CHECK(t.device().is_cuda() && t.device().index == device_, "nccl: tensor ", t.describe(),
             " is not on this group's device cuda:", device_, at());
    SG_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t ready, done;
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(ready, cuda::compute_stream(t.device())));
    SG_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    SG_CUDA_CHECK(cudaEventDestroy(ready));
    issue();
    SG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SG_CUDA_CHECK(cudaEventRecord(done, stream_));
    return std::make_shared<EventWork>(done, device_);
  }
  std::shared_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override {
    return on_stream(t, [&] {
      SG_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    return on_stream(out, [&] {
      SG_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(out.dtype()),
                                      nccl_op(op), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_all_gather(const Tensor& out, const Tensor& in) override {
    return on_stream(out, [&] {
      SG_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), nccl_type(in.dtype()), comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) override {
    return on_stream(t, [&] {
      SG_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), root, comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) override {
    return on_stream(t, [&] {
      SG_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op), root, comm_, stream_));
    });
  }
  std::shared_ptr<Work> do_send(const Tensor& t, int dst, int) override {
    return on_stream(t, [&] { SG_NCCL_CHECK(ncclSend(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), dst, comm_, stream_)); });
  }
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int) override {
    return on_stream(t, [&] { SG_NCCL_CHECK(ncclRecv(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), src, comm_, stream_)); });
  }
  std::shared_ptr<Work> do_barrier() override {
    // A one-element all-reduce on the communication stream, waited for on the host.
    Tensor one = to(from_vector<float>({1.0f}, {1}), Device::cuda(device_));
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

static int env_int(const char* name) {
  const char* v = std::getenv(name);
  SG_CHECK(v && *v, "--rendezvous file: needs ", name, " in the environment");
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  SG_CHECK(*end == 0 && x >= 0, "--rendezvous file: ", name, "='", v, "' is not a non-negative integer");
  return int(x);
}

std::shared_ptr<ProcessGroup> nccl_world_from_file(const std::string& path, double timeout_s) {
  const int rank = env_int("RANK"), size = env_int("WORLD_SIZE"), local = env_int("LOCAL_RANK");
  SG_CHECK(rank < size, "--rendezvous file: RANK ", rank, " >= WORLD_SIZE ", size);
  ncclUniqueId id;
  if (rank == 0) {
    SG_NCCL_CHECK(ncclGetUniqueId(&id));
    std::string tmp = path + ".tmp-" + std::to_string(::getpid());
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      SG_CHECK(f.good(), "--rendezvous file: cannot write ", tmp);
      f.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
    std::filesystem::rename(tmp, path);  // others never see a partial id
  } else {
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      std::ifstream f(path, std::ios::binary);
      if (f.good() && f.read(reinterpret_cast<char*>(&id), sizeof id) && f.gcount() == sizeof id) break;
      SG_CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s,
               "--rendezvous file: rank ", rank, " waited ", timeout_s, " s for ", path, " from rank 0");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return init_with_id(id, rank, size, local);
}

bool nccl_available() { return cuda::device_count() > 0; }

}  // namespace sg::comm

#else  // built without NCCL

namespace sg::comm {

std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup&, int) {
  throw Error("nccl: this shardgrad was built without CUDA/NCCL (configure on a machine with the CUDA toolkit)");
}
std::shared_ptr<ProcessGroup> nccl_world_from_file(const std::string&, double) {
  throw Error("--rendezvous: this shardgrad was built without CUDA/NCCL");
}
bool nccl_available() { return false; }
}  // namespace sg::comm

#endif
