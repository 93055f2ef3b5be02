// AVX-512 stage kernels (xsimd batches for the arithmetic, raw intrinsics for
// masks, f16/bf16 conversion, scalef and fpclass). The only stage file compiled
// with -mavx512*; reached only after dispatch.cpp has checked the CPU. Tails
// (n not a multiple of 16) use masked loads and stores, so nothing outside
// [0, n) is ever touched (masked-off lanes do not fault).
//
// x = fl(z * scale) is rounded before max is subtracted (a mul and a sub, not
// one fma) so that it is the very x the drivers use for the chosen token: the
// max entry then gives exactly e^0 = 1, S >= 1, and logp = x_y - LSE <= 0.
// GCC contracts a plain vector mul + sub into an fma (-ffp-contract=fast is its
// default), hence round_mul(): embedded rounding forces a separate vmulps.
#include <immintrin.h>

#include <limits>

#include <xsimd/xsimd.hpp>

#include "kernels/bf16_avx512.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

using Batch = xsimd::batch<float, xsimd::avx512bw>;
constexpr std::int64_t kLanes = Batch::size;  // 16 f32 per zmm
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

__mmask16 tail_mask(std::int64_t count) { return static_cast<__mmask16>((1U << count) - 1U); }

// fl(a * b), never fused with a following add or sub.
Batch round_mul(Batch a, Batch b) {
  return Batch(_mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Sixteen elements at p + i as f32 (exact for every Elem).
template <Elem T>
Batch load(const void* p, std::int64_t i) {
  if constexpr (T == Elem::f32) {
    return Batch::load_unaligned(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(p) + i));
    if constexpr (T == Elem::bf16) return Batch(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    return Batch(_mm512_cvtph_ps(h));
  }
}

// The first count (< 16) elements at p + i; the other lanes hold fill.
template <Elem T>
Batch load_tail(const void* p, std::int64_t i, std::int64_t count, float fill) {
  const __mmask16 k = tail_mask(count);
  const __m512 f = _mm512_set1_ps(fill);
  if constexpr (T == Elem::f32) {
    return Batch(_mm512_mask_loadu_ps(f, k, static_cast<const float*>(p) + i));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const std::uint16_t*>(p) + i);
    if constexpr (T == Elem::bf16) {
      return Batch(_mm512_mask_mov_ps(f, k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))));
    }
    return Batch(_mm512_mask_mov_ps(f, k, _mm512_cvtph_ps(h)));
  }
}

// f32 -> bf16 (AVX-512F/BW only, no AVX512_BF16), NaN kept NaN; bit for bit
// the scalar float_to_bf16.
__m256i to_bf16(Batch v) { return float_to_bf16x16<Bf16Nan::quiet>(v); }

template <Elem T>
void store(void* p, std::int64_t i, Batch v) {
  if constexpr (T == Elem::f32) {
    v.store_unaligned(static_cast<float*>(p) + i);
  } else {
    const __m256i h = T == Elem::bf16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(p) + i), h);
  }
}

template <Elem T>
void store_tail(void* p, std::int64_t i, std::int64_t count, Batch v) {
  const __mmask16 k = tail_mask(count);
  if constexpr (T == Elem::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, k, v);
  } else {
    const __m256i h = T == Elem::bf16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(p) + i, k, h);
  }
}

// e^x for x <= ~0 (valid up to 88.7, where it overflows to +inf). Cody-Waite:
// x = n ln2 + r, |r| <= ln2/2, e^x = 2^n e^r. e^r is a degree-6 polynomial
// with c0 = c1 = 1 exact (so e^0 == 1 exactly) and c2..c6 a near-minimax fit
// of (e^r - 1 - r) / r^2 (interpolation at Chebyshev nodes): truncation error
// 1.0e-8 = 0.085 ulp; measured total error <= 0.95 ulp over every float in
// [-88, 0] (tests/test_stage_kernels.cpp checks <= 2 ulp on a sample).
// Lanes with x < ln(FLT_MIN) (including -inf) return exactly 0 with keep
// cleared, so callers can skip them in 0 * -inf products; NaN propagates.
Batch exp_nonpos(Batch x, __mmask16& keep) {
  const Batch log2e(1.44269504F);
  const Batch ln2_hi(0.693145751953125F);  // 0x3f317200: 15 significant bits, so n * ln2_hi is exact
  const Batch ln2_lo(1.42860677e-6F);      // ln 2 - ln2_hi
  const Batch n(_mm512_roundscale_ps(x * log2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // vfnmadd directly: xsimd 8.1's fnma negates first, one more instruction.
  Batch r(_mm512_fnmadd_ps(n, ln2_hi, x));
  r = Batch(_mm512_fnmadd_ps(n, ln2_lo, r));
  Batch p(1.39261759e-3F);
  p = xsimd::fma(p, r, Batch(8.36317334e-3F));
  p = xsimd::fma(p, r, Batch(4.16665562e-2F));
  p = xsimd::fma(p, r, Batch(1.66665778e-1F));
  p = xsimd::fma(p, r, Batch(0.5F));
  p = xsimd::fma(p, r, Batch(1.0F));
  p = xsimd::fma(p, r, Batch(1.0F));
  // -87.33654 = ln(FLT_MIN): below it the result would be subnormal; flushing
  // loses < 1.2e-38 per term against sums >= 1. NLT_UQ keeps NaN lanes.
  keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654F), _CMP_NLT_UQ);
  return Batch(_mm512_maskz_scalef_ps(keep, p, n));
}

// vfpclassps categories (Intel SDM): 0x01 QNaN, 0x08 +inf, 0x10 -inf, 0x80 SNaN.
constexpr int kClassNonFinite = 0x01 | 0x08 | 0x10 | 0x80;
constexpr int kClassNanOrPosInf = 0x01 | 0x08 | 0x80;
constexpr int kClassNan = 0x01 | 0x80;
// Elements scanned between early-exit checks: 64 vectors, long enough that
// the check costs nothing, short enough to stop soon after a bad value.
constexpr std::int64_t kScanBlock = 64 * kLanes;

// True when no element of data[begin, n) is in kClasses.
template <Elem T, int kClasses>
bool scan_clean(const void* data, std::int64_t begin, std::int64_t n) {
  std::int64_t i = begin;
  while (i + kLanes <= n) {
    const std::int64_t block_end = i + kScanBlock < n ? i + kScanBlock : n;
    __mmask16 bad = 0;
    for (; i + kLanes <= block_end; i += kLanes) bad |= _mm512_fpclass_ps_mask(load<T>(data, i), kClasses);
    if (bad != 0) return false;
  }
  if (i < n) return _mm512_mask_fpclass_ps_mask(tail_mask(n - i), load_tail<T>(data, i, n - i, 0.0F), kClasses) == 0;
  return true;
}

template <Elem T>
void prefetch(const void* p, std::int64_t i) {
  constexpr std::int64_t kSize = T == Elem::f32 ? 4 : 2;
  _mm_prefetch(static_cast<const char*>(p) + i * kSize, _MM_HINT_T0);
}

// Statistics of z[begin, end) * scale: a max pass, then an exp pass over the
// same (now L1-resident) segment. Tail lanes load as -inf and drop out. The
// exp pass prefetches the next segment (up to row_end) so that its DRAM
// traffic overlaps this segment's arithmetic instead of following it.
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
  st.max = _mm512_reduce_max_ps(xsimd::max(m0, m1));
  if (st.max == kNegInf) {
    // Every entry -inf (S = D = 0, and no -inf - -inf), unless vmaxps dropped
    // a NaN on the way: rare, so checked only here, off the hot path.
    if (!scan_clean<T, kClassNan>(z, begin, end)) st = {kNaN, kNaN, kNaN};
    return st;
  }

  const Batch vmax(st.max);
  Batch sum(0.0F);
  Batch dot(0.0F);
  __mmask16 keep;
  const std::int64_t next_end = row_end - kSegment;  // prefetch while i + kSegment < row_end
  for (i = begin; i + kLanes <= end; i += kLanes) {
    if (i < next_end) prefetch<T>(z, i + kSegment);
    const Batch d = round_mul(load<T>(z, i), vscale) - vmax;
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = Batch(_mm512_mask3_fmadd_ps(e, d, dot, keep));  // flushed lanes (d = -inf) add nothing
  }
  if (i < end) {
    const Batch d = round_mul(load_tail<T>(z, i, end - i, kNegInf), vscale) - vmax;
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = Batch(_mm512_mask3_fmadd_ps(e, d, dot, keep));
  }
  st.sum = _mm512_reduce_add_ps(sum);
  st.dot = _mm512_reduce_add_ps(dot);
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

RowStats row_stats_avx512(const void* z, Elem z_type, std::int64_t n, float scale) {
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
  st.max = _mm512_reduce_max_ps(m);
  // All -inf: store u = -inf (p = 0) rather than -inf - -inf = NaN.
  const Batch vmax(st.max == kNegInf ? 0.0F : st.max);
  Batch sum(0.0F);
  Batch dot(0.0F);
  __mmask16 keep;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Batch d = round_mul(load<Elem::f32>(z, i), vscale) - vmax;
    store<Out>(out, i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = Batch(_mm512_mask3_fmadd_ps(e, d, dot, keep));
  }
  if (i < n) {
    const Batch d = round_mul(load_tail<Elem::f32>(z, i, n - i, kNegInf), vscale) - vmax;
    store_tail<Out>(out, i, n - i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = Batch(_mm512_mask3_fmadd_ps(e, d, dot, keep));
  }
  st.sum = _mm512_reduce_add_ps(sum);  // 0 when every u is -inf
  st.dot = _mm512_reduce_add_ps(dot);
  return st;
}

RowStats row_stats_store_avx512(const float* z, std::int64_t n, float scale, void* out, Elem out_type) {
  return out_type == Elem::f32 ? row_stats_store_typed<Elem::f32>(z, n, scale, out)
                               : row_stats_store_typed<Elem::f16>(z, n, scale, out);
}

// The per-row constants of a dlogits row (see StageKernels::dlogits_row and
// dlogits_entropy_row).
struct DlogitsRow {
  Batch scale, shift, lse, a;
  Batch b, shift_from_mean;  // entropy term only
};

// g = a * (onehot - p) [- b * p * (x - mean)], p = exp(in * in_scale + in_shift
// - lse), for 16 lanes; hot has the target's lane set, if the target falls in
// this vector.
template <bool kEntropy>
Batch dlogits_lanes(Batch in, const DlogitsRow& c, __mmask16 hot) {
  __mmask16 keep;
  const Batch p = exp_nonpos(xsimd::fma(in, c.scale, c.shift) - c.lse, keep);
  // Rounded before any dbias add, so dbias receives exactly the f32 g.
  const Batch g = round_mul(Batch(_mm512_maskz_mov_ps(hot, _mm512_set1_ps(1.0F))) - p, c.a);
  if constexpr (!kEntropy) {
    return g;
  } else {
    // Flushed lanes (p = 0, x possibly -inf) keep g: no 0 * -inf.
    const Batch centered = xsimd::fma(in, c.scale, c.shift_from_mean);
    return Batch(_mm512_mask_mov_ps(g, keep, _mm512_fnmadd_ps(round_mul(c.b, p), centered, g)));
  }
}

__mmask16 hot_mask(std::int64_t target, std::int64_t i) {
  const auto lane = static_cast<std::uint64_t>(target - i);  // negative targets wrap to huge
  return lane < static_cast<std::uint64_t>(kLanes) ? static_cast<__mmask16>(1U << lane) : __mmask16{0};
}

template <Elem In, Elem Out, bool kEntropy>
void dlogits_typed(const void* in, std::int64_t n, const DlogitsRow& c, std::int64_t target, void* out, float* dbias) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    // Load, then store the same lanes: exact aliasing of in and out is safe.
    const Batch g = dlogits_lanes<kEntropy>(load<In>(in, i), c, hot_mask(target, i));
    store<Out>(out, i, g);
    if (dbias != nullptr) (Batch::load_unaligned(dbias + i) + g).store_unaligned(dbias + i);
  }
  if (i < n) {
    const Batch g = dlogits_lanes<kEntropy>(load_tail<In>(in, i, n - i, 0.0F), c, hot_mask(target, i));
    store_tail<Out>(out, i, n - i, g);
    if (dbias != nullptr) {
      const __mmask16 k = tail_mask(n - i);
      _mm512_mask_storeu_ps(dbias + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, dbias + i), g));
    }
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

void dlogits_row_avx512(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                        float a, std::int64_t target, void* out, Elem out_type, float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(0.0F), Batch(0.0F)};
  dlogits_any<false>(in, in_type, n, c, target, out, out_type, dbias);
}

void dlogits_entropy_row_avx512(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                                float a, float b, float mean, std::int64_t target, void* out, Elem out_type,
                                float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(b), Batch(in_shift - mean)};
  dlogits_any<true>(in, in_type, n, c, target, out, out_type, dbias);
}

// tanh for 16 lanes (Cephes' tanhf scheme): |y| < 0.625 an odd polynomial
// y + y^3 P(y^2); above, sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) <= 0.287,
// so 1 - e does not cancel; e flushes to 0 (tanh = +-1) beyond |y| ~ 43.7.
Batch tanh_lanes(Batch y) {
  const __m512 magnitude_bits = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const Batch ay(_mm512_and_ps(y, magnitude_bits));
  const Batch y2 = y * y;
  Batch poly(-5.70498872745e-3F);
  poly = xsimd::fma(poly, y2, Batch(2.06390887954e-2F));
  poly = xsimd::fma(poly, y2, Batch(-5.37397155531e-2F));
  poly = xsimd::fma(poly, y2, Batch(1.33314422036e-1F));
  poly = xsimd::fma(poly, y2, Batch(-3.33332819422e-1F));
  const Batch small = xsimd::fma(poly * y2, y, y);
  __mmask16 keep;
  const Batch e = exp_nonpos(Batch(-2.0F) * ay, keep);
  const Batch large_abs = (Batch(1.0F) - e) / (Batch(1.0F) + e);
  // Copy y's sign onto |tanh|.
  const Batch large(_mm512_or_ps(large_abs, _mm512_andnot_ps(magnitude_bits, y)));
  return Batch(_mm512_mask_mov_ps(large, _mm512_cmp_ps_mask(ay, _mm512_set1_ps(0.625F), _CMP_LT_OQ), small));
}

template <Elem T>
void softcap_typed(const void* z, std::int64_t n, float scale, float cap, float* out) {
  const Batch k(scale / cap);
  const Batch c(cap);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, c * tanh_lanes(load<T>(z, i) * k));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, c * tanh_lanes(load_tail<T>(z, i, n - i, 0.0F) * k));
}

void softcap_avx512(const void* z, Elem z_type, std::int64_t n, float scale, float cap, float* out) {
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
    const Batch g = dlogits_lanes<true>(v, c, hot_mask(target, i));
    const Batch t = xsimd::fma(v, c.scale, c.shift) * cap_k;
    return g * (cap_s * Batch(_mm512_fnmadd_ps(t, t, _mm512_set1_ps(1.0F))));
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
    if (dbias != nullptr) {
      const __mmask16 k = tail_mask(n - i);
      _mm512_mask_storeu_ps(dbias + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, dbias + i), g));
    }
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

void dlogits_softcap_row_avx512(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
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

template <int kClasses>
bool scan_clean_any(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return scan_clean<Elem::f32, kClasses>(data, 0, n);
    case Elem::bf16: return scan_clean<Elem::bf16, kClasses>(data, 0, n);
    case Elem::f16: return scan_clean<Elem::f16, kClasses>(data, 0, n);
  }
  return false;
}

bool all_finite_avx512(const void* data, Elem type, std::int64_t n) {
  return scan_clean_any<kClassNonFinite>(data, type, n);
}

bool no_nan_or_pos_inf_avx512(const void* data, Elem type, std::int64_t n) {
  return scan_clean_any<kClassNanOrPosInf>(data, type, n);
}

template <Elem T>
float max_abs_of(const void* data, std::int64_t n) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 x = load<T>(data, i);
    bad |= _mm512_fpclass_ps_mask(x, kClassNonFinite);
    m = _mm512_max_ps(m, _mm512_and_ps(x, magnitude));
  }
  if (i < n) {
    const __m512 x = load_tail<T>(data, i, n - i, 0.0F);
    bad |= _mm512_fpclass_ps_mask(x, kClassNonFinite);
    m = _mm512_max_ps(m, _mm512_and_ps(x, magnitude));
  }
  return bad != 0 ? std::numeric_limits<float>::infinity() : _mm512_reduce_max_ps(m);
}

float max_abs_avx512(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return max_abs_of<Elem::f32>(data, n);
    case Elem::bf16: return max_abs_of<Elem::bf16>(data, n);
    case Elem::f16: return max_abs_of<Elem::f16>(data, n);
  }
  return std::numeric_limits<float>::infinity();
}

template <Elem T>
float mark_kept_of(const void* g, std::int64_t n, float threshold, std::uint8_t* kept) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 t = _mm512_set1_ps(threshold);
  const __m128i one = _mm_set1_epi8(1);
  __m512 below = _mm512_setzero_ps();  // lane l: |g_v| below the threshold, v = l mod 16
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 x = _mm512_and_ps(load<T>(g, i), magnitude);
    const __mmask16 m = _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ);
    if (m != 0) _mm_mask_storeu_epi8(kept + i, m, one);
    below = _mm512_mask_add_ps(below, static_cast<__mmask16>(~m), below, x);
  }
  if (i < n) {
    const __mmask16 in = tail_mask(n - i);
    const __m512 x = _mm512_and_ps(load_tail<T>(g, i, n - i, 0.0F), magnitude);
    const __mmask16 m = _mm512_mask_cmp_ps_mask(in, x, t, _CMP_GE_OQ);
    if (m != 0) _mm_mask_storeu_epi8(kept + i, m, one);
    below = _mm512_mask_add_ps(below, static_cast<__mmask16>(in & ~m), below, x);
  }
  alignas(64) float lane[kLanes];
  _mm512_store_ps(lane, below);
  float sum = 0.0F;
  for (const float l : lane) sum += l;
  return sum;
}

float mark_kept_avx512(const void* g, Elem type, std::int64_t n, float threshold, std::uint8_t* kept) {
  if (type == Elem::f32) return mark_kept_of<Elem::f32>(g, n, threshold, kept);
  return mark_kept_of<Elem::bf16>(g, n, threshold, kept);
}

template <Elem T>
void add_row_of(const float* in, void* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<T>(out, i, load<T>(out, i) + load<Elem::f32>(in, i));
  if (i < n) store_tail<T>(out, i, n - i, load_tail<T>(out, i, n - i, 0.0F) + load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

void add_row_avx512(const float* in, void* out, Elem out_type, std::int64_t n) {
  if (out_type == Elem::f32) {
    add_row_of<Elem::f32>(in, out, n);
  } else {
    add_row_of<Elem::bf16>(in, out, n);
  }
}

void f32_to_bf16_avx512(const float* in, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::bf16>(out, i, load<Elem::f32>(in, i));
  if (i < n) store_tail<Elem::bf16>(out, i, n - i, load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

void bf16_to_f32_avx512(const std::uint16_t* in, float* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, load<Elem::bf16>(in, i));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, load_tail<Elem::bf16>(in, i, n - i, 0.0F));
}

}  // namespace

namespace detail {

// Only called by dispatch.cpp after __builtin_cpu_supports said yes.
const StageKernels& avx512_table() {
  static constexpr StageKernels k{"avx512",
                                  row_stats_avx512,
                                  row_stats_store_avx512,
                                  dlogits_row_avx512,
                                  dlogits_entropy_row_avx512,
                                  softcap_avx512,
                                  dlogits_softcap_row_avx512,
                                  mark_kept_avx512,
                                  add_row_avx512,
                                  all_finite_avx512,
                                  no_nan_or_pos_inf_avx512,
                                  max_abs_avx512,
                                  f32_to_bf16_avx512,
                                  bf16_to_f32_avx512};
  return k;
}

}  // namespace detail
}  // namespace grpo::kernels
