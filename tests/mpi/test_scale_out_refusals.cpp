// Refusals over several processes: a bad argument on one rank is a refusal
// on every rank (the agreement records), naming the argument, and nobody is
// left waiting in a collective: every test then runs a valid step with the
// same ranks. Also the single-process entry points that take no groups, a
// vocabulary shard whose bias bans all of its tokens (allowed while another
// shard allows some), and the generic log-prob head's refusals.
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
              // The generic head takes groups, but a shard still needs a vocab group.
              LmHeadOptions o;
              o.scale_out = data();
              LmHeadLogProbPlan(
                  {.batch = 1, .seq_len = 9, .hidden = 32, .vocab = 100, .vocab_offset = 0, .global_vocab = 300},
                  LogProbConfig{}, o);
            }),
            "shape.global_vocab");
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

// The generic log-prob head: plan creation, forward() and backward() refuse
// together, in Python-facing order: a refusal at one call leaves the group
// ready for the next.
class LogProbRefusal : public ::testing::Test {
 protected:
  LogProbRefusal() : world_(MPI_COMM_WORLD) {
    c_.head = small_case();
    c_.head.token_block = 16;
    p_ = make_log_prob_problem(c_, false);
  }
  ScaleOut vocab() const { return {.vocab_group = &world_}; }
  ScaleOut data() const { return {.data_group = &world_}; }
  Part vocab_part() const { return grpo::test::vocab_part(c_.head); }
  Part data_part() const { return grpo::test::data_part(c_.head); }
  std::string run(const LogProbHostProblem& p, const Part& part, const ScaleOut& so) const {
    return refused_argument([&] { run_log_prob_part(c_, p, part, so); });
  }
  // The first valid row of this rank's part.
  std::int64_t first_valid(const Part& part) const {
    for (std::int64_t r = part.seq_begin * c_.head.spec.seq_len;; ++r) {
      if (p_.head.batch.mask[r] != 0.0F) return r;
    }
  }

  MpiCommunicator world_;
  LogProbCase c_;
  LogProbHostProblem p_;
};

TEST_F(LogProbRefusal, OneRankRefusesEveryRankRaises) {
  SCOPED_TRACE("rank " + std::to_string(world_rank()));
  const bool last = world_rank() == world_size() - 1;
  // Plan creation: the temperature differs on the last rank (it must be shared).
  {
    LogProbCase c = c_;
    if (last && world_size() > 1) c.head.spec.config.temperature = 0.5F;
    const std::string arg = refused_argument([&] { run_log_prob_part(c, p_, data_part(), data()); });
    EXPECT_EQ(arg, world_size() > 1 ? "config" : "");
  }
  // forward(): an id beyond the vocabulary on the last rank of a data group.
  {
    LogProbHostProblem bad = p_;
    if (last) bad.head.batch.ids[first_valid(data_part())] = static_cast<std::int32_t>(c_.head.spec.vocab);
    EXPECT_EQ(run(bad, data_part(), data()), "ids");
  }
  // backward(): a non-finite dlogp on the last rank of a data group.
  {
    LogProbHostProblem bad = p_;
    if (last) bad.dlogp[first_valid(data_part())] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(run(bad, data_part(), data()), "dlogp");
  }
  // A vocab group whose last rank holds another upstream gradient.
  if (world_size() > 1) {
    LogProbHostProblem other = p_;
    if (last) other.dlogp[first_valid(vocab_part())] += 1.0F;
    EXPECT_EQ(run(other, vocab_part(), vocab()), "dlogp");
    // ... or another label (forward() already refuses).
    LogProbHostProblem moved = p_;
    const std::int64_t r = first_valid(vocab_part());
    if (last) moved.head.batch.ids[r] = (moved.head.batch.ids[r] + 1) % static_cast<std::int32_t>(c_.head.spec.vocab);
    EXPECT_EQ(run(moved, vocab_part(), vocab()), "ids");
  }
  // The group is still in step: valid calls in both groups.
  EXPECT_EQ(run(p_, data_part(), data()), "");
  EXPECT_EQ(run(p_, vocab_part(), vocab()), "");
}

}  // namespace
}  // namespace grpo::test
