#include "kernels/cuda/runtime.h"

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

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

namespace {

// Caching allocator: freed blocks are kept per (device, rounded size) and handed out again, so
// steady-state training does no cudaMalloc/cudaFree. Sizes round up to 512 B below 1 MiB and to
// 2 MiB above. Blocks are reused on the compute stream only, so stream order keeps reuse safe.
class CachingAllocator : public Allocator {
 public:
  void* allocate(size_t bytes, Device d) override {
    const size_t size = round(bytes);
    std::lock_guard<std::mutex> g(mu_);
    auto& pool = free_[{d.index, size}];
    if (!pool.empty()) {
      void* p = pool.back();
      pool.pop_back();
      return p;
    }
    const int visible = device_count();
    SG_CHECK(d.index < visible, "cuda allocator: ", d.str(), " is not available (", visible,
             " CUDA devices visible to this process)");
    SG_CUDA_CHECK(cudaSetDevice(d.index));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {  // give the cache back and try once more
      (void)cudaGetLastError();
      release_all_locked();
      err = cudaMalloc(&p, size);
    }
    SG_CHECK(err == cudaSuccess, "cuda allocator: cannot allocate ", bytes, " bytes on ", d.str(), ": ",
             cudaGetErrorString(err));
    return p;
  }
  void deallocate(void* p, size_t bytes, Device d) override {
    std::lock_guard<std::mutex> g(mu_);
    free_[{d.index, round(bytes)}].push_back(p);
  }

 private:
  static size_t round(size_t b) {
    if (b == 0) b = 1;
    const size_t q = b < (size_t(1) << 20) ? 512 : (size_t(2) << 20);
    return (b + q - 1) / q * q;
  }
  void release_all_locked() {
    for (auto& [key, blocks] : free_)
      for (void* p : blocks) cudaFree(p);
    free_.clear();
  }
  std::mutex mu_;
  std::map<std::pair<int, size_t>, std::vector<void*>> free_;
};

void to_host(void* host_dst, const void* dev_src, size_t bytes, Device d) {
  SG_CUDA_CHECK(cudaSetDevice(d.index));
  cudaStream_t s = compute_stream(d);
  SG_CUDA_CHECK(cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost, s));
  SG_CUDA_CHECK(cudaStreamSynchronize(s));
}

void from_host(void* dev_dst, const void* host_src, size_t bytes, Device d) {
  SG_CUDA_CHECK(cudaSetDevice(d.index));
  cudaStream_t s = compute_stream(d);
  SG_CUDA_CHECK(cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice, s));
  SG_CUDA_CHECK(cudaStreamSynchronize(s));  // the host buffer may be freed right after
}

}  // namespace

Device device_of(const void* p, const char* op) {
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

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_allocator(DeviceType::cuda, new CachingAllocator());
    static kernels::OpTable t;
    t.device_name = "cuda";
    t.copy_to_host = to_host;
    t.copy_from_host = from_host;
#ifdef SG_CUDA_KERNELS
    fill_kernel_table(t);
    t.gemm = gemm;
#endif
    // Without SG_CUDA_KERNELS every other op on a cuda tensor fails naming the op and the device.
    kernels::register_table(DeviceType::cuda, &t);
  });
}

}  // namespace sg::cuda
