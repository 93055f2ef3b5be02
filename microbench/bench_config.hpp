// One microbench run, as read from a YAML file under configs/microbench/.
// configs/README.md lists every field; parse_bench_config refuses unknown or
// ill-typed fields, naming them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common_config.hpp"

namespace grpo::bench {

enum class Impl : std::uint8_t {
  fused,            // LmHeadLossPlan
  generic_head,     // LmHeadLogProbPlan forward, a GRPO loss on its logp computed outside, its backward
  baseline,         // LmHeadBaseline (full logits)
  unfused_gemms,    // the unfused step's three oneDNN GEMMs alone, no loss work (unfused_gemms.hpp)
  logits_fused,     // LogitsLossPlan on materialized logits
  logits_baseline,  // LogitsBaseline
  copy,             // memcpy of the logits bytes: the bandwidth yardstick
};

// Where the library's allocations come from during a run (always through a
// TrackingAllocator on top, which counts live bytes either way).
enum class AllocatorKind : std::uint8_t {
  caching,  // freed blocks reused (steady state of a training loop; see caching_allocator.hpp)
  system,   // operator new / delete every call: every step pays first-touch page faults
};

const char* to_string(Impl impl);
bool is_lm_head(Impl impl);  // needs hidden and weight (else it starts from logits)

struct BenchConfig {
  std::string name;         // the benchmark's name; default: the file's stem
  std::string description;  // free text, shown nowhere but the file
  std::string source;       // the file it came from
  Impl impl = Impl::fused;
  ShapeSpec shape;
  DType dtype = DType::f32;         // hidden and weight
  DType logits_dtype = DType::f32;  // baseline logits; logits-level inputs
  WeightLayout layout = WeightLayout::vocab_major;
  bool bias = false;
  std::int64_t vocab_tile = 0;                                        // 0 = the plan's choice
  std::int64_t token_block = 0;                                       // 0 = the plan's choice
  std::uint64_t workspace_budget = LmHeadOptions{}.workspace_budget;  // the library's default
  DType dhidden_dtype = DType::f32;
  DType dweight_dtype = DType::f32;
  bool forward_only = false;
  bool frozen_weight = false;  // LmHeadOptions::frozen_weight (fused and generic_head only)
  double grad_filter = 0.0;    // LmHeadOptions::grad_filter: off | auto | a threshold (fused and generic_head only)
  bool in_place = false;       // logits level: dlogits written over the logits
  // Also time a forward-only run of the same impl on the same inputs;
  // backward_s = step time - forward-only time.
  bool measure_backward = false;
  // LM head: also time the unfused step's three oneDNN GEMMs alone at this
  // shape (unfused_gemms_s), a reference point, not a bound.
  bool measure_unfused_gemms = true;
  int unfused_gemms_steps = 1;  // best of this many runs of them
  AllocatorKind allocator = AllocatorKind::caching;
  int threads = 0;  // 0 = every core of the current task_arena
  // GRPO_GEMM for this run's plans (a name of the library's backend table;
  // empty = the library's own choice), so ours and oneDNN's compare in one
  // invocation.
  std::string gemm_backend;
  int warmup = 1;  // untimed steps after the (separately timed) first call
  int steps = 3;   // timed steps
  LossSpec loss;
  InputSpec inputs;

  struct Reference;
  std::vector<Reference> references;  // measured in the same process, same shape
};

// A run measured beside the main one for ratio counters: the main config
// with the reference's fields laid over it.
struct BenchConfig::Reference {
  std::string name;
  BenchConfig config;
};

// tree: the parsed YAML; source: its file (for messages and the default name).
BenchConfig parse_bench_config(const YAML::Node& tree, const std::string& source);

// load_yaml_file + overrides ("a.b=value") + parse_bench_config.
BenchConfig load_bench_config(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace grpo::bench
