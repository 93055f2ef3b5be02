// The double-precision oracle: the truth every fast path is compared with.
// Full logits in double, plain loops, no tiling, no SIMD, nothing shared with
// src/ except the public LossConfig type. It is itself checked against
// central finite differences (test_oracle_fd.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "grpo/loss_config.hpp"

namespace grpo::oracle {

// One problem at the logits level. Absent optional tensors are empty vectors.
struct Problem {
  std::int64_t batch = 0;          // B
  std::int64_t seq_len = 0;        // T
  std::int64_t vocab = 0;          // V
  std::vector<double> logits;      // [N * V], row-major; may hold -inf
  std::vector<std::int32_t> ids;   // [N]
  std::vector<double> mask;        // [N], 0 or 1
  std::vector<double> advantages;  // [B] or [N]
  std::vector<double> old_logp;    // [N] or empty (on-policy)
  std::vector<double> ref_logp;    // [N] or empty
  std::vector<double> is_weight;   // [N], [B] or empty
  LossConfig config;
};

struct Result {
  double loss = 0.0;
  std::vector<double> logp;     // [N], 0 on masked rows
  std::vector<double> entropy;  // [N], every row
  std::vector<double> kl;       // [N], 0 on masked rows or when beta == 0
  std::vector<double> dlogits;  // [N * V]
  // The coefficients behind dlogits (for error bounds in tests): dLoss/dlogp_t
  // and dLoss/dEnt_t (the entropy bonus), 0 on masked rows.
  std::vector<double> dloss_dlogp;
  // >= |dloss_dlogp|: its parts (policy, KL, each token's share of a
  // sequence's ratio) summed without cancellation, the KL part's own slope in
  // logp included. A float path's error in c_t scales with this, not with
  // |c_t|, which a policy part and a KL part of opposite sign can shrink.
  std::vector<double> dloss_dlogp_scale;
  std::vector<double> dloss_dentropy;
  double clip_ratio_low = 0.0;
  double clip_ratio_high = 0.0;
  double clip_ratio_region = 0.0;
  double kl_mean = 0.0;
  double entropy_mean = 0.0;
  std::int64_t num_valid = 0;
};

// The model's logit transform (LossConfig::logit_softcap / logit_scale):
// z' = c tanh(s z / c), or s z without a cap; chain = dz'/dz.
struct TransformedLogit {
  long double value;
  long double chain;
};
inline TransformedLogit transform_logit(long double z, const std::optional<float>& softcap, float scale) {
  const long double s = scale;
  if (!softcap) return {s * z, s};
  const long double c = *softcap;
  const long double t = std::tanh(s * z / c);
  return {c * t, s * (1.0L - t * t)};
}

// torch.quantile(values, q) with linear interpolation, in long double (values copied, sorted).
long double linear_quantile(std::vector<long double> values, long double q);

// Loss, per-token values, metrics and dlogits.
Result evaluate(const Problem& problem);

// The scalar loss alone (what finite differences differentiate).
double loss_only(const Problem& problem);

// The LM head on top: logits = hidden * W^T + bias, all in double.
struct LmHeadProblem {
  Problem head;                  // head.logits is ignored (computed from below)
  std::int64_t hidden_size = 0;  // H
  std::vector<double> hidden;    // [N * H]
  std::vector<double> weight;    // [V * H] (vocab-major, whatever the layout under test)
  std::vector<double> bias;      // [V] or empty
};

struct LmHeadResult {
  Result head;                  // head.dlogits filled as well
  std::vector<double> dhidden;  // [N * H]
  std::vector<double> dweight;  // [V * H], vocab-major
  std::vector<double> dbias;    // [V] (empty without bias)
};

LmHeadResult evaluate_lm_head(const LmHeadProblem& problem);

// Logits of an LM-head problem (hidden * W^T + bias), for building a Problem.
std::vector<double> lm_head_logits(const LmHeadProblem& problem);

// The chain rule through z = hidden W^T + bias: dhidden = dz W, dweight =
// dz^T hidden (vocab-major), dbias = column sums of dz (empty without bias).
void lm_head_chain(const LmHeadProblem& problem, const std::vector<double>& dlogits, std::vector<double>& dhidden,
                   std::vector<double>& dweight, std::vector<double>& dbias);

// The generic log-prob head (oracle_log_prob.cpp): per-token logp and entropy
// of the LM head's logits, and the gradients of the linear functional
//   L = sum over valid rows t of dlogp_t logp_t + dentropy_t Ent_t
// for given upstream dlogp, dentropy (what any loss computed outside hands
// back). Masked rows: logp 0, entropy computed, upstream ignored.
struct LogProbProblem {
  LmHeadProblem lm;              // lm.head: batch, seq_len, vocab, ids, mask (empty = every row
                                 // valid), config.temperature / temperature_on_logp; the rest unused
  std::vector<double> dlogp;     // [N]
  std::vector<double> dentropy;  // [N] or empty (= 0)
};

struct LogProbResult {
  std::vector<double> logp;     // [N]
  std::vector<double> entropy;  // [N]
  std::vector<double> dlogits;  // [N * V]
  std::vector<double> dhidden;  // [N * H]
  std::vector<double> dweight;  // [V * H], vocab-major
  std::vector<double> dbias;    // [V] (empty without bias)
};

LogProbResult evaluate_log_prob_head(const LogProbProblem& problem);

// L above, alone (what finite differences differentiate).
double log_prob_objective(const LogProbProblem& problem);

}  // namespace grpo::oracle
