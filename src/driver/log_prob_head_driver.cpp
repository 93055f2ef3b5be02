// The generic log-prob head on the fused LM head's schedule (LmHeadStep):
//   forward   per token block, the fused forward without keeping logits:
//             logp and entropy, bitwise the fused plan's.
//   backward  per token block, the rows with a nonzero upstream gradient
//             (dlogp or dentropy; valid rows only) gathered to the top of the
//             block; their logits recomputed from the gathered rows (same GEMM
//             calls, so the same logits as the forward); dlogits with the
//             entropy term in place; dbias, dW and dhidden as the fused
//             backward. Inactive rows take part in no GEMM; a block without an
//             active row costs no GEMM at all.
// Over several processes (the plan's groups, driver/step_exchange.hpp) the
// step's exchanges are the fused loss's: a vocab group merges every block's
// tile statistics (the forward's and the backward's recompute alike: its
// ranks share the rows and the upstream gradients, so they select the same
// active rows) and sums the dhidden partials; a data group exchanges each
// call's outcome at its end and, after a backward, sums dW and dbias.
#include "driver/log_prob_head_driver.hpp"

#include <algorithm>
#include <exception>

#include "driver/lm_head_step.hpp"

namespace grpo::detail {

namespace {

void forward_blocks(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                    std::byte* workspace, StepExchange& exchange) {
  LmHeadStep step(p, inputs, outputs, workspace, exchange);
  const std::int64_t nb = p.schedule.token_block;
  for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
    const std::int64_t rows = std::min(nb, p.rows - b0);
    step.forward(b0, rows, false);
    step.write_token_outputs(b0, rows, step.regions.rows.logp.data(), step.regions.rows.entropy.data(),
                             step.regions.rows.kl.data());  // kl output absent
  }
  exchange.end(outputs);
  if (outputs.stats != nullptr) *outputs.stats = step.step_stats();
}

void backward_blocks(const LmHeadPlanData& p, const LmHeadInputs& inputs, std::span<const float> dlogp,
                     std::span<const float> dentropy, const LmHeadOutputs& outputs, std::byte* workspace,
                     StepExchange& exchange) {
  LmHeadStep step(p, inputs, outputs, workspace, exchange);
  const std::int64_t nb = p.schedule.token_block;
  const bool with_entropy = !dentropy.empty();
  bool dweight_written = p.options.accumulate_weight_grads;  // accumulate: always add
  step.prepare_tail();                                       // the filtered backward's bases (grad_filter), from W
  if (!outputs.dbias.empty() && !p.options.accumulate_weight_grads) {
    std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
  }
  for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
    const std::int64_t rows = std::min(nb, p.rows - b0);
    const std::int64_t na = step.select_active(rows, [&](std::int64_t r) {
      const std::int64_t row = b0 + r;
      return step.valid(row) && (dlogp[row] != 0.0F || (with_entropy && dentropy[row] != 0.0F));
    });
    if (na > 0) {
      // Padded to whole forward calls and to the backward GEMMs' rung (both
      // within the block's allocated rows).
      step.gather_active(
          b0, na, std::max((na + p.forward_rows - 1) / p.forward_rows * p.forward_rows, p.row_ladder.padded(na)));
      step.forward_gathered(b0, na);
    }
    step.backward(b0, rows, na, true, dlogp.data() + b0, with_entropy ? dentropy.data() + b0 : nullptr,
                  &dweight_written);
  }
  step.finish_tail();
  if (!dweight_written) step.zero_dweight();                    // every row inactive, overwrite mode
  const std::int64_t summed_saturated = exchange.end(outputs);  // a data group's dW and dbias summed
  if (outputs.stats != nullptr) *outputs.stats = step.step_stats(summed_saturated);
}

}  // namespace

void run_log_prob_forward(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                          std::byte* workspace) {
  StepExchange exchange(p, workspace);
  try {
    forward_blocks(p, inputs, outputs, workspace, exchange);
  } catch (...) {
    exchange.abandon(outputs, std::current_exception());  // a data group learns of it
    throw;
  }
}

void run_log_prob_backward(const LmHeadPlanData& p, const LmHeadInputs& inputs, std::span<const float> dlogp,
                           std::span<const float> dentropy, const LmHeadOutputs& outputs, std::byte* workspace) {
  StepExchange exchange(p, workspace);
  try {
    backward_blocks(p, inputs, dlogp, dentropy, outputs, workspace, exchange);
  } catch (...) {
    exchange.abandon(outputs, std::current_exception());  // a data group learns of it
    throw;
  }
}

}  // namespace grpo::detail
