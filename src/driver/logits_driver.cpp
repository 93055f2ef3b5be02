#include "driver/logits_driver.hpp"

#include <cmath>
#include <cstring>
#include <string>

#include "api/buffer.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

void logits_loss_stage(const LogitsShape& shape, const LossConfig& config, const BatchInputs& batch, const float* lse,
                       const float* logp, const float* entropy, float* coef, float* kl, const LogitsOutputs& outputs,
                       double max_abs_coef) {
  const std::int64_t rows = shape.batch * shape.seq_len;
  for (std::int64_t r = 0; r < rows; ++r) check_row(lse[r], logp[r], batch.mask[r] != 0.0F, r, "logits");
  LossAccumulator acc(config, shape.batch, shape.seq_len, batch, max_abs_coef);
  acc.add_rows(0, rows, logp, entropy, coef, kl);
  if (!outputs.tokens.kl.empty()) {
    std::memcpy(outputs.tokens.kl.data(), kl, static_cast<std::size_t>(rows) * sizeof(float));
  }
  std::memcpy(outputs.tokens.logp.data(), logp, static_cast<std::size_t>(rows) * sizeof(float));
  if (!outputs.tokens.entropy.empty()) {
    std::memcpy(outputs.tokens.entropy.data(), entropy, static_cast<std::size_t>(rows) * sizeof(float));
  }
  if (outputs.metrics != nullptr) *outputs.metrics = acc.metrics();
}

void run_logits_loss(const LogitsShape& shape, const LossConfig& config, int threads, Allocator& allocator,
                     const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs,
                     double max_abs_coef) {
  const std::int64_t rows = shape.batch * shape.seq_len;
  const std::int64_t vocab = shape.vocab;
  const kernels::StageKernels& k = kernels::kernels();
  const Temperature temp(config);
  const kernels::Elem in_type = elem_of(logits.dtype);
  const std::size_t in_size = size_of(logits.dtype);
  const auto* base = static_cast<const std::byte*>(logits.data);
  auto row_ptr = [&](std::int64_t r) { return base + static_cast<std::size_t>(r * logits.ld) * in_size; };

  // Per-row scratch: lse, logp, entropy, coefficient, kl.
  Buffer scratch(allocator, static_cast<std::size_t>(rows) * 5 * sizeof(float));
  float* lse = scratch.as<float>();
  float* logp = lse + rows;
  float* entropy = logp + rows;
  float* coef = entropy + rows;
  float* kl = coef + rows;

  for_rows(threads, rows, [&](std::int64_t r) {
    const kernels::RowStats st = k.row_stats(row_ptr(r), in_type, vocab, temp.scale);
    const bool valid = batch.mask[r] != 0.0F;
    const float target = valid ? load_scaled(row_ptr(r), in_type, batch.ids[r], temp.scale) : 0.0F;
    const RowResult res = finish_row(st, target, valid, temp);
    lse[r] = res.lse;
    logp[r] = res.logp;
    entropy[r] = res.entropy;
  });
  // Errors are raised here, after the read-only pass and before any output.
  logits_loss_stage(shape, config, batch, lse, logp, entropy, coef, kl, outputs, max_abs_coef);
  if (outputs.dlogits.empty()) return;

  const kernels::Elem out_type = elem_of(outputs.dlogits.dtype);
  const std::size_t out_size = size_of(outputs.dlogits.dtype);
  auto* out_base = static_cast<std::byte*>(outputs.dlogits.data);
  for_rows(threads, rows, [&](std::int64_t r) {
    std::byte* out = out_base + static_cast<std::size_t>(r * outputs.dlogits.ld) * out_size;
    const float a = coef[r] * temp.grad_scale;
    if (a == 0.0F) {
      // Masked, clipped or zero-advantage row: exact zeros, no exp.
      std::memset(out, 0, static_cast<std::size_t>(vocab) * out_size);
      return;
    }
    k.dlogits_row(row_ptr(r), in_type, vocab, temp.scale, 0.0F, lse[r], a, batch.ids[r], out, out_type, nullptr);
  });
}

}  // namespace grpo::detail
