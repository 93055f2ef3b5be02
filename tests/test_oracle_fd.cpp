// Checks the oracle itself, since every fast path is judged against it:
// - its dlogits against central finite differences of its own loss, over the
//   whole configuration sweep on tiny shapes;
// - its LM-head gradients (dhidden, dweight, dbias) the same way;
// - a few closed-form cases worked out by hand.
//
// Finite-difference error budget. The central difference with step h has error
//   h^2 |f'''| / 6  (truncation)  +  eps_f / h  (rounding of the two loss values).
// Inputs are bounded (fd_support.hpp: |z| <= 3, r <= 3.4, |A| <= 2, isw <= 1.5,
// tau >= 0.7), so |f'''| stays O(10..100): three derivatives of softmax/logp
// bring at most ~2/tau^3 ~ 6, the policy term |A| isw r ~ 10, the aggregation
// weight <= 1. With h = 1e-5: truncation <= 1e-10 * 100 / 6 ~ 2e-9, rounding
// ~ 1e-15 (a few hundred double roundings of an O(1) loss) / 1e-5 = 1e-10.
// So we expect ~1e-9 absolute at worst (the loss and gradients are O(1)) and
// allow kFdTolerance = 1e-8, 5x that bound; the sweep's worst observed error is
// ~3e-10 (recorded as the worst_abs_error property). A real bug moves an entry
// by ~1e-4 or more (the smallest terms: beta = 0.04 times a KL, or p_v ~ 1e-2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "oracle/fd_support.hpp"
#include "oracle/oracle.hpp"

namespace grpo::oracle {
namespace {

using fd::CaseOptions;
using fd::IsWeightKind;

constexpr double kStep = 1e-5;
constexpr double kFdTolerance = 1e-8;
// A draw whose log ratio lies within this distance of a kink is redrawn. One
// FD step moves logp_t by at most h / tau = 1.4e-5 (|dlogp/dz| <= 1/tau), and
// q by no more, so 1e-3 keeps every stencil ~70 steps clear of the kink.
constexpr double kKinkMargin = 1e-3;
// Closed-form checks: a handful of double roundings of O(1) values.
constexpr double kExact = 1e-14;

std::string shape_of(const Problem& p) {
  return " B=" + std::to_string(p.batch) + " T=" + std::to_string(p.seq_len) + " V=" + std::to_string(p.vocab);
}

std::string where_of(const CaseOptions& o, const Problem& p, unsigned seed) {
  return o.describe() + shape_of(p) + " seed=" + std::to_string(seed);
}

// Case o's random problem from seed. Redraws come from the same stream, so the
// seed still reproduces the case. Called under ASSERT_NO_FATAL_FAILURE.
void draw_clear_of_kinks(const CaseOptions& o, unsigned seed, int max_redraws, Problem& p) {
  std::mt19937 rng(seed);
  p = fd::random_problem(o, rng);
  for (int redraw = 0; fd::near_kink(p, kKinkMargin); ++redraw) {
    ASSERT_LT(redraw, max_redraws) << o.describe() << " seed=" << seed;
    p = fd::random_problem(o, rng);
  }
}

enum class MaskedEntries : std::uint8_t { must_be_zero, skipped };

// Every valid row's dlogits against the central difference of the surrogate
// loss (kFdTolerance); worst keeps the largest gap. Called under
// ASSERT_NO_FATAL_FAILURE.
void check_dlogits_against_fd(const Problem& p, const Result& res, const std::string& where, MaskedEntries masked,
                              double& worst) {
  for (std::size_t k = 0; k < res.dlogits.size(); ++k) {
    if (p.mask[k / p.vocab] == 0.0) {
      if (masked == MaskedEntries::must_be_zero) ASSERT_EQ(res.dlogits[k], 0.0) << where << " masked entry " << k;
      continue;
    }
    const double fd = fd::surrogate_derivative(p, k, kStep);
    worst = std::max(worst, std::abs(fd - res.dlogits[k]));
    ASSERT_NEAR(res.dlogits[k], fd, kFdTolerance) << where << " entry " << k;
  }
}

// What a sweep of FD cases found: the largest |oracle - central difference|
// and how many cases passed.
struct FdTally {
  double worst = 0.0;
  std::int64_t cases = 0;
};

// One FD case: the problem drawn clear of kinks, the oracle's result (its loss
// finite) and its dlogits checked against central differences. Called under
// ASSERT_NO_FATAL_FAILURE.
struct FdCase {
  Problem p;
  Result res;
  std::string where;
};

void run_fd_case(const CaseOptions& o, unsigned seed, int max_redraws, MaskedEntries masked, FdTally& tally,
                 FdCase& out) {
  ASSERT_NO_FATAL_FAILURE(draw_clear_of_kinks(o, seed, max_redraws, out.p));
  out.where = where_of(o, out.p, seed);
  out.res = evaluate(out.p);
  ASSERT_TRUE(std::isfinite(out.res.loss)) << out.where;
  ASSERT_NO_FATAL_FAILURE(check_dlogits_against_fd(out.p, out.res, out.where, masked, tally.worst));
  ++tally.cases;
}

class OracleFd : public ::testing::TestWithParam<std::tuple<LossType, IsLevel>> {};

TEST_P(OracleFd, DlogitsMatchCentralDifferences) {
  const auto [type, level] = GetParam();
  const std::vector<CaseOptions> cases = fd::sweep(type, level);
  const auto seed_base = 10000U * (2U * static_cast<unsigned>(type) + static_cast<unsigned>(level));
  FdTally tally;
  std::int64_t valid_rows = 0, clipped_rows = 0, above_delta = 0;
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const CaseOptions& o = cases[c];
    const unsigned seed = seed_base + static_cast<unsigned>(c);
    FdCase fc;
    ASSERT_NO_FATAL_FAILURE(run_fd_case(o, seed, 100, MaskedEntries::must_be_zero, tally, fc));
    const auto& [p, res, where] = fc;
    ASSERT_EQ(loss_only(p), res.loss) << where;
    if (!o.with_old) {
      // On-policy equals "old = the current logp, as a constant", bit for bit.
      Problem frozen = p;
      frozen.old_logp = res.logp;
      ASSERT_EQ(evaluate(frozen).dlogits, res.dlogits) << where;
    }
    // Coverage of the branches the sweep claims to test.
    const std::vector<double> lr = fd::raw_log_ratios(p, res.logp);
    for (std::size_t t = 0; t < lr.size(); ++t) {
      const double a = p.advantages[p.advantages.size() == lr.size() ? t : t / p.seq_len];
      if (p.mask[t] != 0.0 && o.with_delta && a < 0.0 && lr[t] > std::log(1.6)) ++above_delta;
    }
    valid_rows += res.num_valid;
    clipped_rows += std::llround(res.clip_ratio_region * static_cast<double>(res.num_valid));
  }
  std::ostringstream worst_text;
  worst_text << std::scientific << tally.worst;
  RecordProperty("worst_abs_error", worst_text.str());
  EXPECT_GT(clipped_rows, valid_rows / 20) << "too few clipped tokens to exercise clipping";
  EXPECT_LT(clipped_rows, valid_rows / 2) << "too few unclipped tokens";
  EXPECT_GT(above_delta, 0) << "no token reached the delta cap";
}

INSTANTIATE_TEST_SUITE_P(OracleSweep, OracleFd,
                         ::testing::Combine(::testing::Values(LossType::grpo, LossType::bnpo, LossType::dr_grpo,
                                                              LossType::dapo, LossType::cispo, LossType::sapo),
                                            ::testing::Values(IsLevel::token, IsLevel::sequence)),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// The options of the current trainers (issue 8) under the same check: luspo,
// vespo (phi detached: pinned like cispo's ratio, see surrogate_derivative),
// the off-policy sequence mask (kept away from its threshold), dual-clip and
// the differentiable KL estimators k1, abs, k2. Each base is swept over both
// conventions, KL on/off, bias correction, advantages [B]/[N], old present or
// not, delta, every is_weight kind (vespo: none and [N]) and masking.
struct TrainerBase {
  LossType type;
  IsLevel level;
  KlEstimator kl;
  bool opsm;
  bool dual;

  CaseOptions on(CaseOptions o) const {
    o.kl_estimator = kl;
    o.off_policy_mask = opsm;
    o.dual_clip = dual;
    return o;
  }
};

TEST(OracleFdTrainerOptions, DlogitsMatchCentralDifferences) {
  using K = KlEstimator;
  const TrainerBase bases[] = {
      {LossType::luspo, IsLevel::sequence, K::k3, false, false},
      {LossType::luspo, IsLevel::sequence, K::k3, true, true},
      {LossType::vespo, IsLevel::token, K::k3, false, false},
      {LossType::vespo, IsLevel::token, K::k2, true, false},
      {LossType::grpo, IsLevel::token, K::k3, true, false},
      {LossType::grpo, IsLevel::sequence, K::k1, true, false},
      {LossType::cispo, IsLevel::token, K::abs, true, false},
      {LossType::sapo, IsLevel::token, K::k3, true, false},
      {LossType::grpo, IsLevel::token, K::abs, false, true},
      {LossType::dapo, IsLevel::token, K::k2, false, true},
      {LossType::bnpo, IsLevel::sequence, K::k1, false, true},
  };
  FdTally tally;
  std::int64_t dropped = 0, kept_negative = 0, dual_clipped = 0;
  for (std::size_t b = 0; b < std::size(bases); ++b) {
    const TrainerBase& base = bases[b];
    std::vector<CaseOptions> sweep = fd::sweep(base.type, base.level);
    for (std::size_t c = 0; c < sweep.size(); ++c) {
      const CaseOptions o = base.on(sweep[c]);
      if (o.tau == 1.0 && c % 2 == 0) continue;  // half of the tau = 1 points: the sweep is 11 bases wide
      if (base.type == LossType::vespo && o.is_weight == IsWeightKind::per_sequence) continue;  // refused
      const unsigned seed = 500000U + 1000U * static_cast<unsigned>(b) + static_cast<unsigned>(c);
      FdCase fc;
      ASSERT_NO_FATAL_FAILURE(run_fd_case(o, seed, 100, MaskedEntries::skipped, tally, fc));
      const auto& [p, res, where] = fc;
      // Coverage: sequences the mask drops and keeps, tokens on the -A c branch.
      const std::vector<double> lr = fd::raw_log_ratios(p, res.logp);
      for (std::int64_t i = 0; i < p.batch; ++i) {
        double shift = 0.0, count = 0.0;
        bool negative = false;
        for (std::int64_t t = i * p.seq_len; t < (i + 1) * p.seq_len; ++t) {
          if (p.mask[t] == 0.0) continue;
          shift += p.old_logp.empty() ? 0.0 : p.old_logp[t] - res.logp[t];
          count += 1.0;
          const double a = p.advantages[p.advantages.size() == lr.size() ? t : t / p.seq_len];
          negative = negative || a < 0.0;
          if (base.dual && a < 0.0 && lr[t] > std::log(fd::kDualClip)) ++dual_clipped;
        }
        if (base.opsm && negative && count > 0.0) {
          (shift / count > fd::kOffPolicyThreshold ? dropped : kept_negative) += 1;
        }
      }
    }
  }
  std::printf("trainer options FD: %lld cases, worst |oracle - central difference| = %.3g\n",
              static_cast<long long>(tally.cases), tally.worst);
  RecordProperty("worst_abs_error", std::to_string(tally.worst));
  EXPECT_GT(dropped, 0) << "the off-policy mask never dropped a sequence";
  EXPECT_GT(kept_negative, 0) << "the off-policy mask never kept a negative sequence";
  EXPECT_GT(dual_clipped, 0) << "no token reached the dual-clip cap";
}

// Entropy bonus, top-entropy mask, logit softcap and scale, over loss types
// and IS levels: the oracle's dlogits (bonus term, chain factor, mask) against
// central differences of its loss. The mask is piecewise constant (near_kink
// keeps draws away from its steps), so it must show no derivative of its own.
TEST(OracleFdTrainerOptions, EntropyBonusMaskAndSoftcapMatchCentralDifferences) {
  struct Base {
    LossType type;
    IsLevel level;
    double entropy_coef, rho, softcap, scale;

    CaseOptions on(CaseOptions o) const {
      o.entropy_coef = entropy_coef;
      o.top_entropy_quantile = rho;
      o.logit_softcap = softcap;
      o.logit_scale = scale;
      return o;
    }
  };
  const Base bases[] = {
      {LossType::grpo, IsLevel::token, 0.05, 1.0, 0.0, 1.0},   {LossType::dapo, IsLevel::token, -0.3, 0.45, 0.0, 1.0},
      {LossType::grpo, IsLevel::sequence, 0.2, 0.6, 0.0, 1.0}, {LossType::cispo, IsLevel::token, 0.1, 0.3, 2.5, 1.0},
      {LossType::bnpo, IsLevel::token, 0.0, 1.0, 2.0, 1.7},    {LossType::luspo, IsLevel::sequence, 0.0, 0.5, 0.0, 0.6},
      {LossType::vespo, IsLevel::token, 0.15, 0.8, 1.5, 1.3},  {LossType::sapo, IsLevel::token, 0.0, 1.0, 0.0, 1.3},
  };
  FdTally tally;
  std::int64_t masked_out = 0;
  for (std::size_t b = 0; b < std::size(bases); ++b) {
    const Base& base = bases[b];
    std::vector<CaseOptions> sweep = fd::sweep(base.type, base.level);
    for (std::size_t c = 0; c < sweep.size(); c += 5) {  // every 5th point: 8 bases x ~150 cases
      const CaseOptions o = base.on(sweep[c]);
      if (base.type == LossType::vespo && o.is_weight == IsWeightKind::per_sequence) continue;  // refused
      const unsigned seed = 700000U + 1000U * static_cast<unsigned>(b) + static_cast<unsigned>(c);
      FdCase fc;
      ASSERT_NO_FATAL_FAILURE(run_fd_case(o, seed, 200, MaskedEntries::skipped, tally, fc));
      const auto& [p, res, where] = fc;
      // Coverage: the mask removed some valid row's policy term.
      if (base.rho < 1.0) {
        std::vector<long double> valid;
        for (std::size_t t = 0; t < res.entropy.size(); ++t) {
          if (p.mask[t] != 0.0) valid.push_back(res.entropy[t]);
        }
        if (valid.size() > 1) {
          const long double q = linear_quantile(valid, 1.0L - base.rho);
          for (const long double e : valid) masked_out += e < q ? 1 : 0;
        }
      }
    }
  }
  std::printf("entropy bonus / mask / softcap FD: %lld cases, worst |oracle - central difference| = %.3g\n",
              static_cast<long long>(tally.cases), tally.worst);
  RecordProperty("worst_abs_error", std::to_string(tally.worst));
  EXPECT_GT(masked_out, 0) << "the top-entropy mask never masked a token";
}

// The LM head on top: finite differences in hidden, weight and bias entries.
// One entry moves a whole logits row (or column) by h * |W| or h * |h| <= h,
// so the same step, margin and tolerance apply.
TEST(OracleFdLmHead, GradientsMatchCentralDifferences) {
  std::vector<CaseOptions> configs(4);
  configs[3].loss_type = LossType::grpo;  // entropy bonus through a softcap with a scale
  configs[3].entropy_coef = 0.2;
  configs[3].logit_softcap = 1.5;
  configs[3].logit_scale = 1.4;
  configs[0].beta = 0.04;
  configs[0].with_mask = true;
  configs[1].loss_type = LossType::dapo;
  configs[1].level = IsLevel::sequence;
  configs[1].beta = 0.04;
  configs[1].kl_bias_correction = true;
  configs[1].is_weight = IsWeightKind::per_token;
  configs[2].loss_type = LossType::sapo;
  configs[2].temperature_on_logp = true;
  configs[2].tau = 0.7;
  configs[2].per_token_advantages = true;
  for (std::size_t c = 0; c < configs.size(); ++c) {
    const unsigned seed = 777U + static_cast<unsigned>(c);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    LmHeadProblem lp;
    lp.head.batch = 2;
    lp.head.seq_len = 3;
    lp.head.vocab = 5;
    lp.hidden_size = 4;
    do {
      lp.hidden.assign(6 * 4, 0.0);
      lp.weight.assign(5 * 4, 0.0);
      lp.bias.assign(5, 0.0);
      for (double& x : lp.hidden) x = unit(rng);
      for (double& x : lp.weight) x = unit(rng);
      for (double& x : lp.bias) x = 0.5 * unit(rng);
      Problem head;
      head.batch = 2;
      head.seq_len = 3;
      head.vocab = 5;
      head.logits = lm_head_logits(lp);
      fd::fill_inputs(head, configs[c], rng);
      lp.head = head;
    } while (fd::near_kink(lp.head, kKinkMargin));
    const std::string where = configs[c].describe() + " seed=" + std::to_string(seed);

    const LmHeadResult res = evaluate_lm_head(lp);
    EXPECT_EQ(res.head.dlogits, evaluate(lp.head).dlogits) << where;
    const auto loss = [&] {
      Problem head = lp.head;
      head.logits = lm_head_logits(lp);
      return loss_only(head);
    };
    const auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* name) {
      ASSERT_EQ(x.size(), grad.size()) << where << " " << name;
      for (std::size_t k = 0; k < x.size(); ++k) {
        EXPECT_NEAR(grad[k], fd::central_difference(loss, x, k, kStep), kFdTolerance)
            << where << " d" << name << "[" << k << "]";
      }
    };
    check(lp.hidden, res.dhidden, "hidden");
    check(lp.weight, res.dweight, "weight");
    check(lp.bias, res.dbias, "bias");
  }
}

// The generic log-prob head: gradients of L = sum_t dlogp_t logp_t +
// dentropy_t Ent_t (masked rows excluded) in hidden, weight and bias entries.
// L is smooth (no kinks) and its inputs are bounded as above (|z| <~ 3, |g|,
// |h| <= 1, tau >= 0.7): the same step and tolerance apply. Sweep: both
// temperature conventions, tau 0.7 and 1, mask on/off, entropy upstream on/off,
// rows with zero upstream.
TEST(OracleFdLogProbHead, GradientsMatchCentralDifferences) {
  double worst = 0.0;
  int seed_index = 0;
  for (int conv = 0; conv < 2; ++conv) {
    for (const double tau : {0.7, 1.0}) {
      for (int mask = 0; mask < 2; ++mask) {
        for (int with_entropy = 0; with_entropy < 2; ++with_entropy) {
          const int transform = seed_index % 3;  // none, softcap 1.5 with scale 1.3, scale 0.8
          const unsigned seed = 9100U + static_cast<unsigned>(seed_index++);
          std::mt19937 rng(seed);
          std::uniform_real_distribution<double> unit(-1.0, 1.0);
          LogProbProblem pb;
          LmHeadProblem& lp = pb.lm;
          lp.head.batch = 2;
          lp.head.seq_len = 3;
          lp.head.vocab = 5;
          lp.hidden_size = 4;
          lp.head.config.temperature = static_cast<float>(tau);
          lp.head.config.temperature_on_logp = conv == 1;
          if (transform == 1) lp.head.config.logit_softcap = 1.5F;
          if (transform != 0) lp.head.config.logit_scale = transform == 1 ? 1.3F : 0.8F;
          lp.hidden.resize(6 * 4);
          lp.weight.resize(5 * 4);
          lp.bias.resize(5);
          for (double& x : lp.hidden) x = unit(rng);
          for (double& x : lp.weight) x = unit(rng);
          for (double& x : lp.bias) x = 0.5 * unit(rng);
          lp.head.ids.resize(6);
          for (std::int32_t& id : lp.head.ids) id = static_cast<std::int32_t>(rng() % 5);
          if (mask == 1) lp.head.mask = {1.0, 0.0, 1.0, 1.0, 0.0, 1.0};
          pb.dlogp.resize(6);
          for (double& g : pb.dlogp) g = unit(rng);
          pb.dlogp[3] = 0.0;  // a row with zero upstream (both, when entropy is on)
          if (with_entropy == 1) {
            pb.dentropy.resize(6);
            for (double& h : pb.dentropy) h = unit(rng);
            pb.dentropy[3] = 0.0;
            pb.dentropy[2] = 0.0;  // logp only
            pb.dlogp[5] = 0.0;     // entropy only
          }
          std::ostringstream where;
          where << "on_logp=" << conv << " tau=" << tau << " mask=" << mask << " entropy=" << with_entropy
                << " transform=" << transform << " seed=" << seed;
          const LogProbResult res = evaluate_log_prob_head(pb);
          const auto objective = [&] { return log_prob_objective(pb); };
          const auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* name) {
            ASSERT_EQ(x.size(), grad.size()) << where.str() << " " << name;
            for (std::size_t k = 0; k < x.size(); ++k) {
              const double fd = fd::central_difference(objective, x, k, kStep);
              worst = std::max(worst, std::abs(fd - grad[k]));
              EXPECT_NEAR(grad[k], fd, kFdTolerance) << where.str() << " d" << name << "[" << k << "]";
            }
          };
          check(lp.hidden, res.dhidden, "hidden");
          check(lp.weight, res.dweight, "weight");
          check(lp.bias, res.dbias, "bias");
          // The same rows through the GRPO oracle: logp and entropy agree.
          Problem head = lp.head;
          head.logits = lm_head_logits(lp);
          if (head.mask.empty()) head.mask.assign(6, 1.0);
          head.advantages = {1.0, -1.0};
          const Result grpo = evaluate(head);
          for (std::size_t t = 0; t < 6; ++t) {
            EXPECT_NEAR(res.logp[t], grpo.logp[t], kExact) << where.str() << " logp row " << t;
            EXPECT_NEAR(res.entropy[t], grpo.entropy[t], kExact) << where.str() << " entropy row " << t;
          }
        }
      }
    }
  }
  RecordProperty("worst_abs_error", std::to_string(worst));
  std::printf("log-prob head FD: worst |oracle - central difference| = %.3g\n", worst);
}

// --- Closed-form cases -------------------------------------------------------

Problem one_row(std::vector<double> logits, std::int32_t id, LossConfig config) {
  Problem p;
  p.batch = 1;
  p.seq_len = 1;
  p.vocab = static_cast<std::int64_t>(logits.size());
  p.logits = std::move(logits);
  p.ids = {id};
  p.mask = {1.0};
  p.advantages = {1.0};
  p.config = config;
  return p;
}

// V = 2, equal logits, on-policy grpo, A = 1: p = (1/2, 1/2), r = 1 unclipped,
// l = -1 with w = 1, c = -A r = -1, dz = c / tau * (onehot - 1/2).
TEST(OracleClosedForm, UniformTwoTokensOnPolicy) {
  for (const bool on_logp : {false, true}) {
    LossConfig config;
    config.temperature = 0.7F;
    config.temperature_on_logp = on_logp;
    const Result r = evaluate(one_row({3.0, 3.0}, 1, config));
    const double tau = config.temperature;
    // logp = -log 2 with x = z / tau; (z_y - LSE(z)) / tau = -log 2 / tau otherwise.
    EXPECT_NEAR(r.logp[0], on_logp ? -std::log(2.0) / tau : -std::log(2.0), kExact);
    EXPECT_NEAR(r.entropy[0], std::log(2.0), kExact);
    EXPECT_NEAR(r.entropy_mean, std::log(2.0), kExact);
    EXPECT_NEAR(r.loss, -1.0, kExact);
    EXPECT_NEAR(r.dlogits[0], 0.5 / tau, kExact);
    EXPECT_NEAR(r.dlogits[1], -0.5 / tau, kExact);
    EXPECT_EQ(r.num_valid, 1);
    EXPECT_EQ(r.clip_ratio_region, 0.0);
  }
}

// r = e^{+0.5} > 1 + eps_high with A > 0, and r = e^{-0.5} < 1 - eps_low with
// A < 0: both clipped, so the loss is the constant clip edge times A and the
// gradient is exactly zero.
TEST(OracleClosedForm, ClippedTokenHasZeroGradient) {
  for (const double a : {1.0, -1.0}) {
    Problem p = one_row({0.3, -1.2, 2.0}, 2, LossConfig{});
    p.advantages = {a};
    p.old_logp = {evaluate(p).logp[0] - 0.5 * a};
    const Result r = evaluate(p);
    const double edge = a > 0.0 ? 1.0 + double{0.2F} : 1.0 - double{0.2F};
    EXPECT_NEAR(r.loss, -edge * a, kExact);
    EXPECT_EQ(r.dlogits, std::vector<double>(3, 0.0));
    EXPECT_EQ(r.clip_ratio_high, a > 0.0 ? 1.0 : 0.0);
    EXPECT_EQ(r.clip_ratio_low, a > 0.0 ? 0.0 : 1.0);
    EXPECT_EQ(r.clip_ratio_region, 1.0);
  }
}

// log r = 25 is clamped to 20: the forward uses e^20, the gradient through q is 0.
TEST(OracleClosedForm, ClampedLogRatioStopsTheRatioGradient) {
  for (const LossType type : {LossType::grpo, LossType::sapo}) {
    LossConfig config;
    config.loss_type = type;
    Problem p = one_row({0.3, -1.2, 2.0}, 0, config);
    p.advantages = {-1.0};  // A < 0 and r huge: the grpo branch is unclipped
    p.old_logp = {evaluate(p).logp[0] - 25.0};
    const Result r = evaluate(p);
    if (type == LossType::grpo) {
      EXPECT_NEAR(r.loss, std::exp(20.0), 1e-15 * std::exp(20.0));  // a few ulps of e^20
    }
    EXPECT_EQ(r.dlogits, std::vector<double>(3, 0.0)) << to_string(type);
  }
}

// Every aggregation on the same per-token losses: on-policy grpo-family with
// A = 1 gives l = -1 on each valid token. Mask {1,1,0 | 1,0,0}: |o| = (2, 1).
TEST(OracleClosedForm, AggregationNormalizers) {
  const std::vector<std::pair<LossType, double>> expected = {
      {LossType::grpo, -(2.0 / 2.0 + 1.0 / 1.0) / 2.0},  // per-sequence means, over B
      {LossType::bnpo, -3.0 / 3.0},                      // over all valid tokens
      {LossType::dr_grpo, -3.0 / (2.0 * 4.0)},           // over B * max_completion_length
      {LossType::dapo, -3.0 / 6.0},                      // over num_items_in_batch
      {LossType::sapo, -2.0},                            // r = 1: sig = 1/2, l = -A (4/k) / 2 = -2 (k = 1), grpo means
  };
  for (const IsLevel level : {IsLevel::token, IsLevel::sequence}) {
    for (const auto& [type, loss] : expected) {
      Problem p;
      p.batch = 2;
      p.seq_len = 3;
      p.vocab = 2;
      p.logits = {0.1, 0.4, -0.3, 0.2, 1.0, 1.0, 0.5, -0.5, 2.0, 0.0, 0.0, 0.0};
      p.ids = {0, 1, -5, 1, 99, 99};  // masked ids are garbage on purpose
      p.mask = {1, 1, 0, 1, 0, 0};
      p.advantages = {1.0, 1.0};
      p.config.loss_type = type;
      p.config.importance_sampling_level = level;
      p.config.max_completion_length = 4;
      p.config.num_items_in_batch = 6.0;
      EXPECT_NEAR(evaluate(p).loss, loss, kExact) << to_string(type) << to_string(level);
    }
  }
}

// k3 KL with ref = logp + log 2: KL = 2 - log 2 - 1, dKL/dlogp = 1 - 2 = -1.
// A = 0 leaves only the KL term; with bias correction at r = 1 the q path adds
// KL * r, so c = beta (-1 + 1 - log 2).
TEST(OracleClosedForm, KlTermAndBiasCorrection) {
  for (const bool bias : {false, true}) {
    LossConfig config;
    config.beta = 0.04F;
    config.kl_bias_correction = bias;
    Problem p = one_row({0.7, -0.4}, 0, config);
    p.advantages = {0.0};
    const Result base = evaluate([&] {
      Problem q = p;
      q.config.beta = 0.0F;
      return q;
    }());
    p.ref_logp = {base.logp[0] + std::log(2.0)};
    const Result r = evaluate(p);
    const double beta = config.beta, kl = 1.0 - std::log(2.0);
    const double c = bias ? beta * (-1.0 + kl) : -beta;
    const double prob0 = std::exp(base.logp[0]);
    EXPECT_NEAR(r.kl[0], kl, kExact);
    EXPECT_NEAR(r.kl_mean, kl, kExact);
    EXPECT_NEAR(r.loss, beta * kl, kExact);
    EXPECT_NEAR(r.dlogits[0], c * (1.0 - prob0), kExact) << "bias=" << bias;
    EXPECT_NEAR(r.dlogits[1], c * (0.0 - (1.0 - prob0)), kExact) << "bias=" << bias;
  }
}

// |z| ~ 1e4 and a banned (-inf) token: finite, and equal to the shifted row.
// p = (1, e^-1, 0) / (1 + e^-1) for z = (1e4, 1e4 - 1, -inf), tau = 1.
TEST(OracleClosedForm, LargeAndInfiniteLogits) {
  const double inf = std::numeric_limits<double>::infinity();
  const Result big = evaluate(one_row({1e4, 1e4 - 1.0, -inf}, 1, LossConfig{}));
  const Result small = evaluate(one_row({0.0, -1.0, -inf}, 1, LossConfig{}));
  const double z = 1.0 + std::exp(-1.0), p0 = 1.0 / z, p1 = std::exp(-1.0) / z;
  EXPECT_NEAR(big.logp[0], -1.0 - std::log(z), kExact);
  EXPECT_NEAR(big.entropy[0], -(p0 * std::log(p0) + p1 * std::log(p1)), kExact);
  EXPECT_EQ(big.dlogits[2], 0.0);
  for (std::size_t v = 0; v < 3; ++v) EXPECT_NEAR(big.dlogits[v], small.dlogits[v], kExact);
  EXPECT_NEAR(big.dlogits[1], -(1.0 - p1), kExact);  // c = -A r = -1, tau = 1
}

// An all-masked batch: nothing is valid, so loss, metrics, logp and dlogits are
// exactly 0 for every loss type; entropy is still reported per row.
TEST(OracleClosedForm, AllMaskedBatch) {
  for (const LossType type :
       {LossType::grpo, LossType::bnpo, LossType::dr_grpo, LossType::dapo, LossType::cispo, LossType::sapo}) {
    for (const IsLevel level : {IsLevel::token, IsLevel::sequence}) {
      CaseOptions o;
      o.loss_type = type;
      o.level = level;
      o.beta = 0.04;
      std::mt19937 rng(5);
      Problem p = fd::random_problem(o, rng);
      for (std::size_t t = 0; t < p.mask.size(); ++t) {
        p.mask[t] = 0.0;
        p.ids[t] = -1;
      }
      const Result r = evaluate(p);
      const std::string where = o.describe();
      EXPECT_EQ(r.loss, 0.0) << where;
      EXPECT_EQ(r.num_valid, 0) << where;
      EXPECT_EQ(r.dlogits, std::vector<double>(r.dlogits.size(), 0.0)) << where;
      EXPECT_EQ(r.logp, std::vector<double>(r.logp.size(), 0.0)) << where;
      EXPECT_EQ(r.kl, std::vector<double>(r.kl.size(), 0.0)) << where;
      EXPECT_EQ(r.clip_ratio_region + r.kl_mean + r.entropy_mean, 0.0) << where;
      for (const double e : r.entropy) EXPECT_TRUE(std::isfinite(e)) << where;
    }
  }
}

// Clip metrics with eps_low = 0.2 != eps_high = 0.28, so each edge is told
// apart: r = 0.75 is below 1 - eps_low but not below 1 - eps_high; r = 1.25 is
// above 1 + eps_low but not above 1 + eps_high. Six valid rows, one masked.
TEST(OracleClosedForm, ClipMetricsUseTheirOwnEdgeAndSign) {
  const std::vector<std::pair<double, double>> ratio_and_advantage = {
      {0.75, -1.0},  // low
      {1.25, 1.0},   // neither (inside 1 + eps_high)
      {1.3, 1.0},    // high
      {0.7, 1.0},    // neither: low side needs A < 0
      {1.5, -1.0},   // neither: high side needs A > 0
      {1.0, 1.0},    // neither
      {9.0, 1.0},    // masked: not counted
  };
  Problem p;
  p.batch = 1;
  p.seq_len = 7;
  p.vocab = 2;
  p.config.epsilon_high = 0.28F;
  for (const auto& [ratio, a] : ratio_and_advantage) {
    p.logits.insert(p.logits.end(), {0.4, -0.1});
    p.ids.push_back(0);
    p.mask.push_back(ratio == 9.0 ? 0.0 : 1.0);
    p.advantages.push_back(a);
  }
  const std::vector<double> logp = evaluate(p).logp;
  for (std::size_t t = 0; t < logp.size(); ++t) {
    p.old_logp.push_back(logp[t] - std::log(ratio_and_advantage[t].first));
  }
  const Result r = evaluate(p);
  EXPECT_EQ(r.num_valid, 6);
  EXPECT_NEAR(r.clip_ratio_low, 1.0 / 6.0, kExact);
  EXPECT_NEAR(r.clip_ratio_high, 1.0 / 6.0, kExact);
  EXPECT_NEAR(r.clip_ratio_region, 2.0 / 6.0, kExact);
}

// GSPO: the sequence ratio is the masked mean of the token log ratios. Mask
// {1, 1, 0}, log ratios {0.1, 0.3, junk}: q = 0.2, r = e^0.2 < 1.28 unclipped,
// A = 1, so l = -r on both valid tokens, loss = -r, and each valid token gets
// c = (1/|o|) * sum_u w_u (-A r) = -r / 2.
TEST(OracleClosedForm, SequenceRatioIsTheMaskedMean) {
  Problem p;
  p.batch = 1;
  p.seq_len = 3;
  p.vocab = 3;
  p.logits = {0.2, -0.5, 1.0, 0.0, 0.3, -0.3, 5.0, 5.0, 5.0};
  p.ids = {2, 0, -1};
  p.mask = {1, 1, 0};
  p.advantages = {1.0};
  p.config.importance_sampling_level = IsLevel::sequence;
  p.config.epsilon_high = 0.28F;
  const std::vector<double> logp = evaluate(p).logp;
  p.old_logp = {logp[0] - 0.1, logp[1] - 0.3, std::numeric_limits<double>::quiet_NaN()};
  const Result r = evaluate(p);
  const double ratio = std::exp(0.2);
  EXPECT_NEAR(r.loss, -ratio, kExact);
  for (std::size_t t = 0; t < 2; ++t) {
    for (std::int64_t v = 0; v < 3; ++v) {
      const double prob = std::exp(p.logits[t * 3 + v] - p.logits[t * 3 + p.ids[t]] + logp[t]);
      const double onehot = v == p.ids[t] ? 1.0 : 0.0;
      EXPECT_NEAR(r.dlogits[t * 3 + v], -ratio / 2.0 * (onehot - prob), kExact);
    }
  }
}

// A [B] tensor means the same as its [N] broadcast over each sequence.
TEST(OracleClosedForm, PerSequenceTensorsBroadcastOverTheirSequence) {
  for (const LossType type : {LossType::grpo, LossType::cispo, LossType::sapo}) {
    CaseOptions o;
    o.loss_type = type;
    o.is_weight = IsWeightKind::per_sequence;
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    Problem per_seq;  // B, T >= 2, so t / T and any other mapping differ
    per_seq.batch = 2;
    per_seq.seq_len = 3;
    per_seq.vocab = 4;
    for (int k = 0; k < 2 * 3 * 4; ++k) per_seq.logits.push_back(3.0 * unit(rng));
    fd::fill_inputs(per_seq, o, rng);
    Problem per_token = per_seq;
    per_token.advantages.clear();
    per_token.is_weight.clear();
    for (std::int64_t t = 0; t < per_seq.batch * per_seq.seq_len; ++t) {
      per_token.advantages.push_back(per_seq.advantages[t / per_seq.seq_len]);
      per_token.is_weight.push_back(per_seq.is_weight[t / per_seq.seq_len]);
    }
    const Result a = evaluate(per_seq), b = evaluate(per_token);
    EXPECT_EQ(a.loss, b.loss) << to_string(type);
    EXPECT_EQ(a.dlogits, b.dlogits) << to_string(type);
  }
}

// The straight-through KL variants: the forward value of their estimator, the
// gradient of k2 (so their dlogits equal k2's bit for bit without bias
// correction, and their loss equals their estimator's).
TEST(OracleClosedForm, KlPlusVariantsAreStraightThrough) {
  CaseOptions o;
  o.beta = 0.04;
  o.with_mask = true;
  std::mt19937 rng(4242);
  const Problem base = fd::random_problem(o, rng);
  const std::pair<KlEstimator, KlEstimator> pairs[] = {{KlEstimator::k1_plus, KlEstimator::k1},
                                                       {KlEstimator::abs_plus, KlEstimator::abs},
                                                       {KlEstimator::k3_plus, KlEstimator::k3}};
  Problem k2 = base;
  k2.config.kl_estimator = KlEstimator::k2;
  const Result want_grad = evaluate(k2);
  for (const auto& [plus, plain] : pairs) {
    Problem a = base, b = base;
    a.config.kl_estimator = plus;
    b.config.kl_estimator = plain;
    const Result ra = evaluate(a), rb = evaluate(b);
    EXPECT_EQ(ra.loss, rb.loss) << to_string(plus);
    EXPECT_EQ(ra.kl, rb.kl) << to_string(plus);
    EXPECT_EQ(ra.dlogits, want_grad.dlogits) << to_string(plus);
  }
}

// k1, abs, k2, k3 at d = logp - ref = -log 2 (ref = logp + log 2), hand values.
TEST(OracleClosedForm, KlEstimatorValues) {
  const double d = -std::log(2.0);
  const std::pair<KlEstimator, double> expected[] = {
      {KlEstimator::k1, d}, {KlEstimator::abs, -d}, {KlEstimator::k2, 0.5 * d * d}, {KlEstimator::k3, 2.0 + d - 1.0}};
  for (const auto& [e, value] : expected) {
    LossConfig config;
    config.beta = 1.0F;
    config.kl_estimator = e;
    const double logp = evaluate(one_row({0.3, -1.2, 2.0}, 1, LossConfig{})).logp[0];
    Problem p = one_row({0.3, -1.2, 2.0}, 1, config);
    p.advantages = {0.0};
    p.ref_logp = {logp - d};
    EXPECT_NEAR(evaluate(p).kl[0], value, kExact) << to_string(e);
  }
}

// vespo on one sequence, by hand: on-policy w = 1 gives phi = e^(lam - lam) = 1
// for both signs, so l = -A logp; with log w = 0.5 summed over two tokens
// (0.25 each) and A < 0: phi = exp(2 + 3 * 0.5 - 2 e^0.5).
TEST(OracleClosedForm, VespoGammaWeight) {
  LossConfig config;
  config.loss_type = LossType::vespo;
  config.num_items_in_batch = 2.0;
  Problem p;
  p.batch = 1;
  p.seq_len = 2;
  p.vocab = 3;
  p.logits = {0.3, -1.2, 2.0, 1.0, 0.0, -1.0};
  p.ids = {2, 0};
  p.mask = {1.0, 1.0};
  p.advantages = {-1.5};
  p.config = config;
  const Result on = evaluate(p);
  EXPECT_NEAR(on.loss, 1.5 * (on.logp[0] + on.logp[1]) / 2.0, kExact);
  p.old_logp = {on.logp[0] - 0.25, on.logp[1] - 0.25};
  const Result off = evaluate(p);
  const double phi = std::exp(2.0 + 3.0 * 0.5 - 2.0 * std::exp(0.5));
  EXPECT_NEAR(off.loss, phi * 1.5 * (on.logp[0] + on.logp[1]) / 2.0, 1e-13);
  EXPECT_EQ(off.clip_ratio_region, 0.0);
}

}  // namespace
}  // namespace grpo::oracle
