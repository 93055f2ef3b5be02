// The unfused logits-level baseline: what an eager framework does, one op at a
// time over the whole [N, V] tensor, each op its own pass over memory:
//   log_softmax(z / tau)  one row-wise kernel (max, sum-exp, write), as ATen's
//   softmax = exp(log_softmax)           materialized, f32
//   entropy = -sum(softmax * log_softmax) one reduction (no [N, V] temporary)
//   gather, loss (scalar work), then dlogits = c / tau (onehot - softmax).
// The eltwise kernels use the same ISA as the fused path.
#pragma once

#include "grpo/baseline.hpp"

namespace grpo::detail {

// Arguments already validated; same outputs and refusals as run_logits_loss.
void run_unfused_logits(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                        const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs,
                        double max_abs_coef);

}  // namespace grpo::detail
