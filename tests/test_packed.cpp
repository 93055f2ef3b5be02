// Packed sequences (BatchInputs::sequence_offsets, cu_seqlens): a packed call
// equals the padded call on the same tokens. The padded problem is B
// sequences of T rows whose tails past each length L_i are padding (masked);
// the packed one holds rows [i T, i T + L_i) back to back, offsets the
// running sums of L. Every loss type, sequence-level IS, per-sequence and
// per-token advantages and is_weight, the off-policy mask, a KL term.
//   - rows of both calls in one token block: every output bitwise (the same
//     active rows in the same GEMMs);
//   - small token blocks (several sequences per block; sequences crossing
//     blocks, or, for rules that need whole sequences, blocks ending on
//     sequence boundaries; with blocks shorter than a sequence those rules
//     take the two-pass schedule): logp,
//     entropy, kl, the loss and the metrics bitwise (the coefficient stage
//     sums the same rows in the same order), dhidden bitwise (one row's sum
//     over the vocabulary), and every output within the double oracle's bounds
//     of the padded problem (dW and dbias group rows by block differently).
// And the refusals: offsets not increasing, not from 0, not ending at N, with
// batch != 1, and per-sequence inputs of the padded B.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lm_head_oracle_check.hpp"
#include "lm_head_support.hpp"

namespace grpo::test {
namespace {

struct Packed {
  HeadCase c;
  HeadProblem p;
  std::vector<std::int64_t> rows;  // packed row r is padded row rows[r]
};

// Pads the tails of p's sequences (lengths drawn in [1, T]) and packs the rest.
Packed pack(const HeadCase& padded_case, HeadProblem& padded, std::uint32_t seed) {
  const BatchSpec& s = padded_case.spec;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> length(1, s.seq_len);
  Packed out;
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t i = 0; i < s.batch; ++i) {
    const std::int64_t len = i == 0 ? s.seq_len : length(rng);  // one full-length sequence
    for (std::int64_t t = 0; t < s.seq_len; ++t) {
      const std::int64_t r = i * s.seq_len + t;
      if (t >= len) {
        padded.batch.mask[r] = 0.0F;
        padded.oracle.head.mask[r] = 0.0;
      } else {
        out.rows.push_back(r);
      }
    }
    offsets.push_back(offsets.back() + len);
  }
  const auto n = static_cast<std::int64_t>(out.rows.size());
  out.c = padded_case;
  out.c.spec.batch = 1;
  out.c.spec.seq_len = n;
  HeadProblem& q = out.p;
  q.weight = padded.weight;
  q.bias = padded.bias;
  const std::size_t row_bytes = static_cast<std::size_t>(padded_case.hidden) * size_of(padded_case.dtype);
  q.hidden.resize(static_cast<std::size_t>(n) * row_bytes);
  const HostBatch& b = padded.batch;
  HostBatch& pb = q.batch;
  const bool adv_per_token = b.advantages.size() == b.mask.size();
  const bool isw_per_token = b.is_weight.size() == b.mask.size();
  for (std::int64_t r = 0; r < n; ++r) {
    const auto from = static_cast<std::size_t>(out.rows[r]);
    std::memcpy(q.hidden.data() + static_cast<std::size_t>(r) * row_bytes, padded.hidden.data() + from * row_bytes,
                row_bytes);
    pb.ids.push_back(b.ids[from]);
    pb.mask.push_back(b.mask[from]);
    if (adv_per_token) pb.advantages.push_back(b.advantages[from]);
    if (!b.old_logp.empty()) pb.old_logp.push_back(b.old_logp[from]);
    if (!b.ref_logp.empty()) pb.ref_logp.push_back(b.ref_logp[from]);
    if (isw_per_token) pb.is_weight.push_back(b.is_weight[from]);
  }
  if (!adv_per_token) pb.advantages = b.advantages;  // per sequence: [S] = [B]
  if (!isw_per_token) pb.is_weight = b.is_weight;
  pb.sequence_offsets = offsets;
  return out;
}

std::uint32_t bits(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

struct PackedCase {
  const char* name;
  LossType loss;
  IsLevel level = IsLevel::token;
  bool per_token_advantages = false;
  int is_weight_kind = 0;
  float beta = 0.0F;
  bool off_policy_mask = false;
  float entropy_coef = 0.0F;
};

class PackedEqualsPadded : public ::testing::TestWithParam<PackedCase> {};

void expect_packed_equals_padded(const PackedCase& pc, std::int64_t token_block, DType dtype) {
  HeadCase c;
  c.spec.batch = 6;
  c.spec.seq_len = 24;
  c.spec.vocab = 96;
  c.spec.seed = 11;
  c.spec.per_token_advantages = pc.per_token_advantages;
  c.spec.is_weight_kind = pc.is_weight_kind;
  c.spec.mask_fraction = 0.15;
  LossConfig& cfg = c.spec.config;
  cfg.loss_type = pc.loss;
  cfg.importance_sampling_level = pc.level;
  cfg.beta = pc.beta;
  cfg.entropy_coef = pc.entropy_coef;
  if (pc.off_policy_mask) cfg.off_policy_mask_threshold = 0.05F;
  if (pc.loss == LossType::dr_grpo) cfg.max_completion_length = c.spec.seq_len;
  // dapo / cispo / vespo: the caller's global token count, the same constant for both calls.
  if (pc.loss == LossType::dapo || pc.loss == LossType::cispo || pc.loss == LossType::vespo) {
    cfg.num_items_in_batch = 100.0;
  }
  c.hidden = 24;
  c.dtype = dtype;
  c.token_block = token_block;
  c.vocab_tile = 32;
  c.dhidden_dtype = dtype;
  c.dweight_dtype = DType::f32;
  c.bias = true;
  HeadProblem padded = make_head_problem(c);
  Packed packed = pack(c, padded, 5);
  SCOPED_TRACE(std::string(pc.name) + " token_block " + std::to_string(token_block) + " " + to_string(dtype));
  const HeadOutputs want = run_head(c, padded);
  const HeadOutputs got = run_head(packed.c, packed.p);
  SCOPED_TRACE("padded: " + want.schedule + " packed: " + got.schedule);
  const auto n = static_cast<std::int64_t>(packed.rows.size());
  const std::size_t dh_row = static_cast<std::size_t>(c.hidden) * size_of(c.dhidden_dtype);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto from = static_cast<std::size_t>(packed.rows[r]);
    ASSERT_EQ(bits(got.logp[r]), bits(want.logp[from])) << "logp row " << r;
    ASSERT_EQ(bits(got.entropy[r]), bits(want.entropy[from])) << "entropy row " << r;
    ASSERT_EQ(bits(got.kl[r]), bits(want.kl[from])) << "kl row " << r;
    ASSERT_EQ(std::memcmp(got.dhidden.data() + static_cast<std::size_t>(r) * dh_row,
                          want.dhidden.data() + from * dh_row, dh_row),
              0)
        << "dhidden row " << r;
  }
  EXPECT_EQ(got.metrics.loss, want.metrics.loss);
  EXPECT_EQ(got.metrics.clip_ratio_low, want.metrics.clip_ratio_low);
  EXPECT_EQ(got.metrics.clip_ratio_high, want.metrics.clip_ratio_high);
  EXPECT_EQ(got.metrics.clip_ratio_region, want.metrics.clip_ratio_region);
  EXPECT_EQ(got.metrics.kl_mean, want.metrics.kl_mean);
  EXPECT_EQ(got.metrics.entropy_mean, want.metrics.entropy_mean);
  EXPECT_EQ(got.metrics.num_valid, want.metrics.num_valid);
  if (token_block >= c.spec.batch * c.spec.seq_len) {
    EXPECT_EQ(got.dweight, want.dweight);
    EXPECT_EQ(got.dbias, want.dbias);
  }
  // The packed outputs in the padded layout, against the oracle of the padded
  // problem. Rows the packed call does not have (padding) take the padded
  // call's values: only the packed rows are under test.
  HeadOutputs mapped = want;
  mapped.metrics = got.metrics;
  mapped.dweight = got.dweight;
  mapped.dbias = got.dbias;
  for (std::int64_t r = 0; r < n; ++r) {
    const auto from = static_cast<std::size_t>(packed.rows[r]);
    mapped.logp[from] = got.logp[r];
    mapped.entropy[from] = got.entropy[r];
    mapped.kl[from] = got.kl[r];
    std::memcpy(mapped.dhidden.data() + from * dh_row, got.dhidden.data() + static_cast<std::size_t>(r) * dh_row,
                dh_row);
  }
  expect_head_matches_oracle(c, padded, mapped);
}

TEST_P(PackedEqualsPadded, OneBlockBitwise) { expect_packed_equals_padded(GetParam(), 4096, DType::f32); }

TEST_P(PackedEqualsPadded, SequencesCrossingBlocks) { expect_packed_equals_padded(GetParam(), 32, DType::f32); }

TEST_P(PackedEqualsPadded, SequencesCrossingBlocksBf16) { expect_packed_equals_padded(GetParam(), 32, DType::bf16); }

// Blocks shorter than the longest sequence (24 rows): a rule that needs whole
// sequences takes the two-pass schedule, packed and padded alike.
TEST_P(PackedEqualsPadded, SequencesLongerThanBlocks) { expect_packed_equals_padded(GetParam(), 16, DType::f32); }

INSTANTIATE_TEST_SUITE_P(
    Losses, PackedEqualsPadded,
    ::testing::Values(PackedCase{"grpo", LossType::grpo}, PackedCase{"bnpo", LossType::bnpo},
                      PackedCase{"dr_grpo", LossType::dr_grpo},
                      PackedCase{"dapo_kl", LossType::dapo, IsLevel::token, false, 0, 0.04F},
                      PackedCase{"cispo", LossType::cispo}, PackedCase{"sapo", LossType::sapo},
                      PackedCase{"luspo", LossType::luspo, IsLevel::sequence},
                      PackedCase{"vespo_is_weight", LossType::vespo, IsLevel::token, true, 1},
                      PackedCase{"gspo", LossType::grpo, IsLevel::sequence},
                      PackedCase{"gspo_token_adv", LossType::grpo, IsLevel::sequence, true},
                      PackedCase{"grpo_token_adv_seq_is_weight", LossType::grpo, IsLevel::token, true, 2},
                      PackedCase{"off_policy_mask", LossType::grpo, IsLevel::token, false, 0, 0.0F, true},
                      PackedCase{"entropy_bonus", LossType::bnpo, IsLevel::token, false, 0, 0.0F, false, 0.01F}),
    [](const ::testing::TestParamInfo<PackedCase>& info) { return std::string(info.param.name); });

// Refusals name sequence_offsets (or the per-sequence input) and say why.
void expect_refused(const HeadCase& c, const HeadProblem& p, const std::string& argument, const std::string& says) {
  try {
    run_head(c, p);
    FAIL() << "accepted; expected a refusal naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(PackedSequences, BadOffsetsAreRefused) {
  HeadCase c;
  c.spec.batch = 3;
  c.spec.seq_len = 8;
  c.spec.vocab = 40;
  c.hidden = 8;
  HeadProblem padded = make_head_problem(c);
  Packed packed = pack(c, padded, 3);
  const std::vector<std::int64_t> good = packed.p.batch.sequence_offsets;
  const std::int64_t n = good.back();
  auto with = [&](std::vector<std::int64_t> offsets) {
    Packed q = packed;
    q.p.batch.sequence_offsets = std::move(offsets);
    return q;
  };
  {
    Packed q = with({0, 5, 5, n});
    q.p.batch.advantages.assign(3, 1.0F);
    expect_refused(q.c, q.p, "sequence_offsets", "must increase");
  }
  {
    Packed q = with({0, 6, 3, n});
    q.p.batch.advantages.assign(3, 1.0F);
    expect_refused(q.c, q.p, "sequence_offsets", "element 2 = 3 is not above element 1 = 6");
  }
  expect_refused(with({1, good[1], good[2], n}).c, with({1, good[1], good[2], n}).p, "sequence_offsets", "starts at 1");
  expect_refused(with({0, good[1], good[2], n + 1}).c, with({0, good[1], good[2], n + 1}).p, "sequence_offsets",
                 "ends at " + std::to_string(n + 1) + ", not at the " + std::to_string(n) + " rows");
  expect_refused(with({0}).c, with({0}).p, "sequence_offsets", "S + 1 offsets");
  {
    // Per-sequence advantages must have S entries.
    Packed q = with({0, good[1], n});
    expect_refused(q.c, q.p, "advantages", "expected 2 (per packed sequence)");
  }
  {
    // Offsets with a shape of several rows.
    HeadProblem p2 = padded;
    p2.batch.sequence_offsets = {0, 8, 16, 24};
    expect_refused(c, p2, "sequence_offsets", "shape.batch = 1");
  }
}

}  // namespace
}  // namespace grpo::test
