// The acceptance shape of determinism and batch invariance: B=1 T=2048 H=256
// V=151936 with default options, bf16 and f32.
#include "determinism_support.hpp"

namespace grpo::test {
namespace {

HeadCase acceptance_case(DType dtype) {
  HeadCase c;
  c.spec = {1, 2048, 151936, config_for(LossType::grpo)};
  c.spec.config.beta = 0.04F;
  c.spec.seed = 401;
  c.hidden = 256;
  c.dtype = dtype;
  return c;
}

TEST(SlowDeterminism, DefaultOptionsAcrossThreadCountsAtV151936) {
  for (DType dtype : {DType::bf16, DType::f32}) expect_default_options_deterministic(acceptance_case(dtype));
}

TEST(SlowBatchInvariance, RowsAloneAndInBatchesAtV151936) {
  for (DType dtype : {DType::bf16, DType::f32}) expect_batch_invariant(acceptance_case(dtype));
}

}  // namespace
}  // namespace grpo::test
