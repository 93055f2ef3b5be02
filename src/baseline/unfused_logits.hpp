// The unfused logits-level baseline: what an eager framework does. It
// materializes log_softmax [N, V] and softmax [N, V] in f32, gathers, computes
// the loss, then writes dlogits from the stored softmax. Each step is its own
// pass over memory (the eltwise kernels, same ISA as the fused path).
#pragma once

#include "grpo/logits_loss.hpp"

namespace grpo::detail {

// Arguments already validated; same outputs and refusals as run_logits_loss.
void run_unfused_logits(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                        const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs);

}  // namespace grpo::detail
