// AVX2 stage kernels: the primitives of stage_kernels_simd.hpp, which holds
// the algorithms both SIMD paths share, in 8-lane ymm batches (xsimd for the
// arithmetic, raw intrinsics for blends, conversions and the integer work),
// and this path's own scans, max_abs and mark_kept, for x86-64 CPUs with
// AVX2, FMA and F16C but no AVX-512 (Zen 1-3, Haswell to Comet Lake).
// Compiled with -mavx2 -mfma -mf16c -ffp-contract=off and reached only after
// dispatch.cpp has checked the CPU.
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
constexpr char kIsaName[] = "avx2";
constexpr float kInf = std::numeric_limits<float>::infinity();

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

// The primitives of stage_kernels_simd.hpp.
using Keep = __m256;  // all ones in a kept lane
// fl(a * b): this file is compiled with -ffp-contract=off, so a written mul
// is never fused with what follows.
Batch round_mul(Batch a, Batch b) { return a * b; }
Batch fnmadd(Batch a, Batch b, Batch c) { return Batch(_mm256_fnmadd_ps(a, b, c)); }
Batch round_nearest(Batch x) { return Batch(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
// NLT_UQ keeps NaN lanes.
Keep not_below(Batch x, float lo) { return _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_NLT_UQ); }
// No vscalefps: p * 2^n as (p * 2^h) * 2^(n - h), h = floor(n / 2): both
// factors are normal for n in [-126, 128] (the whole range exp_nonpos is
// valid on) and p * 2^h is exact, so the one rounding is the last product's
// (vscalefps rounds once too). Flushed lanes (n possibly -inf, converted to
// garbage) are zeroed by the mask.
Batch scale_pow2(Batch p, Batch n, Keep keep) {
  const __m256 half = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5F)));
  const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_ps(n, half)));
  return Batch(_mm256_and_ps(scaled, keep));
}
// dot += e * d where keep is set: flushed lanes (e = 0, d possibly -inf)
// contribute d = 0, never 0 * -inf.
Batch add_dot(Batch dot, Batch e, Batch d, Keep keep) { return xsimd::fma(e, Batch(_mm256_and_ps(d, keep)), dot); }
Batch where_kept(Keep keep, Batch a, Batch b) { return Batch(_mm256_blendv_ps(b, a, keep)); }

// 1.0 in the target's lane when the target falls in [i, i + 8), else all 0.
Batch onehot(std::int64_t target, std::int64_t i) {
  const auto lane = static_cast<std::uint64_t>(target - i);  // negative targets wrap to huge
  const int hot = lane < static_cast<std::uint64_t>(kLanes) ? static_cast<int>(lane) : -1;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 is_hot = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, _mm256_set1_epi32(hot)));
  return Batch(_mm256_and_ps(is_hot, _mm256_set1_ps(1.0F)));
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

Batch abs_of(Batch y) { return Batch(_mm256_and_ps(y, magnitude_mask())); }
// m (|m|) with y's sign.
Batch with_sign_of(Batch m, Batch y) { return Batch(_mm256_or_ps(m, _mm256_andnot_ps(magnitude_mask(), y))); }
Batch select_below(Batch a, float bound, Batch x, Batch y) {
  return Batch(_mm256_blendv_ps(y, x, _mm256_cmp_ps(a, _mm256_set1_ps(bound), _CMP_LT_OQ)));
}

// scan_clean's kBad: what a lane must not be.
constexpr __m256 (*kIsNan)(__m256) = is_nan;
constexpr __m256 (*kNonFinite)(__m256) = non_finite;
constexpr __m256 (*kNanOrPosInf)(__m256) = nan_or_pos_inf;

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

// Sixteen lane sums (element v into lane v mod 16) as two ymm halves; the
// last n mod 16 elements are added lane by lane in the same order.
static_assert(2 * kLanes == kKeptLanes);
template <Elem T>
std::array<float, kKeptLanes> mark_kept_of(const void* g, std::int64_t n, float threshold, std::uint8_t* kept) {
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
  alignas(32) std::array<float, kKeptLanes> lane{};
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
  return lane;
}

}  // namespace
}  // namespace grpo::kernels

#include "kernels/stage_kernels_simd.hpp"

namespace grpo::kernels::detail {

// Only called by dispatch.cpp once the CPU was found to have AVX2, FMA and F16C.
const StageKernels& avx2_table() { return simd_table(); }

}  // namespace grpo::kernels::detail
