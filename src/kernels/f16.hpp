// IEEE binary16 (fp16) <-> f32 in software, rounding to nearest even exactly
// as vcvtps2ph does (the scalar stage kernels and the reference GEMM must not
// need F16C, and clang 14 has no _Float16 on x86-64; the path-agreement and
// GEMM tests compare them bit for bit with the F16C and AVX-512 forms).
//
// A gradient written in fp16 saturates (docs/semantics.md, "fp16"): a value
// whose magnitude would round past 65504, the largest finite fp16 (>= 65520,
// or an f32 infinity), is written as +-65504 and counted, never as an
// infinity; a NaN stays a (quiet) NaN.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace grpo::kernels {

inline constexpr std::uint16_t kF16MaxBits = 0x7bffU;  // 65504
inline constexpr float kF16Max = 65504.0F;

inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fU;
  const std::uint32_t mantissa = h & 0x3ffU;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  const std::uint32_t bits = exponent == 31 ? sign | 0x7f800000U | (mantissa << 13)  // inf / NaN
                                            : sign | ((exponent + 112) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

// Round to nearest even; past the range an infinity (as vcvtps2ph).
inline std::uint16_t float_to_f16(float f) {
  auto x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000U);
  x &= 0x7fffffffU;
  if (x >= 0x7f800000U) return sign | (x > 0x7f800000U ? 0x7e00U : 0x7c00U);  // NaN (quiet) / inf
  if (x >= 0x477ff000U) return sign | 0x7c00U;                                // >= 65520 rounds to inf
  if (x < 0x38800000U) {                                                      // below 2^-14: a half subnormal or zero
    if (x < 0x33000000U) return sign;  // <= 2^-25 rounds to zero (the tie goes to even 0)
    const std::uint32_t e = x >> 23;
    const std::uint32_t m = (x & 0x7fffffU) | 0x800000U;
    const std::uint32_t shift = 126 - e;  // f / 2^-24 = m * 2^(e - 126)
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1U << shift) - 1);
    const std::uint32_t half = 1U << (shift - 1);
    if (rem > half || (rem == half && (r & 1U) != 0)) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = (x - 0x38000000U) >> 13;  // rebias 127 -> 15, keep 10 mantissa bits
  const std::uint32_t rem = x & 0x1fffU;
  if (rem > 0x1000U || (rem == 0x1000U && (r & 1U) != 0)) ++r;  // a carry may bump the exponent: correct
  return static_cast<std::uint16_t>(sign | r);
}

// The gradient form: as float_to_f16, but +-65504 where that gives an
// infinity (a NaN stays NaN); *saturated counts those.
inline std::uint16_t float_to_f16_saturated(float f, std::int64_t* saturated) {
  const std::uint16_t h = float_to_f16(f);
  if ((h & 0x7fffU) == 0x7c00U) {
    ++*saturated;
    return static_cast<std::uint16_t>((h & 0x8000U) | kF16MaxBits);
  }
  return h;
}

}  // namespace grpo::kernels
