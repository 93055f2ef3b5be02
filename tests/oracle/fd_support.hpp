// Test support for checking the oracle by central finite differences: random
// tiny problems kept away from the loss's kinks, and the "surrogate" loss whose
// plain derivative is the gradient the semantics define (stop-gradients made
// explicit). Used by tests/test_oracle_fd.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "oracle/oracle.hpp"

namespace grpo::oracle::fd {

enum class IsWeightKind : std::uint8_t { none, per_token, per_sequence };

// One point of the configuration sweep.
struct CaseOptions {
  LossType loss_type = LossType::grpo;
  IsLevel level = IsLevel::token;
  bool temperature_on_logp = false;
  double tau = 1.0;
  double beta = 0.0;
  bool kl_bias_correction = false;
  bool per_token_advantages = false;
  bool with_old = true;
  bool with_delta = false;
  IsWeightKind is_weight = IsWeightKind::none;
  bool with_mask = false;
  // Options of the current trainers (issue 8); off by default.
  KlEstimator kl_estimator = KlEstimator::k3;
  bool off_policy_mask = false;  // threshold kOffPolicyThreshold
  bool dual_clip = false;        // clip_ratio_c = kDualClip
  double entropy_coef = 0.0;
  double top_entropy_quantile = 1.0;
  double logit_softcap = 0.0;  // 0 = absent
  double logit_scale = 1.0;

  std::string describe() const {
    return std::string(to_string(loss_type)) + " level=" + to_string(level) +
           " on_logp=" + std::to_string(temperature_on_logp) + " tau=" + std::to_string(tau) +
           " beta=" + std::to_string(beta) + " kl_bias=" + std::to_string(kl_bias_correction) +
           " adv_per_token=" + std::to_string(per_token_advantages) + " old=" + std::to_string(with_old) +
           " delta=" + std::to_string(with_delta) + " is_weight=" + std::to_string(static_cast<int>(is_weight)) +
           " mask=" + std::to_string(with_mask) + " kl=" + to_string(kl_estimator) +
           " opsm=" + std::to_string(off_policy_mask) + " dual_clip=" + std::to_string(dual_clip) +
           " entropy_coef=" + std::to_string(entropy_coef) + " rho=" + std::to_string(top_entropy_quantile) +
           " softcap=" + std::to_string(logit_softcap) + " logit_scale=" + std::to_string(logit_scale);
  }
};

// The configuration sweep for one loss type and IS level: 768 cases, the plain
// product. It keeps combinations where a flag should be inert (kl_bias with
// beta = 0, delta for cispo/sapo, both conventions at tau = 1); at ~0.1 ms a
// case they cost nothing and a flag leaking into the wrong branch would show.
inline std::vector<CaseOptions> sweep(LossType type, IsLevel level) {
  std::vector<CaseOptions> cases;
  for (int conv = 0; conv < 2; ++conv)
    for (const double tau : {0.7, 1.0})
      for (const double beta : {0.0, 0.04})
        for (int kl_bias = 0; kl_bias < 2; ++kl_bias)
          for (int adv = 0; adv < 2; ++adv)
            for (int old = 0; old < 2; ++old)
              for (int delta = 0; delta < 2; ++delta)
                for (const IsWeightKind isw : {IsWeightKind::none, IsWeightKind::per_token, IsWeightKind::per_sequence})
                  for (int mask = 0; mask < 2; ++mask) {
                    CaseOptions o;
                    o.loss_type = type;
                    o.level = level;
                    o.temperature_on_logp = conv == 1;
                    o.tau = tau;
                    o.beta = beta;
                    o.kl_bias_correction = kl_bias == 1;
                    o.per_token_advantages = adv == 1;
                    o.with_old = old == 1;
                    o.with_delta = delta == 1;
                    o.is_weight = isw;
                    o.with_mask = mask == 1;
                    cases.push_back(o);
                  }
  return cases;
}

// The off-policy mask threshold: old - logp is drawn within +-1.2 per token,
// so sequence means fall on both sides of 0.1. The dual-clip c = 1.5 lies
// inside the drawn ratio range (r <= 3.4).
inline constexpr double kOffPolicyThreshold = 0.1;
inline constexpr double kDualClip = 1.5;

// eps_low != eps_high (DAPO's clip-higher values) so a swapped pair shows. For
// cispo eps_high is the cap of min(r, eps_high): 1.3 lies inside the drawn
// ratio range, so both the capped and the uncapped side are exercised.
// delta = 1.6 exceeds 1 + eps_high as the semantics require.
inline LossConfig make_config(const CaseOptions& o) {
  LossConfig c;
  c.loss_type = o.loss_type;
  c.importance_sampling_level = o.level;
  c.epsilon_low = 0.2F;
  c.epsilon_high = o.loss_type == LossType::cispo ? 1.3F : 0.28F;
  if (o.with_delta) c.delta = 1.6F;
  c.beta = static_cast<float>(o.beta);
  c.kl_bias_correction = o.kl_bias_correction;
  c.temperature = static_cast<float>(o.tau);
  c.temperature_on_logp = o.temperature_on_logp;
  c.kl_estimator = o.kl_estimator;
  if (o.off_policy_mask) c.off_policy_mask_threshold = static_cast<float>(kOffPolicyThreshold);
  if (o.dual_clip) c.clip_ratio_c = static_cast<float>(kDualClip);
  c.entropy_coef = static_cast<float>(o.entropy_coef);
  c.top_entropy_quantile = static_cast<float>(o.top_entropy_quantile);
  if (o.logit_softcap > 0.0) c.logit_softcap = static_cast<float>(o.logit_softcap);
  c.logit_scale = static_cast<float>(o.logit_scale);
  return c;
}

// Input ranges are bounded (uniform draws) so that the third derivative in
// the FD error bound is bounded too: |z| <= 3, |log r| <= 1.2 (r <= 3.4),
// |A| <= 2, is_weight in [0.5, 1.5], |ref - logp| <= 1.
inline constexpr double kLogitRange = 3.0;
inline constexpr double kLogRatioRange = 1.2;

// Draws everything but the shape and the logits (already in p): mask, ids,
// advantages, is_weight, old/ref around the current logp, and the config.
// Masked rows get an id outside [0, V) and NaN in every per-token input: the
// semantics say they contribute nothing, so none of it may be read.
inline void fill_inputs(Problem& p, const CaseOptions& o, std::mt19937& rng) {
  std::uniform_real_distribution<double> unit(-1.0, 1.0), half(0.5, 1.5), coin(0.0, 1.0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::int64_t n = p.batch * p.seq_len;
  std::uniform_int_distribution<std::int32_t> pick_id(0, static_cast<std::int32_t>(p.vocab) - 1);
  p.config = make_config(o);
  std::int64_t num_valid = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    // 40% masked: enough that most multi-row draws mix valid and masked rows.
    const bool valid = !o.with_mask || coin(rng) >= 0.4;
    p.mask.push_back(valid ? 1.0 : 0.0);
    p.ids.push_back(valid ? pick_id(rng) : static_cast<std::int32_t>(p.vocab) + 3);
    num_valid += valid ? 1 : 0;
  }
  const std::int64_t adv_size = o.per_token_advantages ? n : p.batch;
  for (std::int64_t k = 0; k < adv_size; ++k) p.advantages.push_back(2.0 * unit(rng));
  if (o.is_weight != IsWeightKind::none) {
    const std::int64_t size = o.is_weight == IsWeightKind::per_token ? n : p.batch;
    for (std::int64_t k = 0; k < size; ++k) p.is_weight.push_back(half(rng));
  }
  // old and ref are drawn around the current logp so the ratios are O(1). The
  // probe has no KL and no normalizer yet, hence the plain grpo config.
  Problem probe = p;
  probe.config = LossConfig{};
  probe.config.temperature = p.config.temperature;
  probe.config.temperature_on_logp = p.config.temperature_on_logp;
  const std::vector<double> logp = evaluate(probe).logp;
  for (std::int64_t t = 0; t < n; ++t) {
    const bool valid = p.mask[t] != 0.0;
    if (o.with_old) p.old_logp.push_back(valid ? logp[t] + kLogRatioRange * unit(rng) : nan);
    if (o.beta != 0.0) p.ref_logp.push_back(valid ? logp[t] + unit(rng) : nan);
    if (!valid && o.per_token_advantages) p.advantages[t] = nan;
    if (!valid && o.is_weight == IsWeightKind::per_token) p.is_weight[t] = nan;
  }
  p.config.max_completion_length = p.seq_len + 1;  // != T, so using T instead would show
  p.config.num_items_in_batch = static_cast<double>(num_valid) + 3.0;
}

// A random tiny problem: B in {1,2}, T in {1..4}, V in {1..7}.
inline Problem random_problem(const CaseOptions& o, std::mt19937& rng) {
  std::uniform_int_distribution<int> pick_b(1, 2), pick_t(1, 4), pick_v(1, 7);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  Problem p;
  p.batch = pick_b(rng);
  p.seq_len = pick_t(rng);
  p.vocab = pick_v(rng);
  for (std::int64_t k = 0; k < p.batch * p.seq_len * p.vocab; ++k) {
    p.logits.push_back(kLogitRange * unit(rng));
  }
  fill_inputs(p, o, rng);
  return p;
}

// The unclamped log ratio each valid row sees (its own, or its sequence's mean).
inline std::vector<double> raw_log_ratios(const Problem& p, const std::vector<double>& logp) {
  const std::int64_t n = p.batch * p.seq_len;
  std::vector<double> lr(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (p.mask[t] != 0.0 && !p.old_logp.empty()) lr[t] = logp[t] - p.old_logp[t];
  }
  if (p.config.importance_sampling_level == IsLevel::token) return lr;
  for (std::int64_t i = 0; i < p.batch; ++i) {
    double sum = 0.0, count = 0.0;
    for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
      sum += p.mask[t] != 0.0 ? lr[t] : 0.0;
      count += p.mask[t];
    }
    for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
      lr[t] = sum / std::max(count, 1.0);
    }
  }
  return lr;
}

// True when some valid row's log ratio lies within `margin` of a point where the
// loss is not differentiable: the +-20 clamp, the clip edges 1 - eps_low and
// 1 + eps_high, delta, and (cispo) eps_high. A central difference straddling
// such a kink measures neither one-sided slope, so such draws are redrawn.
inline bool near_kink(const Problem& p, double margin) {
  const LossConfig& c = p.config;
  std::vector<double> kinks = {-20.0, 20.0, std::log(1.0 + static_cast<double>(c.epsilon_high))};
  if (c.epsilon_low < 1.0F) kinks.push_back(std::log(1.0 - static_cast<double>(c.epsilon_low)));
  if (c.delta) kinks.push_back(std::log(static_cast<double>(*c.delta)));
  if (c.loss_type == LossType::cispo) {
    kinks.push_back(std::log(static_cast<double>(c.epsilon_high)));
  }
  if (c.clip_ratio_c) kinks.push_back(std::log(static_cast<double>(*c.clip_ratio_c)));
  const std::vector<double> logp = evaluate(p).logp;
  const std::vector<double> lr = raw_log_ratios(p, logp);
  for (std::size_t t = 0; t < lr.size(); ++t) {
    if (p.mask[t] == 0.0) continue;
    for (const double k : kinks) {
      if (std::abs(lr[t] - k) < margin) return true;
    }
    // |d| has a kink at d = 0.
    const bool abs_kl = c.kl_estimator == KlEstimator::abs || c.kl_estimator == KlEstimator::abs_plus;
    if (c.beta != 0.0F && abs_kl && std::abs(logp[t] - p.ref_logp[t]) < margin) return true;
  }
  // The top-entropy mask's step: a valid row's entropy at the quantile threshold
  // (the threshold moves with the entropies; the mask flips only when a row
  // crosses it, or two rows' entropies swap order).
  if (c.top_entropy_quantile < 1.0F) {
    const std::vector<double> entropy = evaluate(p).entropy;
    std::vector<long double> valid;
    for (std::size_t t = 0; t < entropy.size(); ++t) {
      if (p.mask[t] != 0.0) valid.push_back(entropy[t]);
    }
    if (!valid.empty()) {
      const long double q = linear_quantile(valid, 1.0L - static_cast<long double>(c.top_entropy_quantile));
      for (const long double e : valid) {
        if (e != q && std::abs(static_cast<double>(e - q)) < margin) return true;
      }
      std::sort(valid.begin(), valid.end());
      for (std::size_t i = 1; i < valid.size(); ++i) {
        if (static_cast<double>(valid[i] - valid[i - 1]) < margin) return true;
      }
    }
  }
  // The off-policy mask's step: mean(old - logp) of a sequence at the threshold.
  if (c.off_policy_mask_threshold && !p.old_logp.empty()) {
    for (std::int64_t i = 0; i < p.batch; ++i) {
      double sum = 0.0, count = 0.0;
      for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
        if (p.mask[t] == 0.0) continue;
        sum += p.old_logp[t] - logp[t];
        count += 1.0;
      }
      if (std::abs(sum / std::max(count, 1.0) - static_cast<double>(*c.off_policy_mask_threshold)) < margin) {
        return true;
      }
    }
  }
  return false;
}

// Central difference of f along one coordinate of x. The step actually taken,
// (x + h) - x, is not exactly h; dividing by it removes the representation error.
template <class F>
double central_difference(F&& f, std::vector<double>& x, std::size_t k, double h) {
  const double x0 = x[k];
  x[k] = x0 + h;
  const double up_step = x[k] - x0;
  const double up = f();
  x[k] = x0 - h;
  const double down_step = x0 - x[k];
  const double down = f();
  x[k] = x0;
  return (up - down) / (up_step + down_step);
}

// dLoss/dlogits[k] as the semantics define it, by finite differences. Two
// stop-gradients are not visible to loss_only and are made explicit here:
// - on-policy (old absent): old = stop_gradient(logp) is the constant logp of
//   the base point, so the FD runs with old_logp frozen at that value;
// - cispo: min(r, eps_high) is detached, so for the policy part (beta = 0) old
//   moves with logp, old' = old + logp' - logp, which pins r. The KL part
//   (advantages = 0 zeroes P for every loss type) keeps r live, since the
//   bias-corrected KL * r is not detached. l_t is linear in (P, KL), so the
//   two derivatives add up to the full one.
// - vespo: phi_i is detached; pinning r pins phi_i, exactly as for cispo.
// The entropy bonus does not depend on r: it is in the policy part only.
// The off-policy mask is piecewise constant in logp: away from its threshold
// (near_kink) a central difference does not see it.
inline double surrogate_derivative(const Problem& base, std::size_t k, double h) {
  Problem p = base;
  const std::vector<double> logp0 = evaluate(base).logp;
  if (p.old_logp.empty()) p.old_logp = logp0;
  if (p.config.loss_type != LossType::cispo && p.config.loss_type != LossType::vespo) {
    return central_difference([&] { return loss_only(p); }, p.logits, k, h);
  }
  Problem policy = p;
  policy.config.beta = 0.0F;
  const std::vector<double> old0 = policy.old_logp;
  const double d_policy = central_difference(
      [&] {
        const std::vector<double> logp = evaluate(policy).logp;
        Problem pinned = policy;
        for (std::size_t t = 0; t < logp.size(); ++t) {
          if (pinned.mask[t] != 0.0) pinned.old_logp[t] = old0[t] + (logp[t] - logp0[t]);
        }
        return loss_only(pinned);
      },
      policy.logits, k, h);
  if (p.config.beta == 0.0F) return d_policy;
  Problem kl = p;
  for (double& a : kl.advantages) a = 0.0;
  kl.config.entropy_coef = 0.0F;  // the entropy bonus is in d_policy already
  return d_policy + central_difference([&] { return loss_only(kl); }, kl.logits, k, h);
}

}  // namespace grpo::oracle::fd
