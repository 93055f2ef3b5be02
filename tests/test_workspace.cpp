// Memory: the plan's workspace stays within the budget whatever N is (checked
// at the headline shape without running its GEMMs), and a run allocates
// exactly the plan's workspace and nothing else through the allocator.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <optional>

#include "driver/lm_head_plan.hpp"
#include "lm_head_support.hpp"

namespace grpo::test {
namespace {

LmHeadShape headline(std::int64_t seq_len, DType dtype) {
  return {1, seq_len, 4096, 151936, dtype, WeightLayout::vocab_major, false, DType::f32};
}

TEST(Workspace, WithinBudgetAtHeadlineShape) {
  for (DType dtype : {DType::bf16, DType::f32}) {
    for (std::size_t budget : {kDefaultWorkspaceBudget, std::size_t{256} << 20, std::size_t{64} << 20}) {
      LmHeadOptions opt;
      opt.workspace_budget = budget;
      const LmHeadLossPlan plan(headline(8192, dtype), LossConfig{}, opt);
      SCOPED_TRACE(plan.describe());
      EXPECT_LE(plan.workspace_size(), budget);
      EXPECT_EQ(plan.schedule().workspace_bytes, plan.workspace_size());
      EXPECT_FALSE(plan.schedule().recompute_logits);
      // The budget is used, not ignored: a block of at least 32 rows, at most N.
      EXPECT_GE(plan.schedule().token_block, 32);
      EXPECT_LE(plan.schedule().token_block, 8192);
      // Independent of N: the same plan at T = 1024 needs the same bytes
      // whenever the block is below 1024 rows.
      const LmHeadLossPlan small(headline(1024, dtype), LossConfig{}, opt);
      if (plan.schedule().token_block < 1024) EXPECT_EQ(small.workspace_size(), plan.workspace_size());
    }
  }
}

TEST(Workspace, SequenceLevelRecomputeAndForwardOnlyWithinBudget) {
  LossConfig gspo;
  gspo.importance_sampling_level = IsLevel::sequence;
  const LmHeadLossPlan recompute(headline(8192, DType::bf16), gspo);
  SCOPED_TRACE(recompute.describe());
  EXPECT_TRUE(recompute.schedule().recompute_logits);  // one 8192-token sequence spans blocks
  EXPECT_LE(recompute.workspace_size(), kDefaultWorkspaceBudget);
  LmHeadOptions fwd;
  fwd.forward_only = true;
  const LmHeadLossPlan forward(headline(8192, DType::bf16), LossConfig{}, fwd);
  EXPECT_LE(forward.workspace_size(), kDefaultWorkspaceBudget);
}

// The default budget: the whole vocabulary's for an unsharded plan, a vocab
// shard's share of it (never below the floor); an explicit budget as given.
TEST(Workspace, DefaultBudgetIsTheShardsShare) {
  const LmHeadShape whole = headline(8192, DType::bf16);
  EXPECT_EQ(detail::plan_workspace_budget(whole, LmHeadOptions{}), kDefaultWorkspaceBudget);
  LmHeadShape half = whole;
  half.vocab = 75968;
  half.vocab_offset = 75968;
  half.global_vocab = 151936;
  EXPECT_EQ(detail::plan_workspace_budget(half, LmHeadOptions{}), kDefaultWorkspaceBudget / 2);
  LmHeadShape sliver = whole;
  sliver.vocab = 2374;
  sliver.global_vocab = 151936;
  EXPECT_EQ(detail::plan_workspace_budget(sliver, LmHeadOptions{}), kMinAutoWorkspaceBudget);
  LmHeadOptions given;
  given.workspace_budget = std::size_t{300} << 20;
  EXPECT_EQ(detail::plan_workspace_budget(half, given), given.workspace_budget);
  EXPECT_EQ(detail::plan_workspace_budget(whole, given), given.workspace_budget);
}

TEST(Workspace, BudgetTooSmallIsRefused) {
  LmHeadOptions opt;
  opt.workspace_budget = 1 << 20;  // 1 MiB cannot hold 32 rows of a 151936-wide block
  try {
    LmHeadLossPlan plan(headline(8192, DType::bf16), LossConfig{}, opt);
    FAIL() << "a 1 MiB budget was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "options.workspace_budget");
  }
}

// A budget that holds fewer slots than the plan's threads runs fewer, and
// describe() says so, with the budget that would run them all.
TEST(Workspace, FewerSlotsThanThreadsAreDescribed) {
  const LmHeadShape shape{1, 512, 256, 4096, DType::bf16, WeightLayout::vocab_major, false, DType::f32};
  const auto plan_with = [&](int threads, std::size_t budget) {
    LmHeadOptions opt;
    opt.token_block = 256;
    opt.max_threads = threads;
    opt.workspace_budget = budget;
    std::optional<LmHeadLossPlan> plan;
    tbb::task_arena arena(threads);
    arena.execute([&] { plan.emplace(shape, LossConfig{}, opt); });
    return std::move(*plan);
  };
  const std::size_t roomy = std::size_t{1} << 30;
  const std::size_t one = plan_with(1, roomy).workspace_size();
  const LmHeadLossPlan two = plan_with(2, roomy);
  ASSERT_EQ(two.schedule().slots, 2) << two.describe();
  ASSERT_GT(two.workspace_size(), one);
  EXPECT_NE(two.describe().find(" threads=2 "), std::string::npos) << two.describe();

  const LmHeadLossPlan tight = plan_with(2, one);
  EXPECT_EQ(tight.schedule().slots, 1);
  EXPECT_EQ(tight.workspace_size(), one);
  EXPECT_NE(tight.describe().find(" threads=1 (of 2: options.workspace_budget " + std::to_string(one) +
                                  "B holds 1 slot beside the token block; 2 take " +
                                  std::to_string(two.workspace_size()) + "B) "),
            std::string::npos)
      << tight.describe();
}

TEST(Workspace, TrackedPeakEqualsPlanWorkspace) {
  HeadCase c;
  c.spec = {2, 100, 5000, config_for(LossType::grpo)};
  c.spec.seed = 5;
  c.hidden = 256;
  c.dtype = DType::bf16;
  c.bias = true;
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  const std::int64_t n = 200, v = 5000, h = 256;
  std::vector<float> logp(n), dh(n * h), dw(v * h), db(v);
  LmHeadShape shape{2, 100, h, v, DType::bf16, WeightLayout::vocab_major, true, DType::f32};
  LmHeadInputs in{{p.hidden.data(), DType::bf16, n, h, h},
                  {p.weight.data(), DType::bf16, v, h, h},
                  {p.bias.data(), DType::f32, v},
                  p.batch.view()};
  LmHeadOutputs out{{logp, {}, {}}, {dh.data(), DType::f32, n, h, h}, {dw.data(), DType::f32, v, h, h}, db, nullptr};
  TrackingAllocator tracker;
  LmHeadOptions opt;
  opt.allocator = &tracker;
  opt.token_block = 64;  // several blocks, a partial last one
  const LmHeadLossPlan plan(shape, c.spec.config, opt);
  SCOPED_TRACE(plan.describe());
  ASSERT_EQ(tracker.allocation_count(), 0U);  // plan creation allocates no workspace
  for (int step = 0; step < 2; ++step) {
    tracker.reset_peak();
    plan.execute(in, out);
    EXPECT_EQ(tracker.peak_bytes(), plan.workspace_size());
    EXPECT_EQ(tracker.live_bytes(), 0U);
  }
  // With the caller's workspace nothing at all goes through the allocator.
  std::vector<std::byte> storage(plan.workspace_size() + 64);
  auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(storage.data()) + 63) / 64 * 64);
  const std::size_t before = tracker.allocation_count();
  plan.execute(in, out, {aligned, plan.workspace_size()});
  EXPECT_EQ(tracker.allocation_count(), before);
}

TEST(Workspace, BaselineTracksItsMaterializedLogits) {
  HeadCase c;
  c.spec = {1, 64, 3000, config_for(LossType::grpo)};
  c.hidden = 64;
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  const std::int64_t n = 64, v = 3000, h = 64;
  std::vector<float> logp(n), dh(n * h), dw(v * h);
  LmHeadShape shape{1, 64, h, v, DType::f32};
  LmHeadInputs in{{p.hidden.data(), DType::f32, n, h, h}, {p.weight.data(), DType::f32, v, h, h}, {}, p.batch.view()};
  LmHeadOutputs out{{logp, {}, {}}, {dh.data(), DType::f32, n, h, h}, {dw.data(), DType::f32, v, h, h}, {}, nullptr};
  TrackingAllocator tracker;
  LmHeadBaselineOptions opt;
  opt.allocator = &tracker;
  LmHeadBaseline(shape, c.spec.config, opt).execute(in, out);
  // logits + log_softmax + softmax (f32) + dlogits (f32): four [N, V] arrays at least.
  EXPECT_GE(tracker.peak_bytes(), 4U * n * v * sizeof(float));
  EXPECT_EQ(tracker.live_bytes(), 0U);
}

}  // namespace
}  // namespace grpo::test
