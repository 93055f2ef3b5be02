// AVX-512 stage kernels: the primitives of stage_kernels_simd.hpp, which
// holds the algorithms both SIMD paths share (xsimd batches for the
// arithmetic, raw intrinsics for masks, f16/bf16 conversion, scalef and
// fpclass), and this path's own scans, max_abs and mark_kept. The only stage
// file compiled with -mavx512*; reached only after dispatch.cpp has checked
// the CPU. Tails
// (n not a multiple of 16) use masked loads and stores, so nothing outside
// [0, n) is ever touched (masked-off lanes do not fault).
//
// x = fl(z * scale) is rounded before max is subtracted (a mul and a sub, not
// one fma) so that it is the very x the drivers use for the chosen token: the
// max entry then gives exactly e^0 = 1, S >= 1, and logp = x_y - LSE <= 0.
// GCC contracts a plain vector mul + sub into an fma (-ffp-contract=fast is its
// default), hence round_mul(): embedded rounding forces a separate vmulps.
#include <immintrin.h>

#include <array>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "kernels/bf16_avx512.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

using Batch = xsimd::batch<float, xsimd::avx512bw>;
constexpr std::int64_t kLanes = Batch::size;  // 16 f32 per zmm
constexpr char kIsaName[] = "avx512";

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

// The primitives of stage_kernels_simd.hpp.
using Keep = __mmask16;  // a set bit per kept lane
float reduce_max(Batch v) { return _mm512_reduce_max_ps(v); }
float reduce_add(Batch v) { return _mm512_reduce_add_ps(v); }
// vfnmadd directly: xsimd 8.1's fnma negates first, one more instruction.
Batch fnmadd(Batch a, Batch b, Batch c) { return Batch(_mm512_fnmadd_ps(a, b, c)); }
Batch round_nearest(Batch x) { return Batch(_mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
// NLT_UQ keeps NaN lanes.
Keep not_below(Batch x, float lo) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_NLT_UQ); }
Batch scale_pow2(Batch p, Batch n, Keep keep) { return Batch(_mm512_maskz_scalef_ps(keep, p, n)); }
// Flushed lanes (d = -inf) add nothing.
Batch add_dot(Batch dot, Batch e, Batch d, Keep keep) { return Batch(_mm512_mask3_fmadd_ps(e, d, dot, keep)); }
Batch where_kept(Keep keep, Batch a, Batch b) { return Batch(_mm512_mask_mov_ps(b, keep, a)); }
Batch onehot(std::int64_t target, std::int64_t i) {
  const auto lane = static_cast<std::uint64_t>(target - i);  // negative targets wrap to huge
  const __mmask16 hot = lane < static_cast<std::uint64_t>(kLanes) ? static_cast<__mmask16>(1U << lane) : __mmask16{0};
  return Batch(_mm512_maskz_mov_ps(hot, _mm512_set1_ps(1.0F)));
}
__m512 magnitude_bits() { return _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)); }
Batch abs_of(Batch y) { return Batch(_mm512_and_ps(y, magnitude_bits())); }
// m (|m|) with y's sign.
Batch with_sign_of(Batch m, Batch y) { return Batch(_mm512_or_ps(m, _mm512_andnot_ps(magnitude_bits(), y))); }
Batch select_below(Batch a, float bound, Batch x, Batch y) {
  return Batch(_mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, _mm512_set1_ps(bound), _CMP_LT_OQ), x));
}

// vfpclassps categories (Intel SDM): 0x01 QNaN, 0x08 +inf, 0x10 -inf, 0x80 SNaN;
// scan_clean's kBad: what a lane must not be.
constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;
constexpr int kNanOrPosInf = 0x01 | 0x08 | 0x80;
constexpr int kIsNan = 0x01 | 0x80;
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
float max_abs_of(const void* data, std::int64_t n) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 x = load<T>(data, i);
    bad |= _mm512_fpclass_ps_mask(x, kNonFinite);
    m = _mm512_max_ps(m, _mm512_and_ps(x, magnitude));
  }
  if (i < n) {
    const __m512 x = load_tail<T>(data, i, n - i, 0.0F);
    bad |= _mm512_fpclass_ps_mask(x, kNonFinite);
    m = _mm512_max_ps(m, _mm512_and_ps(x, magnitude));
  }
  return bad != 0 ? std::numeric_limits<float>::infinity() : _mm512_reduce_max_ps(m);
}

static_assert(kLanes == kKeptLanes);
template <Elem T>
std::array<float, kKeptLanes> mark_kept_of(const void* g, std::int64_t n, float threshold, std::uint8_t* kept) {
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
  alignas(64) std::array<float, kKeptLanes> lane;
  _mm512_store_ps(lane.data(), below);
  return lane;
}

}  // namespace
}  // namespace grpo::kernels

#include "kernels/stage_kernels_simd.hpp"

namespace grpo::kernels::detail {

// Only called by dispatch.cpp once the CPU was found to have AVX-512F/BW/DQ/VL.
const StageKernels& avx512_table() { return simd_table(); }

}  // namespace grpo::kernels::detail
