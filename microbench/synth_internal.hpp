// What the input synthesizers share (synth.cpp: the random generator;
// synth_trained.cpp: trained-like inputs; input_file.cpp: inputs read from a
// file): the counter-based random streams and the dtype-aware store. Not part
// of the microbench's interface.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "synth.hpp"

namespace grpo::bench::detail {

// Each tensor draws from its own stream, so adding a tensor never changes another.
enum class Tensor : std::uint64_t {
  hidden = 1,
  hidden_chi,
  weight,
  bias,
  logits,
  ids,
  advantages,
  zero_pick,
  old_noise,
  ref_noise,
  is_weight,
  peaky,
  // trained_like (synth_trained.cpp)
  frequency_order,
  background_table,
  target_entropy,
  candidates,
  chosen,
  stats_rows,
};

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// splitmix64's finalizer: a bijective 64-bit mix, good enough for test data.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Stream {
  std::uint64_t key;
  Stream(std::uint64_t seed, Tensor t, std::uint64_t sub = 0)
      : key(mix64(mix64(seed + kGolden) ^ (static_cast<std::uint64_t>(t) * kGolden) ^ mix64(sub))) {}
  std::uint64_t bits(std::uint64_t i) const { return mix64(key + (i + 1) * kGolden); }
  // Uniform in (0, 1), never 0 or 1.
  double uniform(std::uint64_t i) const { return (static_cast<double>(bits(i) >> 11) + 0.5) * 0x1p-53; }
  // Box-Muller on the two halves of one draw.
  double normal(std::uint64_t i) const {
    const std::uint64_t b = bits(i);
    const double u1 = (static_cast<double>(b >> 32) + 0.5) * 0x1p-32;
    const double u2 = (static_cast<double>(b & 0xffffffffULL) + 0.5) * 0x1p-32;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Sum of four 16-bit uniforms, centred and scaled to unit variance: about
  // ten times cheaper than Box-Muller, used for the V*H weight entries whose
  // shape does not matter (each logit sums H of them, so it is Gaussian anyway).
  float approx_normal(std::uint64_t i) const {
    const std::uint64_t b = bits(i);
    const auto sum = static_cast<float>((b & 0xffff) + ((b >> 16) & 0xffff) + ((b >> 32) & 0xffff) + (b >> 48));
    constexpr float kScale = 1.7320508F / 65536.0F;  // sqrt(12 / 4) per unit of 2^16
    return (sum + 2.0F - 2.0F * 65536.0F) * kScale;
  }
};

// f(begin, end) over [0, n) in chunks of 2^16 (grain), in a task_arena of
// `threads` (0 = the current arena's concurrency).
template <class F>
void parallel_ranges(std::size_t n, int threads, F&& f, std::size_t grain = std::size_t{1} << 16) {
  tbb::task_arena arena(threads > 0 ? threads : tbb::this_task_arena::max_concurrency());
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, grain),
                      [&](const tbb::blocked_range<std::size_t>& r) { f(r.begin(), r.end()); });
  });
}

inline void store(const HostBuffer& buf, DType dtype, std::size_t i, float v) {
  if (dtype == DType::f32) {
    std::memcpy(buf.data() + 4 * i, &v, 4);
  } else {
    const std::uint16_t b = dtype == DType::f16 ? float_to_f16(v) : float_to_bf16(v);
    std::memcpy(buf.data() + 2 * i, &b, 2);
  }
}

// Filled by fill_batch_tensors before the generator runs: ids, mask,
// advantages, is_weight and the loss config's autos.
void fill_batch_tensors(const ProblemSpec& s, Problem& p);

// The trained-like LM head (synth_trained.cpp): hidden, weight and ids.
void fill_trained_like(const ProblemSpec& s, Problem& p);

// An LM head read from InputSpec::path (input_file.cpp): hidden, weight, ids,
// mask and advantages.
void fill_from_file(const ProblemSpec& s, Problem& p);

}  // namespace grpo::bench::detail
