// The contract between the blocked GEMM (gemm_blocked.hpp) and a micro, the
// register blocks of one block of C, kPanelRows x 32 (gemm_amx_micro.hpp,
// gemm_avx512_micro.hpp, gemm_avx2_micro.hpp). As ruy's kernels declare their
// operand layout as a type, a micro declares how it reads its packed operands
// and where its finished block goes, and its ISA's packing
// (gemm_pack_avx512.hpp, gemm_pack_avx2.hpp) and epilogue
// (gemm_epilogue_avx512.hpp, gemm_epilogue_avx2.hpp) are chosen by those types:
//
//   kKind, kName, kSwappedName   the backend's kind and describe() names
//   kMr, kNr, kKr                its register block's edges (GemmTile)
//   kPanelRows                   X rows of one block (a multiple of kMr)
//   kYBlockBytes                 the packed Y block's budget (its core's L2)
//   XLayout                      XTiles or XRowGroups<rows, Elem, in_place>
//   YLayout                      YVnni<Elem>
//   Packer                       its ISA's packer of XLayout and YLayout
//   Epilogue                     its ISA's epilogue
//   Output                       StagedTiles or DirectGroups
//   kWholeSharedY                a shared (or wide) Y may be taken whole
//                                across its columns (gemm_blocking.hpp)
//   kStateBytes                  its own scratch, handed to begin()
//   begin(state), end()          around one run()
//   block(const MicroBlock&, Sink&)  the block; Sink is the loop's
//                                (gemm_blocked.hpp's GemmMicro concept)
//
// Each element's reduction runs over k in ascending order (the micro's own
// order within its k step, then f32 partial sums stored and reloaded exactly
// between k blocks): the same whatever M, N or the element's position, so a
// row's result does not depend on its batch (GemmTraits::m_independent).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/gemm_blocking.hpp"

namespace grpo::kernels::blocked {

// Packed element types.
struct Bf16 {
  static constexpr std::int64_t kBytes = 2;
};
// f32: bf16 widened to f32 as it is packed (exact: a bf16 is the top half
// of an f32), or f32 sources copied. The blocking's byte budgets then hold
// half the elements, which measured faster than blocks of the bf16 elements
// (docs/benchmarks.md, "Where the GEMM layer's constants came from").
struct F32 {
  static constexpr std::int64_t kBytes = 4;
};

// X panels of 32 rows as 16 x 32 bf16 tiles, [kb32 / 32 k steps][2 tiles]
// [16 rows][32 k], each tile 1 KiB of contiguous memory (the AMX tile loads).
struct XTiles {
  using Elem = Bf16;
  static constexpr bool kInPlace = false;
};

// X panels of kPanelRows rows as groups of kRows rows, each group's (k, k + 1)
// pairs [kb32 / 2 k pairs][kRows rows], a pair one u32 (Bf16) or two f32 (F32,
// its k value, then its k + 1 value): the kRows broadcasts of a k pair one
// half line and the group one sequential stream. kInPlace: the micro can
// instead read K-contiguous rows where they are (MicroBlock::x_rs).
template <std::int64_t kRows, class E, bool kCanReadInPlace>
struct XRowGroups {
  using Elem = E;
  static constexpr std::int64_t kGroupRows = kRows;
  static constexpr bool kInPlace = kCanReadInPlace;
};

// Y as VNNI rows (pairs of k interleaved, what tdpbf16ps and vdpbf16ps take):
// per 16 columns, kb32 / 2 rows of 16 (k, k + 1) pairs. F32: each row of 16
// pairs as its 16 k values, then its 16 k + 1 values.
template <class E>
struct YVnni {
  using Elem = E;
};

// Finished blocks leave as four 16 x 16 f32 tiles stored to memory
// (Sink::staged()), which the loop stores to C while the next block runs.
struct StagedTiles {};
// Finished row groups leave from registers (Sink::group(row, column, sums):
// the group's first row and column within the block).
struct DirectGroups {};

// One call of a micro: the kPanelRows x 32 block of C from an X panel and two Y
// tiles, from zero (first) or from the partial sums at acc; left in acc, or
// when last, handed to the Sink.
struct MicroBlock {
  const std::uint16_t* x = nullptr;   // the packed panel, or X's first row in place when x_rs > 0
  std::int64_t x_rs = 0;              // 0: packed; else X's row stride (XLayout::kInPlace only)
  const std::uint16_t* y0 = nullptr;  // the Y tiles of columns 0-15 and 16-31
  const std::uint16_t* y1 = nullptr;
  std::int64_t kb32 = 0;  // the k block, rounded up to kKStep
  float* acc = nullptr;   // partial sums, acc_ld floats a row
  std::int64_t acc_ld = 0;
  bool first = false;
  bool last = false;
};

template <class Micro>
constexpr MicroShape micro_shape() {
  return {.x_elem_bytes = Micro::XLayout::Elem::kBytes,
          .y_elem_bytes = Micro::YLayout::Elem::kBytes,
          .panel_rows = Micro::kPanelRows,
          .y_block_bytes = Micro::kYBlockBytes,
          .whole_shared_y = Micro::kWholeSharedY,
          .staged_floats = std::is_same_v<typename Micro::Output, StagedTiles> ? kStagedFloats : 0,
          .state_bytes = Micro::kStateBytes};
}

}  // namespace grpo::kernels::blocked
