// Argument validation shared by every entry point. Each check throws
// grpo::Error naming the argument, and runs before any output is written.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo::detail {

// Byte range [first, last) a view touches.
struct ByteRange {
  const std::byte* first = nullptr;
  const std::byte* last = nullptr;
};

// logit_softcap (absent or finite > 0) and logit_scale (finite > 0), named as config fields.
void validate_logit_transform(std::optional<float> softcap, float scale);
void validate_config(const LossConfig& config);
// The unfused baselines compute the loss as it stood before the entropy bonus, the
// top-entropy mask and the logit transforms: refused there (ErrorKind::unsupported).
void refuse_baseline_features(const LossConfig& config);
void validate_positive(std::int64_t value, const char* name);

// A dtype of the enum (f32, bf16 or f16): what every dtype argument must be.
inline bool known_dtype(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }

// a * b for shape arithmetic, or Error(name, ...) when it overflows int64.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* name);

// Magnitudes of the per-token inputs that bound the gradient coefficients.
struct BatchMagnitudes {
  double max_abs_advantage = 0.0;
  double max_is_weight = 1.0;
  std::int64_t num_valid = 0;
  std::int64_t sequences = 0;  // B, or S packed (BatchInputs::sequence_offsets)
};

// Sizes, mask values, finiteness of the per-token tensors, ids in [0, vocab)
// on valid rows, and packed sequence offsets (with batch = 1 only).
BatchMagnitudes validate_batch(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, std::int64_t vocab,
                               const BatchInputs& inputs);

// Refuses inputs whose gradient chain could overflow f32 though every input is
// finite: |c_t| <= w_max * max|A| * R * max(is_weight) (R the largest ratio
// the loss lets through: e^20 after the log-ratio clamp, less with delta or
// cispo's cap), dlogits = c_t / tau * (onehot - p), and each gradient element
// sums at most `fan_in` such terms of magnitude `operand_max`. The KL part of
// c_t depends on the policy's own logp and is checked where logp is known.
// Returns the largest |c_t| whose gradients stay finite (for the KL check
// done where logp is known). x_spread bounds |x_v - E_p[x]| (twice the bound
// on |x|): the entropy bonus's term counts against the same limit.
double check_coefficient_bound(const LossConfig& config, std::int64_t batch, const BatchMagnitudes& m, double fan_in,
                               double operand_max, double x_spread = 0.0);

void validate_token_outputs(const TokenOutputs& outputs, std::int64_t rows);

// An output must not overlap any per-token input (ids, mask, advantages,
// old_logp, ref_logp, is_weight) -- except logp written over old_logp exactly
// (the same array: a trainer's "this epoch's logp is the next one's
// old_logp"), which every driver supports by reading a row's old_logp before
// it writes that row's logp. Error names both arguments.
void check_output_vs_batch(const ByteRange& output, const char* output_name, const BatchInputs& inputs,
                           bool may_be_old_logp);
void check_token_outputs_vs_batch(const TokenOutputs& outputs, const BatchInputs& inputs);

// Non-null data, exact rows/cols, ld >= cols, and (when given) the dtype.
void validate_matrix(const MatrixView& view, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype = std::nullopt);
void validate_matrix(const MutMatrixView& view, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype = std::nullopt);

ByteRange byte_range(const MatrixView& view);
ByteRange byte_range(const void* data, std::size_t bytes);
bool overlaps(const ByteRange& a, const ByteRange& b);

// An output must not overlap any input or another output (except documented in-place cases).
void check_no_overlap(const ByteRange& output, const char* output_name, const ByteRange& other, const char* other_name);

}  // namespace grpo::detail
