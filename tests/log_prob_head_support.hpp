// The generic log-prob head (LmHeadLogProbPlan) against the double oracle:
// problem building (hidden, weight, bias, ids, mask from the LM-head fixtures;
// upstream gradients with exact zeros), a runner, and the comparison with
// error bounds derived as in lm_head_oracle_check.hpp plus the entropy term.
// Shared by test_log_prob_head.cpp and slow_log_prob_head.cpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "lm_head_support.hpp"

namespace grpo::test {

struct LogProbCase {
  HeadCase head;                 // shape, dtype, layout, bias, block / tile, gradient dtypes, accumulate;
                                 // spec.config: temperature, temperature_on_logp; spec.seed
  bool mask = true;              // pass the mask (else every row valid)
  bool entropy_upstream = true;  // pass dL/dEnt (else empty)
  double zero_fraction = 0.3;    // rows whose upstream gradients are both exactly 0
};

inline std::string case_name(const LogProbCase& c) {
  return case_name(c.head) + (c.mask ? " mask" : " no-mask") + (c.entropy_upstream ? " dEnt" : " no-dEnt") +
         " zero=" + std::to_string(c.zero_fraction);
}

inline void PrintTo(const LogProbCase& c, std::ostream* os) { *os << case_name(c); }

struct LogProbHostProblem {
  HeadProblem head;  // hidden, weight, bias (library and oracle copies), ids, mask
  std::vector<float> dlogp, dentropy;
  oracle::LogProbProblem oracle;
};

inline LogProbHostProblem make_log_prob_problem(const LogProbCase& c, bool with_oracle = true) {
  LogProbHostProblem p;
  p.head = make_head_problem(c.head, with_oracle);
  const std::int64_t n = c.head.spec.batch * c.head.spec.seq_len;
  std::mt19937 rng(c.head.spec.seed + 7919U);
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  p.dlogp.resize(n);
  if (c.entropy_upstream) p.dentropy.resize(n);
  for (std::int64_t t = 0; t < n; ++t) {
    const double u = coin(rng);
    const bool zero = u < c.zero_fraction;
    p.dlogp[t] = zero ? 0.0F : unit(rng);
    if (c.entropy_upstream) p.dentropy[t] = zero ? 0.0F : unit(rng);
    // Some rows with only one of the two upstream gradients.
    if (!zero && c.entropy_upstream && u > 0.85) p.dlogp[t] = 0.0F;
    if (!zero && c.entropy_upstream && u < c.zero_fraction + 0.1 && u >= c.zero_fraction) p.dentropy[t] = 0.0F;
  }
  if (!c.mask) p.head.batch.mask.clear();
  p.oracle.lm = p.head.oracle;
  p.oracle.lm.head.config = c.head.spec.config;
  p.oracle.lm.head.ids = p.head.batch.ids;
  p.oracle.lm.head.mask.assign(p.head.batch.mask.begin(), p.head.batch.mask.end());
  p.oracle.dlogp.assign(p.dlogp.begin(), p.dlogp.end());
  p.oracle.dentropy.assign(p.dentropy.begin(), p.dentropy.end());
  return p;
}

struct LogProbRun {
  std::vector<float> logp, entropy;
  std::vector<std::byte> dhidden, dweight;
  std::vector<float> dbias;
  LmHeadStepStats forward_stats, backward_stats;
  std::string schedule;
  LmHeadSchedule plan_schedule;
};

inline LmHeadShape log_prob_shape(const LogProbCase& c) {
  const BatchSpec& s = c.head.spec;
  LmHeadShape shape;
  shape.batch = s.batch;
  shape.seq_len = s.seq_len;
  shape.hidden = c.head.hidden;
  shape.vocab = s.vocab;
  shape.dtype = c.head.dtype;
  shape.layout = c.head.layout;
  shape.has_bias = c.head.bias;
  return shape;
}

inline LmHeadOptions log_prob_options(const LogProbCase& c, int max_threads = 0) {
  LmHeadOptions opt;
  opt.token_block = c.head.token_block;
  opt.vocab_tile = c.head.vocab_tile;
  opt.dweight_dtype = c.head.dweight_dtype;
  opt.dhidden_dtype = c.head.dhidden_dtype;
  opt.accumulate_weight_grads = c.head.accumulate;
  opt.frozen_weight = c.head.frozen;
  opt.grad_filter = c.head.grad_filter;
  opt.max_threads = max_threads;
  return opt;
}

inline LogProbInputs log_prob_inputs(const LogProbCase& c, const LogProbHostProblem& p) {
  const BatchSpec& s = c.head.spec;
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.head.hidden;
  const bool vm = c.head.layout == WeightLayout::vocab_major;
  return {{p.head.hidden.data(), c.head.dtype, n, h, h},
          {p.head.weight.data(), c.head.dtype, vm ? v : h, vm ? h : v, vm ? h : v},
          c.head.bias ? VectorView{p.head.bias.data(), DType::f32, v} : VectorView{},
          p.head.batch.ids,
          p.head.batch.mask};
}

inline LogProbRun run_log_prob(const LogProbCase& c, const LogProbHostProblem& p, int max_threads = 0) {
  const BatchSpec& s = c.head.spec;
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.head.hidden;
  const bool vm = c.head.layout == WeightLayout::vocab_major;
  LogProbRun o;
  o.logp.assign(n, -1.0F);
  o.entropy.assign(n, -1.0F);
  o.dhidden.assign(static_cast<std::size_t>(n * h) * size_of(c.head.dhidden_dtype), std::byte{0x3f});
  if (c.head.accumulate) {
    std::vector<double> init(p.head.dweight_init.size());
    for (std::int64_t a = 0; a < v; ++a) {
      for (std::int64_t k = 0; k < h; ++k) init[vm ? a * h + k : k * v + a] = p.head.dweight_init[a * h + k];
    }
    store(init, c.head.dweight_dtype, o.dweight);
    if (c.head.bias) o.dbias.assign(p.head.dbias_init.begin(), p.head.dbias_init.end());
  } else {
    o.dweight.assign(static_cast<std::size_t>(v * h) * size_of(c.head.dweight_dtype), std::byte{0x3f});
    o.dbias.assign(c.head.bias ? v : 0, 7.0F);
  }
  const LmHeadLogProbPlan plan(
      log_prob_shape(c),
      {s.config.temperature, s.config.temperature_on_logp, s.config.logit_softcap, s.config.logit_scale},
      log_prob_options(c, max_threads));
  o.schedule = plan.describe();
  o.plan_schedule = plan.schedule();
  const LogProbInputs in = log_prob_inputs(c, p);
  plan.forward(in, {o.logp, o.entropy, &o.forward_stats});
  LogProbGradients grads{{o.dhidden.data(), c.head.dhidden_dtype, n, h, h},
                         {o.dweight.data(), c.head.dweight_dtype, vm ? v : h, vm ? h : v, vm ? h : v},
                         o.dbias,
                         &o.backward_stats};
  if (c.head.frozen) {
    grads.dweight = {};
    grads.dbias = {};
  }
  plan.backward(in, {p.dlogp, p.dentropy}, grads);
  return o;
}

// Every output against the oracle. Bounds (cf. lm_head_oracle_check.hpp,
// whose logits, logp, entropy and GEMM bounds are repeated here):
// - logits from an f32-accumulated GEMM: |z error| <= 2 eps sqrt(H) sum_k |h_k w_k|;
//   logp within 8 eps (max|x| + sqrt(V)) + 2 scale |z error| (tol_logp), times
//   post; entropy within tol_logp (2 + log V).
// - dz = a (onehot - p) - b p (x - E_p[x]), a = dlogp / tau, b = dentropy dx/dz:
//   |dp| <= dp_abs = 3 tol_logp + 4 eps (+ 2^-11 in the bf16 path, the f16
//   storage of x - max: p |u| 2^-11 <= 2^-11 / e), so the first term is off by
//   |a| dp_abs; the second by |b| (dp_abs max_v |x_v - E[x]| + max_v p_v
//   (scale |z error| + |E[x] error|) (+ 2^-11 in bf16, the same f16 bound on
//   p |u|)), E[x] = LSE - entropy off by tol_logp (3 + log V); plus the
//   kernel's own roundings (4 eps relative, inside dp_abs's 4 eps).
// - dhidden / dweight / dbias: as the fused check (systematic dz bound times
//   sum |other factor|, bf16 rounding of dz as a random walk, f32
//   accumulation eps sqrt(depth) sum |terms|, output rounding).
inline void expect_log_prob_matches_oracle(const LogProbCase& c, const LogProbHostProblem& p, const LogProbRun& got) {
  const BatchSpec& s = c.head.spec;
  SCOPED_TRACE(case_name(c));
  SCOPED_TRACE(got.schedule);
  const oracle::LogProbResult want = oracle::evaluate_log_prob_head(p.oracle);
  const std::int64_t n = s.batch * s.seq_len, v = s.vocab, h = c.head.hidden;
  const double tau = s.config.temperature;
  const double scale = s.config.temperature_on_logp ? 1.0 : 1.0 / tau;
  const bool bf16 = c.head.dtype == DType::bf16;
  const double f16 = bf16 ? 1.0 / 2048.0 : 0.0;
  const std::vector<double> logits = oracle::lm_head_logits(p.oracle.lm);

  std::vector<double> tol_logp(n), dz_err(n), row_weight(n);
  for (std::int64_t t = 0; t < n; ++t) {
    double zmag = 0.0, xmax = 1.0;
    for (std::int64_t a = 0; a < v; ++a) {
      double m = 0.0;
      for (std::int64_t k = 0; k < h; ++k) {
        m += std::abs(p.oracle.lm.hidden[t * h + k] * p.oracle.lm.weight[a * h + k]);
      }
      zmag = std::max(zmag, m);
      const double z = logits[t * v + a];
      if (std::isfinite(z)) xmax = std::max(xmax, softmax_input(s.config, z));
    }
    const double tol_z = 2.0 * kEpsF32 * std::sqrt(static_cast<double>(h)) * zmag;
    tol_logp[t] = 8.0 * kEpsF32 * (xmax + std::sqrt(static_cast<double>(v))) +
                  2.0 * scale * static_cast<double>(s.config.logit_scale) * tol_z;
    const bool valid = p.head.batch.mask.empty() || p.head.batch.mask[t] != 0.0F;
    const double a = valid ? std::abs(p.dlogp[t]) / tau : 0.0;
    const double b = valid && !p.dentropy.empty() ? std::abs(p.dentropy[t]) * scale : 0.0;
    // Softmax of the row (for max p and max |x - E[x]|).
    double zmax = -std::numeric_limits<double>::infinity();
    for (std::int64_t u = 0; u < v; ++u) zmax = std::max(zmax, logits[t * v + u] * scale);
    double sum = 0.0, sum_x = 0.0;
    for (std::int64_t u = 0; u < v; ++u) {
      const double e = std::exp(logits[t * v + u] * scale - zmax);
      sum += e;
      if (e > 0.0) sum_x += e * (logits[t * v + u] * scale - zmax);
    }
    const double mean = sum_x / sum;
    double max_p = 0.0, max_centered = 0.0;
    for (std::int64_t u = 0; u < v; ++u) {
      const double x = logits[t * v + u] * scale - zmax;
      if (!std::isfinite(x)) continue;
      max_p = std::max(max_p, std::exp(x) / sum);
      max_centered = std::max(max_centered, std::abs(x - mean));
    }
    const double dp_abs = 3.0 * tol_logp[t] + 4.0 * kEpsF32 + f16;
    const double mean_err = tol_logp[t] * (3.0 + std::log(static_cast<double>(v)));
    dz_err[t] = a * dp_abs + b * (dp_abs * max_centered + max_p * (scale * tol_z + mean_err) + f16);
    row_weight[t] = a + b;
    // Through a logit softcap / scale the row is the general one of dz_error_bound.
    if (s.config.logit_softcap || s.config.logit_scale != 1.0F) {
      dz_err[t] = dz_error_bound(s.config, a, b, tol_logp[t], 2.0 * xmax, static_cast<double>(v), bf16);
    }
  }
  for (std::int64_t t = 0; t < n; ++t) {
    SCOPED_TRACE("row " + std::to_string(t));
    EXPECT_NEAR(got.logp[t], want.logp[t], tol_logp[t] * (s.config.temperature_on_logp ? 1.0 / tau : 1.0));
    EXPECT_NEAR(got.entropy[t], want.entropy[t], tol_logp[t] * (2.0 + std::log(static_cast<double>(v))));
  }

  const FilterSlack filter(c.head, want.dlogits, row_weight, dz_err);
  const double dz_round = bf16 ? 4.0 / 512.0 / std::sqrt(3.0) : 0.0;
  const std::vector<float> dh = to_float(got.dhidden.data(), c.head.dhidden_dtype, static_cast<std::size_t>(n * h));
  const double dh_out = c.head.dhidden_dtype == DType::bf16 ? 1.0 / 256.0 : 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t k = 0; k < h; ++k) {
      double sys = 0.0, sq = 0.0, abs_sum = 0.0;
      for (std::int64_t a = 0; a < v; ++a) {
        const double w = p.oracle.lm.weight[a * h + k];
        const double term = want.dlogits[t * v + a] * w;
        sys += dz_err[t] * std::abs(w) + filter.term(t, a, w);
        sq += term * term;
        abs_sum += std::abs(term);
      }
      const double want_dh = want.dhidden[t * h + k];
      const double tol = sys + dz_round * std::sqrt(sq) + 2.0 * kEpsF32 * std::sqrt(static_cast<double>(v)) * abs_sum +
                         dh_out * std::abs(want_dh) + 1e-30;
      ASSERT_NEAR(dh[t * h + k], want_dh, tol) << "dhidden[" << t << ", " << k << "]";
    }
  }
  HeadOutputs as_head;  // reuse its layout conversion
  as_head.dweight = got.dweight;
  const std::vector<double> dw = as_head.dweight_vocab_major(c.head);
  const double dw_out = c.head.dweight_dtype == DType::bf16 ? 1.0 / 256.0 : 0.0;
  for (std::int64_t a = 0; a < v; ++a) {
    for (std::int64_t k = 0; k < h; ++k) {
      double sys = 0.0, sq = 0.0, abs_sum = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        const double x = p.oracle.lm.hidden[t * h + k];
        const double term = want.dlogits[t * v + a] * x;
        sys += dz_err[t] * std::abs(x) + filter.term(t, a, x);
        sq += term * term;
        abs_sum += std::abs(term);
      }
      const double init = c.head.accumulate ? p.head.dweight_init[a * h + k] : 0.0;
      const double want_dw = init + want.dweight[a * h + k];
      const double tol = sys + dz_round * std::sqrt(sq) + 2.0 * kEpsF32 * std::sqrt(static_cast<double>(n)) * abs_sum +
                         2.0 * kEpsF32 * std::abs(init) + dw_out * std::abs(want_dw) + 1e-30;
      ASSERT_NEAR(dw[a * h + k], want_dw, tol) << "dweight[" << a << ", " << k << "]";
    }
  }
  if (c.head.bias) {
    for (std::int64_t a = 0; a < v; ++a) {
      double sys = 0.0, abs_sum = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        sys += dz_err[t];
        abs_sum += std::abs(want.dlogits[t * v + a]);
      }
      const double init = c.head.accumulate ? p.head.dbias_init[a] : 0.0;
      ASSERT_NEAR(got.dbias[a], init + want.dbias[a],
                  sys + 2.0 * kEpsF32 * static_cast<double>(n) * abs_sum + 2.0 * kEpsF32 * std::abs(init) + 1e-30)
          << "dbias[" << a << "]";
    }
  }
}

}  // namespace grpo::test
