// The step's shared state and its backward dispatch (see lm_head_step.hpp).
#include "driver/lm_head_step.hpp"

#include <cstring>

namespace grpo::detail {

StepState::StepState(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                     std::byte* workspace, StepExchange& call_exchange)
    : plan(plan),
      inputs(inputs),
      outputs(outputs),
      workspace(workspace),
      leased(plan.bindings.acquire()),
      logit_transform(plan.config),
      regions(workspace, plan.layout),
      step_exchange(call_exchange) {}

StepPart::StepPart(StepState& s)
    : p(s.plan),
      in(s.inputs),
      out(s.outputs),
      bindings(s.leased),
      transform(s.logit_transform),
      in_size(size_of(s.plan.shape.dtype)),
      store_size(s.plan.store_type == kernels::Elem::f32 ? 4 : 2),
      dl_size(size_of(s.plan.dlogits_dtype)),
      act_row_bytes(static_cast<std::size_t>(s.plan.shape.hidden_ld) * in_size),
      vocab_major(s.plan.shape.layout == WeightLayout::vocab_major),
      ws(s.regions),
      exchange(s.step_exchange),
      stats(s.counters),
      forward_gemm_clock(s.clocks.forward_gemm),
      forward_stage_clock(s.clocks.forward_stage),
      dlogits_clock(s.clocks.dlogits),
      dweight_clock(s.clocks.dweight),
      dhidden_clock(s.clocks.dhidden),
      gemm_f16_saturated(s.gemm_f16_saturated) {}

LmHeadStep::LmHeadStep(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                       std::byte* workspace, StepExchange& call_exchange)
    : StepState(plan, inputs, outputs, workspace, call_exchange),
      StepPart(static_cast<StepState&>(*this)),
      forward_(*this),
      dense_(*this) {
  if (plan.filter) filter_.emplace(*this, dense_);
}

LmHeadStepStats LmHeadStep::step_stats(std::int64_t summed_saturated) const {
  LmHeadStepStats s = counters;
  s.forward_gemm_s = clocks.forward_gemm.seconds();
  s.forward_stage_s = clocks.forward_stage.seconds();
  s.dlogits_s = clocks.dlogits.seconds();
  s.dweight_gemm_s = clocks.dweight.seconds();
  s.dhidden_gemm_s = clocks.dhidden.seconds();
  s.f16_saturated += StepState::gemm_f16_saturated.load(std::memory_order_relaxed) + summed_saturated;
  return s;
}

void LmHeadStep::write_token_outputs(std::int64_t b0, std::int64_t nb, const float* lp, const float* ent,
                                     const float* kl_terms) const {
  const auto bytes = static_cast<std::size_t>(nb) * sizeof(float);
  std::memcpy(out.tokens.logp.data() + b0, lp, bytes);
  if (!out.tokens.entropy.empty()) std::memcpy(out.tokens.entropy.data() + b0, ent, bytes);
  if (!out.tokens.kl.empty()) std::memcpy(out.tokens.kl.data() + b0, kl_terms, bytes);
}

void LmHeadStep::gather_active(std::int64_t b0, std::int64_t na, std::int64_t padded) {
  const std::size_t hidden_bytes = static_cast<std::size_t>(p.shape.hidden) * in_size;
  for (std::int64_t i = 0; i < na; ++i) {
    std::memcpy(ws.hidden_act.data() + static_cast<std::size_t>(i) * act_row_bytes, hidden_row(b0 + ws.rows.active[i]),
                hidden_bytes);
  }
  std::memset(ws.hidden_act.data() + static_cast<std::size_t>(na) * act_row_bytes, 0,
              static_cast<std::size_t>(padded - na) * act_row_bytes);
}

void LmHeadStep::backward(std::int64_t b0, std::int64_t nb, std::int64_t na, bool compacted, const float* logp_coef,
                          const float* entropy_coef, bool* dweight_written) {
  if (na == 0) {
    dense_.zero_dhidden_rows(b0, nb);
    return;
  }
  BackwardBlock b{b0, nb, na, p.row_ladder.padded(na), compacted, logp_coef, entropy_coef};
  stats.dhidden_gemm_rows += b.padded;
  stats.active_rows += na;
  if (!p.options.frozen_weight) stats.dweight_gemm_rows += b.padded;
  // The call's gradient scale (LmHeadInputs::grad_scale) rides on the row coefficients.
  const auto call_scale = static_cast<float>(in.grad_scale);
  b.logp_scale = transform.grad_scale * call_scale;
  b.entropy_scale = transform.entropy_grad_scale * call_scale;
  b.dbias = out.dbias.empty() ? nullptr : out.dbias.data();
  if (filter_) {
    filter_->block(b, dweight_written);
  } else {
    dense_.block(b, dweight_written);
  }
}

}  // namespace grpo::detail
