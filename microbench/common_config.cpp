#include "common_config.hpp"

#include <cmath>
#include <utility>

namespace grpo::bench {
namespace {

void check_fraction(double v, const std::string& field) {
  if (!(v >= 0.0 && v <= 1.0)) throw ConfigError(field, "must be within [0, 1]");
}

void check_non_negative(double v, const std::string& field) {
  if (!(v >= 0.0) || !std::isfinite(v)) throw ConfigError(field, "must be a finite number >= 0");
}

// entropy_range: [min, max] (nats), entropy_mean, zipf_exponent,
// frequency_order_noise, tail_noise: read always, meaningful for trained_like.
void parse_trained_like(MapReader& r, InputSpec& in) {
  const bool trained = in.generator == InputGenerator::trained_like;
  for (const char* key : {"entropy_range", "entropy_mean", "zipf_exponent", "frequency_order_noise", "tail_noise"}) {
    if (r.has(key) && !trained) throw ConfigError(r.field(key), "needs generator: trained_like");
  }
  if (r.has("entropy_range")) {
    const YAML::Node range = r.raw("entropy_range");
    bool ok = range.IsSequence() && range.size() == 2;
    try {
      if (ok) {
        in.entropy_min = range[0].as<double>();
        in.entropy_max = range[1].as<double>();
      }
    } catch (const YAML::Exception&) {
      ok = false;
    }
    if (!ok) throw ConfigError(r.field("entropy_range"), "must be a list of two numbers [min, max] (nats)");
    if (!(in.entropy_min > 0.0 && in.entropy_min < in.entropy_max && in.entropy_max <= 8.0))
      throw ConfigError(r.field("entropy_range"), "must satisfy 0 < min < max <= 8 (nats)");
  }
  in.entropy_mean = r.get_double("entropy_mean").value_or(in.entropy_mean);
  if (in.entropy_mean != 0.0 && !(in.entropy_mean > in.entropy_min && in.entropy_mean < in.entropy_max))
    throw ConfigError(r.field("entropy_mean"), "must lie strictly inside entropy_range (or be 0: uniform targets)");
  in.zipf_exponent = r.get_double("zipf_exponent").value_or(in.zipf_exponent);
  if (!(in.zipf_exponent >= 0.5 && in.zipf_exponent <= 2.0))
    throw ConfigError(r.field("zipf_exponent"), "must be within [0.5, 2]");
  in.frequency_order_noise = r.get_double("frequency_order_noise").value_or(in.frequency_order_noise);
  check_non_negative(in.frequency_order_noise, r.field("frequency_order_noise"));
  in.tail_noise = r.get_double("tail_noise").value_or(in.tail_noise);
  if (!(in.tail_noise >= 0.0 && in.tail_noise <= 2.0))
    throw ConfigError(r.field("tail_noise"), "must be within [0, 2]");
}

}  // namespace

const char* to_string(Distribution d) {
  switch (d) {
    case Distribution::normal: return "normal";
    case Distribution::uniform: return "uniform";
    case Distribution::rademacher: return "rademacher";
    case Distribution::student_t: return "student_t";
  }
  return "?";
}

DType parse_dtype(MapReader& r, const std::string& key, DType fallback) {
  return r.get_enum<DType>(key, {{"f32", DType::f32}, {"bf16", DType::bf16}, {"f16", DType::f16}}).value_or(fallback);
}

WeightLayout parse_layout(MapReader& r, const std::string& key) {
  return r
      .get_enum<WeightLayout>(
          key, {{"vocab_major", WeightLayout::vocab_major}, {"hidden_major", WeightLayout::hidden_major}})
      .value_or(WeightLayout::vocab_major);
}

ShapeSpec parse_shape(MapReader& parent, bool needs_hidden, const std::string& impl_name) {
  if (!parent.has("shape")) throw ConfigError(parent.field("shape"), "is required (batch, seq_len, hidden, vocab)");
  MapReader r = parent.map("shape", false);
  ShapeSpec s;
  auto positive = [&](const std::string& key) {
    const std::int64_t v = r.require<std::int64_t>(key, &MapReader::get_int);
    if (v <= 0) throw ConfigError(r.field(key), "must be > 0");
    return v;
  };
  s.batch = positive("batch");
  s.seq_len = positive("seq_len");
  s.vocab = positive("vocab");
  if (needs_hidden) {
    s.hidden = positive("hidden");
  } else if (r.has("hidden")) {
    throw ConfigError(r.field("hidden"), "is not used by impl " + impl_name + " (it starts from logits)");
  }
  if (s.vocab > (std::int64_t{1} << 31) - 1) throw ConfigError(r.field("vocab"), "exceeds the int32 id range");
  r.finish();
  return s;
}

LossSpec parse_loss(MapReader& parent) {
  MapReader r = parent.map("loss");
  LossSpec spec;
  LossConfig& c = spec.config;
  c.loss_type = r.get_enum<LossType>("loss_type", {{"grpo", LossType::grpo},
                                                   {"bnpo", LossType::bnpo},
                                                   {"dr_grpo", LossType::dr_grpo},
                                                   {"dapo", LossType::dapo},
                                                   {"cispo", LossType::cispo},
                                                   {"sapo", LossType::sapo},
                                                   {"luspo", LossType::luspo},
                                                   {"vespo", LossType::vespo}})
                    .value_or(c.loss_type);
  c.importance_sampling_level =
      r.get_enum<IsLevel>("importance_sampling_level", {{"token", IsLevel::token}, {"sequence", IsLevel::sequence}})
          .value_or(c.importance_sampling_level);
  auto get_float = [&](const std::string& key, float fallback) {
    return static_cast<float>(r.get_double(key).value_or(fallback));
  };
  c.epsilon_low = get_float("epsilon_low", c.epsilon_low);
  c.epsilon_high = get_float("epsilon_high", c.epsilon_high);
  if (r.has("delta") && !r.raw("delta").IsNull()) c.delta = get_float("delta", 0.0F);
  r.raw("delta");  // absent or null: no two-sided clipping
  c.beta = get_float("beta", c.beta);
  c.kl_bias_correction = r.get_bool("kl_bias_correction").value_or(c.kl_bias_correction);
  c.temperature = get_float("temperature", c.temperature);
  c.temperature_on_logp = r.get_bool("temperature_on_logp").value_or(c.temperature_on_logp);
  // max_completion_length / num_items_in_batch take "auto": the run fills them
  // in (seq_len; the synthesized batch's valid-token count).
  if (r.has("max_completion_length") && r.raw("max_completion_length").IsScalar() &&
      r.raw("max_completion_length").Scalar() == "auto") {
    spec.autos.max_completion_length = true;
  } else {
    c.max_completion_length = r.get_int("max_completion_length").value_or(c.max_completion_length);
  }
  if (r.has("num_items_in_batch") && r.raw("num_items_in_batch").IsScalar() &&
      r.raw("num_items_in_batch").Scalar() == "auto") {
    spec.autos.num_items_in_batch = true;
  } else {
    c.num_items_in_batch = r.get_double("num_items_in_batch").value_or(c.num_items_in_batch);
  }
  c.sapo_tau_pos = get_float("sapo_tau_pos", c.sapo_tau_pos);
  c.sapo_tau_neg = get_float("sapo_tau_neg", c.sapo_tau_neg);
  c.kl_estimator = r.get_enum<KlEstimator>("kl_estimator", {{"k3", KlEstimator::k3},
                                                            {"k1", KlEstimator::k1},
                                                            {"abs", KlEstimator::abs},
                                                            {"k2", KlEstimator::k2},
                                                            {"k1+", KlEstimator::k1_plus},
                                                            {"abs+", KlEstimator::abs_plus},
                                                            {"k3+", KlEstimator::k3_plus}})
                       .value_or(c.kl_estimator);
  c.vespo_k_pos = get_float("vespo_k_pos", c.vespo_k_pos);
  c.vespo_lambda_pos = get_float("vespo_lambda_pos", c.vespo_lambda_pos);
  c.vespo_k_neg = get_float("vespo_k_neg", c.vespo_k_neg);
  c.vespo_lambda_neg = get_float("vespo_lambda_neg", c.vespo_lambda_neg);
  c.entropy_coef = get_float("entropy_coef", c.entropy_coef);
  c.top_entropy_quantile = get_float("top_entropy_quantile", c.top_entropy_quantile);
  c.logit_scale = get_float("logit_scale", c.logit_scale);
  // Absent or null: off.
  for (const auto& [key, field] : {std::pair{"off_policy_mask_threshold", &c.off_policy_mask_threshold},
                                   std::pair{"clip_ratio_c", &c.clip_ratio_c}, std::pair{"kl_clamp", &c.kl_clamp},
                                   std::pair{"logit_softcap", &c.logit_softcap}}) {
    if (r.has(key) && !r.raw(key).IsNull()) *field = get_float(key, 0.0F);
    r.raw(key);
  }
  r.finish();
  return spec;
}

InputSpec parse_inputs(MapReader& parent) {
  MapReader r = parent.map("inputs");
  InputSpec in;
  if (const auto seed = r.get_int("seed")) {
    if (*seed < 0) throw ConfigError(r.field("seed"), "must be >= 0");
    in.seed = static_cast<std::uint64_t>(*seed);
  }
  in.generator = r.get_enum<InputGenerator>("generator", {{"random", InputGenerator::random},
                                                          {"trained_like", InputGenerator::trained_like},
                                                          {"file", InputGenerator::file}})
                     .value_or(in.generator);
  parse_trained_like(r, in);
  in.path = r.get_string("path").value_or("");
  if (in.generator == InputGenerator::file && in.path.empty())
    throw ConfigError(r.field("path"), "is required with generator: file");
  if (in.generator != InputGenerator::file && !in.path.empty())
    throw ConfigError(r.field("path"), "needs generator: file");
  in.logit_std = r.get_double("logit_std").value_or(in.logit_std);
  check_non_negative(in.logit_std, r.field("logit_std"));
  in.hidden_distribution = r.get_enum<Distribution>("hidden_distribution", {{"normal", Distribution::normal},
                                                                            {"student_t", Distribution::student_t}})
                               .value_or(in.hidden_distribution);
  in.peaky_fraction = r.get_double("peaky_fraction").value_or(in.peaky_fraction);
  check_fraction(in.peaky_fraction, r.field("peaky_fraction"));
  in.peaky_margin = r.get_double("peaky_margin").value_or(in.peaky_margin);
  check_non_negative(in.peaky_margin, r.field("peaky_margin"));
  in.old_logp =
      r.get_enum<OldLogp>("old_logp", {{"none", OldLogp::none}, {"noisy", OldLogp::noisy}}).value_or(in.old_logp);
  in.old_logp_noise = r.get_double("old_logp_noise").value_or(in.old_logp_noise);
  check_non_negative(in.old_logp_noise, r.field("old_logp_noise"));
  in.ref_logp_noise = r.get_double("ref_logp_noise").value_or(in.ref_logp_noise);
  check_non_negative(in.ref_logp_noise, r.field("ref_logp_noise"));
  in.is_weight_noise = r.get_double("is_weight_noise").value_or(in.is_weight_noise);
  check_non_negative(in.is_weight_noise, r.field("is_weight_noise"));
  in.advantage = r.get_enum<Distribution>("advantage", {{"normal", Distribution::normal},
                                                        {"uniform", Distribution::uniform},
                                                        {"rademacher", Distribution::rademacher}})
                     .value_or(in.advantage);
  in.advantage_scale = r.get_double("advantage_scale").value_or(in.advantage_scale);
  check_non_negative(in.advantage_scale, r.field("advantage_scale"));
  in.advantage_per_token = r.get_bool("advantage_per_token").value_or(in.advantage_per_token);
  in.zero_advantage_fraction = r.get_double("zero_advantage_fraction").value_or(in.zero_advantage_fraction);
  check_fraction(in.zero_advantage_fraction, r.field("zero_advantage_fraction"));
  in.masked_fraction = r.get_double("masked_fraction").value_or(in.masked_fraction);
  if (!(in.masked_fraction >= 0.0 && in.masked_fraction < 1.0)) {
    throw ConfigError(r.field("masked_fraction"), "must be within [0, 1) (at least one valid token per sequence)");
  }
  in.kink_margin = r.get_double("kink_margin").value_or(in.kink_margin);
  check_non_negative(in.kink_margin, r.field("kink_margin"));
  r.finish();
  return in;
}

std::string file_stem(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::size_t dot = name.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
}

}  // namespace grpo::bench
