#include "api/validate.hpp"

#include <cmath>
#include <string>

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
  if (dtype != DType::f32 && dtype != DType::bf16) throw Error(name, "has an unknown dtype");
  if (reinterpret_cast<std::uintptr_t>(data) % size_of(dtype) != 0) {
    throw Error(name, "data is not aligned to its element size");
  }
}

}  // namespace

void validate_positive(std::int64_t value, const char* name) {
  if (value <= 0) throw Error(name, "must be positive, got " + std::to_string(value));
}

void validate_config(const LossConfig& c) {
  if (!(c.temperature > 0.0F) || !std::isfinite(c.temperature)) {
    throw Error("config.temperature", "must be finite and > 0, got " + std::to_string(c.temperature));
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
  if (c.loss_type == LossType::dr_grpo && c.max_completion_length <= 0) {
    throw Error("config.max_completion_length", "must be > 0 for dr_grpo");
  }
  if ((c.loss_type == LossType::dapo || c.loss_type == LossType::cispo) &&
      !(c.num_items_in_batch > 0.0 && std::isfinite(c.num_items_in_batch))) {
    throw Error("config.num_items_in_batch",
                "must be > 0 for dapo and cispo (the global valid-token count, passed by the caller)");
  }
  if (c.loss_type == LossType::sapo && !(c.sapo_tau_pos > 0.0F && c.sapo_tau_neg > 0.0F &&
                                         std::isfinite(c.sapo_tau_pos) && std::isfinite(c.sapo_tau_neg))) {
    throw Error("config.sapo_tau_pos", "sapo temperatures must be finite and > 0");
  }
  switch (c.loss_type) {
    case LossType::grpo:
    case LossType::bnpo:
    case LossType::dr_grpo:
    case LossType::dapo:
    case LossType::cispo:
    case LossType::sapo: break;
    default: throw Error("config.loss_type", "unknown loss type");
  }
  if (c.importance_sampling_level != IsLevel::token && c.importance_sampling_level != IsLevel::sequence) {
    throw Error("config.importance_sampling_level", "unknown level");
  }
}

void validate_batch(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, std::int64_t vocab,
                    const BatchInputs& in) {
  const std::int64_t rows = batch * seq_len;
  check_size(in.ids.size(), rows, "ids");
  check_size(in.mask.size(), rows, "mask");
  if (static_cast<std::int64_t>(in.advantages.size()) != batch &&
      static_cast<std::int64_t>(in.advantages.size()) != rows) {
    throw Error("advantages", "has " + std::to_string(in.advantages.size()) + " elements, expected " +
                                  std::to_string(batch) + " (per sequence) or " + std::to_string(rows) +
                                  " (per token)");
  }
  if (!in.old_logp.empty()) check_size(in.old_logp.size(), rows, "old_logp");
  if (config.beta != 0.0F && in.ref_logp.empty()) throw Error("ref_logp", "is required when beta != 0");
  if (!in.ref_logp.empty()) check_size(in.ref_logp.size(), rows, "ref_logp");
  if (!in.is_weight.empty() && static_cast<std::int64_t>(in.is_weight.size()) != batch &&
      static_cast<std::int64_t>(in.is_weight.size()) != rows) {
    throw Error("is_weight", "has " + std::to_string(in.is_weight.size()) + " elements, expected " +
                                 std::to_string(batch) + " or " + std::to_string(rows));
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const float m = in.mask[r];
    if (m != 0.0F && m != 1.0F) throw Error("mask", "element " + std::to_string(r) + " is not 0 or 1");
    if (m == 0.0F) continue;  // ids of masked rows are never read as indices
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
  const std::size_t elems = static_cast<std::size_t>((v.rows - 1) * v.ld + v.cols);
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
