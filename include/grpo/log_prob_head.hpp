// The generic log-prob head: per-token logp (and entropy) of hidden x W
// without [N, V] logits, and, given dL/dlogp and dL/dentropy from any loss
// computed elsewhere, dhidden, dweight and dbias. What TRL's
// add_fused_lm_head computes in PyTorch; the fused GRPO loss
// (LmHeadLossPlan) is this head with the loss's own coefficients built in.
//
//   grpo::LmHeadLogProbPlan plan(shape, {.temperature = 0.9F});
//   std::span<std::byte> ws = ...;  // >= plan.workspace_size() bytes, 64-byte aligned; or {}
//   plan.forward({hidden, weight, bias, ids, mask}, {.logp = logp, .entropy = ent}, ws);
//   // ... any loss of logp / ent, giving dlogp and dent ...
//   plan.backward({hidden, weight, bias, ids, mask}, {.dlogp = dlogp, .dentropy = dent},
//                 {.dhidden = dh, .dweight = dw, .dbias = db}, ws);
//
// The backward recomputes the logits of the rows it needs (a fourth GEMM pass
// over the forward's three): rows whose dlogp and dentropy are both exactly 0
// (or that are masked) are skipped by all three backward GEMMs, and a block
// with no such row is not recomputed at all.
//
// Mask: optional. A masked row (mask 0) is outside the computation: its logp
// is 0 and its id is never read (as in the fused loss), its entropy is still
// written (it needs no id), and its dlogp / dentropy are ignored (treated as 0;
// they must still be finite).
// Temperature: as LossConfig. Default: x = z / tau, logp = x_y - LSE(x),
// entropy of softmax(x). temperature_on_logp: logp = (z_y - LSE(z)) / tau and
// the entropy is that of softmax(z) (what the fused plan returns), so its
// gradient carries no 1/tau.
// Groups (options.scale_out, grpo/communicator.hpp): as LmHeadLossPlan's. A
// vocab group's ranks hold shards of W's rows and of the bias
// (shape.vocab_offset / global_vocab), every row with the same ids and mask,
// and, in backward(), the same dlogp / dentropy of valid rows; logp and
// entropy are merged over the shards (the same bits on every rank), dweight /
// dbias are the shard's, dhidden is summed over the group. A data group's
// ranks hold their own rows and all of W; backward() sums dweight and dbias
// over the group (the gradient of a loss summed over every rank's rows).
// Plan creation, forward() and backward() are then collective: every rank
// calls them, and a refusal on one rank is thrown on every rank.
// Ownership, threads, errors, workspace: as LmHeadLossPlan. forward() and
// backward() validate every argument (shapes, strides, ids, finiteness of
// hidden / weight / bias and of the upstream gradients, overflow bounds, output
// aliasing with any input) and throw grpo::Error naming it before writing any
// output. With a caller workspace neither call allocates on the heap (after
// the first call on a plan, which creates its GEMM bindings).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "grpo/lm_head_loss.hpp"
#include "grpo/types.hpp"

namespace grpo {

struct LogProbConfig {
  float temperature = 1.0F;
  bool temperature_on_logp = false;  // see the header comment
  // As LossConfig: z' = c tanh(s z / c) (or s z without a cap) before the temperature;
  // the backward applies dz'/dz.
  std::optional<float> logit_softcap;
  float logit_scale = 1.0F;
};

struct LogProbInputs {
  MatrixView hidden;                  // [N, H]
  MatrixView weight;                  // [V, H] or [H, V] per LmHeadShape::layout
  VectorView bias;                    // [V] or empty
  std::span<const std::int32_t> ids;  // [N], in [0, V) on valid rows
  std::span<const float> mask;        // [N] of 0 / 1, or empty: every row valid
};

struct LogProbOutputs {
  std::span<float> logp;             // [N], required; 0 on masked rows
  std::span<float> entropy;          // [N] or empty
  LmHeadStepStats* stats = nullptr;  // optional
};

// dL/dlogp and dL/dentropy of whatever loss the caller computed.
struct LogProbUpstream {
  std::span<const float> dlogp;     // [N], required
  std::span<const float> dentropy;  // [N] or empty (= 0)
};

struct LogProbGradients {
  MutMatrixView dhidden;             // [N, H], dtype = options.dhidden_dtype; zero rows where skipped
  MutMatrixView dweight;             // weight's layout, dtype = options.dweight_dtype; empty with frozen_weight
  std::span<float> dbias;            // [V] when has_bias and not frozen_weight
  LmHeadStepStats* stats = nullptr;  // optional
};

class LmHeadLogProbPlan {
 public:
  // options.forward_only: forward() only (no block buffer; backward() refuses).
  LmHeadLogProbPlan(const LmHeadShape& shape, const LogProbConfig& config = {}, const LmHeadOptions& options = {});
  ~LmHeadLogProbPlan();
  LmHeadLogProbPlan(LmHeadLogProbPlan&&) noexcept;
  LmHeadLogProbPlan& operator=(LmHeadLogProbPlan&&) noexcept;

  // Bytes for either call.
  std::size_t workspace_size() const;
  const LmHeadSchedule& schedule() const;
  std::string describe() const;

  // logp and entropy, bitwise those of an LmHeadLossPlan with the same shape,
  // temperature and options (same schedule code, same batch-invariant GEMM calls).
  void forward(const LogProbInputs& inputs, const LogProbOutputs& outputs, std::span<std::byte> workspace = {}) const;

  // dz_v = a_t (onehot - p_v) - b_t p_v (x_v - E_p[x]) with a_t = dlogp_t / tau and
  // b_t = dentropy_t times dx/dz (1/tau, or 1 under temperature_on_logp); then
  // dhidden = dz W, dweight (+)= dz^T hidden, dbias (+)= sum_t dz.
  void backward(const LogProbInputs& inputs, const LogProbUpstream& upstream, const LogProbGradients& gradients,
                std::span<std::byte> workspace = {}) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo
