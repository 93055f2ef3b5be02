// LmHeadOptions::frozen_weight: a frozen LM head (LoRA) gets dhidden alone.
// The dW GEMMs are skipped and nothing else changes, so every output the
// frozen plan writes is bitwise the one a plan with weight gradients writes,
// in the fused loss and in the generic log-prob head.
#include "determinism_support.hpp"
#include "log_prob_head_support.hpp"

namespace grpo::test {
namespace {

std::vector<HeadCase> frozen_cases() {
  std::vector<HeadCase> out;
  HeadCase c;  // grpo + KL + bias, bf16, several blocks and tiles
  c.spec = {2, 50, 700, config_for(LossType::grpo)};
  c.spec.config.beta = 0.04F;
  c.spec.seed = 401;
  c.hidden = 72;
  c.dtype = DType::bf16;
  c.bias = true;
  out.push_back(c);
  // dapo, hidden-major f32, a sequence-level ratio whose sequences span blocks (the recompute schedule).
  c.spec = {2, 70, 530, config_for(LossType::dapo)};
  c.spec.config.importance_sampling_level = IsLevel::sequence;
  c.spec.seed = 402;
  c.dtype = DType::f32;
  c.layout = WeightLayout::hidden_major;
  c.bias = false;
  out.push_back(c);
  // Entropy bonus and softcap: the rows a zero policy coefficient leaves still feed dhidden.
  c.spec = {1, 90, 611, config_for(LossType::grpo)};
  c.spec.config.entropy_coef = 0.01F;
  c.spec.config.logit_softcap = 30.0F;
  c.spec.seed = 403;
  c.layout = WeightLayout::vocab_major;
  c.dtype = DType::bf16;
  out.push_back(c);
  return out;
}

TEST(FrozenWeight, FusedHeadWritesTheSameBitsWithoutDweight) {
  for (const HeadCase& base : frozen_cases()) {
    SCOPED_TRACE(case_name(base));
    const HeadProblem p = make_head_problem(base, false);
    const HeadOutputs full = run_head(base, p);
    HeadCase frozen_case = base;
    frozen_case.frozen = true;
    const HeadOutputs frozen = run_head(frozen_case, p);
    EXPECT_TRUE(same_bits(frozen.metrics.loss, full.metrics.loss));
    EXPECT_TRUE(same_bits(frozen.logp, full.logp));
    EXPECT_TRUE(same_bits(frozen.entropy, full.entropy));
    EXPECT_TRUE(same_bits(frozen.kl, full.kl));
    EXPECT_TRUE(same_bits(frozen.dhidden, full.dhidden));
    // dhidden is not trivially zero: the comparison above means something.
    const std::vector<float> dh =
        to_float(full.dhidden.data(), base.dhidden_dtype, full.dhidden.size() / size_of(base.dhidden_dtype));
    EXPECT_TRUE(std::any_of(dh.begin(), dh.end(), [](float x) { return x != 0.0F; }));
    EXPECT_NE(frozen.schedule.find("frozen_weight=no_dW"), std::string::npos) << frozen.schedule;
    EXPECT_EQ(full.schedule.find("frozen_weight"), std::string::npos) << full.schedule;
  }
}

// The step's counters: the dW GEMM ran on no row, the dhidden GEMM on the same rows.
TEST(FrozenWeight, StatsCountNoDweightRows) {
  HeadCase c = frozen_cases()[0];
  const HeadProblem p = make_head_problem(c, false);
  const BatchSpec& s = c.spec;
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.hidden;
  LmHeadShape shape{s.batch, s.seq_len, h, v, c.dtype, c.layout, c.bias};
  LmHeadStepStats stats[2];
  for (int frozen = 0; frozen < 2; ++frozen) {
    LmHeadOptions opt;
    opt.token_block = c.token_block;
    opt.vocab_tile = c.vocab_tile;
    opt.frozen_weight = frozen == 1;
    const LmHeadLossPlan plan(shape, s.config, opt);
    std::vector<float> logp(n), dhidden(n * h), dweight(frozen == 1 ? 0 : v * h), dbias(frozen == 1 ? 0 : v);
    LmHeadOutputs out;
    out.tokens.logp = logp;
    out.dhidden = {dhidden.data(), DType::f32, n, h, h};
    if (frozen == 0) out.dweight = {dweight.data(), DType::f32, v, h, h};
    out.dbias = dbias;
    out.stats = &stats[frozen];
    plan.execute({{p.hidden.data(), c.dtype, n, h, h},
                  {p.weight.data(), c.dtype, v, h, h},
                  {p.bias.data(), DType::f32, v},
                  p.batch.view()},
                 out);
  }
  EXPECT_GT(stats[0].dhidden_gemm_rows, 0);
  EXPECT_EQ(stats[0].dweight_gemm_rows, stats[0].dhidden_gemm_rows);
  EXPECT_EQ(stats[1].dhidden_gemm_rows, stats[0].dhidden_gemm_rows);
  EXPECT_EQ(stats[1].dweight_gemm_rows, 0);
  EXPECT_EQ(stats[1].dweight_gemm_s, 0.0);
  EXPECT_EQ(stats[1].logits_gemm_rows, stats[0].logits_gemm_rows);
}

TEST(FrozenWeight, LogProbHeadWritesTheSameDhiddenWithoutDweight) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    LogProbCase c;
    c.head.spec = {1, 130, 901, config_for(LossType::grpo)};
    c.head.spec.config.temperature = 0.8F;
    c.head.spec.seed = 404;
    c.head.hidden = 80;
    c.head.dtype = dtype;
    c.head.bias = true;
    SCOPED_TRACE(case_name(c));
    const LogProbHostProblem p = make_log_prob_problem(c, false);
    const LogProbRun full = run_log_prob(c, p);
    c.head.frozen = true;
    const LogProbRun frozen = run_log_prob(c, p);
    EXPECT_TRUE(same_bits(frozen.logp, full.logp));
    EXPECT_TRUE(same_bits(frozen.entropy, full.entropy));
    EXPECT_TRUE(same_bits(frozen.dhidden, full.dhidden));
    EXPECT_GT(full.backward_stats.dweight_gemm_rows, 0);
    EXPECT_EQ(frozen.backward_stats.dweight_gemm_rows, 0);
    EXPECT_EQ(frozen.backward_stats.dhidden_gemm_rows, full.backward_stats.dhidden_gemm_rows);
    EXPECT_NE(frozen.schedule.find("frozen_weight"), std::string::npos) << frozen.schedule;
  }
}

TEST(FrozenWeight, LogProbHeadRefusesDweightAndAccumulate) {
  LogProbCase c;
  c.head.spec = {1, 40, 300, config_for(LossType::grpo)};
  c.head.spec.seed = 405;
  c.head.bias = true;
  c.head.frozen = true;
  c.head.accumulate = true;
  try {
    const LmHeadLogProbPlan plan(log_prob_shape(c), {}, log_prob_options(c));
    ADD_FAILURE() << "frozen_weight with accumulate_weight_grads was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "options.accumulate_weight_grads") << e.what();
  }
  c.head.accumulate = false;
  const LogProbHostProblem p = make_log_prob_problem(c, false);
  const LmHeadLogProbPlan plan(log_prob_shape(c), {}, log_prob_options(c));
  const std::int64_t n = 40, v = 300, h = c.head.hidden;
  std::vector<float> dhidden(n * h, 5.0F), dweight(v * h, 5.0F);
  try {
    plan.backward(log_prob_inputs(c, p), {p.dlogp, p.dentropy},
                  {{dhidden.data(), DType::f32, n, h, h}, {dweight.data(), DType::f32, v, h, h}, {}, nullptr});
    ADD_FAILURE() << "dweight given to a frozen_weight plan was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dweight") << e.what();
  }
  EXPECT_TRUE(std::all_of(dhidden.begin(), dhidden.end(), [](float x) { return x == 5.0F; }));
}

}  // namespace
}  // namespace grpo::test
