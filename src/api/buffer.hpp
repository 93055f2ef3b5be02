// An owning buffer drawn from a grpo::Allocator: the only way library code
// allocates, so a TrackingAllocator sees every byte.
#pragma once

#include <cstddef>
#include <utility>

#include "grpo/types.hpp"

namespace grpo::detail {

inline constexpr std::size_t kAlignment = 64;  // one cache line, one AVX-512 register

class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& allocator, std::size_t bytes)
      : allocator_(&allocator), bytes_(bytes), data_(bytes ? allocator.allocate(bytes, kAlignment) : nullptr) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      allocator_ = std::exchange(other.allocator_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      data_ = std::exchange(other.data_, nullptr);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() {
    if (data_ != nullptr) allocator_->deallocate(data_, bytes_, kAlignment);
    data_ = nullptr;
    bytes_ = 0;
  }
  template <class T = std::byte>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return bytes_; }

 private:
  Allocator* allocator_ = nullptr;
  std::size_t bytes_ = 0;
  void* data_ = nullptr;
};

inline Allocator& resolve(Allocator* allocator) { return allocator ? *allocator : default_allocator(); }

}  // namespace grpo::detail
