// Vocabulary-parallel, data-parallel and grid (2 x 2) steps against the
// single-process plan over the same global problem, under mpirun with 1-4
// ranks (ctest label mpi; tests/mpi/CMakeLists.txt). Every rank builds the
// same seeded global problem and runs its own part through a plan with
// groups, twice; rank 0 also runs the single-process plan on all of it.
// Checked on every rank:
//  - run to run: the two distributed runs are bitwise identical;
//  - across ranks: the metrics are the same bits on every rank;
// then, on rank 0 (the assembled global outputs are the same bytes on every
// rank):
//  - against the single process, bitwise where the schedule makes the same
//    floating-point operations in the same order:
//      logp, entropy, kl   every mode except unaligned shards (the forward
//                          GEMM calls always have forward_rows rows, so a
//                          row's logits do not depend on its batch, and the
//                          vocab group merges every tile's statistics in
//                          global tile order, the single process's order,
//                          when shard boundaries are tile boundaries);
//      loss, metrics, dW, dbias   vocab parallelism with tile-aligned shards
//                          (same coefficients, same per-tile GEMMs and the
//                          same token block);
//    and within a bound derived from the summation order where it differs:
//      dhidden (vocab group: per-shard GEMMs over K = V_q, then a rank-order
//      sum; data group: other GEMM row counts), dW / dbias (data group:
//      per-rank sums, then a rank-order sum), the loss and the means
//      (data group: double sums split by rank).
//    The bound: two floating-point evaluations of sum_{i<n} x_i in any
//    association, each within gamma_n sum |x_i| of the exact sum
//    (gamma_n = n u / (1 - n u), products rounded once included), differ by at
//    most 2 gamma_n sum |x_i|. The terms' magnitudes come from the oracle's
//    dlogits: inputs are drawn away from every kink of the loss (fill_batch),
//    so the kernels' dlogits equal the oracle's to ~2^-8 relative (the bf16
//    rounding; f16 storage of x - max adds < 2^-11), and 1.1 sum |x_i| bounds
//    the kernels' sum |x_i|.
//  - against the double oracle, the assembled global outputs within the
//    bounds the single-process tests use (lm_head_oracle_check.hpp): the
//    P-rank step is held to the single process's accuracy, including
//    unaligned shards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "lm_head_oracle_check.hpp"
#include "scale_out_support.hpp"

namespace grpo::test {
namespace {

enum class LossKind { grpo_kl, dapo, gspo, features };

struct ScaleCase {
  Mode mode;
  DType dtype;
  LossKind loss;
};

const char* name_of(Mode m) {
  switch (m) {
    case Mode::vocab: return "vocab";
    case Mode::vocab_unaligned: return "vocab_unaligned";
    case Mode::data: return "data";
    case Mode::grid: return "grid";
  }
  return "?";
}
const char* name_of(LossKind l) {
  switch (l) {
    case LossKind::grpo_kl: return "grpo_kl_bias";
    case LossKind::dapo: return "dapo_hidden_major";
    case LossKind::gspo: return "gspo_spanning_blocks";
    case LossKind::features: return "entropy_bonus_softcap_topk";
  }
  return "?";
}

std::string case_label(const ScaleCase& s) {
  return std::string(name_of(s.mode)) + "_" + to_string(s.dtype) + "_" + name_of(s.loss);
}

constexpr double kUnitF32 = 0x1p-24;  // unit roundoff of f32 (round to nearest)
constexpr double kUnitF64 = 0x1p-53;

// The global problem: B = 5 sequences of T = 37 tokens (20% masked), H = 64,
// V = 1000 in vocab tiles of 128 (7 full tiles and one of 104).
HeadCase global_case(const ScaleCase& s, int index) {
  HeadCase c;
  c.spec.batch = 5;
  c.spec.seq_len = 37;
  c.spec.vocab = 1000;
  c.spec.seed = 9000U + static_cast<std::uint32_t>(index);
  c.hidden = 64;
  c.dtype = s.dtype;
  c.vocab_tile = 128;
  c.token_block = 64;  // three blocks over N = 185 rows
  switch (s.loss) {
    case LossKind::grpo_kl:
      c.spec.config = config_for(LossType::grpo);
      c.spec.config.beta = 0.04F;  // KL against ref_logp
      c.bias = true;
      break;
    case LossKind::dapo:
      c.spec.config = config_for(LossType::dapo);  // num_items_in_batch: the valid-token count, set below
      c.layout = WeightLayout::hidden_major;
      c.spec.per_token_advantages = true;
      break;
    case LossKind::gspo:
      c.spec.config = config_for(LossType::grpo);
      c.spec.config.importance_sampling_level = IsLevel::sequence;
      c.token_block = 32;  // < T: sequences span blocks, the two-pass schedule
      c.bias = true;
      break;
    case LossKind::features:
      // The entropy bonus (its dEnt/dx term in the dlogits tile), a logit
      // softcap and scale, and (vocab groups only: a data group refuses it) the
      // top-entropy mask, whose quantile needs every row first: with N = 185
      // rows in blocks of 64, the two-pass schedule.
      c.spec.config = config_for(LossType::grpo);
      c.spec.config.entropy_coef = 0.01F;
      c.spec.config.logit_softcap = 8.0F;
      c.spec.config.logit_scale = 0.9F;
      if (s.mode == Mode::vocab || s.mode == Mode::vocab_unaligned) c.spec.config.top_entropy_quantile = 0.4F;
      c.bias = true;
      break;
  }
  return c;
}

class ScaleOutTest : public ::testing::TestWithParam<ScaleCase> {};

TEST_P(ScaleOutTest, EqualsTheSingleProcessPlan) {
  const ScaleCase sc = GetParam();
  const int rank = world_rank(), size = world_size();
  if (sc.mode == Mode::grid && size != 4) GTEST_SKIP() << "the grid case runs with 4 ranks (2 x 2)";
  const int index = static_cast<int>(sc.mode) * 100 + static_cast<int>(sc.dtype) * 10 + static_cast<int>(sc.loss);
  HeadCase c = global_case(sc, index);
  HeadProblem p = make_head_problem(c);
  std::int64_t num_valid = 0;
  for (const float m : p.batch.mask) num_valid += m != 0.0F ? 1 : 0;
  bool global_num_items = false;
  if (sc.loss == LossKind::dapo) {
    // The single process is told the count; data-parallel ranks ask the library for it.
    c.spec.config.num_items_in_batch = static_cast<double>(num_valid);
    p.oracle.head.config = c.spec.config;
    p.batch.problem.config = c.spec.config;
    global_num_items = sc.mode == Mode::data || sc.mode == Mode::grid;
  }
  const Layout l = layout_of(sc.mode, size);
  const Part part = part_of(c.spec.batch, c.spec.vocab, c.vocab_tile, l, rank);
  SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(size) + ", " + case_label(sc) + ", " +
               case_name(c) + ", part: sequences [" + std::to_string(part.seq_begin) + ", " +
               std::to_string(part.seq_end) + ") tokens [" + std::to_string(part.vocab_begin) + ", " +
               std::to_string(part.vocab_end) + ")");

  // Groups: the world (one mode), or the grid's rows and columns.
  const int v_index = rank % l.vocab_ranks, d_index = rank / l.vocab_ranks;
  MPI_Comm vocab_comm = MPI_COMM_NULL, data_comm = MPI_COMM_NULL;
  if (l.vocab_ranks > 1 || sc.mode != Mode::data) MPI_Comm_split(MPI_COMM_WORLD, d_index, v_index, &vocab_comm);
  if (sc.mode == Mode::data || sc.mode == Mode::grid) MPI_Comm_split(MPI_COMM_WORLD, v_index, d_index, &data_comm);
  std::optional<MpiCommunicator> vocab_group, data_group;
  ScaleOut so;
  if (vocab_comm != MPI_COMM_NULL) so.vocab_group = &vocab_group.emplace(vocab_comm);
  if (data_comm != MPI_COMM_NULL) so.data_group = &data_group.emplace(data_comm);
  so.global_num_items = global_num_items;
  LossConfig dist_config = c.spec.config;
  if (global_num_items) dist_config.num_items_in_batch = 0.0;

  HeadOutputs a, b;
  std::string error;
  try {
    a = run_part(c, p, part, so, dist_config);
    b = run_part(c, p, part, so, dist_config);
  } catch (const std::exception& e) {
    error = e.what();  // every rank throws alike (the agreement); checked below
  }
  if (vocab_comm != MPI_COMM_NULL) MPI_Comm_free(&vocab_comm);
  if (data_comm != MPI_COMM_NULL) MPI_Comm_free(&data_comm);
  ASSERT_TRUE(all_ranks(error.empty())) << "a distributed run threw: " << error;

  // Gather every rank's part, then check (no collective after this block).
  const std::int64_t h = c.hidden, v_all = c.spec.vocab, n_all = c.spec.batch * c.spec.seq_len;
  const std::int64_t t_len = c.spec.seq_len;
  const bool vm = c.layout == WeightLayout::vocab_major;
  const auto parts = allgather_bytes(&part, sizeof(part));
  const auto metrics = allgather_bytes(&a.metrics, sizeof(a.metrics));
  const auto logp = allgather_bytes(a.logp.data(), a.logp.size() * sizeof(float));
  const auto entropy = allgather_bytes(a.entropy.data(), a.entropy.size() * sizeof(float));
  const auto kl = allgather_bytes(a.kl.data(), a.kl.size() * sizeof(float));
  const auto dhidden = allgather_bytes(a.dhidden.data(), a.dhidden.size());
  const auto dweight = allgather_bytes(a.dweight.data(), a.dweight.size());
  const auto dbias = allgather_bytes(a.dbias.data(), a.dbias.size() * sizeof(float));
  HeadOutputs all;  // the global outputs, assembled (dweight vocab-major f32, like single's layout below)
  all.logp.assign(static_cast<std::size_t>(n_all), 0.0F);
  all.entropy = all.logp;
  all.kl = all.logp;
  all.dhidden.assign(static_cast<std::size_t>(n_all * h) * sizeof(float), std::byte{0});
  all.dweight.assign(static_cast<std::size_t>(v_all * h) * sizeof(float), std::byte{0});
  all.dbias.assign(c.bias ? static_cast<std::size_t>(v_all) : 0, 0.0F);
  std::memcpy(&all.metrics, metrics[0].data(), sizeof(Metrics));
  for (int q = 0; q < size; ++q) {
    Part pq;
    std::memcpy(&pq, parts[q].data(), sizeof(pq));
    const std::int64_t r0 = pq.seq_begin * t_len, n = (pq.seq_end - pq.seq_begin) * t_len;
    const std::int64_t v0 = pq.vocab_begin, v = pq.vocab_end - pq.vocab_begin;
    std::memcpy(all.logp.data() + r0, logp[q].data(), static_cast<std::size_t>(n) * sizeof(float));
    std::memcpy(all.entropy.data() + r0, entropy[q].data(), static_cast<std::size_t>(n) * sizeof(float));
    std::memcpy(all.kl.data() + r0, kl[q].data(), static_cast<std::size_t>(n) * sizeof(float));
    std::memcpy(all.dhidden.data() + static_cast<std::size_t>(r0 * h) * sizeof(float), dhidden[q].data(),
                static_cast<std::size_t>(n * h) * sizeof(float));
    // The shard's dW into the global dW, in the weight's layout.
    const auto* src = reinterpret_cast<const float*>(dweight[q].data());
    auto* dst = reinterpret_cast<float*>(all.dweight.data());
    for (std::int64_t a_ = 0; a_ < v; ++a_) {
      for (std::int64_t k = 0; k < h; ++k) {
        dst[vm ? (v0 + a_) * h + k : k * v_all + v0 + a_] = src[vm ? a_ * h + k : k * v + a_];
      }
    }
    if (c.bias) {
      std::memcpy(all.dbias.data() + v0, dbias[q].data(), static_cast<std::size_t>(v) * sizeof(float));
    }
  }

  // Run to run: bitwise.
  EXPECT_TRUE(same_bits(a.logp.data(), b.logp.data(), a.logp.size() * sizeof(float)));
  EXPECT_TRUE(same_bits(a.entropy.data(), b.entropy.data(), a.entropy.size() * sizeof(float)));
  EXPECT_TRUE(same_bits(a.kl.data(), b.kl.data(), a.kl.size() * sizeof(float)));
  EXPECT_TRUE(a.dhidden == b.dhidden);
  EXPECT_TRUE(a.dweight == b.dweight);
  EXPECT_TRUE(same_bits(a.dbias.data(), b.dbias.data(), a.dbias.size() * sizeof(float)));
  EXPECT_TRUE(same_bits(&a.metrics, &b.metrics, sizeof(Metrics)));
  // Across ranks: the same metrics.
  for (int q = 1; q < size; ++q) {
    EXPECT_TRUE(same_bits(metrics[q].data(), metrics[0].data(), sizeof(Metrics))) << "rank " << q << "'s metrics";
  }

  // Everything below compares the assembled global outputs (the same bytes on
  // every rank: they come from the allgathers above) with the single process
  // and the double oracle: rank 0 does it once. Replicated on every rank it was
  // three quarters of the mpi tests' time (oracle and bounds in double). The
  // other ranks wait for it in a barrier that sleeps rather than spins.
  const SleepyBarrierAtExit wait_for_rank0;
  if (rank != 0) return;
  const HeadOutputs single = run_head(c, p, 1);
  const oracle::LmHeadResult want = oracle::evaluate_lm_head(p.oracle);

  // Against the single process.
  const bool aligned = sc.mode != Mode::vocab_unaligned;
  const bool vocab_only = sc.mode == Mode::vocab;
  if (aligned) {
    EXPECT_TRUE(same_bits(all.logp.data(), single.logp.data(), single.logp.size() * sizeof(float))) << "logp";
    EXPECT_TRUE(same_bits(all.entropy.data(), single.entropy.data(), single.entropy.size() * sizeof(float)))
        << "entropy";
    EXPECT_TRUE(same_bits(all.kl.data(), single.kl.data(), single.kl.size() * sizeof(float))) << "kl";
  }
  EXPECT_EQ(all.metrics.num_valid, single.metrics.num_valid);
  const std::vector<double> single_dw = single.dweight_vocab_major(c);
  std::vector<double> all_dw(single_dw.size());
  {
    const auto* f = reinterpret_cast<const float*>(all.dweight.data());
    for (std::int64_t a_ = 0; a_ < v_all; ++a_) {
      for (std::int64_t k = 0; k < h; ++k) all_dw[a_ * h + k] = f[vm ? a_ * h + k : k * v_all + a_];
    }
  }
  const std::vector<float> single_dh = to_float(single.dhidden.data(), DType::f32, static_cast<std::size_t>(n_all * h));
  const auto* all_dh = reinterpret_cast<const float*>(all.dhidden.data());
  if (vocab_only) {
    EXPECT_TRUE(same_bits(&all.metrics.loss, &single.metrics.loss, sizeof(double))) << "loss";
    EXPECT_EQ(all.metrics.kl_mean, single.metrics.kl_mean);
    EXPECT_EQ(all.metrics.entropy_mean, single.metrics.entropy_mean);
    EXPECT_EQ(all.metrics.clip_ratio_region, single.metrics.clip_ratio_region);
    EXPECT_TRUE(all_dw == single_dw) << "dweight";
    EXPECT_TRUE(all.dbias == single.dbias) << "dbias";
  }
  if (aligned) {
    // The loss: a double sum of N terms w_t l_t split by rank; sum_t w_t <= 1
    // for grpo / GSPO (1/B per sequence) and dapo (N_valid / num_items), and
    // |l_t| <= |A_t| max(r_t, 1 + eps_high) + beta |kl_t| (r_t from logp and
    // old_logp: the token's ratio, or the sequence's for GSPO, whichever larger).
    double l_max = 0.0;
    for (std::int64_t t = 0; t < n_all; ++t) {
      if (p.batch.mask[t] == 0.0F) continue;
      const double adv = p.batch.advantages.size() == static_cast<std::size_t>(n_all) ? p.batch.advantages[t]
                                                                                      : p.batch.advantages[t / t_len];
      double r = std::exp(std::clamp(double{single.logp[t]} - p.batch.old_logp[t], -20.0, 20.0));
      if (c.spec.config.importance_sampling_level == IsLevel::sequence) {
        double sum = 0.0, count = 0.0;
        for (std::int64_t u = t / t_len * t_len; u < (t / t_len + 1) * t_len; ++u) {
          sum += p.batch.mask[u] * (double{single.logp[u]} - p.batch.old_logp[u]);
          count += p.batch.mask[u];
        }
        r = std::max(r, std::exp(sum / std::max(count, 1.0)));
      }
      l_max = std::max(l_max, std::abs(adv) * std::max(r, 1.0 + c.spec.config.epsilon_high) +
                                  c.spec.config.beta * std::abs(double{single.kl[t]}));
    }
    const double g = gamma(static_cast<double>(n_all), kUnitF64);
    double kl_max = 0.0, ent_max = 0.0;
    for (std::int64_t t = 0; t < n_all; ++t) {
      kl_max = std::max(kl_max, std::abs(double{single.kl[t]}));
      ent_max = std::max(ent_max, std::abs(double{single.entropy[t]}));
    }
    // The entropy bonus adds entropy_coef x a mean of entropies: its terms sum to at most entropy_coef x max Ent.
    EXPECT_NEAR(all.metrics.loss, single.metrics.loss,
                2.0 * g * (l_max + std::abs(double{c.spec.config.entropy_coef}) * ent_max))
        << "loss";
    EXPECT_NEAR(all.metrics.kl_mean, single.metrics.kl_mean, 2.0 * g * kl_max) << "kl_mean";
    EXPECT_NEAR(all.metrics.entropy_mean, single.metrics.entropy_mean, 2.0 * g * ent_max) << "entropy_mean";
    // Clip counts are exact integers in double: the same ratios.
    EXPECT_EQ(all.metrics.clip_ratio_low, single.metrics.clip_ratio_low);
    EXPECT_EQ(all.metrics.clip_ratio_high, single.metrics.clip_ratio_high);
    EXPECT_EQ(all.metrics.clip_ratio_region, single.metrics.clip_ratio_region);

    // Gradients within the summation-order bound (see the top of the file).
    const std::vector<double>& dz = want.head.dlogits;
    constexpr double kMagnitudeSlack = 1.1;
    const double g_rows = gamma(static_cast<double>(n_all), kUnitF32);
    const double g_vocab = gamma(static_cast<double>(v_all), kUnitF32);
    double worst_dw = 0.0, worst_dh = 0.0;  // error / bound, reported on failure
    for (std::int64_t a_ = 0; a_ < v_all; ++a_) {
      double s_b = 0.0;
      for (std::int64_t t = 0; t < n_all; ++t) s_b += std::abs(dz[t * v_all + a_]);
      if (c.bias) {
        EXPECT_NEAR(all.dbias[a_], single.dbias[a_], 2.0 * g_rows * kMagnitudeSlack * s_b + 1e-30)
            << "dbias[" << a_ << "]";
      }
      for (std::int64_t k = 0; k < h; ++k) {
        double s_w = 0.0;
        for (std::int64_t t = 0; t < n_all; ++t) s_w += std::abs(dz[t * v_all + a_] * p.oracle.hidden[t * h + k]);
        const double bound = 2.0 * g_rows * kMagnitudeSlack * s_w + 1e-30;
        const double e = std::abs(all_dw[a_ * h + k] - single_dw[a_ * h + k]);
        worst_dw = std::max(worst_dw, e / bound);
      }
    }
    for (std::int64_t t = 0; t < n_all; ++t) {
      for (std::int64_t k = 0; k < h; ++k) {
        double s_h = 0.0;
        for (std::int64_t a_ = 0; a_ < v_all; ++a_) s_h += std::abs(dz[t * v_all + a_] * p.oracle.weight[a_ * h + k]);
        const double bound = 2.0 * g_vocab * kMagnitudeSlack * s_h + 1e-30;
        worst_dh = std::max(worst_dh, std::abs(double{all_dh[t * h + k]} - single_dh[t * h + k]) / bound);
      }
    }
    EXPECT_LE(worst_dw, 1.0) << "dweight: largest |distributed - single| / bound";
    EXPECT_LE(worst_dh, 1.0) << "dhidden: largest |distributed - single| / bound";
    std::printf("[ scale-out ] %-40s P=%d  dW err/bound %.3g  dh err/bound %.3g  dh bitwise %s\n",
                case_label(sc).c_str(), size, worst_dw, worst_dh,
                same_bits(all_dh, single_dh.data(), single_dh.size() * sizeof(float)) ? "yes" : "no");
  }
  // The assembled step against the oracle, within the single process's bounds.
  HeadCase as_f32 = c;  // assembled dW is f32 in the weight's layout, dhidden f32
  expect_head_matches_oracle(as_f32, p, all, want);
}

std::vector<ScaleCase> all_cases() {
  std::vector<ScaleCase> out;
  for (const Mode m : {Mode::vocab, Mode::vocab_unaligned, Mode::data, Mode::grid}) {
    for (const DType d : {DType::f32, DType::bf16}) {
      for (const LossKind l : {LossKind::grpo_kl, LossKind::dapo, LossKind::gspo, LossKind::features}) {
        out.push_back({m, d, l});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Modes, ScaleOutTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ScaleCase>& info) { return case_label(info.param); });

}  // namespace
}  // namespace grpo::test
