// The filtered backward's numerics (FilteredBackward's tail correction,
// filtered_backward.cpp): the sketches' random signs, an orthonormal basis of
// a few rows with its dual (modified Gram-Schmidt, then a Cholesky solve), and
// the tail operands' loads and stores in the dlogits dtype. Plain functions of
// their arguments: no plan, no workspace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "grpo/types.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

// The tail correction's random signs: +-1 from (column, direction), a fixed
// hash (the same in every call and on every machine); direction 0 is all +1
// (the plain sum, the direction a trained head's rows share most).
inline float tail_sign(std::int64_t column, std::int64_t direction) {
  if (direction == 0) return 1.0F;
  std::uint64_t x = static_cast<std::uint64_t>(column) * 0x9E3779B97F4A7C15ULL +
                    static_cast<std::uint64_t>(direction) * 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 29;
  return (x >> 63) != 0 ? -1.0F : 1.0F;
}

// Rows [k, kc) of y [kc, n] (row stride ld): the guard's probes before
// Gram-Schmidt, random signs from tail_sign's hash (directions past any the
// sketches use).
void fill_probes(float* y, std::int64_t ld, std::int64_t k, std::int64_t kc, std::int64_t n);

// An orthonormal basis of the span of rows y [rows, n] (row stride ld_y):
// modified Gram-Schmidt in double, twice (a row keeping less than 1e-6 of its
// norm becomes zero), rounded to `type` into basis [rows, n] (row stride
// ld_basis); and dual [k, n] = (Bb Bb^T)^-1 Bb of the first k <= kTailRank
// rounded rows Bb, so x -> (x Bb^T) dual is the orthogonal projection onto
// their span even though rounding left them not quite orthonormal. Rows past
// k (the guard's probes) come out orthogonal to the first k. work: rows (n +
// rows) doubles.
void tail_basis(const float* y, std::int64_t ld_y, std::int64_t rows, std::int64_t k, std::int64_t n, double* work,
                std::byte* basis, std::int64_t ld_basis, DType type, float* dual);

// A value of a tail operand in dlogits dtype.
inline float tail_load(const std::byte* base, std::int64_t i, DType type) {
  return type == DType::bf16 ? kernels::bf16_to_float(reinterpret_cast<const std::uint16_t*>(base)[i])
                             : reinterpret_cast<const float*>(base)[i];
}
// v stored at i in dlogits dtype (rounded to bf16 there).
inline void tail_store(std::byte* base, std::int64_t i, float v, DType type) {
  if (type == DType::bf16) {
    reinterpret_cast<std::uint16_t*>(base)[i] = kernels::float_to_bf16(v);
  } else {
    reinterpret_cast<float*>(base)[i] = v;
  }
}
// v as (hi, lo) at i and i + offset: bf16(v) and bf16(v - hi), or v and 0 in f32.
inline void tail_store_pair(std::byte* base, std::int64_t i, std::int64_t offset, float v, DType type) {
  tail_store(base, i, v, type);
  tail_store(base, i + offset, v - tail_load(base, i, type), type);
}

}  // namespace grpo::detail
