// The generic log-prob head's schedule (see log_prob_head_driver.cpp).
#pragma once

#include <cstddef>
#include <span>

#include "driver/lm_head_plan.hpp"

namespace grpo::detail {

// Arguments already validated. The plan comes from build_lm_head_plan with a
// token-level LossConfig carrying the head's temperature.
void run_log_prob_forward(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                          std::byte* workspace);

// dlogp [N]; dentropy [N] or empty. outputs: dhidden, dweight, dbias, stats.
void run_log_prob_backward(const LmHeadPlanData& plan, const LmHeadInputs& inputs, std::span<const float> dlogp,
                           std::span<const float> dentropy, const LmHeadOutputs& outputs, std::byte* workspace);

}  // namespace grpo::detail
