// fp16 models (issue 48): what is particular to an f16 step beside the oracle
// cases (test_lm_head.cpp, F16): its gradients saturate at +-65504 and say so,
// it is deterministic, and what it does not offer is refused by name.
#include <cmath>

#include "determinism_support.hpp"
#include "kernels/f16.hpp"

namespace grpo::test {
namespace {

HeadCase f16_case() {
  HeadCase c;
  c.spec = {2, 21, 150, config_for(LossType::grpo)};
  c.spec.config.beta = 0.04F;
  c.spec.seed = 48;
  c.hidden = 40;
  c.dtype = DType::f16;
  c.bias = true;
  c.bias_dtype = DType::f16;
  c.dhidden_dtype = DType::f16;
  c.dweight_dtype = DType::f16;
  return c;
}

std::vector<float> f16_values(const std::vector<std::byte>& bytes) {
  return to_float(bytes.data(), DType::f16, bytes.size() / 2);
}

// A gradient past f16's range is written as +-65504, never inf, and counted:
// the same step with f32 gradients says which entries are past it. One token
// block, so each dW entry is written once (the count is per write).
TEST(F16, GradientsPastTheRangeSaturateAndAreCounted) {
  HeadCase c = f16_case();
  c.token_block = 64;  // all 42 rows
  c.grad_scale = std::ldexp(1.0, 24);
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  const HeadOutputs got = run_head(c, p);
  HeadCase wide = c;
  wide.dhidden_dtype = DType::f32;
  wide.dweight_dtype = DType::f32;
  const HeadOutputs ref = run_head(wide, p);
  const std::vector<float> ref_dh = to_float(ref.dhidden.data(), DType::f32, ref.dhidden.size() / 4);
  const std::vector<float> ref_dw = to_float(ref.dweight.data(), DType::f32, ref.dweight.size() / 4);
  std::int64_t saturated = 0, past = 0;
  const auto check = [&](const std::vector<float>& f16, const std::vector<float>& f32, const char* name) {
    ASSERT_EQ(f16.size(), f32.size());
    for (std::size_t i = 0; i < f16.size(); ++i) {
      ASSERT_TRUE(std::isfinite(f16[i])) << name << "[" << i << "]";
      const double mag = std::fabs(f32[i]);
      if (std::fabs(f16[i]) == 65504.0F && mag >= 65520.0 * (1.0 - 1e-4)) ++saturated;
      if (mag >= 65520.0 * (1.0 + 1e-4)) {  // clearly past: saturated, with its sign
        ++past;
        EXPECT_EQ(f16[i], std::copysign(65504.0F, f32[i])) << name << "[" << i << "]";
      } else if (mag < 65504.0 * (1.0 - 1e-4)) {  // clearly inside: rounded once (and f32 vs widened f16 GEMMs)
        EXPECT_NEAR(f16[i], f32[i], mag * 1e-3 + 1e-6) << name << "[" << i << "]";
      }
    }
  };
  check(f16_values(got.dhidden), ref_dh, "dhidden");
  check(f16_values(got.dweight), ref_dw, "dweight");
  ASSERT_GT(past, 0) << "the scale did not push any gradient past 65504";
  EXPECT_GE(got.stats.f16_saturated, past);
  EXPECT_EQ(got.stats.f16_saturated, saturated);
  EXPECT_EQ(ref.stats.f16_saturated, 0);
  // The loss and per-token outputs do not depend on the gradients' dtype.
  EXPECT_TRUE(same_bits(got.logp, ref.logp));
  EXPECT_TRUE(same_bits(double(got.metrics.loss), double(ref.metrics.loss)));
}

// Within the range nothing saturates, and the count says 0.
TEST(F16, InRangeGradientsCountNothing) {
  const HeadCase c = f16_case();
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  const HeadOutputs got = run_head(c, p);
  EXPECT_EQ(got.stats.f16_saturated, 0);
}

// Bitwise the same at every thread count and block choice the plan makes.
TEST(F16, DefaultOptionsDeterministic) {
  HeadCase c = f16_case();
  c.layout = WeightLayout::hidden_major;
  expect_default_options_deterministic(c);
}

// What f16 does not offer is refused, naming the argument.
TEST(F16, RefusalsNameTheArgument) {
  const LossConfig config = config_for(LossType::grpo);
  const auto refused = [&](auto&& make, const char* argument, ErrorKind kind) {
    try {
      make();
      ADD_FAILURE() << "not refused: " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_EQ(e.kind(), kind) << e.what();
    }
  };
  const LmHeadShape bf16{1, 4, 8, 16, DType::bf16};
  const LmHeadShape f16{1, 4, 8, 16, DType::f16};
  refused([&] { LmHeadLossPlan(bf16, config, {.dweight_dtype = DType::f16}); }, "options.dweight_dtype",
          ErrorKind::unsupported);
  refused([&] { LmHeadLossPlan(f16, config, {.grad_filter = kGradFilterAuto}); }, "options.grad_filter",
          ErrorKind::unsupported);
  refused([&] { LmHeadBaseline(f16, config, {}); }, "shape.dtype", ErrorKind::unsupported);
  LmHeadShape bad_bias = f16;
  bad_bias.has_bias = true;
  bad_bias.bias_dtype = static_cast<DType>(7);
  refused([&] { LmHeadLossPlan(bad_bias, config, {}); }, "shape.bias_dtype", ErrorKind::invalid_argument);
  // An f16 plan given bf16 data.
  const LmHeadLossPlan plan(f16, config, {.forward_only = true});
  std::vector<std::uint16_t> h(4 * 8, 0x3c00), w(16 * 8, 0x3c00);
  std::vector<std::int32_t> ids(4, 1);
  std::vector<float> adv(1, 1.0F), logp(4);
  BatchInputs batch;
  batch.ids = ids;
  batch.advantages = adv;
  refused(
      [&] {
        plan.execute({{h.data(), DType::bf16, 4, 8, 8}, {w.data(), DType::f16, 16, 8, 8}, {}, batch}, {{logp}});
      },
      "hidden", ErrorKind::invalid_argument);
}

}  // namespace
}  // namespace grpo::test
