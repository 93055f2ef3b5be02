// One gradcheck, as read from a YAML file under configs/gradcheck/: a shape,
// the loss options, how inputs are synthesized, which reference to use and
// the tolerance of every compared quantity.
#pragma once

#include <map>
#include <string>

#include "common_config.hpp"

namespace grpo::bench {

enum class OracleMode : std::uint8_t {
  none,     // fused vs unfused only
  lm_head,  // tests/oracle evaluate_lm_head: everything in (long) double, O(N*V*H) plain loops; small shapes
  loss,     // double GEMMs here + tests/oracle evaluate for the loss and dlogits; real vocabularies
};

const char* to_string(OracleMode mode);

// A quantity fails when max |a - b| > abs or max |a - b| / max |b| > rel.
struct Tolerance {
  double abs = 0.0;
  double rel = 0.0;
};

struct GradcheckConfig {
  std::string name;
  std::string description;
  std::string source;
  ShapeSpec shape;
  DType dtype = DType::f32;
  WeightLayout layout = WeightLayout::vocab_major;
  bool bias = false;
  DType baseline_logits_dtype = DType::f32;
  std::int64_t vocab_tile = 0;
  std::int64_t token_block = 0;
  std::uint64_t workspace_budget = LmHeadOptions{}.workspace_budget;  // the library's default
  int threads = 0;
  LossSpec loss;
  InputSpec inputs;
  OracleMode oracle = OracleMode::none;
  // Keys: loss, logp, entropy, dhidden, dweight (+ dbias with bias); all required.
  std::map<std::string, Tolerance> tolerance;
};

// The largest N*V*H that oracle: lm_head accepts (its loops take ~10 s there).
inline constexpr double kMaxLmHeadOracleWork = 5e8;

GradcheckConfig parse_gradcheck_config(const YAML::Node& tree, const std::string& source);
GradcheckConfig load_gradcheck_config(const std::string& path);

}  // namespace grpo::bench
