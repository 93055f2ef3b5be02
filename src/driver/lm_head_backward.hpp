// The step's dense backward (DenseBackward): every gradient exact. Per token
// block, its active rows (nonzero upstream) compacted to the top of the block:
// tasks over vocab tiles write dlogits in place over the block buffer, add
// dbias, then run dW tile (+)= dlogits tile^T x active hidden rows while the
// tile is in cache; then tasks over hidden chunks run dhidden = dlogits x W
// chunk. The filtered backward (filtered_backward.hpp) reuses its pieces: the
// dlogits rows, the dW tiles and dhidden GEMMs of a block it does not filter,
// the counters, the dhidden rows' output.
#pragma once

#include <cstdint>

#include "driver/step_state.hpp"

namespace grpo::detail {

// One block's backward: block rows [b0, b0 + nb), of which na are active
// (active[0, na)), padded to `padded` GEMM rows; the statistics and stored
// logits of active row i sit at row active[i] (the fused forward's block) or,
// when compacted, at row i (ForwardPass::gathered). The upstream
// coefficients a_r = logp_coef[r] (dL/dlogp) and, when entropy_coef is
// non-null, b_r = entropy_coef[r] (dL/dEnt), r the block row, times the
// call's scales.
struct BackwardBlock {
  std::int64_t b0 = 0, nb = 0, na = 0, padded = 0;
  bool compacted = false;
  const float* logp_coef = nullptr;
  const float* entropy_coef = nullptr;
  float logp_scale = 1.0F, entropy_scale = 1.0F;
  float* dbias = nullptr;  // null: no bias gradient
};

class DenseBackward : public StepPart {
 public:
  using StepPart::StepPart;

  // The block's gradients through the dense GEMMs.
  void block(const BackwardBlock& b, bool* dweight_written);

  // Active row i's dlogits in vocab tile j into out (+ dbias); returns |a| +
  // |b|, the row's coefficient scale (the filter's threshold is eps times it).
  float row_dlogits(const BackwardBlock& b, std::int64_t i, std::int64_t j, void* out, kernels::Elem out_type) const;
  // Rows [na, padded) of tile j's dlogits set to zero: padding rows add exact zeros.
  void zero_padding(const BackwardBlock& b, std::int64_t j) const;
  // The block's active hidden rows packed once for every dW GEMM that takes
  // them (gemm's shared operand; all of a block's dW GEMMs pack them alike,
  // only the dlogits side differs); null when the backend reads them as they are.
  const void* pack_active_rows(const kernels::Gemm& gemm) const;
  // Tile j's dW GEMM over every column of the tile.
  void tile_dweight(std::int64_t j, int slot, std::int64_t padded, bool accumulate, const void* packed_act);
  // dhidden_act = dlogits x W over every column, per hidden chunk.
  void dhidden(std::int64_t padded);
  // What the block's backward moves (LmHeadStepStats::schedule_bytes, and
  // the filter's skipped row-columns): `run` GEMM columns of V; kept: the
  // filtered GEMMs (filtered_backward.cpp) ran them.
  void count(const BackwardBlock& b, std::int64_t run, bool kept, bool dweight, bool dweight_written);
  // The block's dhidden: summed over a vocab group, written to the outputs
  // (zero rows where inactive); dweight_written updated.
  void finish(const BackwardBlock& b, bool dweight, bool* dweight_written);
  void zero_dhidden_rows(std::int64_t b0, std::int64_t nb) const;
  void zero_dweight() const;

 private:
  // dhidden's output row (f32, or rounded to bf16) from f32 src.
  // Returns the f16 entries that saturated (0 unless dhidden is f16).
  std::int64_t write_dhidden_row(std::int64_t row, const float* src) const;
  void zero_dhidden_row(std::int64_t row) const;
};

}  // namespace grpo::detail
