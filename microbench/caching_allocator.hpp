// A caching allocator in the manner of PyTorch's: freed blocks are kept and
// handed out again for the same size, so in steady state a step that
// allocates the same buffers every call touches no fresh pages. This is what
// a training loop's framework does for the unfused baseline (and what a
// caller-owned, reused workspace does for the fused plan); without it each
// step pays first-touch page faults on every byte it allocates (~0.5 s/GB on
// this VM), which would be measured as if it were the kernels' time.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "grpo/types.hpp"

namespace grpo::bench {

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(Allocator& upstream = default_allocator()) : upstream_(upstream) {}
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment) override;
  void deallocate(void* ptr, std::size_t bytes, std::size_t alignment) override;
  std::size_t cached_bytes() const;

 private:
  Allocator& upstream_;
  mutable std::mutex mutex_;
  std::map<std::pair<std::size_t, std::size_t>, std::vector<void*>> free_;  // (bytes, alignment) -> blocks
};

}  // namespace grpo::bench
