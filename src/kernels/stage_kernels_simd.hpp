// The SIMD stage kernels written once: the row statistics (online LSE), the
// dlogits rows (with the entropy term and the softcap), the softcap, the
// clean-value scans, the kept-column wrappers, the conversions and the
// table, over an ISA's primitives. Each ISA's file (stage_kernels_avx512.cpp,
// stage_kernels_avx2.cpp) defines those primitives in grpo::kernels' unnamed
// namespace and then includes this file, which adds the kernels to that
// namespace, compiled with the file's own flags (as Highway compiles one
// source once per target); the ISA's own algorithms (scan_clean, max_abs_of,
// mark_kept_of) stay in its file.
//
// The primitives (Keep: the ISA's per-lane flag, a vector or a mask register):
//   Batch, kLanes, kIsaName              the xsimd batch, its f32 lanes, the table's name
//   load<T>, load_tail<T>, store<T>, store_tail<T>   lanes of an Elem row; tails touch [0, n) only
//   reduce_max, reduce_add               a Batch to one float, in the ISA's fixed order
//   round_mul(a, b)                      fl(a * b), never fused with what follows
//   fnmadd(a, b, c)                      c - a b, one rounding
//   round_nearest(x)                     x to the nearest integer (ties even)
//   not_below(x, lo)                     Keep: x >= lo, or x NaN
//   scale_pow2(p, n, keep)               p 2^n where keep, else 0
//   add_dot(dot, e, d, keep)             dot + e d where keep, else dot
//   where_kept(keep, a, b)               a where keep, else b
//   onehot(target, i)                    1.0 in the target's lane of [i, i + kLanes), else 0
//   abs_of(y), with_sign_of(m, y)        |y|; m with y's sign bit
//   select_below(a, bound, x, y)         x where a < bound, else y
//   scan_clean<T, kBad>(data, begin, n)  no lane of data[begin, n) is kBad (kIsNan,
//                                        kNonFinite, kNanOrPosInf)
//   max_abs_of<T>                        StageKernels::max_abs for one Elem
//   mark_kept_of<T>                      mark_kept's marks for one Elem, and its kKeptLanes lane
//                                        sums (element v in lane v mod kKeptLanes)
//
// Every expression below is as both files wrote it before they shared it, so
// each ISA's results are its own bits as before (stage_kernels_avx2.cpp is
// compiled with -ffp-contract=off, where a written mul is its own rounding).
#pragma once

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// e^x for x <= ~0 (valid up to 88.7, where it overflows to +inf). Cody-Waite:
// x = n ln2 + r, |r| <= ln2/2, e^x = 2^n e^r. e^r is a degree-6 polynomial
// with c0 = c1 = 1 exact (so e^0 == 1 exactly) and c2..c6 a near-minimax fit
// of (e^r - 1 - r) / r^2 (interpolation at Chebyshev nodes): truncation error
// 1.0e-8 = 0.085 ulp; measured total error <= 0.95 ulp over every float in
// [-88, 0] (tests/test_stage_kernels.cpp checks <= 2 ulp on a sample).
// Lanes with x < ln(FLT_MIN) (including -inf) return exactly 0 with keep
// cleared, so callers can skip them in 0 * -inf products; NaN propagates.
Batch exp_nonpos(Batch x, Keep& keep) {
  const Batch log2e(1.44269504F);
  const Batch ln2_hi(0.693145751953125F);  // 0x3f317200: 15 significant bits, so n * ln2_hi is exact
  const Batch ln2_lo(1.42860677e-6F);      // ln 2 - ln2_hi
  const Batch n = round_nearest(x * log2e);
  Batch r = fnmadd(n, ln2_hi, x);
  r = fnmadd(n, ln2_lo, r);
  Batch p(1.39261759e-3F);
  p = xsimd::fma(p, r, Batch(8.36317334e-3F));
  p = xsimd::fma(p, r, Batch(4.16665562e-2F));
  p = xsimd::fma(p, r, Batch(1.66665778e-1F));
  p = xsimd::fma(p, r, Batch(0.5F));
  p = xsimd::fma(p, r, Batch(1.0F));
  p = xsimd::fma(p, r, Batch(1.0F));
  // -87.33654 = ln(FLT_MIN): below it the result would be subnormal; flushing
  // loses < 1.2e-38 per term against sums >= 1.
  keep = not_below(x, -87.33654F);
  return scale_pow2(p, n, keep);
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
  st.max = reduce_max(xsimd::max(m0, m1));
  if (st.max == kNegInf) {
    // Every entry -inf (S = D = 0, and no -inf - -inf), unless vmaxps dropped
    // a NaN on the way: rare, so checked only here, off the hot path.
    if (!scan_clean<T, kIsNan>(z, begin, end)) st = {kNaN, kNaN, kNaN};
    return st;
  }

  const Batch vmax(st.max);
  Batch sum(0.0F);
  Batch dot(0.0F);
  Keep keep;
  const std::int64_t next_end = row_end - kSegment;  // prefetch while i + kSegment < row_end
  for (i = begin; i + kLanes <= end; i += kLanes) {
    if (i < next_end) prefetch<T>(z, i + kSegment);
    const Batch d = round_mul(load<T>(z, i), vscale) - vmax;
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);  // flushed lanes (d = -inf) add nothing
  }
  if (i < end) {
    const Batch d = round_mul(load_tail<T>(z, i, end - i, kNegInf), vscale) - vmax;
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

RowStats row_stats_simd(const void* z, Elem z_type, std::int64_t n, float scale) {
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
  Keep keep;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Batch d = round_mul(load<Elem::f32>(z, i), vscale) - vmax;
    store<Out>(out, i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  if (i < n) {
    const Batch d = round_mul(load_tail<Elem::f32>(z, i, n - i, kNegInf), vscale) - vmax;
    store_tail<Out>(out, i, n - i, d);
    const Batch e = exp_nonpos(d, keep);
    sum += e;
    dot = add_dot(dot, e, d, keep);
  }
  st.sum = reduce_add(sum);  // 0 when every u is -inf
  st.dot = reduce_add(dot);
  return st;
}

RowStats row_stats_store_simd(const float* z, std::int64_t n, float scale, void* out, Elem out_type) {
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
// - lse); hot: 1.0 in the target's lane, if the target falls in this vector.
template <bool kEntropy>
Batch dlogits_lanes(Batch in, const DlogitsRow& c, Batch hot) {
  Keep keep;
  const Batch p = exp_nonpos(xsimd::fma(in, c.scale, c.shift) - c.lse, keep);
  // Rounded before any dbias add, so dbias receives exactly the f32 g.
  const Batch g = round_mul(hot - p, c.a);
  if constexpr (!kEntropy) {
    return g;
  } else {
    // Flushed lanes (p = 0, x possibly -inf) keep g: no 0 * -inf.
    const Batch centered = xsimd::fma(in, c.scale, c.shift_from_mean);
    return where_kept(keep, fnmadd(round_mul(c.b, p), centered, g), g);
  }
}

// A dlogits row's lanes (lanes(in lanes, i)) into out and, when given, dbias.
template <Elem In, Elem Out, class Lanes>
void dlogits_lanes_row(const void* in, std::int64_t n, void* out, float* dbias, const Lanes& lanes) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    // Load, then store the same lanes: exact aliasing of in and out is safe.
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

template <Elem In, Elem Out, bool kEntropy>
void dlogits_typed(const void* in, std::int64_t n, const DlogitsRow& c, std::int64_t target, void* out, float* dbias) {
  dlogits_lanes_row<In, Out>(in, n, out, dbias,
                             [&](Batch v, std::int64_t i) { return dlogits_lanes<kEntropy>(v, c, onehot(target, i)); });
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

void dlogits_row_simd(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse, float a,
                      std::int64_t target, void* out, Elem out_type, float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(0.0F), Batch(0.0F)};
  dlogits_any<false>(in, in_type, n, c, target, out, out_type, dbias);
}

void dlogits_entropy_row_simd(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                              float a, float b, float mean, std::int64_t target, void* out, Elem out_type,
                              float* dbias) {
  const DlogitsRow c{Batch(in_scale), Batch(in_shift), Batch(lse), Batch(a), Batch(b), Batch(in_shift - mean)};
  dlogits_any<true>(in, in_type, n, c, target, out, out_type, dbias);
}

// tanh (Cephes' tanhf scheme): |y| < 0.625 an odd polynomial y + y^3 P(y^2);
// above, sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) <= 0.287, so 1 - e does
// not cancel; e flushes to 0 (tanh = +-1) beyond |y| ~ 43.7.
Batch tanh_lanes(Batch y) {
  const Batch ay = abs_of(y);
  const Batch y2 = y * y;
  Batch poly(-5.70498872745e-3F);
  poly = xsimd::fma(poly, y2, Batch(2.06390887954e-2F));
  poly = xsimd::fma(poly, y2, Batch(-5.37397155531e-2F));
  poly = xsimd::fma(poly, y2, Batch(1.33314422036e-1F));
  poly = xsimd::fma(poly, y2, Batch(-3.33332819422e-1F));
  const Batch small = xsimd::fma(poly * y2, y, y);
  Keep keep;
  const Batch e = exp_nonpos(Batch(-2.0F) * ay, keep);
  const Batch large_abs = (Batch(1.0F) - e) / (Batch(1.0F) + e);
  return select_below(ay, 0.625F, small, with_sign_of(large_abs, y));
}

template <Elem T>
void softcap_typed(const void* z, std::int64_t n, float scale, float cap, float* out) {
  const Batch k(scale / cap);
  const Batch c(cap);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, c * tanh_lanes(load<T>(z, i) * k));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, c * tanh_lanes(load_tail<T>(z, i, n - i, 0.0F) * k));
}

void softcap_simd(const void* z, Elem z_type, std::int64_t n, float scale, float cap, float* out) {
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
  dlogits_lanes_row<In, Out>(in, n, out, dbias, [&](Batch v, std::int64_t i) {
    const Batch g = dlogits_lanes<true>(v, c, onehot(target, i));
    const Batch t = xsimd::fma(v, c.scale, c.shift) * cap_k;
    return g * (cap_s * fnmadd(t, t, Batch(1.0F)));
  });
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

void dlogits_softcap_row_simd(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
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

template <auto kBad>
bool scan_clean_any(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return scan_clean<Elem::f32, kBad>(data, 0, n);
    case Elem::bf16: return scan_clean<Elem::bf16, kBad>(data, 0, n);
    case Elem::f16: return scan_clean<Elem::f16, kBad>(data, 0, n);
  }
  return false;
}

bool all_finite_simd(const void* data, Elem type, std::int64_t n) { return scan_clean_any<kNonFinite>(data, type, n); }

bool no_nan_or_pos_inf_simd(const void* data, Elem type, std::int64_t n) {
  return scan_clean_any<kNanOrPosInf>(data, type, n);
}

float max_abs_simd(const void* data, Elem type, std::int64_t n) {
  switch (type) {
    case Elem::f32: return max_abs_of<Elem::f32>(data, n);
    case Elem::bf16: return max_abs_of<Elem::bf16>(data, n);
    case Elem::f16: return max_abs_of<Elem::f16>(data, n);
  }
  return std::numeric_limits<float>::infinity();
}

float mark_kept_simd(const void* g, Elem type, std::int64_t n, float threshold, std::uint8_t* kept) {
  const std::array<float, kKeptLanes> lane = type == Elem::f32 ? mark_kept_of<Elem::f32>(g, n, threshold, kept)
                                                               : mark_kept_of<Elem::bf16>(g, n, threshold, kept);
  float sum = 0.0F;  // the lane sums in lane order, on every path
  for (const float l : lane) sum += l;
  return sum;
}

template <Elem T>
void add_row_of(const float* in, void* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<T>(out, i, load<T>(out, i) + load<Elem::f32>(in, i));
  if (i < n) store_tail<T>(out, i, n - i, load_tail<T>(out, i, n - i, 0.0F) + load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

void add_row_simd(const float* in, void* out, Elem out_type, std::int64_t n) {
  if (out_type == Elem::f32) {
    add_row_of<Elem::f32>(in, out, n);
  } else {
    add_row_of<Elem::bf16>(in, out, n);
  }
}

void f32_to_bf16_simd(const float* in, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::bf16>(out, i, load<Elem::f32>(in, i));
  if (i < n) store_tail<Elem::bf16>(out, i, n - i, load_tail<Elem::f32>(in, i, n - i, 0.0F));
}

// Values of magnitude >= 65520 (they round to an f16 infinity) become
// +-65504 before the rounding; a NaN compares false and stays NaN.
Batch saturate_f16(Batch v, std::int64_t* saturated) {
  const auto big = xsimd::abs(v) >= Batch(65520.0F);
  if (xsimd::any(big)) {  // rare: count the lanes one by one
    alignas(64) std::array<float, kLanes> lanes{};
    v.store_aligned(lanes.data());
    for (const float x : lanes) *saturated += std::fabs(x) >= 65520.0F ? 1 : 0;
    v = xsimd::select(big, xsimd::copysign(Batch(65504.0F), v), v);
  }
  return v;
}

std::int64_t f32_to_f16_saturated_simd(const float* in, std::uint16_t* out, std::int64_t n) {
  std::int64_t saturated = 0;
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f16>(out, i, saturate_f16(load<Elem::f32>(in, i), &saturated));
  if (i < n) {
    store_tail<Elem::f16>(out, i, n - i, saturate_f16(load_tail<Elem::f32>(in, i, n - i, 0.0F), &saturated));
  }
  return saturated;
}

void f16_to_f32_simd(const std::uint16_t* in, float* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, load<Elem::f16>(in, i));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, load_tail<Elem::f16>(in, i, n - i, 0.0F));
}

void bf16_to_f32_simd(const std::uint16_t* in, float* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store<Elem::f32>(out, i, load<Elem::bf16>(in, i));
  if (i < n) store_tail<Elem::f32>(out, i, n - i, load_tail<Elem::bf16>(in, i, n - i, 0.0F));
}

// The ISA's table (dispatch.cpp takes it through the file's detail:: function).
const StageKernels& simd_table() {
  static constexpr StageKernels k{kIsaName,
                                  row_stats_simd,
                                  row_stats_store_simd,
                                  dlogits_row_simd,
                                  dlogits_entropy_row_simd,
                                  softcap_simd,
                                  dlogits_softcap_row_simd,
                                  mark_kept_simd,
                                  add_row_simd,
                                  all_finite_simd,
                                  no_nan_or_pos_inf_simd,
                                  max_abs_simd,
                                  f32_to_bf16_simd,
                                  bf16_to_f32_simd,
                                  f32_to_f16_saturated_simd,
                                  f16_to_f32_simd};
  return k;
}

}  // namespace
}  // namespace grpo::kernels
