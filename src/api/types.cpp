// Error, allocators and the to_string helpers of the public vocabulary.
#include <new>

#include "grpo/lm_head_loss.hpp"
#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}
std::size_t size_of(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

const char* to_string(LossType type) {
  switch (type) {
    case LossType::grpo: return "grpo";
    case LossType::bnpo: return "bnpo";
    case LossType::dr_grpo: return "dr_grpo";
    case LossType::dapo: return "dapo";
    case LossType::cispo: return "cispo";
    case LossType::sapo: return "sapo";
    case LossType::luspo: return "luspo";
    case LossType::vespo: return "vespo";
  }
  return "?";
}

const char* to_string(KlEstimator estimator) {
  switch (estimator) {
    case KlEstimator::k3: return "k3";
    case KlEstimator::k1: return "k1";
    case KlEstimator::abs: return "abs";
    case KlEstimator::k2: return "k2";
    case KlEstimator::k1_plus: return "k1+";
    case KlEstimator::abs_plus: return "abs+";
    case KlEstimator::k3_plus: return "k3+";
  }
  return "?";
}

const char* to_string(IsLevel level) { return level == IsLevel::token ? "token" : "sequence"; }

const char* to_string(WeightLayout layout) {
  return layout == WeightLayout::vocab_major ? "vocab_major" : "hidden_major";
}

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_argument: return "invalid argument";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::out_of_memory: return "out of memory";
  }
  return "?";
}

Error::Error(std::string argument, const std::string& message, ErrorKind kind)
    : std::runtime_error(std::string("grpo: ") + to_string(kind) + " '" + argument + "': " + message),
      argument_(std::move(argument)),
      kind_(kind) {}

namespace {

class DefaultAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, std::size_t alignment) override {
    return ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{alignment});
  }
  void deallocate(void* ptr, std::size_t /*bytes*/, std::size_t alignment) override {
    ::operator delete (ptr, std::align_val_t{alignment});
  }
};

}  // namespace

Allocator& default_allocator() {
  // Stateless: a function-local instance holds no data, only a vtable.
  static DefaultAllocator instance;
  return instance;
}

void* TrackingAllocator::allocate(std::size_t bytes, std::size_t alignment) {
  void* ptr = upstream_.allocate(bytes, alignment);
  const std::size_t live = live_.fetch_add(bytes) + bytes;
  std::size_t peak = peak_.load();
  while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
  }
  count_.fetch_add(1);
  return ptr;
}

void TrackingAllocator::deallocate(void* ptr, std::size_t bytes, std::size_t alignment) {
  if (ptr == nullptr) return;
  upstream_.deallocate(ptr, bytes, alignment);
  live_.fetch_sub(bytes);
}

}  // namespace grpo
