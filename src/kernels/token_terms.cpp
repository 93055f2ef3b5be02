#include "kernels/token_terms.hpp"

#include <algorithm>
#include <cmath>

namespace grpo::kernels {
namespace {

struct Policy {
  double value = 0.0;
  double d_ratio = 0.0;
  double d_direct = 0.0;
};

Policy clipped_policy(const LossConfig& c, double r, double adv) {
  const double rt = c.delta ? std::min(r, static_cast<double>(*c.delta)) : r;
  const double cr = std::clamp(r, 1.0 - c.epsilon_low, 1.0 + c.epsilon_high);
  const double unclipped = rt * adv;
  const double clipped = cr * adv;
  Policy p;
  p.value = -std::min(unclipped, clipped);
  // Ties count as unclipped; beyond delta the ratio is a constant.
  bool flows = unclipped <= clipped && (!c.delta || r <= *c.delta);
  if (c.clip_ratio_c && adv < 0) {
    // Dual-clip: the loss of a negative-advantage token is capped at -A c.
    const double cap = -adv * static_cast<double>(*c.clip_ratio_c);
    if (cap < p.value) {
      p.value = cap;
      flows = false;
    }
  }
  p.d_ratio = flows ? -adv * r : 0.0;
  return p;
}

Policy cispo_policy(const LossConfig& c, double r, double adv, double logp) {
  const double w = std::min(r, static_cast<double>(c.epsilon_high));  // detached
  return {-w * adv * logp, 0.0, -w * adv};
}

Policy sapo_policy(const LossConfig& c, double r, double adv) {
  const double k = adv > 0 ? c.sapo_tau_pos : c.sapo_tau_neg;
  const double sig = 1.0 / (1.0 + std::exp(-k * (r - 1.0)));
  return {-adv * (4.0 / k) * sig, -adv * 4.0 * sig * (1.0 - sig) * r, 0.0};
}

struct Kl {
  double value = 0.0;
  double grad = 0.0;  // d value / d logp (the k2 gradient for the _plus variants)
  bool overflow = false;
};

Kl kl_term(const LossConfig& config, double logp, double ref_logp) {
  // u = ref - logp = -d, as TRL and Liger write k3 (no clamp), unless the
  // caller asked for verl's clamp; beyond a clamp the term is constant.
  const double raw = ref_logp - logp;
  double u = raw;
  bool flows = true;
  if (config.kl_clamp) {
    const double c = *config.kl_clamp;
    u = std::clamp(raw, -c, c);
    flows = raw > -c && raw < c;
  }
  const double d = -u;  // logp - ref
  Kl k;
  switch (config.kl_estimator) {
    case KlEstimator::k3:
    case KlEstimator::k3_plus:
      k.overflow = u > kMaxF32ExpArg;
      k.value = std::expm1(u) - u;  // e^u - u - 1 without cancelling near u = 0
      k.grad = 1.0 - std::exp(u);
      break;
    case KlEstimator::k1:
    case KlEstimator::k1_plus:
      k.value = d;
      k.grad = 1.0;
      break;
    case KlEstimator::abs:
    case KlEstimator::abs_plus:
      k.value = std::fabs(d);
      k.grad = d > 0.0 ? 1.0 : (d < 0.0 ? -1.0 : 0.0);  // torch's sign: 0 at d = 0
      break;
    case KlEstimator::k2:
      k.value = 0.5 * d * d;
      k.grad = d;
      break;
  }
  const KlEstimator e = config.kl_estimator;
  if (e == KlEstimator::k1_plus || e == KlEstimator::abs_plus || e == KlEstimator::k3_plus) k.grad = d;
  if (!flows) k.grad = 0.0;
  return k;
}

}  // namespace

double vespo_phi(const LossConfig& config, double log_weight_sum, double adv) {
  const double log_w = std::clamp(log_weight_sum, kVespoLogWeightMin, kLogRatioClamp);
  const bool non_negative = adv >= 0.0;
  const double k = non_negative ? config.vespo_k_pos : config.vespo_k_neg;
  const double lam =
      std::max(static_cast<double>(non_negative ? config.vespo_lambda_pos : config.vespo_lambda_neg), kVespoMinLambda);
  const double log_phi = lam + k * log_w - lam * std::exp(log_w);
  // TRL's f32 exp turns log phi > 88.7 into inf, then nan_to_num into 0.
  return log_phi > kMaxF32ExpArg ? 0.0 : std::exp(log_phi);
}

TokenTerms token_terms(const LossConfig& config, double log_ratio, double logp, double ref_logp, double adv,
                       double is_weight, const SequenceFactors& sequence) {
  const double r = std::exp(log_ratio);
  Policy p;
  switch (config.loss_type) {
    case LossType::cispo: p = cispo_policy(config, r, adv, logp); break;
    case LossType::sapo: p = sapo_policy(config, r, adv); break;
    case LossType::vespo: {
      const double phi = sequence.vespo_phi;  // detached
      p = {-phi * adv * logp, 0.0, -phi * adv};
      break;
    }
    default: p = clipped_policy(config, r, adv); break;
  }
  // TRL's order: policy term, off-policy mask, is_weight (folded into phi for vespo).
  const double factor = sequence.keep * (config.loss_type == LossType::vespo ? 1.0 : is_weight);
  TokenTerms t;
  t.loss = factor * p.value;
  t.d_ratio = factor * p.d_ratio;
  t.d_direct = factor * p.d_direct;
  if (config.beta != 0.0F) {
    const Kl k = kl_term(config, logp, ref_logp);
    t.kl_overflow = k.overflow;
    const double kl = k.value;
    const double dkl = k.grad;
    const double beta = config.beta;
    if (config.kl_bias_correction) {
      t.kl = kl * r;
      t.loss += beta * t.kl;
      t.d_ratio += beta * t.kl;
      t.d_direct += beta * dkl * r;
    } else {
      t.kl = kl;
      t.loss += beta * kl;
      t.d_direct += beta * dkl;
    }
  }
  return t;
}

}  // namespace grpo::kernels
