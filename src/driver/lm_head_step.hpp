// One call's pass over the LM-head schedule, shared by the fused GRPO loss
// (lm_head_driver.cpp) and the generic log-prob head (log_prob_head_driver.cpp),
// in three components over one call's state (StepState):
//   ForwardPass      (lm_head_forward.cpp) logits tiles, row statistics, LSE,
//                    logp, entropy; with keep, the block buffer keeps x - max.
//   DenseBackward    (lm_head_backward.cpp) the active rows' dlogits in place
//                    over the block buffer, dbias, dW per vocab tile, dhidden
//                    per hidden chunk: every gradient exact.
//   FilteredBackward (filtered_backward.cpp, filter_tail.cpp) the strategy a
//                    plan with LmHeadOptions::grad_filter chose: the block's
//                    kept columns through their own GEMMs, the rest through a
//                    rank-k correction, or the dense backward's GEMMs.
// What differs between the two heads is only where the per-row coefficients
// come from (the loss's c_t, or the caller's dL/dlogp and dL/dEnt) and whether
// the backward's logits are the forward's stored block or a recompute of the
// active rows alone.
#pragma once

#include <cstdint>
#include <optional>

#include "driver/filtered_backward.hpp"
#include "driver/lm_head_backward.hpp"
#include "driver/lm_head_forward.hpp"
#include "driver/step_state.hpp"

namespace grpo::detail {

// The step the drivers run: the forward pass, and the backward the plan chose
// (DenseBackward, or FilteredBackward when the plan has a filter).
class LmHeadStep : public StepState, public StepPart {
 public:
  LmHeadStep(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::byte* workspace,
             StepExchange& call_exchange);

  // counters with the phase times filled in; summed_saturated: the f16 dW
  // entries the data group's sum saturated (StepExchange::end), 0 without one.
  LmHeadStepStats step_stats(std::int64_t summed_saturated = 0) const;

  // Logits, statistics, LSE, logp and entropy of rows [b0, b0 + nb) (ForwardPass::block).
  void forward(std::int64_t b0, std::int64_t nb, bool keep) { forward_.block(b0, nb, keep); }
  // The rows gathered by gather_active(), with keep (ForwardPass::gathered).
  void forward_gathered(std::int64_t b0, std::int64_t na) { forward_.gathered(b0, na); }

  // Copies rows [b0, b0 + nb) of logp / entropy / kl (block-relative arrays)
  // to the token outputs.
  void write_token_outputs(std::int64_t b0, std::int64_t nb, const float* lp, const float* ent,
                           const float* kl_terms) const;

  // Collects the block rows r in [0, nb) with is_active(r) into active[]; returns their count.
  template <class Pred>
  std::int64_t select_active(std::int64_t nb, Pred&& is_active) {
    std::int64_t na = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (is_active(r)) ws.rows.active[na++] = r;
    }
    return na;
  }

  // Copies the active rows' hidden rows (block b0) to hidden_act and zeroes
  // rows [na, padded): padding rows add exact zeros to every GEMM.
  void gather_active(std::int64_t b0, std::int64_t na, std::int64_t padded);

  // Gradients of rows [b0, b0 + nb) whose active rows (active[0, na), see
  // select_active / gather_active) have upstream coefficients
  //   a_r = logp_coef[r] (dL/dlogp) and, when entropy_coef is non-null,
  //   b_r = entropy_coef[r] (dL/dEnt), r the block row.
  // The statistics and stored logits of active row i sit at row active[i]
  // (the fused forward's block) or, when compacted, at row i (forward_gathered).
  void backward(std::int64_t b0, std::int64_t nb, std::int64_t na, bool compacted, const float* logp_coef,
                const float* entropy_coef, bool* dweight_written);

  // The filtered backward's per-call work, before the first block and after
  // the last (nothing without a filter).
  void prepare_tail() {
    if (filter_) filter_->prepare();
  }
  void finish_tail() {
    if (filter_) filter_->finish();
  }
  void zero_dweight() const { dense_.zero_dweight(); }

 private:
  ForwardPass forward_;
  DenseBackward dense_;
  std::optional<FilteredBackward> filter_;
};

}  // namespace grpo::detail
