// Differences between two results of one quantity, and the verdict table
// grpo-gradcheck prints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradcheck_config.hpp"

namespace grpo::bench {

// max |a - b| and max |b| over the compared elements, plus non-finite counts.
// rel() = max |a - b| / max |b|: relative to the quantity's own scale, so
// elements near zero (most of dweight) do not blow it up.
struct DiffStats {
  double max_abs = 0.0;
  double max_ref = 0.0;
  std::int64_t worst = -1;
  std::int64_t count = 0;
  std::int64_t nonfinite = 0;  // non-finite values in a or b

  void add(double a, double b, std::int64_t index);
  void merge(const DiffStats& other);
  double rel() const { return max_ref > 0.0 ? max_abs / max_ref : max_abs; }
};

struct CheckRow {
  std::string quantity;  // loss, logp, ...
  std::string pair;      // "fused vs oracle", ...
  DiffStats diff;
  Tolerance tolerance;
  bool passed() const;
};

// Prints the table to stdout; returns true when every row passed.
bool print_verdict(const std::string& title, const std::vector<CheckRow>& rows);

}  // namespace grpo::bench
