// LM-head test fixtures: host tensors in the library's layouts and dtypes, the
// oracle problem on exactly the same (rounded) values, and a runner for the
// fused plan and the baseline.
#pragma once

#include <cstring>

#include "test_support.hpp"

namespace grpo::test {

struct HeadCase {
  BatchSpec spec;
  std::int64_t hidden = 16;
  DType dtype = DType::f32;
  WeightLayout layout = WeightLayout::vocab_major;
  bool bias = false;
  DType bias_dtype = DType::f32;
  bool banned = false;       // bias -inf on some tokens
  bool accumulate = false;   // dweight / dbias += (initial values nonzero)
  bool frozen = false;       // LmHeadOptions::frozen_weight: dweight / dbias not passed (they keep their fill)
  double grad_filter = 0.0;  // LmHeadOptions::grad_filter (fused only)
  double grad_scale = 1.0;   // LmHeadInputs::grad_scale
  // Added to every row of W along one fixed direction (softmax-invariant: every
  // logit of a row moves alike), as a trained head's rows share directions:
  // what the filtered backward's left-out entries sum along.
  double shared_direction = 0.0;
  std::int64_t token_block = 32;
  std::int64_t vocab_tile = 64;
  DType dweight_dtype = DType::f32;
  DType dhidden_dtype = DType::f32;
  bool baseline = false;
  DType baseline_logits = DType::f32;
  // Row padding (elements beyond the dense row; 0 = dense): hidden_ld = H +
  // hidden_pad, weight_ld / dweight_ld = the weight's row + pad, dhidden ld =
  // H + dhidden_pad. Input padding holds NaN (never to be read), output
  // padding kOutputPadByte (never to be written).
  std::int64_t hidden_pad = 0;
  std::int64_t weight_pad = 0;
  std::int64_t dweight_pad = 0;
  std::int64_t dhidden_pad = 0;
};

inline constexpr std::byte kOutputPadByte{0xff};  // a NaN in f32 and in bf16

inline std::string case_name(const HeadCase& c) {
  return describe(c.spec) + " H=" + std::to_string(c.hidden) + " dtype=" + to_string(c.dtype) +
         " layout=" + to_string(c.layout) + (c.bias ? std::string(" bias(") + to_string(c.bias_dtype) + ")" : "") +
         (c.banned ? " banned" : "") + (c.accumulate ? " accumulate" : "") + " block=" + std::to_string(c.token_block) +
         " tile=" + std::to_string(c.vocab_tile) + " dW=" + to_string(c.dweight_dtype) +
         " dh=" + to_string(c.dhidden_dtype) + (c.baseline ? " baseline" : " fused") +
         (c.grad_filter != 0.0 ? " grad_filter=" + std::to_string(c.grad_filter) : "") +
         (c.hidden_pad + c.weight_pad + c.dweight_pad + c.dhidden_pad != 0
              ? " pads(h,w,dw,dh)=" + std::to_string(c.hidden_pad) + "," + std::to_string(c.weight_pad) + "," +
                    std::to_string(c.dweight_pad) + "," + std::to_string(c.dhidden_pad)
              : "");
}

inline void PrintTo(const HeadCase& c, std::ostream* os) { *os << case_name(c); }

// Stores doubles in a dtype; returns the values actually stored (as doubles).
inline std::vector<double> store(const std::vector<double>& v, DType dtype, std::vector<std::byte>& out) {
  out.assign(v.size() * size_of(dtype), std::byte{0});
  std::vector<double> actual(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto f = static_cast<float>(v[i]);
    if (dtype == DType::f32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
      actual[i] = f;
    } else if (dtype == DType::bf16) {
      const std::uint16_t b = kernels::float_to_bf16(f);
      std::memcpy(out.data() + 2 * i, &b, 2);
      actual[i] = kernels::bf16_to_float(b);
    } else {
      const std::uint16_t b = kernels::float_to_f16(f);
      std::memcpy(out.data() + 2 * i, &b, 2);
      actual[i] = kernels::f16_to_float(b);
    }
  }
  return actual;
}

// Dense rows (cols elements of esize bytes each) copied into rows of ld
// elements; each padding element is a copy of `fill` (esize bytes).
inline std::vector<std::byte> pad_rows(const std::vector<std::byte>& dense, std::int64_t rows, std::int64_t cols,
                                       std::int64_t ld, std::size_t esize, const void* fill) {
  std::vector<std::byte> out(static_cast<std::size_t>(rows * ld) * esize);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data() + static_cast<std::size_t>(r * ld) * esize,
                dense.data() + static_cast<std::size_t>(r * cols) * esize, static_cast<std::size_t>(cols) * esize);
    for (std::int64_t k = cols; k < ld; ++k)
      std::memcpy(out.data() + static_cast<std::size_t>(r * ld + k) * esize, fill, esize);
  }
  return out;
}

// The inverse of pad_rows; returns how many padding bytes differ from `fill`.
inline std::size_t unpad_rows(const std::vector<std::byte>& padded, std::int64_t rows, std::int64_t cols,
                              std::int64_t ld, std::size_t esize, const void* fill, std::vector<std::byte>& dense) {
  std::size_t changed = 0;
  dense.resize(static_cast<std::size_t>(rows * cols) * esize);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::memcpy(dense.data() + static_cast<std::size_t>(r * cols) * esize,
                padded.data() + static_cast<std::size_t>(r * ld) * esize, static_cast<std::size_t>(cols) * esize);
    for (std::int64_t k = cols; k < ld; ++k) {
      const std::byte* at = padded.data() + static_cast<std::size_t>(r * ld + k) * esize;
      for (std::size_t i = 0; i < esize; ++i) changed += at[i] != static_cast<const std::byte*>(fill)[i] ? 1 : 0;
    }
  }
  return changed;
}

struct HeadOutputs {
  std::vector<float> logp, entropy, kl;
  std::vector<std::byte> dhidden, dweight;  // dense, whatever the case's padding
  std::vector<float> dbias;
  Metrics metrics;
  LmHeadStepStats stats;  // the fused plan's
  std::string schedule;
  std::size_t padding_bytes_written = 0;  // output padding bytes (HeadCase::*_pad) the run changed

  // dweight as doubles in vocab-major order.
  std::vector<double> dweight_vocab_major(const HeadCase& c) const {
    const std::int64_t v = c.spec.vocab, h = c.hidden;
    const std::vector<float> f = to_float(dweight.data(), c.dweight_dtype, static_cast<std::size_t>(v * h));
    std::vector<double> out(f.size());
    for (std::int64_t a = 0; a < v; ++a) {
      for (std::int64_t k = 0; k < h; ++k) {
        out[a * h + k] = f[c.layout == WeightLayout::vocab_major ? a * h + k : k * v + a];
      }
    }
    return out;
  }
};

// What the filtered backward (LmHeadOptions::grad_filter) may add to a
// gradient's error against the oracle. It leaves out entries with |dz_tv| <
// eps w_t, w_t = (|a_t| + |b_t|) s the row's coefficients
// (docs/filtered_backward.md), and only such entries, so each of them may be
// missing from its dhidden and dW sums. An entry counts as possibly left out
// when its oracle |dz| is below twice that (room for the f32 coefficients and
// the bf16 rounding of the dz the kernel tests) plus its systematic error
// dz_err; it may then add (|dz| + dz_err) times the sum's other factor.
class FilterSlack {
 public:
  // row_weight[t]: the oracle's |a_t| + |b_t| (a = |dL/dlogp| / tau, b = |dL/dEnt| dx/dz').
  FilterSlack(const HeadCase& c, const std::vector<double>& dlogits, const std::vector<double>& row_weight,
              const std::vector<double>& dz_err)
      : v_(c.spec.vocab), dlogits_(dlogits), dz_err_(dz_err) {
    if (c.grad_filter == 0.0) return;
    const double eps = c.grad_filter > 0.0 ? c.grad_filter : std::ldexp(1.0, c.dtype == DType::bf16 ? -12 : -28);
    const double s = std::max(1.0, static_cast<double>(c.spec.config.logit_scale)) *
                     std::max(1.0, static_cast<double>(c.spec.config.temperature));
    may_skip_.assign(dlogits.size(), 0);
    for (std::size_t i = 0; i < dlogits.size(); ++i) {
      const auto t = static_cast<std::int64_t>(i) / v_;
      may_skip_[i] = std::abs(dlogits[i]) < 2.0 * eps * row_weight[t] * s + dz_err[t] ? 1 : 0;
    }
  }
  // The slack entry (t, a) adds to a sum where its other factor is `other`.
  double term(std::int64_t t, std::int64_t a, double other) const {
    if (may_skip_.empty() || may_skip_[t * v_ + a] == 0) return 0.0;
    return (std::abs(dlogits_[t * v_ + a]) + dz_err_[t]) * std::abs(other);
  }

 private:
  std::int64_t v_;
  const std::vector<double>& dlogits_;
  const std::vector<double>& dz_err_;
  std::vector<char> may_skip_;
};

struct HeadProblem {
  oracle::LmHeadProblem oracle;
  HostBatch batch;
  std::vector<std::byte> hidden, weight, bias;   // library layouts / dtypes
  std::vector<double> dweight_init, dbias_init;  // accumulate mode: what the outputs start as
};

HeadOutputs run_head(const HeadCase& c, const HeadProblem& p, int max_threads = 0);

// with_oracle = false skips the O(N V H) double logits (large shapes): ids are
// drawn among unbanned tokens and the on-policy logp comes from a forward-only
// fused run.
inline HeadProblem make_head_problem(const HeadCase& c, bool with_oracle = true) {
  const BatchSpec& s = c.spec;
  const std::int64_t n = s.batch * s.seq_len;
  const std::int64_t h = c.hidden;
  const std::int64_t v = s.vocab;
  std::mt19937 rng(s.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  HeadProblem p;
  std::vector<double> hid(static_cast<std::size_t>(n * h));
  for (double& x : hid) x = normal(rng);
  // W ~ N(0, scale / sqrt(H)): logits have std ~ logit_scale.
  std::vector<double> w(static_cast<std::size_t>(v * h));
  for (double& x : w) x = normal(rng) * s.logit_scale / std::sqrt(static_cast<double>(h));
  if (c.shared_direction != 0.0) {
    for (std::int64_t a = 0; a < v; ++a) {
      for (std::int64_t k = 0; k < h; ++k) w[a * h + k] += c.shared_direction * (k % 2 == 0 ? 1.0 : -0.5);
    }
  }
  p.oracle.hidden_size = h;
  p.oracle.hidden = store(hid, c.dtype, p.hidden);
  std::vector<double> w_layout(w.size());
  for (std::int64_t a = 0; a < v; ++a) {
    for (std::int64_t k = 0; k < h; ++k) {
      const double x = w[a * h + k];
      w_layout[c.layout == WeightLayout::vocab_major ? a * h + k : k * v + a] = x;
    }
  }
  const std::vector<double> stored = store(w_layout, c.dtype, p.weight);
  p.oracle.weight.resize(w.size());
  for (std::int64_t a = 0; a < v; ++a) {
    for (std::int64_t k = 0; k < h; ++k) {
      p.oracle.weight[a * h + k] = stored[c.layout == WeightLayout::vocab_major ? a * h + k : k * v + a];
    }
  }
  if (c.bias) {
    std::vector<double> b(static_cast<std::size_t>(v));
    for (std::int64_t a = 0; a < v; ++a) {
      b[a] = (c.banned && a % 5 == 1) ? -std::numeric_limits<double>::infinity() : normal(rng);
    }
    p.oracle.bias = store(b, c.bias_dtype, p.bias);
  }
  p.oracle.head.batch = s.batch;
  p.oracle.head.seq_len = s.seq_len;
  p.oracle.head.vocab = v;
  if (with_oracle) {
    p.batch.problem.logits = oracle::lm_head_logits(p.oracle);
    fill_batch(s, p.batch, rng);
  } else {
    std::uniform_int_distribution<std::int64_t> pick(0, v - 1);
    p.batch.ids.resize(n);
    for (auto& id : p.batch.ids) {
      do {
        id = static_cast<std::int32_t>(pick(rng));
      } while (c.banned && id % 5 == 1);
    }
    // Probe: on-policy, forward only, no KL, every row valid.
    HeadCase probe_case = c;
    probe_case.spec.config.beta = 0.0F;
    HeadProblem probe = p;
    probe.batch.mask.assign(n, 1.0F);
    probe.batch.advantages.assign(s.batch, 1.0F);
    probe.batch.old_logp.clear();
    probe.batch.ref_logp.clear();
    probe.batch.is_weight.clear();
    const HeadOutputs o = run_head(probe_case, probe);
    const std::vector<double> logp(o.logp.begin(), o.logp.end());
    fill_batch(s, p.batch, rng, &logp);
  }
  p.oracle.head = p.batch.problem;
  if (c.accumulate) {
    const std::size_t wcount = static_cast<std::size_t>(v * h);
    p.dweight_init.resize(wcount);
    for (double& x : p.dweight_init) x = static_cast<float>(0.01 * normal(rng));
    p.dbias_init.resize(static_cast<std::size_t>(v));
    for (double& x : p.dbias_init) x = static_cast<float>(0.01 * normal(rng));
  }
  return p;
}

inline HeadOutputs run_head(const HeadCase& c, const HeadProblem& p, int max_threads) {
  const BatchSpec& s = c.spec;
  const std::int64_t n = s.batch * s.seq_len;
  const std::int64_t v = s.vocab, h = c.hidden;
  const bool vm = c.layout == WeightLayout::vocab_major;
  HeadOutputs o;
  o.logp.assign(n, -1.0F);
  o.entropy.assign(n, -1.0F);
  o.kl.assign(n, -1.0F);
  o.dhidden.assign(static_cast<std::size_t>(n * h) * size_of(c.dhidden_dtype), std::byte{0x3f});
  if (c.accumulate) {
    std::vector<double> init(p.dweight_init.size());
    for (std::int64_t a = 0; a < v; ++a) {
      for (std::int64_t k = 0; k < h; ++k) init[vm ? a * h + k : k * v + a] = p.dweight_init[a * h + k];
    }
    store(init, c.dweight_dtype, o.dweight);
    if (c.bias) o.dbias.assign(p.dbias_init.begin(), p.dbias_init.end());
  } else {
    o.dweight.assign(static_cast<std::size_t>(v * h) * size_of(c.dweight_dtype), std::byte{0x3f});
    o.dbias.assign(c.bias ? v : 0, 7.0F);
  }
  // Row strides; padded copies of the buffers when a case asks for them.
  const std::int64_t wrows = vm ? v : h, wcols = vm ? h : v;
  const std::int64_t hidden_ld = h + c.hidden_pad, weight_ld = wcols + c.weight_pad;
  const std::int64_t dweight_ld = wcols + c.dweight_pad, dhidden_ld = h + c.dhidden_pad;
  const float nan_f32 = std::numeric_limits<float>::quiet_NaN();
  const std::uint16_t nan_bf16 = kernels::float_to_bf16(nan_f32);
  const std::uint16_t nan_f16 = kernels::float_to_f16(nan_f32);
  const void* nan = c.dtype == DType::f32    ? static_cast<const void*>(&nan_f32)
                    : c.dtype == DType::bf16 ? static_cast<const void*>(&nan_bf16)
                                             : static_cast<const void*>(&nan_f16);
  const std::byte out_fill[4] = {kOutputPadByte, kOutputPadByte, kOutputPadByte, kOutputPadByte};
  const std::size_t in_size = size_of(c.dtype);
  const std::vector<std::byte> hidden_buf =
      c.hidden_pad != 0 ? pad_rows(p.hidden, n, h, hidden_ld, in_size, nan) : std::vector<std::byte>{};
  const std::vector<std::byte> weight_buf =
      c.weight_pad != 0 ? pad_rows(p.weight, wrows, wcols, weight_ld, in_size, nan) : std::vector<std::byte>{};
  std::vector<std::byte> dhidden_buf = c.dhidden_pad != 0
                                           ? pad_rows(o.dhidden, n, h, dhidden_ld, size_of(c.dhidden_dtype), out_fill)
                                           : std::vector<std::byte>{};
  std::vector<std::byte> dweight_buf =
      c.dweight_pad != 0 ? pad_rows(o.dweight, wrows, wcols, dweight_ld, size_of(c.dweight_dtype), out_fill)
                         : std::vector<std::byte>{};
  LmHeadShape shape{s.batch,
                    s.seq_len,
                    h,
                    v,
                    c.dtype,
                    c.layout,
                    c.bias,
                    c.bias_dtype,
                    c.hidden_pad != 0 ? hidden_ld : 0,
                    c.weight_pad != 0 ? weight_ld : 0,
                    c.dweight_pad != 0 ? dweight_ld : 0};
  LmHeadInputs in{{c.hidden_pad != 0 ? hidden_buf.data() : p.hidden.data(), c.dtype, n, h, hidden_ld},
                  {c.weight_pad != 0 ? weight_buf.data() : p.weight.data(), c.dtype, wrows, wcols, weight_ld},
                  c.bias ? VectorView{p.bias.data(), c.bias_dtype, v} : VectorView{},
                  p.batch.view()};
  in.grad_scale = c.grad_scale;
  LmHeadOutputs out{
      {o.logp, o.entropy, o.kl},
      {c.dhidden_pad != 0 ? dhidden_buf.data() : o.dhidden.data(), c.dhidden_dtype, n, h, dhidden_ld},
      {c.dweight_pad != 0 ? dweight_buf.data() : o.dweight.data(), c.dweight_dtype, wrows, wcols, dweight_ld},
      o.dbias,
      &o.metrics,
      &o.stats};
  if (c.frozen) {
    out.dweight = {};
    out.dbias = {};
  }
  if (c.baseline) {
    LmHeadBaselineOptions opt;
    opt.logits_dtype = c.baseline_logits;
    opt.dweight_dtype = c.dweight_dtype;
    opt.dhidden_dtype = c.dhidden_dtype;
    opt.accumulate_weight_grads = c.accumulate;
    opt.max_threads = max_threads;
    LmHeadBaseline(shape, s.config, opt).execute(in, out);
  } else {
    LmHeadOptions opt;
    opt.token_block = c.token_block;
    opt.vocab_tile = c.vocab_tile;
    opt.dweight_dtype = c.dweight_dtype;
    opt.dhidden_dtype = c.dhidden_dtype;
    opt.accumulate_weight_grads = c.accumulate;
    opt.frozen_weight = c.frozen;
    opt.grad_filter = c.grad_filter;
    opt.max_threads = max_threads;
    LmHeadLossPlan plan(shape, s.config, opt);
    o.schedule = plan.describe();
    plan.execute(in, out);
  }
  if (c.dhidden_pad != 0) {
    o.padding_bytes_written += unpad_rows(dhidden_buf, n, h, dhidden_ld, size_of(c.dhidden_dtype), out_fill, o.dhidden);
  }
  if (c.dweight_pad != 0) {
    o.padding_bytes_written +=
        unpad_rows(dweight_buf, wrows, wcols, dweight_ld, size_of(c.dweight_dtype), out_fill, o.dweight);
  }
  return o;
}

}  // namespace grpo::test
