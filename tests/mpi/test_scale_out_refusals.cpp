// Refusals over several processes: a bad argument on one rank is a refusal
// on every rank (the agreement records), naming the argument, and nobody is
// left waiting in a collective: every test then runs a valid step with the
// same ranks. Also the single-process entry points that take no groups, and a
// vocabulary shard whose bias bans all of its tokens (allowed while another
// shard allows some).
#include <gtest/gtest.h>

#include <limits>

#include "scale_out_support.hpp"

namespace grpo::test {
namespace {

HeadCase small_case() {
  HeadCase c;
  c.spec.batch = 4;
  c.spec.seq_len = 9;
  c.spec.vocab = 300;
  c.spec.seed = 77;
  c.spec.config = config_for(LossType::grpo);
  c.hidden = 32;
  c.vocab_tile = 64;
  c.token_block = 0;
  c.bias = true;
  return c;
}

// This rank's part under vocabulary or data parallelism over the world.
Part vocab_part(const HeadCase& c) {
  const auto b = shard_bounds(c.spec.vocab, c.vocab_tile, world_size(), true);
  return {0, c.spec.batch, b[world_rank()], b[world_rank() + 1]};
}
Part data_part(const HeadCase& c) {
  return {seq_bound(c.spec.batch, world_size(), world_rank()), seq_bound(c.spec.batch, world_size(), world_rank() + 1),
          0, c.spec.vocab};
}

// Runs f, returns the refused argument ("" when nothing was refused).
template <class F>
std::string refused_argument(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.argument();
  }
  return "";
}

class ScaleOutRefusal : public ::testing::Test {
 protected:
  ScaleOutRefusal() : world_(MPI_COMM_WORLD) {
    c_ = small_case();
    p_ = make_head_problem(c_);
  }
  ScaleOut vocab() const { return {.vocab_group = &world_}; }
  ScaleOut data() const { return {.data_group = &world_}; }
  // A valid step afterwards: the group is still in step.
  void expect_valid_step(const ScaleOut& so, const Part& part) {
    std::string error;
    try {
      run_part(c_, p_, part, so, c_.spec.config);
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_EQ(error, "") << "a valid step after the refusal";
  }

  MpiCommunicator world_;
  HeadCase c_;
  HeadProblem p_;
};

TEST_F(ScaleOutRefusal, ShardsThatDoNotTileTheVocabulary) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  Part part = vocab_part(c_);
  // Rank 0's shard starts one token late.
  if (world_rank() == 0) part.vocab_begin += 1;
  const std::string arg = refused_argument([&] { run_part(c_, p_, part, vocab(), c_.spec.config); });
  EXPECT_EQ(arg, "shape.vocab_offset");
  expect_valid_step(vocab(), vocab_part(c_));
}

TEST_F(ScaleOutRefusal, OneRankRefusedAtPlanCreation) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  HeadCase c = c_;
  // The last rank alone asks for a bf16 dweight of f32 inputs.
  if (world_rank() == world_size() - 1) c.dweight_dtype = DType::bf16;
  const std::string arg = refused_argument([&] { run_part(c, p_, data_part(c_), data(), c_.spec.config); });
  EXPECT_EQ(arg, "options.dweight_dtype");
  expect_valid_step(data(), data_part(c_));
}

TEST_F(ScaleOutRefusal, AnIdOutsideTheGlobalVocabularyOnOneRank) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  HeadProblem bad = p_;
  // The last rank's first valid row chooses token V (one past the global vocabulary).
  const Part part = data_part(c_);
  if (world_rank() == world_size() - 1) {
    for (std::int64_t r = part.seq_begin * c_.spec.seq_len;; ++r) {
      if (bad.batch.mask[r] != 0.0F) {
        bad.batch.ids[r] = static_cast<std::int32_t>(c_.spec.vocab);
        break;
      }
    }
  }
  const std::string arg = refused_argument([&] { run_part(c_, bad, part, data(), c_.spec.config); });
  EXPECT_EQ(arg, "ids");
  expect_valid_step(data(), part);
  // Vocabulary parallelism: a global id beyond this rank's shard is fine, beyond global_vocab is not.
  HeadProblem bad_vp = p_;
  for (std::int64_t r = 0;; ++r) {
    if (bad_vp.batch.mask[r] != 0.0F) {
      bad_vp.batch.ids[r] = static_cast<std::int32_t>(c_.spec.vocab);
      break;
    }
  }
  EXPECT_EQ(refused_argument([&] { run_part(c_, bad_vp, vocab_part(c_), vocab(), c_.spec.config); }), "ids");
}

TEST_F(ScaleOutRefusal, PerTokenInputsThatDifferInTheVocabGroup) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  HeadProblem other = p_;
  if (world_rank() == 1) other.batch.advantages[0] += 1.0F;
  EXPECT_EQ(refused_argument([&] { run_part(c_, other, vocab_part(c_), vocab(), c_.spec.config); }), "batch");
  expect_valid_step(vocab(), vocab_part(c_));
}

TEST_F(ScaleOutRefusal, AKlBeyondF32MetInsideTheScheduleOfOneRank) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  HeadCase c = c_;
  c.spec.config.beta = 0.04F;
  HeadProblem p = make_head_problem(c);
  const Part part = data_part(c);
  // ref_logp - logp > 88.7 on the last rank's last valid row: the k3 KL
  // overflows f32, which only the schedule sees (it needs logp).
  if (world_rank() == world_size() - 1) {
    for (std::int64_t r = part.seq_end * c.spec.seq_len - 1;; --r) {
      if (p.batch.mask[r] != 0.0F) {
        p.batch.ref_logp[r] = 100.0F;
        break;
      }
    }
  }
  EXPECT_EQ(refused_argument([&] { run_part(c, p, part, data(), c.spec.config); }), "ref_logp");
  expect_valid_step(data(), part);
}

TEST_F(ScaleOutRefusal, LocalRefusals) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  // Every rank alike: refused before any exchange (or, with a group, at the
  // plan's agreement).
  EXPECT_EQ(refused_argument([&] {
              LmHeadOptions o;
              o.accumulate_weight_grads = true;
              o.scale_out = data();
              LmHeadLossPlan({.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 300}, c_.spec.config, o);
            }),
            "options.accumulate_weight_grads");
  EXPECT_EQ(refused_argument([&] {
              LmHeadLossPlan(
                  {.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 100, .vocab_offset = 100, .global_vocab = 300},
                  c_.spec.config);
            }),
            "shape.global_vocab");
  EXPECT_EQ(refused_argument([&] {
              LossConfig dapo = config_for(LossType::dapo);  // num_items_in_batch 37
              LmHeadOptions o;
              o.scale_out = {.data_group = &world_, .global_num_items = true};
              LmHeadLossPlan({.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 300}, dapo, o);
            }),
            "config.num_items_in_batch");
  EXPECT_EQ(refused_argument([&] {
              LmHeadOptions o;
              o.scale_out = {.data_group = &world_, .global_num_items = true};
              LmHeadLossPlan({.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 300}, c_.spec.config, o);
            }),
            "options.scale_out.global_num_items");
  EXPECT_EQ(refused_argument([&] {
              LossConfig topk = c_.spec.config;
              topk.top_entropy_quantile = 0.4F;  // a quantile per rank is not the batch's
              LmHeadOptions o;
              o.scale_out = data();
              LmHeadLossPlan({.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 300}, topk, o);
            }),
            "config.top_entropy_quantile");
  EXPECT_EQ(refused_argument([&] {
              LmHeadOptions o;
              o.scale_out = data();
              LmHeadLogProbPlan({.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 300}, LogProbConfig{}, o);
            }),
            "options.scale_out");
  EXPECT_EQ(refused_argument([&] {
              LmHeadBaseline(
                  {.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 100, .vocab_offset = 0, .global_vocab = 300},
                  c_.spec.config);
            }),
            "shape.global_vocab");
  expect_valid_step(data(), data_part(c_));
}

TEST_F(ScaleOutRefusal, AShardWhoseBiasBansAllItsTokens) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  // Tokens [0, 64), the first tile and so rank 0's first tile, are banned:
  // valid ids move off them. The logp is still the single process's, bitwise.
  HeadProblem p = p_;
  auto* bias = reinterpret_cast<float*>(p.bias.data());
  for (std::int64_t v = 0; v < 64; ++v) bias[v] = -std::numeric_limits<float>::infinity();
  for (std::int32_t& id : p.batch.ids) id = id < 64 ? id + 64 : id;
  const HeadOutputs single = run_head(c_, p, 1);
  HeadOutputs got;
  std::string error;
  try {
    got = run_part(c_, p, vocab_part(c_), vocab(), c_.spec.config);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "");
  EXPECT_TRUE(got.logp == single.logp);
  // Every token banned: refused on every rank, naming the bias (every row
  // masked, so no valid row's id is refused first for choosing a banned token).
  for (std::int64_t v = 0; v < c_.spec.vocab; ++v) bias[v] = -std::numeric_limits<float>::infinity();
  std::fill(p.batch.mask.begin(), p.batch.mask.end(), 0.0F);
  EXPECT_EQ(refused_argument([&] { run_part(c_, p, vocab_part(c_), vocab(), c_.spec.config); }), "bias");
  expect_valid_step(vocab(), vocab_part(c_));
}

}  // namespace
}  // namespace grpo::test
