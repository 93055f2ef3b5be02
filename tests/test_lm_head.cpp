// The fused LM-head kernel (and the unfused LM-head baseline) against the
// double oracle at small shapes built around the block / tile / chunk edges:
// both layouts, both dtypes, every loss type, both IS levels (including the
// recompute schedule), bias on/off, accumulate on/off, masked and
// zero-advantage rows.
#include <gtest/gtest.h>

#include "lm_head_oracle_check.hpp"

namespace grpo::test {
namespace {

class HeadVsOracle : public ::testing::TestWithParam<HeadCase> {};

TEST_P(HeadVsOracle, MatchesOracle) {
  const HeadCase& c = GetParam();
  const HeadProblem p = make_head_problem(c);
  expect_head_matches_oracle(c, p, run_head(c, p));
}

std::vector<HeadCase> fused_cases() {
  // (B, T, V, H): rows around the 32-row block (1, 7, 31, 32, 33, 65), vocab around
  // the 64-column tile (1, 63, 64, 65, 193), hidden around the 256-column chunk.
  const std::int64_t shapes[][4] = {{1, 1, 1, 16},   {1, 7, 63, 24},  {1, 31, 64, 16},  {2, 16, 65, 40},
                                    {3, 11, 193, 8}, {1, 65, 70, 20}, {5, 7, 129, 300}, {2, 20, 100, 257}};
  const LossType types[] = {LossType::grpo, LossType::bnpo,  LossType::dr_grpo,
                            LossType::dapo, LossType::cispo, LossType::sapo};
  std::vector<HeadCase> cases;
  int i = 0;
  for (LossType type : types) {
    for (IsLevel level : {IsLevel::token, IsLevel::sequence}) {
      for (int variant = 0; variant < 2; ++variant) {
        HeadCase c;
        const auto& sh = shapes[i % std::size(shapes)];
        c.spec.batch = sh[0];
        c.spec.seq_len = sh[1];
        c.spec.vocab = sh[2];
        c.hidden = sh[3];
        c.spec.config = config_for(type);
        c.spec.config.importance_sampling_level = level;
        c.spec.config.temperature_on_logp = i % 4 == 3;
        c.spec.config.temperature = i % 3 == 0 ? 1.0F : 0.8F;
        c.spec.config.beta = variant == 1 ? 0.04F : 0.0F;
        c.spec.config.kl_bias_correction = variant == 1 && i % 3 == 1;
        c.spec.per_token_advantages = i % 5 == 4;
        c.spec.is_weight_kind = i % 3;
        c.spec.zero_adv_fraction = i % 4 == 1 ? 0.5 : 0.0;
        c.spec.seed = 4000 + i;
        c.dtype = i % 2 == 0 ? DType::f32 : DType::bf16;
        c.layout = (i / 2) % 2 == 0 ? WeightLayout::vocab_major : WeightLayout::hidden_major;
        c.bias = i % 3 != 2;
        c.banned = c.bias && i % 6 == 0;
        c.accumulate = i % 4 == 2;
        c.dhidden_dtype = i % 7 == 5 ? DType::bf16 : DType::f32;
        c.dweight_dtype = c.dtype == DType::bf16 && !c.accumulate && i % 5 == 1 ? DType::bf16 : DType::f32;
        if (i % 9 == 8) {  // the plan's own choice of block and tile
          c.token_block = 0;
          c.vocab_tile = 0;
        }
        cases.push_back(c);
        ++i;
      }
    }
  }
  // The options of the current trainers (issue 8), appended so the cases
  // above keep their shapes and seeds. T = 65 and 20 over 32-row blocks (and
  // 7, 11, 16 per block) exercise both schedules of the options that need
  // whole sequences: vespo, the off-policy mask, luspo.
  const auto add = [&](LossType type, IsLevel level, auto&& tweak) {
    HeadCase c;
    const auto& sh = shapes[i % std::size(shapes)];
    c.spec.batch = sh[0];
    c.spec.seq_len = sh[1];
    c.spec.vocab = sh[2];
    c.hidden = sh[3];
    c.spec.config = config_for(type);
    c.spec.config.importance_sampling_level = level;
    c.spec.config.temperature_on_logp = i % 4 == 3;
    c.spec.config.temperature = i % 3 == 0 ? 1.0F : 0.8F;
    c.spec.per_token_advantages = i % 5 == 4;
    c.spec.is_weight_kind = type == LossType::vespo ? i % 2 : i % 3;
    c.spec.seed = 4000 + i;
    c.dtype = i % 2 == 0 ? DType::f32 : DType::bf16;
    c.layout = (i / 2) % 2 == 0 ? WeightLayout::vocab_major : WeightLayout::hidden_major;
    c.bias = i % 3 != 2;
    c.accumulate = i % 4 == 2;
    tweak(c.spec);
    cases.push_back(c);
    ++i;
  };
  const auto none = [](BatchSpec&) {};
  const auto kl = [](BatchSpec& s) { s.config.beta = 0.04F; };
  const auto opsm = [](BatchSpec& s) { s.config.off_policy_mask_threshold = 0.02F; };
  const auto dual = [](BatchSpec& s) { s.config.clip_ratio_c = 1.25F; };
  for (int k = 0; k < 2; ++k) {
    add(LossType::luspo, IsLevel::sequence, k == 0 ? none : kl);
    add(LossType::vespo, IsLevel::token, none);
    add(LossType::vespo, IsLevel::token, kl);
  }
  for (KlEstimator e : {KlEstimator::k1, KlEstimator::abs, KlEstimator::k2, KlEstimator::k1_plus, KlEstimator::abs_plus,
                        KlEstimator::k3_plus}) {
    add(LossType::grpo, IsLevel::token, [&](BatchSpec& s) {
      s.config.beta = 0.04F;
      s.config.kl_estimator = e;
      s.config.kl_bias_correction = e == KlEstimator::k2;
    });
  }
  for (LossType type : {LossType::grpo, LossType::vespo, LossType::cispo, LossType::dapo}) {
    add(type, IsLevel::token, opsm);
  }
  add(LossType::grpo, IsLevel::token, dual);
  add(LossType::luspo, IsLevel::sequence, [&](BatchSpec& s) {
    dual(s);
    opsm(s);
  });
  add(LossType::dapo, IsLevel::token, dual);
  // Entropy bonus, top-entropy mask (one block, and spanning blocks: the
  // two-pass schedule), logit softcap and scale, appended likewise.
  add_loss_feature_cases(add);
  return cases;
}

std::vector<HeadCase> baseline_cases() {
  std::vector<HeadCase> cases;
  int i = 0;
  for (HeadCase c : fused_cases()) {
    if (i++ % 3 != 0) continue;
    const LossConfig& f = c.spec.config;  // features the baselines refuse (unsupported)
    if (f.entropy_coef != 0.0F || f.top_entropy_quantile != 1.0F || f.logit_softcap || f.logit_scale != 1.0F) continue;
    c.baseline = true;
    if (c.dtype == DType::f32) c.dhidden_dtype = DType::f32;  // the baseline refuses f32 x f32 -> bf16
    c.baseline_logits = c.dtype == DType::bf16 && i % 2 == 0 ? DType::bf16 : DType::f32;
    if (c.baseline_logits == DType::bf16) continue;  // bf16 logits lose precision by design: not an oracle match
    cases.push_back(c);
  }
  return cases;
}

// fp16 models (issue 48): f16 hidden, weight and bias, f16 or f32 gradients,
// on every third of the fused cases (their tile edges, layouts, loss types
// and options), the f16 gradients' one rounding per write in the bounds.
std::vector<HeadCase> f16_cases() {
  std::vector<HeadCase> cases;
  int i = 0;
  for (HeadCase c : fused_cases()) {
    if (i++ % 3 != 1) continue;
    c.dtype = DType::f16;
    c.bias_dtype = i % 2 == 0 ? DType::f16 : DType::f32;
    c.dhidden_dtype = i % 4 < 2 ? DType::f16 : DType::f32;
    c.dweight_dtype = i % 5 < 3 ? DType::f16 : DType::f32;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fused, HeadVsOracle, ::testing::ValuesIn(fused_cases()));
INSTANTIATE_TEST_SUITE_P(F16, HeadVsOracle, ::testing::ValuesIn(f16_cases()));
INSTANTIATE_TEST_SUITE_P(Baseline, HeadVsOracle, ::testing::ValuesIn(baseline_cases()));

}  // namespace
}  // namespace grpo::test

namespace grpo::test {
namespace {

// Regression (found by the fuzzer): forward-only, sequence-level IS and a token
// block that is not a multiple of T used to read past the block.
TEST(HeadForwardOnly, SequenceLevelWithUnalignedBlockMatchesOracle) {
  HeadCase c;
  c.spec = {3, 3, 37, config_for(LossType::grpo)};
  c.spec.config.importance_sampling_level = IsLevel::sequence;
  c.spec.mask_fraction = 0.0;
  c.spec.seed = 9;
  c.hidden = 4;
  const HeadProblem p = make_head_problem(c);
  const oracle::LmHeadResult want = oracle::evaluate_lm_head(p.oracle);
  const std::int64_t n = 9;
  std::vector<float> logp(n, -1.0F);
  Metrics m;
  LmHeadOptions opt;
  opt.forward_only = true;
  opt.token_block = 4;
  LmHeadShape shape{3, 3, 4, 37, DType::f32};
  LmHeadLossPlan plan(shape, c.spec.config, opt);
  plan.execute({{p.hidden.data(), DType::f32, n, 4, 4}, {p.weight.data(), DType::f32, 37, 4, 4}, {}, p.batch.view()},
               {{logp}, {}, {}, {}, &m});
  // Tiny shape: logits error ~ eps * H * |h||w|, logp within 1e-5 of the oracle.
  for (std::int64_t t = 0; t < n; ++t) EXPECT_NEAR(logp[t], want.head.logp[t], 1e-5) << "row " << t;
  EXPECT_NEAR(m.loss, want.head.loss, 1e-5);
}

// A token far less likely under the policy than under the reference
// (ref - logp > 88) used to overflow e^(ref - logp) in f32: the KL exponent is
// clamped at 20, so every output stays finite and matches the oracle.
// ref - logp >> 88 on most rows: TRL's f32 k3 would be inf there. By default
// the step is refused naming ref_logp, before any output is written (one
// block here); with verl's clamp (config.kl_clamp) it is finite and equals the
// oracle's clamped KL.
TEST(HeadKl, HugeReferenceGapRefusedOrClamped) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    HeadCase c;
    c.spec = {1, 8, 50, config_for(LossType::grpo)};
    c.spec.config.beta = 0.04F;
    c.spec.config.temperature = 0.05F;  // logits / tau of a few hundred: logp ~ -300
    c.spec.mask_fraction = 0.0;
    c.spec.seed = 13;
    c.hidden = 16;
    c.dtype = dtype;
    HeadProblem p = make_head_problem(c);
    for (float& r : p.batch.ref_logp) r = -0.5F;
    p.oracle.head.ref_logp.assign(p.batch.ref_logp.begin(), p.batch.ref_logp.end());
    try {
      run_head(c, p);
      ADD_FAILURE() << "a k3 KL beyond f32 was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "ref_logp") << e.what();
    }
    c.spec.config.kl_clamp = 20.0F;
    p.oracle.head.config.kl_clamp = 20.0F;
    const HeadOutputs got = run_head(c, p);
    EXPECT_TRUE(std::isfinite(got.metrics.loss));
    for (float k : got.kl) EXPECT_TRUE(std::isfinite(k));
    for (float x : to_float(got.dhidden.data(), c.dhidden_dtype, got.dhidden.size() / 4)) ASSERT_TRUE(std::isfinite(x));
    const oracle::LmHeadResult want = oracle::evaluate_lm_head(p.oracle);
    EXPECT_NEAR(got.metrics.loss, want.head.loss, 1e-4 * std::abs(want.head.loss));
  }
}

}  // namespace
}  // namespace grpo::test
