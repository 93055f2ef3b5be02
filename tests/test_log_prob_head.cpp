// The generic log-prob head (LmHeadLogProbPlan) against the double oracle at
// shapes around the block / tile / chunk edges: f32 and bf16, both layouts,
// bias on / off (with banned tokens), both temperature conventions, mask on /
// off, entropy upstream on / off, rows with zero upstream, accumulate; and its
// forward against the fused plan's, bit for bit.
#include <gtest/gtest.h>

#include <cstring>

#include "log_prob_head_support.hpp"

namespace grpo::test {
namespace {

class LogProbVsOracle : public ::testing::TestWithParam<LogProbCase> {};

TEST_P(LogProbVsOracle, MatchesOracle) {
  const LogProbCase& c = GetParam();
  const LogProbHostProblem p = make_log_prob_problem(c);
  const LogProbRun got = run_log_prob(c, p);
  expect_log_prob_matches_oracle(c, p, got);

  // Rows with both upstream gradients 0 (or masked) take part in no backward
  // GEMM: per block, the active rows padded to the row quantum (32) for dW
  // and dhidden, and to whole forward calls for the recompute; their dhidden
  // rows are exact zeros.
  const std::int64_t n = c.head.spec.batch * c.head.spec.seq_len;
  const std::int64_t nb = got.plan_schedule.token_block;
  std::int64_t want_rows = 0;
  for (std::int64_t b0 = 0; b0 < n; b0 += nb) {
    std::int64_t na = 0;
    for (std::int64_t t = b0; t < std::min(n, b0 + nb); ++t) {
      const bool valid = p.head.batch.mask.empty() || p.head.batch.mask[t] != 0.0F;
      const bool active = valid && (p.dlogp[t] != 0.0F || (!p.dentropy.empty() && p.dentropy[t] != 0.0F));
      na += active ? 1 : 0;
      if (!active) {
        const std::vector<float> row =
            to_float(got.dhidden.data() + static_cast<std::size_t>(t * c.head.hidden) * size_of(c.head.dhidden_dtype),
                     c.head.dhidden_dtype, static_cast<std::size_t>(c.head.hidden));
        for (float x : row) ASSERT_EQ(x, 0.0F) << "inactive row " << t;
      }
    }
    want_rows += (na + 31) / 32 * 32;
  }
  EXPECT_EQ(got.backward_stats.dhidden_gemm_rows, want_rows);
  EXPECT_LE(got.backward_stats.logits_gemm_rows, got.forward_stats.logits_gemm_rows);
  for (std::int64_t t = 0; t < n; ++t) {
    if (!p.head.batch.mask.empty() && p.head.batch.mask[t] == 0.0F) EXPECT_EQ(got.logp[t], 0.0F) << "row " << t;
  }
}

std::vector<LogProbCase> cases() {
  // (B, T, V, H) around the 32-row block, the 64-column tile and the 256-column chunk.
  const std::int64_t shapes[][4] = {{1, 1, 1, 16},   {1, 7, 63, 24},  {1, 31, 64, 16},  {2, 16, 65, 40},
                                    {3, 11, 193, 8}, {1, 65, 70, 20}, {5, 7, 129, 300}, {2, 20, 100, 257}};
  std::vector<LogProbCase> out;
  for (int i = 0; i < 24; ++i) {
    LogProbCase c;
    const auto& sh = shapes[i % std::size(shapes)];
    HeadCase& h = c.head;
    h.spec.batch = sh[0];
    h.spec.seq_len = sh[1];
    h.spec.vocab = sh[2];
    h.hidden = sh[3];
    h.spec.config.temperature = i % 3 == 0 ? 1.0F : 0.8F;
    h.spec.config.temperature_on_logp = i % 4 == 3;
    h.spec.seed = 6100 + static_cast<std::uint32_t>(i);
    h.dtype = i % 2 == 0 ? DType::f32 : DType::bf16;
    h.layout = (i / 2) % 2 == 0 ? WeightLayout::vocab_major : WeightLayout::hidden_major;
    h.bias = i % 3 != 2;
    h.banned = h.bias && i % 6 == 0;
    h.accumulate = i % 5 == 2;
    h.dhidden_dtype = i % 7 == 5 ? DType::bf16 : DType::f32;
    h.dweight_dtype = h.dtype == DType::bf16 && !h.accumulate && i % 5 == 1 ? DType::bf16 : DType::f32;
    if (i % 9 == 8) {  // the plan's own choice of block and tile
      h.token_block = 0;
      h.vocab_tile = 0;
    }
    c.mask = i % 4 != 1;
    c.entropy_upstream = i % 3 != 1;
    c.zero_fraction = i % 8 == 7 ? 1.0 : (i % 2 == 0 ? 0.3 : 0.6);  // 1.0: nothing to do at all
    out.push_back(c);
  }
  // Logit softcap (with and without a scale inside) and a scale alone, through the same edges.
  for (int i = 0; i < 8; ++i) {
    LogProbCase c = out[static_cast<std::size_t>(i * 3)];
    c.head.spec.seed += 100;
    if (i % 2 == 0) c.head.spec.config.logit_softcap = i % 4 == 0 ? 4.0F : 1.5F;
    c.head.spec.config.logit_scale = i % 3 == 0 ? 1.0F : (i % 3 == 1 ? 1.3F : 0.7F);
    c.entropy_upstream = true;
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(EdgeShapes, LogProbVsOracle, ::testing::ValuesIn(cases()));

// forward() is the fused plan's forward: logp and entropy bit for bit, with the
// fused plan built forward-only or with gradients, with a mask or without.
TEST(LogProbHead, ForwardIsTheFusedPlansForwardBitwise) {
  for (int i = 0; i < 4; ++i) {
    LogProbCase c;
    c.head.spec.batch = 3;
    c.head.spec.seq_len = 70;
    c.head.spec.vocab = 300;
    c.head.hidden = 48;
    c.head.dtype = i % 2 == 0 ? DType::bf16 : DType::f32;
    c.head.bias = i < 2;
    c.head.spec.config.temperature = 0.7F;
    c.head.spec.config.temperature_on_logp = i == 3;
    c.head.spec.seed = 6300 + static_cast<std::uint32_t>(i);
    c.mask = i != 1;
    SCOPED_TRACE(case_name(c));
    const LogProbHostProblem p = make_log_prob_problem(c, false);
    const std::int64_t n = c.head.spec.batch * c.head.spec.seq_len;
    std::vector<float> logp(n), entropy(n);
    const LmHeadLogProbPlan generic(log_prob_shape(c),
                                    {c.head.spec.config.temperature, c.head.spec.config.temperature_on_logp},
                                    log_prob_options(c));
    generic.forward(log_prob_inputs(c, p), {logp, entropy});
    for (const bool forward_only : {true, false}) {
      HeadCase fused = c.head;
      HeadProblem fp = p.head;
      if (!c.mask) fp.batch.mask.assign(n, 1.0F);
      HeadOutputs o;
      if (forward_only) {
        LmHeadOptions opt = log_prob_options(c);
        opt.forward_only = true;
        o.logp.assign(n, 0.0F);
        o.entropy.assign(n, 0.0F);
        LmHeadLossPlan plan(log_prob_shape(c), c.head.spec.config, opt);
        const LogProbInputs gi = log_prob_inputs(c, p);
        plan.execute({gi.hidden, gi.weight, gi.bias, fp.batch.view()}, {.tokens = {o.logp, o.entropy}});
      } else {
        o = run_head(fused, fp);
      }
      EXPECT_EQ(std::memcmp(o.logp.data(), logp.data(), logp.size() * sizeof(float)), 0)
          << "fused forward_only=" << forward_only;
      EXPECT_EQ(std::memcmp(o.entropy.data(), entropy.data(), entropy.size() * sizeof(float)), 0)
          << "fused forward_only=" << forward_only;
    }
  }
}

// The same results for any thread count (work split by the shape), bit for bit.
TEST(LogProbHead, BitwiseIdenticalForAnyThreadCount) {
  LogProbCase c;
  c.head.spec.batch = 2;
  c.head.spec.seq_len = 50;
  c.head.spec.vocab = 333;
  c.head.hidden = 300;
  c.head.dtype = DType::bf16;
  c.head.bias = true;
  c.head.spec.seed = 6400;
  const LogProbHostProblem p = make_log_prob_problem(c, false);
  const LogProbRun one = run_log_prob(c, p, 1);
  for (const int threads : {2, 3, 7}) {
    const LogProbRun many = run_log_prob(c, p, threads);
    EXPECT_EQ(many.logp, one.logp) << threads;
    EXPECT_EQ(many.entropy, one.entropy) << threads;
    EXPECT_EQ(many.dhidden, one.dhidden) << threads;
    EXPECT_EQ(many.dweight, one.dweight) << threads;
    EXPECT_EQ(many.dbias, one.dbias) << threads;
  }
}

// Refusals before any write, naming the argument.
TEST(LogProbHead, RefusesBadArgumentsBeforeWriting) {
  LogProbCase c;
  c.head.spec.batch = 1;
  c.head.spec.seq_len = 8;
  c.head.spec.vocab = 70;
  c.head.hidden = 16;
  c.head.bias = true;
  c.head.spec.seed = 6500;
  LogProbHostProblem p = make_log_prob_problem(c, false);
  const std::int64_t n = 8, v = 70, h = 16;
  const LmHeadLogProbPlan plan(log_prob_shape(c), {}, log_prob_options(c));
  std::vector<float> dh(n * h, 5.0F), dw(v * h, 5.0F), db(v, 5.0F), logp(n, 5.0F);
  const auto expect_refusal = [&](const char* argument, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no refusal, expected one naming " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (float x : dh) ASSERT_EQ(x, 5.0F);
    for (float x : dw) ASSERT_EQ(x, 5.0F);
    for (float x : db) ASSERT_EQ(x, 5.0F);
    for (float x : logp) ASSERT_EQ(x, 5.0F);
  };
  const LogProbGradients grads{{dh.data(), DType::f32, n, h, h}, {dw.data(), DType::f32, v, h, h}, db};
  LogProbInputs in = log_prob_inputs(c, p);
  std::vector<float> bad = p.dlogp;
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  expect_refusal("dlogp", [&] { plan.backward(in, {bad, {}}, grads); });
  expect_refusal("dentropy", [&] { plan.backward(in, {p.dlogp, bad}, grads); });
  expect_refusal("dlogp", [&] { plan.backward(in, {std::span<const float>(p.dlogp).first(5), {}}, grads); });
  // An output over an upstream gradient or an input.
  expect_refusal("dbias", [&] { plan.backward(in, {std::span<const float>(db).first(n), {}}, grads); });
  std::vector<float>& mask = p.head.batch.mask;  // logp written over the mask it reads
  expect_refusal("logp", [&] { plan.forward(in, {std::span<float>(mask.data(), mask.size()), {}}); });
  std::vector<std::int32_t> ids = p.head.batch.ids;
  ids[2] = static_cast<std::int32_t>(v);
  in.ids = ids;
  expect_refusal("ids", [&] { plan.forward(in, {logp, {}}); });
  expect_refusal("ids", [&] { plan.backward(in, {p.dlogp, {}}, grads); });
  // Forward-only plans have no backward.
  LmHeadOptions fo = log_prob_options(c);
  fo.forward_only = true;
  const LmHeadLogProbPlan forward_only(log_prob_shape(c), {}, fo);
  expect_refusal("options.forward_only", [&] { forward_only.backward(log_prob_inputs(c, p), {p.dlogp, {}}, grads); });
  expect_refusal("config.temperature", [&] { LmHeadLogProbPlan(log_prob_shape(c), {0.0F}, {}); });
}

}  // namespace
}  // namespace grpo::test
