// A cache of memory blocks over a raw allocator that is slow to call (cudaMalloc, cudaHostAlloc:
// each a driver call, and often a device synchronisation). Freed blocks are kept by (device, size
// class) and handed out again, so a training loop that allocates the same sizes every step asks
// the driver for nothing after its first step. Size classes: 512 B steps up to 1 MiB, 2 MiB steps
// above. When the raw allocator runs out, every cached block is given back to it and the
// allocation tried once more. A raw free that throws (the driver reporting an earlier kernel's
// fault, say) does not stop the others: every cached block is offered back, the failed ones stay
// counted as reserved (the driver may still hold them), and the first error is then thrown from
// take() or release_cached() (the destructor swallows it).
//
// The cache also knows which device holds any address inside a block it handed out (live or
// cached), which lets the CUDA op table find an op's device without asking the driver.
//
// Thread-safe. Kept free of CUDA so CI tests it over a fake raw allocator; the CUDA runtime builds
// its device and pinned-host allocators on it (kernels/cuda/runtime.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace sg {

class BlockCache {
 public:
  // Returns nullptr when out of memory; throws for any other failure.
  using RawAlloc = std::function<void*(size_t bytes, int device)>;
  using RawFree = std::function<void(void* p, int device)>;  // may throw

  BlockCache(RawAlloc alloc, RawFree free);
  ~BlockCache();  // blocks still handed out are not freed (their owners may outlive the cache)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block of at least `bytes` on `device`: a cached one of the same size class, else a new one.
  // nullptr when the raw allocator fails even after the cache was emptied into it.
  void* take(size_t bytes, int device);
  // Hands back a block take() returned, with the same bytes and device; it stays reserved.
  void give(void* p, size_t bytes, int device);
  // The device of the block (handed out or cached) that contains p, if any.
  std::optional<int> owner(const void* p) const;
  // Frees every cached block to the raw allocator.
  void release_cached();

  size_t reserved_bytes() const;  // held from the raw allocator: handed out + cached
  size_t cached_bytes() const;    // of those, waiting in the cache
  int64_t raw_allocations() const;  // calls to the raw allocator that succeeded, over the cache's life

  static size_t size_class(size_t bytes);

 private:
  // Frees every cached block; the first raw free's error, once all were tried (null: none).
  std::exception_ptr release_cached_locked();
  struct Block {
    size_t size;
    int device;
  };
  RawAlloc alloc_;
  RawFree free_;
  mutable std::mutex mu_;
  std::map<std::pair<int, size_t>, std::vector<void*>> cached_;  // (device, size class) -> blocks
  std::map<uintptr_t, Block> blocks_;                            // every reserved block, by address
  size_t reserved_ = 0, cached_bytes_ = 0;
  int64_t raw_allocations_ = 0;
};

}  // namespace sg
