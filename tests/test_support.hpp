// Shared test fixtures: seeded problem generation (host buffers for the
// library, double copies for the oracle) and the tolerance helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "grpo/baseline.hpp"
#include "grpo/grpo.hpp"
#include "kernels/f16.hpp"
#include "kernels/stage_kernels.hpp"
#include "oracle/oracle.hpp"

namespace grpo::test {

inline constexpr double kEpsF32 = 1.1920928955078125e-07;  // 2^-23
inline constexpr double kEpsBf16 = 0.0078125;              // 2^-7 (8 significant bits)

struct BatchSpec {
  std::int64_t batch = 1;
  std::int64_t seq_len = 1;
  std::int64_t vocab = 1;
  LossConfig config;
  bool per_token_advantages = false;
  bool off_policy = true;        // old_logp present
  int is_weight_kind = 0;        // 0 none, 1 per token, 2 per sequence
  double mask_fraction = 0.2;    // rows masked out
  double zero_adv_fraction = 0;  // sequences with advantage exactly 0
  double logit_scale = 3.0;      // std of the logits
  bool adversarial = false;      // add -inf entries, all-equal rows, |z| ~ 1e4 rows
  std::uint32_t seed = 1;
};

// Per-token tensors in the library's float format plus the oracle problem.
struct HostBatch {
  std::vector<std::int32_t> ids;
  std::vector<float> mask, advantages, old_logp, ref_logp, is_weight;
  std::vector<std::int64_t> sequence_offsets;  // packed rows (test_packed.cpp); empty: B x T
  oracle::Problem problem;                     // logits filled by the caller (logits level) or by lm_head_logits

  BatchInputs view() const { return {ids, mask, advantages, old_logp, ref_logp, is_weight, sequence_offsets}; }
};

inline std::string describe(const BatchSpec& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq_len) + " V=" + std::to_string(s.vocab) +
         " loss=" + to_string(s.config.loss_type) + " is=" + to_string(s.config.importance_sampling_level) +
         " tau=" + std::to_string(s.config.temperature) + (s.config.temperature_on_logp ? " (on logp)" : "") +
         " beta=" + std::to_string(s.config.beta) + (s.config.kl_bias_correction ? " kl*r" : "") +
         (s.per_token_advantages ? " adv[N]" : " adv[B]") + (s.off_policy ? " off-policy" : " on-policy") +
         " isw=" + std::to_string(s.is_weight_kind) + (s.adversarial ? " adversarial" : "") +
         (s.config.kl_estimator != KlEstimator::k3 ? std::string(" kl=") + to_string(s.config.kl_estimator) : "") +
         (s.config.off_policy_mask_threshold ? " opsm=" + std::to_string(*s.config.off_policy_mask_threshold) : "") +
         (s.config.clip_ratio_c ? " clip_c=" + std::to_string(*s.config.clip_ratio_c) : "") +
         " seed=" + std::to_string(s.seed);
}

inline float round_bf16(float v) { return kernels::bf16_to_float(kernels::float_to_bf16(v)); }

// Logits [N, V] with the requested spread; adversarial rows mixed in.
inline std::vector<double> make_logits(const BatchSpec& s, std::mt19937& rng) {
  const std::int64_t n = s.batch * s.seq_len;
  std::normal_distribution<double> normal(0.0, s.logit_scale);
  std::vector<double> z(static_cast<std::size_t>(n * s.vocab));
  for (double& v : z) v = normal(rng);
  if (s.adversarial) {
    for (std::int64_t r = 0; r < n; ++r) {
      double* row = z.data() + r * s.vocab;
      switch (r % 4) {
        case 0:  // banned tokens
          for (std::int64_t v = 1; v < s.vocab; v += 3) row[v] = -std::numeric_limits<double>::infinity();
          break;
        case 1:  // all equal
          for (std::int64_t v = 0; v < s.vocab; ++v) row[v] = 7.25;
          break;
        case 2:  // huge magnitude
          for (std::int64_t v = 0; v < s.vocab; ++v) row[v] = 1.0e4 + row[v];
          break;
        default: break;
      }
    }
  }
  return z;
}

// The chosen token of row r must not be banned (-inf).
inline std::int32_t pick_id(const double* row, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> pick(0, vocab - 1);
  for (;;) {
    const std::int64_t id = pick(rng);
    if (std::isfinite(row[id])) return static_cast<std::int32_t>(id);
  }
}

// Distance of ratio r from every kink of the loss (clip edges, delta, the +-20 clamp).
inline bool near_kink(const LossConfig& c, double log_ratio) {
  constexpr double kMargin = 2e-3;  // >> the f32 error of logp (~1e-5), so kernel and oracle agree on the branch
  const double r = std::exp(log_ratio);
  auto near = [&](double edge) { return std::abs(r - edge) < kMargin * edge; };
  if (std::abs(std::abs(log_ratio) - 20.0) < kMargin) return true;
  if (near(1.0 - c.epsilon_low) || near(1.0 + c.epsilon_high)) return true;
  if (c.delta && near(*c.delta)) return true;
  if (c.loss_type == LossType::cispo && near(c.epsilon_high)) return true;
  if (c.clip_ratio_c && near(*c.clip_ratio_c)) return true;
  return false;
}

// The loss-feature cases both kernels' oracle sweeps append (entropy bonus,
// top-entropy mask, logit softcap and scale): add(type, level, tweak) is the
// sweep's own case maker.
template <class Add>
void add_loss_feature_cases(Add&& add) {
  const auto bonus = [](BatchSpec& s) { s.config.entropy_coef = 0.05F; };
  const auto topk = [](BatchSpec& s) { s.config.top_entropy_quantile = 0.4F; };
  const auto cap = [](BatchSpec& s) {
    s.config.logit_softcap = 4.0F;  // the generated |z| / tau reaches ~10: a real cap
    s.config.logit_scale = 1.2F;
  };
  const auto scaled = [](BatchSpec& s) { s.config.logit_scale = 0.6F; };
  add(LossType::grpo, IsLevel::token, bonus);
  add(LossType::dapo, IsLevel::token, [&](BatchSpec& s) {
    bonus(s);
    topk(s);
  });
  add(LossType::grpo, IsLevel::sequence, topk);
  add(LossType::cispo, IsLevel::token, [&](BatchSpec& s) {
    cap(s);
    bonus(s);
  });
  add(LossType::bnpo, IsLevel::token, cap);
  add(LossType::sapo, IsLevel::token, scaled);
  add(LossType::vespo, IsLevel::token, [&](BatchSpec& s) {
    scaled(s);
    topk(s);
    s.config.entropy_coef = -0.1F;
  });
  add(LossType::luspo, IsLevel::sequence, [&](BatchSpec& s) {
    cap(s);
    topk(s);
    s.config.beta = 0.04F;
  });
}

// The bound on |dlogits error| per entry of one row, for the general row
//   dz = chain (a (onehot - p) - b' p (x - E_p[x])),  chain = dz'/dz <= s,
// a_abs = |dLoss/dlogp| / tau, b_abs = |dLoss/dEnt| dx/dz', tol: the row's
// logp (and x) error, spread: a bound on |x_v - E_p[x]| and on the stored
// |x - max|, f16: the block buffer keeps x - max in f16 (2^-11 relative).
//   a term: p carries tol relatively: a (3 tol + 4 eps) [+ a 2^-11: f16 u]
//   b term: p (x - mean) moves by p |x - mean| (3 tol + 4 eps + f16) plus
//           p |error of x - mean| <= tol (4 + 2 log V) + f16 spread
//   chain:  dchain = 2 s |t| |dt| <= 2 s cap_k (tol + f16 spread) times |g| <= a + b spread
inline double dz_error_bound(const LossConfig& c, double a_abs, double b_abs, double tol, double spread, double vocab,
                             bool f16) {
  const double u = f16 ? 1.0 / 2048.0 : 0.0;
  const double s = c.logit_scale;
  const double err_a = a_abs * (3.0 * tol + 4.0 * kEpsF32 + u);
  const double err_b =
      b_abs * (spread * (3.0 * tol + 4.0 * kEpsF32 + u) + tol * (4.0 + 2.0 * std::log(vocab)) + u * spread);
  double err_chain = 0.0;
  if (c.logit_softcap) {
    const double scale = c.temperature_on_logp ? 1.0 : 1.0 / c.temperature;
    const double cap_k = 1.0 / (scale * *c.logit_softcap);
    err_chain = (a_abs + b_abs * spread) * 2.0 * s * cap_k * (tol + (u + 4.0 * kEpsF32) * spread);
  }
  return s * (err_a + err_b) + err_chain;
}

// |x| = |z'| * scale of one logit z under the config's transform and temperature.
inline double softmax_input(const LossConfig& c, double z) {
  const double scale = c.temperature_on_logp ? 1.0 : 1.0 / c.temperature;
  return std::abs(static_cast<double>(oracle::transform_logit(z, c.logit_softcap, c.logit_scale).value)) * scale;
}

// The relative error of a token's coefficient per unit of logp error, beyond
// the token's own: vespo's phi_i moves with every logp of its sequence,
// d log phi / d log w = k - lam w summed over |o_i| tokens (1 otherwise).
// logp: the oracle's; the factor multiplies tol_logp in the dlogits bound.
inline std::vector<double> coefficient_amplification(const oracle::Problem& p, const std::vector<double>& logp) {
  const std::int64_t n = p.batch * p.seq_len;
  std::vector<double> amp(static_cast<std::size_t>(n), 1.0);
  if (p.config.loss_type != LossType::vespo) return amp;
  for (std::int64_t i = 0; i < p.batch; ++i) {
    double log_w = 0.0, count = 0.0;
    for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
      if (p.mask[t] == 0.0) continue;
      count += 1.0;
      if (!p.old_logp.empty()) log_w += std::clamp(logp[t] - p.old_logp[t], -20.0, 20.0);
      if (!p.is_weight.empty()) log_w += std::max(std::log(p.is_weight[t]), -18.420680743952367);
    }
    const double w = std::exp(std::clamp(log_w, -18.420680743952367, 20.0));
    for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
      const bool pos =
          (p.advantages.size() == static_cast<std::size_t>(p.batch) ? p.advantages[i] : p.advantages[t]) >= 0;
      const double k = pos ? p.config.vespo_k_pos : p.config.vespo_k_neg;
      const double lam = pos ? p.config.vespo_lambda_pos : p.config.vespo_lambda_neg;
      amp[t] = 1.0 + std::abs(k - lam * w) * count;
    }
  }
  return amp;
}

// Fills ids, mask, advantages, is_weight, ref_logp and old_logp (from the
// oracle's on-policy logp plus noise, redrawn away from kinks) for logits
// already in h.problem.logits.
// base_logp: the on-policy logp when the caller has it (large shapes);
// otherwise the oracle computes it from h.problem.logits.
inline void fill_batch(const BatchSpec& s, HostBatch& h, std::mt19937& rng,
                       const std::vector<double>* base_logp = nullptr) {
  const std::int64_t n = s.batch * s.seq_len;
  oracle::Problem& p = h.problem;
  p.batch = s.batch;
  p.seq_len = s.seq_len;
  p.vocab = s.vocab;
  p.config = s.config;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  if (base_logp == nullptr) h.ids.resize(n);  // else the caller chose them
  h.mask.resize(n);
  for (std::int64_t r = 0; r < n; ++r) {
    h.ids[r] = base_logp != nullptr ? h.ids[r] : pick_id(p.logits.data() + r * s.vocab, s.vocab, rng);
    h.mask[r] = unit(rng) < s.mask_fraction ? 0.0F : 1.0F;
  }
  const std::int64_t adv_count = s.per_token_advantages ? n : s.batch;
  h.advantages.resize(adv_count);
  for (std::int64_t i = 0; i < adv_count; ++i) {
    const std::int64_t seq = s.per_token_advantages ? i / s.seq_len : i;
    // Zero-advantage sequences are the odd-numbered ones, up to the fraction.
    const bool zero = seq % 2 == 1 && static_cast<double>(seq / 2 + 1) <= s.zero_adv_fraction * s.batch + 1e-9;
    h.advantages[i] = zero ? 0.0F : static_cast<float>(normal(rng));
  }
  if (s.is_weight_kind != 0) {
    h.is_weight.resize(s.is_weight_kind == 1 ? n : s.batch);
    for (float& w : h.is_weight) w = static_cast<float>(0.5 + unit(rng));
  }
  // On-policy logp from the oracle, to place old/ref logp around it.
  p.ids.assign(h.ids.begin(), h.ids.end());
  p.mask.assign(h.mask.begin(), h.mask.end());
  p.advantages.assign(h.advantages.begin(), h.advantages.end());
  p.is_weight.assign(h.is_weight.begin(), h.is_weight.end());
  LossConfig on_policy = s.config;
  on_policy.beta = 0.0F;
  oracle::Result base;
  if (base_logp != nullptr) {
    base.logp = *base_logp;
  } else {
    oracle::Problem probe = p;
    probe.config = on_policy;
    base = oracle::evaluate(probe);
  }
  if (s.config.beta != 0.0F) {
    h.ref_logp.resize(n);
    for (std::int64_t r = 0; r < n; ++r) h.ref_logp[r] = static_cast<float>(base.logp[r] + 0.2 * normal(rng));
  }
  if (s.off_policy) {
    h.old_logp.resize(n);
    const bool sequence = s.config.importance_sampling_level == IsLevel::sequence;
    for (std::int64_t i = 0; i < s.batch; ++i) {
      for (int attempt = 0;; ++attempt) {
        double sum = 0.0, count = 0.0;
        bool ok = true;
        for (std::int64_t t = i * s.seq_len; t < (i + 1) * s.seq_len; ++t) {
          const double lr = 0.3 * normal(rng);  // SPEC: old = logp + N(0, 0.3) reaches both branches
          h.old_logp[t] = static_cast<float>(base.logp[t] - lr);
          const double actual = base.logp[t] - static_cast<double>(h.old_logp[t]);
          if (!sequence && h.mask[t] != 0.0F && near_kink(s.config, actual)) ok = false;
          sum += h.mask[t] * actual;
          count += h.mask[t];
        }
        if (sequence && near_kink(s.config, sum / std::max(count, 1.0))) ok = false;
        // The off-policy mask's decision: mean(old - logp) away from the threshold.
        const auto& opsm = s.config.off_policy_mask_threshold;
        if (opsm && std::abs(-sum / std::max(count, 1.0) - static_cast<double>(*opsm)) < 2e-3) ok = false;
        if (ok || attempt > 100) break;
      }
    }
  }
  p.old_logp.assign(h.old_logp.begin(), h.old_logp.end());
  p.ref_logp.assign(h.ref_logp.begin(), h.ref_logp.end());
}

// Loss-config knobs that need a value for the loss type.
inline LossConfig config_for(LossType type) {
  LossConfig c;
  c.loss_type = type;
  c.max_completion_length = 16;
  c.num_items_in_batch = 37.0;
  if (type == LossType::cispo) c.epsilon_high = 1.3F;  // the cap of the detached ratio
  return c;
}

// max_v |a_v - b_v| and max_v |b_v| over a range.
struct Diff {
  double max_abs = 0.0;
  double max_ref = 0.0;
  std::int64_t worst = -1;
};

template <class A>
Diff diff(const A& got, const std::vector<double>& want) {
  Diff d;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double e = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(e <= d.max_abs)) {
      d.max_abs = e;
      d.worst = static_cast<std::int64_t>(i);
    }
    d.max_ref = std::max(d.max_ref, std::abs(want[i]));
  }
  return d;
}

inline std::vector<float> to_float(const void* data, DType dtype, std::size_t count) {
  std::vector<float> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    const auto* h = static_cast<const std::uint16_t*>(data);
    out[i] = dtype == DType::f32    ? static_cast<const float*>(data)[i]
             : dtype == DType::bf16 ? kernels::bf16_to_float(h[i])
                                    : kernels::f16_to_float(h[i]);
  }
  return out;
}

}  // namespace grpo::test
