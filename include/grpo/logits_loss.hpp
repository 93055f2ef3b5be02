// GRPO loss and dlogits from an already-materialized logits matrix.
//
//   grpo::LogitsLossPlan plan({.batch = B, .seq_len = T, .vocab = V,
//                              .logits_dtype = grpo::DType::f32}, config);
//   grpo::Metrics metrics;
//   plan.execute(logits, batch, {.tokens = {logp}, .dlogits = dlogits, .metrics = &metrics});
//
// The fused kernel streams each row once forward (online max / sum-exp /
// entropy) and once backward ((onehot - p) * c). The unfused comparison
// path, LogitsBaseline, is in baseline.hpp (library grpo::baseline).
#pragma once

#include <cstdint>
#include <memory>

#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo {

struct LogitsShape {
  std::int64_t batch = 0;    // B sequences
  std::int64_t seq_len = 0;  // T tokens each; N = B * T rows
  std::int64_t vocab = 0;    // V
  DType logits_dtype = DType::f32;
};

struct ExecOptions {
  // Upper bound on the threads used; 0 = the current task_arena's concurrency.
  int max_threads = 0;
  // Source of every byte the library allocates; nullptr = default_allocator().
  Allocator* allocator = nullptr;
};

struct LogitsOutputs {
  TokenOutputs tokens;
  // [N, V] gradient of the loss w.r.t. logits, f32 or bf16. Empty = forward only.
  // May be the very same view as the logits (same data, dtype and ld): in-place.
  MutMatrixView dlogits;
  Metrics* metrics = nullptr;  // optional
};

class LogitsLossPlan {
 public:
  // Validates the shape and the configuration; throws grpo::Error.
  LogitsLossPlan(const LogitsShape& shape, const LossConfig& config, const ExecOptions& options = {});
  ~LogitsLossPlan();
  LogitsLossPlan(LogitsLossPlan&&) noexcept;
  LogitsLossPlan& operator=(LogitsLossPlan&&) noexcept;

  // Validates every argument, then computes. On a grpo::Error no output was written.
  // Thread-safe: one plan may execute concurrently on different buffers.
  void execute(const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs) const;

  const LogitsShape& shape() const;
  const LossConfig& config() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo
