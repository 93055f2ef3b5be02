#include "driver/loss_accumulator.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "grpo/types.hpp"
#include "kernels/token_terms.hpp"

namespace grpo::detail {
namespace {

double clamp_log_ratio(double q, bool* flows) {
  *flows = q > -kernels::kLogRatioClamp && q < kernels::kLogRatioClamp;
  return std::clamp(q, -kernels::kLogRatioClamp, kernels::kLogRatioClamp);
}

}  // namespace

bool needs_whole_sequences(const LossConfig& config) {
  return config.importance_sampling_level == IsLevel::sequence || config.loss_type == LossType::vespo ||
         config.off_policy_mask_threshold.has_value();
}

bool needs_all_rows(const LossConfig& config) { return config.top_entropy_quantile < 1.0F; }

namespace {

// torch.quantile(x, q, interpolation="linear") of the n values in v (n >= 1),
// as torch computes it for an f32 tensor: q and the rank in f32, then
// lerp(below, above, weight) by ATen's formula. Reorders v.
float torch_quantile_f32(float* v, std::int64_t n, float q) {
  const float rank = q * static_cast<float>(n - 1);
  const auto below = static_cast<std::int64_t>(rank);
  const auto above = static_cast<std::int64_t>(std::ceil(rank));
  std::nth_element(v, v + below, v + n);
  const float lo = v[below];
  const float hi = above == below ? lo : *std::min_element(v + below + 1, v + n);
  const float w = rank - static_cast<float>(below);
  const float diff = hi - lo;
  if (std::fabs(w) < 0.5F) {
    const float step = w * diff;
    return lo + step;
  }
  const float step = diff * (1.0F - w);
  return hi - step;
}

}  // namespace

void LossAccumulator::set_entropy_threshold(const float* entropy, float* scratch) {
  const auto rows = static_cast<std::int64_t>(in_.mask.size());
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (in_.mask[r] != 0.0F) scratch[n++] = entropy[r];
  }
  if (n == 0) return;  // no valid token: nothing to mask
  // TRL: threshold = 1 - top_entropy_quantile (a Python float), made an f32 tensor by torch.quantile.
  const auto q = static_cast<float>(1.0 - static_cast<double>(config_.top_entropy_quantile));
  entropy_threshold_ = torch_quantile_f32(scratch, n, q);
  std::int64_t kept = 0;
  for (std::int64_t r = 0; r < rows; ++r) kept += in_.mask[r] != 0.0F && entropy[r] >= entropy_threshold_ ? 1 : 0;
  entropy_norm_ = 1.0 / std::max(static_cast<double>(kept), 1.0);
}

LossAccumulator::LossAccumulator(const LossConfig& config, std::int64_t batch, std::int64_t seq_len,
                                 const BatchInputs& inputs, double max_abs_coef)
    : LossAccumulator(config, Sequences(batch, seq_len, inputs.sequence_offsets), inputs, max_abs_coef) {}

LossAccumulator::LossAccumulator(const LossConfig& config, const Sequences& seqs, const BatchInputs& inputs,
                                 double max_abs_coef)
    : config_(config), seqs_(seqs), batch_(seqs.count()), in_(inputs), max_abs_coef_(max_abs_coef) {
  per_sequence_clip_ = config.importance_sampling_level == IsLevel::sequence &&
                       inputs.advantages.size() == static_cast<std::size_t>(batch_);
  for (const float m : inputs.mask) num_valid_ += m != 0.0F ? 1 : 0;
  entropy_mask_ = needs_all_rows(config);
  set_norm(batch_, num_valid_);
}

void LossAccumulator::set_norm(std::int64_t batch, std::int64_t num_valid) {
  metric_batch_ = batch;
  metric_valid_ = num_valid;
  entropy_norm_ = 1.0 / std::max(static_cast<double>(num_valid), 1.0);  // e_t = 1 until a threshold is set
  switch (config_.loss_type) {
    case LossType::grpo:
    case LossType::sapo:
    case LossType::luspo: norm_ = 1.0 / static_cast<double>(batch); break;
    case LossType::bnpo: norm_ = 1.0 / std::max(static_cast<double>(num_valid), 1.0); break;
    case LossType::dr_grpo:
      norm_ = 1.0 / (static_cast<double>(batch) * static_cast<double>(config_.max_completion_length));
      break;
    case LossType::dapo:
    case LossType::cispo:
    case LossType::vespo: norm_ = 1.0 / config_.num_items_in_batch; break;
  }
}

void LossAccumulator::use_global_counts(std::int64_t global_batch, std::int64_t global_valid, bool num_items) {
  // The same expression of the same integer as a single process over the
  // whole batch computes: w_t, and so c_t, are the same bits.
  if (num_items) config_.num_items_in_batch = static_cast<double>(std::max<std::int64_t>(global_valid, 1));
  set_norm(global_batch, global_valid);
}

double LossAccumulator::per_row(std::span<const float> v, std::int64_t row) const {
  return v.size() == static_cast<std::size_t>(batch_) ? v[static_cast<std::size_t>(seqs_.of_row(row))]
                                                      : v[static_cast<std::size_t>(row)];
}

double LossAccumulator::advantage(std::int64_t row) const { return per_row(in_.advantages, row); }

double LossAccumulator::is_weight(std::int64_t row) const {
  return in_.is_weight.empty() ? 1.0 : per_row(in_.is_weight, row);
}

double LossAccumulator::seq_norm(std::int64_t row) {
  const std::int64_t seq = seqs_.of_row(row);
  if (seq != norm_seq_) {
    double valid = 0.0;
    for (std::int64_t t = seqs_.begin(seq); t < seqs_.end(seq); ++t) valid += in_.mask[t];
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

void LossAccumulator::count_clip(double ratio, double adv, double weight) {
  if (config_.loss_type == LossType::vespo) return;  // no clipping; TRL logs no clip ratio
  const bool cispo = config_.loss_type == LossType::cispo;
  const bool low = !cispo && ratio < 1.0 - config_.epsilon_low && adv < 0;
  const bool high = adv > 0 && (cispo ? ratio > config_.epsilon_high : ratio > 1.0 + config_.epsilon_high);
  clip_low_ += low ? weight : 0.0;
  clip_high_ += high ? weight : 0.0;
  clip_region_ += low || high ? weight : 0.0;
}

void LossAccumulator::add_rows(std::int64_t r0, std::int64_t r1, const float* logp, const float* entropy, float* coef,
                               float* kl, float* ent_coef) {
  const bool sequence = config_.importance_sampling_level == IsLevel::sequence;
  const bool whole = needs_whole_sequences(config_);
  const bool vespo = config_.loss_type == LossType::vespo;
  std::int64_t r = r0;
  while (r < r1) {
    // One sequence when a token needs its sequence, else one token.
    const std::int64_t end = whole ? seqs_.end(seqs_.of_row(r)) : r + 1;
    double q_seq = 0.0;
    bool seq_flows = true;
    double log_w_sum = 0.0;   // vespo: sum_t m_t (clamp(log r_t) + clamp(log is_weight_t))
    double mean_shift = 0.0;  // off-policy mask: sum_t m_t (old_t - logp_t) / max(|o_i|, 1)
    if (whole) {
      double sum = 0.0;
      for (std::int64_t t = r; t < end; ++t) {
        if (in_.mask[t] == 0.0F) continue;
        const double lr = log_ratio(t, logp[t - r0]);
        sum += lr;
        if (vespo) {
          log_w_sum += std::clamp(lr, -kernels::kLogRatioClamp, kernels::kLogRatioClamp);
          if (!in_.is_weight.empty()) {
            log_w_sum += std::clamp(std::log(is_weight(t)), kernels::kVespoLogWeightMin, kernels::kLogRatioClamp);
          }
        }
      }
      mean_shift = -sum * seq_norm(r);
      if (sequence) {
        q_seq = clamp_log_ratio(sum * seq_norm(r), &seq_flows);
        if (per_sequence_clip_) count_clip(std::exp(q_seq), advantage(r), 1.0);
      }
    }
    double seq_d_ratio = 0.0;  // sum_u w_u dl_u/dq_i
    for (std::int64_t t = r; t < end; ++t) {
      float& c = coef[t - r0];
      c = 0.0F;
      if (kl != nullptr) kl[t - r0] = 0.0F;
      if (ent_coef != nullptr) ent_coef[t - r0] = 0.0F;
      if (in_.mask[t] == 0.0F) continue;
      const double lp = logp[t - r0];
      bool flows = seq_flows;
      const double q = sequence ? q_seq : clamp_log_ratio(log_ratio(t, lp), &flows);
      const double adv = advantage(t);
      const double ref = in_.ref_logp.empty() ? 0.0 : in_.ref_logp[t];
      kernels::SequenceFactors factors;
      if (vespo) factors.vespo_phi = kernels::vespo_phi(config_, log_w_sum, adv);
      if (config_.off_policy_mask_threshold && adv < 0.0 && !(mean_shift <= *config_.off_policy_mask_threshold)) {
        factors.keep = 0.0;
      }
      // The entropy mask e_t (TRL: after the off-policy mask, before is_weight; all factors).
      const double e = entropy_mask_ && !(entropy[t - r0] >= entropy_threshold_) ? 0.0 : 1.0;
      factors.keep *= e;
      if (config_.entropy_coef != 0.0F) {
        // Loss -= entropy_coef * sum m e Ent / max(sum m e, 1): a plain mean over the tokens it acts on.
        const double b = -static_cast<double>(config_.entropy_coef) * e * entropy_norm_;
        loss_ += b * entropy[t - r0];
        if (ent_coef != nullptr) ent_coef[t - r0] = static_cast<float>(b);
      }
      const kernels::TokenTerms terms = kernels::token_terms(config_, q, lp, ref, adv, is_weight(t), factors);
      if (terms.kl_overflow || !(std::fabs(terms.kl) <= std::numeric_limits<float>::max())) {
        throw Error("ref_logp", "row " + std::to_string(t) + ": ref_logp - logp = " + std::to_string(ref - lp) +
                                    " makes the " + to_string(config_.kl_estimator) +
                                    " KL term overflow f32 (TRL's k3 would be inf); set config.kl_clamp to bound d");
      }
      const double w = weight(t);
      loss_ += w * terms.loss;
      double g = w * terms.d_direct;
      if (sequence) {
        seq_d_ratio += w * terms.d_ratio;
      } else if (flows) {
        g += w * terms.d_ratio;
      }
      c = static_cast<float>(g);
      if (kl != nullptr) kl[t - r0] = static_cast<float>(terms.kl);
      kl_sum_ += terms.kl;
      entropy_sum_ += entropy[t - r0];
      if (!per_sequence_clip_) count_clip(std::exp(q), adv, 1.0);
    }
    if (sequence && seq_flows && seq_d_ratio != 0.0) {
      const double dq = seq_norm(r);  // dq_i/dlogp_u = m_u / max(|o_i|, 1)
      for (std::int64_t t = r; t < end; ++t) {
        if (in_.mask[t] == 0.0F) continue;
        // Recombine in double: c_u = w_u * direct_u + dq * sum_u w_u dl_u/dq.
        coef[t - r0] = static_cast<float>(static_cast<double>(coef[t - r0]) + dq * seq_d_ratio);
      }
    }
    if (config_.beta != 0.0F) {
      // The policy part of |c| was bounded before the call; a KL term beyond
      // the bound would make dlogits or a gradient sum overflow f32.
      for (std::int64_t t = r; t < end; ++t) {
        if (!(std::fabs(static_cast<double>(coef[t - r0])) <= max_abs_coef_)) {
          throw Error("ref_logp", "row " + std::to_string(t) + ": the KL gradient " + std::to_string(coef[t - r0]) +
                                      " of ref_logp - logp = " + std::to_string(in_.ref_logp[t] - logp[t - r0]) +
                                      " would overflow f32 in the gradients; set config.kl_clamp to bound it");
        }
      }
    }
    r = end;
  }
}

Metrics LossAccumulator::metrics(const Sums& s) const {
  const double denom = std::max(static_cast<double>(metric_valid_), 1.0);
  const double clip_denom = per_sequence_clip_ ? static_cast<double>(metric_batch_) : denom;
  Metrics m;
  m.loss = s.loss;
  m.clip_ratio_low = s.clip_low / clip_denom;
  m.clip_ratio_high = s.clip_high / clip_denom;
  m.clip_ratio_region = s.clip_region / clip_denom;
  m.kl_mean = s.kl / denom;
  m.entropy_mean = s.entropy / denom;
  m.num_valid = metric_valid_;
  return m;
}

}  // namespace grpo::detail
