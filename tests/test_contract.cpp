// Promises of the public headers that no other test exercised:
// - concurrent execute() calls on one plan (distinct workspaces or none, and
//   distinct outputs) give exactly the sequential results (lm_head_loss.hpp,
//   logits_loss.hpp);
// - padded row strides (hidden_ld, weight_ld, dweight_ld, the dhidden view's
//   ld) are honoured: results match the double oracle, input padding (NaN) is
//   never used and output padding is never written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <latch>
#include <thread>

#include "determinism_support.hpp"
#include "lm_head_oracle_check.hpp"

namespace grpo::test {
namespace {

constexpr int kConcurrentIterations = 4;

// Runs f(0) and f(1) on two std::threads released together by a latch, so the
// two calls really overlap; rethrows the first exception either raised.
template <class F>
void run_pair(F&& f) {
  std::latch start(2);
  std::exception_ptr errors[2];
  auto body = [&](int i) {
    start.arrive_and_wait();
    try {
      f(i);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  std::thread a(body, 0), b(body, 1);
  a.join();
  b.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// ---------------------------------------------------------------------------
// LmHeadLossPlan: one plan, two threads.

struct HeadRun {
  HeadOutputs o;
  std::vector<std::byte> ws_storage;
  std::span<std::byte> workspace;  // empty = the library allocates
};

// Fresh outputs (filled with a value execute overwrites) and, when asked, a
// 64-byte-aligned workspace of the plan's size.
HeadRun fresh_run(const HeadCase& c, const LmHeadLossPlan& plan, bool caller_workspace) {
  const std::int64_t n = c.spec.batch * c.spec.seq_len, v = c.spec.vocab, h = c.hidden;
  HeadRun r;
  r.o.logp.assign(n, -1.0F);
  r.o.entropy.assign(n, -1.0F);
  r.o.kl.assign(n, -1.0F);
  r.o.dhidden.assign(static_cast<std::size_t>(n * h) * size_of(c.dhidden_dtype), std::byte{0x3f});
  r.o.dweight.assign(static_cast<std::size_t>(v * h) * size_of(c.dweight_dtype), std::byte{0x3f});
  r.o.dbias.assign(c.bias ? v : 0, 7.0F);
  if (caller_workspace) {
    r.ws_storage.assign(plan.workspace_size() + 64, std::byte{0x5a});
    const auto addr = reinterpret_cast<std::uintptr_t>(r.ws_storage.data());
    r.workspace = {r.ws_storage.data() + ((addr + 63) / 64 * 64 - addr), plan.workspace_size()};
  }
  return r;
}

void execute_head(const HeadCase& c, const LmHeadLossPlan& plan, const HeadProblem& p, HeadRun& r) {
  const std::int64_t n = c.spec.batch * c.spec.seq_len, v = c.spec.vocab, h = c.hidden;
  const bool vm = c.layout == WeightLayout::vocab_major;
  const std::int64_t wrows = vm ? v : h, wcols = vm ? h : v;
  plan.execute({{p.hidden.data(), c.dtype, n, h, h},
                {p.weight.data(), c.dtype, wrows, wcols, wcols},
                c.bias ? VectorView{p.bias.data(), DType::f32, v} : VectorView{},
                p.batch.view()},
               {{r.o.logp, r.o.entropy, r.o.kl},
                {r.o.dhidden.data(), c.dhidden_dtype, n, h, h},
                {r.o.dweight.data(), c.dweight_dtype, wrows, wcols, wcols},
                r.o.dbias,
                &r.o.metrics},
               r.workspace);
}

void expect_same_head_outputs(const HeadOutputs& got, const HeadOutputs& want) {
  EXPECT_TRUE(same_bits(got.metrics.loss, want.metrics.loss)) << got.metrics.loss << " vs " << want.metrics.loss;
  EXPECT_TRUE(same_bits(got.metrics.kl_mean, want.metrics.kl_mean));
  EXPECT_TRUE(same_bits(got.metrics.entropy_mean, want.metrics.entropy_mean));
  EXPECT_TRUE(same_bits(got.metrics.clip_ratio_region, want.metrics.clip_ratio_region));
  EXPECT_EQ(got.metrics.num_valid, want.metrics.num_valid);
  EXPECT_TRUE(same_bits(got.logp, want.logp));
  EXPECT_TRUE(same_bits(got.entropy, want.entropy));
  EXPECT_TRUE(same_bits(got.kl, want.kl));
  EXPECT_TRUE(same_bits(got.dhidden, want.dhidden));
  EXPECT_TRUE(same_bits(got.dweight, want.dweight));
  EXPECT_TRUE(same_bits(got.dbias, want.dbias));
}

// Several token blocks and vocab tiles (block 32, tile 64 at N = 80, V = 500),
// each call long enough (~1 ms) for the two threads to overlap.
HeadCase concurrent_head_case(DType dtype, IsLevel level) {
  HeadCase c;
  c.spec.batch = 2;
  c.spec.seq_len = 40;
  c.spec.vocab = 500;
  c.spec.config = config_for(LossType::grpo);
  c.spec.config.importance_sampling_level = level;
  c.spec.config.beta = 0.04F;
  c.spec.is_weight_kind = 1;
  c.hidden = 64;
  c.dtype = dtype;
  c.bias = true;
  c.token_block = 32;
  c.vocab_tile = 64;
  return c;
}

class ConcurrentHeadExecute : public ::testing::TestWithParam<std::tuple<DType, IsLevel, bool>> {};

TEST_P(ConcurrentHeadExecute, MatchesSequentialBitwise) {
  const auto [dtype, level, caller_workspace] = GetParam();
  HeadCase c = concurrent_head_case(dtype, level);
  c.spec.seed = 71;
  const HeadProblem first = make_head_problem(c);
  HeadCase other = c;
  other.spec.seed = 72;
  const HeadProblem second = make_head_problem(other);
  SCOPED_TRACE(case_name(c) + (caller_workspace ? " caller workspace" : " library workspace") + " (seeds 71, 72)");

  LmHeadOptions opt;
  opt.token_block = c.token_block;
  opt.vocab_tile = c.vocab_tile;
  const LmHeadLossPlan plan({c.spec.batch, c.spec.seq_len, c.hidden, c.spec.vocab, c.dtype, c.layout, c.bias},
                            c.spec.config, opt);
  SCOPED_TRACE(plan.describe());
  // Sequences of 40 tokens are longer than the 32-row block: sequence-level IS
  // runs the recompute schedule, so both schedules are exercised concurrently.
  EXPECT_EQ(plan.schedule().recompute_logits, level == IsLevel::sequence);
  const HeadProblem* problems[2] = {&first, &second};
  HeadOutputs sequential[2];
  for (int i = 0; i < 2; ++i) {
    HeadRun r = fresh_run(c, plan, caller_workspace);
    execute_head(c, plan, *problems[i], r);
    sequential[i] = std::move(r.o);
  }
  ASSERT_FALSE(same_bits(sequential[0].logp, sequential[1].logp));  // the two inputs really differ

  for (bool identical : {false, true}) {
    for (int iteration = 0; iteration < kConcurrentIterations; ++iteration) {
      SCOPED_TRACE(std::string(identical ? "identical inputs" : "different inputs") + ", iteration " +
                   std::to_string(iteration));
      HeadRun runs[2] = {fresh_run(c, plan, caller_workspace), fresh_run(c, plan, caller_workspace)};
      run_pair([&](int i) { execute_head(c, plan, *problems[identical ? 0 : i], runs[i]); });
      for (int i = 0; i < 2; ++i) {
        SCOPED_TRACE("thread " + std::to_string(i));
        expect_same_head_outputs(runs[i].o, sequential[identical ? 0 : i]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Contract, ConcurrentHeadExecute,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(IsLevel::token, IsLevel::sequence), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_" +
                                  to_string(std::get<1>(info.param)) + "_" +
                                  (std::get<2>(info.param) ? "caller_workspace" : "library_workspace");
                         });

// ---------------------------------------------------------------------------
// LogitsLossPlan: one plan, two threads (it takes no workspace).

struct LogitsProblem {
  HostBatch batch;
  std::vector<std::byte> logits;  // [N, V] in the case's dtype
};

LogitsProblem make_logits_problem(const BatchSpec& s, DType dtype) {
  std::mt19937 rng(s.seed);
  LogitsProblem p;
  p.batch.problem.logits = make_logits(s, rng);
  fill_batch(s, p.batch, rng);
  store(p.batch.problem.logits, dtype, p.logits);
  return p;
}

struct LogitsRun {
  std::vector<float> logp, entropy, kl;
  std::vector<std::byte> dlogits;
  Metrics metrics;
};

LogitsRun execute_logits(const LogitsLossPlan& plan, const LogitsProblem& p, DType dtype) {
  const LogitsShape& s = plan.shape();
  const std::int64_t n = s.batch * s.seq_len;
  LogitsRun r;
  r.logp.assign(n, -1.0F);
  r.entropy.assign(n, -1.0F);
  r.kl.assign(n, -1.0F);
  r.dlogits.assign(p.logits.size(), std::byte{0x3f});
  plan.execute({p.logits.data(), dtype, n, s.vocab, s.vocab}, p.batch.view(),
               {{r.logp, r.entropy, r.kl}, {r.dlogits.data(), dtype, n, s.vocab, s.vocab}, &r.metrics});
  return r;
}

class ConcurrentLogitsExecute : public ::testing::TestWithParam<DType> {};

TEST_P(ConcurrentLogitsExecute, MatchesSequentialBitwise) {
  const DType dtype = GetParam();
  BatchSpec s{4, 33, 1000, config_for(LossType::dapo)};
  s.config.beta = 0.04F;
  s.seed = 81;
  const LogitsProblem first = make_logits_problem(s, dtype);
  s.seed = 82;
  const LogitsProblem second = make_logits_problem(s, dtype);
  SCOPED_TRACE(describe(s) + " dtype=" + to_string(dtype) + " (seeds 81, 82)");
  const LogitsLossPlan plan({s.batch, s.seq_len, s.vocab, dtype}, s.config);
  const LogitsProblem* problems[2] = {&first, &second};
  const LogitsRun sequential[2] = {execute_logits(plan, first, dtype), execute_logits(plan, second, dtype)};
  ASSERT_FALSE(same_bits(sequential[0].logp, sequential[1].logp));

  for (bool identical : {false, true}) {
    for (int iteration = 0; iteration < kConcurrentIterations; ++iteration) {
      SCOPED_TRACE(std::string(identical ? "identical inputs" : "different inputs") + ", iteration " +
                   std::to_string(iteration));
      LogitsRun runs[2];
      run_pair([&](int i) { runs[i] = execute_logits(plan, *problems[identical ? 0 : i], dtype); });
      for (int i = 0; i < 2; ++i) {
        SCOPED_TRACE("thread " + std::to_string(i));
        const LogitsRun& want = sequential[identical ? 0 : i];
        EXPECT_TRUE(same_bits(runs[i].metrics.loss, want.metrics.loss));
        EXPECT_TRUE(same_bits(runs[i].metrics.kl_mean, want.metrics.kl_mean));
        EXPECT_TRUE(same_bits(runs[i].metrics.entropy_mean, want.metrics.entropy_mean));
        EXPECT_TRUE(same_bits(runs[i].logp, want.logp));
        EXPECT_TRUE(same_bits(runs[i].entropy, want.entropy));
        EXPECT_TRUE(same_bits(runs[i].kl, want.kl));
        EXPECT_TRUE(same_bits(runs[i].dlogits, want.dlogits));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Contract, ConcurrentLogitsExecute, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// ---------------------------------------------------------------------------
// Padded row strides against the double oracle, with the bounds of
// test_lm_head.cpp (expect_head_matches_oracle): the padding changes where
// elements live, not the arithmetic, so the same derived tolerances apply.

class PaddedStrides : public ::testing::TestWithParam<HeadCase> {};

TEST_P(PaddedStrides, MatchOracleAndLeavePaddingAlone) {
  const HeadCase& c = GetParam();
  const HeadProblem p = make_head_problem(c);
  const HeadOutputs got = run_head(c, p);
  EXPECT_EQ(got.padding_bytes_written, 0U) << case_name(c) << ": output padding was written";
  expect_head_matches_oracle(c, p, got);
}

std::vector<HeadCase> padded_cases() {
  // (B, T, V, H) around the 32-row block and the 32-column tile; pads odd
  // (rows start misaligned) and large (a whole extra cache line or more).
  struct Shape {
    std::int64_t b, t, v, h;
  };
  const Shape shapes[] = {{1, 33, 65, 20}, {2, 17, 97, 24}, {3, 11, 63, 8}, {1, 65, 33, 40}};
  const std::int64_t pads[][4] = {{3, 5, 7, 1}, {16, 64, 32, 17}, {1, 1, 1, 1}, {9, 0, 3, 0}};
  std::vector<HeadCase> cases;
  int i = 0;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (WeightLayout layout : {WeightLayout::vocab_major, WeightLayout::hidden_major}) {
      for (int variant = 0; variant < 2; ++variant) {
        HeadCase c;
        const Shape& sh = shapes[i % std::size(shapes)];
        c.spec.batch = sh.b;
        c.spec.seq_len = sh.t;
        c.spec.vocab = sh.v;
        c.hidden = sh.h;
        c.spec.config = config_for(variant == 0 ? LossType::grpo : LossType::dapo);
        // Sequence level on T = 11 (blocks aligned to sequences) and T = 65 (recompute).
        c.spec.config.importance_sampling_level = i % 4 >= 2 ? IsLevel::sequence : IsLevel::token;
        c.spec.config.beta = variant == 1 ? 0.04F : 0.0F;
        c.spec.is_weight_kind = i % 3;
        c.spec.seed = 9100 + i;
        c.dtype = dtype;
        c.layout = layout;
        c.bias = variant == 0;
        c.accumulate = i % 4 == 1;
        c.dhidden_dtype = i % 4 == 3 ? DType::bf16 : DType::f32;
        c.dweight_dtype = dtype == DType::bf16 && !c.accumulate && variant == 1 ? DType::bf16 : DType::f32;
        c.token_block = 32;
        c.vocab_tile = 32;
        const auto& pad = pads[i % std::size(pads)];
        c.hidden_pad = pad[0];
        c.weight_pad = pad[1];
        c.dweight_pad = pad[2];
        c.dhidden_pad = pad[3];
        cases.push_back(c);
        ++i;
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Contract, PaddedStrides, ::testing::ValuesIn(padded_cases()));

}  // namespace
}  // namespace grpo::test
