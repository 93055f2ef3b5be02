// The sequences of a call's N rows: the shape's B sequences of T rows, or S
// sequences packed back to back (BatchInputs::sequence_offsets, cu_seqlens).
// Every per-sequence rule of the loss reads them through this one view.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

namespace grpo::detail {

class Sequences {
 public:
  // offsets: validated ([S + 1], 0 first, strictly increasing, N last) or empty.
  Sequences(std::int64_t batch, std::int64_t seq_len, std::span<const std::int64_t> offsets)
      : batch_(batch), seq_len_(seq_len), offsets_(offsets) {}

  bool packed() const { return !offsets_.empty(); }
  std::int64_t count() const { return packed() ? static_cast<std::int64_t>(offsets_.size()) - 1 : batch_; }
  std::int64_t begin(std::int64_t seq) const { return packed() ? offsets_[seq] : seq * seq_len_; }
  std::int64_t end(std::int64_t seq) const { return begin(seq + 1); }
  std::int64_t of_row(std::int64_t row) const {
    if (!packed()) return row / seq_len_;
    return static_cast<std::int64_t>(std::upper_bound(offsets_.begin(), offsets_.end(), row) - offsets_.begin()) - 1;
  }

 private:
  std::int64_t batch_;
  std::int64_t seq_len_;
  std::span<const std::int64_t> offsets_;
};

}  // namespace grpo::detail
