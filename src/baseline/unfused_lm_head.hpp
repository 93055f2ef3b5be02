// The unfused LM-head baseline: full logits by one oneDNN matmul, the unfused
// logits-level baseline on them, then dhidden and dweight by two matmuls on
// the materialized dlogits. Every matmul runs multi-threaded (the caller's
// thread cap), as a framework's matmul would (baseline_gemm.hpp).
#pragma once

#include <memory>

#include "baseline/baseline_gemm.hpp"
#include "grpo/baseline.hpp"
#include "kernels/gemm.hpp"

namespace grpo::detail {

struct LmHeadBaselineData {
  LmHeadShape shape;  // *_ld resolved
  LossConfig config;
  LmHeadBaselineOptions options;
  int threads = 1;
  DType dlogits_dtype = DType::f32;  // = input dtype: the backward GEMMs' operand type
  std::unique_ptr<kernels::GemmEngine> engine;
  std::unique_ptr<BaselineGemm> logits;
  std::unique_ptr<BaselineGemm> dhidden;
  std::unique_ptr<BaselineGemm> dweight;
  std::size_t max_scratchpad = 0;
};

std::unique_ptr<LmHeadBaselineData> build_lm_head_baseline(const LmHeadShape& shape, const LossConfig& config,
                                                           const LmHeadBaselineOptions& options);

void run_lm_head_baseline(const LmHeadBaselineData& data, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                          double max_abs_coef);

}  // namespace grpo::detail
