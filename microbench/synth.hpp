// Input synthesis for the microbench and the gradcheck: host tensors in the
// library's layouts and dtypes, built before anything is measured, that look
// like a real GRPO step (logits of a realistic spread, old_logp near the
// current logp so the ratio crosses both clip edges).
//
// Every value is a pure function of (seed, tensor, index): synthesis runs in
// parallel and still gives the same tensors on any machine and thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common_config.hpp"

namespace grpo::bench {

// An uninitialized, 64-byte aligned host allocation (not through the
// library's allocator: inputs and outputs are not part of a step's peak).
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes);
  std::byte* data() const { return data_.get(); }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_.get());
  }
  std::size_t size() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  // Touches every page now, so first-touch page faults are not timed later.
  void fill_zero() const;

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t bytes_ = 0;
};

float bf16_to_float(std::uint16_t v);
std::uint16_t float_to_bf16(float v);  // round to nearest even
float f16_to_float(std::uint16_t v);   // the library's (kernels/f16.hpp)
std::uint16_t float_to_f16(float v);

// Element i of a [count] array of dtype, as float (bf16 widening is exact).
inline float load_float(const std::byte* base, DType dtype, std::size_t i) {
  if (dtype == DType::f32) {
    float f;
    std::memcpy(&f, base + 4 * i, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, base + 2 * i, 2);
  return dtype == DType::f16 ? f16_to_float(b) : bf16_to_float(b);
}

struct ProblemSpec {
  ShapeSpec shape;
  bool lm_head = true;  // hidden + weight; else logits
  DType dtype = DType::f32;
  DType logits_dtype = DType::f32;
  WeightLayout layout = WeightLayout::vocab_major;
  bool bias = false;
  LossSpec loss;
  InputSpec inputs;
  int threads = 0;
};

// The synthesized tensors of one run.
struct Problem {
  ProblemSpec spec;
  LossConfig config;  // spec.loss with its "auto" fields filled in
  HostBuffer hidden;  // [N, H], spec.dtype
  HostBuffer weight;  // [V, H] or [H, V], spec.dtype
  HostBuffer bias;    // [V] f32, or empty
  HostBuffer logits;  // [N, V], spec.logits_dtype (logits-level runs)
  std::vector<std::int32_t> ids;
  std::vector<float> mask, advantages, old_logp, ref_logp, is_weight;

  BatchInputs batch() const { return {ids, mask, advantages, old_logp, ref_logp, is_weight}; }
  LmHeadShape lm_head_shape() const;
  LmHeadInputs lm_head_inputs() const;
  MatrixView logits_view() const;
  std::int64_t num_valid() const;
};

// Builds every input; old_logp and ref_logp come from a forward-only run of
// the library's fused path on these very tensors.
Problem synthesize(const ProblemSpec& spec);

}  // namespace grpo::bench
