// The logits-level schedule: one forward pass per row (online max / sum-exp /
// entropy and the chosen logit), the loss over all rows, one backward pass
// per row writing (onehot - p) * c / tau. Rows are split across TBB tasks.
#pragma once

#include "grpo/logits_loss.hpp"

namespace grpo::detail {

// Arguments already validated. Throws grpo::Error("logits", ...) for NaN / +inf
// logits or an all -inf row, before writing any output.
void run_logits_loss(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                     const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs);

}  // namespace grpo::detail
