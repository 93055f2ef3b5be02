// Scalar stage kernels: the fallback on CPUs without AVX-512 and the per-stage
// comparison target of stage_kernels_avx512.cpp. Plain loops with f32
// accumulation and the same segmenting as the SIMD path (row_stats: one max
// pass then one exp pass per kSegment-long segment, merged in order) and the
// same roundings: x = fl(z * scale), then x - max. (This file is built for
// baseline x86-64, without FMA, so the compiler cannot fuse the two; the
// kernel tests check that max and the stored u agree bit for bit.)
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/f16.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float load(const void* data, Elem type, std::int64_t i) {
  switch (type) {
    case Elem::f32: return static_cast<const float*>(data)[i];
    case Elem::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case Elem::f16: return f16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0.0F;
}

void store(void* data, Elem type, std::int64_t i, float v) {
  switch (type) {
    case Elem::f32: static_cast<float*>(data)[i] = v; return;
    case Elem::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16(v); return;
    case Elem::f16: static_cast<std::uint16_t*>(data)[i] = float_to_f16(v); return;
  }
}

// fl(a * b + c) with a single rounding, as the AVX-512 path's fma: a * b is
// exact in double (24 + 24 bits < 53), so only rare double-rounding ties differ.
float fused(float a, float b, float c) {
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) + static_cast<double>(c));
}

// Statistics of one segment: a max pass, then an exp pass relative to it.
RowStats segment_stats(const void* z, Elem type, std::int64_t begin, std::int64_t end, float scale) {
  RowStats st;
  for (std::int64_t i = begin; i < end; ++i) {
    const float x = load(z, type, i) * scale;
    // Written so a NaN x propagates into the max (std::fmax would drop it).
    st.max = x > st.max || std::isnan(x) ? x : st.max;
  }
  if (st.max == kNegInf) return st;  // every entry -inf: S = D = 0, no -inf - -inf
  for (std::int64_t i = begin; i < end; ++i) {
    const float d = load(z, type, i) * scale - st.max;
    if (d == kNegInf) continue;  // banned token: adds 0 to S and D, never 0 * -inf
    const float e = std::exp(d);
    st.sum += e;
    st.dot += e * d;
  }
  return st;
}

RowStats row_stats_scalar(const void* z, Elem z_type, std::int64_t n, float scale) {
  RowStats st;
  for (std::int64_t begin = 0; begin < n; begin += kSegment) {
    const std::int64_t end = begin + kSegment < n ? begin + kSegment : n;
    st = merge(st, segment_stats(z, z_type, begin, end, scale));
  }
  return st;
}

RowStats row_stats_store_scalar(const float* z, std::int64_t n, float scale, void* out, Elem out_type) {
  // Not segmented: every stored u needs the max of the whole (cache-resident) row.
  RowStats st;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = z[i] * scale;
    st.max = x > st.max || std::isnan(x) ? x : st.max;
  }
  if (st.max == kNegInf) {
    for (std::int64_t i = 0; i < n; ++i) store(out, out_type, i, kNegInf);
    return st;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float d = z[i] * scale - st.max;
    store(out, out_type, i, d);
    if (d == kNegInf) continue;
    const float e = std::exp(d);
    st.sum += e;
    st.dot += e * d;
  }
  return st;
}

void dlogits_row_scalar(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                        float a, std::int64_t target, void* out, Elem out_type, float* dbias) {
  for (std::int64_t i = 0; i < n; ++i) {
    // With in_shift == 0, x is exactly row_stats' fl(z * scale).
    const float p = std::exp(fused(load(in, in_type, i), in_scale, in_shift) - lse);
    const float g = a * ((i == target ? 1.0F : 0.0F) - p);
    store(out, out_type, i, g);  // after the load: out may alias in
    if (dbias != nullptr) dbias[i] += g;
  }
}

void dlogits_entropy_row_scalar(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                                float a, float b, float mean, std::int64_t target, void* out, Elem out_type,
                                float* dbias) {
  const float shift_from_mean = in_shift - mean;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = load(in, in_type, i);
    const float p = std::exp(fused(v, in_scale, in_shift) - lse);
    float g = a * ((i == target ? 1.0F : 0.0F) - p);
    // b * p rounded, then one fused multiply-add, as the AVX-512 path.
    if (p != 0.0F) g = fused(-(b * p), fused(v, in_scale, shift_from_mean), g);
    store(out, out_type, i, g);  // after the load: out may alias in
    if (dbias != nullptr) dbias[i] += g;
  }
}

void softcap_scalar(const void* z, Elem z_type, std::int64_t n, float scale, float cap, float* out) {
  const float k = scale / cap;
  for (std::int64_t i = 0; i < n; ++i) out[i] = cap * std::tanh(load(z, z_type, i) * k);
}

void dlogits_softcap_row_scalar(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                                float a, float b, float mean, float cap_k, float cap_s, std::int64_t target, void* out,
                                Elem out_type, float* dbias) {
  const float shift_from_mean = in_shift - mean;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = load(in, in_type, i);
    const float x = fused(v, in_scale, in_shift);
    const float p = std::exp(x - lse);
    float g = a * ((i == target ? 1.0F : 0.0F) - p);
    if (p != 0.0F) g = fused(-(b * p), fused(v, in_scale, shift_from_mean), g);
    const float t = x * cap_k;
    g = g * (cap_s * fused(-t, t, 1.0F));
    store(out, out_type, i, g);  // after the load: out may alias in
    if (dbias != nullptr) dbias[i] += g;
  }
}

std::uint32_t bits_of(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

// Exponent all ones: +-inf or NaN. The masks are the IEEE exponent fields.
bool is_special(const void* data, Elem type, std::int64_t i) {
  if (type == Elem::f32) return (bits_of(static_cast<const float*>(data)[i]) & 0x7f800000U) == 0x7f800000U;
  const std::uint16_t v = static_cast<const std::uint16_t*>(data)[i];
  return type == Elem::bf16 ? (v & 0x7f80U) == 0x7f80U : (v & 0x7c00U) == 0x7c00U;
}

bool all_finite_scalar(const void* data, Elem type, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (is_special(data, type, i)) return false;
  }
  return true;
}

bool no_nan_or_pos_inf_scalar(const void* data, Elem type, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    // Only -inf is an allowed special value; the conversion to f32 is exact.
    if (is_special(data, type, i) && load(data, type, i) != kNegInf) return false;
  }
  return true;
}

// On the bits: with the sign cleared, a float's bit pattern orders as its
// magnitude does, and every pattern at or above the infinity's is an
// infinity or a NaN. So one integer max over the row (which the compiler
// vectorizes: this pass runs over the whole weight on every call, 8% of a
// T=512 step on a CPU without AVX-512 when it went element by element)
// gives both max |x| and whether anything was special.
float max_abs_scalar(const void* data, Elem type, std::int64_t n) {
  if (type != Elem::f32) {  // bf16 or f16: the same order on the bits, their own infinity
    const auto* p = static_cast<const std::uint16_t*>(data);
    std::uint16_t m = 0;
    for (std::int64_t i = 0; i < n; ++i) m = std::max<std::uint16_t>(m, p[i] & 0x7fffU);
    if (type == Elem::f16) return m >= 0x7c00U ? std::numeric_limits<float>::infinity() : f16_to_float(m);
    return m >= 0x7f80U ? std::numeric_limits<float>::infinity() : bf16_to_float(m);
  }
  const auto* p = static_cast<const float*>(data);
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) m = std::max<std::uint32_t>(m, std::bit_cast<std::uint32_t>(p[i]) & 0x7fffffffU);
  return m >= 0x7f800000U ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(m);
}

void f32_to_bf16_scalar(const float* in, std::uint16_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

std::int64_t f32_to_f16_saturated_scalar(const float* in, std::uint16_t* out, std::int64_t n) {
  std::int64_t saturated = 0;
  for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_f16_saturated(in[i], &saturated);
  return saturated;
}

void f16_to_f32_scalar(const std::uint16_t* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = f16_to_float(in[i]);
}

void bf16_to_f32_scalar(const std::uint16_t* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

float mark_kept_scalar(const void* g, Elem type, std::int64_t n, float threshold, std::uint8_t* kept) {
  std::array<float, kKeptLanes> lane{};  // the AVX-512 path's lanes
  for (std::int64_t i = 0; i < n; ++i) {
    const float x =
        type == Elem::f32 ? static_cast<const float*>(g)[i] : bf16_to_float(static_cast<const std::uint16_t*>(g)[i]);
    if (std::fabs(x) >= threshold) {
      kept[i] = 1;
    } else {
      lane[static_cast<std::size_t>(i) % kKeptLanes] += std::fabs(x);
    }
  }
  float sum = 0.0F;
  for (const float l : lane) sum += l;
  return sum;
}

void add_row_scalar(const float* in, void* out, Elem out_type, std::int64_t n) {
  if (out_type == Elem::f32) {
    auto* o = static_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) o[i] += in[i];
    return;
  }
  auto* o = static_cast<std::uint16_t*>(out);
  for (std::int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(bf16_to_float(o[i]) + in[i]);
}

}  // namespace

namespace detail {

const StageKernels& scalar_table() {
  static constexpr StageKernels k{"scalar",
                                  row_stats_scalar,
                                  row_stats_store_scalar,
                                  dlogits_row_scalar,
                                  dlogits_entropy_row_scalar,
                                  softcap_scalar,
                                  dlogits_softcap_row_scalar,
                                  mark_kept_scalar,
                                  add_row_scalar,
                                  all_finite_scalar,
                                  no_nan_or_pos_inf_scalar,
                                  max_abs_scalar,
                                  f32_to_bf16_scalar,
                                  bf16_to_f32_scalar,
                                  f32_to_f16_saturated_scalar,
                                  f16_to_f32_scalar};
  return k;
}

}  // namespace detail
}  // namespace grpo::kernels
