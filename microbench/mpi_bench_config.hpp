// One grpo-mpi-bench run, as read from a YAML file under configs/mpi/: a
// grpo-microbench config of impl fused (every field means what it means
// there, configs/README.md) plus a `scale_out` map saying how the ranks of
// mpirun split it. Parsed without MPI, so the fast tests check the files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_config.hpp"

namespace grpo::bench {

enum class ScaleOutMode : std::uint8_t {
  vocab,  // every rank: all rows, one vocabulary shard of W (options.scale_out.vocab_group = the world)
  data,   // every rank: its own sequences, all of W (options.scale_out.data_group = the world)
};

const char* to_string(ScaleOutMode mode);

struct MpiBenchConfig {
  BenchConfig bench;  // impl fused; shape is the global problem
  ScaleOutMode mode = ScaleOutMode::vocab;
  // vocab: shards of whole vocab tiles (the plan's tile), so logp is bitwise
  // the single process's; false: an even split of the tokens.
  bool aligned_shards = true;
  // dapo / cispo / vespo: the library counts num_items_in_batch over the ranks.
  bool global_num_items = false;
  // Also time the single-process plan on the whole problem (rank 0 alone,
  // the other ranks idle), same threads per process: the same invocation's
  // reference for speedup_vs_single and peak_ratio_vs_single.
  bool single_reference = true;
};

// load_yaml_file + overrides ("a.b=value", applied to the whole file, the
// scale_out map included) + the checks above. Throws ConfigError naming the
// field.
MpiBenchConfig load_mpi_bench_config(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace grpo::bench
