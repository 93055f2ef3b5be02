#include "synth.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>

#include "kernels/f16.hpp"
#include "synth_internal.hpp"

namespace grpo::bench {
namespace {

using detail::kGolden;
using detail::parallel_ranges;
using detail::store;
using detail::Stream;
using detail::Tensor;

// Student's t with 3 degrees of freedom, divided by sqrt(3) for unit variance.
double student_t3(const Stream& z, const Stream& chi, std::uint64_t i) {
  double c = 0.0;
  for (std::uint64_t k = 0; k < 3; ++k) {
    const double n = chi.normal(3 * i + k);
    c += n * n;
  }
  return z.normal(i) / std::sqrt(c / 3.0) / std::sqrt(3.0);
}

// Expected log-sum-exp of V Gaussian logits of std s: log V + s^2 / 2.
double expected_lse(std::int64_t vocab, double s) { return std::log(static_cast<double>(vocab)) + 0.5 * s * s; }

// Distance of the ratio from every kink of the loss (clip edges, delta, cispo
// cap, the +-20 clamp of log r), relative to the edge.
bool near_kink(const LossConfig& c, double log_ratio, double margin) {
  if (margin <= 0.0) return false;
  const double r = std::exp(log_ratio);
  auto near = [&](double edge) { return std::abs(r - edge) < margin * edge; };
  if (std::abs(std::abs(log_ratio) - 20.0) < margin) return true;
  if (near(1.0 - c.epsilon_low) || near(1.0 + c.epsilon_high)) return true;
  if (c.delta && near(*c.delta)) return true;
  if (c.clip_ratio_c && near(*c.clip_ratio_c)) return true;
  return c.loss_type == LossType::cispo && near(c.epsilon_high);
}

}  // namespace

void detail::fill_batch_tensors(const ProblemSpec& s, Problem& p) {
  const InputSpec& in = s.inputs;
  const std::int64_t n = s.shape.rows();
  const std::int64_t t_len = s.shape.seq_len;
  p.ids.resize(n);
  p.mask.assign(n, 1.0F);
  const Stream ids(in.seed, Tensor::ids);
  const auto padded = static_cast<std::int64_t>(std::floor(in.masked_fraction * static_cast<double>(t_len)));
  for (std::int64_t r = 0; r < n; ++r) {
    p.ids[r] = static_cast<std::int32_t>(ids.bits(r) % static_cast<std::uint64_t>(s.shape.vocab));
    if (r % t_len >= t_len - padded) p.mask[r] = 0.0F;
  }
  const std::int64_t count = in.advantage_per_token ? n : s.shape.batch;
  p.advantages.resize(count);
  const Stream adv(in.seed, Tensor::advantages);
  for (std::int64_t i = 0; i < count; ++i) {
    double a = 0.0;
    switch (in.advantage) {
      case Distribution::uniform: a = 2.0 * adv.uniform(i) - 1.0; break;
      case Distribution::rademacher: a = (adv.bits(i) & 1U) != 0 ? 1.0 : -1.0; break;
      default: a = adv.normal(i); break;
    }
    p.advantages[i] = static_cast<float>(a * in.advantage_scale);
  }
  // Exactly round(fraction * count) entries become 0, picked by hash rank.
  const auto zeros = static_cast<std::int64_t>(std::llround(in.zero_advantage_fraction * static_cast<double>(count)));
  std::vector<std::int64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  const Stream pick(in.seed, Tensor::zero_pick);
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return pick.bits(a) < pick.bits(b); });
  for (std::int64_t i = 0; i < zeros; ++i) p.advantages[order[i]] = 0.0F;
  if (in.is_weight_noise > 0.0) {
    p.is_weight.resize(n);
    const Stream isw(in.seed, Tensor::is_weight);
    for (std::int64_t r = 0; r < n; ++r)
      p.is_weight[r] = static_cast<float>(std::exp(in.is_weight_noise * isw.normal(r)));
  }
  p.config = s.loss.config;
  if (s.loss.autos.max_completion_length) p.config.max_completion_length = t_len;
  if (s.loss.autos.num_items_in_batch)
    p.config.num_items_in_batch = static_cast<double>(std::max<std::int64_t>(p.num_valid(), 1));
}

namespace {

void fill_lm_head(const ProblemSpec& s, Problem& p) {
  const InputSpec& in = s.inputs;
  const std::int64_t n = s.shape.rows(), h = s.shape.hidden, v = s.shape.vocab;
  const std::size_t in_size = size_of(s.dtype);
  p.weight = HostBuffer(static_cast<std::size_t>(v * h) * in_size);
  const Stream w(in.seed, Tensor::weight);
  const float w_scale = static_cast<float>(in.logit_std / std::sqrt(static_cast<double>(h)));
  const bool vm = s.layout == WeightLayout::vocab_major;
  parallel_ranges(static_cast<std::size_t>(v * h), s.threads, [&](std::size_t b, std::size_t e) {
    for (std::size_t j = b; j < e; ++j) {
      // Draw by the logical [V, H] index, so both layouts hold the same W.
      const std::size_t logical = vm ? j : (j % v) * h + j / v;
      store(p.weight, s.dtype, j, w.approx_normal(logical) * w_scale);
    }
  });
  auto weight_at = [&](std::int64_t tok, std::int64_t k) {
    return load_float(p.weight.data(), s.dtype, static_cast<std::size_t>(vm ? tok * h + k : k * v + tok));
  };
  if (s.bias) {
    p.bias = HostBuffer(static_cast<std::size_t>(v) * 4);
    const Stream b(in.seed, Tensor::bias);
    for (std::int64_t a = 0; a < v; ++a) store(p.bias, DType::f32, a, static_cast<float>(0.5 * b.normal(a)));
  }
  p.hidden = HostBuffer(static_cast<std::size_t>(n * h) * in_size);
  const Stream hz(in.seed, Tensor::hidden), hchi(in.seed, Tensor::hidden_chi), peaky(in.seed, Tensor::peaky);
  // Peaky rows: h += delta * W[y] / |W[y]|^2 raises z_y by delta, to about
  // peaky_margin above the log-sum-exp of the other logits.
  const double lift = expected_lse(v, in.logit_std) + in.peaky_margin;
  parallel_ranges(static_cast<std::size_t>(n), s.threads, [&](std::size_t b, std::size_t e) {
    std::vector<double> row(h);
    for (std::size_t r = b; r < e; ++r) {
      for (std::int64_t k = 0; k < h; ++k) {
        const std::uint64_t i = r * h + k;
        row[k] = in.hidden_distribution == Distribution::student_t ? student_t3(hz, hchi, i) : hz.normal(i);
      }
      if (p.mask[r] != 0.0F && peaky.uniform(r) < in.peaky_fraction) {
        double norm2 = 0.0, z = 0.0;
        for (std::int64_t k = 0; k < h; ++k) {
          norm2 += static_cast<double>(weight_at(p.ids[r], k)) * weight_at(p.ids[r], k);
          z += row[k] * weight_at(p.ids[r], k);
        }
        const double delta = norm2 > 0.0 ? (lift - z) / norm2 : 0.0;
        for (std::int64_t k = 0; k < h; ++k) row[k] += delta * weight_at(p.ids[r], k);
      }
      for (std::int64_t k = 0; k < h; ++k) store(p.hidden, s.dtype, r * h + k, static_cast<float>(row[k]));
    }
  });
}

void fill_logits(const ProblemSpec& s, Problem& p) {
  const InputSpec& in = s.inputs;
  const std::int64_t n = s.shape.rows(), v = s.shape.vocab;
  p.logits = HostBuffer(static_cast<std::size_t>(n * v) * size_of(s.logits_dtype));
  const Stream z(in.seed, Tensor::logits), chi(in.seed, Tensor::hidden_chi), peaky(in.seed, Tensor::peaky);
  const auto sd = static_cast<float>(in.logit_std);
  parallel_ranges(static_cast<std::size_t>(n * v), s.threads, [&](std::size_t b, std::size_t e) {
    for (std::size_t j = b; j < e; ++j) {
      const float x = in.hidden_distribution == Distribution::student_t ? static_cast<float>(student_t3(z, chi, j))
                                                                        : z.approx_normal(j);
      store(p.logits, s.logits_dtype, j, x * sd);
    }
  });
  const double lift = expected_lse(v, in.logit_std) + in.peaky_margin;
  for (std::int64_t r = 0; r < n; ++r) {
    if (p.mask[r] != 0.0F && peaky.uniform(r) < in.peaky_fraction) {
      store(p.logits, s.logits_dtype, static_cast<std::size_t>(r * v + p.ids[r]), static_cast<float>(lift));
    }
  }
}

// On-policy logp of the synthesized tensors, from the library's fused path.
std::vector<float> forward_logp(const ProblemSpec& s, const Problem& p) {
  LossConfig on_policy = p.config;
  on_policy.beta = 0.0F;
  BatchInputs batch{p.ids, p.mask, p.advantages, {}, {}, p.is_weight};
  std::vector<float> logp(p.ids.size());
  if (s.lm_head) {
    LmHeadOptions o;
    o.forward_only = true;
    o.max_threads = s.threads;
    const LmHeadLossPlan plan(p.lm_head_shape(), on_policy, o);
    LmHeadInputs in = p.lm_head_inputs();
    in.batch = batch;
    plan.execute(in, {.tokens = {.logp = logp}});
  } else {
    const LogitsLossPlan plan({s.shape.batch, s.shape.seq_len, s.shape.vocab, s.logits_dtype}, on_policy,
                              {.max_threads = s.threads});
    plan.execute(p.logits_view(), batch, {.tokens = {.logp = logp}});
  }
  return logp;
}

void fill_policy_logps(const ProblemSpec& s, Problem& p) {
  const InputSpec& in = s.inputs;
  const bool need_ref = p.config.beta != 0.0F;
  if (in.old_logp == OldLogp::none && !need_ref) return;
  const std::vector<float> logp = forward_logp(s, p);
  const std::int64_t n = s.shape.rows(), t_len = s.shape.seq_len;
  if (need_ref) {
    const Stream ref(in.seed, Tensor::ref_noise);
    p.ref_logp.resize(n);
    for (std::int64_t r = 0; r < n; ++r)
      p.ref_logp[r] = static_cast<float>(logp[r] + in.ref_logp_noise * ref.normal(r));
  }
  if (in.old_logp == OldLogp::none) return;
  p.old_logp.resize(n);
  const bool sequence = p.config.importance_sampling_level == IsLevel::sequence;
  for (std::int64_t seq = 0; seq < s.shape.batch; ++seq) {
    // Redraw (a new sub-stream per attempt) while a ratio sits on a kink.
    for (std::uint64_t attempt = 0;; ++attempt) {
      const Stream noise(in.seed, Tensor::old_noise, attempt);
      bool ok = true;
      double sum = 0.0, count = 0.0;
      for (std::int64_t r = seq * t_len; r < (seq + 1) * t_len; ++r) {
        p.old_logp[r] = static_cast<float>(logp[r] + in.old_logp_noise * noise.normal(r));
        const double log_ratio = static_cast<double>(logp[r]) - p.old_logp[r];
        if (!sequence && p.mask[r] != 0.0F && near_kink(p.config, log_ratio, in.kink_margin)) ok = false;
        sum += p.mask[r] * log_ratio;
        count += p.mask[r];
      }
      if (sequence && near_kink(p.config, sum / std::max(count, 1.0), in.kink_margin)) ok = false;
      if (ok || attempt >= 200) break;
    }
  }
}

}  // namespace

HostBuffer::HostBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  data_.reset(static_cast<std::byte*>(p));
}

void HostBuffer::Free::operator()(std::byte* p) const { std::free(p); }

void HostBuffer::fill_zero() const {
  if (bytes_ != 0) std::memset(data_.get(), 0, bytes_);
}

float bf16_to_float(std::uint16_t v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_bf16(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x40U);  // quiet NaN
  bits += 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>(bits >> 16);
}

float f16_to_float(std::uint16_t v) { return kernels::f16_to_float(v); }
std::uint16_t float_to_f16(float v) { return kernels::float_to_f16(v); }

LmHeadShape Problem::lm_head_shape() const {
  return {.batch = spec.shape.batch,
          .seq_len = spec.shape.seq_len,
          .hidden = spec.shape.hidden,
          .vocab = spec.shape.vocab,
          .dtype = spec.dtype,
          .layout = spec.layout,
          .has_bias = spec.bias,
          .bias_dtype = DType::f32};
}

LmHeadInputs Problem::lm_head_inputs() const {
  const std::int64_t n = spec.shape.rows(), h = spec.shape.hidden, v = spec.shape.vocab;
  const bool vm = spec.layout == WeightLayout::vocab_major;
  LmHeadInputs in;
  in.hidden = {hidden.data(), spec.dtype, n, h, h};
  in.weight = vm ? MatrixView{weight.data(), spec.dtype, v, h, h} : MatrixView{weight.data(), spec.dtype, h, v, v};
  if (!bias.empty()) in.bias = {bias.data(), DType::f32, v};
  in.batch = batch();
  return in;
}

MatrixView Problem::logits_view() const {
  const std::int64_t v = spec.shape.vocab;
  return {logits.data(), spec.logits_dtype, spec.shape.rows(), v, v};
}

std::int64_t Problem::num_valid() const {
  std::int64_t valid = 0;
  for (const float m : mask) valid += m != 0.0F ? 1 : 0;
  return valid;
}

Problem synthesize(const ProblemSpec& spec) {
  Problem p;
  p.spec = spec;
  detail::fill_batch_tensors(spec, p);
  if (spec.inputs.generator == InputGenerator::trained_like) {
    detail::fill_trained_like(spec, p);
  } else if (spec.inputs.generator == InputGenerator::file) {
    detail::fill_from_file(spec, p);
  } else if (spec.lm_head) {
    fill_lm_head(spec, p);
  } else {
    fill_logits(spec, p);
  }
  fill_policy_logps(spec, p);
  return p;
}

}  // namespace grpo::bench
