// The LM-head step's workspace, booked by name (as oneDNN's scratchpad
// registrar books a primitive's scratchpad): each region once, with its bytes
// per block row and its fixed bytes. The block-size search reads the per-row
// and fixed totals from the bookings, the plan lays the regions out from the
// same bookings, and the step gets typed views of them (StepRegions), so a
// region's size is written in one place.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

// Every region starts on a 64-byte boundary: a cache line, and the alignment
// the GEMM backends ask of their operands and scratchpads.
inline constexpr std::size_t kWorkspaceAlign = 64;

inline std::size_t align_workspace(std::size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// The regions in workspace order.
enum class Region : std::uint8_t {
  block,          // [block rows, V] stored logits, then dlogits in place (backward only)
  stage,          // [forward_rows, hidden_ld] input dtype: a partial forward chunk, zero-padded
  tile_stats,     // [block rows, tiles] RowStats
  row_arrays,     // per block row: RowArrays
  hidden_act,     // [block rows, hidden_ld] active hidden rows, input dtype (backward only)
  dhidden_act,    // [block rows, H] f32 (backward only)
  packed_hidden,  // the block's hidden rows as the GEMM backend packed them (Gemm::pack_shared)
  batch_arrays,   // per batch row: BatchArrays (two-pass schedule only)
  entropy_coef,   // [block rows] dLoss/dEnt (entropy bonus only)
  quantile,       // [N] floats: the top-entropy quantile's scratch (only when it is used)
  exchange,       // the exchanges of a plan over several processes (ScaleOutPlan)
  kept_columns,   // the filtered backward's: KeptColumns
  kept_lo,        // per block row: KeptRemainders (bf16 dlogits under the filter)
  tail,           // the filtered backward's tail correction: TailRegions
  count,          // the number of regions
};
inline constexpr std::size_t kRegionCount = static_cast<std::size_t>(Region::count);

// Regions whose size grows with the token block: the search's estimate
// allows each of them kWorkspaceAlign bytes for the rounding of its end.
inline constexpr std::size_t kRowRegions =
    10;  // block .. dhidden_act, packed_hidden, entropy_coef, exchange, kept_lo, tail

// Per block row: the chosen logit, LSE, logp, entropy, coefficient, KL term
// (floats), and the index of the row's place among the active rows.
struct RowArrays {
  static constexpr std::size_t kBytesPerRow = 6 * sizeof(float) + sizeof(std::int64_t);
  std::span<float> target, lse, logp, entropy, coef, kl;
  std::span<std::int64_t> active;
};

// Per batch row, for the two-pass schedule (LmHeadPlanData::two_pass): the
// first pass's logp, entropy and KL terms of every row, and the coefficients
// (dLoss/dlogp; dLoss/dEnt with an entropy bonus) the second pass reads.
struct BatchArrays {
  static std::size_t arrays(bool entropy_bonus) { return entropy_bonus ? 5 : 4; }
  std::span<float> coef, entropy, logp, kl;
  std::span<float> entropy_coef;  // empty without an entropy bonus
};

// The filtered backward's per-block bookkeeping (LmHeadOptions::grad_filter):
// a mark per vocab column, the kept columns (each tile's at its first column,
// then all of them from 0), and each tile's count.
struct KeptColumns {
  static std::size_t bytes(std::int64_t vocab, std::int64_t tiles) {
    return static_cast<std::size_t>(vocab) * (sizeof(std::uint8_t) + 2 * sizeof(std::int32_t)) +
           static_cast<std::size_t>(tiles) * sizeof(std::int64_t);
  }
  std::span<std::int64_t> count;  // [tiles]
  std::span<std::int32_t> column;
  std::span<std::int32_t> index;  // [V] a kept column's place among them (kept columns only)
  std::span<std::uint8_t> mark;
};

// The kept entries' bf16 remainders (LmHeadPlanData::kept_lo_cap per block
// row): per row a count, then columns and remainders (the row's entries at or
// above its threshold, in the order the tiles wrote them).
struct KeptRemainders {
  static std::size_t bytes_per_row(std::int64_t cap) {
    return sizeof(std::int32_t) + static_cast<std::size_t>(cap) * (sizeof(std::int32_t) + sizeof(std::uint16_t));
  }
  std::int32_t* count = nullptr;   // [rows]
  std::int32_t* column = nullptr;  // [rows, cap]
  std::uint16_t* value = nullptr;  // [rows, cap]
};

// The filtered backward's tail correction (LmHeadStep::tail_block; k =
// kTailRank), carved in one place for the booking and the views. Per call:
// A = W B_w^T per vocab column, the duals of both bases,
// the hidden basis, the apply GEMM's B, dW's coordinates C_w [V, k], which
// columns some block left out, and double scratch for the bases, the dense rows' dlogits and dhidden. Per block row:
// the hidden rows' coordinates (f32 and as bf16 pairs), dhidden's
// coordinates, each tile's partial sums, the |g| each tile may leave out and
// the row's threshold scale.
struct TailRegions {
  // The plan's sizes (tail_dims, lm_head_plan.hpp): rank k, the apply GEMM's
  // K (kTailApplyLd), rows per dense GEMM (kDenseRows) and per block (kRowQuantum).
  // rank k; coords kc: k, then the guard's probes (kTailCoords); pair: the
  // hidden rows' [hi, lo, probes] (kTailPairProbes).
  struct Dims {
    std::int64_t vocab = 0, hidden = 0, tiles = 0, rank = 0;
    std::size_t dl_size = 0, in_size = 0;
    std::int64_t apply_ld = 0, dense_rows = 0, dense_block = 0;
    std::int64_t coords = 0, pair = 0;
  };
  std::byte* coord = nullptr;           // [V, kc] dlogits dtype: A = W B_w^T, then W's probe coordinates
  float* dual_w = nullptr;              // [k, H]
  float* dual_h = nullptr;              // [k, H]
  std::byte* basis_h = nullptr;         // [kc, H] input dtype: the hidden basis, then its probes
  std::byte* apply_b = nullptr;         // [kTailApplyLd, H] dlogits dtype
  float* cdw = nullptr;                 // [V, k]
  std::uint8_t* left = nullptr;         // [V] 1: some block left the column out
  double* work = nullptr;               // [kc, H + kc]
  std::byte* dense = nullptr;           // [kDenseRows, V] dlogits dtype: the dense rows' dlogits
  float* dense_out = nullptr;           // [kRowQuantum, H] the block's dense rows' dhidden
  std::int64_t* dense_block = nullptr;  // [kRowQuantum] the block's dense rows, active indices
  float* pending = nullptr;             // [V, kc] the block's dW coordinates and probe sums, before the guard
  float* probe_w = nullptr;             // [V, kc - k] the probe sums of the blocks run filtered so far
  float* norm_w = nullptr;              // [V] |W_v|^2
  std::byte* hidden_pair = nullptr;     // [rows, pair] dlogits dtype
  float* below = nullptr;               // [rows, tiles] |g| under the threshold per row and tile
  float* row_scale = nullptr;           // [rows] the row's threshold / eps
  float* hidden_f = nullptr;            // [rows, kc]
  float* cdh = nullptr;                 // [rows, kc]
  float* partial = nullptr;             // [tiles, rows, kc]
  // Per row and tile, over its entries at or above the threshold: the sum of
  // d^2 |W_v|^2 and of d^2, d its dlogits rounding (the exact step's error there).
  float* err_h = nullptr;  // [rows, tiles]
  float* err_w = nullptr;  // [rows, tiles]

  // Fixed and per-row bytes as booked (the fixed part with every carved piece's alignment).
  static std::size_t fixed_bytes(const Dims& d) { return carve(d, 0, nullptr, nullptr) + 8 * kWorkspaceAlign; }
  static std::size_t per_row_bytes(const Dims& d) {
    const auto kc = static_cast<std::size_t>(d.coords);
    const auto tiles = static_cast<std::size_t>(d.tiles);
    return static_cast<std::size_t>(d.pair) * d.dl_size + 2 * kc * sizeof(float) + tiles * kc * sizeof(float) +
           (3 * tiles + 1) * sizeof(float);
  }
  TailRegions() = default;
  TailRegions(std::byte* base, const Dims& d, std::int64_t rows) { carve(d, rows, this, base); }

 private:
  // Lays the pieces out from base (when v is set); returns their aligned bytes.
  static std::size_t carve(const Dims& d, std::int64_t rows, TailRegions* v, std::byte* base) {
    std::size_t at = 0;
    const auto piece = [&](auto** to, std::size_t bytes) {
      if (v != nullptr) *to = reinterpret_cast<std::remove_pointer_t<decltype(to)>>(base + at);
      at += align_workspace(bytes);
    };
    const auto k = static_cast<std::size_t>(d.rank), h = static_cast<std::size_t>(d.hidden),
               vocab = static_cast<std::size_t>(d.vocab), r = static_cast<std::size_t>(rows);
    TailRegions ignore;
    TailRegions& t = v != nullptr ? *v : ignore;
    const auto kc = static_cast<std::size_t>(d.coords);
    const auto tiles = static_cast<std::size_t>(d.tiles);
    piece(&t.coord, vocab * kc * d.dl_size);
    piece(&t.dual_w, k * h * sizeof(float));
    piece(&t.dual_h, k * h * sizeof(float));
    piece(&t.basis_h, kc * h * d.in_size);
    piece(&t.apply_b, static_cast<std::size_t>(d.apply_ld) * h * d.dl_size);
    piece(&t.cdw, vocab * k * sizeof(float));
    piece(&t.left, vocab);
    piece(&t.work, kc * (h + kc) * sizeof(double));
    const auto block = static_cast<std::size_t>(d.dense_block);
    piece(&t.dense, static_cast<std::size_t>(d.dense_rows) * vocab * d.dl_size);
    piece(&t.dense_out, block * h * sizeof(float));
    piece(&t.dense_block, block * sizeof(std::int64_t));
    piece(&t.pending, vocab * kc * sizeof(float));
    piece(&t.probe_w, vocab * (kc - k) * sizeof(float));
    piece(&t.norm_w, vocab * sizeof(float));
    piece(&t.hidden_pair, r * static_cast<std::size_t>(d.pair) * d.dl_size);
    piece(&t.below, r * tiles * sizeof(float));
    piece(&t.row_scale, r * sizeof(float));
    piece(&t.hidden_f, r * kc * sizeof(float));
    piece(&t.cdh, r * kc * sizeof(float));
    piece(&t.partial, tiles * r * kc * sizeof(float));
    piece(&t.err_h, r * tiles * sizeof(float));
    piece(&t.err_w, r * tiles * sizeof(float));
    return at;
  }
};

struct WorkspaceLayout {
  std::array<std::size_t, kRegionCount> offset{};
  std::array<std::size_t, kRegionCount> bytes{};  // as booked (before alignment)
  std::size_t slots = 0;                          // offset of the slots: per slot, a GEMM tile + a GEMM scratchpad
  std::size_t slot_bytes = 0;                     // one slot
  std::size_t tile_bytes = 0;                     // its GEMM tile part
  std::size_t total = 0;

  std::size_t at(Region r) const { return offset[static_cast<std::size_t>(r)]; }
};

class WorkspaceRegistry {
 public:
  // Region r takes per_row bytes per block row plus fixed bytes (either may be 0).
  void book(Region r, std::size_t per_row, std::size_t fixed = 0) {
    bookings_[static_cast<std::size_t>(r)] = {per_row, fixed};
  }
  // Each slot (a concurrent tile task): a [forward_rows, tile] f32 GEMM tile and a GEMM scratchpad.
  void book_slot(std::size_t tile_bytes, std::size_t scratchpad_bytes) {
    tile_bytes_ = align_workspace(tile_bytes);
    slot_bytes_ = tile_bytes_ + align_workspace(scratchpad_bytes);
  }

  // Bytes the regions take per block row (slots excluded).
  std::size_t bytes_per_row() const {
    std::size_t b = 0;
    for (const Booking& k : bookings_) b += k.per_row;
    return b;
  }
  // Bytes that depend on neither the block nor the slots, with the rounding
  // of every region's end: an upper bound on a layout's regions beside
  // bytes_per_row() * block rows.
  std::size_t fixed_bytes() const {
    std::size_t b = kRowRegions * kWorkspaceAlign;
    for (const Booking& k : bookings_) b += align_workspace(k.fixed);
    return b;
  }

  // The regions for blocks of `rows` rows (block_rows_alloc), then `slots` slots.
  WorkspaceLayout lay_out(std::int64_t rows, int slots) const {
    WorkspaceLayout l;
    std::size_t at = 0;
    for (std::size_t r = 0; r < kRegionCount; ++r) {
      l.offset[r] = at;
      l.bytes[r] = bookings_[r].per_row * static_cast<std::size_t>(rows) + bookings_[r].fixed;
      at += align_workspace(l.bytes[r]);
    }
    l.tile_bytes = tile_bytes_;
    l.slot_bytes = slot_bytes_;
    l.slots = at;
    l.total = at + slot_bytes_ * static_cast<std::size_t>(slots);
    return l;
  }

 private:
  struct Booking {
    std::size_t per_row = 0;
    std::size_t fixed = 0;
  };
  std::array<Booking, kRegionCount> bookings_{};
  std::size_t tile_bytes_ = 0;
  std::size_t slot_bytes_ = 0;
};

// The step's typed views of a laid-out workspace. Regions a plan does not
// use are empty.
struct StepRegions {
  std::span<std::byte> block;
  std::span<std::byte> stage;
  std::span<kernels::RowStats> tile_stats;
  RowArrays rows;
  std::span<std::byte> hidden_act;
  std::span<float> dhidden_act;
  std::span<std::byte> packed_hidden;
  BatchArrays batch;
  std::span<float> entropy_coef;
  std::span<float> quantile;
  std::span<std::byte> exchange;
  KeptColumns kept;
  KeptRemainders kept_lo;
  TailRegions tail;
  std::byte* slots = nullptr;

  // block_rows: rows per block (block_rows_alloc); batch_rows: N; vocab, tiles: the kept columns' (when booked).
  // tail: the tail correction's dimensions (rank 0: not booked).
  StepRegions(std::byte* ws, const WorkspaceLayout& l, std::int64_t block_rows, std::int64_t batch_rows,
              bool entropy_bonus, std::int64_t vocab, std::int64_t tiles, const TailRegions::Dims& tail_dims) {
    const auto bytes = [&](Region r) {
      return std::span<std::byte>(ws + l.at(r), l.bytes[static_cast<std::size_t>(r)]);
    };
    const auto floats = [&](Region r) {
      return std::span<float>(reinterpret_cast<float*>(ws + l.at(r)),
                              l.bytes[static_cast<std::size_t>(r)] / sizeof(float));
    };
    block = bytes(Region::block);
    stage = bytes(Region::stage);
    tile_stats = {reinterpret_cast<kernels::RowStats*>(ws + l.at(Region::tile_stats)),
                  l.bytes[static_cast<std::size_t>(Region::tile_stats)] / sizeof(kernels::RowStats)};
    const auto n = static_cast<std::size_t>(block_rows);
    auto* row = reinterpret_cast<float*>(ws + l.at(Region::row_arrays));
    for (std::span<float>* a : {&rows.target, &rows.lse, &rows.logp, &rows.entropy, &rows.coef, &rows.kl}) {
      *a = {row, n};
      row += n;
    }
    rows.active = {reinterpret_cast<std::int64_t*>(row), n};
    hidden_act = bytes(Region::hidden_act);
    dhidden_act = floats(Region::dhidden_act);
    packed_hidden = bytes(Region::packed_hidden);
    const std::span<float> all = floats(Region::batch_arrays);
    if (!all.empty()) {
      const auto m = static_cast<std::size_t>(batch_rows);
      batch.coef = all.subspan(0, m);
      batch.entropy = all.subspan(m, m);
      batch.logp = all.subspan(2 * m, m);
      batch.kl = all.subspan(3 * m, m);
      if (entropy_bonus) batch.entropy_coef = all.subspan(4 * m, m);
    }
    entropy_coef = floats(Region::entropy_coef);
    quantile = floats(Region::quantile);
    exchange = bytes(Region::exchange);
    if (l.bytes[static_cast<std::size_t>(Region::kept_columns)] > 0) {
      std::byte* at = ws + l.at(Region::kept_columns);
      kept.count = {reinterpret_cast<std::int64_t*>(at), static_cast<std::size_t>(tiles)};
      at += static_cast<std::size_t>(tiles) * sizeof(std::int64_t);
      kept.column = {reinterpret_cast<std::int32_t*>(at), static_cast<std::size_t>(vocab)};
      at += static_cast<std::size_t>(vocab) * sizeof(std::int32_t);
      kept.index = {reinterpret_cast<std::int32_t*>(at), static_cast<std::size_t>(vocab)};
      at += static_cast<std::size_t>(vocab) * sizeof(std::int32_t);
      kept.mark = {reinterpret_cast<std::uint8_t*>(at), static_cast<std::size_t>(vocab)};
    }
    if (l.bytes[static_cast<std::size_t>(Region::kept_lo)] > 0) {
      // count [rows], column [rows, cap], value [rows, cap]: cap from the booked bytes.
      const std::size_t per_row = l.bytes[static_cast<std::size_t>(Region::kept_lo)] / n;
      const auto cap =
          static_cast<std::int64_t>((per_row - sizeof(std::int32_t)) / (sizeof(std::int32_t) + sizeof(std::uint16_t)));
      std::byte* at = ws + l.at(Region::kept_lo);
      kept_lo.count = reinterpret_cast<std::int32_t*>(at);
      at += n * sizeof(std::int32_t);
      kept_lo.column = reinterpret_cast<std::int32_t*>(at);
      at += n * static_cast<std::size_t>(cap) * sizeof(std::int32_t);
      kept_lo.value = reinterpret_cast<std::uint16_t*>(at);
    }
    if (tail_dims.rank > 0) tail = TailRegions(ws + l.at(Region::tail), tail_dims, block_rows);
    slots = ws + l.slots;
  }
};

}  // namespace grpo::detail
