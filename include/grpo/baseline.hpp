// The unfused comparison paths: what an eager framework runs, with the same
// contract (same validation, same outputs) as the fused plans. They exist to
// measure the fused kernels against, not to train with: they materialize the
// full [N, V] logits (and dlogits). They are the library grpo::baseline
// (target_link_libraries(app grpo::baseline)), apart from grpo::grpo, and
// not included by grpo/grpo.hpp.
//
//   grpo::LmHeadBaseline baseline(shape, config, {.logits_dtype = grpo::DType::bf16});
//   baseline.execute(inputs, outputs);   // same views as LmHeadLossPlan::execute
//
// Ownership, thread safety and errors as for the plans (lm_head_loss.hpp,
// logits_loss.hpp): views are borrowed for one call; an object is immutable
// after construction; invalid arguments throw grpo::Error before any output
// is written. Unlike the plans, every oneDNN matmul here runs with oneDNN's
// own OpenMP team (max_threads threads), as a framework's matmul would.
#pragma once

#include <memory>

#include "grpo/lm_head_loss.hpp"
#include "grpo/logits_loss.hpp"
#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo {

// The unfused logits-level loss: log_softmax and softmax as full [N, V]
// arrays, entropy and the gather as separate whole-tensor ops.
class LogitsBaseline {
 public:
  LogitsBaseline(const LogitsShape& shape, const LossConfig& config, const ExecOptions& options = {});
  ~LogitsBaseline();
  LogitsBaseline(LogitsBaseline&&) noexcept;
  LogitsBaseline& operator=(LogitsBaseline&&) noexcept;

  void execute(const MatrixView& logits, const BatchInputs& batch, const LogitsOutputs& outputs) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The unfused LM head: full logits by one oneDNN matmul, then LogitsBaseline,
// then dhidden and dweight by two matmuls on the materialized dlogits.
// bf16 inputs produce bf16 logits and dlogits (the "bf16 logits" baseline)
// unless logits_dtype says f32.
struct LmHeadBaselineOptions {
  DType logits_dtype = DType::f32;
  int max_threads = 0;
  bool forward_only = false;
  DType dweight_dtype = DType::f32;
  DType dhidden_dtype = DType::f32;
  bool accumulate_weight_grads = false;
  Allocator* allocator = nullptr;
};

class LmHeadBaseline {
 public:
  LmHeadBaseline(const LmHeadShape& shape, const LossConfig& config, const LmHeadBaselineOptions& options = {});
  ~LmHeadBaseline();
  LmHeadBaseline(LmHeadBaseline&&) noexcept;
  LmHeadBaseline& operator=(LmHeadBaseline&&) noexcept;

  // dhidden must be dense (ld == hidden): the baseline writes it with one GEMM.
  void execute(const LmHeadInputs& inputs, const LmHeadOutputs& outputs) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo
