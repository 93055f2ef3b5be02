// The GRPO loss configuration and the per-batch tensors, shared by the
// logits-level kernel, the fused LM-head kernel and the unfused baselines.
// The math is ../shared/SPEC.md; docs/semantics in README.md says where the
// spec was silent and what this library chose.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "grpo/types.hpp"

namespace grpo {

// luspo and vespo are appended: the earlier values keep their numbers.
enum class LossType : std::uint8_t { grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo };
enum class IsLevel : std::uint8_t { token, sequence };
// The KL estimator, with d = logp - ref_logp (the policy's minus the
// reference's): k1 = d, abs = |d|, k2 = d^2 / 2, k3 = e^-d + d - 1 (TRL's and
// Liger's, the default). The _plus variants are verl's straight-through ones:
// the forward value of the named estimator, the gradient of k2 (d). k2's own
// "+" is k2 itself, so it has no entry.
enum class KlEstimator : std::uint8_t { k3, k1, abs, k2, k1_plus, abs_plus, k3_plus };

const char* to_string(LossType type);
const char* to_string(IsLevel level);
const char* to_string(KlEstimator estimator);

struct LossConfig {
  LossType loss_type = LossType::grpo;
  // token: r per token; sequence: GSPO, one ratio per sequence.
  // luspo requires sequence; vespo requires token (it forms its own
  // sequence weight from the token log ratios).
  //   luspo: the grpo term with r := s_i, aggregated (1/B) sum_i sum_t m_t l_t.
  //   vespo: l_t = -phi_i A_t logp_t with phi_i detached (see vespo_k_pos);
  //          aggregated as dapo (num_items_in_batch).
  IsLevel importance_sampling_level = IsLevel::token;
  float epsilon_low = 0.2F;
  // For cispo this is the cap of the detached ratio (min(r, epsilon_high)).
  float epsilon_high = 0.2F;
  // Two-sided clipping: r~ = min(r, delta). Must exceed 1 + epsilon_high.
  std::optional<float> delta;
  // KL (k3) coefficient; ref_logp is required when beta != 0. The k3 value
  // e^d - d - 1, d = ref_logp - logp, is TRL's and Liger's, unclamped; a token
  // whose e^d overflows f32 (d > 88.7, where TRL's value is inf) is refused
  // naming ref_logp.
  float beta = 0.0F;
  // Multiply the KL term by the (non-detached) importance ratio.
  bool kl_bias_correction = false;
  // Which KL term beta multiplies (see KlEstimator). Only k3 and k3_plus
  // exponentiate, so only they can overflow f32 (refused, as above).
  KlEstimator kl_estimator = KlEstimator::k3;
  // verl-style clamp (any estimator): d is clamped to [-kl_clamp, kl_clamp] before the KL (its
  // gradient is 0 outside), so no finite input can overflow. Absent = no clamp.
  std::optional<float> kl_clamp;
  float temperature = 1.0F;
  // false: logp = x_y - LSE(x), x = z / tau (TRL, Liger).
  // true:  logp = (z_y - LSE(z)) / tau (MLLM-JAX); p = softmax(z).
  bool temperature_on_logp = false;
  // dr_grpo normalizer: sum m l / (B * max_completion_length). Required (> 0) for dr_grpo.
  std::int64_t max_completion_length = 0;
  // dapo / cispo normalizer: the global valid-token count, from the caller. Required (> 0) there.
  double num_items_in_batch = 0.0;
  // sapo temperatures: k = tau_pos when A > 0, tau_neg otherwise.
  float sapo_tau_pos = 1.0F;
  float sapo_tau_neg = 1.05F;
  // vespo's gamma weight (TRL's vespo_k_pos / vespo_lambda_pos / _neg and
  // their defaults): per sequence, log w_i = clamp(sum_t m_t clamp(log r_t,
  // -20, 20) + sum_t m_t clamp(log is_weight_t, log 1e-8, 20), log 1e-8, 20);
  // (k, lam) = (k_pos, lambda_pos) when A_t >= 0, else (k_neg, lambda_neg),
  // lam floored at 1e-4 as TRL does; phi = exp(lam + k log w - lam w), taken as
  // 0 when it is not finite in f32 (TRL computes it in f32 and maps inf/NaN to
  // 0). is_weight enters phi only (it must be [N] and >= 0 for vespo) and does
  // not multiply l_t again.
  float vespo_k_pos = 2.0F;
  float vespo_lambda_pos = 3.0F;
  float vespo_k_neg = 3.0F;
  float vespo_lambda_neg = 2.0F;
  // Off-policy sequence mask (TRL's off_policy_mask_threshold, DeepSeek-V3.2):
  // sequence i keeps its policy term iff A >= 0 or sum_t m_t (old_t - logp_t) /
  // max(|o_i|, 1) <= threshold (logp detached; per-token advantages decide per
  // token). It multiplies the policy term only (not the KL). Absent = off.
  // Finite and >= 0. Without old_logp the mean is 0: nothing is dropped.
  std::optional<float> off_policy_mask_threshold;
  // Dual-clip (verl's clip_ratio_c), for A < 0 in the PPO-clipped losses
  // (grpo, bnpo, dr_grpo, dapo, luspo): l = min(max(-A r~, -A clip(r)), -A c),
  // gradient 0 where -A c is strictly smaller (ties flow). Must exceed 1.
  // Absent = off (verl's default is 3).
  std::optional<float> clip_ratio_c;
  // Entropy bonus: Loss -= entropy_coef * sum_t m_t e_t Ent_t / max(sum_t m_t e_t, 1), a plain
  // mean over the tokens it acts on whatever the loss type (e_t: the entropy mask below, 1 when
  // off). Differentiable: dEnt_t/dx_v = -p_v (x_v - E_p[x]), fused into the same dlogits tile
  // (no extra GEMM pass). Finite; 0 = off.
  float entropy_coef = 0.0F;
  // TRL's top_entropy_quantile rho in [0, 1]: e_t = [Ent_t >= q] m_t with q the (1 - rho)
  // quantile of the entropies of the valid tokens of the call (linear interpolation, as
  // torch.quantile computes it in f32). e_t multiplies the policy term (not the KL) and is not
  // differentiated. 1 = off (q is the minimum: every token kept). It needs every token's
  // entropy before any coefficient: the fused LM head runs its two-pass schedule (logits
  // recomputed for the backward) when the call's rows do not fit one token block.
  float top_entropy_quantile = 1.0F;
  // Logit transforms of the model's head (Gemma's final_logit_softcapping, Granite's / Cohere's
  // logit scale), before the temperature: z' = c tanh(s z / c), or z' = s z without a cap;
  // dz'/dz = s (1 - tanh^2(s z / c)). logit_softcap: c, finite and > 0; absent = no cap.
  // logit_scale: s, finite and > 0.
  std::optional<float> logit_softcap;
  float logit_scale = 1.0F;
};

// The per-token tensors of one micro-batch: B sequences of T tokens (N = B * T
// rows, padded with masked rows), or S sequences packed back to back in N rows
// (sequence_offsets). Spans are contiguous float32/int32/int64 arrays; an
// empty span means "absent". "Per sequence" below is [B], or [S] when packed.
struct BatchInputs {
  std::span<const std::int32_t> ids;  // [N] chosen token; never read on masked rows
  std::span<const float> mask;        // [N], each 0 or 1
  std::span<const float> advantages;  // per sequence or [N] (per token)
  std::span<const float> old_logp;    // [N] or empty (on-policy: r = 1, gradient flows)
  std::span<const float> ref_logp;    // [N], required when beta != 0
  std::span<const float> is_weight;   // [N], per sequence, or empty; no gradient flows into it
  // Packed sequences (flash-attention's cu_seqlens): [S + 1] offsets, sequence
  // i the rows [offsets[i], offsets[i + 1]); offsets[0] = 0, strictly
  // increasing, offsets[S] = N. The shape is then one row of N tokens (batch =
  // 1, seq_len = N). Every per-sequence rule (grpo / sapo's mean, sequence-level
  // IS, vespo's weight, the off-policy mask, the B of grpo / luspo / dr_grpo's
  // normalizers and of the clip ratios over sequences) follows them. Empty: the
  // shape's B sequences of T rows.
  std::span<const std::int64_t> sequence_offsets;
};

// Per-token outputs. logp is always written (trainers keep it as next epoch's
// old_logp; 0 on masked rows; it may be the very array old_logp is). entropy
// and kl are written when non-empty.
struct TokenOutputs {
  std::span<float> logp;     // [N], required
  std::span<float> entropy;  // [N] or empty
  std::span<float> kl;       // [N] or empty: the KL term added per token (its forward value, times r under
                             // kl_bias_correction: TRL's per_token_kl); 0 on masked rows or when beta == 0
};

// The metrics TRL logs, computed as TRL computes them: masked means over
// valid rows (0 when no row is valid). kl_mean is the mean of the kl output.
// clip ratios: grpo family and sapo, r < 1 - eps_low with A < 0 (low),
// r > 1 + eps_high with A > 0 (high), either (region); cispo, TRL's
// cispo_clip_ratio r > eps_high with A > 0 in high and region (low = 0).
// With sequence-level IS and per-sequence advantages, r is one per sequence
// and the ratios are fractions of the B sequences (TRL's global_masked_mean
// of a [B, 1] tensor). vespo: all three are 0 (TRL logs none for it).
struct Metrics {
  double loss = 0.0;
  double clip_ratio_low = 0.0;
  double clip_ratio_high = 0.0;
  double clip_ratio_region = 0.0;
  double kl_mean = 0.0;
  double entropy_mean = 0.0;
  std::int64_t num_valid = 0;
};

}  // namespace grpo
