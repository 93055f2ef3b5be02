// The microbench / gradcheck tooling: configs are refused with the field
// named, the peak accounting means what it says (fused = the plan's
// workspace, baseline >= its materialized logits), synthesized inputs reach
// both clip branches, and every counter the issue names is produced.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "bench_config.hpp"
#include "bench_run.hpp"
#include "compare.hpp"
#include "gradcheck_config.hpp"
#include "measure.hpp"
#include "runners.hpp"

namespace grpo::bench {
namespace {

constexpr const char* kTinyFused = R"(
impl: fused
shape: {batch: 2, seq_len: 24, hidden: 64, vocab: 1000}
dtype: f32
vocab_tile: 256
warmup: 0
steps: 2
measure_unfused_gemms: false
loss: {loss_type: dapo, num_items_in_batch: auto, delta: 1.5, epsilon_high: 0.28}
inputs: {seed: 3, old_logp_noise: 0.3, advantage_per_token: true}
)";

BenchConfig parse(const std::string& yaml) { return parse_bench_config(YAML::Load(yaml), "test.yaml"); }

// The field a config is refused for ("<accepted>" when it is not refused).
std::string refused_field(const std::string& yaml) {
  try {
    parse(yaml);
  } catch (const ConfigError& e) {
    return e.field();
  }
  return "<accepted>";
}

std::string with(const std::string& extra) { return std::string(kTinyFused) + extra; }

TEST(MicrobenchConfig, ReadsEveryField) {
  const BenchConfig c = parse(kTinyFused);
  EXPECT_EQ(c.name, "test");
  EXPECT_EQ(c.impl, Impl::fused);
  EXPECT_EQ(c.shape, (ShapeSpec{2, 24, 64, 1000}));
  EXPECT_EQ(c.vocab_tile, 256);
  EXPECT_EQ(c.steps, 2);
  EXPECT_EQ(c.loss.config.loss_type, LossType::dapo);
  EXPECT_TRUE(c.loss.autos.num_items_in_batch);
  ASSERT_TRUE(c.loss.config.delta.has_value());
  EXPECT_FLOAT_EQ(*c.loss.config.delta, 1.5F);
  EXPECT_FLOAT_EQ(c.loss.config.epsilon_high, 0.28F);
  EXPECT_EQ(c.inputs.seed, 3U);
  EXPECT_TRUE(c.inputs.advantage_per_token);
  EXPECT_EQ(parse(with("workspace_budget: 64MiB\n")).workspace_budget, std::uint64_t{64} << 20);
}

TEST(MicrobenchConfig, UnknownFieldIsNamed) {
  EXPECT_EQ(refused_field(with("stpes: 3\n")), "stpes");
  EXPECT_EQ(refused_field(R"(
impl: fused
shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100, vocabulary: 5}
)"),
            "shape.vocabulary");
  EXPECT_EQ(refused_field(R"(
impl: fused
shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}
inputs: {old_logp_nosie: 0.3}
)"),
            "inputs.old_logp_nosie");
  EXPECT_EQ(refused_field(R"(
impl: fused
shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}
loss: {epsilon: 0.2}
)"),
            "loss.epsilon");
}

TEST(MicrobenchConfig, WrongTypeIsNamed) {
  const std::string shape = "shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}\n";
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "steps: three\n"), "steps");
  EXPECT_EQ(refused_field("impl: fused\nshape: {batch: 1, seq_len: 1.5, hidden: 16, vocab: 100}\n"), "shape.seq_len");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "dtype: fp16\n"), "dtype");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "bias: maybe\n"), "bias");
  EXPECT_EQ(refused_field("impl: fast\n" + shape), "impl");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "loss: {epsilon_low: high}\n"), "loss.epsilon_low");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "inputs: 3\n"), "inputs");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "inputs: {zero_advantage_fraction: 1.5}\n"),
            "inputs.zero_advantage_fraction");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "workspace_budget: lots\n"), "workspace_budget");
  EXPECT_EQ(refused_field("impl: fused\n" + shape + "steps:\n"), "steps");
}

TEST(MicrobenchConfig, MissingShapeIsNamed) {
  EXPECT_EQ(refused_field("impl: fused\nsteps: 2\n"), "shape");
  EXPECT_EQ(refused_field("impl: fused\nshape: {batch: 1, seq_len: 8, hidden: 16}\n"), "shape.vocab");
  EXPECT_EQ(refused_field("impl: fused\nshape: {batch: 1, seq_len: 8, vocab: 100}\n"), "shape.hidden");
  // Logits-level runs start from logits: a hidden size would be silently ignored.
  EXPECT_EQ(refused_field("impl: logits_fused\nshape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}\n"),
            "shape.hidden");
  EXPECT_EQ(refused_field("shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}\n"), "impl");
}

TEST(MicrobenchConfig, MessageNamesFileAndField) {
  try {
    parse(with("inputs_typo: 1\n"));
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("test.yaml"), std::string::npos) << what;
    EXPECT_NE(what.find("inputs_typo"), std::string::npos) << what;
  }
}

TEST(MicrobenchConfig, ReferenceErrorsAreNamed) {
  EXPECT_EQ(refused_field(with("references:\n  - {name: b, impl: bogus}\n")), "references[0].impl");
  EXPECT_EQ(refused_field(with("references:\n  - {impl: baseline}\n")), "references[0].name");
  EXPECT_EQ(refused_field(with("references:\n  - {name: b, shape: {batch: 1}}\n")), "references[0].shape");
  EXPECT_EQ(refused_field(with("references:\n  - {name: b, inputs: {sed: 1}}\n")), "references[0].inputs.sed");
  const BenchConfig c = parse(with("references:\n  - {name: base, impl: baseline, logits_dtype: f32}\n"));
  ASSERT_EQ(c.references.size(), 1U);
  EXPECT_EQ(c.references[0].config.impl, Impl::baseline);
  EXPECT_EQ(c.references[0].config.shape, c.shape);
  EXPECT_EQ(c.references[0].config.inputs, c.inputs);  // inherited from the main run
}

TEST(MicrobenchConfig, OverridesAreTypeChecked) {
  YAML::Node tree = YAML::Load(kTinyFused);
  apply_override(tree, "shape.seq_len=32");
  apply_override(tree, "inputs.seed=9");
  const BenchConfig c = parse_bench_config(tree, "test.yaml");
  EXPECT_EQ(c.shape.seq_len, 32);
  EXPECT_EQ(c.inputs.seed, 9U);
  YAML::Node typo = YAML::Load(kTinyFused);
  apply_override(typo, "shape.seq_lenn=32");
  EXPECT_THROW(parse_bench_config(typo, "test.yaml"), ConfigError);
}

TEST(MicrobenchConfig, EveryShippedConfigParses) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(GRPO_CONFIG_DIR "/microbench")) {
    EXPECT_NO_THROW(load_bench_config(entry.path().string())) << entry.path();
    ++count;
  }
  // gradcheck/filter/: configs run by hand (minutes each), not ctest's; they must parse all the same.
  for (const auto& entry : std::filesystem::recursive_directory_iterator(GRPO_CONFIG_DIR "/gradcheck")) {
    if (!entry.is_regular_file()) continue;
    EXPECT_NO_THROW(load_gradcheck_config(entry.path().string())) << entry.path();
    ++count;
  }
  EXPECT_GE(count, 20);
}

TEST(GradcheckConfig, ErrorsAreNamed) {
  const std::string base = R"(
shape: {batch: 1, seq_len: 8, hidden: 16, vocab: 100}
oracle: lm_head
tolerance:
  loss: {abs: 1.0e-4, rel: 1.0e-4}
  logp: {abs: 1.0e-4, rel: 1.0e-4}
  entropy: {abs: 1.0e-4, rel: 1.0e-4}
  dhidden: {abs: 1.0e-4, rel: 1.0e-4}
)";
  auto field = [](const std::string& yaml) {
    try {
      parse_gradcheck_config(YAML::Load(yaml), "g.yaml");
    } catch (const ConfigError& e) {
      return e.field();
    }
    return std::string("<accepted>");
  };
  EXPECT_EQ(field(base), "tolerance.dweight");
  const std::string full = base + "  dweight: {abs: 1.0e-4, rel: 1.0e-4}\n";
  EXPECT_EQ(field(full), "<accepted>");
  EXPECT_EQ(field(full + "  dhidden_typo: {abs: 1, rel: 1}\n"), "tolerance.dhidden_typo");
  EXPECT_EQ(field(full + "oracel: none\n"), "oracel");
  std::string big = full;
  big.replace(big.find("hidden: 16, vocab: 100"), 22, "hidden: 4096, vocab: 151936");
  EXPECT_EQ(field(big), "oracle");  // O(N*V*H) long-double loops at a real vocabulary: refused
}

RunStats run(const BenchConfig& c) {
  const Problem p = synthesize(problem_spec(c));
  Progress quiet(c.name, false);
  return measure_run(c, p, quiet, false);
}

TEST(MicrobenchPeak, FusedTrackedPeakEqualsWorkspace) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const bool forward_only : {false, true}) {
      for (const std::int64_t tile : {256, 0}) {
        BenchConfig c = parse(kTinyFused);
        c.dtype = dtype;
        c.forward_only = forward_only;
        c.vocab_tile = tile;
        const RunStats s = run(c);
        SCOPED_TRACE(s.describe);
        EXPECT_GT(s.workspace_bytes, 0U);
        // The step allocates its workspace and nothing else through the library's allocator.
        EXPECT_EQ(s.peak_bytes, s.workspace_bytes);
      }
    }
  }
}

TEST(MicrobenchPeak, BaselinePeakCoversMaterializedLogits) {
  const std::string shape =
      "shape: {batch: 2, seq_len: 24, hidden: 64, vocab: 1000}\nmeasure_unfused_gemms: false\nsteps: 1\nwarmup: 0\n";
  const std::size_t rows_x_vocab = 48 * 1000;
  for (const char* logits : {"f32", "bf16"}) {
    const BenchConfig c = parse(std::string("impl: baseline\ndtype: bf16\nlogits_dtype: ") + logits + "\n" + shape);
    const RunStats s = run(c);
    SCOPED_TRACE(logits);
    EXPECT_GE(s.peak_bytes, rows_x_vocab * size_of(c.logits_dtype));
  }
  // The logits-level baseline keeps log_softmax and softmax, both f32 [N, V].
  const BenchConfig c = parse("impl: logits_baseline\nshape: {batch: 2, seq_len: 24, vocab: 1000}\nsteps: 1\n");
  EXPECT_GE(run(c).peak_bytes, 2 * rows_x_vocab * sizeof(float));
}

// Executed FLOPs come from the rows each step put through its GEMMs: the
// baseline and the unfused GEMMs do every row of all three; the fused path
// drops every backward row when no coefficient is nonzero (all advantages 0,
// beta 0) and still runs the logits GEMM on all of them.
TEST(MicrobenchFlops, ExecutedFlopsCountTheRowsTheGemmsRan) {
  const std::string shape =
      "shape: {batch: 2, seq_len: 24, hidden: 64, vocab: 1000}\nmeasure_unfused_gemms: false\nsteps: 1\nwarmup: 0\n";
  const double per_row = 2.0 * 1000 * 64, rows = 48;
  for (const char* impl : {"baseline", "unfused_gemms"}) {
    const BenchConfig c = parse(std::string("impl: ") + impl + "\n" + shape);
    SCOPED_TRACE(impl);
    const RunStats s = run(c);
    ASSERT_TRUE(s.executed_flops.has_value());
    EXPECT_EQ(*s.executed_flops, nominal_flops(c));
    EXPECT_EQ(*s.executed_flops, 3 * per_row * rows);
  }
  const BenchConfig unfused = parse("impl: unfused_gemms\n" + shape);
  EXPECT_GE(run(unfused).peak_bytes, 48 * 1000 * 2 * sizeof(float));  // its [N, V] logits and dlogits

  // All advantages 0: the logits GEMM sees every row (plus its zero padding)
  // and no backward GEMM runs, exactly as in a forward-only step.
  const BenchConfig idle = parse("impl: fused\ninputs: {zero_advantage_fraction: 1.0}\n" + shape);
  BenchConfig forward = idle;
  forward.forward_only = true;
  const RunStats s = run(idle), f = run(forward);
  ASSERT_TRUE(s.executed_flops.has_value() && f.executed_flops.has_value());
  EXPECT_GE(*s.executed_flops, per_row * rows);
  EXPECT_EQ(*s.executed_flops, *f.executed_flops);
  // Active rows add two backward GEMM rows each (whole rows, padding included).
  const RunStats a = run(parse("impl: fused\n" + shape));
  ASSERT_TRUE(a.executed_flops.has_value());
  EXPECT_GT(*a.executed_flops, *s.executed_flops);
  EXPECT_EQ(std::fmod(*a.executed_flops - *s.executed_flops, 2 * per_row), 0.0);
}

TEST(MicrobenchInputs, ReachBothClipBranches) {
  const RunStats noisy = run(parse(kTinyFused));
  EXPECT_GT(noisy.metrics.clip_ratio_low, 0.0);
  EXPECT_GT(noisy.metrics.clip_ratio_high, 0.0);
  EXPECT_LT(noisy.metrics.clip_ratio_region, 0.9);  // most tokens stay unclipped
  BenchConfig c = parse(kTinyFused);
  c.inputs.old_logp = OldLogp::none;
  const RunStats on_policy = run(c);
  EXPECT_EQ(on_policy.metrics.clip_ratio_region, 0.0);
}

TEST(MicrobenchInputs, DeterministicAndExactZeroAdvantageCount) {
  BenchConfig c = parse(kTinyFused);
  c.shape.batch = 8;
  c.inputs.advantage_per_token = false;
  c.inputs.zero_advantage_fraction = 0.5;
  const Problem a = synthesize(problem_spec(c));
  const Problem b = synthesize(problem_spec(c));
  ASSERT_EQ(a.weight.size(), b.weight.size());
  EXPECT_EQ(std::memcmp(a.weight.data(), b.weight.data(), a.weight.size()), 0);
  EXPECT_EQ(std::memcmp(a.hidden.data(), b.hidden.data(), a.hidden.size()), 0);
  EXPECT_EQ(a.old_logp, b.old_logp);
  EXPECT_EQ(std::count(a.advantages.begin(), a.advantages.end(), 0.0F), 4);
  EXPECT_EQ(a.config.num_items_in_batch, static_cast<double>(a.num_valid()));
}

TEST(MicrobenchRun, ProducesEveryNamedCounter) {
  const BenchResult r = run_bench(parse(with("references:\n  - {name: baseline, impl: baseline}\n")), false);
  for (const char* name : kCoreCounters) EXPECT_EQ(r.counters.count(name), 1U) << name;
  EXPECT_EQ(r.counters.count("speedup_vs_baseline"), 1U);
  EXPECT_EQ(r.counters.count("peak_ratio_vs_baseline"), 1U);
  EXPECT_EQ(r.step_s.size(), 2U);
  // f32: measured against the f32 FMA peak, which nothing executes beyond.
  if (r.counters.at("peak_f32_fma_gflops") > 0.0) {
    EXPECT_EQ(r.counters.at("machine_peak_gflops"), r.counters.at("peak_f32_fma_gflops"));
    EXPECT_GT(r.counters.at("peak_frac"), 0.0);
    EXPECT_LE(r.counters.at("peak_frac"), 1.0);
  }
  EXPECT_GT(r.counters.at("executed_gflops"), 0.0);
  // The phases are the last timed step's, as shares of that step's own thread-seconds: with the remainder they
  // sum to 1, and the remainder is not negative however the timed steps spread.
  ASSERT_EQ(r.counters.count("phase_step_s"), 1U);
  EXPECT_EQ(r.counters.at("phase_step_s"), r.step_s.back());
  double shares = r.counters.at("phase_other_frac");
  for (const char* phase : {"forward_gemm", "forward_stage", "dlogits", "dweight_gemm", "dhidden_gemm"}) {
    const double frac = r.counters.at(std::string("phase_") + phase + "_frac");
    EXPECT_GE(frac, 0.0) << phase;
    shares += frac;
  }
  EXPECT_NEAR(shares, 1.0, 1e-12);
  EXPECT_GE(r.counters.at("phase_other_frac"), 0.0);
  const BenchResult logits =
      run_bench(parse("impl: logits_fused\nshape: {batch: 1, seq_len: 16, vocab: 4096}\nsteps: 2\n"
                      "references:\n  - {name: copy, impl: copy}\n"),
                false);
  EXPECT_GT(logits.counters.at("copy_bw_frac"), 0.0);
  EXPECT_GT(logits.counters.at("gbytes_per_s"), 0.0);
  // No GEMM at the logits level: the FLOP counters do not apply.
  EXPECT_EQ(logits.counters.at("executed_gflops"), 0.0);
  EXPECT_EQ(logits.counters.at("peak_frac"), 0.0);
  EXPECT_EQ(logits.counters.count("peak_f32_fma_gflops"), 0U);
}

TEST(MicrobenchCompare, TableShowsRatios) {
  const auto dir = std::filesystem::temp_directory_path();
  auto write = [&](const char* file, const char* name, double step, double peak) {
    std::ofstream(dir / file) << "{\n  \"benchmarks\": [\n    {\n      \"name\": \"" << name
                              << "/iterations:3/manual_time\",\n      \"step_s_p50\": " << step
                              << ",\n      \"peak_bytes\": " << peak << "\n    }\n  ]\n}\n";
    return read_benchmark_json((dir / file).string());
  };
  const auto a = write("grpo_cmp_a.json", "base", 2.0, 4096.0 * 1024 * 1024);
  const auto b = write("grpo_cmp_b.json", "fused", 1.0, 1024.0 * 1024 * 1024);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->name, "base");
  const std::string table = format_compare_table(*a, *b);
  EXPECT_NE(table.find("B/A"), std::string::npos) << table;
  EXPECT_NE(table.find("0.5x"), std::string::npos) << table;
  EXPECT_NE(table.find("0.25x"), std::string::npos) << table;
  EXPECT_NE(table.find("4.00 GiB"), std::string::npos) << table;
  std::filesystem::remove(dir / "grpo_cmp_a.json");
  std::filesystem::remove(dir / "grpo_cmp_b.json");
}

// A fraction of the machine peak above 1 is a probe error: never a result in
// the counters nor in the compare table.
TEST(MicrobenchCompare, FractionsAboveOneAreWithheld) {
  Counters c{{"peak_frac", 1.0465}, {"roofline_frac", 0.93}};
  EXPECT_TRUE(withhold_fraction_above_one(c, "peak_frac", "test"));
  EXPECT_FALSE(withhold_fraction_above_one(c, "roofline_frac", "test"));
  EXPECT_FALSE(withhold_fraction_above_one(c, "absent", "test"));
  EXPECT_EQ(c.at("peak_frac"), 0.0);
  EXPECT_EQ(c.at("peak_frac_withheld"), 1.0465);
  EXPECT_EQ(c.at("roofline_frac"), 0.93);
  EXPECT_EQ(c.count("roofline_frac_withheld"), 0U);

  const auto dir = std::filesystem::temp_directory_path();
  auto write = [&](const char* file, const char* extra) {
    std::ofstream(dir / file) << "{\n  \"benchmarks\": [\n    {\n      \"name\": \"x/iterations:3/manual_time\",\n"
                              << "      \"step_s_p50\": 2.0,\n      \"peak_frac\": " << extra << "\n    }\n  ]\n}\n";
    return read_benchmark_json((dir / file).string());
  };
  const auto a = write("grpo_cmp_wa.json", "0,\n      \"peak_frac_withheld\": 1.0465");
  const auto b = write("grpo_cmp_wb.json", "0.9");
  ASSERT_TRUE(a && b);
  const std::string table = format_compare_table(*a, *b);
  EXPECT_NE(table.find("withheld (1.0465 > 1: probe error)"), std::string::npos) << table;
  EXPECT_EQ(table.find("1.0465x"), std::string::npos) << table;
  std::filesystem::remove(dir / "grpo_cmp_wa.json");
  std::filesystem::remove(dir / "grpo_cmp_wb.json");
}

}  // namespace
}  // namespace grpo::bench
