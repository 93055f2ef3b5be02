// The measurement of one run: first call (plan creation included), warm-up,
// timed steps; per step the library-tracked peak and the process RSS
// high-water mark, each reset just before the step.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench_config.hpp"
#include "synth.hpp"

namespace grpo::bench {

// Progress lines on stderr for long runs: "<name>: step 2/5 (elapsed 14.2 s)".
// One line when a run starts; after that, quiet for quick runs: lines only
// once kQuietSeconds have passed, then at most one per kIntervalSeconds
// within a phase (and one at each phase change).
class Progress {
 public:
  explicit Progress(std::string name, bool enabled = true);
  void update(const std::string& phase, int i = 0, int n = 0);
  double elapsed() const;

 private:
  std::string name_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
  std::string last_phase_;
};

// Process memory from /proc/self: VmRSS and VmHWM, and the HWM reset
// (writing "5" to /proc/self/clear_refs sets VmHWM to the current VmRSS).
struct RssProbe {
  static bool reset_high_water_mark();
  static std::int64_t rss_bytes();              // -1 when unavailable
  static std::int64_t high_water_mark_bytes();  // -1 when unavailable
};

struct RunStats {
  std::vector<double> step_s;  // timed steps, in order
  double first_call_s = 0.0;   // plan creation + first step
  // Max over timed steps of (tracked peak - tracked live bytes before the step).
  std::size_t peak_bytes = 0;
  // Max over timed steps of (VmHWM after - VmRSS before); -1 when /proc is unavailable.
  std::int64_t peak_rss_delta_bytes = -1;
  Metrics metrics;  // of the last step
  std::string describe;
  std::size_t workspace_bytes = 0;
  // FLOPs one step's GEMMs executed (LM head: rows the fused path skips
  // excluded, padding to the GEMM row quantum included), from the last step.
  std::optional<double> executed_flops;
  std::optional<LmHeadStepStats> step_stats;  // LM head: rows and phase thread-seconds of the last step
  std::optional<double> unfused_gemms_s;      // when measured (LM head, measure_unfused_gemms)
  std::optional<double> forward_s;            // p50 of a forward-only run (measure_backward)

  double mean() const;
  double percentile(double q) const;  // nearest-rank on the sorted step times
  double p50() const { return percentile(0.5); }
  std::optional<double> backward_s() const;  // p50 - forward_s
};

// Synthesizes nothing: problem must match problem_spec(config).
// unfused_gemms: also time the unfused step's GEMMs alone after the steps
// (config.measure_unfused_gemms, unless a reference measures them anyway).
RunStats measure_run(const BenchConfig& config, const Problem& problem, Progress& progress, bool unfused_gemms);

}  // namespace grpo::bench
