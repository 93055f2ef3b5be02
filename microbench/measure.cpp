#include "measure.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>

#include "caching_allocator.hpp"
#include "runners.hpp"

namespace grpo::bench {
namespace {

constexpr double kQuietSeconds = 3.0;     // runs shorter than this print nothing
constexpr double kIntervalSeconds = 2.0;  // at most one line per interval within a phase

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

std::int64_t status_field_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;  // "VmHWM:  123 kB"
  }
  return -1;
}

// One call of `call` with the per-step bookkeeping: tracked peak and RSS
// high-water mark reset just before, read just after. Returns the seconds the
// call took (or the time it measured itself).
template <class F>
double observed_call(TrackingAllocator& tracker, RunStats& stats, F&& call) {
  const std::size_t live_before = tracker.live_bytes();
  tracker.reset_peak();
  const bool rss_ok = RssProbe::reset_high_water_mark();
  const std::int64_t rss_before = RssProbe::rss_bytes();
  const auto t0 = Clock::now();
  const std::optional<double> self_timed = call();
  const double dt = self_timed.value_or(seconds(t0, Clock::now()));
  const std::int64_t hwm = RssProbe::high_water_mark_bytes();
  stats.peak_bytes = std::max(stats.peak_bytes, tracker.peak_bytes() - live_before);
  if (rss_ok && rss_before >= 0 && hwm >= 0) {
    stats.peak_rss_delta_bytes = std::max(stats.peak_rss_delta_bytes, hwm - rss_before);
  }
  return dt;
}

// Times `steps` calls of runner after `warmup` untimed ones; fills the step
// statistics of `stats`.
void timed_steps(Runner& runner, TrackingAllocator& tracker, int warmup, int steps, Progress& progress,
                 const std::string& phase, RunStats& stats) {
  for (int i = 0; i < warmup; ++i) {
    progress.update(phase.empty() ? "warm-up" : phase + " warm-up", i + 1, warmup);
    runner.before_step();
    runner.step();
  }
  for (int i = 0; i < steps; ++i) {
    progress.update(phase.empty() ? "step" : phase + " step", i + 1, steps);
    runner.before_step();
    stats.step_s.push_back(observed_call(tracker, stats, [&] { return runner.step(); }));
  }
}

Allocator& upstream_for(const BenchConfig& config, CachingAllocator& cache) {
  return config.allocator == AllocatorKind::caching ? static_cast<Allocator&>(cache) : default_allocator();
}

}  // namespace

Progress::Progress(std::string name, bool enabled)
    : name_(std::move(name)), enabled_(enabled), start_(Clock::now()), last_(start_) {}

double Progress::elapsed() const { return seconds(start_, Clock::now()); }

void Progress::update(const std::string& phase, int i, int n) {
  const auto now = Clock::now();
  const double since_start = seconds(start_, now);
  const bool new_phase = phase != last_phase_;
  const bool first = last_phase_.empty();  // always say which config starts
  if (!enabled_ ||
      (!first && (since_start < kQuietSeconds || (!new_phase && seconds(last_, now) < kIntervalSeconds)))) {
    return;
  }
  last_ = now;
  last_phase_ = phase;
  if (n > 0) {
    std::fprintf(stderr, "grpo-microbench: %s: %s %d/%d (elapsed %.1f s)\n", name_.c_str(), phase.c_str(), i, n,
                 since_start);
  } else {
    std::fprintf(stderr, "grpo-microbench: %s: %s (elapsed %.1f s)\n", name_.c_str(), phase.c_str(), since_start);
  }
  std::fflush(stderr);
}

bool RssProbe::reset_high_water_mark() {
  std::ofstream out("/proc/self/clear_refs");
  if (!out) return false;
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

std::int64_t RssProbe::rss_bytes() { return status_field_bytes("VmRSS"); }
std::int64_t RssProbe::high_water_mark_bytes() { return status_field_bytes("VmHWM"); }

double RunStats::mean() const {
  return step_s.empty() ? 0.0 : std::accumulate(step_s.begin(), step_s.end(), 0.0) / static_cast<double>(step_s.size());
}

double RunStats::percentile(double q) const {
  if (step_s.empty()) return 0.0;
  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<std::size_t>(rank, 1, sorted.size()) - 1];
}

std::optional<double> RunStats::backward_s() const {
  if (!forward_s) return std::nullopt;
  return p50() - *forward_s;
}

RunStats measure_run(const BenchConfig& config, const Problem& problem, Progress& progress, bool unfused_gemms) {
  RunStats stats;
  {
    // Declared in this order so the runner (and its plan) goes first.
    CachingAllocator cache;
    TrackingAllocator tracker(upstream_for(config, cache));
    std::unique_ptr<Runner> runner = make_runner(config, problem, tracker);  // outputs: not timed
    progress.update("first call (plan creation + step)");
    runner->before_step();
    // The first call's RSS delta counts (with a caching allocator it is the
    // only call that maps fresh memory); its tracked peak does not: the steps'
    // peak is the number asked for, and the first call's is the same.
    RunStats first;
    stats.first_call_s = observed_call(tracker, first, [&] {
      runner->create();
      runner->step();
      return std::optional<double>{};  // wall time, plan creation included
    });
    stats.peak_rss_delta_bytes = first.peak_rss_delta_bytes;
    stats.describe = runner->describe();
    stats.workspace_bytes = runner->workspace_bytes();
    timed_steps(*runner, tracker, config.warmup, config.steps, progress, "", stats);
    stats.metrics = runner->metrics();
    if (const std::optional<LmHeadStepStats> rows = runner->step_stats()) {
      stats.executed_flops = executed_flops(config, *rows);
      stats.step_stats = rows;
    }
    if (unfused_gemms) {
      progress.update("the unfused step's GEMMs alone");
      stats.unfused_gemms_s = runner->unfused_gemms_seconds(config.unfused_gemms_steps);
      if (!stats.unfused_gemms_s && config.impl == Impl::unfused_gemms) stats.unfused_gemms_s = stats.p50();
    }
  }
  if (config.measure_backward) {
    // The same impl forward-only on the same inputs; backward = step - forward.
    BenchConfig fwd = config;
    fwd.forward_only = true;
    CachingAllocator cache;
    TrackingAllocator tracker(upstream_for(fwd, cache));
    std::unique_ptr<Runner> runner = make_runner(fwd, problem, tracker);
    runner->create();
    RunStats f;
    timed_steps(*runner, tracker, std::max(config.warmup, 1), config.steps, progress, "forward-only", f);
    stats.forward_s = f.p50();
  }
  return stats;
}

}  // namespace grpo::bench
