// LmHeadInputs::grad_scale: the call's factor on every gradient, applied to the
// per-row coefficients before the backward GEMMs (the Python layer passes
// 1 / num_items_in_batch there, so a dapo plan serves every step), and the
// step's active_rows counter.
#include "determinism_support.hpp"

namespace grpo::test {
namespace {

struct ScaledRun {
  std::vector<float> logp, dhidden, dweight, dbias;
  Metrics metrics;
  LmHeadStepStats stats;
};

HeadCase scale_case() {
  HeadCase c;  // grpo + KL + bias, bf16 inputs, several blocks and tiles
  c.spec = {2, 45, 300, config_for(LossType::grpo)};
  c.spec.config.beta = 0.04F;
  c.spec.seed = 501;
  c.hidden = 48;
  c.dtype = DType::bf16;
  c.bias = true;
  return c;
}

ScaledRun run_scaled(const HeadCase& c, const HeadProblem& p, double grad_scale) {
  const BatchSpec& s = c.spec;
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.hidden;
  const LmHeadShape shape{s.batch, s.seq_len, h, v, c.dtype, c.layout, c.bias};
  LmHeadOptions opt;
  opt.token_block = c.token_block;
  opt.vocab_tile = c.vocab_tile;
  const LmHeadLossPlan plan(shape, s.config, opt);
  ScaledRun r;
  r.logp.assign(n, 7.0F);
  r.dhidden.assign(n * h, 7.0F);
  r.dweight.assign(v * h, 7.0F);
  r.dbias.assign(v, 7.0F);
  LmHeadOutputs out;
  out.tokens.logp = r.logp;
  out.dhidden = {r.dhidden.data(), DType::f32, n, h, h};
  out.dweight = {r.dweight.data(), DType::f32, v, h, h};
  out.dbias = r.dbias;
  out.metrics = &r.metrics;
  out.stats = &r.stats;
  LmHeadInputs in{{p.hidden.data(), c.dtype, n, h, h},
                  {p.weight.data(), c.dtype, v, h, h},
                  {p.bias.data(), DType::f32, v},
                  p.batch.view()};
  in.grad_scale = grad_scale;
  plan.execute(in, out);
  return r;
}

// A power of two scales every coefficient, dlogits entry (f32 or bf16), GEMM
// product and sum exactly, so each gradient is exactly scaled; the loss,
// metrics and logp do not move at all.
TEST(GradScale, PowerOfTwoScalesEveryGradientExactlyAndNothingElse) {
  const HeadCase c = scale_case();
  const HeadProblem p = make_head_problem(c, false);
  const ScaledRun one = run_scaled(c, p, 1.0);
  for (const double g : {0.25, -2.0}) {
    SCOPED_TRACE(g);
    const ScaledRun scaled = run_scaled(c, p, g);
    EXPECT_TRUE(same_bits(scaled.logp, one.logp));
    EXPECT_TRUE(same_bits(scaled.metrics.loss, one.metrics.loss));
    const std::vector<float>* pairs[][2] = {
        {&scaled.dhidden, &one.dhidden}, {&scaled.dweight, &one.dweight}, {&scaled.dbias, &one.dbias}};
    for (const auto& pair : pairs) {
      const std::vector<float>& got = *pair[0];
      const std::vector<float>& base = *pair[1];
      std::size_t nonzero = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], static_cast<float>(base[i] * g)) << "entry " << i;
        nonzero += base[i] != 0.0F ? 1 : 0;
      }
      EXPECT_GT(nonzero, 0U);  // the comparison means something
    }
  }
}

TEST(GradScale, NonFiniteIsRefusedNamingItBeforeAnyOutput) {
  const HeadCase c = scale_case();
  const HeadProblem p = make_head_problem(c, false);
  for (const double g : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    try {
      run_scaled(c, p, g);
      ADD_FAILURE() << "grad_scale " << g << " was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "grad_scale") << e.what();
    }
  }
  // A finite scale whose gradients would overflow f32 is refused too.
  try {
    run_scaled(c, p, 1e38);
    ADD_FAILURE() << "grad_scale 1e38 was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "grad_scale") << e.what();
  }
}

// active_rows: the rows with a nonzero coefficient, before the padding the
// backward GEMMs add. On-policy grpo without KL with every row valid and
// nonzero advantages: every row.
TEST(GradScale, ActiveRowsCountTheRowsInTheBackward) {
  HeadCase c = scale_case();
  c.spec.config.beta = 0.0F;
  c.spec.off_policy = false;
  c.spec.zero_adv_fraction = 0.0;
  const HeadProblem p = make_head_problem(c, false);
  const ScaledRun r = run_scaled(c, p, 1.0);
  std::int64_t valid = 0;
  for (const float m : p.batch.mask) valid += m != 0.0F ? 1 : 0;
  EXPECT_EQ(r.stats.active_rows, valid);
  EXPECT_GE(r.stats.dhidden_gemm_rows, r.stats.active_rows);
  EXPECT_LT(r.stats.dhidden_gemm_rows - r.stats.active_rows,
            32 * ((c.spec.batch * c.spec.seq_len + c.token_block - 1) / c.token_block));  // padding per block
}

}  // namespace
}  // namespace grpo::test
