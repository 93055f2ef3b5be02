// AVX-512 eltwise ops (xsimd batches, intrinsics for bf16 loads and horizontal
// max). Compiled with -mavx512*; only reached after the CPU check.
#include <immintrin.h>

#include <cmath>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "kernels/bf16_avx512.hpp"
#include "kernels/eltwise.hpp"

namespace grpo::kernels {
namespace {

using Batch = xsimd::batch<float, xsimd::avx512bw>;
constexpr std::int64_t kLanes = Batch::size;  // 16

Batch load(const void* z, Elem type, std::int64_t i) {
  if (type == Elem::f32) return Batch::load_unaligned(static_cast<const float*>(z) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(z) + i));
  return Batch(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}

float load1(const void* z, Elem type, std::int64_t i) {
  return type == Elem::f32 ? static_cast<const float*>(z)[i] : bf16_to_float(static_cast<const std::uint16_t*>(z)[i]);
}

float max_avx512(const void* z, Elem type, std::int64_t n) {
  Batch m(-std::numeric_limits<float>::infinity());
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = xsimd::max(m, load(z, type, i));
  float r = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) r = std::fmax(r, load1(z, type, i));
  return r;
}

float sum_exp_avx512(const void* z, Elem type, std::int64_t n, float scale, float shift) {
  Batch s(0.0F);
  const Batch vs(scale);
  const Batch vh(shift);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) s += xsimd::exp(xsimd::fma(load(z, type, i), vs, vh));
  float r = xsimd::hadd(s);
  for (; i < n; ++i) r += std::exp(load1(z, type, i) * scale + shift);
  return r;
}

void affine_avx512(const void* z, Elem type, std::int64_t n, float scale, float shift, float* out) {
  const Batch vs(scale);
  const Batch vh(shift);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) xsimd::fma(load(z, type, i), vs, vh).store_unaligned(out + i);
  for (; i < n; ++i) out[i] = load1(z, type, i) * scale + shift;
}

void exp_avx512(const float* in, std::int64_t n, float* out) {
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) xsimd::exp(Batch::load_unaligned(in + i)).store_unaligned(out + i);
  for (; i < n; ++i) out[i] = std::exp(in[i]);
}

float dot_avx512(const float* p, const float* logp, std::int64_t n) {
  Batch s(0.0F);
  const Batch zero(0.0F);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch pv = Batch::load_unaligned(p + i);
    s += xsimd::select(pv == zero, zero, pv * Batch::load_unaligned(logp + i));
  }
  float r = xsimd::hadd(s);
  for (; i < n; ++i) r += p[i] == 0.0F ? 0.0F : p[i] * logp[i];
  return r;
}

void onehot_minus_avx512(const float* p, std::int64_t n, float a, std::int64_t target, void* out, Elem out_type) {
  const Batch va(-a);
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch g = Batch::load_unaligned(p + i) * va;
    if (out_type == Elem::f32) {
      g.store_unaligned(static_cast<float*>(out) + i);
    } else {
      // Unchecked, as this path always was: its scalar tail keeps a NaN quiet.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(out) + i),
                          float_to_bf16x16<Bf16Nan::unchecked>(g));
    }
  }
  for (; i < n; ++i) {
    const float g = -a * p[i];
    if (out_type == Elem::f32) {
      static_cast<float*>(out)[i] = g;
    } else {
      static_cast<std::uint16_t*>(out)[i] = float_to_bf16(g);
    }
  }
  if (target >= 0 && target < n) {
    const float g = a * (1.0F - p[target]);
    if (out_type == Elem::f32) {
      static_cast<float*>(out)[target] = g;
    } else {
      static_cast<std::uint16_t*>(out)[target] = float_to_bf16(g);
    }
  }
}

}  // namespace

// Called only once eltwise_scalar.cpp (compiled for any x86-64) found AVX-512:
// the compiler may use it anywhere in this file, before any check.
const EltwiseKernels* avx512_eltwise_table() {
  static const EltwiseKernels k{"avx512",   max_avx512, sum_exp_avx512,     affine_avx512,
                                exp_avx512, dot_avx512, onehot_minus_avx512};
  return &k;
}

}  // namespace grpo::kernels
