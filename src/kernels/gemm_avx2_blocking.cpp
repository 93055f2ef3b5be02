#include "kernels/gemm_avx2_blocking.hpp"

#include <algorithm>

namespace grpo::kernels::avx2 {

Blocking plan_blocking(const GemmSpec& spec) {
  Blocking p;
  p.m = spec.a.rows;
  p.k = spec.a.cols;
  p.n = spec.b.cols;
  const std::int64_t k_blocks = p.k <= kKcSingle ? 1 : (p.k + kKcMax - 1) / kKcMax;
  p.kc = (p.k + k_blocks - 1) / k_blocks;
  p.threads = std::max(1, spec.threads);
  // Each thread's share of the columns, in whole panels.
  const std::int64_t panels = (p.n + kNr - 1) / kNr;
  p.cols_per_thread = (panels + p.threads - 1) / p.threads * kNr;
  p.threads = static_cast<int>(std::min<std::int64_t>(p.threads, (p.n + p.cols_per_thread - 1) / p.cols_per_thread));
  p.nc = std::min(p.cols_per_thread, kNcMax);
  p.mc = std::min(round_up(p.m, kMr), kMc);
  p.b_bytes = align_up(static_cast<std::size_t>(p.kc * p.nc) * sizeof(float));
  p.a_bytes = align_up(static_cast<std::size_t>(p.kc * p.mc) * sizeof(float));
  p.tile_bytes = align_up(static_cast<std::size_t>(kMr * kNr) * sizeof(float));
  p.acc_ld = round_up(p.n, kNr);
  p.acc_bytes = k_blocks > 1 ? align_up(static_cast<std::size_t>(round_up(p.m, kMr) * p.acc_ld) * sizeof(float)) : 0;
  p.per_thread = p.b_bytes + p.a_bytes + p.tile_bytes;
  return p;
}

}  // namespace grpo::kernels::avx2
