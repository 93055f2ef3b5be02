// The generic log-prob head's entry points: plan creation (the fused LM head's
// schedule and GEMMs, built for the head's temperature) and the two calls,
// each validating every argument before its first write.
#include "grpo/log_prob_head.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <utility>

#include "api/lm_head_validate.hpp"
#include "api/scale_out_plan.hpp"
#include "api/validate.hpp"
#include "driver/buffer.hpp"
#include "driver/lm_head_plan.hpp"
#include "driver/log_prob_head_driver.hpp"

namespace grpo {
namespace {

// The token-level loss configuration the shared plan builder and row math
// read: only the temperature and logit-transform fields matter to the generic head.
LossConfig loss_config_of(const LogProbConfig& c) {
  LossConfig config;
  config.temperature = c.temperature;
  config.temperature_on_logp = c.temperature_on_logp;
  config.logit_softcap = c.logit_softcap;
  config.logit_scale = c.logit_scale;
  return config;
}

void check_rows(std::size_t got, std::int64_t rows, const char* name) {
  if (static_cast<std::int64_t>(got) != rows) {
    throw Error(name, "has " + std::to_string(got) + " elements, expected " + std::to_string(rows));
  }
}

// ids [N] in [0, V) on valid rows; mask [N] of 0 / 1 or empty (every row valid).
void validate_ids_mask(const LogProbInputs& in, std::int64_t rows, std::int64_t vocab) {
  check_rows(in.ids.size(), rows, "ids");
  if (!in.mask.empty()) check_rows(in.mask.size(), rows, "mask");
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!in.mask.empty()) {
      const float m = in.mask[r];
      if (m != 0.0F && m != 1.0F) throw Error("mask", "element " + std::to_string(r) + " is not 0 or 1");
      if (m == 0.0F) continue;  // ids of masked rows are never read as indices
    }
    const std::int32_t id = in.ids[r];
    if (id < 0 || id >= vocab) {
      throw Error("ids", "element " + std::to_string(r) + " = " + std::to_string(id) + " is outside [0, " +
                             std::to_string(vocab) + ")");
    }
  }
}

detail::ByteRange float_range(std::span<const float> s) { return detail::byte_range(s.data(), s.size_bytes()); }

// The fused plan's view of the call: Step reads hidden, weight, bias, ids, mask.
LmHeadInputs as_lm_head_inputs(const LogProbInputs& in) {
  LmHeadInputs out{in.hidden, in.weight, in.bias, {}};
  out.batch.ids = in.ids;
  out.batch.mask = in.mask;
  return out;
}

}  // namespace

struct LmHeadLogProbPlan::Impl {
  std::unique_ptr<detail::LmHeadPlanData> data;
  detail::LmHeadCallSpec call;

  std::int64_t rows() const { return data->rows; }

  // hidden, weight, bias, ids, mask: views and index values (not yet the
  // operand values, scanned last). A vocabulary shard's ids are global.
  void validate_inputs(const LogProbInputs& in) const {
    detail::validate_lm_head_operands(call, as_lm_head_inputs(in));
    validate_ids_mask(in, rows(), detail::global_vocab_of(call.shape));
  }

  // With groups, a call's local checks are agreed before anything runs:
  // check() throws on this rank, agree_on_call makes it every rank's.
  template <class Check>
  void agree(const LmHeadInputs& in, Check&& check, std::span<const std::span<const float>> shared = {}) const {
    if (!data->scale_out) {
      check();
      return;
    }
    std::exception_ptr refused;
    try {
      check();
    } catch (...) {
      refused = std::current_exception();
    }
    detail::agree_on_call(*data, in, refused, shared);
  }

  // hidden, weight, bias, ids, mask, and room for the backward's dlogp, dentropy.
  static std::array<detail::NamedRange, 7> input_ranges(const LogProbInputs& in) {
    const std::array<detail::NamedRange, 3> operands = detail::operand_ranges(as_lm_head_inputs(in));
    return {operands[0], operands[1], operands[2],
            detail::NamedRange{detail::byte_range(in.ids.data(), in.ids.size_bytes()), "ids"},
            detail::NamedRange{float_range(in.mask), "mask"}};
  }

  // Upstream values: finite everywhere (masked rows' are ignored, not exempt).
  static void check_upstream_finite(const LogProbUpstream& upstream) {
    const auto finite_all = [](std::span<const float> v, const char* name) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (!std::isfinite(v[i])) throw Error(name, "element " + std::to_string(i) + " is not finite");
      }
    };
    finite_all(upstream.dlogp, "dlogp");
    finite_all(upstream.dentropy, "dentropy");
  }

  // Upstream gradients that overflow f32 from finite inputs (bounds: the
  // operands' magnitudes, validate_lm_head_values). Row t's dlogits sum to at
  // most 2|a_t| + |b_t| sum_v p_v |x_v - E_p[x]| <= 2|a_t| + 2|b_t| x_bound
  // (a_t = dlogp_t / tau, b_t = dentropy_t dx/dz); dbias and dW (over max|h|)
  // sum those over the valid rows, a dhidden row takes one of them times
  // max|W|. The logit scale s multiplies both (folded into the scale, or the
  // softcap's chain factor <= s).
  void check_upstream_bounds(const LogProbInputs& inputs, const LogProbUpstream& upstream,
                             const detail::OperandBounds& bounds) const {
    const double s_logit = call.config.logit_scale;
    const double tau = call.config.temperature / s_logit;
    const double entropy_scale = (call.config.temperature_on_logp ? 1.0 : 1.0 / call.config.temperature) * s_logit;
    double sum_logp = 0.0, sum_entropy = 0.0;
    for (std::int64_t r = 0; r < rows(); ++r) {
      if (!inputs.mask.empty() && inputs.mask[r] == 0.0F) continue;
      sum_logp += 2.0 * std::abs(static_cast<double>(upstream.dlogp[r])) / tau;
      if (!upstream.dentropy.empty()) {
        sum_entropy += 2.0 * std::abs(static_cast<double>(upstream.dentropy[r])) * entropy_scale * bounds.x_bound;
      }
    }
    const double operand_max =
        std::max({1.0, static_cast<double>(bounds.max_hidden), static_cast<double>(bounds.max_weight)});
    if (!((sum_logp + sum_entropy) * operand_max * 4.0 < static_cast<double>(std::numeric_limits<float>::max()))) {
      throw Error(sum_entropy > sum_logp ? "dentropy" : "dlogp",
                  "upstream gradients of this magnitude can overflow f32 in dhidden / dweight / dbias");
    }
  }

  std::byte* workspace(std::span<std::byte> given, detail::Buffer& owned) const {
    return detail::call_workspace(given, data->layout.total, data->options.allocator, owned);
  }
};

LmHeadLogProbPlan::LmHeadLogProbPlan(const LmHeadShape& shape, const LogProbConfig& config,
                                     const LmHeadOptions& options) {
  // Collective when options.scale_out has groups (api/scale_out_plan.hpp),
  // as LmHeadLossPlan's: the groups' semantics are the fused loss's.
  const LossConfig loss = loss_config_of(config);
  auto impl = std::make_unique<Impl>();
  impl->data = detail::build_plan(shape, loss, options, [&] {
    detail::validate_lm_head_shape(shape);
    if (!(config.temperature > 0.0F) || !std::isfinite(config.temperature)) {
      throw Error("config.temperature", "must be finite and > 0, got " + std::to_string(config.temperature));
    }
    detail::validate_logit_transform(config.logit_softcap, config.logit_scale);
    detail::validate_head_options(shape, options);
    detail::check_scale_out_arguments(shape, loss, options);
  });
  impl->call = {impl->data->shape, loss,  options.forward_only,       options.dweight_dtype, options.dhidden_dtype,
                shape.bias_dtype,  false, impl->data->schedule.slots, options.frozen_weight};
  impl_ = std::move(impl);
}

LmHeadLogProbPlan::~LmHeadLogProbPlan() = default;
LmHeadLogProbPlan::LmHeadLogProbPlan(LmHeadLogProbPlan&&) noexcept = default;
LmHeadLogProbPlan& LmHeadLogProbPlan::operator=(LmHeadLogProbPlan&&) noexcept = default;

std::size_t LmHeadLogProbPlan::workspace_size() const { return impl_->data->layout.total; }
const LmHeadSchedule& LmHeadLogProbPlan::schedule() const { return impl_->data->schedule; }

std::string LmHeadLogProbPlan::describe() const {
  const detail::LmHeadPlanData& d = *impl_->data;
  const LmHeadSchedule& s = d.schedule;
  std::ostringstream os;
  os << "log-prob head: token_block=" << s.token_block << " vocab_tile=" << s.vocab_tile << " (" << d.tiles
     << " tiles) forward_rows=" << d.forward_rows << " hidden_chunk=" << d.hidden_chunk << detail::describe_threads(d)
     << " gemm_passes=1 forward"
     << (d.options.forward_only ? ""
         : d.options.frozen_weight
             ? " + 2 backward (logits of rows with nonzero upstream recomputed; frozen_weight: no dW GEMMs)"
             : " + 3 backward (logits of rows with nonzero upstream recomputed)")
     << " workspace=" << s.workspace_bytes << "B" << detail::describe_gemms(d);
  if (d.scale_out) os << d.scale_out->describe();
  return os.str();
}

void LmHeadLogProbPlan::forward(const LogProbInputs& inputs, const LogProbOutputs& outputs,
                                std::span<std::byte> workspace) const {
  const Impl& m = *impl_;
  const LmHeadInputs in = as_lm_head_inputs(inputs);
  detail::Buffer owned;
  std::byte* ws = nullptr;
  // Collective with groups: a refusal on any rank is every rank's.
  m.agree(in, [&] {
    m.validate_inputs(inputs);
    check_rows(outputs.logp.size(), m.rows(), "logp");
    if (!outputs.entropy.empty()) check_rows(outputs.entropy.size(), m.rows(), "entropy");
    const std::array<detail::NamedRange, 7> ins = Impl::input_ranges(inputs);
    const std::array<detail::NamedRange, 2> outs = {
        {{float_range(outputs.logp), "logp"}, {float_range(outputs.entropy), "entropy"}}};
    detail::check_outputs_apart(outs, std::span(ins).first(5), [](std::size_t) {});
    detail::validate_lm_head_values(m.call, in);
    ws = m.workspace(workspace, owned);
  });
  LmHeadOutputs out;
  out.tokens.logp = outputs.logp;
  out.tokens.entropy = outputs.entropy;
  out.stats = outputs.stats;
  detail::run_log_prob_forward(*m.data, in, out, ws);
}

void LmHeadLogProbPlan::backward(const LogProbInputs& inputs, const LogProbUpstream& upstream,
                                 const LogProbGradients& gradients, std::span<std::byte> workspace) const {
  const Impl& m = *impl_;
  if (m.call.forward_only) {
    // Every rank of a group has the same forward_only (plan creation compared it).
    throw Error("options.forward_only", "the plan was built forward-only: backward() needs a plan with gradients",
                ErrorKind::unsupported);
  }
  const LmHeadInputs in = as_lm_head_inputs(inputs);
  LmHeadOutputs out;
  out.dhidden = gradients.dhidden;
  out.dweight = gradients.dweight;
  out.dbias = gradients.dbias;
  out.stats = gradients.stats;
  detail::Buffer owned;
  std::byte* ws = nullptr;
  // Collective with groups: a refusal on any rank is every rank's, and a
  // vocab group's ranks hold the same upstream gradients.
  const std::array<std::span<const float>, 2> shared = {upstream.dlogp, upstream.dentropy};
  m.agree(
      in,
      [&] {
        m.validate_inputs(inputs);
        check_rows(upstream.dlogp.size(), m.rows(), "dlogp");
        if (!upstream.dentropy.empty()) check_rows(upstream.dentropy.size(), m.rows(), "dentropy");
        detail::validate_lm_head_gradients(m.call, out);
        std::array<detail::NamedRange, 7> ins = Impl::input_ranges(inputs);
        ins[5] = {float_range(upstream.dlogp), "dlogp"};
        ins[6] = {float_range(upstream.dentropy), "dentropy"};
        const std::array<detail::NamedRange, 3> outs = {
            {{detail::byte_range(gradients.dhidden.as_const()), "dhidden"},
             {detail::byte_range(gradients.dweight.as_const()), "dweight"},
             {detail::byte_range(gradients.dbias.data(), gradients.dbias.size_bytes()), "dbias"}}};
        detail::check_outputs_apart(outs, ins, [](std::size_t) {});
        Impl::check_upstream_finite(upstream);
        m.check_upstream_bounds(inputs, upstream, detail::validate_lm_head_values(m.call, in));
        ws = m.workspace(workspace, owned);
      },
      shared);
  detail::run_log_prob_backward(*m.data, in, upstream.dlogp, upstream.dentropy, out, ws);
}

}  // namespace grpo
