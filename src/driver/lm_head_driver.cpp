// The fused LM-head schedule. Per token block of `token_block` rows:
//   forward   logits tiles, row statistics, LSE, logp, entropy (LmHeadStep);
//             the block buffer keeps x - max per tile.
//   loss      the coefficient stage for the block's rows (LossAccumulator).
//   backward  the rows with c_t != 0 compacted, dlogits in place, dbias, dW and
//             dhidden GEMMs (LmHeadStep).
// Three GEMMs' worth of FLOPs: the logits are never recomputed unless
// sequence-level importance sampling has sequences that span blocks.
#include <cstring>

#include "api/validate.hpp"
#include "driver/lm_head_plan.hpp"
#include "driver/lm_head_step.hpp"
#include "driver/loss_accumulator.hpp"

namespace grpo::detail {

void run_lm_head(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                 std::byte* workspace, double max_abs_coef, const GlobalCounts& counts) {
  LmHeadStep step(p, inputs, outputs, workspace);
  const bool backward = !p.options.forward_only;
  const std::int64_t nb = p.schedule.token_block;
  LossAccumulator acc(p.config, p.shape.batch, p.shape.seq_len, inputs.batch, max_abs_coef);
  const ScaleOutPlan* so = p.scale_out.get();
  if (so != nullptr && (so->data || so->global_num_items)) {
    acc.use_global_counts(counts.batch, counts.num_valid, so->global_num_items);
  }
  bool dweight_written = p.options.accumulate_weight_grads;  // accumulate: always add
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
    step.gather_active(b0, na, (na + kRowQuantum - 1) / kRowQuantum * kRowQuantum);
    step.backward(b0, rows, na, false, c, e, &dweight_written);
  };

  if (!p.sequence_spans_blocks) {
    // A block's outputs are written only after its coefficients read every
    // per-token input of its rows (logp may be the very array old_logp is).
    for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, backward);
      // A top-entropy mask here means one block holds every row (see the schedule).
      if (needs_all_rows(p.config)) acc.set_entropy_threshold(step.entropy, step.quantile_space);
      try {
        acc.add_rows(b0, b0 + rows, step.logp, step.entropy, step.coef, step.kl, step.ent_coef);
      } catch (const Error& e) {
        // The one refusal that needs the policy's own logp (a k3 KL beyond
        // f32, see LossConfig::beta) is met block by block: say so when
        // earlier blocks' outputs exist. kl_clamp makes it impossible.
        if (b0 == 0) throw;
        throw Error(e.argument(), std::string(e.what()) + "; " + kEarlierBlocksWritten, e.kind());
      }
      step.write_token_outputs(b0, rows, step.logp, step.entropy, step.kl);
      if (backward) backward_block(b0, rows, step.coef, step.ent_coef);
    }
  } else {
    // Sequence-level ratios of sequences longer than a block: a first forward
    // pass for every logp, then the coefficients, then (with gradients) the
    // logits again, block by block, and the backward. Nothing is written
    // before the coefficients have read every per-token input.
    float* entropy_all = step.coef_all + p.rows;
    float* logp_all = entropy_all + p.rows;
    float* kl_all = logp_all + p.rows;
    float* ent_coef_all = p.entropy_bonus ? kl_all + p.rows : nullptr;
    for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, false);
      std::memcpy(logp_all + b0, step.logp, static_cast<std::size_t>(rows) * sizeof(float));
      std::memcpy(entropy_all + b0, step.entropy, static_cast<std::size_t>(rows) * sizeof(float));
    }
    if (needs_all_rows(p.config)) acc.set_entropy_threshold(entropy_all, step.quantile_space);
    acc.add_rows(0, p.rows, logp_all, entropy_all, step.coef_all, kl_all, ent_coef_all);
    step.write_token_outputs(0, p.rows, logp_all, entropy_all, kl_all);
    for (std::int64_t b0 = 0; backward && b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, true);
      backward_block(b0, rows, step.coef_all + b0, ent_coef_all != nullptr ? ent_coef_all + b0 : nullptr);
    }
  }
  if (backward && !dbias_ready) std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
  if (backward && !dweight_written) step.zero_dweight();  // every row inactive, overwrite mode
  // Data parallelism: global metrics, dW and dbias summed over the data group.
  if (so != nullptr && so->data) {
    finish_data_parallel(p, outputs, &acc, workspace, nullptr);
  } else if (outputs.metrics != nullptr) {
    *outputs.metrics = acc.metrics();
  }
  if (outputs.stats != nullptr) *outputs.stats = step.step_stats();
}

}  // namespace grpo::detail
