// The step's forward pass (ForwardPass): per token block, tasks over vocab
// tiles run the logits tile = hidden rows x W tile (a single-threaded GEMM in
// the task), then the row-statistics stage on the tile while it is in cache;
// with keep, the block buffer keeps x - max per tile. Then per row, the tile
// statistics (every shard's, StepExchange) merged in tile order -> LSE,
// logp, entropy.
#pragma once

#include <cstdint>
#include <memory>

#include "driver/step_state.hpp"

namespace grpo::detail {

class ForwardPass : public StepPart {
 public:
  using StepPart::StepPart;

  // Logits, statistics, LSE, logp and entropy of rows [b0, b0 + nb). Every
  // logits GEMM call has exactly forward_rows rows (see kForwardRows), or
  // ForwardPlan::tail_rows for the shorter last block that has its own GEMMs: a
  // partial last chunk is copied to the stage buffer and zero-padded.
  void block(std::int64_t b0, std::int64_t nb, bool keep);

  // block() of the rows gathered by LmHeadStep::gather_active() (block row i
  // is row b0 + active[i]), with keep: the generic head's backward recomputes
  // only the logits of rows with a nonzero upstream gradient. The GEMM calls
  // have forward_rows rows and the forward's row stride, so each row's logits
  // are bitwise the forward pass's.
  void gathered(std::int64_t b0, std::int64_t na);

 private:
  // The forward of nb rows by `gemms`, calls of fr rows: chunk_source(c) is
  // the GEMM's A operand for rows [c * fr, (c + 1) * fr) (fr rows of stride
  // hidden_ld), row_of(r) the batch row of block row r.
  template <class ChunkSource, class RowOf>
  void compute_rows(std::int64_t nb, bool keep, const FullAndLast<std::unique_ptr<kernels::Gemm>>& gemms,
                    std::int64_t fr, ChunkSource&& chunk_source, RowOf&& row_of);
};

}  // namespace grpo::detail
