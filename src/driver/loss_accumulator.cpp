#include "driver/loss_accumulator.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/token_terms.hpp"

namespace grpo::detail {
namespace {

double clamp_log_ratio(double q, bool* flows) {
  *flows = q > -kernels::kLogRatioClamp && q < kernels::kLogRatioClamp;
  return std::clamp(q, -kernels::kLogRatioClamp, kernels::kLogRatioClamp);
}

}  // namespace

LossAccumulator::LossAccumulator(const LossConfig& config, std::int64_t batch, std::int64_t seq_len,
                                 const BatchInputs& inputs)
    : config_(config), batch_(batch), seq_len_(seq_len), in_(inputs) {
  for (const float m : inputs.mask) num_valid_ += m != 0.0F ? 1 : 0;
  switch (config.loss_type) {
    case LossType::grpo:
    case LossType::sapo: norm_ = 1.0 / static_cast<double>(batch); break;
    case LossType::bnpo: norm_ = 1.0 / std::max(static_cast<double>(num_valid_), 1.0); break;
    case LossType::dr_grpo:
      norm_ = 1.0 / (static_cast<double>(batch) * static_cast<double>(config.max_completion_length));
      break;
    case LossType::dapo:
    case LossType::cispo: norm_ = 1.0 / config.num_items_in_batch; break;
  }
}

double LossAccumulator::advantage(std::int64_t row) const {
  return in_.advantages.size() == static_cast<std::size_t>(batch_) ? in_.advantages[row / seq_len_]
                                                                   : in_.advantages[row];
}

double LossAccumulator::is_weight(std::int64_t row) const {
  if (in_.is_weight.empty()) return 1.0;
  return in_.is_weight.size() == static_cast<std::size_t>(batch_) ? in_.is_weight[row / seq_len_] : in_.is_weight[row];
}

double LossAccumulator::seq_norm(std::int64_t row) {
  const std::int64_t seq = row / seq_len_;
  if (seq != norm_seq_) {
    double valid = 0.0;
    for (std::int64_t t = seq * seq_len_; t < (seq + 1) * seq_len_; ++t) valid += in_.mask[t];
    norm_seq_ = seq;
    norm_seq_value_ = 1.0 / std::max(valid, 1.0);
  }
  return norm_seq_value_;
}

double LossAccumulator::weight(std::int64_t row) {
  const bool per_sequence = config_.loss_type == LossType::grpo || config_.loss_type == LossType::sapo;
  return in_.mask[row] * norm_ * (per_sequence ? seq_norm(row) : 1.0);
}

double LossAccumulator::log_ratio(std::int64_t row, double logp) const {
  return in_.old_logp.empty() ? 0.0 : logp - static_cast<double>(in_.old_logp[row]);
}

void LossAccumulator::add_rows(std::int64_t r0, std::int64_t r1, const float* logp, const float* entropy, float* coef,
                               std::span<float> kl) {
  const bool sequence = config_.importance_sampling_level == IsLevel::sequence;
  const double lo = 1.0 - config_.epsilon_low;
  const double hi = 1.0 + config_.epsilon_high;
  std::int64_t r = r0;
  while (r < r1) {
    // One sequence at sequence level, one token at token level.
    const std::int64_t end = sequence ? r + seq_len_ : r + 1;
    double q_seq = 0.0;
    bool seq_flows = true;
    if (sequence) {
      double sum = 0.0;
      for (std::int64_t t = r; t < end; ++t) {
        if (in_.mask[t] != 0.0F) sum += log_ratio(t, logp[t - r0]);
      }
      q_seq = clamp_log_ratio(sum * seq_norm(r), &seq_flows);
    }
    double seq_d_ratio = 0.0;  // sum_u w_u dl_u/dq_i
    for (std::int64_t t = r; t < end; ++t) {
      float& c = coef[t - r0];
      c = 0.0F;
      if (!kl.empty()) kl[t] = 0.0F;
      if (in_.mask[t] == 0.0F) continue;
      const double lp = logp[t - r0];
      bool flows = seq_flows;
      const double q = sequence ? q_seq : clamp_log_ratio(log_ratio(t, lp), &flows);
      const double adv = advantage(t);
      const double ref = in_.ref_logp.empty() ? 0.0 : in_.ref_logp[t];
      const kernels::TokenTerms terms = kernels::token_terms(config_, q, lp, ref, adv, is_weight(t));
      const double w = weight(t);
      loss_ += w * terms.loss;
      double g = w * terms.d_direct;
      if (sequence) {
        seq_d_ratio += w * terms.d_ratio;
      } else if (flows) {
        g += w * terms.d_ratio;
      }
      c = static_cast<float>(g);
      if (!kl.empty()) kl[t] = static_cast<float>(terms.kl);
      kl_sum_ += terms.kl;
      entropy_sum_ += entropy[t - r0];
      const double ratio = std::exp(q);
      const bool low = ratio < lo && adv < 0;
      const bool high = ratio > hi && adv > 0;
      clip_low_ += low;
      clip_high_ += high;
      clip_region_ += low || high;
    }
    if (sequence && seq_flows && seq_d_ratio != 0.0) {
      const double dq = seq_norm(r);  // dq_i/dlogp_u = m_u / max(|o_i|, 1)
      for (std::int64_t t = r; t < end; ++t) {
        if (in_.mask[t] == 0.0F) continue;
        // Recombine in double: c_u = w_u * direct_u + dq * sum_u w_u dl_u/dq.
        coef[t - r0] = static_cast<float>(static_cast<double>(coef[t - r0]) + dq * seq_d_ratio);
      }
    }
    r = end;
  }
}

Metrics LossAccumulator::metrics() const {
  const double denom = std::max(static_cast<double>(num_valid_), 1.0);
  Metrics m;
  m.loss = loss_;
  m.clip_ratio_low = clip_low_ / denom;
  m.clip_ratio_high = clip_high_ / denom;
  m.clip_ratio_region = clip_region_ / denom;
  m.kl_mean = kl_sum_ / denom;
  m.entropy_mean = entropy_sum_ / denom;
  m.num_valid = num_valid_;
  return m;
}

}  // namespace grpo::detail
