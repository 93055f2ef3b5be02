// Validation of one LM-head call, shared by the fused plan and the baseline.
#pragma once

#include "grpo/lm_head_loss.hpp"

namespace grpo::detail {

struct LmHeadCallSpec {
  LmHeadShape shape;  // with the *_ld resolved (no zeros)
  LossConfig config;
  bool forward_only = false;
  DType dweight_dtype = DType::f32;
  DType dhidden_dtype = DType::f32;
  DType bias_dtype = DType::f32;
  bool dhidden_dense = false;  // the baseline writes dhidden with one GEMM of ld = H
  int threads = 1;             // for the finiteness scans
};

// Throws grpo::Error naming the argument; writes nothing. Returns the largest
// |c_t| whose gradients stay finite (LossAccumulator's max_abs_coef).
double validate_lm_head_call(const LmHeadCallSpec& spec, const LmHeadInputs& inputs, const LmHeadOutputs& outputs);

// Shape and option checks done once at plan creation.
void validate_lm_head_shape(const LmHeadShape& shape);

}  // namespace grpo::detail
