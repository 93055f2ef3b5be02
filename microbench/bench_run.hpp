// A whole microbench run as Google Benchmark sees it: synthesize inputs,
// measure the main config and its references, and turn the results into
// named counters (so --benchmark_out_format=json carries them).
#pragma once

#include <map>
#include <string>

#include "bench_config.hpp"

namespace grpo::bench {

// Counter name -> value. Every run has at least kCoreCounters; references add
// <ref>_step_s, time_ratio_vs_<ref>, speedup_vs_<ref>, peak_ratio_vs_<ref>
// (and copy_bw_frac, backward ratios when they apply).
using Counters = std::map<std::string, double>;

inline constexpr const char* kCoreCounters[] = {
    "step_s_mean",          "step_s_p50", "step_s_p90",      "first_call_s",        "peak_bytes",
    "peak_rss_delta_bytes", "gflops",     "executed_gflops", "machine_peak_gflops", "peak_frac",
    "unfused_gemms_s",      "loss",       "clip_ratio_low",  "clip_ratio_high",     "clip_ratio_region",
};

struct BenchResult {
  std::vector<double> step_s;  // the main run's timed steps (replayed as manual times)
  Counters counters;
  std::string label;  // one line: what ran (the plan's describe())
};

// show_progress: progress lines on stderr for long runs.
BenchResult run_bench(const BenchConfig& config, bool show_progress);

// A fraction of a bound (peak_frac, roofline_frac) above 1 is a measurement
// error, not a result: the bound's probe caught a slow moment. Moves the
// value to <key>_withheld, sets <key> to 0 (does not apply) and says so on
// stderr, naming `run`. Returns whether it withheld one.
bool withhold_fraction_above_one(Counters& counters, const std::string& key, const std::string& run);

}  // namespace grpo::bench
