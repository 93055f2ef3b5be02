// The LM-head step's workspace, booked by name (as oneDNN's scratchpad
// registrar books a primitive's scratchpad): each region once, by the phase
// that uses it (book_forward, book_dense_backward, book_filter, the loss
// stage's in book_workspace), with its bytes per block row and its fixed
// bytes, or as pieces the registry lays out (book_pieces). The block-size
// search reads the per-row and fixed totals from the bookings, the plan lays
// the regions and pieces out from the same bookings, and the step gets typed
// views of them (StepRegions; the filter's FilterRegions), so a region's size
// is written in one place and no phase computes another's offsets. A phase
// that reuses another's region as scratch books that use too (book_use:
// pieces laid out in the region and checked to fit in it), and the slots'
// GEMM tiles likewise (book_slot_pieces).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

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
  kept_columns,   // the filtered backward's: KeptColumns (filter_plan.hpp)
  kept_lo,        // per block row: KeptRemainders (bf16 dlogits under the filter)
  tail,           // the filtered backward's tail correction: TailRegions
  count,          // the number of regions
};
inline constexpr std::size_t kRegionCount = static_cast<std::size_t>(Region::count);

// Uses of a region's bytes by a phase while the region's own contents are
// not needed (WorkspaceRegistry::book_use), each laid out in pieces from the
// region's start and checked to fit in it:
enum class RegionUse : std::uint8_t {
  kept_dlogits,  // block: the kept columns' dlogits, compacted in place [rows, kept_cap], then their
                 // bf16 remainders [rows, kept_cap] (the filtered backward's backward_kept)
  tail_sketch,   // block: the sketch's sign matrix [kTailRows, V / tail_stride] (the filter's prepare)
  tail_apply,    // block: the tail correction's dW rows [V, kTailApplyLd] (the filter's finish)
  tail_probes,   // stage: the basis and probe rows [kTailRows, hidden_ld] (the filter's prepare)
  count,
};
inline constexpr std::size_t kRegionUseCount = static_cast<std::size_t>(RegionUse::count);

// Regions whose size grows with the token block: the search's estimate
// allows each of them kWorkspaceAlign bytes for the rounding of its end.
inline constexpr std::size_t kRowRegions =
    10;  // block .. dhidden_act, packed_hidden, entropy_coef, exchange, kept_lo, tail

// Per block row (Region::row_arrays, packed pieces in this order): the chosen
// logit, LSE, logp, entropy, coefficient, KL term (floats), and the index of
// the row's place among the active rows.
struct RowArrays {
  static constexpr std::size_t kFloatArrays = 6;
  std::span<float> target, lse, logp, entropy, coef, kl;
  std::span<std::int64_t> active;
};

// Per batch row, for the two-pass schedule (LmHeadPlanData::two_pass;
// Region::batch_arrays, packed pieces in this order): the first pass's logp,
// entropy and KL terms of every row, and the coefficients (dLoss/dlogp;
// dLoss/dEnt with an entropy bonus) the second pass reads.
struct BatchArrays {
  static std::size_t arrays(bool entropy_bonus) { return entropy_bonus ? 5 : 4; }
  std::span<float> coef, entropy, logp, kl;
  std::span<float> entropy_coef;  // empty without an entropy bonus
};

// A region booked in pieces (WorkspaceRegistry::book_pieces): piece i takes
// per_row bytes per block row plus fixed bytes and starts on a multiple of
// align (1: right after the piece before it).
struct WorkspacePiece {
  std::size_t per_row = 0;
  std::size_t fixed = 0;
  std::size_t align = kWorkspaceAlign;
};

struct WorkspaceLayout {
  std::array<std::size_t, kRegionCount> offset{};
  std::array<std::size_t, kRegionCount> bytes{};  // as booked (before alignment)
  // A region booked in pieces: each piece's offset and bytes.
  std::array<std::vector<std::size_t>, kRegionCount> piece_offset;
  std::array<std::vector<std::size_t>, kRegionCount> piece_bytes;
  std::size_t slots = 0;       // offset of the slots: per slot, a GEMM tile + a GEMM scratchpad
  std::size_t slot_bytes = 0;  // one slot
  std::size_t tile_bytes = 0;  // its GEMM tile part
  // Each use of a slot's tile booked in pieces (book_slot_pieces): their offsets in the tile.
  std::vector<std::vector<std::size_t>> slot_piece_offset;
  // Each use of a region (book_use): its pieces' offsets and bytes.
  std::array<std::vector<std::size_t>, kRegionUseCount> use_offset;
  std::array<std::vector<std::size_t>, kRegionUseCount> use_bytes;
  std::size_t total = 0;

  std::size_t at(Region r) const { return offset[static_cast<std::size_t>(r)]; }
  // Slot `slot`'s GEMM tile and scratchpad, the slots starting at `slots_at` (the workspace + slots).
  float* slot_tile(std::byte* slots_at, int slot) const {
    return reinterpret_cast<float*>(slots_at + static_cast<std::size_t>(slot) * slot_bytes);
  }
  void* slot_scratch(std::byte* slots_at, int slot) const {
    return slots_at + static_cast<std::size_t>(slot) * slot_bytes + tile_bytes;
  }
  // Piece i of use `use` of slot `slot`'s tile, as T.
  template <class T>
  T* slot_piece(std::byte* slots_at, int slot, std::size_t use, std::size_t i) const {
    return reinterpret_cast<T*>(slots_at + static_cast<std::size_t>(slot) * slot_bytes + slot_piece_offset[use][i]);
  }
  // Piece i of region r in the workspace ws, as T (empty when not booked).
  template <class T>
  std::span<T> piece(std::byte* ws, Region r, std::size_t i) const {
    const auto at = static_cast<std::size_t>(r);
    if (i >= piece_offset[at].size()) return {};
    return {reinterpret_cast<T*>(ws + piece_offset[at][i]), piece_bytes[at][i] / sizeof(T)};
  }
  // Piece i of use u of a region, as T (empty when not booked).
  template <class T>
  std::span<T> use_piece(std::byte* ws, RegionUse u, std::size_t i) const {
    const auto at = static_cast<std::size_t>(u);
    if (i >= use_offset[at].size()) return {};
    return {reinterpret_cast<T*>(ws + use_offset[at][i]), use_bytes[at][i] / sizeof(T)};
  }
};

class WorkspaceRegistry {
 public:
  // Region r takes per_row bytes per block row plus fixed bytes (either may be 0).
  void book(Region r, std::size_t per_row, std::size_t fixed = 0) {
    bookings_[static_cast<std::size_t>(r)] = {per_row, fixed};
    pieces_[static_cast<std::size_t>(r)].clear();
  }
  // Region r as pieces, laid out in order: it takes their per-row bytes, their
  // fixed bytes each rounded to its alignment, and room for rounding the end
  // of each aligned piece that grows with the block.
  void book_pieces(Region r, std::span<const WorkspacePiece> pieces) {
    Booking b;
    for (const WorkspacePiece& piece : pieces) {
      b.per_row += piece.per_row;
      b.fixed += round_up(piece.fixed, piece.align) + (piece.per_row > 0 && piece.align > 1 ? piece.align : 0);
    }
    bookings_[static_cast<std::size_t>(r)] = b;
    pieces_[static_cast<std::size_t>(r)].assign(pieces.begin(), pieces.end());
  }
  // Each slot (a concurrent tile task): a [forward_rows, tile] f32 GEMM tile and a GEMM scratchpad.
  void book_slot(std::size_t tile_bytes, std::size_t scratchpad_bytes) {
    tile_bytes_ = align_workspace(tile_bytes);
    slot_bytes_ = tile_bytes_ + align_workspace(scratchpad_bytes);
  }
  // A use of every slot's GEMM tile as pieces (fixed bytes each, laid out
  // from the tile's start as a region's are); `use`: the phase's own index.
  // The tile keeps book_slot's bytes, which every use must fit (lay_out checks).
  void book_slot_pieces(std::size_t use, std::span<const WorkspacePiece> pieces) {
    if (slot_uses_.size() <= use) slot_uses_.resize(use + 1);
    slot_uses_[use].assign(pieces.begin(), pieces.end());
  }

  // Use u of region `host` as pieces laid out from the host's start (the
  // first piece on its first byte, whatever its contents: a use may
  // transform them in place); they take no bytes of their own, and lay_out
  // checks that they fit in the host.
  void book_use(RegionUse u, Region host, std::span<const WorkspacePiece> pieces) {
    uses_[static_cast<std::size_t>(u)] = {host, {pieces.begin(), pieces.end()}};
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
      std::size_t piece_at = at;
      for (const WorkspacePiece& piece : pieces_[r]) {
        const std::size_t bytes = piece.per_row * static_cast<std::size_t>(rows) + piece.fixed;
        l.piece_offset[r].push_back(piece_at);
        l.piece_bytes[r].push_back(bytes);
        piece_at += round_up(bytes, piece.align);
      }
      at += align_workspace(l.bytes[r]);
    }
    l.tile_bytes = tile_bytes_;
    l.slot_bytes = slot_bytes_;
    for (const std::vector<WorkspacePiece>& use : slot_uses_) {
      std::size_t piece_at = 0;
      std::vector<std::size_t>& offsets = l.slot_piece_offset.emplace_back();
      for (const WorkspacePiece& piece : use) {
        offsets.push_back(piece_at);
        piece_at += round_up(piece.fixed, piece.align);
      }
      if (piece_at > tile_bytes_) throw std::logic_error("a use of the slot's tile outgrows the tile");
    }
    for (std::size_t u = 0; u < kRegionUseCount; ++u) {
      const auto host = static_cast<std::size_t>(uses_[u].host);
      std::size_t piece_at = l.offset[host];
      for (const WorkspacePiece& piece : uses_[u].pieces) {
        piece_at = round_up(piece_at, piece.align);
        const std::size_t bytes = piece.per_row * static_cast<std::size_t>(rows) + piece.fixed;
        l.use_offset[u].push_back(piece_at);
        l.use_bytes[u].push_back(bytes);
        piece_at += bytes;
      }
      if (piece_at > l.offset[host] + l.bytes[host]) throw std::logic_error("a use of a region outgrows the region");
    }
    l.slots = at;
    l.total = at + slot_bytes_ * static_cast<std::size_t>(slots);
    return l;
  }

 private:
  struct Booking {
    std::size_t per_row = 0;
    std::size_t fixed = 0;
  };
  static std::size_t round_up(std::size_t bytes, std::size_t align) { return (bytes + align - 1) / align * align; }

  struct Use {
    Region host = Region::block;
    std::vector<WorkspacePiece> pieces;  // none: not booked
  };

  std::array<Booking, kRegionCount> bookings_{};
  std::array<std::vector<WorkspacePiece>, kRegionCount> pieces_;
  std::array<Use, kRegionUseCount> uses_;
  std::vector<std::vector<WorkspacePiece>> slot_uses_;
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
  std::byte* slots = nullptr;

  // The filtered backward's regions are its own views (FilterRegions).
  StepRegions(std::byte* ws, const WorkspaceLayout& l) {
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
    std::size_t i = 0;
    for (std::span<float>* a : {&rows.target, &rows.lse, &rows.logp, &rows.entropy, &rows.coef, &rows.kl}) {
      *a = l.piece<float>(ws, Region::row_arrays, i++);
    }
    rows.active = l.piece<std::int64_t>(ws, Region::row_arrays, i);
    hidden_act = bytes(Region::hidden_act);
    dhidden_act = floats(Region::dhidden_act);
    packed_hidden = bytes(Region::packed_hidden);
    i = 0;
    for (std::span<float>* a : {&batch.coef, &batch.entropy, &batch.logp, &batch.kl, &batch.entropy_coef}) {
      *a = l.piece<float>(ws, Region::batch_arrays, i++);
    }
    entropy_coef = floats(Region::entropy_coef);
    quantile = floats(Region::quantile);
    exchange = bytes(Region::exchange);
    slots = ws + l.slots;
  }
};

}  // namespace grpo::detail
