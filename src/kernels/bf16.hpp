// bf16 <-> f32: the library's one rounding (round to nearest even) and
// widening, scalar here, 16 and 8 lanes in bf16_avx512.hpp and
// bf16_avx2.hpp (the same arithmetic, bit for bit).
//
// Round to nearest even: add 0x7fff (just below half of the 16 dropped
// bits) plus the lowest kept bit (which tips exact ties to the even
// neighbour) and keep the high half; an overflow carries into the exponent
// and correctly gives +-inf. A NaN must not go through the add (a payload
// near the top would carry into the sign or turn into an infinity): what a
// NaN becomes is the caller's policy, Bf16Nan.
#pragma once

#include <bit>
#include <cstdint>

namespace grpo::kernels {

enum class Bf16Nan : std::uint8_t {
  // Keep the sign and the top payload bits, force the quiet bit (0x40): the
  // stage kernels, whose NaN is data (a -inf logit's gradient).
  quiet,
  // Every NaN becomes 0x7fc0: the GEMM backends (what the reference loops
  // and the integer epilogue give; vcvtneps2bf16 keeps payloads instead,
  // gemm_epilogue_avx512.hpp).
  canonical,
  // No check: only for values known not to be NaN.
  unchecked,
};

constexpr float bf16_to_float(std::uint16_t v) { return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16); }

// The 32 bits of a non-NaN f32, rounded to bf16 (in the low 16 bits).
constexpr std::uint32_t bf16_round_bits(std::uint32_t bits) { return (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16; }

template <Bf16Nan kNan = Bf16Nan::quiet>
constexpr std::uint16_t float_to_bf16(float v) {
  const auto bits = std::bit_cast<std::uint32_t>(v);
  if constexpr (kNan != Bf16Nan::unchecked) {
    if ((bits & 0x7fffffffU) > 0x7f800000U) {
      return kNan == Bf16Nan::quiet ? static_cast<std::uint16_t>((bits >> 16) | 0x40U) : std::uint16_t{0x7fc0};
    }
  }
  return static_cast<std::uint16_t>(bf16_round_bits(bits));
}

}  // namespace grpo::kernels
