#include "bench_run.hpp"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include <tbb/task_arena.h>
#include <string>
#include <utility>

#include "input_stats.hpp"
#include "machine_peak.hpp"
#include "measure.hpp"
#include "runners.hpp"

namespace grpo::bench {
namespace {

// Rows the input statistics are measured on: 64 full reference rows, a few
// seconds at V=151936 H=4096 on 2 cores.
constexpr int kInputStatsRows = 64;

void add_run_counters(const BenchConfig& c, const RunStats& s, Counters& out) {
  out["step_s_mean"] = s.mean();
  out["step_s_p50"] = s.p50();
  out["step_s_p90"] = s.percentile(0.9);
  out["step_s_min"] = s.percentile(0.0);
  out["first_call_s"] = s.first_call_s;
  out["peak_bytes"] = static_cast<double>(s.peak_bytes);
  out["peak_rss_delta_bytes"] = static_cast<double>(s.peak_rss_delta_bytes);
  out["workspace_bytes"] = static_cast<double>(s.workspace_bytes);
  // Rates use the p50 step. gflops: the nominal work (three GEMMs' worth,
  // rows the fused path skips still count), so it compares implementations
  // on the same work. executed_gflops: the FLOPs the step's GEMMs really
  // executed; peak_frac: that over the machine's measured peak for the
  // dtype, an upper bound nothing can exceed. 0 = does not apply (the FLOP
  // counters for logits-level runs, GB/s for LM-head runs).
  const double flops = nominal_flops(c), bytes = nominal_bytes(c);
  out["gflops"] = s.p50() > 0.0 ? flops / s.p50() * 1e-9 : 0.0;
  out["gbytes_per_s"] = s.p50() > 0.0 ? bytes / s.p50() * 1e-9 : 0.0;
  const double executed = s.executed_flops && s.p50() > 0.0 ? *s.executed_flops / s.p50() * 1e-9 : 0.0;
  out["executed_gflops"] = executed;
  out["machine_peak_gflops"] = 0.0;
  out["peak_frac"] = 0.0;
  if (is_lm_head(c.impl)) {
    const MachinePeak& peak = machine_peak();
    out["machine_peak_gflops"] = peak.for_dtype(c.dtype);
    out["peak_f32_fma_gflops"] = peak.f32_fma_gflops;
    out["peak_avx512_bf16_gflops"] = peak.avx512_bf16_gflops;
    out["peak_amx_bf16_gflops"] = peak.amx_bf16_gflops;
    out["machine_peak_threads"] = peak.threads;
    if (peak.for_dtype(c.dtype) > 0.0) out["peak_frac"] = executed / peak.for_dtype(c.dtype);
    // The roofline of the step's own schedule: its FLOPs at the peak or its
    // bytes (LmHeadStepStats::schedule_bytes) at the triad bandwidth,
    // whichever takes longer: no run of this schedule can be faster.
    out["machine_triad_gbytes_per_s"] = peak.triad_gbytes_per_s;
    if (s.step_stats && s.step_stats->schedule_bytes > 0.0 && s.executed_flops && peak.for_dtype(c.dtype) > 0.0 &&
        peak.triad_gbytes_per_s > 0.0) {
      const double compute_s = *s.executed_flops / (peak.for_dtype(c.dtype) * 1e9);
      const double memory_s = s.step_stats->schedule_bytes / (peak.triad_gbytes_per_s * 1e9);
      out["schedule_bytes"] = s.step_stats->schedule_bytes;
      out["roofline_compute_s"] = compute_s;
      out["roofline_memory_s"] = memory_s;
      out["roofline_s"] = std::max(compute_s, memory_s);
      out["roofline_frac"] = s.p50() > 0.0 ? std::max(compute_s, memory_s) / s.p50() : 0.0;
    }
    withhold_fraction_above_one(out, "peak_frac", c.name);
    withhold_fraction_above_one(out, "roofline_frac", c.name);
  }
  // Where the last step's time went (thread-seconds per phase, see
  // LmHeadStepStats), and each phase's share of that same step's
  // thread-seconds (its wall time x threads; not the p50's, which a slower
  // last step would overrun into a negative remainder); other_frac:
  // everything else (loss, gathers, waits).
  if (s.step_stats && !s.step_s.empty() &&
      (s.step_stats->forward_gemm_s > 0.0 || s.step_stats->forward_stage_s > 0.0)) {
    const LmHeadStepStats& t = *s.step_stats;
    const double threads = c.threads > 0 ? c.threads : tbb::this_task_arena::max_concurrency();
    out["phase_step_s"] = s.step_s.back();
    const double total = s.step_s.back() * threads;
    const std::pair<const char*, double> phases[] = {{"forward_gemm", t.forward_gemm_s},
                                                     {"forward_stage", t.forward_stage_s},
                                                     {"dlogits", t.dlogits_s},
                                                     {"dweight_gemm", t.dweight_gemm_s},
                                                     {"dhidden_gemm", t.dhidden_gemm_s}};
    double accounted = 0.0;
    for (const auto& [name, sec] : phases) {
      out[std::string("phase_") + name + "_s"] = sec;
      out[std::string("phase_") + name + "_frac"] = total > 0.0 ? sec / total : 0.0;
      accounted += sec;
    }
    out["phase_other_frac"] = total > 0.0 ? 1.0 - accounted / total : 0.0;
  }
  // The filtered backward (grad_filter): the share of each backward GEMM's
  // unfiltered FLOPs (its rows x V) that the filter left out, last step.
  if (s.step_stats && c.grad_filter != 0.0) {
    const LmHeadStepStats& t = *s.step_stats;
    const double v = static_cast<double>(c.shape.vocab);
    const auto frac = [&](std::int64_t skipped, std::int64_t rows) {
      return rows > 0 ? static_cast<double>(skipped) / (static_cast<double>(rows) * v) : 0.0;
    };
    out["filter_dhidden_skipped_frac"] = frac(t.dhidden_skipped_row_columns, t.dhidden_gemm_rows);
    out["filter_dweight_skipped_frac"] = frac(t.dweight_skipped_row_columns, t.dweight_gemm_rows);
    out["filter_guard_blocks"] = static_cast<double>(t.filter_guard_blocks);
    out["filter_lowered_blocks"] = static_cast<double>(t.filter_lowered_blocks);
  }
  // The unfused step's oneDNN GEMMs timed alone (a reference, not a bound).
  out["unfused_gemms_s"] = s.unfused_gemms_s.value_or(0.0);
  out["loss"] = s.metrics.loss;
  out["clip_ratio_low"] = s.metrics.clip_ratio_low;
  out["clip_ratio_high"] = s.metrics.clip_ratio_high;
  out["clip_ratio_region"] = s.metrics.clip_ratio_region;
  out["entropy_mean"] = s.metrics.entropy_mean;
  out["kl_mean"] = s.metrics.kl_mean;
  out["num_valid"] = static_cast<double>(s.metrics.num_valid);
  out["batch"] = static_cast<double>(c.shape.batch);
  out["seq_len"] = static_cast<double>(c.shape.seq_len);
  out["hidden"] = static_cast<double>(c.shape.hidden);
  out["vocab"] = static_cast<double>(c.shape.vocab);
  if (s.forward_s) {
    out["forward_s"] = *s.forward_s;
    out["backward_s"] = *s.backward_s();
  }
}

void add_reference_counters(const std::string& ref, Impl ref_impl, const RunStats& main, const RunStats& r,
                            Counters& out) {
  out[ref + "_step_s"] = r.p50();
  out[ref + "_peak_bytes"] = static_cast<double>(r.peak_bytes);
  out[ref + "_peak_rss_delta_bytes"] = static_cast<double>(r.peak_rss_delta_bytes);
  if (r.p50() > 0.0) out["time_ratio_vs_" + ref] = main.p50() / r.p50();
  if (main.p50() > 0.0) out["speedup_vs_" + ref] = r.p50() / main.p50();
  if (r.peak_bytes > 0)
    out["peak_ratio_vs_" + ref] = static_cast<double>(main.peak_bytes) / static_cast<double>(r.peak_bytes);
  // A copy moves the bytes a fused logits-level step must move; its time over
  // ours is the fraction of the copy's bandwidth we reach.
  if (ref_impl == Impl::copy && main.p50() > 0.0) out["copy_bw_frac"] = r.p50() / main.p50();
  if (r.forward_s) {
    out[ref + "_backward_s"] = *r.backward_s();
    if (main.forward_s && *r.backward_s() > 0.0) out["backward_ratio_vs_" + ref] = *main.backward_s() / *r.backward_s();
  }
}

}  // namespace

namespace {

// GRPO_GEMM for one run's plans (kernels::forced_gemm_backend() reads it when
// a plan builds its GEMMs), the previous value restored after.
class GemmBackendScope {
 public:
  explicit GemmBackendScope(const std::string& backend) : active_(!backend.empty()) {
    if (!active_) return;
    if (const char* old = std::getenv("GRPO_GEMM")) previous_ = old;
    setenv("GRPO_GEMM", backend.c_str(), 1);
  }
  ~GemmBackendScope() {
    if (!active_) return;
    if (previous_) {
      setenv("GRPO_GEMM", previous_->c_str(), 1);
    } else {
      unsetenv("GRPO_GEMM");
    }
  }
  GemmBackendScope(const GemmBackendScope&) = delete;
  GemmBackendScope& operator=(const GemmBackendScope&) = delete;

 private:
  bool active_;
  std::optional<std::string> previous_;
};

}  // namespace

BenchResult run_bench(const BenchConfig& config, bool show_progress) {
  Progress progress(config.name, show_progress);
  const GemmBackendScope gemm_backend(config.gemm_backend);
  if (is_lm_head(config.impl)) {
    // Measured first, on an otherwise idle process (once per process).
    progress.update("measuring the machine's peak");
    const MachinePeak& peak = machine_peak();
    if (show_progress && !peak.missing.empty()) {
      std::fprintf(stderr, "grpo-microbench: machine peak: not measured: %s\n", peak.missing.c_str());
    }
  }
  progress.update("synthesizing inputs");
  const ProblemSpec spec = problem_spec(config);
  auto problem = std::make_unique<Problem>(synthesize(spec));
  // What trained-like or saved inputs look like, on sampled rows (input_stats.hpp).
  std::optional<InputStats> input_stats;
  if (spec.inputs.generator != InputGenerator::random) {
    progress.update("measuring the inputs' entropy");
    input_stats = measure_inputs(*problem, kInputStatsRows, config.threads);
    if (show_progress) std::fprintf(stderr, "%s: %s\n", config.name.c_str(), input_stats->summary().c_str());
  }

  // An unfused_gemms reference measures them anyway; do not pay twice.
  const BenchConfig::Reference* gemms_ref = nullptr;
  for (const auto& r : config.references) {
    if (r.config.impl == Impl::unfused_gemms) gemms_ref = &r;
  }
  RunStats main = measure_run(config, *problem, progress, config.measure_unfused_gemms && gemms_ref == nullptr);

  BenchResult result;
  std::vector<std::pair<const BenchConfig::Reference*, RunStats>> refs;
  for (const auto& r : config.references) {
    Progress ref_progress(r.config.name, show_progress);
    const ProblemSpec ref_spec = problem_spec(r.config);
    std::unique_ptr<Problem> own;
    if (!same_problem(ref_spec, spec)) {
      ref_progress.update("synthesizing inputs");
      own = std::make_unique<Problem>(synthesize(ref_spec));
    }
    refs.emplace_back(&r, measure_run(r.config, own ? *own : *problem, ref_progress, false));
  }
  if (gemms_ref != nullptr && config.measure_unfused_gemms) {
    for (const auto& [r, s] : refs) {
      if (r == gemms_ref) main.unfused_gemms_s = s.p50();
    }
  }
  add_run_counters(config, main, result.counters);
  for (const auto& [r, s] : refs) add_reference_counters(r->name, r->config.impl, main, s, result.counters);
  if (input_stats) {
    result.counters["inputs_entropy_mean"] = input_stats->entropy_mean;
    result.counters["inputs_entropy_p10"] = input_stats->entropy_p10;
    result.counters["inputs_entropy_p50"] = input_stats->entropy_p50;
    result.counters["inputs_entropy_p90"] = input_stats->entropy_p90;
    result.counters["inputs_frac_above_eps"] = input_stats->frac_above;
  }
  result.step_s = main.step_s;
  result.label = main.describe;
  return result;
}

bool withhold_fraction_above_one(Counters& counters, const std::string& key, const std::string& run) {
  const auto it = counters.find(key);
  if (it == counters.end() || !(it->second > 1.0)) return false;
  std::fprintf(stderr,
               "grpo-microbench: %s: %s = %.4g is above 1, a measurement error (the peak probe ran at a slow "
               "moment, or the bound is wrong): withheld as %s_withheld, %s reported as 0\n",
               run.c_str(), key.c_str(), it->second, key.c_str(), key.c_str());
  counters[key + "_withheld"] = it->second;
  it->second = 0.0;
  return true;
}

}  // namespace grpo::bench
