// The logits-level kernel (and the unfused baseline) against the double oracle:
// every loss type, both IS levels, both temperature conventions, KL on/off,
// per-sequence and per-token advantages, masked rows, both dtypes, separate
// and in-place dlogits, shapes around the vector / segment edges and the real
// vocabulary size.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "test_support.hpp"

namespace grpo::test {
namespace {

struct LogitsCase {
  BatchSpec spec;
  DType dtype = DType::f32;
  bool in_place = false;
  bool baseline = false;
};

std::string case_name(const LogitsCase& c) {
  return describe(c.spec) + " dtype=" + to_string(c.dtype) + (c.in_place ? " in-place" : "") +
         (c.baseline ? " baseline" : " fused");
}

void PrintTo(const LogitsCase& c, std::ostream* os) { *os << case_name(c); }

struct RunResult {
  std::vector<float> logp, entropy, kl, dlogits;
  Metrics metrics;
};

RunResult run(const LogitsCase& c, const HostBatch& h) {
  const BatchSpec& s = c.spec;
  const std::int64_t n = s.batch * s.seq_len;
  const std::size_t count = static_cast<std::size_t>(n * s.vocab);
  // Logits in the tested dtype; an ld of V + 3 checks the row stride is honoured.
  const std::int64_t ld = s.vocab + 3;
  const std::size_t esize = size_of(c.dtype);
  std::vector<std::byte> logits(static_cast<std::size_t>(n * ld) * esize, std::byte{0x7f});
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t v = 0; v < s.vocab; ++v) {
      const auto z = static_cast<float>(h.problem.logits[r * s.vocab + v]);
      auto* at = logits.data() + static_cast<std::size_t>(r * ld + v) * esize;
      if (c.dtype == DType::f32) {
        std::memcpy(at, &z, 4);
      } else {
        const std::uint16_t b = kernels::float_to_bf16(z);
        std::memcpy(at, &b, 2);
      }
    }
  }
  RunResult out;
  out.logp.assign(n, -1.0F);
  out.entropy.assign(n, -1.0F);
  out.kl.assign(n, -1.0F);
  std::vector<std::byte> separate;
  MutMatrixView dl;
  if (c.in_place) {
    dl = {logits.data(), c.dtype, n, s.vocab, ld};
  } else {
    separate.assign(count * esize, std::byte{0x55});
    dl = {separate.data(), c.dtype, n, s.vocab, s.vocab};
  }
  LogitsShape shape{s.batch, s.seq_len, s.vocab, c.dtype};
  LogitsOutputs o{{out.logp, out.entropy, out.kl}, dl, &out.metrics};
  const MatrixView in{logits.data(), c.dtype, n, s.vocab, ld};
  if (c.baseline) {
    LogitsBaseline(shape, s.config).execute(in, h.view(), o);
  } else {
    LogitsLossPlan(shape, s.config).execute(in, h.view(), o);
  }
  out.dlogits.resize(count);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto* row = static_cast<const std::byte*>(dl.data) + static_cast<std::size_t>(r * dl.ld) * esize;
    const std::vector<float> f = to_float(row, c.dtype, static_cast<std::size_t>(s.vocab));
    std::copy(f.begin(), f.end(), out.dlogits.begin() + r * s.vocab);
  }
  return out;
}

class LogitsVsOracle : public ::testing::TestWithParam<LogitsCase> {};

TEST_P(LogitsVsOracle, MatchesOracle) {
  const LogitsCase& c = GetParam();
  const BatchSpec& s = c.spec;
  SCOPED_TRACE(case_name(c));
  std::mt19937 rng(s.seed);
  HostBatch h;
  h.problem.logits = make_logits(s, rng);
  if (c.dtype == DType::bf16) {
    // The oracle sees exactly the bf16 values the kernel reads.
    for (double& z : h.problem.logits) z = round_bf16(static_cast<float>(z));
  }
  fill_batch(s, h, rng);
  const oracle::Result want = oracle::evaluate(h.problem);
  const RunResult got = run(c, h);
  const std::int64_t n = s.batch * s.seq_len;
  const double tau = s.config.temperature;
  const double scale = s.config.temperature_on_logp ? 1.0 : 1.0 / tau;

  // Tolerances. The kernel works in f32 on exact inputs; x = z * scale rounds
  // with error eps|x|; the sum of V exponentials, accumulated in 16 lanes and
  // 2048-long segments, has a random-walk error ~ eps sqrt(V) relative; each
  // exp is within a few ulp. So |logp error| <= 8 eps (max|x| + sqrt(V)), the 8
  // covering exp's ulps, the subtraction and log.
  double max_x = 1.0;
  for (double z : h.problem.logits) {
    if (std::isfinite(z)) max_x = std::max(max_x, softmax_input(s.config, z));
  }
  const double tol_logp = 8.0 * kEpsF32 * (max_x + std::sqrt(static_cast<double>(s.vocab)));
  // entropy = log S - D/S, D/S = E_p[x - M] has S's relative error times |E_p[x - M]| <= max_x + log V.
  const double tol_entropy = tol_logp * (2.0 + std::log(static_cast<double>(s.vocab)));
  for (std::int64_t r = 0; r < n; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    EXPECT_NEAR(got.logp[r], want.logp[r], tol_logp * (s.config.temperature_on_logp ? 1.0 / tau : 1.0));
    EXPECT_NEAR(got.entropy[r], want.entropy[r], tol_entropy);
    // kl = e^d - d - 1 with d = ref - logp: |dkl/dlogp| = |1 - e^d| <= 1 for the generated |d| < ~0.7.
    EXPECT_NEAR(got.kl[r], want.kl[r], 2.0 * tol_logp + 4.0 * kEpsF32);
  }

  // dlogits: dz = a (onehot - p). p carries logp's error relatively (|dp| <= p tol);
  // a = c / tau carries r's (relative tol) and f32 rounding, so
  // |dz error| <= |a| (3 tol + 4 eps) (+ 2^-8 |dz| when stored as bf16: RNE to 8 bits is
  // 2^-9 relative, doubled for the f32 error under it). |a| is the oracle's
  // dloss_dlogp_scale / tau: |c| with its policy and KL parts summed without
  // cancellation and the KL part's own slope in logp added, which |c| misses
  // when the two parts cancel.
  // vespo: phi_i carries the logp errors of the whole sequence (amp, see
  // coefficient_amplification), and the loss moves by |c_t logp_t| amp tol.
  // With the entropy bonus, softcap or scale the row is the general one of
  // dz_error_bound; |a| and |b| are the oracle's coefficients.
  const std::vector<double> amp = coefficient_amplification(h.problem, want.logp);
  double sum_abs_a = 0.0, phi_loss_tol = 0.0, entropy_loss_tol = 0.0;
  const double out_rel = c.dtype == DType::bf16 ? 1.0 / 256.0 : 0.0;
  for (std::int64_t r = 0; r < n; ++r) {
    const double a = want.dloss_dlogp_scale[r] / tau;  // |c| without cancellation between its parts
    const double b = std::abs(want.dloss_dentropy[r]) * scale;
    sum_abs_a += a;
    entropy_loss_tol += std::abs(want.dloss_dentropy[r]) * tol_entropy;
    if (amp[r] > 1.0) phi_loss_tol += tau * a * std::abs(want.logp[r]) * amp[r] * tol_logp;
    const double tol_abs =
        dz_error_bound(s.config, a, b, tol_logp * amp[r], 2.0 * max_x, static_cast<double>(s.vocab), false);
    for (std::int64_t v = 0; v < s.vocab; ++v) {
      const double w = want.dlogits[r * s.vocab + v];
      const double g = got.dlogits[r * s.vocab + v];
      ASSERT_NEAR(g, w, tol_abs + out_rel * std::abs(w) + 1e-30) << "row " << r << " v " << v;
    }
  }
  // loss = sum_t w_t l_t moves by sum_t |c_t| tol_logp, c_t = tau a_t; plus f32 rounding.
  EXPECT_NEAR(got.metrics.loss, want.loss,
              2.0 * tau * sum_abs_a * tol_logp + phi_loss_tol + entropy_loss_tol +
                  16.0 * kEpsF32 * std::abs(want.loss) + 1e-12);
  // Branch decisions agree exactly (inputs are drawn away from the kinks).
  EXPECT_DOUBLE_EQ(got.metrics.clip_ratio_low, want.clip_ratio_low);
  EXPECT_DOUBLE_EQ(got.metrics.clip_ratio_high, want.clip_ratio_high);
  EXPECT_DOUBLE_EQ(got.metrics.clip_ratio_region, want.clip_ratio_region);
  EXPECT_EQ(got.metrics.num_valid, want.num_valid);
  EXPECT_NEAR(got.metrics.entropy_mean, want.entropy_mean, tol_entropy);
  EXPECT_NEAR(got.metrics.kl_mean, want.kl_mean, 2.0 * tol_logp + 4.0 * kEpsF32);
}

std::vector<LogitsCase> semantic_cases() {
  // (B, T, V): rows 1..9, 15-17, 63-65 and vocabularies around the 16-lane and
  // 2048-segment edges.
  const std::int64_t shapes[][3] = {{1, 1, 1},   {1, 3, 2047}, {3, 3, 2048}, {1, 5, 2049}, {2, 4, 6145}, {1, 7, 4099},
                                    {3, 5, 100}, {1, 16, 17},  {4, 16, 64},  {1, 17, 33},  {7, 9, 257},  {1, 65, 65},
                                    {3, 2, 15},  {2, 1, 16},   {1, 9, 31},   {3, 21, 40},  {1, 6, 4097}, {2, 8, 2048}};
  const LossType types[] = {LossType::grpo, LossType::bnpo,  LossType::dr_grpo,
                            LossType::dapo, LossType::cispo, LossType::sapo};
  std::vector<LogitsCase> cases;
  int i = 0;
  for (LossType type : types) {
    for (IsLevel level : {IsLevel::token, IsLevel::sequence}) {
      for (bool on_logp : {false, true}) {
        for (bool kl : {false, true}) {
          LogitsCase c;
          const auto& sh = shapes[i % std::size(shapes)];
          c.spec.batch = sh[0];
          c.spec.seq_len = sh[1];
          c.spec.vocab = sh[2];
          c.spec.config = config_for(type);
          c.spec.config.importance_sampling_level = level;
          c.spec.config.temperature_on_logp = on_logp;
          c.spec.config.temperature = (i % 3 == 0) ? 1.0F : 0.7F;
          c.spec.config.beta = kl ? 0.04F : 0.0F;
          c.spec.config.kl_bias_correction = kl && (i % 4 == 1);
          if (type != LossType::cispo && type != LossType::sapo && i % 5 == 2) c.spec.config.delta = 1.6F;
          c.spec.per_token_advantages = (i / 2) % 2 == 1;
          c.spec.off_policy = i % 7 != 3;
          c.spec.is_weight_kind = i % 3;
          c.spec.seed = 1000 + i;
          c.dtype = i % 2 == 0 ? DType::f32 : DType::bf16;
          c.in_place = (i / 3) % 2 == 1;
          cases.push_back(c);
          ++i;
        }
      }
    }
  }
  // The options of the current trainers (issue 8), appended so the cases
  // above keep their shapes and seeds: luspo (sequence level), vespo (token
  // level, with and without per-token is_weight), every KL estimator, the
  // off-policy sequence mask and dual-clip.
  const auto add = [&](LossType type, IsLevel level, auto&& tweak) {
    LogitsCase c;
    const auto& sh = shapes[i % std::size(shapes)];
    c.spec.batch = sh[0];
    c.spec.seq_len = sh[1];
    c.spec.vocab = sh[2];
    c.spec.config = config_for(type);
    c.spec.config.importance_sampling_level = level;
    c.spec.config.temperature = (i % 3 == 0) ? 1.0F : 0.7F;
    c.spec.config.temperature_on_logp = i % 4 == 3;
    c.spec.per_token_advantages = i % 5 == 4;
    c.spec.is_weight_kind = type == LossType::vespo ? (i % 2) : i % 3;
    c.spec.seed = 1000 + i;
    c.dtype = i % 2 == 0 ? DType::f32 : DType::bf16;
    c.in_place = (i / 3) % 2 == 1;
    tweak(c.spec);
    cases.push_back(c);
    ++i;
  };
  const auto none = [](BatchSpec&) {};
  const auto kl = [](BatchSpec& s) { s.config.beta = 0.04F; };
  const auto opsm = [](BatchSpec& s) { s.config.off_policy_mask_threshold = 0.02F; };
  const auto dual = [](BatchSpec& s) { s.config.clip_ratio_c = 1.25F; };
  for (int k = 0; k < 2; ++k) {
    add(LossType::luspo, IsLevel::sequence, none);
    add(LossType::luspo, IsLevel::sequence, kl);
    add(LossType::vespo, IsLevel::token, none);
    add(LossType::vespo, IsLevel::token, kl);
  }
  for (KlEstimator e : {KlEstimator::k3, KlEstimator::k1, KlEstimator::abs, KlEstimator::k2, KlEstimator::k1_plus,
                        KlEstimator::abs_plus, KlEstimator::k3_plus}) {
    add(i % 2 ? LossType::dapo : LossType::grpo, IsLevel::token, [&](BatchSpec& s) {
      s.config.beta = 0.04F;
      s.config.kl_estimator = e;
      // Not abs+ with bias correction: its d + |d| cancels exactly for d < 0,
      // leaving only rounding in c (no relative bound applies).
      s.config.kl_bias_correction = e == KlEstimator::k2 || e == KlEstimator::k3_plus;
      if (e == KlEstimator::k1_plus) s.config.kl_clamp = 0.1F;  // some |d| beyond it: gradient 0 there
    });
  }
  for (LossType type : {LossType::grpo, LossType::cispo, LossType::sapo, LossType::vespo}) {
    add(type, IsLevel::token, opsm);
  }
  add(LossType::grpo, IsLevel::sequence, opsm);
  add(LossType::luspo, IsLevel::sequence, [&](BatchSpec& s) {
    opsm(s);
    dual(s);
    s.config.beta = 0.04F;
  });
  add(LossType::grpo, IsLevel::token, dual);
  add(LossType::dapo, IsLevel::token, [&](BatchSpec& s) {
    dual(s);
    s.config.delta = 1.6F;
  });
  add(LossType::bnpo, IsLevel::sequence, dual);
  // Entropy bonus, top-entropy mask, logit softcap and scale (appended: the cases above keep their seeds).
  add_loss_feature_cases(add);
  return cases;
}

std::vector<LogitsCase> real_vocab_cases() {
  std::vector<LogitsCase> cases;
  int i = 0;
  for (LossType type : {LossType::grpo, LossType::dapo, LossType::sapo, LossType::cispo}) {
    LogitsCase c;
    c.spec = {1, 9, 151936, config_for(type)};
    c.spec.config.beta = 0.04F;
    c.spec.config.importance_sampling_level = i % 2 ? IsLevel::sequence : IsLevel::token;
    c.spec.seed = 77 + i;
    c.dtype = i % 2 ? DType::bf16 : DType::f32;
    c.in_place = i >= 2;
    cases.push_back(c);
    ++i;
  }
  // The entropy bonus through a softcap, and the top-entropy mask with a logit scale, at V = 151936.
  for (int k = 0; k < 2; ++k) {
    LogitsCase c;
    c.spec = {1, 9, 151936, config_for(k == 0 ? LossType::grpo : LossType::dapo)};
    c.spec.config.entropy_coef = k == 0 ? 0.05F : -0.02F;
    if (k == 0) c.spec.config.logit_softcap = 6.0F;
    c.spec.config.logit_scale = k == 0 ? 1.1F : 0.8F;
    if (k == 1) c.spec.config.top_entropy_quantile = 0.5F;
    c.spec.seed = 91 + k;
    c.dtype = k == 0 ? DType::f32 : DType::bf16;
    c.in_place = k == 1;
    cases.push_back(c);
  }
  return cases;
}

std::vector<LogitsCase> adversarial_cases() {
  std::vector<LogitsCase> cases;
  for (int i = 0; i < 4; ++i) {
    LogitsCase c;
    c.spec = {2, 4, i < 2 ? 301 : 4100, config_for(i % 2 ? LossType::bnpo : LossType::grpo)};
    c.spec.config.temperature = 0.9F;
    c.spec.adversarial = true;
    c.spec.seed = 500 + i;
    c.dtype = i % 2 ? DType::bf16 : DType::f32;
    cases.push_back(c);
  }
  // All rows masked; all advantages zero.
  LogitsCase masked;
  masked.spec = {2, 3, 50, config_for(LossType::grpo)};
  masked.spec.mask_fraction = 1.0;
  cases.push_back(masked);
  LogitsCase zero_adv;
  zero_adv.spec = {4, 3, 70, config_for(LossType::dapo)};
  zero_adv.spec.zero_adv_fraction = 1.0;
  cases.push_back(zero_adv);
  return cases;
}

std::vector<LogitsCase> baseline_cases() {
  std::vector<LogitsCase> cases;
  for (LogitsCase c : semantic_cases()) {
    if (c.in_place) continue;  // the baseline writes dlogits from its stored softmax
    c.baseline = true;
    cases.push_back(c);
    if (cases.size() >= 12) break;
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Semantics, LogitsVsOracle, ::testing::ValuesIn(semantic_cases()));
INSTANTIATE_TEST_SUITE_P(RealVocab, LogitsVsOracle, ::testing::ValuesIn(real_vocab_cases()));
INSTANTIATE_TEST_SUITE_P(Adversarial, LogitsVsOracle, ::testing::ValuesIn(adversarial_cases()));
INSTANTIATE_TEST_SUITE_P(Baseline, LogitsVsOracle, ::testing::ValuesIn(baseline_cases()));

}  // namespace
}  // namespace grpo::test
