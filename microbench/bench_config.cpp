#include "bench_config.hpp"

#include "kernels/gemm_backend.hpp"

namespace grpo::bench {
namespace {

// GRPO_GEMM's names, from the library's one backend table.
std::vector<std::pair<std::string, std::string>> gemm_backend_names() {
  std::vector<std::pair<std::string, std::string>> names;
  for (const grpo::kernels::GemmBackendEntry& e : grpo::kernels::gemm_backends()) names.emplace_back(e.name, e.name);
  return names;
}

const std::vector<std::pair<std::string, Impl>> kImpls = {
    {"fused", Impl::fused},
    {"generic_head", Impl::generic_head},
    {"baseline", Impl::baseline},
    {"unfused_gemms", Impl::unfused_gemms},
    {"logits_fused", Impl::logits_fused},
    {"logits_baseline", Impl::logits_baseline},
    {"copy", Impl::copy},
};

int positive_int(MapReader& r, const std::string& key, int fallback, int min) {
  const std::int64_t v = r.get_int(key).value_or(fallback);
  if (v < min || v > 1000000) throw ConfigError(r.field(key), "must be within [" + std::to_string(min) + ", 1000000]");
  return static_cast<int>(v);
}

// path: "" for the file's top level, "references[i]" for a reference.
BenchConfig parse_run(const YAML::Node& tree, const std::string& source, const std::string& path, bool top) {
  MapReader r(tree, path);
  BenchConfig c;
  c.source = source;
  c.name = r.get_string("name").value_or(file_stem(source));
  c.description = r.get_string("description").value_or("");
  if (!r.has("impl"))
    throw ConfigError(r.field("impl"),
                      "is required (fused | baseline | unfused_gemms | logits_fused | logits_baseline | copy)");
  c.impl = *r.get_enum<Impl>("impl", kImpls);
  const bool lm_head = is_lm_head(c.impl);
  c.shape = parse_shape(r, lm_head, to_string(c.impl));
  c.dtype = parse_dtype(r, "dtype", DType::f32);
  c.logits_dtype = parse_dtype(r, "logits_dtype", DType::f32);
  c.layout = parse_layout(r, "weight_layout");
  c.bias = r.get_bool("bias").value_or(false);
  c.vocab_tile = r.get_int("vocab_tile").value_or(0);
  if (c.vocab_tile < 0) throw ConfigError(r.field("vocab_tile"), "must be >= 0 (0 = the plan's choice)");
  c.token_block = r.get_int("token_block").value_or(0);
  if (c.token_block < 0) throw ConfigError(r.field("token_block"), "must be >= 0 (0 = the plan's choice)");
  c.workspace_budget = r.get_bytes("workspace_budget").value_or(c.workspace_budget);
  c.dhidden_dtype = parse_dtype(r, "dhidden_dtype", DType::f32);
  c.dweight_dtype = parse_dtype(r, "dweight_dtype", DType::f32);
  c.forward_only = r.get_bool("forward_only").value_or(false);
  c.frozen_weight = r.get_bool("frozen_weight").value_or(false);
  if (const YAML::Node f = r.raw("grad_filter"); f && !f.IsNull()) {
    const std::string word = f.IsScalar() ? f.Scalar() : "";
    if (word == "off" || word == "false") {
      c.grad_filter = 0.0;
    } else if (word == "auto") {
      c.grad_filter = kGradFilterAuto;
    } else {
      const std::optional<double> t = r.get_double("grad_filter");
      if (!t || !(*t > 0.0 && *t < 1.0)) {
        throw ConfigError(r.field("grad_filter"), "must be off, auto or a threshold in (0, 1)");
      }
      c.grad_filter = *t;
    }
  }
  c.in_place = r.get_bool("in_place").value_or(false);
  c.measure_backward = r.get_bool("measure_backward").value_or(false);
  c.measure_unfused_gemms = r.get_bool("measure_unfused_gemms").value_or(lm_head);
  c.unfused_gemms_steps = positive_int(r, "unfused_gemms_steps", 1, 1);
  c.allocator =
      r.get_enum<AllocatorKind>("allocator", {{"caching", AllocatorKind::caching}, {"system", AllocatorKind::system}})
          .value_or(c.allocator);
  c.threads = positive_int(r, "threads", 0, 0);
  c.gemm_backend = r.get_enum<std::string>("gemm_backend", gemm_backend_names()).value_or("");
  c.warmup = positive_int(r, "warmup", 1, 0);
  c.steps = positive_int(r, "steps", 3, 1);
  c.loss = parse_loss(r);
  c.inputs = parse_inputs(r);

  if (!lm_head && c.impl != Impl::copy && c.dtype != DType::f32) {
    throw ConfigError(r.field("dtype"), "is for hidden and weight; logits-level runs take logits_dtype");
  }
  if (c.inputs.generator != InputGenerator::random && (!lm_head || c.bias)) {
    throw ConfigError(r.field("inputs.generator"),
                      "trained_like and file build an LM head without bias (impl fused | "
                      "generic_head | baseline | unfused_gemms, bias: false)");
  }
  if (c.in_place && c.impl != Impl::logits_fused && c.impl != Impl::logits_baseline) {
    throw ConfigError(r.field("in_place"), "applies to the logits-level impls only");
  }
  if (c.measure_unfused_gemms && !lm_head) {
    throw ConfigError(r.field("measure_unfused_gemms"), "needs an LM-head impl (fused | baseline | unfused_gemms)");
  }
  if (c.measure_backward && c.forward_only) {
    throw ConfigError(r.field("measure_backward"), "makes no sense with forward_only: true");
  }
  if (c.frozen_weight && c.impl != Impl::fused && c.impl != Impl::generic_head) {
    throw ConfigError(r.field("frozen_weight"), "needs impl fused or generic_head (the baselines always compute dW)");
  }
  if (c.grad_filter != 0.0 && c.impl != Impl::fused && c.impl != Impl::generic_head) {
    throw ConfigError(r.field("grad_filter"), "needs impl fused or generic_head (the baselines are exact)");
  }
  if (c.measure_backward && c.impl != Impl::fused && c.impl != Impl::baseline) {
    throw ConfigError(r.field("measure_backward"), "needs impl fused or baseline");
  }

  const YAML::Node refs = r.raw("references");
  if (refs && !refs.IsNull()) {
    if (!top) throw ConfigError(r.field("references"), "cannot nest inside a reference");
    if (!refs.IsSequence()) throw ConfigError(r.field("references"), "must be a list of maps");
    YAML::Node base = YAML::Clone(tree);
    base.remove("references");
    base.remove("name");
    base.remove("description");
    for (std::size_t i = 0; i < refs.size(); ++i) {
      const std::string ref_path = r.field("references") + "[" + std::to_string(i) + "]";
      MapReader ref(refs[i], ref_path);
      const std::string ref_name = ref.require<std::string>("name", &MapReader::get_string);
      for (const char* fixed : {"shape", "references"}) {
        if (ref.has(fixed)) throw ConfigError(ref.field(fixed), "cannot differ from the main run's");
      }
      YAML::Node overlay = YAML::Clone(refs[i]);
      overlay.remove("name");
      BenchConfig rc = parse_run(merge_nodes(base, overlay), source, ref_path, false);
      rc.name = c.name + "/" + ref_name;
      for (const auto& existing : c.references) {
        if (existing.name == ref_name) throw ConfigError(ref.field("name"), "'" + ref_name + "' is used twice");
      }
      c.references.push_back({ref_name, std::move(rc)});
    }
  }
  r.finish();
  return c;
}

}  // namespace

const char* to_string(Impl impl) {
  for (const auto& [name, value] : kImpls) {
    if (value == impl) return name.c_str();
  }
  return "?";
}

bool is_lm_head(Impl impl) {
  return impl == Impl::fused || impl == Impl::generic_head || impl == Impl::baseline || impl == Impl::unfused_gemms;
}

BenchConfig parse_bench_config(const YAML::Node& tree, const std::string& source) {
  try {
    return parse_run(tree, source, "", true);
  } catch (const ConfigError& e) {
    if (!e.source().empty() || source.empty()) throw;
    throw ConfigError(e.field(), e.message(), source);
  }
}

BenchConfig load_bench_config(const std::string& path, const std::vector<std::string>& overrides) {
  YAML::Node tree = load_yaml_file(path);
  for (const std::string& o : overrides) {
    try {
      apply_override(tree, o);
    } catch (const ConfigError& e) {
      throw ConfigError(e.field(), e.message() + " (in a --set / --sweep override)", path);
    }
  }
  return parse_bench_config(tree, path);
}

}  // namespace grpo::bench
