// The generic log-prob head (LmHeadLogProbPlan) over groups, against the
// single-process head on the same global problem, under mpirun with 1-4
// ranks (ctest label mpi). The groups mean what they mean for the fused loss
// (test_scale_out.cpp): a vocab group's ranks hold shards of W's rows (and
// bias) and every row with the same ids and the same upstream dL/dlogp,
// dL/dEnt; a data group's ranks hold their own rows, all of W, and get dW /
// dbias summed over the group (the gradient of a loss summed over every
// rank's rows). Every rank runs its part twice (forward, then backward) and
// checks its run-to-run bits; rank 0 compares the assembled outputs:
//   logp, entropy    bitwise the single process's unless the shards cut
//                    tiles (the same tile GEMMs, merged in global tile order;
//                    a data group's rows do not depend on their batch);
//   dW, dbias        bitwise with tile-aligned vocab shards (the same
//                    coefficients, tile GEMMs and token block); a data group
//                    sums per-rank f32 sums in rank order: within
//                    2 gamma_N x 1.1 sum_t |dz h| (dbias: sum_t |dz|);
//   dhidden          a vocab group adds per-shard GEMMs over K = V_q in rank
//                    order: within 2 gamma_V x 1.1 sum_v |dz W|; a data group
//                    computes a row in other GEMM calls: the same bound;
// with dz the oracle's dlogits and the bound's reason as in test_scale_out.cpp;
// and every assembled output against the double oracle within the single
// process's bounds (log_prob_head_support.hpp), unaligned shards included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "scale_out_support.hpp"

namespace grpo::test {
namespace {

// vocab-major W with bias, mask and temperature 0.9; hidden-major W without
// bias or mask, through a logit softcap and scale.
enum class Variant { bias_mask, hidden_major_softcap };

struct LogProbScaleCase {
  Mode mode;
  DType dtype;
  Variant variant;
};

std::string case_label(const LogProbScaleCase& s) {
  const char* modes[] = {"vocab", "vocab_unaligned", "data", "grid"};
  return std::string(modes[static_cast<int>(s.mode)]) + "_" + to_string(s.dtype) + "_" +
         (s.variant == Variant::bias_mask ? "bias_mask_temp09" : "hidden_major_softcap");
}

constexpr double kUnitF32 = 0x1p-24;  // unit roundoff of f32 (round to nearest)

// B = 5 sequences of T = 37 tokens, H = 64, V = 1000 in tiles of 128, blocks
// of 64 rows (three over N = 185); 30% of the rows with zero upstream.
LogProbCase global_case(const LogProbScaleCase& s, int index) {
  LogProbCase c;
  c.head.spec.batch = 5;
  c.head.spec.seq_len = 37;
  c.head.spec.vocab = 1000;
  c.head.spec.seed = 9500U + static_cast<std::uint32_t>(index);
  c.head.spec.config = config_for(LossType::grpo);
  c.head.hidden = 64;
  c.head.dtype = s.dtype;
  c.head.vocab_tile = 128;
  c.head.token_block = 64;
  if (s.variant == Variant::bias_mask) {
    c.head.bias = true;
    c.head.spec.config.temperature = 0.9F;
  } else {
    c.head.layout = WeightLayout::hidden_major;
    c.head.spec.config.logit_softcap = 8.0F;
    c.head.spec.config.logit_scale = 0.9F;
    c.mask = false;
  }
  return c;
}

class LogProbScaleOut : public ::testing::TestWithParam<LogProbScaleCase> {};

TEST_P(LogProbScaleOut, EqualsTheSingleProcessHead) {
  const LogProbScaleCase sc = GetParam();
  const int rank = world_rank(), size = world_size();
  if (sc.mode == Mode::grid && size != 4) GTEST_SKIP() << "the grid case runs with 4 ranks (2 x 2)";
  const int index = static_cast<int>(sc.mode) * 100 + static_cast<int>(sc.dtype) * 10 + static_cast<int>(sc.variant);
  const LogProbCase c = global_case(sc, index);
  const LogProbHostProblem p = make_log_prob_problem(c);
  const Layout l = layout_of(sc.mode, size);
  const Part part = part_of(c.head.spec.batch, c.head.spec.vocab, c.head.vocab_tile, l, rank);
  SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(size) + ", " + case_label(sc) + ", " +
               case_name(c) + ", part: sequences [" + std::to_string(part.seq_begin) + ", " +
               std::to_string(part.seq_end) + ") tokens [" + std::to_string(part.vocab_begin) + ", " +
               std::to_string(part.vocab_end) + ")");

  const int v_index = rank % l.vocab_ranks, d_index = rank / l.vocab_ranks;
  MPI_Comm vocab_comm = MPI_COMM_NULL, data_comm = MPI_COMM_NULL;
  if (sc.mode != Mode::data) MPI_Comm_split(MPI_COMM_WORLD, d_index, v_index, &vocab_comm);
  if (sc.mode == Mode::data || sc.mode == Mode::grid) MPI_Comm_split(MPI_COMM_WORLD, v_index, d_index, &data_comm);
  std::optional<MpiCommunicator> vocab_group, data_group;
  ScaleOut so;
  if (vocab_comm != MPI_COMM_NULL) so.vocab_group = &vocab_group.emplace(vocab_comm);
  if (data_comm != MPI_COMM_NULL) so.data_group = &data_group.emplace(data_comm);

  LogProbRun a, b;
  std::string error;
  try {
    a = run_log_prob_part(c, p, part, so);
    b = run_log_prob_part(c, p, part, so);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (vocab_comm != MPI_COMM_NULL) MPI_Comm_free(&vocab_comm);
  if (data_comm != MPI_COMM_NULL) MPI_Comm_free(&data_comm);
  ASSERT_TRUE(all_ranks(error.empty())) << "a distributed run threw: " << error;
  EXPECT_TRUE(a.logp == b.logp && a.entropy == b.entropy) << "run to run: logp / entropy";
  EXPECT_TRUE(a.dhidden == b.dhidden && a.dweight == b.dweight) << "run to run: dhidden / dweight";
  EXPECT_TRUE(same_bits(a.dbias.data(), b.dbias.data(), a.dbias.size() * sizeof(float))) << "run to run: dbias";

  // Every rank's part, assembled (dW f32 in the weight's layout, dhidden f32).
  const BatchSpec& s = c.head.spec;
  const std::int64_t h = c.head.hidden, v_all = s.vocab, n_all = s.batch * s.seq_len, t_len = s.seq_len;
  const bool vm = c.head.layout == WeightLayout::vocab_major;
  const auto parts = allgather_bytes(&part, sizeof(part));
  const auto logp = allgather_bytes(a.logp.data(), a.logp.size() * sizeof(float));
  const auto entropy = allgather_bytes(a.entropy.data(), a.entropy.size() * sizeof(float));
  const auto dhidden = allgather_bytes(a.dhidden.data(), a.dhidden.size());
  const auto dweight = allgather_bytes(a.dweight.data(), a.dweight.size());
  const auto dbias = allgather_bytes(a.dbias.data(), a.dbias.size() * sizeof(float));
  LogProbRun all;
  all.logp.assign(static_cast<std::size_t>(n_all), 0.0F);
  all.entropy = all.logp;
  all.dhidden.assign(static_cast<std::size_t>(n_all * h) * sizeof(float), std::byte{0});
  all.dweight.assign(static_cast<std::size_t>(v_all * h) * sizeof(float), std::byte{0});
  all.dbias.assign(c.head.bias ? static_cast<std::size_t>(v_all) : 0, 0.0F);
  all.schedule = a.schedule;
  for (int q = 0; q < size; ++q) {
    Part pq;
    std::memcpy(&pq, parts[q].data(), sizeof(pq));
    const std::int64_t r0 = pq.seq_begin * t_len, n = (pq.seq_end - pq.seq_begin) * t_len;
    const std::int64_t v0 = pq.vocab_begin, v = pq.vocab_end - pq.vocab_begin;
    std::memcpy(all.logp.data() + r0, logp[q].data(), static_cast<std::size_t>(n) * sizeof(float));
    std::memcpy(all.entropy.data() + r0, entropy[q].data(), static_cast<std::size_t>(n) * sizeof(float));
    std::memcpy(all.dhidden.data() + static_cast<std::size_t>(r0 * h) * sizeof(float), dhidden[q].data(),
                static_cast<std::size_t>(n * h) * sizeof(float));
    const auto* src = reinterpret_cast<const float*>(dweight[q].data());
    auto* dst = reinterpret_cast<float*>(all.dweight.data());
    for (std::int64_t a_ = 0; a_ < v; ++a_) {
      for (std::int64_t k = 0; k < h; ++k) {
        dst[vm ? (v0 + a_) * h + k : k * v_all + v0 + a_] = src[vm ? a_ * h + k : k * v + a_];
      }
    }
    if (c.head.bias) std::memcpy(all.dbias.data() + v0, dbias[q].data(), static_cast<std::size_t>(v) * sizeof(float));
  }

  // The comparisons, on rank 0 alone (the assembled outputs are the same
  // bytes on every rank); the others wait in a sleeping barrier.
  const SleepyBarrierAtExit wait_for_rank0;
  if (rank != 0) return;
  const LogProbRun single = run_log_prob(c, p, 1);
  const bool aligned = sc.mode != Mode::vocab_unaligned;
  if (aligned) {
    EXPECT_TRUE(all.logp == single.logp) << "logp";
    EXPECT_TRUE(all.entropy == single.entropy) << "entropy";
  }
  if (sc.mode == Mode::vocab) {
    EXPECT_TRUE(all.dweight == single.dweight) << "dweight";
    EXPECT_TRUE(same_bits(all.dbias.data(), single.dbias.data(), all.dbias.size() * sizeof(float))) << "dbias";
  }
  if (aligned) {
    const oracle::LogProbResult want = oracle::evaluate_log_prob_head(p.oracle);
    const std::vector<double>& dz = want.dlogits;
    constexpr double kMagnitudeSlack = 1.1;  // the kernels' sum |x_i| against the oracle's
    const double g_rows = gamma(static_cast<double>(n_all), kUnitF32);
    const double g_vocab = gamma(static_cast<double>(v_all), kUnitF32);
    const auto* got_dw = reinterpret_cast<const float*>(all.dweight.data());
    const auto* one_dw = reinterpret_cast<const float*>(single.dweight.data());
    const auto* got_dh = reinterpret_cast<const float*>(all.dhidden.data());
    const auto* one_dh = reinterpret_cast<const float*>(single.dhidden.data());
    double worst_dw = 0.0, worst_db = 0.0, worst_dh = 0.0;  // error / bound
    for (std::int64_t a_ = 0; a_ < v_all; ++a_) {
      double s_b = 0.0;
      for (std::int64_t t = 0; t < n_all; ++t) s_b += std::abs(dz[t * v_all + a_]);
      if (c.head.bias) {
        worst_db = std::max(worst_db, std::abs(double{all.dbias[a_]} - single.dbias[a_]) /
                                          (2.0 * g_rows * kMagnitudeSlack * s_b + 1e-30));
      }
      for (std::int64_t k = 0; k < h; ++k) {
        double s_w = 0.0;
        for (std::int64_t t = 0; t < n_all; ++t) s_w += std::abs(dz[t * v_all + a_] * p.oracle.lm.hidden[t * h + k]);
        const std::int64_t at = vm ? a_ * h + k : k * v_all + a_;
        worst_dw = std::max(worst_dw,
                            std::abs(double{got_dw[at]} - one_dw[at]) / (2.0 * g_rows * kMagnitudeSlack * s_w + 1e-30));
      }
    }
    for (std::int64_t t = 0; t < n_all; ++t) {
      for (std::int64_t k = 0; k < h; ++k) {
        double s_h = 0.0;
        for (std::int64_t a_ = 0; a_ < v_all; ++a_) {
          s_h += std::abs(dz[t * v_all + a_] * p.oracle.lm.weight[a_ * h + k]);
        }
        worst_dh = std::max(worst_dh, std::abs(double{got_dh[t * h + k]} - one_dh[t * h + k]) /
                                          (2.0 * g_vocab * kMagnitudeSlack * s_h + 1e-30));
      }
    }
    EXPECT_LE(worst_dw, 1.0) << "dweight: largest |distributed - single| / bound";
    EXPECT_LE(worst_db, 1.0) << "dbias: largest |distributed - single| / bound";
    EXPECT_LE(worst_dh, 1.0) << "dhidden: largest |distributed - single| / bound";
    std::printf("[ log-prob ] %-42s P=%d  dW err/bound %.3g  db %.3g  dh %.3g  dh bitwise %s\n", case_label(sc).c_str(),
                size, worst_dw, worst_db, worst_dh, all.dhidden == single.dhidden ? "yes" : "no");
  }
  // The assembled outputs against the oracle, within the single process's bounds.
  expect_log_prob_matches_oracle(c, p, all);
}

std::vector<LogProbScaleCase> all_cases() {
  std::vector<LogProbScaleCase> out;
  for (const Mode m : {Mode::vocab, Mode::vocab_unaligned, Mode::data, Mode::grid}) {
    for (const DType d : {DType::f32, DType::bf16}) {
      for (const Variant v : {Variant::bias_mask, Variant::hidden_major_softcap}) out.push_back({m, d, v});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Modes, LogProbScaleOut, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<LogProbScaleCase>& info) { return case_label(info.param); });

}  // namespace
}  // namespace grpo::test
