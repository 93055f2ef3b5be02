// The generic log-prob head in double: full logits, one softmax per row in
// long double, the upstream gradients pushed back through logp and entropy,
// then the LM head's chain rule. Nothing shared with src/.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "oracle/oracle.hpp"

namespace grpo::oracle {
namespace {

void require(bool condition, const std::string& what) {
  if (!condition) throw std::invalid_argument("grpo::oracle (log-prob head): " + what);
}

bool row_valid(const LogProbProblem& pb, std::int64_t t) {
  const std::vector<double>& mask = pb.lm.head.mask;
  return mask.empty() || mask[static_cast<std::size_t>(t)] != 0.0;
}

}  // namespace

LogProbResult evaluate_log_prob_head(const LogProbProblem& pb) {
  const Problem& head = pb.lm.head;
  const std::int64_t n = head.batch * head.seq_len;
  const std::int64_t vocab = head.vocab;
  const auto un = static_cast<std::size_t>(n);
  require(n > 0 && vocab > 0, "empty shape");
  require(head.ids.size() == un, "ids size");
  require(head.mask.empty() || head.mask.size() == un, "mask size");
  require(pb.dlogp.size() == un, "dlogp size");
  require(pb.dentropy.empty() || pb.dentropy.size() == un, "dentropy size");
  require(head.config.temperature > 0.0F, "temperature");
  const std::vector<double> logits = lm_head_logits(pb.lm);
  const long double tau = head.config.temperature;
  const bool on_logp = head.config.temperature_on_logp;
  // x = z / tau (default) or z (temperature_on_logp); logp = (x_y - LSE(x)) * post.
  const long double scale = on_logp ? 1.0L : 1.0L / tau;
  const long double post = on_logp ? 1.0L / tau : 1.0L;

  LogProbResult res;
  res.logp.assign(un, 0.0);
  res.entropy.assign(un, 0.0);
  res.dlogits.assign(un * static_cast<std::size_t>(vocab), 0.0);
  std::vector<long double> x(static_cast<std::size_t>(vocab));
  std::vector<long double> p(static_cast<std::size_t>(vocab));
  std::vector<long double> chain(static_cast<std::size_t>(vocab));  // dz'/dz of the logit transform
  for (std::int64_t t = 0; t < n; ++t) {
    const bool valid = row_valid(pb, t);
    long double max_x = -std::numeric_limits<long double>::infinity();
    for (std::int64_t v = 0; v < vocab; ++v) {
      const TransformedLogit zt =
          transform_logit(logits[t * vocab + v], head.config.logit_softcap, head.config.logit_scale);
      x[v] = zt.value * scale;
      chain[v] = zt.chain;
      max_x = std::max(max_x, x[v]);
    }
    long double sum = 0.0L;
    for (std::int64_t v = 0; v < vocab; ++v) sum += std::exp(x[v] - max_x);
    const long double log_sum = std::log(sum);
    // E_p[x] - max_x, p_v = 0 terms skipped (x_v = -inf).
    long double mean_shifted = 0.0L;
    for (std::int64_t v = 0; v < vocab; ++v) {
      p[v] = std::exp(x[v] - max_x) / sum;
      if (p[v] > 0.0L) mean_shifted += p[v] * (x[v] - max_x);
    }
    res.entropy[t] = static_cast<double>(log_sum - mean_shifted);
    if (!valid) continue;  // logp 0, upstream ignored, id never read
    const std::int32_t id = head.ids[static_cast<std::size_t>(t)];
    require(id >= 0 && id < vocab, "id out of range on a valid row");
    res.logp[t] = static_cast<double>(((x[id] - max_x) - log_sum) * post);
    // dlogp/dz_v = (onehot - p_v) / tau in both conventions; dEnt/dx_v =
    // -p_v (x_v - E_p[x]) and dx/dz = scale.
    const long double a = static_cast<long double>(pb.dlogp[t]) / tau;
    const long double b = pb.dentropy.empty() ? 0.0L : static_cast<long double>(pb.dentropy[t]) * scale;
    for (std::int64_t v = 0; v < vocab; ++v) {
      const long double onehot = v == id ? 1.0L : 0.0L;
      const long double centered = p[v] > 0.0L ? (x[v] - max_x) - mean_shifted : 0.0L;
      res.dlogits[t * vocab + v] = static_cast<double>((a * (onehot - p[v]) - b * p[v] * centered) * chain[v]);
    }
  }
  lm_head_chain(pb.lm, res.dlogits, res.dhidden, res.dweight, res.dbias);
  return res;
}

double log_prob_objective(const LogProbProblem& pb) {
  const LogProbResult r = evaluate_log_prob_head(pb);
  long double total = 0.0L;
  for (std::size_t t = 0; t < r.logp.size(); ++t) {
    if (!row_valid(pb, static_cast<std::int64_t>(t))) continue;
    total += static_cast<long double>(pb.dlogp[t]) * r.logp[t];
    if (!pb.dentropy.empty()) total += static_cast<long double>(pb.dentropy[t]) * r.entropy[t];
  }
  return static_cast<double>(total);
}

}  // namespace grpo::oracle
