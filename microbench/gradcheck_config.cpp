#include "gradcheck_config.hpp"

#include <cmath>

namespace grpo::bench {
namespace {

GradcheckConfig parse(const YAML::Node& tree, const std::string& source) {
  MapReader r(tree, "");
  GradcheckConfig c;
  c.source = source;
  c.name = r.get_string("name").value_or(file_stem(source));
  c.description = r.get_string("description").value_or("");
  c.shape = parse_shape(r, true, "gradcheck");
  c.dtype = parse_dtype(r, "dtype", DType::f32);
  c.layout = parse_layout(r, "weight_layout");
  c.bias = r.get_bool("bias").value_or(false);
  c.baseline_logits_dtype = parse_dtype(r, "baseline_logits_dtype", DType::f32);
  c.vocab_tile = r.get_int("vocab_tile").value_or(0);
  if (c.vocab_tile < 0) throw ConfigError(r.field("vocab_tile"), "must be >= 0 (0 = the plan's choice)");
  c.token_block = r.get_int("token_block").value_or(0);
  if (c.token_block < 0) throw ConfigError(r.field("token_block"), "must be >= 0 (0 = the plan's choice)");
  c.workspace_budget = r.get_bytes("workspace_budget").value_or(c.workspace_budget);
  const std::int64_t threads = r.get_int("threads").value_or(0);
  if (threads < 0 || threads > 1024) throw ConfigError(r.field("threads"), "must be within [0, 1024]");
  c.threads = static_cast<int>(threads);
  c.loss = parse_loss(r);
  c.inputs = parse_inputs(r);
  if (!r.has("oracle")) throw ConfigError(r.field("oracle"), "is required (none | lm_head | loss)");
  c.oracle = *r.get_enum<OracleMode>(
      "oracle", {{"none", OracleMode::none}, {"lm_head", OracleMode::lm_head}, {"loss", OracleMode::loss}});
  const double work =
      static_cast<double>(c.shape.rows()) * static_cast<double>(c.shape.vocab) * static_cast<double>(c.shape.hidden);
  if (c.oracle == OracleMode::lm_head && work > kMaxLmHeadOracleWork) {
    throw ConfigError(r.field("oracle"), "lm_head runs O(N*V*H) plain loops; N*V*H = " + std::to_string(work) +
                                             " is too large (use oracle: loss)");
  }
  MapReader tol = r.map("tolerance", false);
  std::vector<std::string> keys = {"loss", "logp", "entropy", "dhidden", "dweight"};
  if (c.bias) keys.emplace_back("dbias");
  for (const std::string& key : keys) {
    MapReader q = tol.map(key, false);
    Tolerance t;
    t.abs = q.require<double>("abs", &MapReader::get_double);
    t.rel = q.require<double>("rel", &MapReader::get_double);
    if (!(t.abs >= 0.0) || !(t.rel >= 0.0) || !std::isfinite(t.abs) || !std::isfinite(t.rel)) {
      throw ConfigError(q.path(), "abs and rel must be finite and >= 0");
    }
    q.finish();
    c.tolerance[key] = t;
  }
  tol.finish();
  r.finish();
  return c;
}

}  // namespace

const char* to_string(OracleMode mode) {
  switch (mode) {
    case OracleMode::none: return "none";
    case OracleMode::lm_head: return "lm_head";
    case OracleMode::loss: return "loss";
  }
  return "?";
}

GradcheckConfig parse_gradcheck_config(const YAML::Node& tree, const std::string& source) {
  try {
    return parse(tree, source);
  } catch (const ConfigError& e) {
    if (!e.source().empty() || source.empty()) throw;
    throw ConfigError(e.field(), e.message(), source);
  }
}

GradcheckConfig load_gradcheck_config(const std::string& path) {
  return parse_gradcheck_config(load_yaml_file(path), path);
}

}  // namespace grpo::bench
