// The logits-level schedule: one forward pass per row (online max / sum-exp /
// entropy and the chosen logit), the loss over all rows, one backward pass
// per row writing (onehot - p) * c / tau (plus the entropy bonus's term, times
// the softcap's chain factor). Rows are split across TBB tasks. With a logit
// softcap each pass maps its row to z' = c tanh(s z / c) in a per-thread row
// buffer first.
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
// then writes logp, entropy, kl and the metrics. ent_coef[N] receives dLoss/dEnt
// (entropy bonus; may be null otherwise); quantile_space[N] is the top-entropy
// mask's scratch (may be null otherwise).
void logits_loss_stage(const LogitsShape& shape, const LossConfig& config, const BatchInputs& batch, const float* lse,
                       const float* logp, const float* entropy, float* coef, float* kl, const LogitsOutputs& outputs,
                       double max_abs_coef, float* ent_coef = nullptr, float* quantile_space = nullptr);

}  // namespace grpo::detail
