// The fused LM-head schedule. Per token block of `token_block` rows:
//   forward   logits tiles, row statistics, LSE, logp, entropy (LmHeadStep);
//             the block buffer keeps x - max per tile.
//   loss      the coefficient stage for the block's rows (LossAccumulator).
//   backward  the rows with c_t != 0 compacted, dlogits in place, dbias, dW and
//             dhidden GEMMs (LmHeadStep).
// Three GEMMs' worth of FLOPs: the logits are never recomputed unless
// sequence-level importance sampling has sequences that span blocks.
// Packed sequences (BatchInputs::sequence_offsets) whose coefficients need
// whole sequences take blocks that end on sequence boundaries, so one pass
// serves whenever every sequence fits a token block.
#include <algorithm>
#include <cstring>
#include <span>

#include "driver/lm_head_plan.hpp"
#include "driver/lm_head_step.hpp"
#include "driver/loss_accumulator.hpp"

namespace grpo::detail {

namespace {

// The rows [b0, end) of the block starting at b0: at most nb rows, or (aligned)
// the whole sequences of offsets that fit in them.
std::int64_t block_end(std::int64_t b0, std::int64_t nb, std::int64_t rows, std::span<const std::int64_t> offsets,
                       bool aligned) {
  const std::int64_t end = std::min(b0 + nb, rows);
  if (!aligned) return end;
  return *(std::upper_bound(offsets.begin(), offsets.end(), end) - 1);  // the last sequence end <= end
}

// Whether packed sequences let a plan built for its two-pass schedule run one
// pass: it took two passes for whole sequences alone (not for every row's
// entropy), and every sequence fits a token block.
bool sequences_fit_blocks(const LmHeadPlanData& p, std::span<const std::int64_t> offsets) {
  if (!p.two_pass || offsets.empty() || !needs_whole_sequences(p.config) || needs_all_rows(p.config)) return false;
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    if (offsets[i] - offsets[i - 1] > p.schedule.token_block) return false;
  }
  return true;
}

void run_blocks(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::byte* workspace,
                double max_abs_coef, const GlobalCounts& counts, StepExchange& exchange) {
  LmHeadStep step(p, inputs, outputs, workspace, exchange);
  const RowArrays& row = step.regions.rows;
  const bool backward = !p.options.forward_only;
  const std::int64_t nb = p.schedule.token_block;
  LossAccumulator acc(p.config, p.shape.batch, p.shape.seq_len, inputs.batch, max_abs_coef);
  exchange.begin(acc, counts);
  bool dweight_written = p.options.accumulate_weight_grads;  // accumulate: always add
  if (backward) step.prepare_tail();                         // the filtered backward's bases (grad_filter), from W
  // dbias is zeroed (overwrite mode) just before the first backward, after the
  // first coefficients: a refusal there leaves it untouched.
  bool dbias_ready = outputs.dbias.empty() || p.options.accumulate_weight_grads;
  // c: dLoss/dlogp per block row; e: dLoss/dEnt (entropy bonus) or null.
  auto backward_block = [&](std::int64_t b0, std::int64_t rows, const float* c, const float* e) {
    if (!dbias_ready) std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
    dbias_ready = true;
    // Exact zeros (masked, clipped, A = 0) drop out of both GEMMs.
    const std::int64_t na =
        step.select_active(rows, [&](std::int64_t r) { return c[r] != 0.0F || (e != nullptr && e[r] != 0.0F); });
    step.gather_active(b0, na, p.row_ladder.padded(na));
    step.backward(b0, rows, na, false, c, e, &dweight_written);
  };

  // dLoss/dEnt per block row (entropy bonus only).
  float* const block_entropy_coef = step.regions.entropy_coef.empty() ? nullptr : step.regions.entropy_coef.data();
  const std::span<const std::int64_t> offsets = inputs.batch.sequence_offsets;
  const bool aligned = sequences_fit_blocks(p, offsets);
  if (!p.two_pass || aligned) {
    // A block's outputs are written only after its coefficients read every
    // per-token input of its rows (logp may be the very array old_logp is).
    for (std::int64_t b0 = 0, b1 = 0; b0 < p.rows; b0 = b1) {
      b1 = block_end(b0, nb, p.rows, offsets, aligned);
      const std::int64_t rows = b1 - b0;
      step.forward(b0, rows, backward);
      // A top-entropy mask here means one block holds every row (see the schedule).
      if (needs_all_rows(p.config)) acc.set_entropy_threshold(row.entropy.data(), step.regions.quantile.data());
      try {
        acc.add_rows(b0, b0 + rows, row.logp.data(), row.entropy.data(), row.coef.data(), row.kl.data(),
                     block_entropy_coef);
      } catch (const Error& e) {
        // The one refusal that needs the policy's own logp (a k3 KL beyond
        // f32, see LossConfig::beta) is met block by block: say so when
        // earlier blocks' outputs exist. kl_clamp makes it impossible.
        if (b0 == 0) throw;
        throw Error(e.argument(), std::string(e.what()) + "; " + kEarlierBlocksWritten, e.kind());
      }
      step.write_token_outputs(b0, rows, row.logp.data(), row.entropy.data(), row.kl.data());
      if (backward) backward_block(b0, rows, row.coef.data(), block_entropy_coef);
    }
  } else {
    // The two-pass schedule (LmHeadPlanData::two_pass): a first forward
    // pass for every logp and entropy, then the coefficients, then (with gradients) the
    // logits again, block by block, and the backward. Nothing is written
    // before the coefficients have read every per-token input.
    const BatchArrays& all = step.regions.batch;
    float* const entropy_coef_all = all.entropy_coef.empty() ? nullptr : all.entropy_coef.data();
    for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, false);
      std::memcpy(all.logp.data() + b0, row.logp.data(), static_cast<std::size_t>(rows) * sizeof(float));
      std::memcpy(all.entropy.data() + b0, row.entropy.data(), static_cast<std::size_t>(rows) * sizeof(float));
    }
    if (needs_all_rows(p.config)) acc.set_entropy_threshold(all.entropy.data(), step.regions.quantile.data());
    acc.add_rows(0, p.rows, all.logp.data(), all.entropy.data(), all.coef.data(), all.kl.data(), entropy_coef_all);
    step.write_token_outputs(0, p.rows, all.logp.data(), all.entropy.data(), all.kl.data());
    for (std::int64_t b0 = 0; backward && b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, true);
      backward_block(b0, rows, all.coef.data() + b0, entropy_coef_all != nullptr ? entropy_coef_all + b0 : nullptr);
    }
  }
  if (backward && !dbias_ready) std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
  if (backward) step.finish_tail();
  if (backward && !dweight_written) step.zero_dweight();  // every row inactive, overwrite mode
  const std::int64_t summed_saturated = exchange.end(outputs, acc);
  if (outputs.stats != nullptr) *outputs.stats = step.step_stats(summed_saturated);
}

}  // namespace

void run_lm_head(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                 std::byte* workspace, double max_abs_coef, const GlobalCounts& counts) {
  StepExchange exchange(p, workspace);
  try {
    run_blocks(p, inputs, outputs, workspace, max_abs_coef, counts, exchange);
  } catch (...) {
    exchange.abandon(outputs, std::current_exception());
    throw;
  }
}

}  // namespace grpo::detail
