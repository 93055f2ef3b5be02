// The LM-head entry points: plan creation (validate, schedule, primitives) and
// execution (validate the call, find the workspace, run the driver).
#include "grpo/lm_head_loss.hpp"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <sstream>
#include <string>
#include <utility>

#include "api/lm_head_validate.hpp"
#include "api/scale_out_plan.hpp"
#include "api/validate.hpp"
#include "driver/buffer.hpp"
#include "driver/lm_head_plan.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"

namespace grpo {

namespace detail {

void validate_lm_head_shape(const LmHeadShape& s) {
  validate_positive(s.batch, "shape.batch");
  validate_positive(s.seq_len, "shape.seq_len");
  validate_positive(s.hidden, "shape.hidden");
  validate_positive(s.vocab, "shape.vocab");
  if (s.vocab > (std::int64_t{1} << 31) - 1) throw Error("shape.vocab", "exceeds the int32 id range");
  if (!known_dtype(s.dtype)) throw Error("shape.dtype", "must be f32, bf16 or f16");
  if (s.has_bias && !known_dtype(s.bias_dtype)) throw Error("shape.bias_dtype", "must be f32, bf16 or f16");
  if (s.layout != WeightLayout::vocab_major && s.layout != WeightLayout::hidden_major) {
    throw Error("shape.layout", "unknown weight layout");
  }
  const std::int64_t weight_cols = s.layout == WeightLayout::vocab_major ? s.hidden : s.vocab;
  const std::int64_t weight_rows = s.layout == WeightLayout::vocab_major ? s.vocab : s.hidden;
  if (s.hidden_ld != 0 && s.hidden_ld < s.hidden) throw Error("shape.hidden_ld", "is smaller than hidden");
  if (s.weight_ld != 0 && s.weight_ld < weight_cols) throw Error("shape.weight_ld", "is smaller than the weight's row");
  if (s.dweight_ld != 0 && s.dweight_ld < weight_cols)
    throw Error("shape.dweight_ld", "is smaller than the weight's row");
  // oneDNN 2.6 keeps matmul dimensions and strides in 32-bit ints inside its
  // kernels (a hidden of 2^32 crashed there): refuse what it cannot take.
  constexpr std::int64_t kMaxDim = (std::int64_t{1} << 31) - 1;
  const std::pair<std::int64_t, const char*> dims[] = {
      {s.hidden, "shape.hidden"},         {s.hidden_ld, "shape.hidden_ld"}, {s.weight_ld, "shape.weight_ld"},
      {s.dweight_ld, "shape.dweight_ld"}, {s.seq_len, "shape.seq_len"},     {s.batch, "shape.batch"}};
  for (const auto& [value, name] : dims) {
    if (value > kMaxDim) {
      throw Error(name, std::to_string(value) + " exceeds the 2^31 - 1 that oneDNN's matmul takes",
                  ErrorKind::unsupported);
    }
  }
  // Every size the library derives (elements and bytes of each operand) must
  // fit in int64: checked here once, so nothing later can overflow or divide by 0.
  const std::int64_t rows = checked_mul(s.batch, s.seq_len, "shape.seq_len");
  const std::int64_t ld_h = std::max(s.hidden_ld, s.hidden);
  const std::int64_t ld_w = std::max({s.weight_ld, s.dweight_ld, weight_cols});
  checked_mul(checked_mul(rows, ld_h, "shape.hidden"), 8, "shape.hidden");
  checked_mul(checked_mul(weight_rows, ld_w, "shape.vocab"), 8, "shape.vocab");
  checked_mul(checked_mul(rows, s.vocab, "shape.vocab"), 8, "shape.vocab");
}

LmHeadShape resolve_lds(LmHeadShape s) {
  const std::int64_t weight_cols = s.layout == WeightLayout::vocab_major ? s.hidden : s.vocab;
  if (s.hidden_ld == 0) s.hidden_ld = s.hidden;
  if (s.weight_ld == 0) s.weight_ld = weight_cols;
  if (s.dweight_ld == 0) s.dweight_ld = weight_cols;
  return s;
}

void validate_grad_dtypes(const LmHeadShape& s, DType dweight, DType dhidden) {
  if (dweight == DType::bf16 && s.dtype != DType::bf16) {
    throw Error("options.dweight_dtype", "bf16 gradients need bf16 inputs (oneDNN has no f32 x f32 -> bf16 matmul)",
                ErrorKind::unsupported);
  }
  // An f16 dW is written by the GEMMs' f16 epilogue, which only our
  // widening backends have (oneDNN 2.6 has no f16 matmul without AVX512-FP16).
  if (dweight == DType::f16 && s.dtype != DType::f16) {
    throw Error("options.dweight_dtype",
                "f16 gradients need f16 inputs (shape.dtype is " + std::string(to_string(s.dtype)) + ")",
                ErrorKind::unsupported);
  }
  if (!known_dtype(dweight)) throw Error("options.dweight_dtype", "must be f32, bf16 or f16");
  if (!known_dtype(dhidden)) throw Error("options.dhidden_dtype", "must be f32, bf16 or f16");
}

void validate_head_options(const LmHeadShape& shape, const LmHeadOptions& options) {
  validate_grad_dtypes(shape, options.dweight_dtype, options.dhidden_dtype);
  if (options.max_threads < 0) throw Error("options.max_threads", "must be >= 0");
  if (options.token_block < 0) throw Error("options.token_block", "must be >= 0");
  if (options.vocab_tile < 0) throw Error("options.vocab_tile", "must be >= 0");
  if (options.frozen_weight && options.accumulate_weight_grads) {
    throw Error("options.accumulate_weight_grads", "has no dweight to add into: options.frozen_weight is set");
  }
  const double f = options.grad_filter;
  // The filter's rule and its guard are derived and tested for bf16 and
  // f32 dlogits and weights (docs/filtered_backward.md); an f16 step runs exact.
  if (f != 0.0 && shape.dtype == DType::f16 && !options.forward_only) {
    throw Error("options.grad_filter", "is not offered for f16 inputs yet: the f16 step runs exact (0)",
                ErrorKind::unsupported);
  }
  if (!(f >= 0.0 && f < 1.0) && f != kGradFilterAuto) {
    throw Error("options.grad_filter",
                "must be 0 (off), kGradFilterAuto or a threshold in (0, 1); got " + std::to_string(f));
  }
}

}  // namespace detail

struct LmHeadLossPlan::Impl {
  std::unique_ptr<detail::LmHeadPlanData> data;
  detail::LmHeadCallSpec call;
};

LmHeadLossPlan::LmHeadLossPlan(const LmHeadShape& shape, const LossConfig& config, const LmHeadOptions& options) {
  // Collective when options.scale_out has groups (api/scale_out_plan.hpp).
  const LossConfig checked = detail::config_for_checks(config, options.scale_out);
  auto impl = std::make_unique<Impl>();
  impl->data = detail::build_plan(shape, config, options, [&] {
    detail::validate_lm_head_shape(shape);
    detail::validate_config(checked);
    detail::validate_head_options(shape, options);
    detail::check_scale_out_arguments(shape, config, options);
  });
  impl->call = {impl->data->shape, checked, options.forward_only,       options.dweight_dtype, options.dhidden_dtype,
                shape.bias_dtype,  false,   impl->data->schedule.slots, options.frozen_weight};
  impl_ = std::move(impl);
}

LmHeadLossPlan::~LmHeadLossPlan() = default;
LmHeadLossPlan::LmHeadLossPlan(LmHeadLossPlan&&) noexcept = default;
LmHeadLossPlan& LmHeadLossPlan::operator=(LmHeadLossPlan&&) noexcept = default;

std::size_t LmHeadLossPlan::workspace_size() const { return impl_->data->layout.total; }
const LmHeadSchedule& LmHeadLossPlan::schedule() const { return impl_->data->schedule; }

std::string LmHeadLossPlan::describe() const {
  const detail::LmHeadPlanData& d = *impl_->data;
  const LmHeadSchedule& s = d.schedule;
  const int passes = d.options.forward_only ? 1 : (s.recompute_logits ? 4 : 3) - (d.options.frozen_weight ? 1 : 0);
  std::ostringstream os;
  os << "fused lm-head: token_block=" << s.token_block << " vocab_tile=" << s.vocab_tile << " (" << d.tiles
     << " tiles) forward_rows=" << d.forward_rows << " hidden_chunk=" << d.hidden_chunk << detail::describe_threads(d)
     << " gemm_passes=" << passes
     << (s.recompute_logits ? (detail::needs_all_rows(d.config)
                                   ? " (logits recomputed: the top-entropy mask needs every row's entropy first)"
                                   : " (logits recomputed: a whole-sequence term spans token blocks)")
                            : "")
     << (d.entropy_bonus ? " entropy_bonus=fused" : "") << (d.config.logit_softcap ? " softcap=fused" : "")
     << (d.options.frozen_weight && !d.options.forward_only ? " frozen_weight=no_dW" : "")
     << " workspace=" << s.workspace_bytes << "B" << detail::describe_gemms(d);
  if (d.scale_out) os << d.scale_out->describe();
  return os.str();
}

void LmHeadLossPlan::execute(const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                             std::span<std::byte> workspace) const {
  double max_abs_coef = 0.0;
  detail::Buffer owned;
  std::byte* ws = workspace.data();
  const detail::ScaleOutPlan* so = impl_->data->scale_out.get();
  std::exception_ptr refused;  // with groups, exchanged before it is thrown
  try {
    max_abs_coef = detail::validate_lm_head_call(impl_->call, inputs, outputs);
    ws = detail::call_workspace(workspace, workspace_size(), impl_->data->options.allocator, owned);
  } catch (...) {
    if (so == nullptr) throw;
    refused = std::current_exception();
  }
  // Collective with groups: every rank's refusal is every rank's.
  const detail::GlobalCounts counts = detail::agree_on_call(*impl_->data, inputs, refused);
  // A refusal met inside the schedule reaches the other ranks through the
  // step's exchange hook (driver/step_exchange.hpp).
  detail::run_lm_head(*impl_->data, inputs, outputs, ws, max_abs_coef, counts);
}

}  // namespace grpo
