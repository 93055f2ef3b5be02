// Argument validation shared by every entry point. Each check throws
// grpo::Error naming the argument, and runs before any output is written.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo::detail {

void validate_config(const LossConfig& config);
void validate_positive(std::int64_t value, const char* name);

// Sizes, mask values, finiteness of the per-token tensors, and ids in [0, vocab)
// on valid rows.
void validate_batch(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, std::int64_t vocab,
                    const BatchInputs& inputs);

void validate_token_outputs(const TokenOutputs& outputs, std::int64_t rows);

// Non-null data, exact rows/cols, ld >= cols, and (when given) the dtype.
void validate_matrix(const MatrixView& view, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype = std::nullopt);
void validate_matrix(const MutMatrixView& view, const char* name, std::int64_t rows, std::int64_t cols,
                     std::optional<DType> dtype = std::nullopt);

// Byte range [first, last) a matrix view touches.
struct ByteRange {
  const std::byte* first = nullptr;
  const std::byte* last = nullptr;
};
ByteRange byte_range(const MatrixView& view);
ByteRange byte_range(const void* data, std::size_t bytes);
bool overlaps(const ByteRange& a, const ByteRange& b);

// An output must not overlap any input or another output (except documented in-place cases).
void check_no_overlap(const ByteRange& output, const char* output_name, const ByteRange& other, const char* other_name);

}  // namespace grpo::detail
