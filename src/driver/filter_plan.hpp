// The filtered backward's plan and workspace (LmHeadOptions::grad_filter;
// FilteredBackward, filtered_backward.hpp): its constants, its own GEMMs
// (FilterPlan, created with the plan's others for every block the search
// tries), its regions of the step's workspace booked through the registry
// (kept_columns and kept_lo as packed pieces, tail as aligned pieces) and
// its typed views of them (FilterRegions). A plan without a filter has
// none of it (LmHeadPlanData::filter is null).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "driver/lm_head_plan.hpp"
#include "driver/workspace_registry.hpp"

namespace grpo::detail {

// The filtered backward (LmHeadOptions::grad_filter) runs its GEMMs over a
// block's kept vocabulary columns in groups of this many (the last one
// zero-padded): dW of one group is a [kKeptTile, H] f32 slot buffer, then
// added into the kept rows of dW.
inline constexpr std::int64_t kKeptTile = 256;
// The filtered backward gives the left-out entries back in a subspace of
// this many directions (FilteredBackward's tail correction): dhidden in a basis of
// W's rows, dW in a basis of the block's hidden rows. The left-out entries
// of a trained model's logits are each tiny but many (~150k per row at Qwen's
// vocabulary), and their sum points along the few directions most rows of W
// share; 8 directions, the first their plain sum, take that coherent part.
inline constexpr std::int64_t kTailRank = 8;
// Remainders a block row may carry (its entries at or above the filter's
// threshold: ~12-96 per row on the trained-like inputs, 16 on the A/B head).
inline constexpr std::int64_t kKeptRemainders = 512;
// Columns of the tail GEMM operands that carry a rank-k value split in two
// bf16 halves (hi, lo), and of the dW apply GEMM's [hi, hi, lo] x [hi; lo; hi]
// (padded to the AMX tile's 32 rows of K).
inline constexpr std::int64_t kTailPair = 2 * kTailRank;
inline constexpr std::int64_t kTailApplyLd = 32;
// The basis of W's rows is sketched from every kTailSketchStride-th row (of
// a vocab-major W; every row of a hidden-major one, whose sampled rows would
// be columns two strides apart, which oneDNN's memory descriptors refuse), in
// GEMMs of kTailRows rows (>= kTailRank + kTailProbes; two AMX tiles of 16).
inline constexpr std::int64_t kTailSketchStride = 8;
inline constexpr std::int64_t kTailRows = 32;
// The guard of grad_filter = auto (FilteredBackward::guard_holds): beside the
// basis, kTailProbes random directions orthogonal to it ride in the same
// tail GEMMs; a left-out sum's coordinates along them estimate the norm of
// what the correction leaves (E sum_j (q_j x)^2 = m |x|^2 / (H - k) for x off
// the basis). A block runs filtered only while that estimate is within
// kGuardRatio of the exact step's own error there (its bf16 roundings of the
// kept entries), for dhidden per block and for dW summed over the call's
// blocks so far; else it tries a lower threshold (kFilterRungs) or runs the
// exact GEMMs. Measured over the head families of
// python/grpo/head_families.py (docs/filtered_backward.md): both estimates
// within 0.84-1.33x of the errors they estimate, so 0.75 keeps the filtered
// gradients under the exact step's error there. What the estimate can
// miss: a left-out sum along one direction only, whose probe coordinates
// are then a chi-square of m degrees; it passes a block at 1.2x the exact
// error when that falls under (0.75 / 1.2)^2 = 0.39 of its mean: p = 0.073
// with 8 probes, 0.0033 with 24 (24 + 8 = the AMX tile's 32 rows).
inline constexpr std::int64_t kTailProbes = 24;
inline constexpr std::int64_t kTailCoords = kTailRank + kTailProbes;      // a coordinate row: basis, then probes
inline constexpr std::int64_t kTailPairProbes = kTailPair + kTailProbes;  // hidden rows' [hi, lo, probes]
inline constexpr double kGuardRatio = 0.75;
// A block the guard refuses tries lower thresholds, eps / 4^r for r = 1..5
// (down to eps / 1024), before the exact GEMMs: what the correction leaves
// is mostly the sum of many small entries, not a direction a basis could
// hold. On python/grpo/head_families.py's heads at T=512 H=1024 V=151936
// (Zen 5) three rungs let 4 of 9 run filtered, six rungs 8 of 9, at
// 60-99% of the backward left out (docs/filtered_backward.md).
inline constexpr int kFilterRungs = 6;
static_assert(kTailCoords <= kTailRows, "the W projection GEMM's rows hold the basis and the probes");
// A dense row: nearly uniform (entropy above ln V - kDenseRowEntropyGap,
// support beyond ~V / 20 columns) with entries under the filter's threshold
// adding up to more than kDenseRowMass of its scale (|a| + |b|, see the
// rule). Its left-out mass is most of its gradient and points along
// E_p[W] - mean W, which depends on the row and which no fixed basis holds
// (measured on the A/B's real head: rows of 9-11.4 nats, 47-430x the exact
// step's row error after the tail correction). Its dhidden is computed over
// every column (up to kRowQuantum such rows per block, else the block runs
// the exact GEMMs). Peaked rows whose tail is heavy (trained-like inputs up
// to 6 nats) are left to the tail correction, which holds them.
inline constexpr float kDenseRowMass = 0.25F;
inline constexpr float kDenseRowEntropyGap = 3.0F;
inline constexpr std::int64_t kDenseRows = 8;

struct FilterPlan {
  // eps (LmHeadOptions::grad_filter, or auto's), the kept columns' GEMM
  // group (kKeptTile, or less for a small vocabulary) and the most kept
  // columns a block may have and still run filtered (a multiple of
  // kept_tile, <= V: the row stride of the compacted dlogits, written in
  // place over the block buffer).
  float eps = 0.0F;
  std::int64_t kept_tile = 0;
  std::int64_t kept_cap = 0;
  // With bf16 dlogits the kept entries also carry their rounding's remainder
  // (lo = g - bf16(g), a second bf16 GEMM pass): per block row, room for the
  // remainders of this many entries at or above the row's threshold
  // (Region::kept_lo, kKeptRemainders); a block with a row holding more runs
  // the exact GEMMs. 0 with f32 dlogits (nothing to carry).
  std::int64_t kept_lo_cap = 0;
  // The tail correction's rank (kTailRank) and the stride of the W rows its
  // sketch samples (kTailSketchStride or 1).
  std::int64_t tail_rank = 0;
  std::int64_t tail_stride = 1;
  // grad_filter = auto: a block runs filtered only where the guard's
  // estimate of what the filter leaves out holds (kGuardRatio).
  bool guard = false;

  // Every GEMM below, gone (before another try of the plan's block builds its own).
  void release_gemms() {
    dweight_kept.clear();
    dhidden_kept.clear();
    dweight_kept_lo.clear();
    tail_dhidden.clear();
    tail_dweight.clear();
    tail_hidden.clear();
    tail_project = {};
    tail_sketch = {};
    dense_dhidden = {};
    tail_apply = {};
  }

  // The filtered backward's, indexed alike: dW of a group of kept columns
  // into a slot's f32 [kept_tile, H] (empty with frozen_weight); dhidden
  // chunk += kept dlogits [k, kept_tile] x the group's gathered W rows
  // [kept_tile, chunk] (ld hidden_chunk) [chunk kind].
  std::vector<std::unique_ptr<kernels::Gemm>> dweight_kept;
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> dhidden_kept;
  // dweight_kept accumulating (the remainders' pass), with kept_lo_cap.
  std::vector<std::unique_ptr<kernels::Gemm>> dweight_kept_lo;
  // The tail correction's (FilteredBackward::tail_block), per
  // rung: dlogits tile [k, cols] x A tile [cols, kTailRank] -> f32 [k,
  // kTailRank]; dlogits tile^T [cols, k] x the hidden rows' coordinates [k,
  // kTailPair] -> f32 [cols, kTailPair] (empty with frozen_weight); the active
  // hidden rows [k, H] x the hidden basis^T [H, kTailRank] -> f32.
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> tail_dhidden;
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> tail_dweight;
  std::vector<std::unique_ptr<kernels::Gemm>> tail_hidden;
  // Per call: W's basis rows [kTailRows, H] x W tile^T -> f32 [kTailRows,
  // cols] (A = W B^T), and dW tile += C [cols, kTailApplyLd] x D
  // [kTailApplyLd, H] (either layout; empty with frozen_weight).
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_project;
  // Omega [kTailRows, V / tail_stride] x W's sampled rows [., chunk] -> f32 [kTailRows, chunk] (ld H).
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_sketch;
  // The dense rows' dhidden chunk: their dlogits [kDenseRows, V] x W[:, chunk] (dhidden's spec).
  FullAndLast<std::unique_ptr<kernels::Gemm>> dense_dhidden;
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_apply;
};

// The filter a plan of this shape and options runs, before its GEMMs exist;
// null when grad_filter is off, the plan is forward-only or V is too small
// to leave a column out.
std::unique_ptr<FilterPlan> make_filter_plan(const LmHeadShape& shape, const LmHeadOptions& options);
// Whether every GEMM the filter would create for rows of kRowQuantum has rows
// independent of M (the plan's row ladder is then the dense one).
bool filter_gemms_m_independent(const LmHeadPlanData& p, std::int64_t chunk);
// The filter's GEMMs for the plan's block and row ladder (p.filter set).
void create_filter_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed);
// Its regions (kept_columns, kept_lo, tail), its uses of the block and stage
// buffers (RegionUse), and the bytes its per-slot buffers need of a slot's
// GEMM tile.
void book_filter(const LmHeadPlanData& p, WorkspaceRegistry& w);
std::size_t filter_slot_tile_bytes(const LmHeadPlanData& p);

// The filter's uses of a slot's GEMM tile booked in pieces
// (WorkspaceRegistry::book_slot_pieces), and their pieces:
//   marked_row    one row's f32 dlogits [tile], its own marks [tile] and their
//                 columns [tile] (bf16 dlogits: FilteredBackward::tile_dlogits)
//   tail_terms    a tile's dW coordinates [tile, kTailPairProbes], the kept
//                 columns' A rows [tile, kTailCoords] and places [tile] (tail_block)
//   kept_dweight  a group of kept columns' f32 dW rows [kept_tile, H] (backward_kept)
//   kept_w        their W rows of a hidden chunk [kept_tile, hidden_chunk], input dtype
//   tail_project  W's projection on the basis and probes [kTailRows, tile] f32 (prepare)
struct FilterSlotUse {
  static constexpr std::size_t kMarkedRow = 0, kTailTerms = 1, kKeptDweight = 2, kKeptW = 3, kTailProject = 4;
  static constexpr std::size_t kRow = 0, kOwnMarks = 1, kFound = 2;   // marked_row's pieces
  static constexpr std::size_t kCoords = 0, kKeptA = 1, kKeptAt = 2;  // tail_terms'
};

// The filtered backward's per-block bookkeeping (Region::kept_columns):
// a mark per vocab column, the kept columns (each tile's at its first column,
// then all of them from 0), and each tile's count.
struct KeptColumns {
  std::span<std::int64_t> count;  // [tiles]
  std::span<std::int32_t> column;
  std::span<std::int32_t> index;  // [V] a kept column's place among them (kept columns only)
  std::span<std::uint8_t> mark;
};

// The kept entries' bf16 remainders (Region::kept_lo, FilterPlan::kept_lo_cap
// per block row): per row a count, then columns and remainders (the row's
// entries at or above its threshold, in the order the tiles wrote them).
struct KeptRemainders {
  std::int32_t* count = nullptr;   // [rows]
  std::int32_t* column = nullptr;  // [rows, cap]
  std::uint16_t* value = nullptr;  // [rows, cap]
};

// The tail correction's pieces of Region::tail (FilteredBackward::tail_block;
// k = kTailRank, kc = kTailCoords: k, then the guard's probes; pair =
// kTailPairProbes: the hidden rows' [hi, lo, probes]), in workspace order.
// Per call: A = W B_w^T per vocab column, the duals of both bases, the hidden
// basis, the apply GEMM's B, dW's coordinates C_w [V, k], which columns some
// block left out, and double scratch for the bases, the dense rows' dlogits
// and dhidden. Per block row: the hidden rows' coordinates (f32 and as bf16
// pairs), dhidden's coordinates, each tile's partial sums, the |g| each tile
// may leave out and the row's threshold scale.
enum class TailPiece : std::uint8_t {
  coord,        // [V, kc] dlogits dtype: A = W B_w^T, then W's probe coordinates
  dual_w,       // [k, H] f32
  dual_h,       // [k, H] f32
  basis_h,      // [kc, H] input dtype: the hidden basis, then its probes
  apply_b,      // [kTailApplyLd, H] dlogits dtype
  cdw,          // [V, k] f32
  left,         // [V] 1: some block left the column out
  work,         // [kc, H + kc] double
  dense,        // [kDenseRows, V] dlogits dtype: the dense rows' dlogits
  dense_out,    // [kRowQuantum, H] f32: the block's dense rows' dhidden
  dense_block,  // [kRowQuantum] int64: the block's dense rows, active indices
  pending,      // [V, kc] f32: the block's dW coordinates and probe sums, before the guard
  probe_w,      // [V, kc - k] f32: the probe sums of the blocks run filtered so far
  norm_w,       // [V] f32: |W_v|^2
  hidden_pair,  // [rows, pair] dlogits dtype
  below,        // [rows, tiles] f32: |g| under the threshold per row and tile
  row_scale,    // [rows] f32: the row's threshold / eps
  hidden_f,     // [rows, kc] f32
  cdh,          // [rows, kc] f32
  partial,      // [tiles, rows, kc] f32
  // Per row and tile, over its entries at or above the threshold: the sum of
  // d^2 |W_v|^2 and of d^2, d its dlogits rounding (the exact step's error there).
  err_h,  // [rows, tiles] f32
  err_w,  // [rows, tiles] f32
  count,
};

struct TailRegions {
  std::byte* coord = nullptr;
  float* dual_w = nullptr;
  float* dual_h = nullptr;
  std::byte* basis_h = nullptr;
  std::byte* apply_b = nullptr;
  float* cdw = nullptr;
  std::uint8_t* left = nullptr;
  double* work = nullptr;
  std::byte* dense = nullptr;
  float* dense_out = nullptr;
  std::int64_t* dense_block = nullptr;
  float* pending = nullptr;
  float* probe_w = nullptr;
  float* norm_w = nullptr;
  std::byte* hidden_pair = nullptr;
  float* below = nullptr;
  float* row_scale = nullptr;
  float* hidden_f = nullptr;
  float* cdh = nullptr;
  float* partial = nullptr;
  float* err_h = nullptr;
  float* err_w = nullptr;
};

// The filter's views of a call's workspace, as the registry laid its pieces out.
struct FilterRegions {
  FilterRegions(std::byte* ws, const WorkspaceLayout& l);
  KeptColumns kept;
  KeptRemainders kept_lo;
  TailRegions tail;
  // Its uses of the block and stage buffers (RegionUse), each empty when not booked:
  std::span<std::byte> kept_dlogits;     // the block's first bytes: [rows, kept_cap] dlogits, compacted in place
  std::span<std::byte> kept_remainders;  // then [rows, kept_cap] bf16 remainders (bf16 dlogits)
  std::span<std::byte> tail_sketch;      // [kTailRows, V / tail_stride] dlogits dtype
  std::span<std::byte> tail_apply;       // [V, kTailApplyLd] dlogits dtype
  std::span<std::byte> tail_probes;      // [kTailRows, hidden_ld] input dtype
};

}  // namespace grpo::detail
