#include "input_stats.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>

#include <immintrin.h>

#include "cpu_features.hpp"
#include "synth_internal.hpp"

namespace grpo::bench {
namespace {

// out[i * 4 + j] = a_i . b_j for four rows of a and four of b (stride ld,
// n a multiple of 16): 16 accumulators, each operand load feeding four FMAs.
__attribute__((target("avx512f"))) void dots_4x4_avx512(const float* a, const float* b, std::int64_t ld, std::int64_t n,
                                                        float* out) {
  __m512 acc[16];
  for (__m512& x : acc) x = _mm512_setzero_ps();
  for (std::int64_t k = 0; k < n; k += 16) {
    __m512 bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = _mm512_loadu_ps(b + j * ld + k);
    for (int i = 0; i < 4; ++i) {
      const __m512 av = _mm512_loadu_ps(a + i * ld + k);
      for (int j = 0; j < 4; ++j) acc[i * 4 + j] = _mm512_fmadd_ps(av, bv[j], acc[i * 4 + j]);
    }
  }
  for (int x = 0; x < 16; ++x) out[x] = _mm512_reduce_add_ps(acc[x]);
}

// The same on AVX2 + FMA (n a multiple of 8), two rows of a at a time: 8
// accumulators in named variables, so they stay in registers even at -O1.
// Without it a CPU lacking AVX-512 ran the plain loop below, which only the
// optimizer makes fast: under the sanitizer build (-O1) the trained-like input
// tests took 54 s instead of a fraction of one (Zen 3).
__attribute__((target("avx2,fma"))) float hsum_avx2(__m256 x) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

__attribute__((target("avx2,fma"))) void dots_4x4_avx2(const float* a, const float* b, std::int64_t ld, std::int64_t n,
                                                       float* out) {
  for (int i = 0; i < 4; i += 2) {
    const float* a0 = a + i * ld;
    const float* a1 = a0 + ld;
    __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s03 = s00;
    __m256 s10 = s00, s11 = s00, s12 = s00, s13 = s00;
    for (std::int64_t k = 0; k < n; k += 8) {
      const __m256 x0 = _mm256_loadu_ps(a0 + k), x1 = _mm256_loadu_ps(a1 + k);
      const __m256 w0 = _mm256_loadu_ps(b + k), w1 = _mm256_loadu_ps(b + ld + k);
      const __m256 w2 = _mm256_loadu_ps(b + 2 * ld + k), w3 = _mm256_loadu_ps(b + 3 * ld + k);
      s00 = _mm256_fmadd_ps(x0, w0, s00);
      s01 = _mm256_fmadd_ps(x0, w1, s01);
      s02 = _mm256_fmadd_ps(x0, w2, s02);
      s03 = _mm256_fmadd_ps(x0, w3, s03);
      s10 = _mm256_fmadd_ps(x1, w0, s10);
      s11 = _mm256_fmadd_ps(x1, w1, s11);
      s12 = _mm256_fmadd_ps(x1, w2, s12);
      s13 = _mm256_fmadd_ps(x1, w3, s13);
    }
    float* o = out + static_cast<std::ptrdiff_t>(i) * 4;
    o[0] = hsum_avx2(s00);
    o[1] = hsum_avx2(s01);
    o[2] = hsum_avx2(s02);
    o[3] = hsum_avx2(s03);
    o[4] = hsum_avx2(s10);
    o[5] = hsum_avx2(s11);
    o[6] = hsum_avx2(s12);
    o[7] = hsum_avx2(s13);
  }
}

// The same sums in plain code (any CPU, any n): 16 partial sums per dot.
void dots_4x4_plain(const float* a, const float* b, std::int64_t ld, std::int64_t n, float* out) {
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      float acc[16] = {};
      std::int64_t k = 0;
      for (; k + 16 <= n; k += 16) {
        for (int l = 0; l < 16; ++l) acc[l] += a[i * ld + k + l] * b[j * ld + k + l];
      }
      float sum = 0.0F;
      for (; k < n; ++k) sum += a[i * ld + k] * b[j * ld + k];
      for (const float x : acc) sum += x;
      out[i * 4 + j] = sum;
    }
  }
}

double quantile(std::vector<double> xs, double q) {
  if (xs.empty()) return 0.0;
  std::sort(xs.begin(), xs.end());
  const double pos = q * static_cast<double>(xs.size() - 1);
  const auto i = static_cast<std::size_t>(pos);
  const double f = pos - static_cast<double>(i);
  return i + 1 < xs.size() ? xs[i] * (1.0 - f) + xs[i + 1] * f : xs[i];
}

}  // namespace

std::vector<float> reference_logits(const Problem& p, std::span<const std::int64_t> rows, int threads) {
  const ProblemSpec& s = p.spec;
  const std::int64_t h = s.shape.hidden, v = s.shape.vocab;
  const auto r_count = static_cast<std::int64_t>(rows.size());
  const bool vm = s.layout == WeightLayout::vocab_major;
  const CpuFeatures cpu = detect_cpu_features();
  const auto dots = h % 16 == 0 && cpu.avx512f   ? dots_4x4_avx512
                    : h % 8 == 0 && cpu.avx2_fma ? dots_4x4_avx2
                                                 : dots_4x4_plain;
  // Rows and tokens in fours (zero padding): hid [r_pad, H] as float.
  const std::int64_t r_pad = (r_count + 3) / 4 * 4;
  std::vector<float> hid(static_cast<std::size_t>(r_pad * h), 0.0F);
  for (std::int64_t i = 0; i < r_count; ++i) {
    for (std::int64_t k = 0; k < h; ++k)
      hid[i * h + k] = load_float(p.hidden.data(), s.dtype, static_cast<std::size_t>(rows[i] * h + k));
  }
  std::vector<float> out(static_cast<std::size_t>(r_count * v));
  const float* bias = p.bias.empty() ? nullptr : p.bias.as<float>();
  constexpr std::int64_t kChunk = 64;  // tokens per task: 64 float rows of W (1 MiB at H=4096) stay in L2
  const std::int64_t chunks = (v + kChunk - 1) / kChunk;
  detail::parallel_ranges(
      static_cast<std::size_t>(chunks), threads,
      [&](std::size_t b, std::size_t e) {
        std::vector<float> w(static_cast<std::size_t>(kChunk * h));
        float block[16];
        for (std::size_t c = b; c < e; ++c) {
          const std::int64_t t0 = static_cast<std::int64_t>(c) * kChunk, tn = std::min(kChunk, v - t0);
          std::fill(w.begin(), w.end(), 0.0F);
          for (std::int64_t t = 0; t < tn; ++t) {
            for (std::int64_t k = 0; k < h; ++k) {
              const std::int64_t tok = t0 + t;
              w[t * h + k] =
                  load_float(p.weight.data(), s.dtype, static_cast<std::size_t>(vm ? tok * h + k : k * v + tok));
            }
          }
          for (std::int64_t i = 0; i < r_pad; i += 4) {
            for (std::int64_t t = 0; t < tn; t += 4) {
              dots(&hid[i * h], &w[t * h], h, h, block);
              for (std::int64_t a = 0; a < 4 && i + a < r_count; ++a) {
                for (std::int64_t j = 0; j < 4 && t + j < tn; ++j) {
                  const std::int64_t tok = t0 + t + j;
                  out[(i + a) * v + tok] = block[a * 4 + j] + (bias != nullptr ? bias[tok] : 0.0F);
                }
              }
            }
          }
        }
      },
      1);
  return out;
}

RowFacts row_facts(std::span<const float> z, std::int32_t id, double eps) {
  RowFacts f;
  double mx = -INFINITY;
  for (const float x : z) mx = std::max(mx, static_cast<double>(x));
  double sum = 0.0, dot = 0.0;
  for (const float x : z) {
    const double e = std::exp(x - mx);
    sum += e;
    dot += e * (x - mx);
  }
  const double log_sum = std::log(sum);
  f.entropy = log_sum - dot / sum;
  f.logp = z[id] - mx - log_sum;
  // p_v >= eps  <=>  z_v >= mx + log_sum + log(eps); the chosen id counts
  // when 1 - p >= eps.
  const double cut = mx + log_sum + std::log(eps);
  for (std::size_t i = 0; i < z.size(); ++i) {
    const bool big = static_cast<std::int32_t>(i) == id ? -std::expm1(f.logp) >= eps : z[i] >= cut;
    if (big) f.significant.push_back(static_cast<std::int32_t>(i));
  }
  return f;
}

std::vector<std::int64_t> sample_rows(const Problem& p, int count) {
  std::vector<std::int64_t> valid;
  for (std::size_t r = 0; r < p.mask.size(); ++r) {
    if (p.mask[r] != 0.0F) valid.push_back(static_cast<std::int64_t>(r));
  }
  if (static_cast<std::int64_t>(valid.size()) <= count) return valid;
  // A seeded shuffle's first `count`, sorted: spread over every sequence.
  const detail::Stream pick(p.spec.inputs.seed, detail::Tensor::stats_rows);
  std::sort(valid.begin(), valid.end(), [&](auto a, auto b) { return pick.bits(a) < pick.bits(b); });
  valid.resize(static_cast<std::size_t>(count));
  std::sort(valid.begin(), valid.end());
  return valid;
}

InputStats measure_inputs(const Problem& p, int count, int threads, double eps) {
  InputStats st;
  st.eps = eps;
  const std::vector<std::int64_t> rows = sample_rows(p, count);
  const std::int64_t v = p.spec.shape.vocab;
  const std::vector<float> z = reference_logits(p, rows, threads);
  double above = 0.0, logp = 0.0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const RowFacts f = row_facts(std::span<const float>(&z[i * v], v), p.ids[rows[i]], eps);
    st.entropy.push_back(f.entropy);
    logp += f.logp;
    above += static_cast<double>(f.significant.size());
  }
  st.rows = static_cast<std::int64_t>(rows.size());
  if (st.rows == 0) return st;
  const auto rcount = static_cast<double>(st.rows);
  double sum = 0.0;
  for (const double e : st.entropy) sum += e;
  st.entropy_mean = sum / rcount;
  st.entropy_p10 = quantile(st.entropy, 0.1);
  st.entropy_p50 = quantile(st.entropy, 0.5);
  st.entropy_p90 = quantile(st.entropy, 0.9);
  st.entropy_min = quantile(st.entropy, 0.0);
  st.entropy_max = quantile(st.entropy, 1.0);
  st.logp_mean = logp / rcount;
  st.significant_per_row = above / rcount;
  st.frac_above = above / (rcount * static_cast<double>(v));
  return st;
}

std::string InputStats::summary() const {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "inputs on %lld sampled rows: entropy mean %.3f nats (min %.3f p10 %.3f p50 %.3f p90 %.3f max "
                "%.3f); chosen-id logp mean %.3f; |p - onehot| >= 2^%.0f: %.3g of entries (%.1f per row)",
                static_cast<long long>(rows), entropy_mean, entropy_min, entropy_p10, entropy_p50, entropy_p90,
                entropy_max, logp_mean, std::log2(eps), frac_above, significant_per_row);
  return buf;
}

}  // namespace grpo::bench
