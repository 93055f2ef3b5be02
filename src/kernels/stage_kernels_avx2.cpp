// AVX2 stage kernels: the AVX-512 kernels' algorithms in 8-lane ymm batches
// (xsimd for the arithmetic, raw intrinsics for blends, conversions and the
// integer work), for x86-64 CPUs with AVX2, FMA and F16C but no AVX-512 (Zen 1-3,
// Haswell to Comet Lake). Compiled with -mavx2 -mfma -mf16c -ffp-contract=off
// and reached only after dispatch.cpp has checked the CPU.
//
// Differences from the AVX-512 file, and why:
// - No masked loads or stores for 16-bit elements, so a row's last n mod 8
//   elements go through an 8-element stack buffer: nothing outside [0, n) is
//   read or written.
// - No embedded rounding: -ffp-contract=off keeps a written mul and sub apart
//   (x = fl(z * scale) must be the very x the drivers use), and every fused
//   multiply-add is an explicit fma.
// - No vscalefps: 2^n is built in the exponent field, in two factors so that
//   n in [-126, 128] (the whole range exp_nonpos is valid on) never leaves
//   the normal range before the final, correctly rounded product.
// - mark_kept keeps the 16 lane sums of the other paths (two ymm halves per
//   16 elements), so its result is the same bits on every path.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "kernels/bf16_avx2.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

using Batch = xsimd::batch<float, xsimd::fma3<xsimd::avx2>>;
constexpr std::int64_t kLanes = Batch::size;  // 8 f32 per ymm
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Eight elements at p + i as f32 (exact for every Elem).
template <Elem T>
Batch load(const void* p, std::int64_t i) {
  if constexpr (T == Elem::f32) {
    return Batch::load_unaligned(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(p) + i));
    if constexpr (T == Elem::bf16) return Batch(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    return Batch(_mm256_cvtph_ps(h));
  }
}

// The first count (< 8) elements at p + i; the other lanes hold fill. Through
// a stack buffer: AVX2 has no masked 16-bit load.
template <Elem T>
Batch load_tail(const void* p, std::int64_t i, std::int64_t count, float fill) {
  constexpr std::size_t kSize = T == Elem::f32 ? 4 : 2;
  alignas(32) std::array<std::uint16_t, 2 * kLanes> raw{};
  std::memcpy(raw.data(), static_cast<const char*>(p) + i * static_cast<std::int64_t>(kSize),
              static_cast<std::size_t>(count) * kSize);
  const Batch v = load<T>(raw.data(), 0);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
  return Batch(_mm256_blendv_ps(_mm256_set1_ps(fill), v, in));
}

// f32 -> bf16, round to nearest even by integer arithmetic, NaN kept NaN; bit
// for bit the scalar float_to_bf16.
__m128i to_bf16(Batch v) {
  const __m256i r = float_to_bf16x8_epi32<Bf16Nan::quiet>(v);
  // Every lane is now <= 0xffff, so the unsigned saturating pack is exact; it
  // packs within 128-bit halves, and the permute gathers halves 0 and 2.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

__m128i to_f16(Batch v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

template <Elem T>
void store(void* p, std::int64_t i, Batch v) {
  if constexpr (T == Elem::f32) {
    v.store_unaligned(static_cast<float*>(p) + i);
  } else {
    const __m128i h = T == Elem::bf16 ? to_bf16(v) : to_f16(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(p) + i), h);
  }
}

template <Elem T>
void store_tail(void* p, std::int64_t i, std::int64_t count, Batch v) {
  constexpr std::size_t kSize = T == Elem::f32 ? 4 : 2;
  alignas(32) std::array<std::uint16_t, 2 * kLanes> raw{};
  store<T>(raw.data(), 0, v);
  std::memcpy(static_cast<char*>(p) + i * static_cast<std::int64_t>(kSize), raw.data(),
              static_cast<std::size_t>(count) * kSize);
}

float reduce_max(Batch v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

float reduce_add(Batch v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2^n for integral n in [-126, 127], n given as a float.
__m256 pow2(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

// e^x for x <= ~0 (valid up to 88.7, where it overflows to +inf): the AVX-512
// path's Cody-Waite reduction and degree-6 polynomial (see there), with
// c0 = c1 = 1 exact so e^0 == 1 exactly. Lanes with x < ln(FLT_MIN) (including
// -inf) return exactly 0 with keep cleared (all bits zero), so callers can
// skip them in 0 * -inf products; NaN propagates (keep set).
Batch exp_nonpos(Batch x, __m256& keep) {
  const Batch log2e(1.44269504F);
  const Batch ln2_hi(0.693145751953125F);  // 0x3f317200: 15 significant bits, so n * ln2_hi is exact
  const Batch ln2_lo(1.42860677e-6F);      // ln 2 - ln2_hi
  const Batch n(_mm256_round_ps(x * log2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  Batch r(_mm256_fnmadd_ps(n, ln2_hi, x));
  r = Batch(_mm256_fnmadd_ps(n, ln2_lo, r));
  Batch p(1.39261759e-3F);
  p = xsimd::fma(p, r, Batch(8.36317334e-3F));
  p = xsimd::fma(p, r, Batch(4.16665562e-2F));
  p = xsimd::fma(p, r, Batch(1.66665778e-1F));
  p = xsimd::fma(p, r, Batch(0.5F));
  p = xsimd::fma(p, r, Batch(1.0F));
  p = xsimd::fma(p, r, Batch(1.0F));
  // -87.33654 = ln(FLT_MIN): below it the result would be subnormal; flushing
  // loses < 1.2e-38 per term against sums >= 1. NLT_UQ keeps NaN lanes.
  keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654F), _CMP_NLT_UQ);
  // p * 2^n as (p * 2^h) * 2^(n - h), h = floor(n / 2): both factors are
  // normal for n in [-126, 128] and p * 2^h is exact, so the one rounding is
  // the last product's (vscalefps rounds once too). Flushed lanes (n possibly
  // -inf, converted to garbage) are zeroed by the mask.
  const __m256 half = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5F)));
  const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_ps(n, half)));
  return Batch(_mm256_and_ps(scaled, keep));
}

__m256 magnitude_mask() { return _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)); }

// All ones where x is +-inf or NaN: |x| is not less than inf, or unordered.
__m256 non_finite(__m256 x) {
  return _mm256_cmp_ps(_mm256_and_ps(x, magnitude_mask()), _mm256_set1_ps(kInf), _CMP_NLT_UQ);
}
// All ones where x is NaN or +inf.
__m256 nan_or_pos_inf(__m256 x) { return _mm256_cmp_ps(x, _mm256_set1_ps(kInf), _CMP_NLT_UQ); }
// All ones where x is NaN.
__m256 is_nan(__m256 x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }

// Elements scanned between early-exit checks: 64 vectors, long enough that
// the check costs nothing, short enough to stop soon after a bad value.
constexpr std::int64_t kScanBlock = 64 * kLanes;

// True when Bad(x) holds for no element of data[begin, n).
template <Elem T, __m256 (*Bad)(__m256)>
bool scan_clean(const void* data, std::int64_t begin, std::int64_t n) {
  std::int64_t i = begin;
  while (i + kLanes <= n) {
    const std::int64_t block_end = i + kScanBlock < n ? i + kScanBlock : n;
    __m256 bad = _mm256_setzero_ps();
    for (; i + kLanes <= block_end; i += kLanes) bad = _mm256_or_ps(bad, Bad(load<T>(data, i)));
    if (_mm256_movemask_ps(bad) != 0) return false;
  }
  if (i < n) return _mm256_movemask_ps(Bad(load_tail<T>(data, i, n - i, 0.0F))) == 0;
  return true;
}

template <Elem T>
void prefetch(const void* p, std::int64_t i) {
  constexpr std::int64_t kSize = T == Elem::f32 ? 4 : 2;
  _mm_prefetch(static_cast<const char*>(p) + i * kSize, _MM_HINT_T0);
}

// dot += e * d where keep is set: flushed lanes (e = 0, d possibly -inf)
// contribute d = 0, never 0 * -inf.
Batch add_dot(Batch dot, Batch e, Batch d, __m256 keep) { return xsimd::fma(e, Batch(_mm256_and_ps(d, keep)), dot); }

// Statistics of z[begin, end) * scale: a max pass, then an exp pass over the
// same (now L1-resident) segment, prefetching the next segment (up to
// row_end). Tail lanes load as -inf and drop out.
template <Elem T>
RowStats segment_stats(const void* z, std::int64_t begin, std::int64_t end, std::int64_t row_end, float scale) {
  const Batch vscale(scale);
  // Two max chains hide the max latency; the order does not change the result.
  Batch m0(kNegInf);
  Batch m1(kNegInf);
  std::int64_t i = begin;
  for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
    m0 = xsimd::max(m0, load<T>(z, i) * vscale);
    m1 = xsimd::max(m1, load<T>(z, i + kLanes) * vscale);
  }
  for (; i + kLanes <= end; i += kLanes) m0 = xsimd::max(m0, load<T>(z, i) * vscale);
  if (i < end) m1 = xsimd::max(m1, load_tail<T>(z, i, end - i, kNegInf) * vscale);
  RowStats st;
  st.max = reduce_max(xsimd::max(m0, m1));
  if (st.max == kNegInf) {
    // Every entry -inf (S = D = 0, and no -inf - -inf), unless vmaxps dropped
    // a NaN on the way: rare, so checked only here, off the hot path.
    if (!scan_clean<T, is_nan>(z, begin, end)) st = {kNaN, kNaN, kNaN};
    return st;
  }

  const Batch vmax(st.max);
  Batch sum(0.0F);
  Batch dot(0.0F);
  __m256 keep;
  const std::int64_t next_end = row_end - kSegment;  // prefetch while i + kSegment < row_end
  for (i = begin; i + kLanes <= end; i += kLanes) {
    if (i < next_end) prefetch<T>(z, i + kSegment);
    const Batch d = load<T>(z, i) * vscale - vmax;
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  if (i < end) {
    const Batch d = load_tail<T>(z, i, end - i, kNegInf) * vscale - vmax;
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  st.sum = reduce_add(sum);
  st.dot = reduce_add(dot);
  return st;
}

template <Elem T>
RowStats row_stats_typed(const void* z, std::int64_t n, float scale) {
  RowStats st;
  for (std::int64_t begin = 0; begin < n; begin += kSegment) {
    const std::int64_t end = begin + kSegment < n ? begin + kSegment : n;
    st = merge(st, segment_stats<T>(z, begin, end, n, scale));
  }
  return st;
}

RowStats row_stats_avx2(const void* z, Elem z_type, std::int64_t n, float scale) {
  return z_type == Elem::f32 ? row_stats_typed<Elem::f32>(z, n, scale) : row_stats_typed<Elem::bf16>(z, n, scale);
}

template <Elem Out>
RowStats row_stats_store_typed(const float* z, std::int64_t n, float scale, void* out) {
  // Not segmented: every stored u needs the max of the whole (cache-resident) row.
  const Batch vscale(scale);
  Batch m(kNegInf);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = xsimd::max(m, load<Elem::f32>(z, i) * vscale);
  if (i < n) m = xsimd::max(m, load_tail<Elem::f32>(z, i, n - i, kNegInf) * vscale);
  RowStats st;
  st.max = reduce_max(m);
  // All -inf: store u = -inf (p = 0) rather than -inf - -inf = NaN.
  const Batch vmax(st.max == kNegInf ? 0.0F : st.max);
  Batch sum(0.0F);
  Batch dot(0.0F);
  __m256 keep;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Batch d = load<Elem::f32>(z, i) * vscale - vmax;
    store<Out>(out, i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  if (i < n) {
    const Batch d = load_tail<Elem::f32>(z, i, n - i, kNegInf) * vscale - vmax;
    store_tail<Out>(out, i, n - i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  st.sum = reduce_add(sum);  // 0 when every u is -inf
  st.dot = reduce_add(dot);
  return st;
}

RowStats row_stats_store_avx2(const float* z, std::int64_t n, float scale, void* out, Elem out_type) {
  return out_type == Elem::f32 ? row_stats_store_typed<Elem::f32>(z, n, scale, out)
                               : row_stats_store_typed<Elem::f16>(z, n, scale, out);
}

// The per-row constants of a dlogits row (see StageKernels::dlogits_row and
// dlogits_entropy_row).
struct DlogitsRow {
  Batch scale, shift, lse, a;
  Batch b, shift_from_mean;  // entropy term only
};

// 1.0 in the target's lane when the target falls in [i, i + 8), else all 0.
Batch onehot(std::int64_t target, std::int64_t i) {
  const auto lane = static_cast<std::uint64_t>(target - i);  // negative targets wrap to huge
  const int hot = lane < static_cast<std::uint64_t>(kLanes) ? static_cast<int>(lane) : -1;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 is_hot = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, _mm256_set1_epi32(hot)));
  return Batch(_mm256_and_ps(is_hot, _mm256_set1_ps(1.0F)));
}

// g = a * (onehot - p) [- b * p * (x - mean)], p = exp(in * in_scale + in_shift - lse).
template <bool kEntropy>
Batch dlogits_lanes(Batch in, const DlogitsRow& c, Batch hot) {
  __m256 keep;
  const Batch p = exp_nonpos(xsimd::fma(in, c.scale, c.shift) - c.lse, keep);
  // Rounded before any dbias add, so dbias receives exactly the f32 g.
  const Batch g = (hot - p) * c.a;
  if constexpr (!kEntropy) {
    return g;
  } else {
    // Flushed lanes (p = 0, x possibly -inf) keep g: no 0 * -inf.
    const Batch centered = xsimd::fma(in, c.scale, c.shift_from_mean);
    return Batch(_mm256_blendv_ps(g, _mm256_fnmadd_ps(c.b * p, centered, g), keep));
  }
}

template <Elem In, Elem Out, bool kEntropy>
void dlogits_typed(const void* in, std::int64_t n, const DlogitsRow& c, std::int64_t target, void* out, float* dbias) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    // Load, then store the same lanes: exact aliasing of in and out is safe.
    const Batch g = dlogits_lanes<kEntropy>(load<In>(in, i), c, onehot(target, i));
    store<Out>(out, i, g);
    if (dbias != nullptr) (Batch::load_unaligned(dbias + i) + g).store_unaligned(dbias + i);
  }
  if (i < n) {
    const Batch g = dlogits_lanes<kEntropy>(load_tail<In>(in, i, n - i, 0.0F), c, onehot(target, i));
    store_tail<Out>(out, i, n - i, g);
    if (dbias != nullptr) store_tail<Elem::f32>(dbias, i, n - i, load_tail<Elem::f32>(dbias, i, n - i, 0.0F) + g);
  }
}

template <bool kEntropy, Elem In>
void dlogits_in(const void* in, std::int64_t n, const DlogitsRow& c, std::int64_t target, void* out, Elem out_type,
                float* dbias) {
  if (out_type == Elem::f32) {
    dlogits_typed<In, Elem::f32, kEntropy>(in, n, c, target, out, dbias);
  } else {
    dlogits_typed<In, Elem::bf16, kEntropy>(in, n, c, target, out, dbias);
  }
}

template <bool kEntropy>
void dlogits_any(const void* in, Elem in_type, std::int64_t n, const DlogitsRow& c, std::int64_t target, void* out,
                 Elem out_type, float* dbias) {
  switch (in_type) {
    case Elem::f32: return dlogits_in<kEntropy, Elem::f32>(in, n, c, target, out, out_type, dbias);
    case Elem::bf16: return dlogits_in<kEntropy, Elem::bf16>(in, n, c, target, out, out_type, dbias);
    case Elem::f16: return dlogits_in<kEntropy, Elem::f16>(in, n, c, target, out, out_type, dbias);
  }
}

void dlogits_row_avx2(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse, float a,
                      std::int64_t target, void* out, Elem out_type, float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(0.0F), Batch(0.0F)};
  dlogits_any<false>(in, in_type, n, c, target, out, out_type, dbias);
}

void dlogits_entropy_row_avx2(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                              float a, float b, float mean, std::int64_t target, void* out, Elem out_type,
                              float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(b), Batch(in_shift - mean)};
  dlogits_any<true>(in, in_type, n, c, target, out, out_type, dbias);
}

// tanh for 8 lanes, the AVX-512 path's scheme (Cephes' tanhf): |y| < 0.625 an
// odd polynomial, above sign(y) (1 - e) / (1 + e) with e = e^(-2|y|).
Batch tanh_lanes(Batch y) {
  const Batch ay(_mm256_and_ps(y, magnitude_mask()));
  const Batch y2 = y * y;
  Batch poly(-5.70498872745e-3F);
  poly = xsimd::fma(poly, y2, Batch(2.06390887954e-2F));
  poly = xsimd::fma(poly, y2, Batch(-5.37397155531e-2F));
  poly = xsimd::fma(poly, y2, Batch(1.33314422036e-1F));
  poly = xsimd::fma(poly, y2, Batch(-3.33332819422e-1F));
  const Batch small = xsimd::fma(poly * y2, y, y);
  __m256 keep;
  const Batch e = exp_nonpos(Batch(-2.0F) * ay, keep);
  const Batch large_abs = (Batch(1.0F) - e) / (Batch(1.0F) + e);
  // Copy y's sign onto |tanh|.
  const Batch large(_mm256_or_ps(large_abs, _mm256_andnot_ps(magnitude_mask(), y)));
  return Batch(_mm256_blendv_ps(large, small, _mm256_cmp_ps(ay, _mm256_set1_ps(0.625F), _CMP_LT_OQ)));
}

template <Elem T>
void softcap_typed(const void* z, std::int64_t n, float scale, float cap, float* out) {
  const Batch k(scale / cap);
  const Batch c(cap);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, c * tanh_lanes(load<T>(z, i) * k));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, c * tanh_lanes(load_tail<T>(z, i, n - i, 0.0F) * k));
}

void softcap_avx2(const void* z, Elem z_type, std::int64_t n, float scale, float cap, float* out) {
  if (z_type == Elem::f32) {
    softcap_typed<Elem::f32>(z, n, scale, cap, out);
  } else {
    softcap_typed<Elem::bf16>(z, n, scale, cap, out);
  }
}

template <Elem In, Elem Out>
void dlogits_softcap_typed(const void* in, std::int64_t n, const DlogitsRow& c, Batch cap_k, Batch cap_s,
                           std::int64_t target, void* out, float* dbias) {
  // g (with the entropy term) times s (1 - t^2), t = x cap_k.
  auto lanes = [&](Batch v, std::int64_t i) {
    const Batch g = dlogits_lanes<true>(v, c, onehot(target, i));
    const Batch t = xsimd::fma(v, c.scale, c.shift) * cap_k;
    return g * (cap_s * Batch(_mm256_fnmadd_ps(t, t, _mm256_set1_ps(1.0F))));
  };
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch g = lanes(load<In>(in, i), i);
    store<Out>(out, i, g);
    if (dbias != nullptr) (Batch::load_unaligned(dbias + i) + g).store_unaligned(dbias + i);
  }
  if (i < n) {
    const Batch g = lanes(load_tail<In>(in, i, n - i, 0.0F), i);
    store_tail<Out>(out, i, n - i, g);
    if (dbias != nullptr) store_tail<Elem::f32>(dbias, i, n - i, load_tail<Elem::f32>(dbias, i, n - i, 0.0F) + g);
  }
}

template <Elem In>
void dlogits_softcap_in(const void* in, std::int64_t n, const DlogitsRow& c, Batch cap_k, Batch cap_s,
                        std::int64_t target, void* out, Elem out_type, float* dbias) {
  if (out_type == Elem::f32) {
    dlogits_softcap_typed<In, Elem::f32>(in, n, c, cap_k, cap_s, target, out, dbias);
  } else {
    dlogits_softcap_typed<In, Elem::bf16>(in, n, c, cap_k, cap_s, target, out, dbias);
  }
}

void dlogits_softcap_row_avx2(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                              float a, float b, float mean, float cap_k, float cap_s, std::int64_t target, void* out,
                              Elem out_type, float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(b), Batch(in_shift - mean)};
  switch (in_type) {
    case Elem::f32:
      return dlogits_softcap_in<Elem::f32>(in, n, c, Batch(cap_k), Batch(cap_s), target, out, out_type, dbias);
    case Elem::bf16:
      return dlogits_softcap_in<Elem::bf16>(in, n, c, Batch(cap_k), Batch(cap_s), target, out, out_type, dbias);
    case Elem::f16:
      return dlogits_softcap_in<Elem::f16>(in, n, c, Batch(cap_k), Batch(cap_s), target, out, out_type, dbias);
  }
}

template <__m256 (*Bad)(__m256)>
bool scan_clean_any(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return scan_clean<Elem::f32, Bad>(data, 0, n);
    case Elem::bf16: return scan_clean<Elem::bf16, Bad>(data, 0, n);
    case Elem::f16: return scan_clean<Elem::f16, Bad>(data, 0, n);
  }
  return false;
}

bool all_finite_avx2(const void* data, Elem type, std::int64_t n) { return scan_clean_any<non_finite>(data, type, n); }

bool no_nan_or_pos_inf_avx2(const void* data, Elem type, std::int64_t n) {
  return scan_clean_any<nan_or_pos_inf>(data, type, n);
}

template <Elem T>
float max_abs_of(const void* data, std::int64_t n) {
  __m256 m = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 x = load<T>(data, i);
    bad = _mm256_or_ps(bad, non_finite(x));
    m = _mm256_max_ps(m, _mm256_and_ps(x, magnitude_mask()));
  }
  if (i < n) {
    const __m256 x = load_tail<T>(data, i, n - i, 0.0F);
    bad = _mm256_or_ps(bad, non_finite(x));
    m = _mm256_max_ps(m, _mm256_and_ps(x, magnitude_mask()));
  }
  return _mm256_movemask_ps(bad) != 0 ? kInf : reduce_max(Batch(m));
}

float max_abs_avx2(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return max_abs_of<Elem::f32>(data, n);
    case Elem::bf16: return max_abs_of<Elem::bf16>(data, n);
    case Elem::f16: return max_abs_of<Elem::f16>(data, n);
  }
  return kInf;
}

// Sixteen lane sums (element v into lane v mod 16) as two ymm halves; the
// last n mod 16 elements are added lane by lane in the same order.
template <Elem T>
float mark_kept_of(const void* g, std::int64_t n, float threshold, std::uint8_t* kept) {
  const __m256 t = _mm256_set1_ps(threshold);
  __m256 below[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  std::int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    for (int h = 0; h < 2; ++h) {
      const __m256 x = _mm256_and_ps(load<T>(g, i + h * kLanes), magnitude_mask());
      const __m256 ge = _mm256_cmp_ps(x, t, _CMP_GE_OQ);
      for (int bits = _mm256_movemask_ps(ge); bits != 0; bits &= bits - 1)
        kept[i + h * kLanes + __builtin_ctz(bits)] = 1;
      below[h] = _mm256_add_ps(below[h], _mm256_andnot_ps(ge, x));
    }
  }
  alignas(32) std::array<float, 2 * kLanes> lane{};
  _mm256_store_ps(lane.data(), below[0]);
  _mm256_store_ps(lane.data() + kLanes, below[1]);
  for (; i < n; ++i) {
    const float x = std::fabs(T == Elem::f32 ? static_cast<const float*>(g)[i]
                                             : bf16_to_float(static_cast<const std::uint16_t*>(g)[i]));
    if (x >= threshold) {
      kept[i] = 1;
    } else {
      lane[static_cast<std::size_t>(i % (2 * kLanes))] += x;
    }
  }
  float sum = 0.0F;
  for (const float l : lane) sum += l;
  return sum;
}

float mark_kept_avx2(const void* g, Elem type, std::int64_t n, float threshold, std::uint8_t* kept) {
  if (type == Elem::f32) return mark_kept_of<Elem::f32>(g, n, threshold, kept);
  return mark_kept_of<Elem::bf16>(g, n, threshold, kept);
}

template <Elem T>
void add_row_of(const float* in, void* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<T>(out, i, load<T>(out, i) + load<Elem::f32>(in, i));
  if (i < n) store_tail<T>(out, i, n - i, load_tail<T>(out, i, n - i, 0.0F) + load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

void add_row_avx2(const float* in, void* out, Elem out_type, std::int64_t n) {
  if (out_type == Elem::f32) {
    add_row_of<Elem::f32>(in, out, n);
  } else {
    add_row_of<Elem::bf16>(in, out, n);
  }
}

void f32_to_bf16_avx2(const float* in, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::bf16>(out, i, load<Elem::f32>(in, i));
  if (i < n) store_tail<Elem::bf16>(out, i, n - i, load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

void bf16_to_f32_avx2(const std::uint16_t* in, float* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, load<Elem::bf16>(in, i));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, load_tail<Elem::bf16>(in, i, n - i, 0.0F));
}

}  // namespace

namespace detail {

// Only called by dispatch.cpp after __builtin_cpu_supports said yes.
const StageKernels& avx2_table() {
  static constexpr StageKernels k{"avx2",
                                  row_stats_avx2,
                                  row_stats_store_avx2,
                                  dlogits_row_avx2,
                                  dlogits_entropy_row_avx2,
                                  softcap_avx2,
                                  dlogits_softcap_row_avx2,
                                  mark_kept_avx2,
                                  add_row_avx2,
                                  all_finite_avx2,
                                  no_nan_or_pos_inf_avx2,
                                  max_abs_avx2,
                                  f32_to_bf16_avx2,
                                  bf16_to_f32_avx2};
  return k;
}

}  // namespace detail
}  // namespace grpo::kernels
