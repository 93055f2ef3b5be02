// The generic log-prob head against the double oracle at the real vocabulary
// (V = 151936, the plan's own 2048-column tiles plus a 392-column last tile) with
// a modest N = 40 and H = 32 (the oracle is O(N V H) in long double): f32 and
// bf16, both layouts, 32-row blocks (two blocks, the second partial), bias,
// mask, entropy upstream, rows with zero upstream.
#include <gtest/gtest.h>

#include "log_prob_head_support.hpp"

namespace grpo::test {
namespace {

class LogProbRealVocab : public ::testing::TestWithParam<std::tuple<DType, WeightLayout, bool>> {};

TEST_P(LogProbRealVocab, MatchesOracle) {
  LogProbCase c;
  c.head.spec.batch = 2;
  c.head.spec.seq_len = 20;
  c.head.spec.vocab = 151936;
  c.head.hidden = 32;
  c.head.dtype = std::get<0>(GetParam());
  c.head.layout = std::get<1>(GetParam());
  c.head.spec.config.temperature = 0.9F;
  c.head.spec.config.temperature_on_logp = std::get<2>(GetParam());
  c.head.bias = true;
  c.head.token_block = 32;
  c.head.vocab_tile = 0;  // the plan's default tile
  c.head.spec.seed = 7100;
  c.zero_fraction = 0.25;
  const LogProbHostProblem p = make_log_prob_problem(c);
  expect_log_prob_matches_oracle(c, p, run_log_prob(c, p));
}

INSTANTIATE_TEST_SUITE_P(V151936, LogProbRealVocab,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(WeightLayout::vocab_major, WeightLayout::hidden_major),
                                            ::testing::Values(false, true)));

// A logit softcap with a scale inside, and the entropy upstream, at V = 151936.
TEST(LogProbRealVocabSoftcap, MatchesOracle) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    LogProbCase c;
    c.head.spec.batch = 2;
    c.head.spec.seq_len = 20;
    c.head.spec.vocab = 151936;
    c.head.hidden = 32;
    c.head.dtype = dtype;
    c.head.spec.config.temperature = 0.9F;
    c.head.spec.config.logit_softcap = 5.0F;
    c.head.spec.config.logit_scale = 1.3F;
    c.head.bias = true;
    c.head.token_block = 32;
    c.head.spec.seed = 7200;
    c.zero_fraction = 0.25;
    const LogProbHostProblem p = make_log_prob_problem(c);
    expect_log_prob_matches_oracle(c, p, run_log_prob(c, p));
  }
}

}  // namespace
}  // namespace grpo::test
