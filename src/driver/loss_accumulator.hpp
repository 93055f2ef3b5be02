// Turns per-token log-probabilities into the loss, the metrics and the
// per-token gradient coefficient c_t = dLoss/dlogp_t. Every normalizer that
// depends only on the mask (|o_i|, sum m) is computed up front, so rows can be
// fed block by block in row order and the sums come out identical to one
// pass over all rows.
#pragma once

#include <cstdint>
#include <span>

#include "grpo/loss_config.hpp"

namespace grpo::detail {

class LossAccumulator {
 public:
  // The batch must already be validated.
  LossAccumulator(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, const BatchInputs& inputs);

  // Rows [r0, r1): logp and entropy indexed by r - r0. Writes coef[r - r0] and,
  // when kl is non-empty, kl[r] (absolute index). For sequence-level importance
  // sampling, [r0, r1) must consist of whole sequences. Call in row order.
  void add_rows(std::int64_t r0, std::int64_t r1, const float* logp, const float* entropy, float* coef,
                std::span<float> kl);

  Metrics metrics() const;

 private:
  double advantage(std::int64_t row) const;
  double is_weight(std::int64_t row) const;
  double weight(std::int64_t row);  // w_t = dLoss/dl_t
  double log_ratio(std::int64_t row, double logp) const;
  // 1 / max(|o_i|, 1) for the sequence of `row`; rows arrive in order, so it is
  // recomputed once per sequence (no per-batch allocation).
  double seq_norm(std::int64_t row);

  LossConfig config_;
  std::int64_t batch_;
  std::int64_t seq_len_;
  BatchInputs in_;
  std::int64_t norm_seq_ = -1;  // sequence whose norm is cached
  double norm_seq_value_ = 0.0;
  double norm_ = 0.0;  // the loss-type normalizer (except grpo/sapo's per-sequence one)
  std::int64_t num_valid_ = 0;

  double loss_ = 0.0;
  double clip_low_ = 0.0;
  double clip_high_ = 0.0;
  double clip_region_ = 0.0;
  double kl_sum_ = 0.0;
  double entropy_sum_ = 0.0;
};

}  // namespace grpo::detail
