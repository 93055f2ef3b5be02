// An owning buffer drawn from a grpo::Allocator: the only way library code
// allocates, so a TrackingAllocator sees every byte.
#pragma once

#include <cstddef>
#include <new>
#include <string>
#include <utility>

#include "grpo/types.hpp"

namespace grpo::detail {

inline constexpr std::size_t kAlignment = 64;  // one cache line, one AVX-512 register

class Buffer {
 public:
  Buffer() = default;
  // A failed allocation becomes Error(what, ..., ErrorKind::out_of_memory).
  Buffer(Allocator& allocator, std::size_t bytes, const char* what = "workspace")
      : allocator_(&allocator), bytes_(bytes), data_(allocate_or_throw(allocator, bytes, what)) {}
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
  static void* allocate_or_throw(Allocator& allocator, std::size_t bytes, const char* what) {
    if (bytes == 0) return nullptr;
    try {
      return allocator.allocate(bytes, kAlignment);
    } catch (const std::bad_alloc&) {
      throw Error(what, "allocating " + std::to_string(bytes) + " bytes failed", ErrorKind::out_of_memory);
    }
  }

  Allocator* allocator_ = nullptr;
  std::size_t bytes_ = 0;
  void* data_ = nullptr;
};

inline Allocator& resolve(Allocator* allocator) { return allocator ? *allocator : default_allocator(); }

}  // namespace grpo::detail
