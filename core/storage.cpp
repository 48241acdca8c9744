#include "core/storage.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/sysinfo.h>

#include "core/error.h"

namespace sg {

namespace {
struct CpuAllocator : Allocator {
  void* allocate(size_t bytes, Device) override {
    size_t rounded = (bytes + 63) / 64 * 64;  // 64-byte aligned for vector loads
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    SG_CHECK(p, "cpu allocator: out of memory allocating ", bytes, " bytes");
    return p;
  }
  void deallocate(void* p, size_t, Device) override { std::free(p); }
};

// The meta device's memory: addresses, each one unique and 64-byte aligned, never read or
// written (a meta kernel does nothing), so that storages stay distinct, as aliasing checks and
// the ledger expect, without a byte behind them. They start at 2^44, far from any mapping.
struct MetaAllocator : Allocator {
  void* allocate(size_t bytes, Device) override {
    static std::atomic<uintptr_t> next{uintptr_t(1) << 44};
    return reinterpret_cast<void*>(next.fetch_add((bytes + 63) / 64 * 64 + 64));
  }
  void deallocate(void*, size_t, Device) override {}
};

Allocator*& slot(DeviceType t) {
  static Allocator* slots[kNumDeviceTypes] = {new CpuAllocator(), nullptr, new MetaAllocator()};
  return slots[int(t)];
}
Allocator*& pinned_slot() {
  static Allocator* a = nullptr;
  return a;
}
}  // namespace

size_t host_memory_bytes() {
  struct sysinfo si {};
  if (sysinfo(&si) != 0) return 0;
  return (size_t(si.totalram) + size_t(si.totalswap)) * size_t(si.mem_unit);
}

void register_pinned_allocator(Allocator* a) { pinned_slot() = a; }
Allocator* pinned_allocator() { return pinned_slot(); }

void register_allocator(DeviceType t, Allocator* a) { slot(t) = a; }

Allocator* allocator_for(DeviceType t) {
  Allocator* a = slot(t);
  SG_CHECK(a, "no allocator for device type ", Device{t, 0}.str(),
           " (was shardgrad built with CUDA?)");
  return a;
}

Storage::Storage(size_t nbytes, Device d, MemCategory c) : nbytes_(nbytes), device_(d), category_(c) {
  data_ = allocator_for(d.type)->allocate(nbytes, d);
  Ledger::global().on_alloc(d, c, int64_t(nbytes));
}

Storage::Storage(size_t nbytes, Device d, MemCategory c, Pinned)
    : nbytes_(nbytes), device_(d), category_(c), pinned_(pinned_allocator() != nullptr) {
  SG_CHECK(d.is_cpu(), "pinned storage: page-locked memory is host memory; asked for ", d.str());
  data_ = allocator()->allocate(nbytes, d);
  Ledger::global().on_alloc(d, c, int64_t(nbytes));
}

Allocator* Storage::allocator() const { return pinned_ ? pinned_allocator() : allocator_for(device_.type); }

Storage::Storage(void* external, size_t nbytes, Device d)
    : data_(external), nbytes_(nbytes), device_(d), category_(MemCategory::workspace), owned_(false) {}

Storage::~Storage() {
  if (!owned_ || !data_) return;
  allocator()->deallocate(data_, nbytes_, device_);
  Ledger::global().on_free(device_, category_, int64_t(nbytes_));
}

void Storage::recategorize(MemCategory c) {
  if (!owned_ || c == category_) return;
  Ledger::global().on_free(device_, category_, int64_t(nbytes_));
  category_ = c;
  Ledger::global().on_alloc(device_, c, int64_t(nbytes_));
}

void Storage::release() {
  SG_CHECK(owned_, "Storage::release: the storage wraps external memory");
  if (!data_) return;
  allocator()->deallocate(data_, nbytes_, device_);
  Ledger::global().on_free(device_, category_, int64_t(nbytes_));
  data_ = nullptr;
  nbytes_ = 0;
}

void Storage::reallocate(size_t nbytes) {
  SG_CHECK(owned_, "Storage::reallocate: the storage wraps external memory");
  release();
  data_ = allocator()->allocate(nbytes, device_);
  nbytes_ = nbytes;
  Ledger::global().on_alloc(device_, category_, int64_t(nbytes));
}

}  // namespace sg
