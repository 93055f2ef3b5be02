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
  const bool flows = unclipped <= clipped && (!c.delta || r <= *c.delta);
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

}  // namespace

TokenTerms token_terms(const LossConfig& config, double log_ratio, double logp, double ref_logp, double adv,
                       double is_weight) {
  const double r = std::exp(log_ratio);
  Policy p;
  switch (config.loss_type) {
    case LossType::cispo: p = cispo_policy(config, r, adv, logp); break;
    case LossType::sapo: p = sapo_policy(config, r, adv); break;
    default: p = clipped_policy(config, r, adv); break;
  }
  TokenTerms t;
  t.loss = is_weight * p.value;
  t.d_ratio = is_weight * p.d_ratio;
  t.d_direct = is_weight * p.d_direct;
  if (config.beta != 0.0F) {
    // k3 with d = ref - logp, as TRL and Liger compute it (no clamp), unless
    // the caller asked for verl's clamp; beyond a clamp the term is constant.
    const double raw = ref_logp - logp;
    double d = raw;
    bool flows = true;
    if (config.kl_clamp) {
      const double c = *config.kl_clamp;
      d = std::clamp(raw, -c, c);
      flows = raw > -c && raw < c;
    }
    t.kl_overflow = d > kMaxF32ExpArg;
    const double e = std::exp(d);
    const double kl = std::expm1(d) - d;  // e^d - d - 1 without cancelling near d = 0
    const double dkl = flows ? 1.0 - e : 0.0;
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
