// Basic vocabulary of the grpo API: dtypes, non-owning views, errors, and
// the allocator through which every byte the library allocates passes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace grpo {

// f16: IEEE binary16 (fp16 models); its gradients saturate at +-65504
// (docs/semantics.md, "fp16").
enum class DType : std::uint8_t { f32, bf16, f16 };

const char* to_string(DType dtype);
std::size_t size_of(DType dtype);

// A read-only row-major matrix: element (r, c) is at data + (r * ld + c) * size_of(dtype).
// ld is in elements and may exceed cols (padded rows, a column slice of a larger matrix).
struct MatrixView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
};

// A writable matrix view with the same addressing as MatrixView.
struct MutMatrixView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;

  bool empty() const { return data == nullptr; }
  MatrixView as_const() const { return {data, dtype, rows, cols, ld}; }
};

// A read-only contiguous vector with a dtype tag (the LM-head bias).
struct VectorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t size = 0;

  bool empty() const { return data == nullptr; }
};

// What kind of refusal an Error is.
enum class ErrorKind : std::uint8_t {
  invalid_argument,  // a size, stride, value or option the contract refuses
  unsupported,       // a valid request this build cannot serve (a dtype combination, a shape oneDNN cannot take)
  out_of_memory,     // an allocation the library needed failed
};

const char* to_string(ErrorKind kind);

// Every refusal of the library. argument() names the offending argument
// ("ids", "logits", "config.temperature", ...); kind() says what sort of
// refusal it is; what() is a full sentence naming both. Whatever the kind,
// no output was written when an Error leaves execute().
class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message, ErrorKind kind = ErrorKind::invalid_argument);
  const std::string& argument() const { return argument_; }
  ErrorKind kind() const { return kind_; }

 private:
  std::string argument_;
  ErrorKind kind_;
};

// Where the library's memory comes from. Plans and baselines take an
// Allocator* in their options; nullptr means default_allocator().
class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory aligned to `alignment` (a power of two), or throws std::bad_alloc.
  virtual void* allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, std::size_t alignment) = 0;
};

// A stateless aligned allocator (operator new with alignment).
Allocator& default_allocator();

// Counts live bytes and their high-water mark; thread-safe. The microbench
// and the tests pass one of these to measure what a step allocates.
class TrackingAllocator final : public Allocator {
 public:
  explicit TrackingAllocator(Allocator& upstream = default_allocator()) : upstream_(upstream) {}
  void* allocate(std::size_t bytes, std::size_t alignment) override;
  void deallocate(void* ptr, std::size_t bytes, std::size_t alignment) override;

  std::size_t live_bytes() const { return live_.load(); }
  std::size_t peak_bytes() const { return peak_.load(); }
  std::size_t allocation_count() const { return count_.load(); }
  // Sets the high-water mark to the bytes live now.
  void reset_peak() { peak_.store(live_.load()); }

 private:
  Allocator& upstream_;
  std::atomic<std::size_t> live_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<std::size_t> count_{0};
};

}  // namespace grpo
