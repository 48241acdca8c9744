// The block cache under the CUDA device and pinned-host allocators, over a fake raw allocator
// (malloc with a byte budget), and host tensors asked for page-locked memory on a machine
// without the CUDA backend.
#include "tests/catch.h"
#include <cstdlib>
#include <map>

#include "autograd/ops.h"
#include "core/block_cache.h"
#include "core/error.h"
#include "core/ledger.h"

using namespace sg;

namespace {
// malloc with a budget, counting calls: what cudaMalloc looks like to the cache.
struct FakeRaw {
  explicit FakeRaw(size_t budget_bytes) : budget(budget_bytes) {}
  size_t budget = 0, used = 0;
  int allocs = 0, frees = 0;
  std::map<void*, size_t> live;
  BlockCache make() {
    return BlockCache(
        [this](size_t bytes, int) -> void* {
          if (used + bytes > budget) return nullptr;
          void* p = std::malloc(bytes);
          used += bytes;
          live[p] = bytes;
          ++allocs;
          return p;
        },
        [this](void* p, int) {
          used -= live.at(p);
          live.erase(p);
          std::free(p);
          ++frees;
        });
  }
};
}  // namespace

TEST_CASE("block cache: size classes of 512 B up to 1 MiB and 2 MiB above", "[core]") {
  CHECK(BlockCache::size_class(0) == 512);
  CHECK(BlockCache::size_class(1) == 512);
  CHECK(BlockCache::size_class(512) == 512);
  CHECK(BlockCache::size_class(513) == 1024);
  CHECK(BlockCache::size_class(size_t(1) << 20) == (size_t(1) << 20));
  CHECK(BlockCache::size_class((size_t(1) << 20) + 1) == (size_t(2) << 20));
  CHECK(BlockCache::size_class((size_t(5) << 20) + 7) == (size_t(6) << 20));
}

TEST_CASE("block cache: a freed block is handed out again for its size class and device only", "[core]") {
  FakeRaw raw{1 << 24};
  BlockCache cache = raw.make();
  void* a = cache.take(1000, 0);
  REQUIRE(a);
  cache.give(a, 1000, 0);
  CHECK(cache.cached_bytes() == 1024);
  CHECK(cache.take(1020, 0) == a);  // same class (1024): no new raw allocation
  CHECK(raw.allocs == 1);
  cache.give(a, 1020, 0);
  void* b = cache.take(1000, 1);  // another device never gets device 0's block
  void* c = cache.take(2000, 0);  // nor another size class
  CHECK(b != a);
  CHECK(c != a);
  CHECK(raw.allocs == 3);
  CHECK(cache.reserved_bytes() == 1024 + 1024 + 2048);
  CHECK(cache.raw_allocations() == 3);
  // Returning a block with the wrong size or device, or one it never gave, is refused.
  CHECK_THROWS_WITH(cache.give(c, 100, 0), Catch::Contains("was not handed out by this cache"));
  CHECK_THROWS_WITH(cache.give(c, 2000, 1), Catch::Contains("was not handed out by this cache"));
  int local = 0;
  CHECK_THROWS_WITH(cache.give(&local, 4, 0), Catch::Contains("was not handed out by this cache"));
  cache.give(b, 1000, 1);
  cache.give(c, 2000, 0);
  cache.release_cached();
  CHECK(raw.frees == 3);
  CHECK(raw.used == 0);
  CHECK(cache.reserved_bytes() == 0);
}

TEST_CASE("block cache: the owner of an address inside any block, live or cached", "[core]") {
  FakeRaw raw{1 << 24};
  BlockCache cache = raw.make();
  auto* a = static_cast<char*>(cache.take(3000, 2));  // class 3072
  auto* b = static_cast<char*>(cache.take(100, 5));
  CHECK(cache.owner(a) == 2);
  CHECK(cache.owner(a + 3071) == 2);  // interior pointers: a view at an offset
  CHECK(cache.owner(b + 10) == 5);
  cache.give(a, 3000, 2);
  CHECK(cache.owner(a + 5) == 2);  // cached blocks are still ours
  int local = 0;
  CHECK_FALSE(cache.owner(&local).has_value());
  // One past a block is not inside it (unless another block starts there).
  if (cache.owner(a + 3072) != std::nullopt) CHECK(b == a + 3072);
  cache.release_cached();
  CHECK_FALSE(cache.owner(a).has_value());  // freed to the raw allocator: no longer ours
  cache.give(b, 100, 5);
}

TEST_CASE("block cache: out of memory empties the cache into the raw allocator and tries again", "[core]") {
  FakeRaw raw{8192};
  BlockCache cache = raw.make();
  void* a = cache.take(4096, 0);
  void* b = cache.take(4096, 0);
  REQUIRE(a);
  REQUIRE(b);
  cache.give(a, 4096, 0);
  cache.give(b, 4096, 0);
  // 8 KiB of budget is held by two cached 4 KiB blocks: a 6 KiB block fits only once they go back.
  void* c = cache.take(6000, 0);
  REQUIRE(c);
  CHECK(raw.frees == 2);
  CHECK(cache.cached_bytes() == 0);
  CHECK(cache.reserved_bytes() == 6144);
  // Nothing left to give back: the failure reaches the caller as nullptr.
  CHECK(cache.take(4096, 0) == nullptr);
  cache.give(c, 6000, 0);
}

TEST_CASE("block cache: a raw free that fails is thrown after the other blocks are freed", "[core]") {
  FakeRaw raw{1 << 20};
  void* refused = nullptr;  // the raw free of this block fails, as cudaFree after a kernel fault
  BlockCache cache(
      [&](size_t bytes, int) -> void* {
        void* p = std::malloc(bytes);
        raw.live[p] = bytes;
        return p;
      },
      [&](void* p, int) {
        if (p == refused) throw Error("cudaFree: an illegal memory access was encountered");
        raw.live.erase(p);
        std::free(p);
        ++raw.frees;
      });
  void* a = cache.take(4096, 0);
  void* b = cache.take(4096, 0);
  void* c = cache.take(8192, 0);
  refused = b;
  for (auto [p, n] : {std::pair{a, 4096}, std::pair{b, 4096}, std::pair{c, 8192}}) cache.give(p, size_t(n), 0);
  REQUIRE_THROWS_WITH(cache.release_cached(), Catch::Contains("illegal memory access"));
  CHECK(raw.frees == 2);                     // a and c went back to the driver
  CHECK(cache.cached_bytes() == 0);          // b is not handed out again
  CHECK(cache.reserved_bytes() == 4096);     // and stays counted: the driver may still hold it
  CHECK(cache.owner(b) == std::optional<int>(0));
  std::free(b);
}

TEST_CASE("pinned host tensors: host memory, charged to the ledger, page-locked only with the CUDA backend up",
          "[core]") {
  // Without a GPU (CI) no pinned allocator is registered and the bytes are ordinary host memory;
  // with one, tests/gpu/kernels.cpp checks that the driver sees them as page-locked.
  auto comm_bytes = [] { return Ledger::global().stats(Device::cpu()).cur(MemCategory::comm_buffer); };
  const int64_t before = comm_bytes();
  {
    MemScope scope(MemCategory::comm_buffer);
    Tensor t = Tensor::empty_pinned({3, 5}, DType::bf16);
    CHECK(t.device() == Device::cpu());
    CHECK(t.storage()->pinned() == (pinned_allocator() != nullptr));
    CHECK(comm_bytes() == before + 30);
    copy_(t, full({3, 5}, 2.5));
    CHECK(to_vector<float>(t) == std::vector<float>(15, 2.5f));
  }
  CHECK(comm_bytes() == before);
  CHECK_THROWS_WITH(Storage(16, Device::cuda(0), MemCategory::workspace, Storage::Pinned{}),
                    Catch::Contains("page-locked memory is host memory; asked for cuda:0"));
}
