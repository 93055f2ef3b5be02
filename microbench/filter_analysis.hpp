// grpo-microbench --analyze-filter: the evidence for the filtered backward's
// clustering (issue 20, item 2). On sampled row segments of a config's
// inputs, the fraction of (row block x vocab tile) blocks whose every entry
// has |p_v - onehot_v| < eps (eps = 2^-12), i.e. the share of the backward
// GEMMs' FLOPs a block filter could skip, for several block shapes and three
// column orders:
//   natural    vocabulary ids in order
//   avg_logit  descending average forward logit (CCE's order; the average over
//              the valid rows of z = W h is W times the average h, one GEMV)
//   sig_count  descending count of significant entries per column over the
//              analysed rows. The forward pass computes every p, so it could
//              count them over the whole batch and hand the backward this
//              order; with --analyze-segments 0 (every row) this is that
//              order; on sampled segments it is optimistic (fewer rows, fewer
//              distinct significant columns to pack).
//   sig_heldout  (two segments or more) the sig_count order taken on the
//              even-numbered segments and scored on the odd ones: an order
//              fixed before the rows it serves, as one from an earlier pass or
//              an earlier step would be.
// Row blocks are aligned to their segment's start (segments start at
// multiples of 32 rows; with 0, at multiples of 320).
// Every valid row counts as active (a zero advantage would skip its row in
// the exact path already); masked rows have no significant entries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_config.hpp"
#include "input_stats.hpp"

namespace grpo::bench {

struct FilterAnalysisOptions {
  // Row segments of kFilterSegmentRows rows each, spread over the batch;
  // 0: every row, segment after segment (the logits of one segment at a time).
  int segments = 2;
  std::vector<std::int64_t> block_rows = {32, 64, 160};
  // 1 column: a filter that gathers each row block's significant columns
  // (the FLOPs a per-block compaction would leave); 2048: the driver's tile.
  std::vector<std::int64_t> tile_cols = {1, 16, 64, 256, 2048};
  double eps = kFilterEpsBf16;
};

// lcm(32, 64, 160): every default row block tiles a segment exactly.
inline constexpr std::int64_t kFilterSegmentRows = 320;

struct FilterBlockResult {
  std::string order;  // natural | avg_logit | sig_count | sig_heldout
  std::int64_t block_rows = 0, tile_cols = 0;
  double skip_frac = 0.0;  // FLOP-weighted fraction of blocks with no significant entry
};

struct FilterAnalysis {
  InputStats stats;  // over the analysed rows
  std::vector<FilterBlockResult> blocks;
  double synth_s = 0.0, analysis_s = 0.0;  // building the inputs; the reference logits and the blocks
  std::string table() const;
};

FilterAnalysis analyze_filter(const BenchConfig& config, const FilterAnalysisOptions& options);

}  // namespace grpo::bench
