// One implementation (fused, baseline, unfused GEMMs, logits-level paths, copy)
// bound to one synthesized problem: creates its plan and outputs, then runs
// steps. Outputs are host buffers allocated and touched here, outside the
// library's allocator, so a step's tracked peak is the step's own memory.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_config.hpp"
#include "synth.hpp"

namespace grpo::bench {

class Runner {
 public:
  virtual ~Runner() = default;
  // Creates the plan / baseline object (timed as part of first_call_s; the
  // constructor, which allocates and touches the outputs, is not).
  virtual void create() {}
  // Untimed preparation before each step (in place: restore the logits).
  virtual void before_step() {}
  // Runs one step. Returns its duration when the impl times itself (the
  // unfused GEMMs, which exclude building their operands); nullopt = time the call.
  virtual std::optional<double> step() = 0;
  virtual std::string describe() const = 0;
  virtual Metrics metrics() const { return metrics_; }
  // The fused plan's workspace (0 for the others).
  virtual std::size_t workspace_bytes() const { return 0; }
  // LM head: rows the last step put through its GEMMs (LmHeadOutputs::stats).
  virtual std::optional<LmHeadStepStats> step_stats() const { return std::nullopt; }
  // LM head: the unfused step's three GEMMs (one when forward-only) at this
  // run's shapes, timed alone, best of `reps` (unfused_gemms.hpp).
  virtual std::optional<double> unfused_gemms_seconds(int reps) { return std::nullopt; }

 protected:
  Metrics metrics_;
};

// Per-token outputs and the LM-head gradients of one run, allocated and
// touched once, outside the library's allocator. The config gives the hidden
// size, dtypes, layout, bias and frozen weight; the rows and vocabulary are
// the config's shape, or a scale-out rank's own (its rows, its shard).
struct HeadOutputs {
  HeadOutputs(const BenchConfig& c, bool forward_only);
  HeadOutputs(const BenchConfig& c, bool forward_only, std::int64_t n_rows, std::int64_t n_vocab);
  // Views of the buffers: dhidden / dweight / dbias only when they exist
  // (forward-only: none; frozen_weight: no dweight, no dbias).
  LmHeadOutputs view(const BenchConfig& c, Metrics* metrics, LmHeadStepStats* stats = nullptr);

  std::int64_t rows = 0, vocab = 0;
  std::vector<float> logp;
  HostBuffer dhidden, dweight;
  std::vector<float> dbias;
};

// The plan options a config asks for (fused loss, generic head, scale-out).
LmHeadOptions plan_options(const BenchConfig& c, Allocator& allocator);

// Builds the runner and its outputs; call create() before the first step.
// allocator: what the library's options get (the tracker).
std::unique_ptr<Runner> make_runner(const BenchConfig& config, const Problem& problem, Allocator& allocator);

// The problem a config's impl runs on.
ProblemSpec problem_spec(const BenchConfig& config);
bool same_problem(const ProblemSpec& a, const ProblemSpec& b);

// Nominal work of one step: GEMM flops of an LM-head step (2NVH per GEMM,
// three GEMMs with backward) and the logits bytes a logits-level step must
// move (read logits, write dlogits). Rows the fused path skips still count,
// so the rates compare implementations on the same work.
double nominal_flops(const BenchConfig& config);
double nominal_bytes(const BenchConfig& config);

// The FLOPs an LM-head step's GEMMs executed: 2 * V * H per row of the logits
// GEMM and per row of each of the two backward GEMMs.
double executed_flops(const BenchConfig& config, const LmHeadStepStats& rows);

}  // namespace grpo::bench
