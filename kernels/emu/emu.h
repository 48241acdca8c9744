// CUDA emulation: runs the kernels of kernels/cuda/ on the CPU, so CI (no GPU) executes the same
// kernel source that nvcc compiles. Included by kernels/cuda/common.cuh when __CUDACC__ is not
// defined; kernel code never includes it directly.
//
// Model: a launch runs every thread of a block as a fiber (a ucontext of its own stack) on the
// launching OS thread; the blocks of the grid run one after another on those fibers. A fiber runs
// until it reaches a barrier, then the next one runs, so
//   __syncthreads()           is a barrier among the block's threads,
//   shared memory             is one buffer per launch, reused (and poisoned with NaNs) per block,
//   warp shuffles and ballots exchange values among the warp's 32 lanes through a slot array
//                             guarded by a warp barrier,
//   atomics                   are std::atomic_ref operations.
// The threads between two barriers run in turn, in ascending order on one pass over the block
// and descending on the next, so a read of another thread's write that lacks its barrier meets
// the write missing (a NaN from the poison, or a stale value) one way or the other. Misuse that a
// GPU would turn into silent garbage aborts here with a message instead: a barrier reached by some
// threads while others exited (or stand at a different kind of barrier), a barrier that can never
// complete (deadlock: no thread can run), a block of more than 1024 threads.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

// AddressSanitizer keeps a thread's stack bounds (and its fake stacks for use-after-return): each
// switch between the scheduler and a fiber tells it which stack comes next.
#if defined(__SANITIZE_ADDRESS__)
#define SG_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SG_EMU_ASAN 1
#endif
#endif
#ifdef SG_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace sg::emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Storage types of the half dtypes: the bits, converted through core/dtype.h (round to nearest even,
// as __float2bfloat16 / __float2half do on the device).
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

using Stream = void*;  // launches run synchronously; the stream only keeps signatures identical

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  std::abort();
}

struct Grid;

// The calling thread's coordinates (each emulated CUDA thread is one fiber).
struct ThreadState {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
  Grid* grid = nullptr;
  int lane = 0, warp = 0;
  size_t shared_offset = 0;  // next free byte of the block's static shared memory
};

// A stack's lowest address and size, for AddressSanitizer's switch annotations.
struct StackBounds {
  const void* bottom = nullptr;
  size_t size = 0;
};
// Before a switch: the stack the switch goes to (fake: where to keep the leaving side's fake
// stack; null when that side ends for good). After it, on the arriving side: the fake stack kept,
// and (from, when given) the bounds of the stack just left.
inline void leave_stack([[maybe_unused]] void** fake, [[maybe_unused]] StackBounds to) {
#ifdef SG_EMU_ASAN
  __sanitizer_start_switch_fiber(fake, to.bottom, to.size);
#endif
}
inline void arrive_on_stack([[maybe_unused]] void* fake, [[maybe_unused]] StackBounds* from) {
#ifdef SG_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, from ? &from->bottom : nullptr, from ? &from->size : nullptr);
#endif
}

// One emulated thread: its context, its coordinates, and whether it can run.
struct Fiber {
  enum class Status { ready, waiting, done };
  ucontext_t context;
  StackBounds stack;
  ThreadState state;
  Status status = Status::ready;
  const char* waits_at = "";  // the barrier it waits at
};

// What the launching OS thread runs: the scheduler's context, the launch's fibers (thread i is
// fibers[i]), what each runs, and the fiber running now.
struct Scheduler {
  ucontext_t context;
  StackBounds thread_stack;  // the launching thread's (AddressSanitizer's), learnt on each arrival
  Fiber* fibers = nullptr;
  const std::function<void(int)>* thread_main = nullptr;
  Fiber* running = nullptr;
};
inline thread_local Scheduler* this_scheduler = nullptr;
inline ThreadState& me() { return this_scheduler->running->state; }

// The running fiber stops here, back to the scheduler, until the barrier it waits at completes
// (Barrier::wait marks its waiters ready) and the scheduler runs it again.
[[gnu::noinline]] inline void block_running(const char* kind) {
  Fiber* f = this_scheduler->running;
  f->status = Fiber::Status::waiting;
  f->waits_at = kind;
  void* fake = nullptr;
  leave_stack(&fake, this_scheduler->thread_stack);
  if (swapcontext(&f->context, &this_scheduler->context) != 0) fail("swapcontext failed");
  arrive_on_stack(fake, &this_scheduler->thread_stack);
}

// A reusable barrier for n threads. Every arrival names the kind of barrier it is ("__syncthreads",
// "end of block", ...); arrivals of different kinds in one phase mean divergent control flow
// around a barrier, which is undefined on a GPU, so it aborts here.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) { waiters_.reserve(size_t(n)); }
  void wait(const char* kind) {
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (std::strcmp(kind_, kind) != 0) {
      char msg[256];
      std::snprintf(msg, sizeof msg, "divergent barrier: one thread at '%s' while another is at '%s'", kind, kind_);
      fail(msg);
    }
    if (++arrived_ == n_) {  // the last to arrive goes on; the others run again in their turn
      arrived_ = 0;
      for (Fiber* f : waiters_) f->status = Fiber::Status::ready;
      waiters_.clear();
      return;
    }
    waiters_.push_back(this_scheduler->running);
    block_running(kind);
  }

 private:
  const int n_;
  int arrived_ = 0;
  const char* kind_ = "";
  std::vector<Fiber*> waiters_;
};

// Fiber stacks, kept by each launching OS thread for its next launches (mapping 1024 stacks per
// launch would cost more than the kernels): 256 KiB each, below a guard page, so that an overflow
// faults instead of writing over a neighbour.
class FiberStacks {
 public:
  static constexpr size_t kSize = 256 * 1024, kGuard = 4096;
  char* get(size_t i) {
    while (stacks_.size() <= i) {
      void* p = mmap(nullptr, kSize + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fail("cannot map a fiber stack");
      if (mprotect(p, kGuard, PROT_NONE) != 0) fail("cannot protect a fiber stack's guard page");
      stacks_.push_back(static_cast<char*>(p));
    }
    return stacks_[i] + kGuard;
  }
  ~FiberStacks() {
    for (char* p : stacks_) munmap(p, kSize + kGuard);
  }

 private:
  std::vector<char*> stacks_;
};

constexpr size_t kStaticShared = 48 * 1024;       // the default static shared-memory limit of a block
constexpr size_t kMaxDynamicShared = 227 * 1024;  // sm_90's dynamic limit (opted into above 48 KiB)

// What the threads of one launch share.
struct Grid {
  dim3 grid, block;
  int threads;
  std::vector<unsigned char> static_shared, dynamic_shared;
  Barrier block_barrier;
  std::vector<std::unique_ptr<Barrier>> warp_barriers;  // one per warp, sized to its live lanes
  std::vector<uint64_t> warp_slots;                     // 32 exchange slots per warp
  std::vector<uint32_t> warp_fragments;                 // per warp: 32 lanes x 10 words of mma operands
  Grid(dim3 g, dim3 b, size_t shmem)
      : grid(g), block(b), threads(int(b.x * b.y * b.z)), static_shared(kStaticShared), dynamic_shared(shmem),
        block_barrier(threads) {
    const int warps = (threads + 31) / 32;
    for (int w = 0; w < warps; ++w) warp_barriers.push_back(std::make_unique<Barrier>(std::min(32, threads - 32 * w)));
    warp_slots.resize(size_t(warps) * 32);
    warp_fragments.resize(size_t(warps) * 32 * 10);
  }
};

// A block-shared array: every thread of the block declares the same arrays in the same order, so
// each gets the same offset into the block's shared buffer.
template <class T>
T* shared_array(size_t count) {
  ThreadState& t = me();
  const size_t align = alignof(T) < 16 ? 16 : alignof(T);
  const size_t off = (t.shared_offset + align - 1) / align * align;
  if (off + count * sizeof(T) > kStaticShared) fail("static shared memory over 48 KiB");
  // a block's static and dynamic shared memory together: sm_90's most (launch() opts in past 48 KiB)
  if (off + count * sizeof(T) + t.grid->dynamic_shared.size() > kMaxDynamicShared)
    fail("static + dynamic shared memory over 227 KiB");
  t.shared_offset = off + count * sizeof(T);
  return reinterpret_cast<T*>(t.grid->static_shared.data() + off);
}
template <class T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(me().grid->dynamic_shared.data());
}

inline void warp_sync() { me().grid->warp_barriers[size_t(me().warp)]->wait("warp barrier"); }

// Every lane publishes v; returns the value published by lane src (its own when src is not a
// live lane). Two warp barriers: one so all values are written, one so none is overwritten early.
template <class T>
T warp_exchange(T v, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move at most 8 bytes");
  ThreadState& t = me();
  uint64_t* slots = t.grid->warp_slots.data() + size_t(t.warp) * 32;
  const int live = std::min(32, t.grid->threads - 32 * t.warp);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slots[t.lane] = bits;
  warp_sync();
  T out = v;
  if (src >= 0 && src < live) std::memcpy(&out, &slots[src], sizeof(T));
  warp_sync();
  return out;
}

// A fiber's entry (makecontext passes no pointer portably): its thread index is its place among
// the scheduler's fibers.
inline void fiber_entry() {
  Scheduler& s = *this_scheduler;
  arrive_on_stack(nullptr, &s.thread_stack);
  (*s.thread_main)(int(s.running - s.fibers));
  s.running->status = Fiber::Status::done;
  leave_stack(nullptr, s.thread_stack);  // for good: returns to the scheduler (uc_link)
}

// The context calls live in functions of their own: the compiler treats getcontext and
// swapcontext as returning twice (as setjmp), which no local variable of the scheduler should meet.
[[gnu::noinline]] inline void start_fiber(Fiber& f, char* stack, Scheduler& sched) {
  if (getcontext(&f.context) != 0) fail("getcontext failed");
  f.context.uc_stack.ss_sp = stack;
  f.context.uc_stack.ss_size = FiberStacks::kSize;
  f.stack = {stack, FiberStacks::kSize};
  f.context.uc_link = &sched.context;
  makecontext(&f.context, fiber_entry, 0);
}
[[gnu::noinline]] inline void resume_fiber(Fiber& f, Scheduler& sched) {
  sched.running = &f;
  void* fake = nullptr;
  leave_stack(&fake, f.stack);
  if (swapcontext(&sched.context, &f.context) != 0) fail("swapcontext failed");
  arrive_on_stack(fake, nullptr);
  sched.running = nullptr;
}

inline void run_grid(dim3 grid, dim3 block, size_t shmem, const std::function<void()>& body) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024) fail("a block needs 1 to 1024 threads");
  if (grid.y > 65535 || grid.z > 65535) fail("gridDim.y and gridDim.z are at most 65535");
  if (shmem > kMaxDynamicShared) fail("dynamic shared memory over 227 KiB (sm_90's most for a block)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // (their product could wrap in 32 bits)
  if (this_scheduler) fail("a kernel launched from inside a kernel");
  static thread_local FiberStacks stacks;
  Grid g(grid, block, shmem);
  const std::function<void(int)> thread_main = [&](int tid) {
    ThreadState& t = me();
    t.grid = &g;
    t.thread_idx = dim3(unsigned(tid) % block.x, unsigned(tid) / block.x % block.y, unsigned(tid) / (block.x * block.y));
    t.block_dim = block;
    t.grid_dim = grid;
    t.lane = tid % 32;
    t.warp = tid / 32;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          t.block_idx = dim3(x, y, z);
          t.shared_offset = 0;
          if (tid == 0) {  // NaN-poison shared memory: a read before any write shows up in the results
            for (auto* mem : {&g.static_shared, &g.dynamic_shared})  // (memset of an empty one's null: UB)
              if (!mem->empty()) std::memset(mem->data(), 0xff, mem->size());
          }
          g.block_barrier.wait("start of block");
          body();
          g.block_barrier.wait("end of block");
        }
  };
  std::vector<Fiber> fibers(threads);
  Scheduler sched;
  sched.fibers = fibers.data();
  sched.thread_main = &thread_main;
  for (unsigned i = 0; i < threads; ++i) start_fiber(fibers[i], stacks.get(i), sched);
  struct Scope {  // the scheduler is this OS thread's for the launch only
    Scheduler* s;
    explicit Scope(Scheduler* s_) : s(s_) { this_scheduler = s; }
    ~Scope() { this_scheduler = nullptr; }
  } scope(&sched);
  unsigned done = 0;
  for (uint64_t pass = 0; done < threads; ++pass) {
    bool ran = false;
    for (unsigned k = 0; k < threads; ++k) {
      const unsigned i = pass % 2 ? threads - 1 - k : k;
      Fiber& f = fibers[i];
      if (f.status != Fiber::Status::ready) continue;
      resume_fiber(f, sched);
      ran = true;
      if (f.status == Fiber::Status::done) ++done;
    }
    if (!ran) {
      unsigned waiting = 0;
      const char* at = "";
      for (const Fiber& f : fibers)
        if (f.status == Fiber::Status::waiting) ++waiting, at = f.waits_at;
      char msg[256];
      std::snprintf(msg, sizeof msg, "deadlock: %u of %u threads wait at a barrier that can never complete (one at '%s')",
                    waiting, threads, at);
      fail(msg);
    }
  }
}

// launch(kernel, grid, block, shmem, stream, args...): the kernel runs on every emulated thread
// with its own copy of the arguments, as a __global__ function receives them.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, Stream, A... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch: wrong number of kernel arguments");
  run_grid(grid, block, shmem, [&] { kernel(static_cast<P>(args)...); });
}

inline float to_f32(bf16 v) { return bf16_to_f32(v.bits); }
inline float to_f32(f16 v) { return f16_to_f32(v.bits); }
inline bf16 bf16_from(float f) { return bf16{f32_to_bf16(f)}; }
inline f16 f16_from(float f) { return f16{f32_to_f16(f)}; }

}  // namespace sg::emu

// ---- the CUDA built-ins, at global scope as nvcc has them ----

using sg::emu::dim3;
#define threadIdx (::sg::emu::me().thread_idx)
#define blockIdx (::sg::emu::me().block_idx)
#define blockDim (::sg::emu::me().block_dim)
#define gridDim (::sg::emu::me().grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads() { sg::emu::me().grid->block_barrier.wait("__syncthreads"); }
inline void __syncwarp(unsigned = 0xffffffffu) { sg::emu::warp_sync(); }

// Shuffles over `width`-lane segments of the warp, with the CUDA rules for out-of-segment sources
// (xor: a lane of an earlier segment is read, a later one gives the caller's own value; down: the
// caller's own value). The mask is not checked: our kernels shuffle whole warps.
template <class T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
  const int lane = sg::emu::me().lane;
  return sg::emu::warp_exchange(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const int lane = sg::emu::me().lane, src = lane ^ lane_mask;
  return sg::emu::warp_exchange(v, src < (lane & ~(width - 1)) + width ? src : lane);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = sg::emu::me().lane, src = lane + int(delta);
  return sg::emu::warp_exchange(v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
inline unsigned __ballot_sync(unsigned, int predicate) {
  sg::emu::ThreadState& t = sg::emu::me();
  uint64_t* slots = t.grid->warp_slots.data() + size_t(t.warp) * 32;
  const int live = std::min(32, t.grid->threads - 32 * t.warp);
  slots[t.lane] = predicate != 0;
  sg::emu::warp_sync();
  unsigned bits = 0;
  for (int l = 0; l < live; ++l) bits |= unsigned(slots[l] != 0) << l;
  sg::emu::warp_sync();
  return bits;
}

template <class T>
T atomicAdd(T* address, T v) {
  return std::atomic_ref<T>(*address).fetch_add(v);
}
template <class T>
T atomicMax(T* address, T v) {
  static_assert(std::is_integral_v<T>, "atomicMax: integers only, as on the device");
  std::atomic_ref<T> a(*address);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

namespace sg::emu {

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, c  (D = A B + C;
// A 16x16, B 16x8, C and D 16x8). Each lane passes its own fragment registers; the fragments of the
// warp meet in a per-warp scratch (a warp barrier on each side), every lane rebuilds A, B and C
// from the layout of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"),
// and takes back the four elements of D its lane owns. With g = lane / 4 and t = lane % 4:
//   A: a[i], i < 8, two halves (bf16 or f16) per register, low half first:
//      row g for i in {0,1,4,5}, g + 8 otherwise; col 2t + (i & 1), + 8 for i >= 4
//   B: b[i], i < 4: row (k) 2t + (i & 1), + 8 for i >= 2; col (n) g
//   C, D: c[i], i < 4: row g for i < 2, g + 8 otherwise; col 2t + (i & 1)
// The products of two bf16 or two f16 are exact in f32 (8 or 11 significant bits each, and f16's
// range squared stays normal in f32); the sum runs in f32 in k order after C. The element types
// differ only in how `widen` turns a 16-bit half into f32.
template <float (*widen)(uint16_t)>
void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  ThreadState& t = me();
  if (std::min(32, t.grid->threads - 32 * t.warp) != 32) fail("mma.sync needs all 32 lanes of the warp");
  uint32_t* warp = t.grid->warp_fragments.data() + size_t(t.warp) * 32 * 10;
  uint32_t* mine = warp + t.lane * 10;
  for (int r = 0; r < 4; ++r) mine[r] = a[r];
  for (int r = 0; r < 2; ++r) mine[4 + r] = b[r];
  for (int r = 0; r < 4; ++r) std::memcpy(&mine[6 + r], &c[r], 4);
  Barrier& barrier = *t.grid->warp_barriers[size_t(t.warp)];
  barrier.wait("mma.sync");
  auto half = [](uint32_t word, int i) { return widen(uint16_t(i & 1 ? word >> 16 : word & 0xffffu)); };
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, tig = lane % 4;
    const uint32_t* f = warp + lane * 10;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = half(f[i / 2], i);
    }
    for (int i = 0; i < 4; ++i) B[tig * 2 + (i & 1) + (i >= 2 ? 8 : 0)][g] = half(f[4 + i / 2], i);
    for (int i = 0; i < 4; ++i) std::memcpy(&C[i < 2 ? g : g + 8][tig * 2 + (i & 1)], &f[6 + i], 4);
  }
  const int g = t.lane / 4, tig = t.lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8, col = tig * 2 + (i & 1);
    float s = C[row][col];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
  barrier.wait("mma.sync");  // no lane overwrites its fragments while another still reads them
}
// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 r, [row]: four 8x8 matrices of 16-bit
// elements, each row 16 contiguous bytes of shared memory at an address one lane gives: lanes
// 8i .. 8i+7 give rows 0..7 of matrix i. Register i of every lane receives two elements of
// matrix i, low half first: row lane/4, columns 2(lane%4) and 2(lane%4)+1; with .trans, those of
// the transpose (rows 2(lane%4) and 2(lane%4)+1 of column lane/4). (PTX ISA, "Warp-level matrix
// load instruction: ldmatrix".) The row addresses must be 16-byte aligned and in shared memory.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  ThreadState& t = me();
  if (std::min(32, t.grid->threads - 32 * t.warp) != 32) fail("ldmatrix needs all 32 lanes of the warp");
  const auto* p = static_cast<const unsigned char*>(row);
  const auto within = [p](const std::vector<unsigned char>& s) { return p >= s.data() && p + 16 <= s.data() + s.size(); };
  if (!within(t.grid->static_shared) && !within(t.grid->dynamic_shared)) fail("ldmatrix: row address not in shared memory");
  if (reinterpret_cast<uintptr_t>(p) & 15) fail("ldmatrix: row address not 16-byte aligned");
  uint64_t* slots = t.grid->warp_slots.data() + size_t(t.warp) * 32;
  slots[t.lane] = reinterpret_cast<uintptr_t>(p);
  warp_sync();
  const auto at = [slots](int lane, int col) {
    uint16_t v;
    std::memcpy(&v, reinterpret_cast<const unsigned char*>(slots[lane]) + 2 * col, 2);
    return uint32_t(v);
  };
  const int g = t.lane / 4, q = t.lane % 4;
  for (int i = 0; i < 4; ++i)
    r[i] = trans ? at(8 * i + 2 * q, g) | at(8 * i + 2 * q + 1, g) << 16 : at(8 * i + g, 2 * q) | at(8 * i + g, 2 * q + 1) << 16;
  warp_sync();  // no lane republishes its address while another still reads
}

inline void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  mma_m16n8k16<bf16_to_f32>(d, a, b, c);
}
inline void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  mma_m16n8k16<f16_to_f32>(d, a, b, c);
}

}  // namespace sg::emu
