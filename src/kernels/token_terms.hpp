// The per-token GRPO coefficient stage: the policy term, the KL term and
// their derivatives for one token, in double. Scalar on purpose: it runs N
// times per step against the N * V work of the row stages.
#pragma once

#include "grpo/loss_config.hpp"

namespace grpo::kernels {

// Clamp of the log importance ratio before exp (SPEC: [-20, 20]).
inline constexpr double kLogRatioClamp = 20.0;

// e^d overflows f32 beyond log(FLT_MAX): where TRL's f32 k3 becomes inf.
inline constexpr double kMaxF32ExpArg = 88.72283905206835;

// vespo's lower clamp of log w and of each log is_weight: log(1e-8) (TRL's
// get_gamma_weights, matching the VESPO reference code).
inline constexpr double kVespoLogWeightMin = -18.420680743952367;

// TRL floors vespo's lambda at 1e-4 (lambda_seq.clamp(min=1e-4)).
inline constexpr double kVespoMinLambda = 1e-4;

struct TokenTerms {
  double loss = 0.0;         // l_t = isw * keep * P + beta * KL-term
  double d_ratio = 0.0;      // dl_t / dq, q the (clamped) log ratio; the caller applies dq/dlogp
  double d_direct = 0.0;     // dl_t / dlogp_t through paths other than q (cispo, vespo, KL)
  double kl = 0.0;           // the KL term's value, times r under bias correction (0 when beta == 0)
  bool kl_overflow = false;  // e^(ref - logp) does not fit f32 (refused by the caller)
};

// Factors that come from the token's whole sequence (1 when unused).
struct SequenceFactors {
  double vespo_phi = 1.0;  // vespo's detached gamma weight (vespo_phi below)
  double keep = 1.0;       // the off-policy sequence mask, 0 or 1
};

// vespo's phi for a token of advantage adv, from its sequence's log-weight
// sum before the final clamp (see LossConfig::vespo_k_pos).
double vespo_phi(const LossConfig& config, double log_weight_sum, double adv);

// log_ratio: q, already clamped; logp, ref_logp: this token's; adv: its advantage.
TokenTerms token_terms(const LossConfig& config, double log_ratio, double logp, double ref_logp, double adv,
                       double is_weight, const SequenceFactors& sequence = {});

}  // namespace grpo::kernels
