// The double-precision oracle. It reads top to bottom as the semantics:
//   row softmax -> log ratio q -> per-token loss and partials
//   -> aggregation weights -> chain rule back to dlogits.
// Full logits, plain loops, long double for the log-sum-exp. Nothing here is
// fast on purpose: every quantity is a named vector a test can look at.
#include "oracle/oracle.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "oracle/oracle_token_terms.hpp"

namespace grpo::oracle {
namespace {

using detail::kLogRatioClamp;

void require(bool condition, const std::string& what) {
  if (!condition) throw std::invalid_argument("grpo::oracle: " + what);
}

// The oracle trusts its caller far less than it costs to check: a test that
// builds a wrong-sized tensor should fail loudly, not read garbage.
void check_problem(const Problem& pb) {
  const std::int64_t n = pb.batch * pb.seq_len;
  const auto un = static_cast<std::size_t>(n);
  const auto ub = static_cast<std::size_t>(pb.batch);
  require(pb.batch > 0 && pb.seq_len > 0 && pb.vocab > 0, "empty shape");
  require(pb.logits.size() == un * static_cast<std::size_t>(pb.vocab), "logits size");
  require(pb.ids.size() == un && pb.mask.size() == un, "ids/mask size");
  require(pb.advantages.size() == ub || pb.advantages.size() == un, "advantages size");
  require(pb.old_logp.empty() || pb.old_logp.size() == un, "old_logp size");
  require(pb.is_weight.empty() || pb.is_weight.size() == ub || pb.is_weight.size() == un, "is_weight size");
  require(pb.config.beta == 0.0F || pb.ref_logp.size() == un, "ref_logp needed");
  require(pb.config.temperature > 0.0F, "temperature");
  for (std::int64_t t = 0; t < n; ++t) {
    const double m = pb.mask[static_cast<std::size_t>(t)];
    require(m == 0.0 || m == 1.0, "mask is not 0/1");
    const std::int32_t y = pb.ids[static_cast<std::size_t>(t)];
    require(m == 0.0 || (y >= 0 && y < pb.vocab), "id out of range on a valid row");
  }
  const LossType type = pb.config.loss_type;
  require(type != LossType::dr_grpo || pb.config.max_completion_length > 0, "max_completion_length");
  require((type != LossType::dapo && type != LossType::cispo && type != LossType::vespo) ||
              pb.config.num_items_in_batch > 0.0,
          "num_items_in_batch");
}

// A [B] tensor is read per sequence, an [N] tensor per token. When T == 1 the
// two coincide (i == t), so the size alone decides without ambiguity.
double per_row(const std::vector<double>& v, const Problem& pb, std::int64_t t, double absent) {
  if (v.empty()) return absent;
  const bool per_sequence = static_cast<std::int64_t>(v.size()) == pb.batch;
  return v[static_cast<std::size_t>(per_sequence ? t / pb.seq_len : t)];
}

// One row of logits through the softmax of x = z / tau (or x = z when the
// temperature is applied to logp instead).
struct RowSoftmax {
  double logp = 0.0;     // (x_y - LSE(x)) * post; 0 on masked rows
  double entropy = 0.0;  // LSE(x) - sum p x, for every row
  std::vector<double> p;
  std::vector<double> centered;  // x_v - E_p[x] (0 where p_v = 0)
  std::vector<double> chain;     // dz'_v/dz_v of the logit transform
};

RowSoftmax row_softmax(const double* z, std::int64_t vocab, const LossConfig& config, bool valid, std::int32_t id) {
  const long double tau = config.temperature;
  const bool on_logp = config.temperature_on_logp;
  std::vector<long double> x(static_cast<std::size_t>(vocab));
  // The max starts at -inf, never 0: rows of large negative logits stay exact.
  long double max_x = -std::numeric_limits<long double>::infinity();
  RowSoftmax row;
  row.chain.resize(static_cast<std::size_t>(vocab));
  for (std::int64_t v = 0; v < vocab; ++v) {
    const TransformedLogit zt = transform_logit(z[v], config.logit_softcap, config.logit_scale);
    row.chain[v] = static_cast<double>(zt.chain);
    x[v] = on_logp ? zt.value : zt.value / tau;
    max_x = std::max(max_x, x[v]);
  }
  // Sums over x - max: -inf entries give exp(-inf) = 0 and drop out. A row of
  // only -inf has no softmax at all; it comes out NaN, which is the honest answer.
  long double sum = 0.0L;
  for (std::int64_t v = 0; v < vocab; ++v) sum += std::exp(x[v] - max_x);
  const long double log_sum = std::log(sum);  // LSE = max_x + log_sum

  row.p.resize(static_cast<std::size_t>(vocab));
  row.centered.assign(static_cast<std::size_t>(vocab), 0.0);
  long double mean_shifted_x = 0.0L;  // sum_v p_v (x_v - max_x), p_v = 0 terms skipped
  for (std::int64_t v = 0; v < vocab; ++v) {
    const long double p = std::exp(x[v] - max_x) / sum;
    row.p[v] = static_cast<double>(p);
    if (p > 0.0L) mean_shifted_x += p * (x[v] - max_x);
  }
  for (std::int64_t v = 0; v < vocab; ++v) {
    if (row.p[v] > 0.0) row.centered[v] = static_cast<double>((x[v] - max_x) - mean_shifted_x);
  }
  // Entropy = LSE - sum p x; both sides shifted by max_x so that |z| ~ 1e4
  // does not cancel the leading digits away.
  row.entropy = static_cast<double>(log_sum - mean_shifted_x);
  if (valid) {
    const long double post = on_logp ? 1.0L / tau : 1.0L;
    row.logp = static_cast<double>(((x[id] - max_x) - log_sum) * post);
  }
  return row;
}

// Everything the forward pass computes, row by row.
struct Forward {
  std::vector<RowSoftmax> rows;
  std::vector<bool> valid;
  std::vector<double> q;         // clamped log ratio seen by each row
  std::vector<double> dq_dlogp;  // dq_t/dlogp_t (token) or dq_i/dlogp_t (sequence)
  std::vector<double> weight;    // w_t = dLoss/dl_t, 0 on masked rows
  std::vector<detail::TokenTerms> terms;
  std::vector<double> entropy_weight;   // dLoss/dEnt_t (the entropy bonus), 0 on masked rows
  std::vector<std::int64_t> seq_valid;  // |o_i|
  std::int64_t num_valid = 0;
  double loss = 0.0;
};

// dLoss/dl_t for a valid token of sequence i: the aggregation normalizer.
double aggregation_weight(const Problem& pb, std::int64_t seq_valid, std::int64_t num_valid) {
  const auto batch = static_cast<double>(pb.batch);
  switch (pb.config.loss_type) {
    case LossType::grpo:
    case LossType::sapo: return 1.0 / (batch * static_cast<double>(std::max<std::int64_t>(seq_valid, 1)));
    case LossType::bnpo: return 1.0 / static_cast<double>(std::max<std::int64_t>(num_valid, 1));
    case LossType::dr_grpo: return 1.0 / (batch * static_cast<double>(pb.config.max_completion_length));
    case LossType::dapo:
    case LossType::cispo:
    case LossType::vespo:
      // The caller's global count; never guessed from this micro-batch.
      return 1.0 / pb.config.num_items_in_batch;
    case LossType::luspo: return 1.0 / batch;  // (1/B) sum_i sum_t: each sequence weighted by |o_i|
  }
  return 0.0;
}

Forward forward(const Problem& pb) {
  check_problem(pb);
  const std::int64_t n = pb.batch * pb.seq_len;
  const auto un = static_cast<std::size_t>(n);
  Forward f;
  f.rows.reserve(un);
  f.valid.resize(un);
  f.q.assign(un, 0.0);
  f.dq_dlogp.assign(un, 0.0);
  f.weight.assign(un, 0.0);
  f.terms.assign(un, {});
  f.seq_valid.assign(static_cast<std::size_t>(pb.batch), 0);

  for (std::int64_t t = 0; t < n; ++t) {
    f.valid[t] = pb.mask[t] != 0.0;
    // ids of masked rows are never read: pass -1 so a slip would show.
    f.rows.push_back(row_softmax(&pb.logits[static_cast<std::size_t>(t * pb.vocab)], pb.vocab, pb.config, f.valid[t],
                                 f.valid[t] ? pb.ids[t] : -1));
    if (f.valid[t]) ++f.seq_valid[t / pb.seq_len];
  }
  for (const std::int64_t c : f.seq_valid) f.num_valid += c;

  // Log ratio; on-policy (old absent) means old = stop_gradient(logp): lr = 0
  // but dq/dlogp stays 1, so the gradient still flows through r.
  std::vector<double> log_ratio(un, 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (f.valid[t] && !pb.old_logp.empty()) log_ratio[t] = f.rows[t].logp - pb.old_logp[t];
  }
  const auto clamp_q = [](double raw) { return std::clamp(raw, -kLogRatioClamp, kLogRatioClamp); };
  const auto unclamped = [](double raw) { return raw > -kLogRatioClamp && raw < kLogRatioClamp; };
  if (pb.config.importance_sampling_level == IsLevel::token) {
    for (std::int64_t t = 0; t < n; ++t) {
      f.q[t] = clamp_q(log_ratio[t]);
      f.dq_dlogp[t] = unclamped(log_ratio[t]) ? 1.0 : 0.0;
    }
  } else {
    // GSPO: one ratio per sequence, the masked mean of the token log ratios.
    for (std::int64_t i = 0; i < pb.batch; ++i) {
      const double denom = static_cast<double>(std::max<std::int64_t>(f.seq_valid[i], 1));
      double sum = 0.0;
      for (std::int64_t t = i * pb.seq_len; t < (i + 1) * pb.seq_len; ++t) {
        if (f.valid[t]) sum += log_ratio[t];
      }
      const double mean = sum / denom;
      for (std::int64_t t = i * pb.seq_len; t < (i + 1) * pb.seq_len; ++t) {
        f.q[t] = clamp_q(mean);
        f.dq_dlogp[t] = f.valid[t] && unclamped(mean) ? 1.0 / denom : 0.0;
      }
    }
  }

  // Per-sequence factors over the valid tokens: vespo's log-weight sum and
  // the off-policy mask's mean of old - logp (logp detached: neither has a
  // derivative here).
  std::vector<double> vespo_sum(static_cast<std::size_t>(pb.batch), 0.0);
  std::vector<double> mean_old_minus_logp(static_cast<std::size_t>(pb.batch), 0.0);
  for (std::int64_t i = 0; i < pb.batch; ++i) {
    double shift = 0.0;
    for (std::int64_t t = i * pb.seq_len; t < (i + 1) * pb.seq_len; ++t) {
      if (!f.valid[t]) continue;
      shift += -log_ratio[t];
      vespo_sum[i] += clamp_q(log_ratio[t]);
      if (!pb.is_weight.empty()) {
        vespo_sum[i] += std::clamp(std::log(per_row(pb.is_weight, pb, t, 1.0)), detail::kVespoLogFloor, kLogRatioClamp);
      }
    }
    mean_old_minus_logp[i] = shift / static_cast<double>(std::max<std::int64_t>(f.seq_valid[i], 1));
  }

  // The top-entropy mask e_t: Ent_t >= the (1 - rho) quantile of the valid
  // rows' entropies (not differentiated); 1 when rho = 1.
  std::vector<double> entropy_mask(un, 1.0);
  if (pb.config.top_entropy_quantile < 1.0F) {
    std::vector<long double> valid_entropies;
    for (std::int64_t t = 0; t < n; ++t) {
      if (f.valid[t]) valid_entropies.push_back(f.rows[t].entropy);
    }
    if (!valid_entropies.empty()) {
      const long double threshold =
          linear_quantile(valid_entropies, 1.0L - static_cast<long double>(pb.config.top_entropy_quantile));
      for (std::int64_t t = 0; t < n; ++t) entropy_mask[t] = f.rows[t].entropy >= threshold ? 1.0 : 0.0;
    }
  }
  double entropy_count = 0.0;  // sum_t m_t e_t
  for (std::int64_t t = 0; t < n; ++t) entropy_count += f.valid[t] ? entropy_mask[t] : 0.0;
  f.entropy_weight.assign(un, 0.0);

  // Masked rows are skipped outright, so nothing read there (old_logp,
  // ref_logp, is_weight of a masked token) can leak into the loss, not even a NaN.
  for (std::int64_t t = 0; t < n; ++t) {
    if (!f.valid[t]) continue;
    detail::TokenInputs in;
    const std::int64_t seq = t / pb.seq_len;
    const double adv = per_row(pb.advantages, pb, t, 0.0);
    if (pb.config.loss_type == LossType::vespo) in.vespo_phi = detail::vespo_phi(pb.config, vespo_sum[seq], adv);
    const auto& opsm = pb.config.off_policy_mask_threshold;
    in.keep = !opsm || adv >= 0.0 || mean_old_minus_logp[seq] <= static_cast<double>(*opsm) ? 1.0 : 0.0;
    in.keep *= entropy_mask[t];
    in.q = f.q[t];
    in.logp = f.rows[t].logp;
    in.advantage = per_row(pb.advantages, pb, t, 0.0);
    in.is_weight = per_row(pb.is_weight, pb, t, 1.0);
    in.ref_logp = pb.ref_logp.empty() ? 0.0 : pb.ref_logp[t];
    f.terms[t] = detail::token_terms(pb.config, in);
    f.weight[t] = aggregation_weight(pb, f.seq_valid[t / pb.seq_len], f.num_valid);
    f.loss += f.weight[t] * f.terms[t].loss;
    // Entropy bonus: Loss -= coef * sum m e Ent / max(sum m e, 1).
    f.entropy_weight[t] = -static_cast<double>(pb.config.entropy_coef) * entropy_mask[t] / std::max(entropy_count, 1.0);
    f.loss += f.entropy_weight[t] * f.rows[t].entropy;
  }
  return f;
}

// c_t = dLoss/dlogp_t by the chain rule through both paths of l_t; with
// magnitudes, every term's absolute value instead (TokenTerms::d_q_abs,
// d_logp_abs): a bound on |c_t| that no cancellation shrinks.
std::vector<double> logp_coefficients(const Problem& pb, const Forward& f, bool magnitudes) {
  const std::int64_t n = pb.batch * pb.seq_len;
  const auto d_logp = [&](std::int64_t t) { return magnitudes ? f.terms[t].d_logp_abs : f.terms[t].d_logp; };
  const auto d_q = [&](std::int64_t t) { return magnitudes ? f.terms[t].d_q_abs : f.terms[t].d_q; };
  const auto dq_dlogp = [&](std::int64_t t) { return magnitudes ? std::abs(f.dq_dlogp[t]) : f.dq_dlogp[t]; };
  std::vector<double> c(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (f.valid[t]) c[t] = f.weight[t] * d_logp(t);
  }
  if (pb.config.importance_sampling_level == IsLevel::token) {
    for (std::int64_t t = 0; t < n; ++t) {
      if (f.valid[t]) c[t] += f.weight[t] * d_q(t) * dq_dlogp(t);
    }
  } else {
    // q_i is shared by the sequence: every token's dl/dq flows back to every
    // token's logp, each with weight dq_i/dlogp_t = 1/|o_i| (0 when clamped).
    for (std::int64_t i = 0; i < pb.batch; ++i) {
      double d_loss_d_q = 0.0;
      for (std::int64_t u = i * pb.seq_len; u < (i + 1) * pb.seq_len; ++u) {
        if (f.valid[u]) d_loss_d_q += f.weight[u] * d_q(u);
      }
      for (std::int64_t t = i * pb.seq_len; t < (i + 1) * pb.seq_len; ++t) {
        if (f.valid[t]) c[t] += dq_dlogp(t) * d_loss_d_q;
      }
    }
  }
  if (magnitudes) {
    for (double& x : c) x = std::abs(x);
  }
  return c;
}

}  // namespace

long double linear_quantile(std::vector<long double> values, long double q) {
  require(!values.empty(), "quantile of no values");
  std::sort(values.begin(), values.end());
  const long double rank = q * static_cast<long double>(values.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(rank));
  const auto above = static_cast<std::size_t>(std::ceil(rank));
  return values[below] + (values[above] - values[below]) * (rank - static_cast<long double>(below));
}

double loss_only(const Problem& problem) { return forward(problem).loss; }

Result evaluate(const Problem& pb) {
  const Forward f = forward(pb);
  const std::int64_t n = pb.batch * pb.seq_len;
  const auto un = static_cast<std::size_t>(n);
  Result res;
  res.loss = f.loss;
  res.num_valid = f.num_valid;
  res.logp.resize(un);
  res.entropy.resize(un);
  res.kl.assign(un, 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    res.logp[t] = f.rows[t].logp;
    res.entropy[t] = f.rows[t].entropy;
    if (f.valid[t]) res.kl[t] = f.terms[t].kl;  // already 0 when beta == 0
  }

  // dlogp_t/dz'_v = ([v == y_t] - p_v) / tau in both temperature conventions;
  // dEnt_t/dz'_v = -p_v (x_v - E_p[x]) dx/dz' (1/tau, or 1 under
  // temperature_on_logp); then dz'/dz of the logit transform.
  const std::vector<double> c = logp_coefficients(pb, f, false);
  const double tau = pb.config.temperature;
  const double dx_dz = pb.config.temperature_on_logp ? 1.0 : 1.0 / tau;
  res.dloss_dlogp = c;
  res.dloss_dlogp_scale = logp_coefficients(pb, f, true);
  res.dloss_dentropy = f.entropy_weight;
  res.dlogits.assign(un * static_cast<std::size_t>(pb.vocab), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    const double b = f.entropy_weight[t];
    if (!f.valid[t] || (c[t] == 0.0 && b == 0.0)) continue;  // exact zeros, as the fast paths may skip
    const double scale = c[t] / tau;
    const RowSoftmax& row = f.rows[t];
    for (std::int64_t v = 0; v < pb.vocab; ++v) {
      const double onehot = v == pb.ids[t] ? 1.0 : 0.0;
      const double d_entropy = -row.p[v] * row.centered[v] * dx_dz;
      res.dlogits[t * pb.vocab + v] = (scale * (onehot - row.p[v]) + b * d_entropy) * row.chain[v];
    }
  }

  // Metrics as TRL logs them: masked means over valid rows; the ratio is the
  // clamped exp(q). cispo counts TRL's cispo_clip_ratio (r > eps_high, A > 0)
  // as high and region. Sequence-level IS with [B] advantages: one ratio per
  // sequence, and the clip ratios are fractions of the B sequences.
  const bool cispo = pb.config.loss_type == LossType::cispo;
  const double lo = 1.0 - static_cast<double>(pb.config.epsilon_low);
  const double hi =
      cispo ? static_cast<double>(pb.config.epsilon_high) : 1.0 + static_cast<double>(pb.config.epsilon_high);
  const bool per_sequence = pb.config.importance_sampling_level == IsLevel::sequence &&
                            pb.advantages.size() == static_cast<std::size_t>(pb.batch);
  double low = 0.0, high = 0.0, region = 0.0, kl = 0.0, entropy = 0.0;
  auto count_clip = [&](double r, double a) {
    if (pb.config.loss_type == LossType::vespo) return;  // TRL logs no clip ratio for vespo
    const bool is_low = !cispo && r < lo && a < 0.0;
    const bool is_high = r > hi && a > 0.0;
    low += is_low ? 1.0 : 0.0;
    high += is_high ? 1.0 : 0.0;
    region += is_low || is_high ? 1.0 : 0.0;
  };
  for (std::int64_t t = 0; t < n; ++t) {
    // The sequence's ratio: q of any of its tokens (masked ones included).
    if (per_sequence && t % pb.seq_len == 0) count_clip(std::exp(f.q[t]), pb.advantages[t / pb.seq_len]);
    if (!f.valid[t]) continue;
    if (!per_sequence) count_clip(std::exp(f.q[t]), per_row(pb.advantages, pb, t, 0.0));
    kl += res.kl[t];
    entropy += res.entropy[t];
  }
  const double count = static_cast<double>(std::max<std::int64_t>(f.num_valid, 1));
  const double clip_count = per_sequence ? static_cast<double>(pb.batch) : count;
  res.clip_ratio_low = low / clip_count;
  res.clip_ratio_high = high / clip_count;
  res.clip_ratio_region = region / clip_count;
  res.kl_mean = kl / count;
  res.entropy_mean = entropy / count;
  return res;
}

std::vector<double> lm_head_logits(const LmHeadProblem& pb) {
  const std::int64_t n = pb.head.batch * pb.head.seq_len;
  const std::int64_t vocab = pb.head.vocab;
  const std::int64_t h = pb.hidden_size;
  require(pb.hidden.size() == static_cast<std::size_t>(n * h), "hidden size");
  require(pb.weight.size() == static_cast<std::size_t>(vocab * h), "weight size");
  require(pb.bias.empty() || pb.bias.size() == static_cast<std::size_t>(vocab), "bias size");
  std::vector<double> logits(static_cast<std::size_t>(n * vocab));
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t v = 0; v < vocab; ++v) {
      long double acc = pb.bias.empty() ? 0.0L : pb.bias[v];
      for (std::int64_t k = 0; k < h; ++k) {
        acc += static_cast<long double>(pb.hidden[t * h + k]) * pb.weight[v * h + k];
      }
      logits[t * vocab + v] = static_cast<double>(acc);
    }
  }
  return logits;
}

void lm_head_chain(const LmHeadProblem& pb, const std::vector<double>& dz, std::vector<double>& dhidden,
                   std::vector<double>& dweight, std::vector<double>& dbias) {
  const std::int64_t n = pb.head.batch * pb.head.seq_len;
  const std::int64_t vocab = pb.head.vocab;
  const std::int64_t h = pb.hidden_size;
  require(dz.size() == static_cast<std::size_t>(n * vocab), "dlogits size");
  // z = h W^T + b: dh = dz W, dW = dz^T h, db = column sums of dz.
  dhidden.assign(static_cast<std::size_t>(n * h), 0.0);
  dweight.assign(static_cast<std::size_t>(vocab * h), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t k = 0; k < h; ++k) {
      long double acc = 0.0L;
      for (std::int64_t v = 0; v < vocab; ++v) {
        acc += static_cast<long double>(dz[t * vocab + v]) * pb.weight[v * h + k];
      }
      dhidden[t * h + k] = static_cast<double>(acc);
    }
  }
  for (std::int64_t v = 0; v < vocab; ++v) {
    for (std::int64_t k = 0; k < h; ++k) {
      long double acc = 0.0L;
      for (std::int64_t t = 0; t < n; ++t) {
        acc += static_cast<long double>(dz[t * vocab + v]) * pb.hidden[t * h + k];
      }
      dweight[v * h + k] = static_cast<double>(acc);
    }
  }
  dbias.clear();
  if (!pb.bias.empty()) {
    dbias.assign(static_cast<std::size_t>(vocab), 0.0);
    for (std::int64_t v = 0; v < vocab; ++v) {
      long double acc = 0.0L;
      for (std::int64_t t = 0; t < n; ++t) acc += dz[t * vocab + v];
      dbias[v] = static_cast<double>(acc);
    }
  }
}

LmHeadResult evaluate_lm_head(const LmHeadProblem& pb) {
  Problem head = pb.head;
  head.logits = lm_head_logits(pb);
  LmHeadResult res;
  res.head = evaluate(head);
  lm_head_chain(pb, res.head.dlogits, res.dhidden, res.dweight, res.dbias);
  return res;
}

}  // namespace grpo::oracle
