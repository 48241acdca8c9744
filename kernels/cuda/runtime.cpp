#include "kernels/cuda/runtime.h"

#include <atomic>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/block_cache.h"
#include "core/storage.h"
#include "kernels/ops.h"

namespace sg::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string device_name(Device d) {
  cudaDeviceProp prop{};
  SG_CUDA_CHECK(cudaGetDeviceProperties(&prop, d.index));
  return prop.name;
}

namespace {

// What a BlockCache wants from a raw allocation that wrote *p and returned err: *p, or nullptr when
// the driver is out of memory (the sticky error cleared); any other failure throws. (p is read
// here, after the call, not passed by value beside it: argument order is unspecified.)
void* null_if_out_of_memory(cudaError_t err, void* const* p) {
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  SG_CUDA_CHECK(err);
  return *p;
}

// The first device this process allocated on: page-locked host memory is allocated with it
// current, so a thread that never chose a device (MPI's progress thread) does not create a
// context on cuda:0 (hundreds of MB there, for every rank of a multi-GPU job). It stays current on
// that thread afterwards; op-table entries set their device from their pointers anyway.
std::atomic<int> g_device_in_use{-1};

// Device memory: cudaMalloc through a BlockCache, so steady-state training does no
// cudaMalloc/cudaFree. Every block is allocated, used and freed in the order of the compute
// stream; the NCCL backend's communication stream is ordered after it by events and its Work
// holds the tensors it uses until its completion event, so a block is never handed out again
// while another stream may still touch it.
class DeviceAllocator : public Allocator {
 public:
  DeviceAllocator()
      : cache_(
            [](size_t bytes, int device) -> void* {
              SG_CUDA_CHECK(cudaSetDevice(device));
              void* p = nullptr;
              return null_if_out_of_memory(cudaMalloc(&p, bytes), &p);
            },
            [](void* p, int device) {  // out of memory, or trimming: not on a hot path
              SG_CUDA_CHECK(cudaSetDevice(device));
              // Queued kernels may still use the block (cudaFree only *may* wait); an earlier
              // kernel's fault surfaces here and is thrown, not swallowed.
              SG_CUDA_CHECK(cudaDeviceSynchronize());
              SG_CUDA_CHECK(cudaFree(p));
            }) {}
  void* allocate(size_t bytes, Device d) override {
    static const int visible = device_count();  // fixed for the life of the process
    SG_CHECK(d.index < visible, "cuda allocator: ", d.str(), " is not available (", visible,
             " CUDA devices visible to this process)");
    int none = -1;
    g_device_in_use.compare_exchange_strong(none, d.index);
    void* p = cache_.take(bytes, d.index);
    SG_CHECK(p, "cuda allocator: cannot allocate ", bytes, " bytes on ", d.str(), ": out of memory (",
             cache_.reserved_bytes(), " bytes already held by shardgrad's cache)");
    return p;
  }
  void deallocate(void* p, size_t bytes, Device d) override { cache_.give(p, bytes, d.index); }
  std::optional<int> owner(const void* p) const { return cache_.owner(p); }

 private:
  BlockCache cache_;
};

// Page-locked host memory: cudaHostAlloc through a BlockCache (registering host memory is slow,
// milliseconds, and synchronises the device). Host copies to and from it are synchronous here,
// so a freed block is idle by the time it is handed out again.
class PinnedAllocator : public Allocator {
 public:
  PinnedAllocator()
      : cache_(
            [](size_t bytes, int) -> void* {
              if (const int d = g_device_in_use.load(); d >= 0) SG_CUDA_CHECK(cudaSetDevice(d));
              void* p = nullptr;
              return null_if_out_of_memory(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), &p);
            },
            [](void* p, int) { SG_CUDA_CHECK(cudaFreeHost(p)); }) {}
  void* allocate(size_t bytes, Device) override {
    void* p = cache_.take(bytes, 0);
    SG_CHECK(p, "pinned host allocator: cannot page-lock ", bytes, " bytes (", cache_.reserved_bytes(),
             " bytes already held); lower the pinned memory use or raise the locked-memory limit (ulimit -l)");
    return p;
  }
  void deallocate(void* p, size_t bytes, Device) override { cache_.give(p, bytes, 0); }

 private:
  BlockCache cache_;
};

DeviceAllocator* device_allocator() {
  static auto* a = new DeviceAllocator();  // kept for the process: blocks may be freed at exit
  return a;
}

void to_host(void* host_dst, const void* dev_src, size_t bytes, Device d) {
  SG_CUDA_CHECK(cudaSetDevice(d.index));
  SG_CUDA_CHECK(cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost, compute_stream(d)));
  sync(d);
}

void from_host(void* dev_dst, const void* host_src, size_t bytes, Device d) {
  SG_CUDA_CHECK(cudaSetDevice(d.index));
  SG_CUDA_CHECK(cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice, compute_stream(d)));
  sync(d);  // the host buffer may be freed right after
}

// One device's deferred checks: slot i of dev belongs to pending[i]. Outside the ledger (1 KB per
// device for the life of the process), so the ledger's figures stay the model's.
struct DeferredChecks {
  std::mutex mu;
  int* dev = nullptr;   // kDeferredChecks ints, zero except where a kernel counted into a pending slot
  int* host = nullptr;  // page-locked: sync() copies the pending slots here before it waits
  std::vector<std::function<std::string(int)>> pending;
  std::vector<std::string> failed;  // read back by a thread that does not report them, in queue order
};

DeferredChecks& deferred(Device d) {
  return *once_per_device<DeferredChecks*>(d, [&] {
    SG_CUDA_CHECK(cudaSetDevice(d.index));
    auto* c = new DeferredChecks();  // kept for the process, like the streams
    SG_CUDA_CHECK(cudaMalloc(&c->dev, kDeferredChecks * sizeof(int)));
    // on the compute stream (non-blocking: the legacy stream's memset would not be ordered before
    // the first kernel that counts)
    SG_CUDA_CHECK(cudaMemsetAsync(c->dev, 0, kDeferredChecks * sizeof(int), compute_stream(d)));
    SG_CUDA_CHECK(cudaMallocHost(&c->host, kDeferredChecks * sizeof(int)));
    return c;
  });
}
}  // namespace

Device device_of(const void* p, const char* op) {
  if (const std::optional<int> d = device_allocator()->owner(p)) {  // no driver query for our own blocks
    SG_CUDA_CHECK(cudaSetDevice(*d));
    return Device::cuda(*d);
  }
  cudaPointerAttributes at{};
  const cudaError_t err = cudaPointerGetAttributes(&at, p);
  if (err != cudaSuccess) (void)cudaGetLastError();
  SG_CHECK(err == cudaSuccess && at.type == cudaMemoryTypeDevice, op, " (cuda): pointer ", p,
           " is not CUDA device memory");
  SG_CUDA_CHECK(cudaSetDevice(at.device));
  return Device::cuda(at.device);
}

cudaStream_t compute_stream(Device d) {
  return once_per_device<cudaStream_t>(d, [&] {
    SG_CUDA_CHECK(cudaSetDevice(d.index));
    cudaStream_t s;
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  });
}

StreamMarks::~StreamMarks() {
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);  // never throws from a destructor
}

int StreamMarks::mark() {
  SG_CUDA_CHECK(cudaSetDevice(d_.index));
  if (used_ == int(events_.size())) {
    cudaEvent_t e;
    SG_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  SG_CUDA_CHECK(cudaEventRecord(events_[size_t(used_)], compute_stream(d_)));
  return used_++;
}

float StreamMarks::elapsed_ms(int a, int b) {
  SG_CHECK(a >= 0 && b >= 0 && a < used_ && b < used_, "StreamMarks: no mark ", a, " or ", b, " (", used_, " queued)");
  SG_CUDA_CHECK(cudaEventSynchronize(events_[size_t(b)]));
  float ms = 0;
  SG_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[size_t(a)], events_[size_t(b)]));
  return ms;
}

DeferredCheck deferred_check(Device d, std::function<std::string(int)> message) {
  DeferredChecks& c = deferred(d);
  std::unique_lock<std::mutex> lock(c.mu);
  while (c.pending.size() == size_t(kDeferredChecks)) {  // every slot pending: wait once, then take slot 0
    lock.unlock();
    sync(d);
    lock.lock();  // (another thread may have refilled them meanwhile: look again)
  }
  c.pending.push_back(std::move(message));
  return DeferredCheck(c.dev + (c.pending.size() - 1), std::move(lock));
}

void sync(Device d) {
  SG_CUDA_CHECK(cudaSetDevice(d.index));
  const cudaStream_t s = compute_stream(d);
  DeferredChecks& c = deferred(d);
  std::lock_guard<std::mutex> lock(c.mu);
  const size_t n = c.pending.size();
  if (n) SG_CUDA_CHECK(cudaMemcpyAsync(c.host, c.dev, n * sizeof(int), cudaMemcpyDeviceToHost, s));
  SG_CUDA_CHECK(cudaStreamSynchronize(s));
  if (n) {
    SG_CUDA_CHECK(cudaMemsetAsync(c.dev, 0, n * sizeof(int), s));  // before any later kernel counts again
    for (size_t i = 0; i < n; ++i)
      if (const int count = c.host[i]) c.failed.push_back(c.pending[i](count));
    c.pending.clear();
  }
  if (c.failed.empty() || !reports_device_errors()) return;
  const std::string what = c.failed.front();
  c.failed.clear();
  throw Error(str(what, " (found at the host's next wait for ", d.str(),
                  ": the op ran asynchronously, before the call that reports it)"));
}

bool has_mma_sync(Device d) {
  return once_per_device<bool>(d, [&] {
    int major = 0;
    SG_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d.index));
    return major >= 8;
  });
}

namespace {
std::atomic<AttentionBackend> g_attention{AttentionBackend::flash};
}

void set_attention_backend(AttentionBackend b) {
  if (b == AttentionBackend::cudnn) {
#ifndef SG_CUDA_KERNELS
    throw Error("attention (cudnn): this build has no CUDA kernels (SG_CUDA_KERNELS is off: nvcc was not found "
                "or -DSG_CUDA_KERNELS=OFF)");
#elif !defined(SG_WITH_CUDNN)
    throw Error("attention (cudnn): this build has no cuDNN (CMake found no libcudnn and cudnn.h next to the CUDA "
                "toolkit); use --attention flash");
#endif
  }
  g_attention = b;
}

AttentionBackend attention_backend() { return g_attention; }

namespace {
std::atomic<NormBackward> g_norm_backward{NormBackward::fused};
std::atomic<Classifier> g_classifier{Classifier::streaming};
std::atomic<EmbeddingBackward> g_embedding_backward{EmbeddingBackward::columns};
std::atomic<FlashBackward> g_flash_backward{FlashBackward::free};
std::atomic<FlashForward> g_flash_forward{FlashForward::keys32};
}  // namespace

void set_norm_backward(NormBackward kind) { g_norm_backward = kind; }
NormBackward norm_backward() { return g_norm_backward; }
void set_classifier(Classifier kind) { g_classifier = kind; }
Classifier classifier() { return g_classifier; }
void set_embedding_backward_kind(EmbeddingBackward kind) { g_embedding_backward = kind; }
EmbeddingBackward embedding_backward_kind() { return g_embedding_backward; }
void set_flash_backward_kind(FlashBackward kind) { g_flash_backward = kind; }
FlashBackward flash_backward_kind() { return g_flash_backward; }
void set_flash_forward_kind(FlashForward kind) { g_flash_forward = kind; }
FlashForward flash_forward_kind() { return g_flash_forward; }

void allow_dynamic_shared(const void* kernel, size_t shmem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;  // (kernel, device) -> bytes
  int device = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = allowed[{kernel, device}];
  if (have >= shmem) return;
  // Without the attribute a block gets 48 KiB in all, its static shared memory included: a kernel
  // with static arrays needs it below 48 KiB of dynamic.
  cudaFuncAttributes attr{};
  SG_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (shmem + attr.sharedSizeBytes > 48 * 1024)
    SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  have = shmem;
}

namespace {
// The variant named by the environment variable var, if set, through set; refused naming the
// variable and the names it takes.
template <class E>
void variant_from_env(const char* var, std::initializer_list<E> all, void (*set)(E)) {
  const char* e = std::getenv(var);
  if (!e || !*e) return;
  std::string names;
  for (E k : all) {
    if (std::string(e) == name(k)) return set(k);
    names += (names.empty() ? "" : ", ") + std::string(name(k));
  }
  throw Error(str(var, "=", e, ": not a variant; one of ", names, " (kernels/cuda/variants.h)"));
}
}  // namespace

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A whole run's variants, for timing them end to end (scripts/gpu_check.sh).
    variant_from_env("SG_NORM_BACKWARD",
                     {NormBackward::fused, NormBackward::smem, NormBackward::smem_ahead, NormBackward::split},
                     &set_norm_backward);
    variant_from_env("SG_CLASSIFIER", {Classifier::streaming, Classifier::staged, Classifier::reversed},
                     &set_classifier);
    variant_from_env("SG_EMBEDDING_BACKWARD", {EmbeddingBackward::columns, EmbeddingBackward::packs},
                     &set_embedding_backward_kind);
    variant_from_env("SG_FLASH_BACKWARD", {FlashBackward::free, FlashBackward::dq_three, FlashBackward::three},
                     &set_flash_backward_kind);
    variant_from_env("SG_FLASH_FORWARD", {FlashForward::keys32, FlashForward::keys64}, &set_flash_forward_kind);
#ifdef SG_WITH_CUDNN
    variant_from_env("SG_DQ_ACCUMULATOR", {DqAccumulator::memset, DqAccumulator::engine, DqAccumulator::poisoned},
                     &set_dq_accumulator);
#endif
    register_allocator(DeviceType::cuda, device_allocator());
    if (device_count() > 0) register_pinned_allocator(new PinnedAllocator());
    static kernels::OpTable t;
    t.device_name = "cuda";
    t.copy_to_host = to_host;
    t.copy_from_host = from_host;
#ifdef SG_CUDA_KERNELS
    fill_kernel_table(t);
#endif
    // Without SG_CUDA_KERNELS every other op on a cuda tensor fails naming the op and the device.
    kernels::register_table(DeviceType::cuda, &t);
  });
}

}  // namespace sg::cuda
