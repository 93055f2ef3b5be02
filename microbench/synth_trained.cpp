// Trained-like LM-head inputs (InputSpec::generator = trained_like): hidden
// states and a head weight whose logits z = W h have per-token entropies
// drawn from a range the config sets, a Zipf tail, and most of each row's
// mass on a few candidate ids that are often, not always, frequent ones.
// The chosen ids are drawn from each row's own distribution, as a policy's
// completions are.
//
// The construction, for W [V, H] (logical) and a row's h:
//   W[v, 0] = b_v = -zipf_exponent * log(1 + rank_v)   the unigram prior
//   W[v, k] ~ N(0, 1 / (H - 1)) for k >= 1              generic directions
//   h[0] = 1;  h[1:] = g + sum_j alpha_j W[c_j, 1:],    g ~ N(0, tail_noise^2)
// so every logit is b_v plus Gaussian noise of std s = |h[1:]| / sqrt(H - 1)
// ("the tail"), except the kCandidates ids c_j, whose logits are set exactly
// by solving the small Gram system for alpha. The row's entropy is then
//   H = h2(q) + q * H_cand + (1 - q) * H_tail(s)
// with q the candidates' mass: given a target H, the generator picks the
// candidates' shape (H_cand) and solves for q, using a table of the tail's
// log-mass and entropy against s measured once on the prior. Nothing of size
// [N, V] is ever built: a row costs O(kCandidates^2 * H).
//
// Where the prediction is off: the tail's mass for one row fluctuates around
// the table's mean (the prior's mass sits on ~100 effective ids), so a row's
// entropy lands near its target, not on it; measure_inputs (input_stats.hpp)
// reports what the rows really have.
#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "synth_internal.hpp"

namespace grpo::bench::detail {
namespace {

// Ids a row's mass concentrates on: a trained model's top-k. log(8) = 2.08
// nats is the most entropy they carry alone; the rest comes from the tail.
constexpr int kCandidates = 8;
// The tail table: s in [0, kTableMax] in kTableSteps steps, each the mean of
// kTableDraws noise draws over the whole vocabulary.
constexpr int kTableSteps = 80;
constexpr double kTableMax = 4.0;
constexpr int kTableDraws = 4;
// Chosen ids from the tail: a prior draw accepted with probability
// exp(noise - kNoiseCap * s) (noise above kNoiseCap sigma, p ~ 1e-3 per id,
// is accepted as if at the cap).
constexpr double kNoiseCap = 3.0;
// Fixed-point rounds between the tail's noise s and the boosts that set it.
constexpr int kRounds = 4;

double binary_entropy(double q) {
  if (q <= 0.0 || q >= 1.0) return 0.0;
  return -q * std::log(q) - (1.0 - q) * std::log1p(-q);
}

// Entropy of softmax(-gamma * log(1 + j)), j < kCandidates: gamma = 0 is
// uniform (log 8), large gamma puts everything on j = 0.
double candidate_entropy(double gamma, std::array<double, kCandidates>& d, double& log_sum) {
  double m = 0.0;
  for (int j = 0; j < kCandidates; ++j) d[j] = -gamma * std::log1p(j);
  double sum = 0.0, dot = 0.0;
  for (int j = 0; j < kCandidates; ++j) {
    const double e = std::exp(d[j] - m);
    sum += e;
    dot += e * d[j];
  }
  log_sum = std::log(sum);
  return log_sum - dot / sum;
}

// Tail log-mass and entropy against the noise std s, measured on the prior.
struct TailTable {
  std::vector<double> log_mass, entropy;
  std::pair<double, double> at(double s) const {
    const double x = std::clamp(s, 0.0, kTableMax) / kTableMax * kTableSteps;
    const int i = std::min(static_cast<int>(x), kTableSteps - 1);
    const double f = x - i;
    return {log_mass[i] + f * (log_mass[i + 1] - log_mass[i]), entropy[i] + f * (entropy[i + 1] - entropy[i])};
  }
};

TailTable tail_table(const std::vector<double>& prior, std::uint64_t seed, int threads) {
  const auto v = static_cast<std::int64_t>(prior.size());
  std::vector<float> noise(static_cast<std::size_t>(kTableDraws * v));
  for (int d = 0; d < kTableDraws; ++d) {
    const Stream g(seed, Tensor::background_table, static_cast<std::uint64_t>(d));
    for (std::int64_t i = 0; i < v; ++i) noise[d * v + i] = static_cast<float>(g.normal(static_cast<std::uint64_t>(i)));
  }
  TailTable t;
  t.log_mass.resize(kTableSteps + 1);
  t.entropy.resize(kTableSteps + 1);
  parallel_ranges(
      kTableSteps + 1, threads,
      [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) {
          const double s = kTableMax * static_cast<double>(i) / kTableSteps;
          double log_mass = 0.0, entropy = 0.0;
          for (int d = 0; d < kTableDraws; ++d) {
            // The prior is <= 0 and the noise below ~6 sigma: no overflow.
            double sum = 0.0, dot = 0.0;
            for (std::int64_t k = 0; k < v; ++k) {
              const double z = prior[k] + s * noise[d * v + k];
              const double ez = std::exp(z);
              sum += ez;
              dot += ez * z;
            }
            log_mass += std::log(sum);
            entropy += std::log(sum) - dot / sum;
          }
          t.log_mass[i] = log_mass / kTableDraws;
          t.entropy[i] = entropy / kTableDraws;
        }
      },
      1);
  return t;
}

// Per-token target entropies: uniform on [lo, hi], or a truncated exponential
// of the given mean (rate found by bisection; negative rates lean high).
std::vector<double> target_entropies(const InputSpec& in, std::int64_t n) {
  const double lo = in.entropy_min, w = in.entropy_max - in.entropy_min;
  double rate = 0.0;
  if (in.entropy_mean > 0.0) {
    const double want = in.entropy_mean - lo;
    auto mean_of = [&](double l) { return std::abs(l * w) < 1e-9 ? w / 2 : 1.0 / l - w / std::expm1(l * w); };
    double a = -200.0 / w, b = 200.0 / w;  // mean_of decreases in the rate
    for (int it = 0; it < 200; ++it) {
      const double mid = 0.5 * (a + b);
      (mean_of(mid) > want ? a : b) = mid;
    }
    rate = 0.5 * (a + b);
  }
  const Stream u(in.seed, Tensor::target_entropy);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) {
    const double x = u.uniform(static_cast<std::uint64_t>(r));
    out[r] = std::abs(rate * w) < 1e-9 ? lo + x * w : lo - std::log1p(-x * -std::expm1(-rate * w)) / rate;
  }
  return out;
}

// Solves G a = y in place for a symmetric positive definite k x k G (Cholesky).
void solve_spd(std::array<double, kCandidates * kCandidates> g, std::array<double, kCandidates>& y) {
  constexpr int k = kCandidates;
  for (int j = 0; j < k; ++j) {
    double d = g[j * k + j];
    for (int p = 0; p < j; ++p) d -= g[j * k + p] * g[j * k + p];
    if (!(d > 0.0)) throw std::runtime_error("trained_like: candidate directions are not independent");
    g[j * k + j] = std::sqrt(d);
    for (int i = j + 1; i < k; ++i) {
      double x = g[i * k + j];
      for (int p = 0; p < j; ++p) x -= g[i * k + p] * g[j * k + p];
      g[i * k + j] = x / g[j * k + j];
    }
  }
  for (int i = 0; i < k; ++i) {
    for (int p = 0; p < i; ++p) y[i] -= g[i * k + p] * y[p];
    y[i] /= g[i * k + i];
  }
  for (int i = k - 1; i >= 0; --i) {
    for (int p = i + 1; p < k; ++p) y[i] -= g[p * k + i] * y[p];
    y[i] /= g[i * k + i];
  }
}

// Draws ids from the prior: cdf over ids in rank order.
struct PriorSampler {
  std::vector<std::int64_t> by_rank;
  std::vector<double> cdf;
  std::int64_t draw(double u) const {
    const auto it = std::upper_bound(cdf.begin(), cdf.end(), u * cdf.back());
    return by_rank[std::min<std::size_t>(it - cdf.begin(), cdf.size() - 1)];
  }
};

}  // namespace

void fill_trained_like(const ProblemSpec& s, Problem& p) {
  const InputSpec& in = s.inputs;
  const std::int64_t n = s.shape.rows(), h = s.shape.hidden, v = s.shape.vocab;
  if (h < 64 || v < 8 * kCandidates) {
    throw std::invalid_argument(
        "inputs.generator trained_like needs hidden >= 64 and vocab >= " + std::to_string(8 * kCandidates) +
        " (shape has hidden " + std::to_string(h) + ", vocab " + std::to_string(v) + ")");
  }
  const bool vm = s.layout == WeightLayout::vocab_major;
  auto w_index = [&](std::int64_t tok, std::int64_t k) {
    return static_cast<std::size_t>(vm ? tok * h + k : k * v + tok);
  };

  // Frequency ranks: ids roughly in frequency order, as a BPE vocabulary's
  // merge order, shuffled by frequency_order_noise.
  std::vector<std::int64_t> by_rank(static_cast<std::size_t>(v));
  {
    const Stream o(in.seed, Tensor::frequency_order);
    std::vector<double> key(static_cast<std::size_t>(v));
    for (std::int64_t i = 0; i < v; ++i)
      key[i] = std::log1p(static_cast<double>(i)) + in.frequency_order_noise * o.normal(static_cast<std::uint64_t>(i));
    std::iota(by_rank.begin(), by_rank.end(), 0);
    std::stable_sort(by_rank.begin(), by_rank.end(), [&](auto a, auto b) { return key[a] < key[b]; });
  }
  std::vector<float> prior_value(static_cast<std::size_t>(v));
  for (std::int64_t r = 0; r < v; ++r)
    prior_value[by_rank[r]] = static_cast<float>(-in.zipf_exponent * std::log1p(static_cast<double>(r)));

  const std::size_t in_size = size_of(s.dtype);
  p.weight = HostBuffer(static_cast<std::size_t>(v * h) * in_size);
  const Stream w(in.seed, Tensor::weight);
  const double inv_sqrt = 1.0 / std::sqrt(static_cast<double>(h - 1));
  const auto w_scale = static_cast<float>(inv_sqrt);
  parallel_ranges(static_cast<std::size_t>(v * h), s.threads, [&](std::size_t b, std::size_t e) {
    for (std::size_t j = b; j < e; ++j) {
      // By the logical [V, H] index, so both layouts hold the same W.
      const std::size_t logical = vm ? j : (j % v) * h + j / v;
      const std::size_t tok = logical / h, k = logical % h;
      store(p.weight, s.dtype, j, k == 0 ? prior_value[tok] : w.approx_normal(logical) * w_scale);
    }
  });
  // Everything below uses the stored (rounded) values.
  auto weight_at = [&](std::int64_t tok, std::int64_t k) {
    return load_float(p.weight.data(), s.dtype, w_index(tok, k));
  };
  std::vector<double> prior(static_cast<std::size_t>(v));
  for (std::int64_t t = 0; t < v; ++t) prior[t] = weight_at(t, 0);
  const double prior_max = *std::max_element(prior.begin(), prior.end());
  for (double& b : prior) b -= prior_max;  // the table wants b <= 0; softmax does not see the shift

  PriorSampler sampler;
  sampler.by_rank = by_rank;
  sampler.cdf.resize(static_cast<std::size_t>(v));
  double acc = 0.0;
  for (std::int64_t r = 0; r < v; ++r) sampler.cdf[r] = acc += std::exp(prior[by_rank[r]]);
  const TailTable table = tail_table(prior, in.seed, s.threads);
  const std::vector<double> targets = target_entropies(in, n);
  const double var_w = inv_sqrt * inv_sqrt;  // per-entry variance of W[:, 1:]

  p.hidden = HostBuffer(static_cast<std::size_t>(n * h) * in_size);
  const Stream hz(in.seed, Tensor::hidden);
  parallel_ranges(
      static_cast<std::size_t>(n), s.threads,
      [&](std::size_t b, std::size_t e) {
        std::vector<double> g(h), row(h);
        std::vector<double> wc(static_cast<std::size_t>(kCandidates * h));
        for (std::size_t r = b; r < e; ++r) {
          // The candidates: distinct ids drawn from the prior, so mass sits
          // mostly, not only, on frequent ids.
          const Stream cs(in.seed, Tensor::candidates, r);
          std::array<std::int64_t, kCandidates> cand{};
          for (int j = 0, draw = 0; j < kCandidates; ++draw) {
            const std::int64_t id = sampler.draw(cs.uniform(static_cast<std::uint64_t>(draw)));
            if (std::find(cand.begin(), cand.begin() + j, id) == cand.begin() + j) cand[j++] = id;
          }
          // The candidates' own shape carries a share rho of the target.
          const double target = targets[r];
          const double rho = 0.2 + 0.6 * cs.uniform(1000);
          const double want_cand = std::min(rho * target, 0.9 * std::log(static_cast<double>(kCandidates)));
          std::array<double, kCandidates> d{};
          double log_d = 0.0, lo = 0.0, hi = 60.0;
          for (int it = 0; it < 60; ++it) {
            const double mid = 0.5 * (lo + hi);
            (candidate_entropy(mid, d, log_d) > want_cand ? lo : hi) = mid;
          }
          const double h_cand = candidate_entropy(hi, d, log_d);

          double norm_g = 0.0;
          for (std::int64_t k = 1; k < h; ++k) {
            g[k] = in.tail_noise * hz.normal(r * h + k);
            norm_g += g[k] * g[k];
          }
          std::array<double, kCandidates * kCandidates> gram{};
          std::array<double, kCandidates> cg{}, bc{};
          for (int j = 0; j < kCandidates; ++j) {
            double* c = &wc[static_cast<std::size_t>(j * h)];
            for (std::int64_t k = 0; k < h; ++k) c[k] = weight_at(cand[j], k);
            bc[j] = c[0];
            double dot = 0.0;
            for (std::int64_t k = 1; k < h; ++k) dot += c[k] * g[k];
            cg[j] = dot;
          }
          for (int i = 0; i < kCandidates; ++i) {
            for (int j = 0; j <= i; ++j) {
              double dot = 0.0;
              const double* a = &wc[static_cast<std::size_t>(i * h)];
              const double* c = &wc[static_cast<std::size_t>(j * h)];
              for (std::int64_t k = 1; k < h; ++k) dot += a[k] * c[k];
              gram[i * kCandidates + j] = gram[j * kCandidates + i] = dot;
            }
          }
          // Fixed point: the boosts raise |h|, hence the tail's noise s,
          // hence the tail's mass the boosts are measured against.
          double sd = std::sqrt(var_w * norm_g), q = 0.0;
          std::array<double, kCandidates> alpha{};
          for (int round = 0; round < kRounds; ++round) {
            const auto [log_mass, h_tail] = table.at(sd);
            // The candidates' own prior mass is not part of the tail.
            double cand_mass = 0.0;
            for (int j = 0; j < kCandidates; ++j) cand_mass += std::exp(bc[j] - prior_max + 0.5 * sd * sd);
            const double log_tail = std::log(std::max(std::exp(log_mass) - cand_mass, 0.1 * std::exp(log_mass)));
            // H(q) = h2(q) + q h_cand + (1 - q) h_tail falls from its maximum
            // at q0 to h_cand at q = 1.
            const double q0 = 1.0 / (1.0 + std::exp(h_tail - h_cand));
            auto entropy_at = [&](double x) { return binary_entropy(x) + x * h_cand + (1.0 - x) * h_tail; };
            if (entropy_at(q0) <= target) {
              q = q0;
            } else {
              double a = q0, c = 1.0;
              for (int it = 0; it < 100; ++it) {
                const double mid = 0.5 * (a + c);
                (entropy_at(mid) > target ? a : c) = mid;
              }
              q = 0.5 * (a + c);
            }
            const double m = std::log(q) - std::log1p(-q) - log_d;
            // Logits relative to the shifted prior: z_c = log_tail + m + d_j.
            for (int j = 0; j < kCandidates; ++j) alpha[j] = (log_tail + m + d[j] + prior_max) - bc[j] - cg[j];
            solve_spd(gram, alpha);
            double norm = norm_g;
            for (int i = 0; i < kCandidates; ++i) {
              norm += 2.0 * alpha[i] * cg[i];
              for (int j = 0; j < kCandidates; ++j) norm += alpha[i] * alpha[j] * gram[i * kCandidates + j];
            }
            sd = std::sqrt(var_w * std::max(norm, 0.0));
          }
          row[0] = 1.0;
          for (std::int64_t k = 1; k < h; ++k) {
            double x = g[k];
            for (int j = 0; j < kCandidates; ++j) x += alpha[j] * wc[static_cast<std::size_t>(j * h + k)];
            row[k] = x;
          }
          for (std::int64_t k = 0; k < h; ++k) store(p.hidden, s.dtype, r * h + k, static_cast<float>(row[k]));

          // The chosen id, from the row's own distribution: a candidate with
          // probability q (by their shape d), else a tail id (prior draw,
          // accepted by its noise).
          const Stream ch(in.seed, Tensor::chosen, r);
          std::int64_t chosen = cand[0];
          if (ch.uniform(0) < q) {
            double u = ch.uniform(1) * std::exp(log_d);
            for (int j = 0; j < kCandidates; ++j) {
              chosen = cand[j];
              if ((u -= std::exp(d[j])) <= 0.0) break;
            }
          } else {
            for (std::uint64_t attempt = 0; attempt < 1000; ++attempt) {
              const std::int64_t id = sampler.draw(ch.uniform(2 + 2 * attempt));
              if (std::find(cand.begin(), cand.end(), id) != cand.end()) continue;
              chosen = id;
              double noise = 0.0;
              for (std::int64_t k = 1; k < h; ++k) noise += weight_at(id, k) * row[k];
              if (ch.uniform(3 + 2 * attempt) < std::exp(noise - kNoiseCap * sd)) break;
            }
          }
          p.ids[r] = static_cast<std::int32_t>(chosen);
        }
      },
      16);
}

}  // namespace grpo::bench::detail
