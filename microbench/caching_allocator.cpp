#include "caching_allocator.hpp"

namespace grpo::bench {

CachingAllocator::~CachingAllocator() {
  for (auto& [key, blocks] : free_) {
    for (void* p : blocks) upstream_.deallocate(p, key.first, key.second);
  }
}

void* CachingAllocator::allocate(std::size_t bytes, std::size_t alignment) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find({bytes, alignment});
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      return p;
    }
  }
  return upstream_.allocate(bytes, alignment);
}

void CachingAllocator::deallocate(void* ptr, std::size_t bytes, std::size_t alignment) {
  const std::lock_guard<std::mutex> lock(mutex_);
  free_[{bytes, alignment}].push_back(ptr);
}

std::size_t CachingAllocator::cached_bytes() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = 0;
  for (const auto& [key, blocks] : free_) total += key.first * blocks.size();
  return total;
}

}  // namespace grpo::bench
