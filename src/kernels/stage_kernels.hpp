// The SIMD stage kernels: row statistics (online log-sum-exp + entropy
// accumulator), the dlogits row, and the finiteness scans. Each stage has a
// scalar implementation (stage_kernels_scalar.cpp: the fallback and the
// per-stage comparison target), an AVX-512 one (stage_kernels_avx512.cpp) and
// an AVX2 one (stage_kernels_avx2.cpp), selected once at run time.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/bf16.hpp"

namespace grpo::kernels {

// Storage types a row segment can have. f16 only appears in the fused
// driver's block buffer, holding x - max (see row_stats_store).
enum class Elem : std::uint8_t { f32, bf16, f16 };

// Softmax statistics of x over a row or a segment of one:
//   max = M = max_v x_v (-inf when every x_v is -inf or n == 0)
//   sum = S = sum_v exp(x_v - M)
//   dot = D = sum_v exp(x_v - M) * (x_v - M)      (entries with x_v = -inf add 0)
// Then LSE = M + log S, entropy = log S - D / S, E_p[x] = M + D / S.
struct RowStats {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0F;
  float dot = 0.0F;
};

// The online update: the statistics of the concatenation of two segments.
// Merging in a fixed order (segment 0, 1, 2, ...) gives results independent
// of how the segments were scheduled. Defined out of line in merge.cpp (built
// without AVX-512 flags): an inline definition compiled into the AVX-512 file
// could be the copy the linker keeps for every caller.
RowStats merge(const RowStats& a, const RowStats& b);

struct StageKernels {
  const char* name;

  // Statistics of x_v = z_v * scale, v in [0, n). z is f32 or bf16 (Elem::f16 not
  // accepted). Long rows are processed in segments of kSegment elements merged
  // online in order, so one pass over memory suffices.
  RowStats (*row_stats)(const void* z, Elem z_type, std::int64_t n, float scale);

  // Statistics of x_v = z_v * scale for an f32 GEMM tile row (n <= a few thousand,
  // cache resident), and stores u_v = x_v - stats.max into out (f32 or f16).
  // f16 is safe for u because |error(u)| <= 2^-11 |u| and the entries that matter
  // for p (u near 0) are the ones stored most precisely.
  RowStats (*row_stats_store)(const float* z, std::int64_t n, float scale, void* out, Elem out_type);

  // One row of dlogits: x_v = in_v * in_scale + in_shift, p_v = exp(x_v - lse),
  //   g_v = a * ([v == target] - p_v)      (target < 0 or >= n: no one-hot in this row)
  // written to out (f32 or bf16, round to nearest even). out may alias in exactly
  // (same pointer) when the element sizes match. When dbias is non-null, also
  // dbias[v] += g_v (f32), added in the order rows are processed.
  void (*dlogits_row)(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse, float a,
                      std::int64_t target, void* out, Elem out_type, float* dbias);

  // dlogits_row with the entropy term of the generic log-prob head: with x_v and
  // p_v as above and mean = E_p[x] over the whole row,
  //   g_v = a * ([v == target] - p_v) - b * p_v * (x_v - mean)
  // (b = dL/dEnt times the temperature chain factor; dEnt/dx_v = -p_v (x_v - mean)).
  // x_v - mean is formed as in_v * in_scale + (in_shift - mean), one rounding of
  // the small shift difference instead of a cancellation between two large
  // values. Entries with p_v = 0 (x_v = -inf, or below the exp's flush point)
  // get no entropy term (never 0 * -inf). Aliasing and dbias as dlogits_row.
  void (*dlogits_entropy_row)(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                              float a, float b, float mean, std::int64_t target, void* out, Elem out_type,
                              float* dbias);

  // The logit softcap: out_v = cap * tanh(scale * z_v / cap), z f32 or bf16;
  // out may alias z exactly when z is f32. (-inf maps to -cap, as tanh does.)
  void (*softcap)(const void* z, Elem z_type, std::int64_t n, float scale, float cap, float* out);

  // dlogits_entropy_row through a softcap: with x_v, p_v and mean as there,
  //   g_v = (a * ([v == target] - p_v) - b * p_v * (x_v - mean)) * s * (1 - t_v^2),
  //   t_v = x_v * cap_k   (= z'_v / c, so the last factor is dz'/dz)
  // b = 0 gives the plain dlogits row times the chain factor. dbias receives
  // the final g_v. Aliasing as dlogits_row.
  void (*dlogits_softcap_row)(const void* in, Elem in_type, std::int64_t n, float in_scale, float in_shift, float lse,
                              float a, float b, float mean, float cap_k, float cap_s, std::int64_t target, void* out,
                              Elem out_type, float* dbias);

  // The filtered backward's column marks over one dlogits row g (f32 or
  // bf16): kept[v] = 1 where |g_v| >= threshold; other marks are left as they
  // are. Returns the sum of |g_v| below the threshold (the most the row can
  // leave out), summed in kKeptLanes = 16 lanes (element v into lane v mod
  // 16) then lanes 0..15 in order: the same bits on every path.
  float (*mark_kept)(const void* g, Elem type, std::int64_t n, float threshold, std::uint8_t* kept);
  // out_v = out_v + in_v over a row, out f32 or bf16 (the sum rounded to
  // nearest even): a dW row the filtered backward adds into.
  void (*add_row)(const float* in, void* out, Elem out_type, std::int64_t n);

  // True when every element is finite (no NaN, no +-inf).
  bool (*all_finite)(const void* data, Elem type, std::int64_t n);
  // True when no element is NaN or +inf (-inf allowed: banned tokens in a bias).
  bool (*no_nan_or_pos_inf)(const void* data, Elem type, std::int64_t n);

  // max_v |x_v| when every element is finite, +inf otherwise (one pass: the
  // finiteness check of hidden / weight, and the bound that proves their
  // logits cannot overflow f32).
  float (*max_abs)(const void* data, Elem type, std::int64_t n);

  // Conversions of contiguous runs.
  void (*f32_to_bf16)(const float* in, std::uint16_t* out, std::int64_t n);
  void (*bf16_to_f32)(const std::uint16_t* in, float* out, std::int64_t n);
  // An f16 gradient run: rounded to nearest even, +-65504 where the value
  // would round to an infinity (f16.hpp's float_to_f16_saturated, bit for
  // bit); returns how many saturated.
  std::int64_t (*f32_to_f16_saturated)(const float* in, std::uint16_t* out, std::int64_t n);
  // f16 widened to f32 (exact).
  void (*f16_to_f32)(const std::uint16_t* in, float* out, std::int64_t n);
};

// Segment length of row_stats over long rows: 2048 f32 = 8 KiB stays in L1
// between the max pass and the exp pass over the same segment.
inline constexpr std::int64_t kSegment = 2048;
// The lanes of StageKernels::mark_kept's sum (an AVX-512 vector's).
inline constexpr std::size_t kKeptLanes = 16;

const StageKernels& scalar_kernels();
// nullptr when the CPU (or the build) lacks AVX-512F/BW/DQ/VL.
const StageKernels* avx512_kernels();
// nullptr when the CPU lacks AVX2, FMA or F16C.
const StageKernels* avx2_kernels();
// The dispatched set: AVX-512 when available, else AVX2, else scalar. In the
// environment (read once), GRPO_SIMD=scalar forces the scalar path and
// GRPO_SIMD=avx2 the AVX2 one where the CPU has it (scalar where it does not).
const StageKernels& kernels();

// The scalar element conversions shared by both paths and by the drivers,
// bf16_to_float and float_to_bf16 (round to nearest even; NaN stays NaN),
// are bf16.hpp's.

}  // namespace grpo::kernels
