// Validation of the logits-level loss, shared by LogitsLossPlan (api) and the
// unfused LogitsBaseline (grpo::baseline): both take the same arguments and
// refuse the same ones.
#pragma once

#include "grpo/logits_loss.hpp"

namespace grpo::detail {

void validate_logits_shape(const LogitsShape& shape);

// Views, per-token inputs, outputs and their overlaps. Returns the largest
// |c_t| whose dlogits stay finite (see check_coefficient_bound).
double validate_logits_call(const LogitsShape& shape, const LossConfig& config, const MatrixView& logits,
                            const BatchInputs& batch, const LogitsOutputs& outputs);

}  // namespace grpo::detail
