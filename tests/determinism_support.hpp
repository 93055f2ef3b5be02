// Shared by the fast and slow determinism tests: bitwise comparison, thread
// counts, and the batch-invariance probe (a row's logp and entropy computed
// in batches of different sizes and positions).
#pragma once

#include <gtest/gtest.h>

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <cstring>

#include "lm_head_support.hpp"

namespace grpo::test {

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

inline bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

inline constexpr int kThreadCounts[] = {1, 2, 3, 7};

// TBB caps workers at cores - 1 by default; the tests lift it so 7 threads
// really run (oversubscribing the 2-core machine on purpose).
inline constexpr std::size_t kMaxThreads = 8;

// Runs c with default plan options (token_block = vocab_tile = 0: chosen by
// the plan) under 1, 2, 3 and 7 threads, twice each; every output must match
// the first run bit for bit.
inline void expect_default_options_deterministic(HeadCase c) {
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, kMaxThreads);
  c.token_block = 0;
  c.vocab_tile = 0;
  SCOPED_TRACE(case_name(c));
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  std::vector<HeadOutputs> runs;
  for (int threads : kThreadCounts) {
    for (int repeat = 0; repeat < 2; ++repeat) {
      tbb::task_arena arena(threads);
      arena.execute([&] { runs.push_back(run_head(c, p)); });
    }
  }
  for (std::size_t i = 1; i < runs.size(); ++i) {
    SCOPED_TRACE("run " + std::to_string(i) + " (threads " + std::to_string(kThreadCounts[i / 2]) +
                 "): " + runs[i].schedule + " vs " + runs[0].schedule);
    EXPECT_TRUE(same_bits(runs[i].metrics.loss, runs[0].metrics.loss));
    EXPECT_TRUE(same_bits(runs[i].logp, runs[0].logp));
    EXPECT_TRUE(same_bits(runs[i].entropy, runs[0].entropy));
    EXPECT_TRUE(same_bits(runs[i].dhidden, runs[0].dhidden));
    EXPECT_TRUE(same_bits(runs[i].dweight, runs[0].dweight));
    EXPECT_TRUE(same_bits(runs[i].dbias, runs[0].dbias));
  }
}

struct TokenResult {
  std::vector<float> logp, entropy;
};

// logp and entropy of rows [first, first + n) of p's hidden states, computed
// as one call of a plan with default options over exactly those rows, laid
// out as `batch` sequences of n / batch tokens. forward_only picks the
// rollout-style plan; otherwise a training step (every row valid, advantage 1).
inline TokenResult token_outputs(const HeadCase& c, const HeadProblem& p, std::int64_t first, std::int64_t n,
                                 std::int64_t batch, bool forward_only) {
  const std::int64_t h = c.hidden, v = c.spec.vocab;
  const bool vm = c.layout == WeightLayout::vocab_major;
  const std::size_t row_bytes = static_cast<std::size_t>(h) * size_of(c.dtype);
  // A copy of exactly the rows, so nothing before or after them is addressable.
  std::vector<std::byte> hidden(p.hidden.begin() + static_cast<std::ptrdiff_t>(first * row_bytes),
                                p.hidden.begin() + static_cast<std::ptrdiff_t>((first + n) * row_bytes));
  std::vector<std::int32_t> ids(p.batch.ids.begin() + first, p.batch.ids.begin() + first + n);
  std::vector<float> mask(n, 1.0F), adv(batch, 1.0F);
  TokenResult r;
  r.logp.assign(n, -1.0F);
  r.entropy.assign(n, -1.0F);
  LmHeadShape shape{batch, n / batch, h, v, c.dtype, c.layout, c.bias, DType::f32};
  LmHeadOptions opt;
  opt.forward_only = forward_only;
  LmHeadLossPlan plan(shape, LossConfig{}, opt);
  std::vector<std::byte> dh, dw;
  std::vector<float> db;
  LmHeadOutputs out{{r.logp, r.entropy, {}}};
  if (!forward_only) {
    dh.resize(static_cast<std::size_t>(n * h) * sizeof(float));
    dw.resize(static_cast<std::size_t>(v * h) * sizeof(float));
    db.resize(c.bias ? v : 0);
    out.dhidden = {dh.data(), DType::f32, n, h, h};
    out.dweight = {dw.data(), DType::f32, vm ? v : h, vm ? h : v, vm ? h : v};
    out.dbias = db;
  }
  plan.execute({{hidden.data(), c.dtype, n, h, h},
                {p.weight.data(), c.dtype, vm ? v : h, vm ? h : v, vm ? h : v},
                c.bias ? VectorView{p.bias.data(), DType::f32, v} : VectorView{},
                {ids, mask, adv}},
               out);
  return r;
}

// Every row of [0, N) computed in sub-batches of sizes 1, 7 and 511 at
// several positions (and the whole batch as a training step) must give the
// logp and entropy of the whole-batch forward-only call, bit for bit.
inline void expect_batch_invariant(const HeadCase& c) {
  SCOPED_TRACE(case_name(c));
  const HeadProblem p = make_head_problem(c, /*with_oracle=*/false);
  const std::int64_t n = c.spec.batch * c.spec.seq_len;
  const TokenResult whole = token_outputs(c, p, 0, n, 1, /*forward_only=*/true);
  auto expect_rows = [&](std::int64_t first, std::int64_t count, std::int64_t batch, bool forward_only) {
    SCOPED_TRACE("rows [" + std::to_string(first) + ", " + std::to_string(first + count) + ") as " +
                 std::to_string(batch) + " sequences" + (forward_only ? ", forward only" : ", training step"));
    const TokenResult part = token_outputs(c, p, first, count, batch, forward_only);
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t row = first + r;
      ASSERT_EQ(std::memcmp(&part.logp[r], &whole.logp[row], 4), 0)
          << "row " << row << " logp " << part.logp[r] << " vs " << whole.logp[row];
      ASSERT_EQ(std::memcmp(&part.entropy[r], &whole.entropy[row], 4), 0)
          << "row " << row << " entropy " << part.entropy[r] << " vs " << whole.entropy[row];
    }
  };
  expect_rows(0, n, 1, /*forward_only=*/false);
  for (std::int64_t row : {std::int64_t{0}, n / 3, n - 1}) expect_rows(row, 1, 1, true);
  for (std::int64_t first : {std::int64_t{0}, std::int64_t{5}, n - 7}) expect_rows(first, 7, 7, true);
  if (n >= 1024) {
    for (std::int64_t first : {std::int64_t{0}, std::int64_t{163}, n - 511}) expect_rows(first, 511, 1, true);
    expect_rows(n - 511, 511, 1, false);
  }
}

}  // namespace grpo::test
