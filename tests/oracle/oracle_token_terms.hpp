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
  // |d_q| and |d_logp| with their parts (policy, KL) summed without
  // cancellation, and the KL part's own slope in logp added: what a float
  // path's error in the coefficient scales with (error bounds in tests).
  double d_q_abs = 0.0;
  double d_logp_abs = 0.0;
};

struct TokenInputs {
  double q = 0.0;     // clamped log ratio of this token (or of its sequence, GSPO)
  double logp = 0.0;  // log-prob of the chosen token
  double advantage = 0.0;
  double is_weight = 1.0;
  double ref_logp = 0.0;   // read only when beta != 0
  double vespo_phi = 1.0;  // vespo's detached sequence weight (see vespo_phi)
  double keep = 1.0;       // the off-policy sequence mask, 0 or 1
};

// log(1e-8): vespo's floor for log w and for each log is_weight (TRL).
inline constexpr double kVespoLogFloor = -18.420680743952367;
// log(FLT_MAX): TRL's f32 exp of a larger log phi is inf, mapped to 0.
inline constexpr double kLogFloatMax = 88.72283905206835;

// vespo's gamma weight phi = e^lam w^k e^(-lam w) for one token, from the
// unclamped sum S_i = sum over the sequence's valid tokens of clamp(log r_t,
// -20, 20) + clamp(log is_weight_t, log 1e-8, 20); log w = clamp(S_i, log
// 1e-8, 20). (k, lam) follow the sign of the token's advantage (A >= 0: pos).
inline double vespo_phi(const LossConfig& config, double log_w_sum, double advantage) {
  const double log_w = std::clamp(log_w_sum, kVespoLogFloor, kLogRatioClamp);
  const double k = advantage >= 0.0 ? config.vespo_k_pos : config.vespo_k_neg;
  double lam = advantage >= 0.0 ? config.vespo_lambda_pos : config.vespo_lambda_neg;
  lam = std::max(lam, 1e-4);  // TRL's lambda_seq.clamp(min=1e-4)
  const double log_phi = lam + k * log_w - lam * std::exp(log_w);
  return log_phi > kLogFloatMax ? 0.0 : std::exp(log_phi);
}

// A KL estimator's value and derivative in logp, d = logp - ref (after
// config.kl_clamp, which makes the derivative 0 outside). The _plus variants
// keep the value and take k2's derivative d (verl's straight-through trick).
struct KlValue {
  double value = 0.0;
  double d_logp = 0.0;
  double d2_logp = 0.0;  // |d(d_logp)/dlogp|
};

inline KlValue kl_estimate(const LossConfig& config, double logp, double ref_logp) {
  const double d_raw = logp - ref_logp;
  double d = d_raw;
  bool inside = true;
  if (config.kl_clamp) {
    const double c = *config.kl_clamp;
    d = std::clamp(d_raw, -c, c);
    inside = d_raw > -c && d_raw < c;
  }
  KlValue kl;
  switch (config.kl_estimator) {
    case KlEstimator::k1:
    case KlEstimator::k1_plus: kl = {d, 1.0, 0.0}; break;
    case KlEstimator::abs:
    case KlEstimator::abs_plus: kl = {std::abs(d), d > 0.0 ? 1.0 : (d < 0.0 ? -1.0 : 0.0), 0.0}; break;
    case KlEstimator::k2: kl = {0.5 * d * d, d, 1.0}; break;
    case KlEstimator::k3:
    case KlEstimator::k3_plus:
      // e^-d + d - 1; expm1 keeps the tiny values near d = 0 exact instead of
      // cancelling 1 - 1 (truth should not carry the float path's rounding).
      kl = {std::expm1(-d) + d, -std::expm1(-d), std::exp(-d)};
      break;
  }
  const KlEstimator e = config.kl_estimator;
  if (e == KlEstimator::k1_plus || e == KlEstimator::abs_plus || e == KlEstimator::k3_plus) {
    kl.d_logp = d;
    kl.d2_logp = 1.0;
  }
  if (!inside) kl.d_logp = kl.d2_logp = 0.0;
  return kl;
}

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
    case LossType::dapo:
    case LossType::luspo: {  // luspo: q is the sequence's (sequence-level IS)
      // PPO clipping, with optional two-sided clipping r~ = min(r, delta).
      const bool has_delta = config.delta.has_value();
      const double delta = has_delta ? static_cast<double>(*config.delta) : 0.0;
      const double r_tilde = has_delta ? std::min(r, delta) : r;
      const double r_clip = std::clamp(r, 1.0 - eps_low, 1.0 + eps_high);
      out.loss = -std::min(r_tilde * a, r_clip * a);
      // The unclipped branch carries the gradient; ties count as unclipped
      // (SPEC.md). Above delta, r~ is the constant delta: no gradient.
      bool unclipped = r_tilde * a <= r_clip * a && (!has_delta || r <= delta);
      // Dual-clip (verl), A < 0 only: min(loss, -A c); the constant branch
      // has no gradient, ties keep the ratio branch.
      if (config.clip_ratio_c && a < 0.0 && -a * static_cast<double>(*config.clip_ratio_c) < out.loss) {
        out.loss = -a * static_cast<double>(*config.clip_ratio_c);
        unclipped = false;
      }
      out.d_q = unclipped ? -a * r : 0.0;
      break;
    }
    case LossType::vespo:
      // phi is detached: a pure gradient scale on logp, nothing through r.
      out.loss = -in.vespo_phi * a * in.logp;
      out.d_logp = -in.vespo_phi * a;
      break;
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

// l_t = keep * is_weight * P + beta * KL term, with both partials (TRL's
// order: policy term, off-policy mask, is_weight, + beta KL). vespo's
// is_weight is inside phi and does not multiply again.
inline TokenTerms token_terms(const LossConfig& config, const TokenInputs& in) {
  TokenTerms out = policy_term(config, in);
  const double factor = in.keep * (config.loss_type == LossType::vespo ? 1.0 : in.is_weight);
  out.loss *= factor;
  out.d_q *= factor;
  out.d_logp *= factor;
  out.d_q_abs = std::abs(out.d_q);
  out.d_logp_abs = std::abs(out.d_logp);
  const double beta = config.beta;
  if (beta == 0.0) return out;
  const double beta_abs = std::abs(beta);

  // No clamp (TRL, Liger) unless config.kl_clamp asks for verl's.
  const KlValue kl = kl_estimate(config, in.logp, in.ref_logp);
  out.kl = kl.value;
  if (config.kl_bias_correction) {
    // KL * r with r live: both the q path and the direct path see it; the
    // term added (and reported, as TRL's per_token_kl) is KL * r.
    const double r = std::exp(in.q);
    out.kl *= r;
    out.loss += beta * out.kl;
    out.d_q += beta * out.kl;
    out.d_logp += beta * kl.d_logp * r;
    // d(KL r)/dq = KL r moves with q by KL r again; KL' r by (KL'' + KL') r.
    out.d_q_abs += 2.0 * beta_abs * std::abs(out.kl);
    out.d_logp_abs += beta_abs * r * (2.0 * std::abs(kl.d_logp) + kl.d2_logp);
  } else {
    out.loss += beta * out.kl;
    out.d_logp += beta * kl.d_logp;
    out.d_logp_abs += beta_abs * (std::abs(kl.d_logp) + kl.d2_logp);
  }
  return out;
}

}  // namespace grpo::oracle::detail
