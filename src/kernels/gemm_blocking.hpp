// The blocking of the blocked bf16 GEMM (gemm_blocked.hpp) as a pure
// function of the spec and the micro's declared shape: the orientation, the
// k and column blocks of the packed Y, whether X is packed a whole k block at
// a time, the shared-row cap and the scratch layout. No ISA and no memory:
// tests/test_gemm_blocking.cpp checks it on any CPU, and gemm_sizes() sizes a
// GEMM by it without building one. The measurements behind the constants
// are in docs/benchmarks.md, "Where the GEMM layer's constants came from".
//
// Scheme (BLIS-like, sized for one core's L2 and L1: 2 MiB and 48 KiB by
// default, a micro may declare a smaller Y block and other panel rows): the
// product is computed as X Y with X [Mx, K] and Y [K, Ny], either X = A,
// Y = B or (swapped) X = B^T, Y = A^T, whichever is cheaper to pack (a
// K-contiguous X is a plain copy; Y is always rearranged), or the one that
// makes a shared operand (GemmSpec::shared) Y. Y is packed one block of
// kc x nc at a time (<= kYBlockBytes, so it stays in L2 while every X panel
// streams past it); a shared Y, or one too wide for an L2 block, may be taken
// whole across its columns (MicroShape::whole_shared_y). X is packed into
// panels of the micro's panel_rows (32 for the AVX-512 and AMX micros).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/gemm.hpp"

namespace grpo::kernels::blocked {

inline constexpr std::int64_t kTile = 16;   // rows of a tile; f32 columns of an accumulator tile
inline constexpr std::int64_t kKStep = 32;  // bf16 k per tile row (64 bytes)
inline constexpr std::int64_t kPanel = 32;  // rows (or columns) of a micro's 32 x 32 block
inline constexpr std::size_t kAlignBytes = 64;
// Two sets of four finished 16 x 16 accumulator tiles (4 KiB each) for a
// micro whose tiles leave through memory (StagedTiles, gemm_micro.hpp).
inline constexpr std::int64_t kStagedFloats = kTile * kTile * 8;

// The packed Y block's size: half of a 2 MiB L2 plus room, so the block and
// the X panel passing by (32 rows x kc bf16, <= 160 KiB at kc = 2560) stay in
// L2 together.
inline constexpr std::size_t kYBlockBytes = std::size_t{1024} << 10;
// The k block of a whole_shared_y micro's shared Y, and the most of it taken
// whole (more came from L3 too slowly).
inline constexpr std::int64_t kSharedKBlock = 4096;
inline constexpr std::size_t kSharedYWholeBytes = std::size_t{8} << 20;
// The most partial sums a call with a shared Y in L2 blocks takes: 640 rows
// against the forward's 2048-row W tile, the largest forward call measured on
// AMX.
inline constexpr std::size_t kSharedAccBytes = std::size_t{5} << 20;
// The most of a wide Y packed whole across its columns at a time, and the
// shortest k block it may take (more partial-sum round trips than that cost
// more than the packing saves).
inline constexpr std::size_t kWideYBytes = std::size_t{4} << 20;
inline constexpr std::int64_t kWideYMinK = 1024;
// The most scratch X packed a whole k block at a time may take (the step's
// dW packs 2048 x 640 and dh 640 x 2048: 2.5 MiB).
inline constexpr std::size_t kXWholeBytes = std::size_t{16} << 20;

constexpr std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }
constexpr std::size_t align_up(std::size_t v) { return (v + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// What the blocking needs of a micro (gemm_micro.hpp declares it).
struct MicroShape {
  std::int64_t x_elem_bytes = 2;             // a packed X element: 2 (bf16) or 4 (f32)
  std::int64_t y_elem_bytes = 2;             // a packed Y element, likewise
  std::int64_t panel_rows = kPanel;          // X rows of one micro block (its columns: kPanel)
  std::size_t y_block_bytes = kYBlockBytes;  // the packed Y block's budget (in the core's L2)
  bool whole_shared_y = false;               // a shared (or wide) Y may be taken whole across its columns
  std::int64_t staged_floats = 0;            // kStagedFloats for a StagedTiles micro, else 0
  std::size_t state_bytes = 0;               // the micro's own scratch (AMX: its tile configuration)
};

// Strided 2-D operand: element (i, j) at p[i * rs + j * cs], of dtype.
struct View {
  std::int64_t rs = 0;
  std::int64_t cs = 0;
  DType dtype = DType::bf16;
};

struct Blocking {
  std::int64_t m = 0, n = 0, k = 0;
  bool swapped = false;         // X = B^T, Y = A^T
  std::int64_t mx = 0, ny = 0;  // X's rows, Y's columns
  View x, y;
  bool x_kcontig = false;  // X's rows are K-contiguous: packing is a copy
  bool x_whole = false;    // X packed a whole k block at a time (Y spans several column blocks)
  // The most of a shared Y's columns one call takes at full speed
  // (GemmTraits::max_shared_rows), 0 when unbounded.
  std::int64_t max_shared_rows = 0;
  std::int64_t kc = 0, nc = 0;  // Y's k block and column block
  std::int64_t acc_ld = 0;      // floats between partial-sum rows
  // Scratch: [Y block][X panels (or one panel)][partial sums][staged tiles][micro state].
  std::size_t y_bytes = 0, x_bytes = 0, acc_bytes = 0, scratch_bytes = 0;

  std::int64_t k_blocks() const { return (k + kc - 1) / kc; }
  std::int64_t n_blocks() const { return (ny + nc - 1) / nc; }
};

// What an epilogue (gemm_epilogue_*.hpp) knows of C: the spec (C's dtype and
// strides, bias, accumulate) and the orientation the product ran in (X's
// rows are C's rows unless swapped).
class EpilogueTarget {
 public:
  EpilogueTarget(const GemmSpec& spec, const Blocking& b) : spec_(spec), swapped_(b.swapped), mx_(b.mx), ny_(b.ny) {}

 protected:
  GemmSpec spec_;
  bool swapped_ = false;
  std::int64_t mx_ = 0, ny_ = 0;  // X's rows, Y's columns
};

// spec: A and B with one contiguous dimension each (serves(), or f16 and
// f32 ones for a micro that widens as it packs: serves_widened()).
Blocking plan_blocking(const GemmSpec& spec, const MicroShape& micro);

// Y whole, every (k block, column block) in run()'s order: what
// pack_shared() fills; 0 without a shared operand.
std::size_t shared_packed_bytes(const GemmSpec& spec, const Blocking& b);
// Given the packed shared Y, run() packs no Y block: its room goes.
std::size_t scratch_bytes_with_packed(const GemmSpec& spec, const Blocking& b);

// bf16 A and B, each with one contiguous dimension, C's rows contiguous.
bool serves(const GemmSpec& spec);
// The same with A and B each f32, bf16 or f16 (a micro that widens to f32 as
// it packs: the avx2 backend's).
bool serves_widened(const GemmSpec& spec);
// serves_widened with at least one of A and B f16: the specs the avx512fma
// backend takes beside serves()'s (f32 A and B stay with oneDNN, whose bits
// the f32 models were checked with).
bool serves_f16_mix(const GemmSpec& spec);

}  // namespace grpo::kernels::blocked
