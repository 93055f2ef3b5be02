// The per-token part of the oracle: the loss l_t of one valid token and its two
// partial derivatives, given the (already clamped) log ratio q. Kept apart from
// oracle.cpp so the whole per-token semantics reads on one screen; only the
// oracle includes it. Everything is double; the config's floats are widened
// once (so 0.2F means 0.20000000298..., exactly what the fast paths see).
#pragma once

#include <algorithm>
#include <cmath>

#include "grpo/loss_config.hpp"

namespace grpo::oracle::detail {

// log r is clamped to [-kLogRatioClamp, kLogRatioClamp] before exp (SPEC.md),
// so r stays within [2.1e-9, 4.9e8] and never overflows.
inline constexpr double kLogRatioClamp = 20.0;

struct TokenTerms {
  double loss = 0.0;    // l_t = isw * P + beta * KL term
  double d_q = 0.0;     // dl_t / dq, q the clamped log ratio (r = exp(q))
  double d_logp = 0.0;  // dl_t / dlogp_t through the paths that bypass q
  double kl = 0.0;      // the KL term added (k3, times r under bias correction; 0 when beta == 0)
};

struct TokenInputs {
  double q = 0.0;     // clamped log ratio of this token (or of its sequence, GSPO)
  double logp = 0.0;  // log-prob of the chosen token
  double advantage = 0.0;
  double is_weight = 1.0;
  double ref_logp = 0.0;  // read only when beta != 0
};

// The policy term P and its partials, before is_weight.
inline TokenTerms policy_term(const LossConfig& config, const TokenInputs& in) {
  const double r = std::exp(in.q);
  const double a = in.advantage;
  const double eps_low = config.epsilon_low;
  const double eps_high = config.epsilon_high;
  TokenTerms out;
  switch (config.loss_type) {
    case LossType::grpo:
    case LossType::bnpo:
    case LossType::dr_grpo:
    case LossType::dapo: {
      // PPO clipping, with optional two-sided clipping r~ = min(r, delta).
      const bool has_delta = config.delta.has_value();
      const double delta = has_delta ? static_cast<double>(*config.delta) : 0.0;
      const double r_tilde = has_delta ? std::min(r, delta) : r;
      const double r_clip = std::clamp(r, 1.0 - eps_low, 1.0 + eps_high);
      out.loss = -std::min(r_tilde * a, r_clip * a);
      // The unclipped branch carries the gradient; ties count as unclipped
      // (SPEC.md). Above delta, r~ is the constant delta: no gradient.
      const bool unclipped = r_tilde * a <= r_clip * a && (!has_delta || r <= delta);
      out.d_q = unclipped ? -a * r : 0.0;
      break;
    }
    case LossType::cispo: {
      // The coefficient min(r, eps_high) is detached: the gradient reaches
      // logp only directly, never through r.
      const double coefficient = std::min(r, eps_high);
      out.loss = -coefficient * a * in.logp;
      out.d_logp = -coefficient * a;
      break;
    }
    case LossType::sapo: {
      const double k = a > 0.0 ? static_cast<double>(config.sapo_tau_pos) : static_cast<double>(config.sapo_tau_neg);
      const double sig = 1.0 / (1.0 + std::exp(-k * (r - 1.0)));
      out.loss = -a * (4.0 / k) * sig;
      // d sig / dq = sig (1 - sig) * k * r; the k cancels the 4/k.
      out.d_q = -a * 4.0 * sig * (1.0 - sig) * r;
      break;
    }
  }
  return out;
}

// l_t = is_weight * P + beta * KL term, with both partials.
inline TokenTerms token_terms(const LossConfig& config, const TokenInputs& in) {
  TokenTerms out = policy_term(config, in);
  out.loss *= in.is_weight;
  out.d_q *= in.is_weight;
  out.d_logp *= in.is_weight;
  const double beta = config.beta;
  if (beta == 0.0) return out;

  // k3 estimator with d = ref - logp: KL = e^d - d - 1. expm1 keeps the tiny
  // values near d = 0 exact instead of cancelling 1 - 1 (truth should not
  // carry the float path's rounding).
  // No clamp (TRL, Liger) unless config.kl_clamp asks for verl's: d is then
  // clamped to [-c, c] and constant beyond.
  const double d_raw = in.ref_logp - in.logp;
  double d = d_raw;
  bool inside = true;
  if (config.kl_clamp) {
    const double c = *config.kl_clamp;
    d = std::clamp(d_raw, -c, c);
    inside = d_raw > -c && d_raw < c;
  }
  out.kl = std::expm1(d) - d;
  const double d_kl = inside ? -std::expm1(d) : 0.0;  // dKL/dlogp = 1 - e^d
  if (config.kl_bias_correction) {
    // KL * r with r live: both the q path and the direct path see it; the
    // term added (and reported, as TRL's per_token_kl) is KL * r.
    const double r = std::exp(in.q);
    out.kl *= r;
    out.loss += beta * out.kl;
    out.d_q += beta * out.kl;
    out.d_logp += beta * d_kl * r;
  } else {
    out.loss += beta * out.kl;
    out.d_logp += beta * d_kl;
  }
  return out;
}

}  // namespace grpo::oracle::detail
