// The per-token GRPO coefficient stage: the policy term, the KL term and
// their derivatives for one token, in double. Scalar on purpose: it runs N
// times per step against the N * V work of the row stages.
#pragma once

#include "grpo/loss_config.hpp"

namespace grpo::kernels {

// Clamp of the log importance ratio before exp (SPEC: [-20, 20]).
inline constexpr double kLogRatioClamp = 20.0;

struct TokenTerms {
  double loss = 0.0;      // l_t = isw * P + beta * KL-term
  double d_ratio = 0.0;   // dl_t / dq, q the (clamped) log ratio; the caller applies dq/dlogp
  double d_direct = 0.0;  // dl_t / dlogp_t through paths other than q (cispo, KL)
  double kl = 0.0;        // k3 KL_t (0 when beta == 0)
};

// log_ratio: q, already clamped; logp, ref_logp: this token's; adv: its advantage.
TokenTerms token_terms(const LossConfig& config, double log_ratio, double logp, double ref_logp, double adv,
                       double is_weight);

}  // namespace grpo::kernels
