// The microbench's trained-like inputs (synth_trained.cpp), inputs read from
// a file (input_file.hpp) and the filter analysis (filter_analysis.hpp): the
// generator lands on the entropies it was asked for, on rows measured with
// the plain reference; it is a pure function of the seed; a file round-trips;
// the analysis skips nothing where every entry is significant; the reference
// logits they are measured on match double dot products.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "bench_config.hpp"
#include "filter_analysis.hpp"
#include "input_file.hpp"
#include "input_stats.hpp"
#include "runners.hpp"

namespace grpo::bench {
namespace {

// Small enough for the fast tier (~0.3 s each), large enough that a row's
// tail is a real Zipf tail (V = 16384) and the candidates' boosts barely move
// the other logits (H = 512).
constexpr const char* kTrainedLike = R"(
impl: fused
shape: {batch: 2, seq_len: 128, hidden: 512, vocab: 16384}
dtype: bf16
steps: 1
measure_unfused_gemms: false
inputs: {seed: 7, generator: trained_like, old_logp: none, advantage_per_token: true}
)";

BenchConfig parse(const std::string& yaml) { return parse_bench_config(YAML::Load(yaml), "test.yaml"); }

std::string refused_field(const std::string& yaml) {
  try {
    parse(yaml);
  } catch (const ConfigError& e) {
    return e.field();
  }
  return "<accepted>";
}

double quantile(std::vector<double> xs, double q) {
  std::sort(xs.begin(), xs.end());
  return xs[static_cast<std::size_t>(q * static_cast<double>(xs.size() - 1))];
}

// A row's entropy misses its target by the tail's fluctuation (its mass sits
// on ~100 effective ids of the Zipf prior: a few tenths of a nat at most);
// quantiles over 256 rows average that out to within kQuantileTol of the
// target distribution's, which is what the generator promises.
constexpr double kQuantileTol = 0.25;

TEST(TrainedLikeInputs, UniformTargetsLandInTheRange) {
  BenchConfig c = parse(kTrainedLike);
  c.inputs.entropy_min = 0.3;
  c.inputs.entropy_max = 3.0;
  const Problem p = synthesize(problem_spec(c));
  const InputStats st = measure_inputs(p, 256, 0);
  ASSERT_EQ(st.rows, 256);
  SCOPED_TRACE(st.summary());
  // Uniform on [0.3, 3.0]: p10 0.57, p50 1.65, p90 2.73.
  EXPECT_NEAR(quantile(st.entropy, 0.1), 0.57, kQuantileTol);
  EXPECT_NEAR(quantile(st.entropy, 0.5), 1.65, kQuantileTol);
  EXPECT_NEAR(quantile(st.entropy, 0.9), 2.73, kQuantileTol);
  EXPECT_GT(st.entropy_min, 0.3 - kQuantileTol);
  EXPECT_LT(st.entropy_max, 3.0 + kQuantileTol);
  // Trained-like: a few entries per row carry the mass, not thousands.
  EXPECT_LT(st.frac_above, 0.01);
  EXPECT_GT(st.significant_per_row, 1.0);
}

TEST(TrainedLikeInputs, MeanTargetIsMet) {
  for (const double mean : {0.5, 1.0, 2.0, 3.0}) {
    BenchConfig c = parse(kTrainedLike);
    c.inputs.entropy_min = 0.05;
    c.inputs.entropy_max = 5.0;
    c.inputs.entropy_mean = mean;
    const InputStats st = measure_inputs(synthesize(problem_spec(c)), 256, 0);
    EXPECT_NEAR(st.entropy_mean, mean, kQuantileTol) << "entropy_mean " << mean << ": " << st.summary();
  }
}

TEST(TrainedLikeInputs, ChosenIdsFollowTheRowsDistribution) {
  // Sampled from the row's own distribution, the chosen id's mean log-prob
  // is minus the mean entropy (E[log p(y)] = -H per row), up to sampling
  // noise (a low-entropy row now and then draws a tail id of log p ~ -8) and
  // the candidates' mass being drawn with the predicted, not the realized,
  // tail: 0.1-0.2 nats measured at these shapes, 0.3 allowed.
  const Problem p = synthesize(problem_spec(parse(kTrainedLike)));
  const InputStats st = measure_inputs(p, 256, 0);
  EXPECT_NEAR(st.logp_mean, -st.entropy_mean, 0.3) << st.summary();
}

// reference_logits (the logits every input statistic and the filter analysis
// are measured on) against double dot products, at hidden widths that take
// each of its kernels where the CPU has them (AVX-512: H % 16 == 0; AVX2 +
// FMA: H % 8 == 0; plain: any H), both weight layouts, with and without bias,
// a vocabulary and a row count that are not multiples of its 4 x 4 blocks.
// Bound: a float dot product of H terms in any order is within
// gamma_H sum |x_k w_k| of the exact one (plus the bias's rounding).
TEST(ReferenceLogits, MatchDoubleDotProducts) {
  for (const int hidden : {8, 16, 20, 24, 48, 512}) {
    for (const char* layout : {"vocab_major", "hidden_major"}) {
      for (const bool bias : {false, true}) {
        SCOPED_TRACE("H " + std::to_string(hidden) + " " + layout + (bias ? " bias" : ""));
        const BenchConfig c =
            parse("impl: fused\nshape: {batch: 1, seq_len: 7, hidden: " + std::to_string(hidden) +
                  ", vocab: 37}\ndtype: f32\nweight_layout: " + layout + "\nbias: " + (bias ? "true" : "false") +
                  "\nsteps: 1\n" + "measure_unfused_gemms: false\ninputs: {seed: 3}\n");
        const Problem p = synthesize(problem_spec(c));
        const std::vector<std::int64_t> rows = {6, 0, 3, 5, 1};
        const std::vector<float> z = reference_logits(p, rows, 2);
        ASSERT_EQ(z.size(), rows.size() * 37);
        const bool vm = std::string(layout) == "vocab_major";
        const double gamma = hidden * 0x1p-24 / (1.0 - hidden * 0x1p-24);
        for (std::size_t i = 0; i < rows.size(); ++i) {
          for (std::int64_t a = 0; a < 37; ++a) {
            double dot = 0.0, mag = 0.0;
            for (std::int64_t k = 0; k < hidden; ++k) {
              const double x = load_float(p.hidden.data(), DType::f32, static_cast<std::size_t>(rows[i] * hidden + k));
              const double w =
                  load_float(p.weight.data(), DType::f32, static_cast<std::size_t>(vm ? a * hidden + k : k * 37 + a));
              dot += x * w;
              mag += std::abs(x * w);
            }
            const double b = bias ? double{p.bias.as<float>()[a]} : 0.0;
            EXPECT_NEAR(z[i * 37 + a], dot + b, gamma * mag + 0x1p-24 * std::abs(dot + b) + 1e-30)
                << "row " << rows[i] << " token " << a;
          }
        }
      }
    }
  }
}

TEST(TrainedLikeInputs, PureFunctionOfTheSeed) {
  BenchConfig c = parse(kTrainedLike);
  c.threads = 1;
  const Problem a = synthesize(problem_spec(c));
  c.threads = 2;
  const Problem b = synthesize(problem_spec(c));
  ASSERT_EQ(a.weight.size(), b.weight.size());
  EXPECT_EQ(std::memcmp(a.weight.data(), b.weight.data(), a.weight.size()), 0);
  EXPECT_EQ(std::memcmp(a.hidden.data(), b.hidden.data(), a.hidden.size()), 0);
  EXPECT_EQ(a.ids, b.ids);
  c.inputs.seed = 8;
  const Problem d = synthesize(problem_spec(c));
  EXPECT_NE(std::memcmp(a.hidden.data(), d.hidden.data(), a.hidden.size()), 0);
  EXPECT_NE(a.ids, d.ids);
}

TEST(TrainedLikeInputs, ConfigErrorsAreNamed) {
  const std::string base = "impl: fused\nshape: {batch: 1, seq_len: 8, hidden: 64, vocab: 1000}\n";
  EXPECT_EQ(refused_field(base + "inputs: {entropy_range: [0.3, 3]}\n"), "inputs.entropy_range");
  EXPECT_EQ(refused_field(base + "inputs: {generator: trained_like, entropy_range: [3, 0.3]}\n"),
            "inputs.entropy_range");
  EXPECT_EQ(refused_field(base + "inputs: {generator: trained_like, entropy_range: 2}\n"), "inputs.entropy_range");
  EXPECT_EQ(refused_field(base + "inputs: {generator: trained_like, entropy_mean: 4}\n"), "inputs.entropy_mean");
  EXPECT_EQ(refused_field(base + "inputs: {generator: file}\n"), "inputs.path");
  EXPECT_EQ(refused_field(base + "bias: true\ninputs: {generator: trained_like}\n"), "inputs.generator");
  EXPECT_EQ(refused_field("impl: logits_fused\nshape: {batch: 1, seq_len: 8, vocab: 1000}\n"
                          "inputs: {generator: trained_like}\n"),
            "inputs.generator");
  EXPECT_EQ(refused_field(base + "inputs: {generator: trained_like, entropy_range: [0.1, 4], entropy_mean: 1}\n"),
            "<accepted>");
}

TEST(InputFile, RoundTripsAnLmHead) {
  // A random problem's tensors written in the file format, read back.
  BenchConfig c = parse(kTrainedLike);
  c.dtype = DType::f32;
  c.inputs.generator = InputGenerator::random;
  c.shape = {2, 8, 64, 300};
  const Problem src = synthesize(problem_spec(c));
  const std::string path =
      (std::filesystem::temp_directory_path() / ("grpo_input_" + std::to_string(::getpid()) + ".grpoin")).string();
  {
    std::ofstream f(path, std::ios::binary);
    f.write(kInputFileMagic, 8);
    const std::int64_t header[6] = {2, 8, 64, 300, 2, 0};
    f.write(reinterpret_cast<const char*>(header), sizeof header);
    f.write(reinterpret_cast<const char*>(src.hidden.data()), static_cast<std::streamsize>(src.hidden.size()));
    f.write(reinterpret_cast<const char*>(src.weight.data()), static_cast<std::streamsize>(src.weight.size()));
    f.write(reinterpret_cast<const char*>(src.ids.data()), 16 * 4);
    std::vector<float> mask(16, 1.0F);
    mask[15] = 0.0F;
    f.write(reinterpret_cast<const char*>(mask.data()), 16 * 4);
    const float adv[2] = {0.5F, -1.0F};
    f.write(reinterpret_cast<const char*>(adv), sizeof adv);
  }
  c.inputs.generator = InputGenerator::file;
  c.inputs.path = path;
  const Problem p = synthesize(problem_spec(c));
  EXPECT_EQ(std::memcmp(p.hidden.data(), src.hidden.data(), src.hidden.size()), 0);
  EXPECT_EQ(std::memcmp(p.weight.data(), src.weight.data(), src.weight.size()), 0);
  EXPECT_EQ(p.ids, src.ids);
  EXPECT_EQ(p.num_valid(), 15);
  EXPECT_EQ(p.advantages, (std::vector<float>{0.5F, -1.0F}));
  // The file's shape must be the config's.
  c.shape.seq_len = 9;
  try {
    synthesize(problem_spec(c));
    ADD_FAILURE() << "a shape mismatch was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

TEST(FilterAnalysis, NothingSkippedWhenEveryEntryCounts) {
  // V = 1000 near-uniform logits: every p ~ 1e-3 >= 2^-12, no block is skippable.
  BenchConfig c = parse(kTrainedLike);
  c.dtype = DType::f32;
  c.inputs.generator = InputGenerator::random;
  c.inputs.logit_std = 0.1;
  c.shape = {1, 64, 64, 1000};
  const FilterAnalysis a = analyze_filter(c, {});
  EXPECT_EQ(a.stats.rows, 64);
  EXPECT_NEAR(a.stats.frac_above, 1.0, 1e-12);
  for (const FilterBlockResult& b : a.blocks) EXPECT_EQ(b.skip_frac, 0.0) << b.order << " " << b.block_rows;
}

TEST(FilterAnalysis, TrainedLikeSkipsMostSmallBlocks) {
  const FilterAnalysis a = analyze_filter(parse(kTrainedLike), {});
  constexpr std::size_t kPerOrder = 3 * 5;  // row blocks x tile widths
  ASSERT_EQ(a.blocks.size(), 3 * kPerOrder);
  for (std::size_t i = 0; i < kPerOrder; ++i) {
    const FilterBlockResult& natural = a.blocks[i];
    const FilterBlockResult& sorted = a.blocks[i + kPerOrder];
    const FilterBlockResult& sig_count = a.blocks[i + 2 * kPerOrder];
    ASSERT_EQ(natural.order, "natural");
    ASSERT_EQ(sig_count.order, "sig_count");
    ASSERT_EQ(sorted.tile_cols, natural.tile_cols);
    for (const FilterBlockResult* b : {&natural, &sorted, &sig_count}) {
      EXPECT_GE(b->skip_frac, 0.0);
      EXPECT_LE(b->skip_frac, 1.0);
    }
  }
  // 32 rows x 64 columns: most blocks hold nothing significant.
  ASSERT_EQ(a.blocks[2].tile_cols, 64);
  EXPECT_GT(a.blocks[2].skip_frac, 0.5);
}

}  // namespace
}  // namespace grpo::bench
