// The logits-level entry point: validate, then hand over to the driver. The
// unfused baseline (src/baseline/unfused_logits.cpp) shares the validation.
#include "grpo/logits_loss.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "api/logits_validate.hpp"
#include "api/validate.hpp"
#include "driver/buffer.hpp"
#include "driver/logits_driver.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo {

struct LogitsLossPlan::Impl {
  LogitsShape shape;
  LossConfig config;
  ExecOptions options;
};

namespace detail {

void validate_logits_shape(const LogitsShape& shape) {
  detail::validate_positive(shape.batch, "shape.batch");
  detail::validate_positive(shape.seq_len, "shape.seq_len");
  detail::validate_positive(shape.vocab, "shape.vocab");
  if (shape.vocab > (std::int64_t{1} << 31) - 1) throw Error("shape.vocab", "exceeds the int32 id range");
  // Sizes derived later (rows, elements and bytes of [N, V]) must fit in int64.
  const std::int64_t rows = detail::checked_mul(shape.batch, shape.seq_len, "shape.seq_len");
  detail::checked_mul(detail::checked_mul(rows, shape.vocab, "shape.vocab"), 8, "shape.vocab");
  if (shape.logits_dtype != DType::f32 && shape.logits_dtype != DType::bf16) {
    throw Error("shape.logits_dtype", "must be f32 or bf16");
  }
}

}  // namespace detail

namespace {

// A bound on |x| = |z'| * scale over the finite logits: from the cap, or a
// scan (only the entropy bonus needs it). Non-finite entries are skipped here
// (the forward pass refuses NaN / +inf; -inf gives p = 0).
double x_bound(const LossConfig& config, const MatrixView& logits) {
  const double scale = (config.temperature_on_logp ? 1.0 : 1.0 / config.temperature);
  if (config.logit_softcap) return static_cast<double>(*config.logit_softcap) * scale;
  const kernels::StageKernels& k = kernels::kernels();
  const kernels::Elem type = detail::elem_of(logits.dtype);
  const std::size_t size = size_of(logits.dtype);
  double max_abs = 0.0;
  for (std::int64_t r = 0; r < logits.rows; ++r) {
    const auto* row = static_cast<const std::byte*>(logits.data) + static_cast<std::size_t>(r * logits.ld) * size;
    float m = k.max_abs(row, type, logits.cols);
    if (!std::isfinite(m)) {
      m = 0.0F;
      for (std::int64_t v = 0; v < logits.cols; ++v) {
        const float z = std::fabs(detail::load_scaled(row, type, v, 1.0F));
        if (std::isfinite(z)) m = std::max(m, z);
      }
    }
    max_abs = std::max(max_abs, static_cast<double>(m));
  }
  return max_abs * static_cast<double>(config.logit_scale) * scale;
}

}  // namespace

namespace detail {

double validate_logits_call(const LogitsShape& shape, const LossConfig& config, const MatrixView& logits,
                            const BatchInputs& batch, const LogitsOutputs& outputs) {
  const std::int64_t rows = shape.batch * shape.seq_len;
  detail::validate_matrix(logits, "logits", rows, shape.vocab, shape.logits_dtype);
  const detail::BatchMagnitudes magnitudes =
      detail::validate_batch(config, shape.batch, shape.seq_len, shape.vocab, batch);
  detail::validate_token_outputs(outputs.tokens, rows);
  detail::check_token_outputs_vs_batch(outputs.tokens, batch);
  const detail::ByteRange in_range = detail::byte_range(logits);
  const auto span_range = [](std::span<float> s) { return detail::byte_range(s.data(), s.size_bytes()); };
  detail::check_no_overlap(span_range(outputs.tokens.logp), "logp", in_range, "logits");
  detail::check_no_overlap(span_range(outputs.tokens.entropy), "entropy", in_range, "logits");
  detail::check_no_overlap(span_range(outputs.tokens.kl), "kl", in_range, "logits");
  if (outputs.dlogits.empty()) return std::numeric_limits<double>::infinity();
  detail::validate_matrix(outputs.dlogits, "dlogits", rows, shape.vocab);
  const detail::ByteRange out_range = detail::byte_range(outputs.dlogits.as_const());
  const bool in_place =
      outputs.dlogits.data == logits.data && outputs.dlogits.ld == logits.ld && outputs.dlogits.dtype == logits.dtype;
  if (!in_place) detail::check_no_overlap(out_range, "dlogits", in_range, "logits (in place needs the same view)");
  detail::check_no_overlap(span_range(outputs.tokens.logp), "logp", out_range, "dlogits");
  detail::check_no_overlap(span_range(outputs.tokens.entropy), "entropy", out_range, "dlogits");
  detail::check_no_overlap(span_range(outputs.tokens.kl), "kl", out_range, "dlogits");
  detail::check_output_vs_batch(out_range, "dlogits", batch, false);
  // Each dlogits element is one term: |c_t| / tau (plus the entropy bonus's, bounded by the spread of x).
  return detail::check_coefficient_bound(config, magnitudes.sequences, magnitudes, 1.0, 1.0,
                                         config.entropy_coef != 0.0F ? 2.0 * x_bound(config, logits) : 0.0);
}

}  // namespace detail

LogitsLossPlan::LogitsLossPlan(const LogitsShape& shape, const LossConfig& config, const ExecOptions& options) {
  detail::validate_logits_shape(shape);
  detail::validate_config(config);
  if (options.max_threads < 0) throw Error("options.max_threads", "must be >= 0");
  impl_ = std::make_unique<Impl>(Impl{shape, config, options});
}

LogitsLossPlan::~LogitsLossPlan() = default;
LogitsLossPlan::LogitsLossPlan(LogitsLossPlan&&) noexcept = default;
LogitsLossPlan& LogitsLossPlan::operator=(LogitsLossPlan&&) noexcept = default;

const LogitsShape& LogitsLossPlan::shape() const { return impl_->shape; }
const LossConfig& LogitsLossPlan::config() const { return impl_->config; }

void LogitsLossPlan::execute(const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs) const {
  const double max_abs_coef = detail::validate_logits_call(impl_->shape, impl_->config, logits, batch, outputs);
  detail::run_logits_loss(impl_->shape, impl_->config, detail::resolve_threads(impl_->options.max_threads),
                          detail::resolve(impl_->options.allocator), logits, batch, outputs, max_abs_coef);
}

}  // namespace grpo
