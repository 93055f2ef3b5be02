// Plan creation and the per-call agreement of a fused LM-head plan over
// several processes (grpo/communicator.hpp). Both are collective: every rank
// runs its local checks, then the ranks of each group exchange one fixed-size
// record, so a refusal anywhere is a refusal everywhere and no rank is left
// in a collective. The step's own exchanges are in driver/scale_out.hpp.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <span>

#include "driver/lm_head_plan.hpp"
#include "grpo/lm_head_loss.hpp"

namespace grpo::detail {

bool has_groups(const ScaleOut& scale_out);
// The vocabulary the ids index: global_vocab, or vocab when unsharded.
std::int64_t global_vocab_of(const LmHeadShape& shape);
// The config the argument checks see: with global_num_items, a placeholder
// normalizer of 1 (no count gives a larger dLoss/dl_t).
LossConfig config_for_checks(const LossConfig& config, const ScaleOut& scale_out);

// The local checks of the scale-out arguments: shard fields, options that
// do not combine with a group (accumulate_weight_grads with a data group),
// global_num_items.
void check_scale_out_arguments(const LmHeadShape& shape, const LossConfig& config, const LmHeadOptions& options);
// Refuses a sharded shape or groups where a single-process entry point
// (baseline, generic log-prob head) is given one; what: that entry point.
void refuse_scale_out(const LmHeadShape& shape, const ScaleOut* scale_out, const char* what);

// The fused plan, alone (no groups: validate, then build) or collectively.
// validate: the local argument checks (throw grpo::Error). With groups the
// ranks exchange what they were given (shapes, shards, loss options), check it
// alike (shards tile the global vocabulary in rank order; the vocab group
// shares rows, the data group shares W), then the token block each chose;
// every rank of a vocab group takes the group's smallest, so the per-block
// exchanges pair up.
std::unique_ptr<LmHeadPlanData> build_plan(const LmHeadShape& shape, const LossConfig& config,
                                           const LmHeadOptions& options, const std::function<void()>& validate);

// execute()'s agreement, after its local checks (refused: their refusal, or
// null): exchanges the outcome over the plan's groups and throws on every
// rank when any refused. The vocab group also checks that its ranks hold the
// same per-token inputs and that some shard's bias allows a token; the data
// group adds up the batch and valid-token counts (returned). Allocates
// nothing: the records live in the plan. Without groups: rethrows refused.
// shared: more per-token arrays a vocab group must share (the generic head's
// upstream dL/dlogp and dL/dEnt, whose nonzero rows every rank's backward
// recomputes and exchanges alike); their masked rows are not compared.
GlobalCounts agree_on_call(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const std::exception_ptr& refused,
                           std::span<const std::span<const float>> shared = {});

}  // namespace grpo::detail
