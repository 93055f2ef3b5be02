// A plan's own memory (issue 21): its backward GEMMs come in one shape per
// rung of the row ladder (driver/lm_head_plan.hpp RowLadder), so their count
// grows with the log of the token block, not with the block; the plan
// reports its GEMM count and bytes (LmHeadSchedule::gemm_count / plan_bytes,
// describe()). And the ladder's padding is what the step runs: outputs at
// blocks past the dense rungs match the oracle, for both heads.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <string>

#include "api/lm_head_validate.hpp"
#include "driver/lm_head_plan.hpp"
#include "lm_head_oracle_check.hpp"
#include "log_prob_head_support.hpp"

namespace grpo::test {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr std::size_t kPlanBytesDivisor = 4;
#else
constexpr std::size_t kPlanBytesDivisor = 8;
#endif

using detail::kRowQuantum;
using detail::RowLadder;

// Rungs a ladder may have: 2 * rungs multiples of 32 up to 64 * rungs, then
// `rungs` per doubling, plus the top.
std::size_t max_rungs(std::int64_t top, std::int64_t rungs) {
  const std::int64_t dense = 2 * kRowQuantum * rungs;
  if (top <= dense) return static_cast<std::size_t>(top / kRowQuantum);
  const auto doublings = static_cast<std::int64_t>(std::ceil(std::log2(static_cast<double>(top) / dense)));
  return static_cast<std::size_t>(2 * rungs + rungs * doublings + 1);
}

TEST(RowLadder, CoversEveryActiveRowCountWithBoundedPadding) {
  for (const std::int64_t rungs : {detail::kLadderRungsOnednn, detail::kLadderRungsOwn}) {
    for (const std::int64_t top : {32, 160, 512, 544, 4096, 4128, 70080, 140160}) {
      SCOPED_TRACE("rungs=" + std::to_string(rungs) + " top=" + std::to_string(top));
      const RowLadder ladder(top, rungs);
      const std::vector<std::int64_t>& e = ladder.entries();
      ASSERT_FALSE(e.empty());
      EXPECT_EQ(e.back(), top);
      EXPECT_LE(e.size(), max_rungs(top, rungs));
      for (std::size_t i = 0; i < e.size(); ++i) {
        EXPECT_EQ(e[i] % kRowQuantum, 0) << "rung " << i;
        if (i > 0) EXPECT_LT(e[i - 1], e[i]) << "rung " << i;
      }
      EXPECT_EQ(ladder.padded(0), 0);
      for (std::int64_t r = 1; r <= top; ++r) {
        const std::size_t i = ladder.index_of(r);
        ASSERT_LT(i, e.size()) << "active " << r;
        const std::int64_t padded = ladder.padded(r);
        ASSERT_EQ(padded, e[i]);
        ASSERT_GE(padded, r);
        if (i > 0) ASSERT_LT(e[i - 1], r) << "active " << r << ": a lower rung would do";
        // Up to 2 * 32 * rungs rows: the next multiple of 32, as before the
        // ladder. Past 32 * rungs: under 1 / rungs of the rows.
        if (r <= 2 * kRowQuantum * rungs) {
          ASSERT_EQ(padded, std::min(top, (r + kRowQuantum - 1) / kRowQuantum * kRowQuantum)) << "active " << r;
        }
        if (r > kRowQuantum * rungs) ASSERT_LT(padded * rungs, r * (rungs + 1)) << "active " << r;
      }
    }
  }
}

LmHeadShape tiny_head(std::int64_t seq_len, DType dtype) {
  return {1, seq_len, 8, 16, dtype, WeightLayout::vocab_major, false, DType::f32};
}

// The case: H = 8, V = 16 at T = 70000 and 140000, where a 256 MiB
// budget (the default then, kept here for the tighter bound) takes every row
// in one block. f32 runs oneDNN (a primitive is tens of KiB), bf16 our
// backend where the CPU has AMX (oneDNN otherwise).
// Before the ladder: 13142 GEMMs and ~620 MiB at T = 70000 (f32), twice that
// at 140000.
TEST(PlanMemory, GemmCountAndBytesDoNotGrowWithTheBlock) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    LmHeadOptions options;
    options.workspace_budget = std::size_t{256} << 20;
    const LmHeadLossPlan small(tiny_head(70000, dtype), LossConfig{}, options);
    const LmHeadLossPlan big(tiny_head(140000, dtype), LossConfig{}, options);
    const LmHeadSchedule& a = small.schedule();
    const LmHeadSchedule& b = big.schedule();
    SCOPED_TRACE(small.describe());
    SCOPED_TRACE(big.describe());
    ASSERT_EQ(a.token_block, 70000);  // one block: the ladder's top is the block
    ASSERT_EQ(b.token_block, 140000);
    // Twice the block, a few more rungs: 6 backward GEMMs (4 dW, 2 dhidden)
    // per rung; the oneDNN ladder has 8 rungs per doubling, ours 64.
    EXPECT_LE(b.gemm_count, a.gemm_count + 6 * detail::kLadderRungsOwn + 6);
    EXPECT_LT(b.gemm_count * 4, a.gemm_count * 5);
    EXPECT_LE(a.gemm_count, 2 + 6 * max_rungs(70080, detail::kLadderRungsOwn));
    // Bytes: a plan measures its own (process-wide, so another thread could
    // add to it; none runs here). Bound: an eighth of the budget (the whole
    // budget is 256 MiB; the workspace takes 12-27 MiB here), whichever T.
    // Under AddressSanitizer every allocation carries redzones (measured: 36
    // MiB for the f32 plan that takes 21 MiB without): a quarter there.
    EXPECT_GT(a.plan_bytes, 0U);
    EXPECT_LE(a.plan_bytes, options.workspace_budget / kPlanBytesDivisor);
    EXPECT_LE(b.plan_bytes, options.workspace_budget / kPlanBytesDivisor);
    // describe() names both.
    for (const LmHeadLossPlan* p : {&small, &big}) {
      const std::string d = p->describe();
      EXPECT_NE(d.find(" plan=" + std::to_string(p->schedule().plan_bytes) + "B (" +
                       std::to_string(p->schedule().gemm_count) + " gemms"),
                std::string::npos);
    }
  }
}

// The plan's ladder ends at its block and pads every active row count of a
// block to a rung it built GEMMs for; the generic head's plan alike.
TEST(PlanMemory, PlanLadderCoversItsBlock) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const auto p = detail::build_lm_head_plan(detail::resolve_lds(tiny_head(70000, dtype)), LossConfig{}, {});
    const RowLadder& ladder = p->row_ladder;
    ASSERT_EQ(ladder.entries().back(), p->block_rows_alloc);
    ASSERT_EQ(p->backward.dweight.size(), ladder.entries().size());
    ASSERT_EQ(p->backward.dhidden.size(), ladder.entries().size());
    EXPECT_EQ(p->schedule.gemm_count, p->gemms.size());
    for (std::int64_t r = 1; r <= p->schedule.token_block; ++r) {
      ASSERT_GE(ladder.padded(r), r);
      ASSERT_LE(ladder.padded(r), p->block_rows_alloc);
    }
  }
  const LogProbConfig config;
  const LmHeadLogProbPlan generic(tiny_head(70000, DType::f32), config);
  SCOPED_TRACE(generic.describe());
  // f32 runs on oneDNN (8 rungs a doubling) where the CPU has AVX-512, on
  // our avx2 backend (64) where it has not.
  const std::int64_t rungs =
      generic.describe().find("grpo:avx2") != std::string::npos ? detail::kLadderRungsOwn : detail::kLadderRungsOnednn;
  EXPECT_LE(generic.schedule().gemm_count, 2 + 6 * max_rungs(70080, rungs));
  EXPECT_NE(generic.describe().find(" plan=" + std::to_string(generic.schedule().plan_bytes) + "B"), std::string::npos);
}

// A block past the dense rungs (oneDNN's 512 rows, ours 4096; the plan makes
// it 960 rows of f32 (960 + 140) and 8960 of bf16 (8960 + 40)), about 2/3 of
// its rows active: the backward runs on the ladder's padding (zero rows) and
// every output matches the oracle, bitwise alike for 1 and 2 threads.
HeadCase big_block_case(DType dtype, std::int64_t rows) {
  HeadCase c;
  c.spec = {1, rows, 40, config_for(LossType::grpo)};
  c.spec.mask_fraction = 0.3;
  c.spec.seed = 2105;
  c.hidden = 16;
  c.dtype = dtype;
  c.token_block = rows;
  c.vocab_tile = 0;
  return c;
}

TEST(PlanMemory, LadderPaddedBlocksMatchOracle) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const HeadCase c = big_block_case(dtype, dtype == DType::f32 ? 1100 : 9000);
    const HeadProblem p = make_head_problem(c);
    const HeadOutputs got = run_head(c, p, 2);
    expect_head_matches_oracle(c, p, got);
    // The padding is the ladder's: per block, under max(32, active / 8) rows
    // (two blocks here).
    EXPECT_GE(got.stats.dhidden_gemm_rows, got.stats.active_rows);
    EXPECT_LE(got.stats.dhidden_gemm_rows * 8, got.stats.active_rows * 9 + 2 * 8 * kRowQuantum);
    const HeadOutputs one = run_head(c, p, 1);
    EXPECT_EQ(one.dhidden, got.dhidden);
    EXPECT_EQ(one.dweight, got.dweight);
    EXPECT_EQ(one.logp, got.logp);
  }
}

TEST(PlanMemory, LadderPaddedBlocksMatchOracleLogProbHead) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    LogProbCase c;
    c.head = big_block_case(dtype, dtype == DType::f32 ? 1100 : 9000);
    c.head.spec.mask_fraction = 0.1;
    c.zero_fraction = 0.3;
    const LogProbHostProblem p = make_log_prob_problem(c);
    const LogProbRun got = run_log_prob(c, p);
    expect_log_prob_matches_oracle(c, p, got);
    EXPECT_GE(got.backward_stats.dhidden_gemm_rows, got.backward_stats.active_rows);
    EXPECT_LE(got.backward_stats.dhidden_gemm_rows * 8, got.backward_stats.active_rows * 9 + 2 * 8 * kRowQuantum);
  }
}

}  // namespace
}  // namespace grpo::test
