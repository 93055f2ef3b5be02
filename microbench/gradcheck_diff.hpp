// Differences between two results of one quantity, and the verdict table
// grpo-gradcheck prints.
#pragma once

#include <cmath>
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
  double sum_sq_diff = 0.0;    // sum (a - b)^2 and sum b^2 over the finite pairs
  double sum_sq_ref = 0.0;

  void add(double a, double b, std::int64_t index);
  void merge(const DiffStats& other);
  double rel() const { return max_ref > 0.0 ? max_abs / max_ref : max_abs; }
  // ||a - b||_2 / ||b||_2: the error of the whole quantity (printed, not checked).
  double rel_l2() const { return sum_sq_ref > 0.0 ? std::sqrt(sum_sq_diff / sum_sq_ref) : std::sqrt(sum_sq_diff); }
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
