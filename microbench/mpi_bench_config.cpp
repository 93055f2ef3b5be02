#include "mpi_bench_config.hpp"

namespace grpo::bench {

const char* to_string(ScaleOutMode mode) { return mode == ScaleOutMode::vocab ? "vocab" : "data"; }

MpiBenchConfig load_mpi_bench_config(const std::string& path, const std::vector<std::string>& overrides) {
  YAML::Node tree = load_yaml_file(path);
  for (const std::string& o : overrides) {
    try {
      apply_override(tree, o);
    } catch (const ConfigError& e) {
      throw ConfigError(e.field(), e.message() + " (in a --set override)", path);
    }
  }
  MpiBenchConfig c;
  try {
    if (!tree.IsMap() || !tree["scale_out"]) {
      throw ConfigError("scale_out", "is required (mode: vocab | data): grpo-mpi-bench splits the run over the ranks");
    }
    {
      MapReader r(tree["scale_out"], "scale_out");
      if (!r.has("mode")) throw ConfigError("scale_out.mode", "is required (vocab | data)");
      c.mode = *r.get_enum<ScaleOutMode>("mode", {{"vocab", ScaleOutMode::vocab}, {"data", ScaleOutMode::data}});
      c.aligned_shards = r.get_bool("aligned_shards").value_or(true);
      c.global_num_items = r.get_bool("global_num_items").value_or(false);
      c.single_reference = r.get_bool("single_reference").value_or(true);
      r.finish();
    }
    for (const char* refused : {"references", "measure_backward", "measure_unfused_gemms", "unfused_gemms_steps"}) {
      if (tree[refused]) {
        throw ConfigError(refused, "is not offered by grpo-mpi-bench (its reference is the single-process plan)");
      }
    }
    tree.remove("scale_out");
    tree["measure_unfused_gemms"] = false;
  } catch (const ConfigError& e) {
    if (!e.source().empty()) throw;
    throw ConfigError(e.field(), e.message(), path);
  }
  c.bench = parse_bench_config(tree, path);
  if (c.bench.impl != Impl::fused) {
    throw ConfigError("impl", "must be fused: grpo-mpi-bench runs the fused plan over the ranks", path);
  }
  if (c.mode == ScaleOutMode::data && c.bench.shape.batch < 1) {
    throw ConfigError("shape.batch", "must be >= 1", path);
  }
  if (c.global_num_items && c.mode != ScaleOutMode::data) {
    throw ConfigError("scale_out.global_num_items", "applies to mode data", path);
  }
  return c;
}

}  // namespace grpo::bench
