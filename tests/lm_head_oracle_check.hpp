// The LM-head outputs against the double oracle, with error bounds derived
// from the oracle's own quantities: shared by test_lm_head.cpp (dense views)
// and test_contract.cpp (padded row strides).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>

#include "lm_head_support.hpp"

namespace grpo::test {

// Error bounds derived from the oracle's own quantities (see the comments).
struct HeadOracleBounds {
  std::vector<double> tol_logp;  // per row
  std::vector<double> dz_err;    // per row: bound on |dlogits error| per entry, systematic part
};

// Every output of `got` (a run of c on p) against the double oracle within
// those bounds; `want` is oracle::evaluate_lm_head(p.oracle), for a caller
// that has it already.
inline void expect_head_matches_oracle(const HeadCase& c, const HeadProblem& p, const HeadOutputs& got,
                                       const oracle::LmHeadResult& want) {
  const BatchSpec& s = c.spec;
  SCOPED_TRACE(case_name(c));
  SCOPED_TRACE(got.schedule);
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.hidden;
  const double tau = s.config.temperature;
  const double scale = s.config.temperature_on_logp ? 1.0 : 1.0 / tau;
  const bool bf16 = c.dtype == DType::bf16;

  // Logits come from an f32-accumulated GEMM on exact inputs: |z error| <=
  // eps sqrt(H) sum_k |h_k w_k| (random-walk accumulation, 2x margin). Then the
  // logits-level bound applies on top: 8 eps (max|x| + sqrt(V)) + 2 scale |z error|
  // (x_y and the LSE each move by at most scale |z error|).
  HeadOracleBounds b;
  b.tol_logp.resize(n);
  b.dz_err.resize(n);
  double sum_abs_c = 0.0, phi_loss_tol = 0.0, entropy_loss_tol = 0.0;
  // vespo: phi_i carries the logp errors of the whole sequence (see
  // coefficient_amplification); 1 for every other loss.
  const std::vector<double> amp = coefficient_amplification(p.oracle.head, want.head.logp);
  std::vector<double> abs_a_row(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    double zmag = 0.0, xmax = 1.0;
    for (std::int64_t a = 0; a < v; ++a) {
      double m = 0.0;
      for (std::int64_t k = 0; k < h; ++k) m += std::abs(p.oracle.hidden[t * h + k] * p.oracle.weight[a * h + k]);
      zmag = std::max(zmag, m);
      const double z = p.batch.problem.logits[t * v + a];
      if (std::isfinite(z)) xmax = std::max(xmax, softmax_input(s.config, z));
    }
    const double tol_z = 2.0 * kEpsF32 * std::sqrt(static_cast<double>(h)) * zmag;
    // x = z' scale moves by at most s scale |z error| (dz'/dz <= s).
    b.tol_logp[t] = 8.0 * kEpsF32 * (xmax + std::sqrt(static_cast<double>(v))) +
                    2.0 * scale * static_cast<double>(s.config.logit_scale) * tol_z;
    // The oracle's coefficients: a = |dLoss/dlogp| / tau (its parts summed
    // without cancellation, dloss_dlogp_scale), b = |dLoss/dEnt| dx/dz'.
    const double abs_a = want.head.dloss_dlogp_scale[t] / tau;
    const double abs_b = std::abs(want.head.dloss_dentropy[t]) * scale;
    sum_abs_c += abs_a * tau;
    entropy_loss_tol +=
        std::abs(want.head.dloss_dentropy[t]) * b.tol_logp[t] * (2.0 + std::log(static_cast<double>(v)));
    // dz = chain (a (onehot - p) - b p (x - mean)) (dz_error_bound); in the bf16
    // path the block keeps x - max in f16: |dp| <= p |u| 2^-11 <= 2^-11 / e < 2^-11.
    b.dz_err[t] = dz_error_bound(s.config, abs_a, abs_b, b.tol_logp[t], 2.0 * xmax, static_cast<double>(v), bf16);
    abs_a_row[t] = abs_a;
  }
  // phi's relative error (vespo): amp times the largest tol_logp (any row of its sequence).
  const double tol_max = *std::max_element(b.tol_logp.begin(), b.tol_logp.end());
  for (std::int64_t t = 0; t < n; ++t) {
    if (amp[t] <= 1.0) continue;
    b.dz_err[t] += abs_a_row[t] * amp[t] * tol_max;
    phi_loss_tol += abs_a_row[t] * tau * std::abs(want.head.logp[t]) * amp[t] * tol_max;
  }

  for (std::int64_t t = 0; t < n; ++t) {
    SCOPED_TRACE("row " + std::to_string(t));
    EXPECT_NEAR(got.logp[t], want.head.logp[t], b.tol_logp[t] * (s.config.temperature_on_logp ? 1.0 / tau : 1.0));
    EXPECT_NEAR(got.entropy[t], want.head.entropy[t], b.tol_logp[t] * (2.0 + std::log(static_cast<double>(v))));
    EXPECT_NEAR(got.kl[t], want.head.kl[t], 2.0 * b.tol_logp[t] + 4.0 * kEpsF32);
  }
  EXPECT_DOUBLE_EQ(got.metrics.clip_ratio_region, want.head.clip_ratio_region);
  EXPECT_NEAR(got.metrics.loss, want.head.loss,
              2.0 * sum_abs_c * *std::max_element(b.tol_logp.begin(), b.tol_logp.end()) + phi_loss_tol +
                  entropy_loss_tol + 16.0 * kEpsF32 * std::abs(want.head.loss) + 1e-12);

  // Gradient GEMMs: a sum of products whose dz factor has the systematic bound
  // dz_err (added worst-case: sum |other factor|), the bf16 rounding of dz in the
  // bf16 path (independent per entry, |e| <= 2^-9 |dz|: 4 sigma of a random walk
  // of uniform errors, sigma <= 2^-9 / sqrt(3) per term), and f32 accumulation
  // (eps sqrt(depth) sum |terms|, 2x margin). A bf16 output adds 2^-8 relative.
  const double dz_round = bf16 ? 4.0 / 512.0 / std::sqrt(3.0) : 0.0;
  std::vector<double> row_weight(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < n; ++t) {
    row_weight[t] = std::abs(want.head.dloss_dlogp[t]) / tau + std::abs(want.head.dloss_dentropy[t]) * scale;
  }
  const FilterSlack filter(c, want.head.dlogits, row_weight, b.dz_err);
  // dhidden[t, k] = sum_v dz[t, v] W[v, k]
  const std::vector<float> dh = to_float(got.dhidden.data(), c.dhidden_dtype, static_cast<std::size_t>(n * h));
  const double dh_out = c.dhidden_dtype == DType::bf16  ? 1.0 / 256.0
                        : c.dhidden_dtype == DType::f16 ? 1.0 / 1024.0
                                                        : 0.0;
  // An f16 output's rounding near 0 is absolute: half its subnormal step, 2^-25 (2x margin).
  const double dh_abs = c.dhidden_dtype == DType::f16 ? std::ldexp(1.0, -24) : 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t k = 0; k < h; ++k) {
      double sys = 0.0, sq = 0.0, abs_sum = 0.0;
      for (std::int64_t a = 0; a < v; ++a) {
        const double w = p.oracle.weight[a * h + k];
        const double term = want.head.dlogits[t * v + a] * w;
        sys += b.dz_err[t] * std::abs(w) + filter.term(t, a, w);
        sq += term * term;
        abs_sum += std::abs(term);
      }
      const double want_dh = want.dhidden[t * h + k];
      const double tol = sys + dz_round * std::sqrt(sq) + 2.0 * kEpsF32 * std::sqrt(static_cast<double>(v)) * abs_sum +
                         dh_out * std::abs(want_dh) + dh_abs + 1e-30;
      ASSERT_NEAR(dh[t * h + k], want_dh, tol) << "dhidden[" << t << ", " << k << "]";
    }
  }
  // dweight[v, k] = init + sum_t dz[t, v] hidden[t, k]
  const std::vector<double> dw = got.dweight_vocab_major(c);
  const double dw_out = c.dweight_dtype == DType::bf16 ? 1.0 / 256.0 : 0.0;
  // An f16 dW is rounded once per token block that adds into it (the GEMM's
  // f16 C): each rounding moves it by at most 2^-11 of the partial sum, itself
  // at most |init| + sum |terms|, or by 2^-25 near 0.
  const bool dw_f16 = c.dweight_dtype == DType::f16;
  const double dw_roundings = !dw_f16 ? 0.0
                              : c.token_block > 0
                                  ? std::ceil(static_cast<double>(n) / static_cast<double>(c.token_block))
                                  : static_cast<double>(n);
  for (std::int64_t a = 0; a < v; ++a) {
    for (std::int64_t k = 0; k < h; ++k) {
      double sys = 0.0, sq = 0.0, abs_sum = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        const double x = p.oracle.hidden[t * h + k];
        const double term = want.head.dlogits[t * v + a] * x;
        sys += b.dz_err[t] * std::abs(x) + filter.term(t, a, x);
        sq += term * term;
        abs_sum += std::abs(term);
      }
      const double init = c.accumulate ? p.dweight_init[a * h + k] : 0.0;
      const double want_dw = init + want.dweight[a * h + k];
      const double tol = sys + dz_round * std::sqrt(sq) + 2.0 * kEpsF32 * std::sqrt(static_cast<double>(n)) * abs_sum +
                         2.0 * kEpsF32 * std::abs(init) + dw_out * std::abs(want_dw) +
                         dw_roundings * (std::ldexp(abs_sum + std::abs(init), -11) + std::ldexp(1.0, -25)) + 1e-30;
      ASSERT_NEAR(dw[a * h + k], want_dw, tol) << "dweight[" << a << ", " << k << "]";
    }
  }
  if (c.bias) {
    for (std::int64_t a = 0; a < v; ++a) {
      double sys = 0.0, abs_sum = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        sys += b.dz_err[t];
        abs_sum += std::abs(want.head.dlogits[t * v + a]);
      }
      const double init = c.accumulate ? p.dbias_init[a] : 0.0;
      // The baseline sums the stored (bf16 in the bf16 path) dlogits.
      const double round = c.baseline && bf16 ? 1.0 / 256.0 * abs_sum : 0.0;
      ASSERT_NEAR(
          got.dbias[a], init + want.dbias[a],
          sys + round + 2.0 * kEpsF32 * static_cast<double>(n) * abs_sum + 2.0 * kEpsF32 * std::abs(init) + 1e-30)
          << "dbias[" << a << "]";
    }
  }
}

inline void expect_head_matches_oracle(const HeadCase& c, const HeadProblem& p, const HeadOutputs& got) {
  expect_head_matches_oracle(c, p, got, oracle::evaluate_lm_head(p.oracle));
}

}  // namespace grpo::test
