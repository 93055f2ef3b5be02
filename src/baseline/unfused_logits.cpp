#include "baseline/unfused_logits.hpp"

#include <cmath>
#include <cstring>
#include <memory>

#include "api/logits_validate.hpp"
#include "api/validate.hpp"
#include "driver/buffer.hpp"
#include "driver/logits_driver.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "kernels/eltwise.hpp"

namespace grpo::detail {

void run_unfused_logits(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                        const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs,
                        double max_abs_coef) {
  const std::int64_t rows = shape.batch * shape.seq_len;
  const std::int64_t vocab = shape.vocab;
  const std::size_t full = static_cast<std::size_t>(rows) * static_cast<std::size_t>(vocab);
  const kernels::EltwiseKernels& k = kernels::eltwise();
  const LogitTransform transform(config);
  const kernels::Elem in_type = elem_of(logits.dtype);
  const std::size_t in_size = size_of(logits.dtype);
  const auto* base = static_cast<const std::byte*>(logits.data);
  auto row_ptr = [&](std::int64_t r) { return base + static_cast<std::size_t>(r * logits.ld) * in_size; };

  // The materialized arrays an eager framework keeps alive for backward.
  Buffer log_softmax(allocator, full * sizeof(float));
  Buffer softmax(allocator, full * sizeof(float));
  Buffer per_row(allocator, static_cast<std::size_t>(rows) * 3 * sizeof(float));
  auto* lse = per_row.as<float>();
  float* logp = lse + rows;
  float* entropy = logp + rows;
  auto full_row = [&](const Buffer& b, std::int64_t r) { return b.as<float>() + r * vocab; };

  // log_softmax(z / tau): max pass, sum-exp pass, write pass.
  for_rows(threads, rows, [&](std::int64_t r) {
    const float m = k.max(row_ptr(r), in_type, vocab) * transform.scale;
    const float finite_m = std::isfinite(m) ? m : 0.0F;
    const float s = k.sum_exp(row_ptr(r), in_type, vocab, transform.scale, -finite_m);
    lse[r] = finite_m + std::log(s);
    if (!std::isfinite(m)) lse[r] = m;  // NaN / +inf / all -inf: refused below
    k.affine(row_ptr(r), in_type, vocab, transform.scale, -lse[r], full_row(log_softmax, r));
  });
  // softmax = exp(log_softmax), entropy = -sum p log p, gather: three separate
  // ops over the whole tensor, as an eager framework runs them.
  for_rows(threads, rows, [&](std::int64_t r) { k.exp(full_row(log_softmax, r), vocab, full_row(softmax, r)); });
  for_rows(threads, rows,
           [&](std::int64_t r) { entropy[r] = -k.dot_p_logp(full_row(softmax, r), full_row(log_softmax, r), vocab); });
  for (std::int64_t r = 0; r < rows; ++r) {
    logp[r] = batch.mask[r] != 0.0F ? full_row(log_softmax, r)[batch.ids[r]] * transform.post : 0.0F;
  }
  Buffer coef_buffer(allocator, static_cast<std::size_t>(rows) * 2 * sizeof(float));
  auto* coef = coef_buffer.as<float>();
  float* kl = coef + rows;
  logits_loss_stage(shape, config, batch, lse, logp, entropy, coef, kl, outputs, max_abs_coef);
  if (outputs.dlogits.empty()) return;

  // dlogits = c / tau * (onehot - softmax), every row (an eager framework does
  // not skip rows whose coefficient is zero).
  const kernels::Elem out_type = elem_of(outputs.dlogits.dtype);
  const std::size_t out_size = size_of(outputs.dlogits.dtype);
  auto* out_base = static_cast<std::byte*>(outputs.dlogits.data);
  for_rows(threads, rows, [&](std::int64_t r) {
    const std::int64_t target = batch.mask[r] != 0.0F ? batch.ids[r] : -1;
    k.onehot_minus(full_row(softmax, r), vocab, coef[r] * transform.grad_scale, target,
                   out_base + static_cast<std::size_t>(r * outputs.dlogits.ld) * out_size, out_type);
  });
}

}  // namespace grpo::detail

namespace grpo {

// The public class: the same validation as LogitsLossPlan (api/logits_validate.hpp),
// then run_unfused_logits above.
struct LogitsBaseline::Impl {
  LogitsShape shape;
  LossConfig config;
  ExecOptions options;
};

LogitsBaseline::LogitsBaseline(const LogitsShape& shape, const LossConfig& config, const ExecOptions& options) {
  detail::validate_logits_shape(shape);
  detail::validate_config(config);
  detail::refuse_baseline_features(config);
  if (options.max_threads < 0) throw Error("options.max_threads", "must be >= 0");
  impl_ = std::make_unique<Impl>(Impl{shape, config, options});
}

LogitsBaseline::~LogitsBaseline() = default;
LogitsBaseline::LogitsBaseline(LogitsBaseline&&) noexcept = default;
LogitsBaseline& LogitsBaseline::operator=(LogitsBaseline&&) noexcept = default;

void LogitsBaseline::execute(const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs) const {
  const double max_abs_coef = detail::validate_logits_call(impl_->shape, impl_->config, logits, batch, outputs);
  detail::run_unfused_logits(impl_->shape, impl_->config, detail::resolve_threads(impl_->options.max_threads),
                             detail::resolve(impl_->options.allocator), logits, batch, outputs, max_abs_coef);
}

}  // namespace grpo
