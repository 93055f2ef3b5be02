// Bitwise-identical outputs for any thread count (1, 2, 3, 7) and run to run:
// work is split by the shape and reduced in index order, never by thread.
#include "determinism_support.hpp"

namespace grpo::test {
namespace {

TEST(Determinism, LogitsLevelAcrossThreadCounts) {
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, kMaxThreads);
  for (DType dtype : {DType::f32, DType::bf16}) {
    BatchSpec s{2, 9, 5003, config_for(LossType::grpo)};
    s.config.beta = 0.04F;
    s.config.temperature = 0.7F;
    s.seed = 31;
    SCOPED_TRACE(describe(s) + " dtype=" + to_string(dtype));
    std::mt19937 rng(s.seed);
    HostBatch h;
    h.problem.logits = make_logits(s, rng);
    fill_batch(s, h, rng);
    const std::int64_t n = s.batch * s.seq_len;
    std::vector<std::byte> logits;
    store(h.problem.logits, dtype, logits);
    struct Out {
      std::vector<float> logp, entropy, kl;
      std::vector<std::byte> dlogits;
      Metrics m;
    };
    std::vector<Out> runs;
    for (int threads : kThreadCounts) {
      for (int repeat = 0; repeat < 2; ++repeat) {
        Out o;
        o.logp.resize(n);
        o.entropy.resize(n);
        o.kl.resize(n);
        o.dlogits.resize(logits.size());
        tbb::task_arena arena(threads);
        arena.execute([&] {
          LogitsLossPlan plan({s.batch, s.seq_len, s.vocab, dtype}, s.config);
          plan.execute({logits.data(), dtype, n, s.vocab, s.vocab}, h.view(),
                       {{o.logp, o.entropy, o.kl}, {o.dlogits.data(), dtype, n, s.vocab, s.vocab}, &o.m});
        });
        runs.push_back(std::move(o));
      }
    }
    for (std::size_t i = 1; i < runs.size(); ++i) {
      SCOPED_TRACE("run " + std::to_string(i) + " (threads " + std::to_string(kThreadCounts[i / 2]) + ")");
      EXPECT_TRUE(same_bits(runs[i].m.loss, runs[0].m.loss));
      EXPECT_TRUE(same_bits(runs[i].logp, runs[0].logp));
      EXPECT_TRUE(same_bits(runs[i].entropy, runs[0].entropy));
      EXPECT_TRUE(same_bits(runs[i].dlogits, runs[0].dlogits));
    }
  }
}

TEST(Determinism, LmHeadAcrossThreadCounts) {
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, kMaxThreads);
  // Several blocks, several tiles, two hidden chunks, bias and sequence-level IS
  // in one case, so every reduction (tile merge, dbias, dweight across blocks) runs.
  for (int variant = 0; variant < 2; ++variant) {
    HeadCase c;
    c.spec = {3, 40, 1000, config_for(variant == 0 ? LossType::grpo : LossType::dapo)};
    c.spec.config.importance_sampling_level = variant == 0 ? IsLevel::token : IsLevel::sequence;
    c.spec.config.beta = 0.04F;
    c.spec.seed = 97 + variant;
    c.hidden = 300;
    c.dtype = variant == 0 ? DType::bf16 : DType::f32;
    c.layout = variant == 0 ? WeightLayout::vocab_major : WeightLayout::hidden_major;
    c.bias = true;
    c.token_block = 64;
    c.vocab_tile = 128;
    SCOPED_TRACE(case_name(c));
    const HeadProblem p = make_head_problem(c);
    std::vector<HeadOutputs> runs;
    for (int threads : kThreadCounts) {
      for (int repeat = 0; repeat < 2; ++repeat) {
        tbb::task_arena arena(threads);
        arena.execute([&] { runs.push_back(run_head(c, p)); });
      }
    }
    for (std::size_t i = 1; i < runs.size(); ++i) {
      SCOPED_TRACE("run " + std::to_string(i) + " (threads " + std::to_string(kThreadCounts[i / 2]) + ")");
      EXPECT_TRUE(same_bits(runs[i].metrics.loss, runs[0].metrics.loss));
      EXPECT_TRUE(same_bits(runs[i].logp, runs[0].logp));
      EXPECT_TRUE(same_bits(runs[i].entropy, runs[0].entropy));
      EXPECT_TRUE(same_bits(runs[i].dhidden, runs[0].dhidden));
      EXPECT_TRUE(same_bits(runs[i].dweight, runs[0].dweight));
      EXPECT_TRUE(same_bits(runs[i].dbias, runs[0].dbias));
    }
    // The schedule really used the threads it was given.
    EXPECT_NE(runs.back().schedule.find("threads=7"), std::string::npos) << runs.back().schedule;
  }
}

// Default options: the plan picks the token block and the vocab tile itself,
// and they must not follow the thread count. Small V so several blocks and
// tiles run in the fast tier; the slow tier repeats it at V = 151936.
TEST(Determinism, LmHeadDefaultOptionsAcrossThreadCounts) {
  for (DType dtype : {DType::bf16, DType::f32}) {
    HeadCase c;
    c.spec = {1, 700, 5003, config_for(LossType::grpo)};
    c.spec.config.beta = 0.04F;
    c.spec.seed = 211;
    c.hidden = 64;
    c.dtype = dtype;
    c.bias = true;
    expect_default_options_deterministic(c);
  }
}

TEST(BatchInvariance, LogpAndEntropyOfARowDoNotDependOnItsBatch) {
  for (DType dtype : {DType::bf16, DType::f32}) {
    HeadCase c;
    c.spec = {1, 1100, 3001, config_for(LossType::grpo)};
    c.spec.seed = 223;
    c.hidden = 96;
    c.dtype = dtype;
    expect_batch_invariant(c);
  }
}

// A block whose packed hidden rows are more than the forward GEMM takes whole
// (GemmTraits::max_shared_rows; 8 MiB of packed rows: 1024 at H = 4096 for
// the avx512bf16 backend, 512 for avx512fma's f32) runs its forward in equal calls of at most that many rows, and a
// shorter last block past it in calls of its own: the loss and every row's
// outputs bitwise a small-block plan's (dW sums the blocks, so its bits
// follow the block size).
TEST(BatchInvariance, ForwardCallsSplitPastTheSharedRowCap) {
  HeadCase c;
  c.spec = {1, 3420, 257, config_for(LossType::grpo)};  // a 1920-row block, then 1500 rows
  c.spec.seed = 227;
  c.hidden = 4096;
  c.dtype = DType::bf16;
  c.vocab_tile = 0;
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  c.token_block = 1920;  // a requested block is a multiple of 160 (kForwardRows)
  const HeadOutputs big = run_head(c, p);
  c.token_block = 160;
  const HeadOutputs small = run_head(c, p);
  SCOPED_TRACE(big.schedule + " vs " + small.schedule);
  EXPECT_TRUE(same_bits(big.metrics.loss, small.metrics.loss));
  EXPECT_TRUE(same_bits(big.logp, small.logp));
  EXPECT_TRUE(same_bits(big.entropy, small.entropy));
  EXPECT_TRUE(same_bits(big.dhidden, small.dhidden));
  const bool fma = big.schedule.find("forward:grpo:avx512_fma") != std::string::npos;
  if (!fma && big.schedule.find("forward:grpo:avx512_bf16") == std::string::npos) {
    GTEST_SKIP() << "the forward runs neither avx512bf16 nor avx512fma GEMMs on this CPU (the backends whose "
                    "shared-row cap this shape reaches: amx's bounds its partial sums, so a 257-column W tile takes "
                    "thousands of rows): "
                 << big.schedule;
  }
  EXPECT_NE(big.schedule.find("token_block=1920 "), std::string::npos);
  if (fma) {
    EXPECT_NE(big.schedule.find("forward_rows=480 "), std::string::npos);
    // 4 x 480 rows, then the last block's 1500 (1504 rounded to 32) in 4 x 384.
    EXPECT_EQ(big.stats.logits_gemm_rows, 1920 + 4 * 384);
    return;
  }
  EXPECT_NE(big.schedule.find("forward_rows=960 "), std::string::npos);
  // 2 x 960 rows, then the last block's 1500 (1504 rounded to 32) in 2 x 768.
  EXPECT_EQ(big.stats.logits_gemm_rows, 1920 + 2 * 768);
}

}  // namespace
}  // namespace grpo::test
