#include "core/block_cache.h"

#include "core/error.h"

namespace sg {

BlockCache::BlockCache(RawAlloc alloc, RawFree free) : alloc_(std::move(alloc)), free_(std::move(free)) {}

BlockCache::~BlockCache() {
  std::lock_guard<std::mutex> g(mu_);
  (void)release_cached_locked();  // a destructor cannot throw: the process is going down
}

size_t BlockCache::size_class(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t q = bytes <= (size_t(1) << 20) ? 512 : (size_t(2) << 20);
  return (bytes + q - 1) / q * q;
}

void* BlockCache::take(size_t bytes, int device) {
  const size_t size = size_class(bytes);
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cached_.find({device, size});
    if (it != cached_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= size;
      return p;
    }
    void* p = alloc_(size, device);
    if (!p && cached_bytes_ > 0) {  // give the cache back and try once more
      failed = release_cached_locked();
      if (!failed) p = alloc_(size, device);
    }
    if (p) {
      blocks_[reinterpret_cast<uintptr_t>(p)] = {size, device};
      reserved_ += size;
      ++raw_allocations_;
      return p;
    }
  }
  if (failed) std::rethrow_exception(failed);  // (outside the lock)
  return nullptr;
}

void BlockCache::give(void* p, size_t bytes, int device) {
  const size_t size = size_class(bytes);
  std::lock_guard<std::mutex> g(mu_);
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(p));
  SG_CHECK(b != blocks_.end() && b->second.size == size && b->second.device == device,
           "block cache: ", p, " (", bytes, " bytes, device ", device, ") was not handed out by this cache");
  cached_[{device, size}].push_back(p);
  cached_bytes_ += size;
}

std::optional<int> BlockCache::owner(const void* p) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(mu_);
  auto it = blocks_.upper_bound(a);  // the first block starting after p
  if (it == blocks_.begin()) return std::nullopt;
  --it;
  if (a >= it->first + it->second.size) return std::nullopt;
  return it->second.device;
}

void BlockCache::release_cached() {
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> g(mu_);
    failed = release_cached_locked();
  }
  if (failed) std::rethrow_exception(failed);
}

std::exception_ptr BlockCache::release_cached_locked() {
  std::exception_ptr first;
  for (auto& [key, list] : cached_)
    for (void* p : list) {
      try {
        free_(p, key.first);
      } catch (...) {  // left reserved and out of the cache: the driver may still hold it
        if (!first) first = std::current_exception();
        continue;
      }
      blocks_.erase(reinterpret_cast<uintptr_t>(p));
      reserved_ -= key.second;
    }
  cached_.clear();
  cached_bytes_ = 0;
  return first;
}

size_t BlockCache::reserved_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return reserved_;
}

size_t BlockCache::cached_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return cached_bytes_;
}

int64_t BlockCache::raw_allocations() const {
  std::lock_guard<std::mutex> g(mu_);
  return raw_allocations_;
}

}  // namespace sg
