// The three oneDNN GEMMs of the unfused LM-head step (logits, dhidden,
// dweight; the logits GEMM alone when forward-only), timed alone: the very
// primitives LmHeadBaseline builds, each a whole-matrix call with oneDNN's
// own OpenMP team (the run's thread cap), no loss work, operands allocated
// and touched before the clock starts.
//
// A reference point, not an upper bound: the fused path runs its tiles as
// single-threaded GEMMs inside TBB tasks and skips the rows whose
// coefficient is zero, and can be faster than these. The machine's peak
// (machine_peak.hpp) is the upper bound.
#pragma once

#include <memory>

#include "grpo/baseline.hpp"
#include "grpo/grpo.hpp"

namespace grpo::detail {
struct LmHeadBaselineData;
}

namespace grpo::bench {

struct UnfusedGemmTimes {
  double logits_s = 0.0;
  double dhidden_s = 0.0;
  double dweight_s = 0.0;
  double total() const { return logits_s + dhidden_s + dweight_s; }
};

class UnfusedGemms {
 public:
  // shape: dense strides (the microbench's inputs). options.allocator: where
  // the [N, V] logits and dlogits operands come from (nullptr = the default).
  UnfusedGemms(const LmHeadShape& shape, const LossConfig& config, const LmHeadBaselineOptions& options);
  ~UnfusedGemms();
  UnfusedGemms(UnfusedGemms&&) noexcept;
  UnfusedGemms& operator=(UnfusedGemms&&) noexcept;

  // Reads inputs.hidden / weight / bias; overwrites outputs.dhidden and
  // outputs.dweight with products of zero dlogits (or adds them, with
  // accumulate_weight_grads). The seconds each GEMM took.
  UnfusedGemmTimes run(const LmHeadInputs& inputs, const LmHeadOutputs& outputs) const;

 private:
  std::unique_ptr<detail::LmHeadBaselineData> data_;
};

}  // namespace grpo::bench
