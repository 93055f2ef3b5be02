// What an LM-head problem's logits look like, measured on sampled rows with a
// plain reference (the full [N, V] logits are never built): per-token entropy
// quantiles and the fraction of softmax entries |p_v - onehot_v| at or above
// a threshold (2^-12 = eps(bf16) / 32, the filtered backward's `auto`).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "synth.hpp"

namespace grpo::bench {

inline constexpr double kFilterEpsBf16 = 0x1p-12;  // eps(bf16) / 32 = 2^-8 / 32 (SPEC "Filtered backward")

// Logits of the given rows, [rows.size(), V] row-major float, from the
// problem's stored hidden and weight (float accumulation, 16 lanes). Plain
// code, not the library: the truth the statistics are read off.
std::vector<float> reference_logits(const Problem& p, std::span<const std::int64_t> rows, int threads);

// Per-row softmax facts of one logits row with chosen id `id`.
struct RowFacts {
  double entropy = 0.0;                   // nats
  double logp = 0.0;                      // log p[id]
  std::vector<std::int32_t> significant;  // ids v with |p_v - onehot_v| >= eps, ascending
};
RowFacts row_facts(std::span<const float> logits, std::int32_t id, double eps);

struct InputStats {
  std::int64_t rows = 0;  // valid rows sampled
  double eps = kFilterEpsBf16;
  double entropy_mean = 0.0, entropy_p10 = 0.0, entropy_p50 = 0.0, entropy_p90 = 0.0;
  double entropy_min = 0.0, entropy_max = 0.0;
  std::vector<double> entropy;  // per sampled valid row
  double logp_mean = 0.0;       // of the chosen ids
  double frac_above = 0.0;      // entries with |p - onehot| >= eps, over rows x V
  double significant_per_row = 0.0;

  std::string summary() const;  // one line
};

// Samples up to `sample_rows` valid rows spread over the batch (a seeded
// choice: the same rows for the same problem).
std::vector<std::int64_t> sample_rows(const Problem& p, int sample_rows);
InputStats measure_inputs(const Problem& p, int sample_rows, int threads, double eps = kFilterEpsBf16);

}  // namespace grpo::bench
