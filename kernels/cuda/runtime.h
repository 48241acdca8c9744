// The CUDA runtime side of the backend: checked calls, device memory for the ledger (a caching
// allocator over plain cudaMalloc, never managed memory), host<->device copies, and the streams
// every launcher and the NCCL backend use. Built only when the CUDA toolkit is found.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "kernels/cuda/variants.h"
#include "kernels/ops.h"

#define SG_CUDA_CHECK(call)                                                                          \
  do {                                                                                               \
    cudaError_t sg_err_ = (call);                                                                    \
    if (sg_err_ != cudaSuccess)                                                                      \
      throw ::sg::Error(::sg::str(#call, " failed: ", cudaGetErrorString(sg_err_), " (", __FILE__, ":", \
                                  __LINE__, ")"));                                                   \
  } while (0)

namespace sg::cuda {

int device_count();  // 0 when there is no driver or no device (never throws)
std::string device_name(Device d);  // "NVIDIA H200", as cudaGetDeviceProperties names it

// One T per device (a stream, a library handle), made by create() on first use; thread-safe. Each
// call site has its own table (create's type is part of the instantiation). Kept for the process.
template <class T, class Create>
T once_per_device(Device d, Create&& create) {
  static std::mutex mu;
  static std::map<int, T> made;
  std::lock_guard<std::mutex> lock(mu);
  auto it = made.find(d.index);
  if (it != made.end()) return it->second;
  return made[d.index] = create();
}
// The compute stream of a device: the stream kernels and copies are issued on.
cudaStream_t compute_stream(Device d);

// Bad input that kernels find (embedding indices, cross-entropy targets), reported without making
// the host wait at the op. deferred_check hands out a zeroed device int for a kernel on d's compute
// stream to count into; the DeferredCheck holds d's checks until it is destroyed, so the op's
// launch is queued before any sync can read the slot. The count comes back with the next sync(d)
// (copies to and from the host, item(), the global norm), and the first failed check in queue order
// throws message(count), saying the op ran earlier; later failures read back with it are dropped
// (one report per wait). A thread in a DeviceErrorsElsewhere scope (core/device.h: the
// communication threads) reads them back without throwing; the next other wait reports them.
// That is PyTorch's device-assert timing, but named and counted, and the device stays usable: the
// kernels that read indices later (embedding_backward) skip the bad ones. With every slot pending
// (kDeferredChecks ops checked with no wait between), the next check waits once.
constexpr int kDeferredChecks = 256;
class DeferredCheck {
 public:
  DeferredCheck(int* slot, std::unique_lock<std::mutex> hold) : slot_(slot), hold_(std::move(hold)) {}
  int* ptr() const { return slot_; }

 private:
  int* slot_;
  std::unique_lock<std::mutex> hold_;
};
DeferredCheck deferred_check(Device d, std::function<std::string(int count)> message);
// Waits for d's compute stream, then reports the deferred checks (above). The op table's host
// copies and its global norm wait through here.
void sync(Device d);
// Timing marks on d's compute stream, for the op profiler (kernels/profile.h): mark() queues an
// event from the object's pool and returns its number; elapsed_ms(a, b) waits for mark b and
// returns the stream time between marks a and b; reset() reuses the pool from mark 0.
class StreamMarks {
 public:
  explicit StreamMarks(Device d) : d_(d) {}
  ~StreamMarks();
  StreamMarks(const StreamMarks&) = delete;
  StreamMarks& operator=(const StreamMarks&) = delete;
  int mark();
  float elapsed_ms(int a, int b);
  void reset() { used_ = 0; }

 private:
  Device d_;
  std::vector<cudaEvent_t> events_;
  int used_ = 0;
};
// Registers the CUDA allocator and op table (idempotent); called on first use of a cuda device.
// With SG_CUDA_KERNELS the table holds every kernel; without it only the host<->device copies.
void ensure_registered();
// The device that owns the device pointer p, made current; op names the caller in the error
// thrown for host or unknown pointers. Op-table entries find their device this way.
Device device_of(const void* p, const char* op);
// Whether d runs mma.sync on bf16/f16 (compute capability 8.0 or newer): the tensor-core attention
// kernels need it; older devices take the FMA ones.
bool has_mma_sync(Device d);

// Which fused attention the op table's attention entries run, process-wide (default flash): the
// hand-written kernels of kernels/cuda/attention*.cuh, or cuDNN's fused SDPA
// (kernels/cuda/attention_cudnn.cpp; bf16/f16, D <= 128 and a multiple of 8). Selecting cudnn
// throws, naming what is missing, on a build without the CUDA kernels or without cuDNN.
enum class AttentionBackend : uint8_t { flash, cudnn };
void set_attention_backend(AttentionBackend b);
AttentionBackend attention_backend();

// Where the op table's LayerNorm/RMSNorm backward sums dw/db (kernels/cuda/variants.h; default
// fused). Process-wide; for timing the choices against each other (bench/memory_gpu.cpp).
void set_norm_backward(NormBackward kind);
NormBackward norm_backward();
// How the op table's fused classifier reads its rows (kernels/cuda/variants.h; default streaming).
void set_classifier(Classifier kind);
Classifier classifier();
// How the embedding backward sums a run of equal rows (kernels/cuda/variants.h; default columns).
void set_embedding_backward_kind(EmbeddingBackward kind);
EmbeddingBackward embedding_backward_kind();
// The blocks per SM the tensor-core attention backward is built for (kernels/cuda/variants.h;
// default free).
void set_flash_backward_kind(FlashBackward kind);
FlashBackward flash_backward_kind();
// Keys per tile of the tensor-core attention forward (kernels/cuda/variants.h; default keys32).
void set_flash_forward_kind(FlashForward kind);
FlashForward flash_forward_kind();

// Lets kernel take shmem bytes of dynamic shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize,
// needed once static + dynamic exceed 48 KiB) on the current device; once per kernel, size and
// device. launch() calls it for every launch with dynamic shared memory.
void allow_dynamic_shared(const void* kernel, size_t shmem);

#ifdef SG_CUDA_KERNELS
// kernels/cuda/table.cu: every kernel entry of the CUDA op table (all but the host copies).
void fill_kernel_table(kernels::OpTable& t);

// kernels/cuda/gemm_cublaslt.cpp: GEMM through cuBLASLt on `stream` (the op table: the compute stream), its epilogues
// included (bias, GELU and its saved input; the GELU derivative with the bias gradient; the row
// sums of A, i.e. a weight gradient's bias gradient; a residual, as the beta = 1 source). f32
// (TF32 tensor cores only when allowed below), bf16 and f16 with f32 accumulation; cuBLASLt's
// GELU is the tanh form GPT-2 uses (tests/gpu/kernels.cpp checks it). gemm() throws where cuBLASLt cannot take the epilogue;
// gemm_fused() then returns false having launched nothing, and the op table's gemm entry
// (table.cu) runs that epilogue as separate kernels.
void gemm(const kernels::GemmArgs& a, cudaStream_t stream);
bool gemm_fused(const kernels::GemmArgs& a, cudaStream_t stream);
// TF32 for f32 GEMMs: ~10-bit mantissa products, several times faster. Off by default, so f32
// results match the CPU to f32 rounding.
void set_allow_tf32(bool allow);
bool allow_tf32();
// GEMM tuning (also SG_GEMM_TUNE=1 in the environment): the first call of each shape times up to
// 8 of the heuristic's algorithms on its own operands and keeps the fastest, instead of taking the
// heuristic's first. Off by default: the choice depends on timings, so two processes may pick
// differently and round differently (each one is deterministic once it has chosen; the tuning
// file below fixes the choice across processes). Choices are kept per shape and per setting:
// turning tuning on later tunes each shape at its next call.
void set_gemm_tuning(bool tune);
bool gemm_tuning();
// The tuning file (also SG_GEMM_TUNE_FILE=path; kernels/cuda/gemm_choices.h): a GEMM whose shape
// it holds runs the algorithm saved there, tuning on or off, once cuBLASLt accepts it again for
// that GEMM (cublasLtMatmulAlgoCheck); with tuning on, each shape tuned is added to it (time 0
// where the heuristic offered one candidate). So one tuned run fixes the algorithms of every
// later process and rank that reads the file. A file tuned with another cuBLASLt or on another
// card is refused (the GEMM throws, naming it).
// "" turns it off. The choices already made in this process stay until forget_gemm_choices().
void set_gemm_tuning_file(const std::string& path);
std::string gemm_tuning_file();
// GEMM shapes of this process whose algorithm came from the file.
int64_t gemm_choices_from_file();
// Drops the algorithms chosen so far: each shape asks (the file, tuning or the heuristic) again.
void forget_gemm_choices();
// Whether a's epilogue meets cuBLASLt's rules: the bias, bias gradient, row sums and
// pre-activation 16-byte aligned, N a multiple of 8 with a pre-activation, a bias gradient only
// with the GELU derivative (DGELU_BGRAD), the row sums alone and alpha 1 (BGRADB). Its heuristic may still
// offer no algorithm for a shape; gemm_fused() says so.
bool epilogue_fits(const kernels::GemmArgs& a);
#endif

#ifdef SG_WITH_CUDNN
// kernels/cuda/attention_cudnn.cpp, on `stream` of device d. Forward writes a.out and the f32
// softmax statistics (the log-sum-exp of each row, [B, H, T]); backward reads a.out, a.dout and
// those statistics and writes a.dq, a.dk, a.dv ('='). a.lse is not used: the caller owns the f32
// buffer. bf16 and f16; f32 is refused by name.
void cudnn_attention_forward(const kernels::AttentionArgs& a, float* stats, Device d, cudaStream_t stream);
void cudnn_attention_backward(const kernels::AttentionArgs& a, const float* stats, Device d, cudaStream_t stream);
// Whether cuDNN builds a plan for a's q and out strides (the answer is cached; contiguous layouts
// always say yes). The op table runs a layout it refuses on contiguous copies, and says so once on
// stderr.
bool cudnn_attention_takes_layout(const kernels::AttentionArgs& a, Device d, bool backward);
// For tests: answer no for every strided layout, so that the contiguous copies run.
void force_cudnn_contiguous_layouts(bool force);
// How the backward's dQ accumulator starts (kernels/cuda/variants.h; default memset); also
// SG_DQ_ACCUMULATOR=memset|engine|poisoned in the environment. engine and poisoned need a cuDNN
// that zeroes the accumulator itself (9.6.0 or newer); elsewhere they are refused naming the version.
void set_dq_accumulator(DqAccumulator how);
DqAccumulator dq_accumulator();
bool cudnn_zeroes_dq_accumulator();  // the loaded cuDNN is 9.6.0 or newer
#endif

}  // namespace sg::cuda
