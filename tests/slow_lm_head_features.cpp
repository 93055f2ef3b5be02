// The fused LM head with the loss features of the current trainers against the
// double oracle at the real vocabulary (V = 151936, the plan's own 2048-column
// tiles plus a 392-column last tile), N = 40 rows over 32-row blocks, H = 32:
// the entropy bonus through a softcap with a scale, and the top-entropy mask
// spanning two blocks (the two-pass schedule); f32 and bf16.
#include <gtest/gtest.h>

#include "lm_head_oracle_check.hpp"

namespace grpo::test {
namespace {

class HeadFeaturesRealVocab : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(HeadFeaturesRealVocab, MatchesOracle) {
  const auto [dtype, variant] = GetParam();
  HeadCase c;
  c.spec.batch = 2;
  c.spec.seq_len = 20;
  c.spec.vocab = 151936;
  c.hidden = 32;
  c.spec.config = config_for(variant == 0 ? LossType::grpo : LossType::dapo);
  c.spec.config.temperature = 0.9F;
  c.spec.config.beta = 0.04F;
  if (variant == 0) {
    c.spec.config.entropy_coef = 0.05F;
    c.spec.config.logit_softcap = 5.0F;
    c.spec.config.logit_scale = 1.3F;
  } else {
    c.spec.config.entropy_coef = -0.02F;
    c.spec.config.top_entropy_quantile = 0.3F;
    c.spec.config.logit_scale = 0.8F;
  }
  c.spec.seed = 7300 + static_cast<std::uint32_t>(variant);
  c.dtype = dtype;
  c.bias = true;
  c.token_block = 32;
  c.vocab_tile = 0;  // the plan's default tile
  const HeadProblem p = make_head_problem(c);
  const HeadOutputs got = run_head(c, p);
  if (variant == 1) EXPECT_NE(got.schedule.find("top-entropy mask"), std::string::npos) << got.schedule;
  expect_head_matches_oracle(c, p, got);
}

INSTANTIATE_TEST_SUITE_P(V151936, HeadFeaturesRealVocab,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(0, 1)));

}  // namespace
}  // namespace grpo::test
