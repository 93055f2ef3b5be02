// The one place an LM-head step meets other processes (grpo/communicator.hpp,
// driver/scale_out.hpp). A plan of one process has no groups and every call
// here does nothing: the step's code reads as if there were no other process.
//   column_of     a token id's column in this plan's W (a vocab shard holds
//                 tokens [vocab_offset, vocab_offset + V) of a larger vocabulary)
//   row_stats     after a block's forward: its tile statistics merged over the
//                 vocab group, the chosen logit from the shard that holds it
//   sum_dhidden   after a block's dhidden GEMMs: the shards' partials summed
//   begin / end   the step's global counts; at its end the metrics, and dW
//                 and dbias summed over the data group (the generic head's
//                 end: the gradients alone, and its forward's outcome)
//   abandon       a refusal met inside the schedule: the other ranks of the
//                 data group, waiting at the end of the step, learn of it
// The hook lives for one call: what it knows of the call (whether the
// end-of-step exchange began) is the call's, not the plan's.
#pragma once

#include <cstdint>
#include <exception>

#include "driver/lm_head_plan.hpp"
#include "driver/loss_accumulator.hpp"

namespace grpo::detail {

class StepExchange {
 public:
  // workspace: the call's (the hook uses its Region::exchange).
  StepExchange(const LmHeadPlanData& plan, std::byte* workspace)
      : plan_(plan),
        so_(plan.scale_out.get()),
        workspace_(workspace),
        regions_(workspace, plan.layout),
        first_token_(plan.shape.vocab_offset) {}

  // The column of W that holds token id; outside [0, V) when another shard holds it.
  std::int64_t column_of(std::int64_t id) const { return id - first_token_; }

  // The statistics to merge for block rows [0, rows), tiles_out of them per
  // row: tile_stats itself in one process; with a vocab group, every shard's
  // tiles in token order, and target[r] the chosen logit as the shard holding
  // id_of(r) computed it (id_of(r) < 0: a masked row, target untouched).
  template <class IdOf>
  const kernels::RowStats* row_stats(std::int64_t rows, const kernels::RowStats* tile_stats, float* target,
                                     IdOf&& id_of, std::int64_t* tiles_out) const {
    *tiles_out = plan_.tiles;
    if (!vocab_sharded()) return tile_stats;
    *tiles_out = so_->global_tiles;
    return so_->gather_row_stats(regions_, rows, plan_.tiles, tile_stats, target, static_cast<IdOf&&>(id_of));
  }

  // count floats of dhidden partials (this shard's part of dlogits x W), summed over the vocab group.
  void sum_dhidden(float* dhidden, std::int64_t count) const {
    if (vocab_sharded()) so_->sum_in_rank_order(so_->vocab, dhidden, count, regions_, plan_.schedule.slots);
  }

  // Before the first block: the data group's batch and valid-token counts
  // (agree_on_call) become the loss's normalizers.
  void begin(LossAccumulator& acc, const GlobalCounts& counts) const {
    if (so_ != nullptr && (so_->data || so_->global_num_items)) {
      acc.use_global_counts(counts.batch, counts.num_valid, so_->global_num_items);
    }
  }

  // After the last block: the metrics (over the data group), and dW and
  // dbias summed over it. Returns the f16 dW entries the sum saturated.
  std::int64_t end(const LmHeadOutputs& outputs, const LossAccumulator& acc) {
    if (so_ != nullptr && so_->data) {
      ended_ = true;
      return finish_data_parallel(plan_, outputs, &acc, workspace_, nullptr);
    }
    if (outputs.metrics != nullptr) *outputs.metrics = acc.metrics();
    return 0;
  }

  // The generic log-prob head's end of a call (no loss, no metrics): with a
  // data group, the outcome exchanged and, after a backward, dW and dbias
  // summed over the group (a forward's outputs hold no gradient to sum).
  std::int64_t end(const LmHeadOutputs& outputs) {
    if (so_ == nullptr || !so_->data) return 0;
    ended_ = true;
    return finish_data_parallel(plan_, outputs, nullptr, workspace_, nullptr);
  }

  // The step met error before its end: with a data group whose end-of-step
  // exchange has not begun, the error is exchanged there (the others wait
  // for this rank) and the agreed refusal thrown; otherwise nothing.
  void abandon(const LmHeadOutputs& outputs, const std::exception_ptr& error) {
    if (so_ == nullptr || !so_->data || ended_) return;
    ended_ = true;
    finish_data_parallel(plan_, outputs, nullptr, workspace_, error);
  }

 private:
  bool vocab_sharded() const { return so_ != nullptr && so_->vocab; }

  const LmHeadPlanData& plan_;
  const ScaleOutPlan* so_;  // null: this process alone
  std::byte* workspace_;
  ExchangeRegions regions_;  // of Region::exchange
  std::int64_t first_token_;
  bool ended_ = false;  // the end-of-step exchange began
};

}  // namespace grpo::detail
