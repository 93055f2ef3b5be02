#include "driver/logits_driver.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "driver/buffer.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

void logits_loss_stage(const LogitsShape& shape, const LossConfig& config, const BatchInputs& batch, const float* lse,
                       const float* logp, const float* entropy, float* coef, float* kl, const LogitsOutputs& outputs,
                       double max_abs_coef, float* ent_coef, float* quantile_space) {
  const std::int64_t rows = shape.batch * shape.seq_len;
  for (std::int64_t r = 0; r < rows; ++r) check_row(lse[r], logp[r], batch.mask[r] != 0.0F, r, "logits");
  LossAccumulator acc(config, shape.batch, shape.seq_len, batch, max_abs_coef);
  if (needs_all_rows(config)) acc.set_entropy_threshold(entropy, quantile_space);
  acc.add_rows(0, rows, logp, entropy, coef, kl, ent_coef);
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
  const LogitTransform transform(config);
  const kernels::Elem in_type = elem_of(logits.dtype);
  const std::size_t in_size = size_of(logits.dtype);
  const auto* base = static_cast<const std::byte*>(logits.data);
  auto row_ptr = [&](std::int64_t r) { return base + static_cast<std::size_t>(r * logits.ld) * in_size; };
  const bool bonus = config.entropy_coef != 0.0F;
  const bool quantile = needs_all_rows(config);

  // Per-row scratch: lse, logp, entropy, coefficient, kl (+ dLoss/dEnt, + the
  // quantile's scratch); with a softcap, one row of z' per thread.
  const std::size_t per_row = 5 + (bonus ? 1 : 0) + (quantile ? 1 : 0);
  const std::size_t capped_rows = transform.capped() ? static_cast<std::size_t>(threads) : 0;
  Buffer scratch(allocator, (static_cast<std::size_t>(rows) * per_row + capped_rows * static_cast<std::size_t>(vocab)) *
                                sizeof(float));
  auto* lse = scratch.as<float>();
  float* logp = lse + rows;
  float* entropy = logp + rows;
  float* coef = entropy + rows;
  float* kl = coef + rows;
  float* next = kl + rows;
  float* ent_coef = bonus ? std::exchange(next, next + rows) : nullptr;
  float* quantile_space = quantile ? std::exchange(next, next + rows) : nullptr;
  float* capped = next;  // [threads, V]
  // The row the softmax reads (as f32 z' when capped) and its element type.
  auto softmax_row = [&](std::int64_t r, int slot) -> std::pair<const void*, kernels::Elem> {
    if (!transform.capped()) return {row_ptr(r), in_type};
    float* z = capped + static_cast<std::size_t>(slot) * static_cast<std::size_t>(vocab);
    k.softcap(row_ptr(r), in_type, vocab, transform.softcap_scale, transform.softcap, z);
    return {z, kernels::Elem::f32};
  };

  run_with_threads(threads, [&] {
    for_each_item(rows, threads, [&](std::int64_t r, int slot) {
      const auto [z, type] = softmax_row(r, slot);
      const kernels::RowStats st = k.row_stats(z, type, vocab, transform.scale);
      const bool valid = batch.mask[r] != 0.0F;
      const float target = valid ? load_scaled(z, type, batch.ids[r], transform.scale) : 0.0F;
      const RowResult res = finish_row(st, target, valid, transform);
      lse[r] = res.lse;
      logp[r] = res.logp;
      entropy[r] = res.entropy;
    });
  });
  // Errors are raised here, after the read-only pass and before any output.
  logits_loss_stage(shape, config, batch, lse, logp, entropy, coef, kl, outputs, max_abs_coef, ent_coef,
                    quantile_space);
  if (outputs.dlogits.empty()) return;

  const kernels::Elem out_type = elem_of(outputs.dlogits.dtype);
  const std::size_t out_size = size_of(outputs.dlogits.dtype);
  auto* out_base = static_cast<std::byte*>(outputs.dlogits.data);
  run_with_threads(threads, [&] {
    for_each_item(rows, threads, [&](std::int64_t r, int slot) {
      std::byte* out = out_base + static_cast<std::size_t>(r * outputs.dlogits.ld) * out_size;
      const float a = coef[r] * transform.grad_scale;
      const float b = bonus ? ent_coef[r] * transform.entropy_grad_scale : 0.0F;
      if (a == 0.0F && b == 0.0F) {
        // Masked, clipped or zero-advantage row: exact zeros, no exp.
        std::memset(out, 0, static_cast<std::size_t>(vocab) * out_size);
        return;
      }
      const std::int64_t target = batch.ids[r];  // a = b = 0 on masked rows
      const auto [z, type] = softmax_row(r, slot);
      dlogits_row(k, transform, z, type, vocab, transform.scale, 0.0F, lse[r], {a, b, lse[r] - entropy[r], b != 0.0F},
                  target, out, out_type, nullptr);
    });
  });
}

}  // namespace grpo::detail
