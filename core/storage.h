// A block of bytes on one device, charged to the ledger for as long as it lives.
#pragma once
#include <cstddef>
#include <memory>

#include "core/device.h"
#include "core/ledger.h"

namespace sg {

// One allocator per device type. The CPU one is registered here; the CUDA caching allocator
// registers itself when the CUDA backend is linked.
struct Allocator {
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes, Device d) = 0;
  virtual void deallocate(void* p, size_t bytes, Device d) = 0;
};
void register_allocator(DeviceType t, Allocator* a);
Allocator* allocator_for(DeviceType t);
// Page-locked host memory (the CUDA backend registers cudaHostAlloc's, cached): device copies to
// and from it run at full bus bandwidth and can be asynchronous. Null when none is registered.
void register_pinned_allocator(Allocator* a);
Allocator* pinned_allocator();

// The memory this machine could ever give a process, in bytes: RAM plus swap (0 when unknown).
size_t host_memory_bytes();

class Storage {
 public:
  Storage(size_t nbytes, Device d, MemCategory c);
  // Host bytes, page-locked when a pinned allocator is registered (pinned() says which it got),
  // ordinary host memory otherwise. d must be a CPU device.
  struct Pinned {};
  Storage(size_t nbytes, Device d, MemCategory c, Pinned);
  // Wraps memory someone else owns (never freed, never charged).
  Storage(void* external, size_t nbytes, Device d);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  MemCategory category() const { return category_; }
  bool pinned() const { return pinned_; }
  // Moves the bytes to another ledger category (a gathered buffer becoming a parameter, ...).
  void recategorize(MemCategory c);
  // Frees the bytes (data() null, nbytes() 0) while the Storage object lives on, so every handle
  // sharing it — parameters, views, tensors a tape saved — sees the bytes reallocate() brings back
  // (FSDP/ZeRO-3 releases a unit's gathered parameters between uses). Owned storage only.
  void release();
  // Allocates nbytes again, charged to the same category; the contents are uninitialised.
  void reallocate(size_t nbytes);

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  MemCategory category_;
  bool owned_ = true;
  bool pinned_ = false;
  Allocator* allocator() const;
};

}  // namespace sg
