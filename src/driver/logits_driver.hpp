// The logits-level schedule: one forward pass per row (online max / sum-exp /
// entropy and the chosen logit), the loss over all rows, one backward pass
// per row writing (onehot - p) * c / tau. Rows are split across TBB tasks.
#pragma once

#include "grpo/logits_loss.hpp"

namespace grpo::detail {

// Arguments already validated. Throws grpo::Error("logits", ...) for NaN / +inf
// logits or an all -inf row, before writing any output.
// max_abs_coef: from validation (LossAccumulator's bound on |c_t|).
void run_logits_loss(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                     const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs,
                     double max_abs_coef);

// The loss stage of both logits-level paths: refuses bad rows (NaN / +inf
// logits, an all -inf row, a chosen token at -inf), then computes the
// coefficients into coef[N] and the KL terms into kl[N] (scratch), and only
// then writes logp, entropy, kl and the metrics.
void logits_loss_stage(const LogitsShape& shape, const LossConfig& config, const BatchInputs& batch, const float* lse,
                       const float* logp, const float* entropy, float* coef, float* kl, const LogitsOutputs& outputs,
                       double max_abs_coef);

}  // namespace grpo::detail
