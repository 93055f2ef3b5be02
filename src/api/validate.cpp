#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "kernels/token_terms.hpp"

namespace grpo::detail {
namespace {

bool finite(float v) { return std::isfinite(v); }

void check_size(std::size_t got, std::int64_t want, const char* name) {
  if (static_cast<std::int64_t>(got) != want) {
    throw Error(name, "has " + std::to_string(got) + " elements, expected " + std::to_string(want));
  }
}

void check_finite(std::span<const float> values, const char* name) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!finite(values[i])) throw Error(name, "element " + std::to_string(i) + " is not finite");
  }
}

void check_matrix_common(const void* data, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         const char* name, std::int64_t want_rows, std::int64_t want_cols,
                         std::optional<DType> want_dtype) {
  if (data == nullptr) throw Error(name, "data is null");
  if (rows != want_rows || cols != want_cols) {
    throw Error(name, "is [" + std::to_string(rows) + ", " + std::to_string(cols) + "], expected [" +
                          std::to_string(want_rows) + ", " + std::to_string(want_cols) + "]");
  }
  if (ld < cols) throw Error(name, "ld " + std::to_string(ld) + " is smaller than cols " + std::to_string(cols));
  if (want_dtype && dtype != *want_dtype) {
    throw Error(name, std::string("has dtype ") + to_string(dtype) + ", expected " + to_string(*want_dtype));
  }
  if (!known_dtype(dtype)) throw Error(name, "has an unknown dtype");
  if (reinterpret_cast<std::uintptr_t>(data) % size_of(dtype) != 0) {
    throw Error(name, "data is not aligned to its element size");
  }
}

}  // namespace

void validate_positive(std::int64_t value, const char* name) {
  if (value <= 0) throw Error(name, "must be positive, got " + std::to_string(value));
}

void validate_logit_transform(std::optional<float> softcap, float scale) {
  if (softcap && !(*softcap > 0.0F && std::isfinite(*softcap))) {
    throw Error("config.logit_softcap", "must be finite and > 0, got " + std::to_string(*softcap));
  }
  if (!(scale > 0.0F) || !std::isfinite(scale)) {
    throw Error("config.logit_scale", "must be finite and > 0, got " + std::to_string(scale));
  }
}

void validate_config(const LossConfig& c) {
  if (!(c.temperature > 0.0F) || !std::isfinite(c.temperature)) {
    throw Error("config.temperature", "must be finite and > 0, got " + std::to_string(c.temperature));
  }
  validate_logit_transform(c.logit_softcap, c.logit_scale);
  if (!std::isfinite(c.entropy_coef)) {
    throw Error("config.entropy_coef", "must be finite, got " + std::to_string(c.entropy_coef));
  }
  if (!(c.top_entropy_quantile >= 0.0F && c.top_entropy_quantile <= 1.0F)) {
    throw Error("config.top_entropy_quantile",
                "must be in [0, 1] (1 keeps every token), got " + std::to_string(c.top_entropy_quantile));
  }
  if (!(c.epsilon_low >= 0.0F) || !std::isfinite(c.epsilon_low)) {
    throw Error("config.epsilon_low", "must be finite and >= 0, got " + std::to_string(c.epsilon_low));
  }
  if (!(c.epsilon_high >= 0.0F) || !std::isfinite(c.epsilon_high)) {
    throw Error("config.epsilon_high", "must be finite and >= 0, got " + std::to_string(c.epsilon_high));
  }
  if (c.delta && !(*c.delta > 1.0F + c.epsilon_high && std::isfinite(*c.delta))) {
    throw Error("config.delta", "must be finite and exceed 1 + epsilon_high, got " + std::to_string(*c.delta));
  }
  if (!std::isfinite(c.beta)) throw Error("config.beta", "must be finite");
  if (c.kl_clamp && !(*c.kl_clamp > 0.0F && std::isfinite(*c.kl_clamp))) {
    throw Error("config.kl_clamp", "must be finite and > 0, got " + std::to_string(*c.kl_clamp));
  }
  if (c.loss_type == LossType::dr_grpo && c.max_completion_length <= 0) {
    throw Error("config.max_completion_length", "must be > 0 for dr_grpo");
  }
  if ((c.loss_type == LossType::dapo || c.loss_type == LossType::cispo || c.loss_type == LossType::vespo) &&
      !(c.num_items_in_batch > 0.0 && std::isfinite(c.num_items_in_batch))) {
    throw Error("config.num_items_in_batch",
                "must be > 0 for dapo, cispo and vespo (the global valid-token count, passed by the caller)");
  }
  // Each temperature named on its own: the refusal says which one the caller got wrong.
  if (c.loss_type == LossType::sapo && !(c.sapo_tau_pos > 0.0F && std::isfinite(c.sapo_tau_pos))) {
    throw Error("config.sapo_tau_pos", "must be finite and > 0, got " + std::to_string(c.sapo_tau_pos));
  }
  if (c.loss_type == LossType::sapo && !(c.sapo_tau_neg > 0.0F && std::isfinite(c.sapo_tau_neg))) {
    throw Error("config.sapo_tau_neg", "must be finite and > 0, got " + std::to_string(c.sapo_tau_neg));
  }
  switch (c.loss_type) {
    case LossType::grpo:
    case LossType::bnpo:
    case LossType::dr_grpo:
    case LossType::dapo:
    case LossType::cispo:
    case LossType::sapo:
    case LossType::luspo:
    case LossType::vespo: break;
    default: throw Error("config.loss_type", "unknown loss type");
  }
  if (c.importance_sampling_level != IsLevel::token && c.importance_sampling_level != IsLevel::sequence) {
    throw Error("config.importance_sampling_level", "unknown level");
  }
  // TRL only warns for these two; a loss that silently is not the paper's is refused here.
  if (c.loss_type == LossType::luspo && c.importance_sampling_level != IsLevel::sequence) {
    throw Error("config.importance_sampling_level", "must be sequence for luspo (its ratio is s_i)");
  }
  if (c.loss_type == LossType::vespo && c.importance_sampling_level != IsLevel::token) {
    throw Error("config.importance_sampling_level",
                "must be token for vespo (it forms its own sequence weight from the token log ratios)");
  }
  if (c.loss_type == LossType::vespo) {
    const std::pair<float, const char*> ks[] = {{c.vespo_k_pos, "config.vespo_k_pos"},
                                                {c.vespo_k_neg, "config.vespo_k_neg"}};
    for (const auto& [k, name] : ks) {
      if (!std::isfinite(k)) throw Error(name, "must be finite");
    }
    const std::pair<float, const char*> lambdas[] = {{c.vespo_lambda_pos, "config.vespo_lambda_pos"},
                                                     {c.vespo_lambda_neg, "config.vespo_lambda_neg"}};
    for (const auto& [lam, name] : lambdas) {
      if (!(lam > 0.0F) || !std::isfinite(lam)) {
        throw Error(name, "must be finite and > 0, got " + std::to_string(lam));
      }
    }
  }
  switch (c.kl_estimator) {
    case KlEstimator::k3:
    case KlEstimator::k1:
    case KlEstimator::abs:
    case KlEstimator::k2:
    case KlEstimator::k1_plus:
    case KlEstimator::abs_plus:
    case KlEstimator::k3_plus: break;
    default: throw Error("config.kl_estimator", "unknown KL estimator");
  }
  if (c.off_policy_mask_threshold &&
      !(*c.off_policy_mask_threshold >= 0.0F && std::isfinite(*c.off_policy_mask_threshold))) {
    throw Error("config.off_policy_mask_threshold",
                "must be finite and >= 0, got " + std::to_string(*c.off_policy_mask_threshold));
  }
  if (c.clip_ratio_c) {
    if (!(*c.clip_ratio_c > 1.0F && std::isfinite(*c.clip_ratio_c))) {
      throw Error("config.clip_ratio_c", "must be finite and exceed 1, got " + std::to_string(*c.clip_ratio_c));
    }
    if (c.loss_type == LossType::cispo || c.loss_type == LossType::sapo || c.loss_type == LossType::vespo) {
      throw Error("config.clip_ratio_c",
                  std::string("applies to the PPO-clipped losses only, not ") + to_string(c.loss_type));
    }
  }
}

void refuse_baseline_features(const LossConfig& c) {
  const char* field = nullptr;
  if (c.entropy_coef != 0.0F) field = "config.entropy_coef";
  if (c.top_entropy_quantile != 1.0F) field = "config.top_entropy_quantile";
  if (c.logit_softcap) field = "config.logit_softcap";
  if (c.logit_scale != 1.0F) field = "config.logit_scale";
  if (field != nullptr) {
    throw Error(field, "is not implemented by the unfused baselines (the fused plans and the oracle have it)",
                ErrorKind::unsupported);
  }
}

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* name) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw Error(name, std::to_string(a) + " x " + std::to_string(b) + " overflows 64-bit sizes");
  }
  return out;
}

std::int64_t validate_sequence_offsets(std::span<const std::int64_t> offsets, std::int64_t batch, std::int64_t rows) {
  if (offsets.empty()) return batch;
  if (batch != 1) {
    throw Error(
        "sequence_offsets",
        "packed sequences take shape.batch = 1 (the N rows as one row of seq_len = N), got " + std::to_string(batch));
  }
  if (offsets.size() < 2) {
    throw Error("sequence_offsets", "has " + std::to_string(offsets.size()) +
                                        " element(s): S + 1 offsets of S >= 1 sequences, 0 first and N last");
  }
  if (offsets[0] != 0) throw Error("sequence_offsets", "starts at " + std::to_string(offsets[0]) + ", not at 0");
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    if (offsets[i] <= offsets[i - 1]) {
      throw Error("sequence_offsets", "element " + std::to_string(i) + " = " + std::to_string(offsets[i]) +
                                          " is not above element " + std::to_string(i - 1) + " = " +
                                          std::to_string(offsets[i - 1]) +
                                          ": offsets must increase (a sequence holds at least one row)");
    }
  }
  if (offsets.back() != rows) {
    throw Error("sequence_offsets",
                "ends at " + std::to_string(offsets.back()) + ", not at the " + std::to_string(rows) + " rows (N)");
  }
  return static_cast<std::int64_t>(offsets.size()) - 1;
}

BatchMagnitudes validate_batch(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, std::int64_t vocab,
                               const BatchInputs& in) {
  const std::int64_t rows = batch * seq_len;
  check_size(in.ids.size(), rows, "ids");
  check_size(in.mask.size(), rows, "mask");
  const std::int64_t sequences = validate_sequence_offsets(in.sequence_offsets, batch, rows);
  const char* const per = in.sequence_offsets.empty() ? " (per sequence) or " : " (per packed sequence) or ";
  if (static_cast<std::int64_t>(in.advantages.size()) != sequences &&
      static_cast<std::int64_t>(in.advantages.size()) != rows) {
    throw Error("advantages", "has " + std::to_string(in.advantages.size()) + " elements, expected " +
                                  std::to_string(sequences) + per + std::to_string(rows) + " (per token)");
  }
  if (!in.old_logp.empty()) check_size(in.old_logp.size(), rows, "old_logp");
  if (config.beta != 0.0F && in.ref_logp.empty()) throw Error("ref_logp", "is required when beta != 0");
  if (!in.ref_logp.empty()) check_size(in.ref_logp.size(), rows, "ref_logp");
  if (!in.is_weight.empty() && static_cast<std::int64_t>(in.is_weight.size()) != sequences &&
      static_cast<std::int64_t>(in.is_weight.size()) != rows) {
    throw Error("is_weight", "has " + std::to_string(in.is_weight.size()) + " elements, expected " +
                                 std::to_string(sequences) + per + std::to_string(rows) + " (per token)");
  }
  BatchMagnitudes mag;
  mag.sequences = sequences;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float m = in.mask[r];
    if (m != 0.0F && m != 1.0F) throw Error("mask", "element " + std::to_string(r) + " is not 0 or 1");
    if (m == 0.0F) continue;  // ids of masked rows are never read as indices
    ++mag.num_valid;
    const std::int32_t id = in.ids[r];
    if (id < 0 || id >= vocab) {
      throw Error("ids", "element " + std::to_string(r) + " = " + std::to_string(id) + " is outside [0, " +
                             std::to_string(vocab) + ")");
    }
  }
  check_finite(in.advantages, "advantages");
  check_finite(in.old_logp, "old_logp");
  check_finite(in.ref_logp, "ref_logp");
  check_finite(in.is_weight, "is_weight");
  if (config.loss_type == LossType::vespo && !in.is_weight.empty()) {
    // vespo sums log is_weight_t into its sequence weight: per token, and a
    // logarithm (TRL refuses sequence-level correction modes for vespo).
    if (static_cast<std::int64_t>(in.is_weight.size()) != rows) {
      throw Error("is_weight", "must be per token ([N] = " + std::to_string(rows) + ") for vespo");
    }
    for (std::size_t i = 0; i < in.is_weight.size(); ++i) {
      if (in.is_weight[i] < 0.0F) throw Error("is_weight", "element " + std::to_string(i) + " is negative (vespo)");
    }
  }
  for (const float a : in.advantages) mag.max_abs_advantage = std::max(mag.max_abs_advantage, std::fabs(double{a}));
  if (!in.is_weight.empty()) {
    mag.max_is_weight = 0.0;
    for (const float w : in.is_weight) mag.max_is_weight = std::max(mag.max_is_weight, std::fabs(double{w}));
  }
  return mag;
}

double check_coefficient_bound(const LossConfig& c, std::int64_t batch, const BatchMagnitudes& m, double fan_in,
                               double operand_max, double x_spread) {
  double w_max = 1.0;  // dLoss/dl_t: the aggregation's normalizer (per-sequence ones are <= 1)
  switch (c.loss_type) {
    case LossType::grpo:
    case LossType::sapo:
    case LossType::luspo: w_max = 1.0 / static_cast<double>(batch); break;
    case LossType::bnpo: w_max = 1.0; break;
    case LossType::dr_grpo:
      w_max = 1.0 / (static_cast<double>(batch) * static_cast<double>(c.max_completion_length));
      break;
    case LossType::dapo:
    case LossType::cispo:
    case LossType::vespo: w_max = 1.0 / c.num_items_in_batch; break;
  }
  double ratio = std::exp(kernels::kLogRatioClamp);
  if (c.delta) ratio = std::min(ratio, static_cast<double>(*c.delta));
  if (c.loss_type == LossType::cispo) ratio = std::min(ratio, static_cast<double>(c.epsilon_high));
  double is_weight_max = m.max_is_weight;
  if (c.loss_type == LossType::vespo) {
    // The gradient scale is phi (is_weight is inside it): its largest value
    // over log w in [log 1e-8, 20] is at the ends or at log w = log(k / lam).
    ratio = 0.0;
    for (const double adv : {1.0, -1.0}) {
      const double k = adv > 0 ? c.vespo_k_pos : c.vespo_k_neg;
      const double lam =
          std::max(static_cast<double>(adv > 0 ? c.vespo_lambda_pos : c.vespo_lambda_neg), kernels::kVespoMinLambda);
      const double stationary = k > 0.0 ? std::log(k / lam) : kernels::kVespoLogWeightMin;  // clamped by vespo_phi
      for (const double lw : {kernels::kVespoLogWeightMin, kernels::kLogRatioClamp, stationary}) {
        ratio = std::max(ratio, kernels::vespo_phi(c, lw, adv));
      }
    }
    is_weight_max = 1.0;
  }
  // The logit scale multiplies every dlogits entry (folded into 1/tau, or the softcap's chain factor <= s).
  const double inv_tau = static_cast<double>(c.logit_scale) / static_cast<double>(c.temperature);
  // A factor 4 of headroom for the f32 sums' rounding and the bf16 dlogits.
  const double raw_limit = static_cast<double>(std::numeric_limits<float>::max()) / 4.0 /
                           (inv_tau * std::max(1.0, fan_in) * std::max(1.0, operand_max));
  // The entropy bonus adds b p (x - E_p[x]) per entry, |b| <= |entropy_coef|, as a coefficient on
  // the same 1/tau scale (its own scale is 1 rather than 1/tau under temperature_on_logp).
  const double entropy_equiv = std::fabs(static_cast<double>(c.entropy_coef)) * x_spread *
                               (c.temperature_on_logp ? std::max(1.0, static_cast<double>(c.temperature)) : 1.0);
  const double limit = raw_limit - entropy_equiv;
  const double policy = w_max * m.max_abs_advantage * ratio * is_weight_max;
  if (policy < limit) return limit;
  const double bound = (policy + entropy_equiv) * inv_tau * std::max(1.0, fan_in) * std::max(1.0, operand_max);
  // Name the input that contributes most (on a log scale) to the overflow.
  const char* name = "advantages";
  double largest = m.max_abs_advantage;
  if (m.max_is_weight > largest) {
    name = "is_weight";
    largest = m.max_is_weight;
  }
  if (inv_tau > largest) name = "config.temperature";
  if (entropy_equiv > policy) name = "config.entropy_coef";
  std::ostringstream os;
  os << "max |advantage| " << m.max_abs_advantage << ", max is_weight " << m.max_is_weight
     << ", logit_scale / temperature " << inv_tau << ", up to " << ratio << " for the ratio and an entropy term of "
     << entropy_equiv << " make gradients that can overflow f32 (bound " << bound << ")";
  throw Error(name, os.str());
}

void check_output_vs_batch(const ByteRange& output, const char* output_name, const BatchInputs& in,
                           bool may_be_old_logp) {
  if (output.first == nullptr) return;
  const auto range = [](auto s) { return byte_range(s.data(), s.size_bytes()); };
  const bool exactly_old_logp = may_be_old_logp && !in.old_logp.empty() &&
                                output.first == reinterpret_cast<const std::byte*>(in.old_logp.data()) &&
                                output.last == range(in.old_logp).last;
  const std::pair<ByteRange, const char*> inputs[] = {{range(in.ids), "ids"},
                                                      {range(in.mask), "mask"},
                                                      {range(in.advantages), "advantages"},
                                                      {range(in.old_logp), "old_logp"},
                                                      {range(in.ref_logp), "ref_logp"},
                                                      {range(in.is_weight), "is_weight"},
                                                      {range(in.sequence_offsets), "sequence_offsets"}};
  for (const auto& [input, name] : inputs) {
    if (exactly_old_logp && input.first == output.first) continue;
    if (overlaps(output, input)) {
      const bool old = input.first == range(in.old_logp).first;
      throw Error(output_name, std::string("overlaps ") + name +
                                   (old ? " (only logp may be written over old_logp, as the very same array)" : ""));
    }
  }
}

void check_token_outputs_vs_batch(const TokenOutputs& out, const BatchInputs& in) {
  const auto range = [](std::span<float> s) { return byte_range(s.data(), s.size_bytes()); };
  check_output_vs_batch(range(out.logp), "logp", in, /*may_be_old_logp=*/true);
  check_output_vs_batch(range(out.entropy), "entropy", in, false);
  check_output_vs_batch(range(out.kl), "kl", in, false);
}

void validate_token_outputs(const TokenOutputs& out, std::int64_t rows) {
  if (out.logp.data() == nullptr) throw Error("logp", "is required");
  check_size(out.logp.size(), rows, "logp");
  if (!out.entropy.empty()) check_size(out.entropy.size(), rows, "entropy");
  if (!out.kl.empty()) check_size(out.kl.size(), rows, "kl");
  const auto range = [](std::span<float> s) { return byte_range(s.data(), s.size_bytes()); };
  check_no_overlap(range(out.entropy), "entropy", range(out.logp), "logp");
  check_no_overlap(range(out.kl), "kl", range(out.logp), "logp");
  check_no_overlap(range(out.kl), "kl", range(out.entropy), "entropy");
}

void validate_matrix(const MatrixView& v, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype) {
  check_matrix_common(v.data, v.dtype, v.rows, v.cols, v.ld, name, rows, cols, dtype);
}

void validate_matrix(const MutMatrixView& v, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype) {
  check_matrix_common(v.data, v.dtype, v.rows, v.cols, v.ld, name, rows, cols, dtype);
}

ByteRange byte_range(const MatrixView& v) {
  if (v.data == nullptr || v.rows == 0 || v.cols == 0) return {};
  const auto* first = static_cast<const std::byte*>(v.data);
  const auto elems = static_cast<std::size_t>((v.rows - 1) * v.ld + v.cols);
  return {first, first + elems * size_of(v.dtype)};
}

ByteRange byte_range(const void* data, std::size_t bytes) {
  if (data == nullptr || bytes == 0) return {};
  const auto* first = static_cast<const std::byte*>(data);
  return {first, first + bytes};
}

bool overlaps(const ByteRange& a, const ByteRange& b) {
  if (a.first == nullptr || b.first == nullptr) return false;
  return a.first < b.last && b.first < a.last;
}

void check_no_overlap(const ByteRange& output, const char* output_name, const ByteRange& other,
                      const char* other_name) {
  if (overlaps(output, other)) {
    throw Error(output_name, std::string("overlaps ") + other_name);
  }
}

}  // namespace grpo::detail
