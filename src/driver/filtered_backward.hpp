// The filtered backward (LmHeadOptions::grad_filter; docs/filtered_backward.md),
// the backward strategy a plan with a filter chose (LmHeadPlanData::filter). Per token block:
//   dlogits    the tiles write dlogits as the dense backward does and mark
//              the kept columns (an entry at or above eps times its row's
//              coefficient scale); with bf16 dlogits the kept entries'
//              remainders g - bf16(g) are listed per row (KeptRemainders).
//   decide     kept columns past kept_cap, a remainder list overflowing, more
//              dense rows than a block holds, or (grad_filter = auto) the
//              guard refusing at every rung: the dense backward's GEMMs,
//              bitwise the unfiltered block.
//   kept GEMMs the kept columns compacted in place, dW per group of
//              kept_tile columns into a slot buffer added into dW's kept rows,
//              dhidden against the groups' gathered W rows (filtered_backward.cpp).
//   tail       what was left out, back through a rank-k correction: dhidden
//              in a basis of W's rows, dW in a basis of the hidden rows
//              (filter_tail.cpp), and nearly uniform rows' dhidden over every
//              column (the dense rows).
#pragma once

#include <atomic>
#include <cstdint>

#include "driver/filter_plan.hpp"
#include "driver/lm_head_backward.hpp"
#include "driver/step_state.hpp"

namespace grpo::detail {

class FilteredBackward : public StepPart {
 public:
  FilteredBackward(StepState& s, DenseBackward& dense)
      : StepPart(s), f_(*s.plan.filter), fws_(s.workspace, s.plan.layout), dense_(dense) {}

  // The block's gradients: filtered, or through the dense GEMMs.
  void block(const BackwardBlock& b, bool* dweight_written);

  // The tail correction, per call (before any block): a rank-k basis B_w of
  // W's rows (a randomized range finder: the sketch Omega W of every
  // tail_stride-th row, Omega's first row all ones, the rest random signs),
  // its dual, and A = W B_w^T per vocab column in the dlogits dtype (the
  // tail_project GEMMs; bf16's 2^-9 on a correction that is itself a few
  // percent of dhidden). Depends on W alone.
  void prepare();
  // Adds the tail's dW part (tail_block's coordinates C_w of every column some
  // block left out, times the hidden basis' dual) into dW: dW tile += C D
  // through the tail_apply GEMMs. After the last block.
  void finish();

 private:
  // Tile j's dlogits rows (+ dbias) and its kept columns. With bf16 dlogits
  // (kept_lo_cap > 0) each row is computed in f32 in the slot's tile, written
  // rounded as the kernel rounds, and each entry at or above the row's
  // threshold (the entries whose rounding matters; the kept columns are
  // theirs) leaves its remainder g - bf16(g) in the row's list in kept_lo.
  void tile_dlogits(const BackwardBlock& b, std::int64_t j, int slot);

  // The tail correction of a block that runs filtered, before the kept
  // columns are compacted (every dlogits entry still in the block buffer):
  //   dhidden row t += (sum over left-out v of g_tv A_v) dual_w: the left-out
  //     entries' sum projected onto span(B_w), as the tile GEMMs' g A over all
  //     columns minus the kept columns' own terms, summed in tile order;
  //   dW column v += (sum over t of g_tv H_t) dual_h for every left-out v,
  //     H_t the hidden row's coordinates in a basis B_h of the hidden rows
  //     (made from the call's first filtered block), accumulated in C_w over
  //     the blocks and applied once by finish().
  // The error left is the left-out entries' part orthogonal to the basis.
  void tail_block(std::int64_t padded, std::int64_t na, bool dweight);
  // Tile j's partial sums less the terms of the columns marked `tag` (the
  // kept GEMMs have them): their A rows gathered after the slot's dW
  // coordinates [cols, kTailPairProbes], then row by row.
  void tile_kept_terms(std::int64_t j, int slot, std::int64_t na, std::uint8_t tag) const;
  // dhidden's tail coordinates (and probes), the tiles' partial sums added in tile order.
  void sum_tail_partials(std::int64_t na) const;
  // The guard's ladder, rung >= 1: every column no row keeps yet is kept
  // (marked rung + 1) where some active row's stored dlogits reach eps 4^-rung
  // of its scale; the kept columns listed again in column order. Returns
  // their count.
  std::int64_t keep_at_rung(std::int64_t na, int rung);
  // The tail coordinates after keep_at_rung(rung): less the newly kept columns' terms.
  void tail_kept_terms(std::int64_t na, int rung);
  // The block's tail dW coordinates (tail_block's pending) added to the
  // call's for every column it leaves out, and their probe sums to the guard's.
  void commit_tail_dweight();
  // The exact step's estimated error (squared) on the block, from its
  // roundings of the kept entries (err_h: sum d^2 |W_v|^2; err_w: sum d^2,
  // times |h_t|^2 here; the left-out entries' roundings are smaller by their
  // size, and leaving them out makes the estimate lower, so the guard
  // stricter): dhidden's over its rows but the dense ones (computed over
  // every column) is returned, dW's is added to the call's.
  double block_exact_errors(std::int64_t na, std::int64_t dense, bool dweight);
  // grad_filter = auto: whether the block may run filtered. What the filter
  // leaves of a row's dhidden after the tail correction is off the basis
  // B_w; its coordinates along the kTailProbes probes orthogonal to B_w
  // (cdh's last columns) estimate its norm: E sum_j (q_j x)^2 = m |x|^2 /
  // (H - k). dhidden: the block's rows (the dense rows aside) against
  // exact_dhidden (block_exact_errors). dW: a column's left-out sum adds up
  // over the blocks, so the probe sums of every block run filtered so far
  // plus this one's, against the exact step's error over every block so far.
  bool guard_holds(std::int64_t na, std::int64_t dense, bool dweight, double exact_dhidden) const;
  // |W_v|^2 of vocab columns [c0, c0 + cols) into out (the guard's weights):
  // a pass over W per call, in loops the compiler vectorizes.
  void column_norms(std::int64_t c0, std::int64_t cols, float* out) const;
  template <class E>
  void column_norms_of(std::int64_t c0, std::int64_t cols, float* out) const;
  // f32 dlogits: row i's tile-j share of the guard's exact-step error, each
  // entry at or above the threshold taken at its rounding's mean square
  // g^2 2^-48 / 3 (f32's unit roundoff 2^-24, uniform).
  void guard_row_errors(std::int64_t i, std::int64_t j, const float* g, std::int64_t cols, float threshold) const;
  // dhidden_act rows [0, na) += their tail coordinates x dual_w (after backward_kept).
  void tail_dhidden(std::int64_t na);

  // The block's dense rows (kDenseRowMass, kDenseRowEntropyGap), their active indices into
  // tail.dense_block; their count (more than kRowQuantum: the caller runs the
  // exact GEMMs).
  std::int64_t dense_rows(std::int64_t na, bool compacted) const;
  // The block's dense rows' dhidden over every column, before compaction
  // (their dlogits rows still whole): kDenseRows rows at a time copied to
  // tail.dense, the dense_dhidden GEMMs into tail.dense_out; block() copies
  // them over the rows' filtered dhidden.
  void dense_dhidden(std::int64_t dense);
  std::int64_t kept_groups(std::int64_t kept) const { return (kept + f_.kept_tile - 1) / f_.kept_tile; }
  // The filtered backward of a block whose kept columns (kept.column[0,
  // kept)) fit in kept_cap: the block buffer's dlogits [padded, V] compacted in
  // place to [padded, kept_cap] (the kept columns, then zeros up to a whole
  // group), dW of each group of kept_tile columns into a slot buffer added
  // into dW's kept rows, and dhidden from the groups against their gathered
  // W rows, in group order. With bf16 dlogits (kept_lo_cap) each GEMM runs
  // again on the kept entries' remainders, compacted alike past the matrix:
  // the kept part is then exact to ~2^-16, not bf16's 2^-9.
  void backward_kept(std::int64_t padded, std::int64_t na, std::int64_t kept, bool dweight,
                     const bool* dweight_written);

  const FilterPlan& f_;
  FilterRegions fws_;  // the filter's regions of the call's workspace
  DenseBackward& dense_;
  // Whether a row of the block had more remainders than kept_lo holds;
  // whether a block ran filtered (the tail's dW coordinates need applying)
  // and whether this call's hidden basis exists.
  std::atomic<bool> lo_overflow_{false};
  bool tail_used_ = false;
  bool hidden_basis_ready_ = false;
  // The guard (filter_guard): the exact step's estimated dW error (squared)
  // over the call's blocks so far.
  double exact_dweight_error_ = 0.0;
};

}  // namespace grpo::detail
