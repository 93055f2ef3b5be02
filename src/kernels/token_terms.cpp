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
    // k3 with d = ref - logp clamped above at kLogRatioClamp: e^d stays finite in
    // f32 (a very unlikely token under the policy, e.g. logp = -300 at a low
    // temperature, would otherwise make the KL and every gradient inf). Beyond
    // the clamp the term is constant, so its derivative is 0.
    const double raw = ref_logp - logp;
    const double diff = std::min(raw, kLogRatioClamp);
    const double e = std::exp(diff);
    t.kl = e - diff - 1.0;
    const double dkl = raw < kLogRatioClamp ? 1.0 - e : 0.0;
    const double beta = config.beta;
    if (config.kl_bias_correction) {
      t.loss += beta * t.kl * r;
      t.d_ratio += beta * t.kl * r;
      t.d_direct += beta * dkl * r;
    } else {
      t.loss += beta * t.kl;
      t.d_direct += beta * dkl;
    }
  }
  return t;
}

}  // namespace grpo::kernels
