// The blocked bf16 GEMM shared by our microkernel backends (gemm_amx.cpp,
// gemm_avx512_bf16.cpp, gemm_avx512_fma.cpp): C (+)= A B (+ bias), A and B bf16, C f32 or bf16, on
// the calling thread. The packing, the blocking and the epilogue are here;
// a Micro supplies the 32 x 32 block's inner loop.
//
// Scheme (BLIS-like, sized for one core's 2 MiB L2 and 48 KiB L1):
//   The product is computed as X Y with X [Mx, K] and Y [K, Ny], either
//   X = A, Y = B or (swapped) X = B^T, Y = A^T, whichever is cheaper to pack
//   (a K-contiguous X, like the forward's W tile or the backward's dlogits,
//   is a plain copy; Y is always rearranged), or the one that makes a shared
//   operand (GemmSpec::shared) Y. Y is packed into VNNI layout (pairs of k
//   interleaved: what tdpbf16ps and vdpbf16ps both take), one block of
//   kc x nc at a time (<= kYBlockBytes, so it stays in L2 while every X panel
//   streams past it; a shared Y, or one too wide for an L2 block, may be
//   taken whole across its columns, see the constructor). X is copied into
//   panels of 32 rows in the layout its Micro reads (Micro::kXGroupRows): 0,
//   tiles, every 16 x 32 tile 1 KiB of contiguous memory (the AMX tile
//   loads); 8, row groups, each group's (k, k + 1) pairs [k pair][8 rows],
//   the 8 broadcasts of a k pair one half line and the group one sequential
//   stream. A Micro that can (kXInPlace) reads X's rows where they are
//   instead, when they are K-contiguous and the panel is used once per k
//   block (the forward's W tile rows, dhidden's dlogits rows): no copy, and
//   measured faster though the W rows, 8 KiB apart, share one L1 set. Each
//   element's reduction runs over k in ascending order (Micro's own order
//   within its k step, then f32 partial sums stored and reloaded exactly
//   between k blocks): the same whatever M, N or the element's position,
//   so a row's result does not depend on its batch
//   (GemmTraits::m_independent).
//
// Only for translation units compiled with AVX-512F/BW/DQ/VL, and for a
// Micro of AVX512-BF16 or AMX instructions with those too; everything is in
// an unnamed namespace (one copy per such unit).
//
// Micro: kKind, kName, kSwappedName, kStateBytes, kXGroupRows, kWholeSharedY
//   (a shared Y taken whole, see the constructor), kXF32 and kYF32 (the
//   packed X group pairs, or Y's VNNI rows, widened to f32 after packing:
//   each pair's k value, then its k + 1 value; each row of 16 pairs, its 16
//   k values, then its 16 k + 1 values; Y's byte budgets then hold half the
//   elements); begin(state),
//   end(); block(xp, y0, y1, kb32, acc_at, acc_ld, first, last, staged): the
//   32 x 32 block of C from the X panel xp ([kb32 / 32][2][16][32] tiles, or
//   [32 / g][kb32 / 2][g] u32 pairs for kXGroupRows g) and the two Y
//   tiles y0, y1 ([kb32 / 2][16][2] each), starting from zero (first) or
//   from acc_at (ld acc_ld floats); leaves it in acc_at, or when last, as
//   four 16 x 16 tiles in staged (rows 0-15 x cols 0-15, 0-15 x 16-31,
//   16-31 x 0-15, 16-31 x 16-31). A kDirectC Micro has instead
//   block(xp, x_rs, y0, y1, kb32, acc_at, acc_ld, first, last, to_c) (xp
//   X's first row in place, rows x_rs elements apart, when x_rs > 0: a
//   kXInPlace Micro), which when last hands each finished group of
//   kXGroupRows rows to to_c(g, sums)
//   (sums[r][h]: row g + r, columns 16 h .. 16 h + 15), stored to C from
//   registers (store_group).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/bf16_avx512.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"
#include "kernels/prefetch.hpp"

namespace grpo::kernels {
namespace {

// The packed Y block's size: half of a 2 MiB L2 plus room, so the block and
// the X panel passing by (32 rows x kc bf16, <= 160 KiB at kc = 2560) stay in
// L2 together.
constexpr std::size_t kYBlockBytes = std::size_t{1024} << 10;
// The k block of a Micro::kWholeSharedY GEMM's shared Y, and the most of it
// taken whole (below).
constexpr std::int64_t kSharedKBlock = 4096;
constexpr std::size_t kSharedYWholeBytes = std::size_t{8} << 20;
// The most partial sums a call with a shared Y in L2 blocks takes (amx,
// below): 640 rows against the forward's 2048-row W tile, the largest
// forward call measured on AMX (2026-11-25, docs/benchmarks.md).
constexpr std::size_t kSharedAccBytes = std::size_t{5} << 20;
// The most of a wide Y (below) packed whole across its columns at a time,
// and the shortest k block it may take (more partial-sum round trips than
// that cost more than the packing saves). dhidden's 2048-column W chunk:
// k blocks of 1024, 4 MiB less scratch per slot than 8 MiB blocks of 2048
// at the same speed. Zen 4, alternated runs: T = 512 step, dhidden 2.48
// thread-s either way (12 MiB: 2.52); headline 60.82 / 61.39 s against
// 61.25 / 61.75 s, peak 250.8 MB against 259.3.
constexpr std::size_t kWideYBytes = std::size_t{4} << 20;
constexpr std::int64_t kWideYMinK = 1024;
constexpr std::int64_t kTile = 16;   // rows of a tile; f32 columns of an accumulator tile
constexpr std::int64_t kKStep = 32;  // bf16 k per tile row (64 bytes)
constexpr std::int64_t kPanel = 32;  // rows (or columns) of a 2 x 2 accumulator block
constexpr std::size_t kAlignBytes = 64;
// The most scratch X packed a whole k block at a time may take (the step's
// dW packs 2048 x 640 and dh 640 x 2048: 2.5 MiB).
constexpr std::size_t kXWholeBytes = std::size_t{16} << 20;
// Two sets of four finished accumulator tiles (4 KiB each): a block's tiles
// are stored to one set and converted into C while the next block's
// tdpbf16ps run, so the vector loads never wait on the tile stores just made
// (a tile store forwards to a load only through L1, hundreds of cycles).
constexpr std::int64_t kStaged = kTile * kTile * 8;  // 2 sets x 4 tiles

std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }
std::size_t align_up(std::size_t v) { return (v + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Strided 2-D bf16 operand: element (i, j) at p[i * rs + j * cs].
struct View {
  std::int64_t rs = 0;
  std::int64_t cs = 0;
};

__mmask32 mask32(std::int64_t n) { return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1; }
__mmask16 mask16(std::int64_t n) { return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1U << n) - 1); }

// Row/column index vectors for 16 x 16 32-bit transposes through gathers
// (the blocks are in L1; a gather of 16 is cheap next to the 128 tdpbf16ps a
// K = 4096 accumulator tile takes).
__m512i column_offsets(std::int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}

// (k, k + 1) pairs of 32 elements: r0 holds k's, r1 k + 1's; lo gets the
// pairs of elements 0-15 (k's in the low halves), hi those of 16-31.
inline void interleave_pairs(__m512i r0, __m512i r1, __m512i& lo, __m512i& hi) {
  const __m512i lo_idx =
      _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005, 0x00260006, 0x00270007,
                        0x00280008, 0x00290009, 0x002a000a, 0x002b000b, 0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  lo = _mm512_permutex2var_epi16(r0, lo_idx, r1);
  hi = _mm512_permutex2var_epi16(r0, hi_idx, r1);
}

template <class Micro>
class BlockedGemm final : public GemmBackend {
 public:
  explicit BlockedGemm(const GemmSpec& spec) : spec_(spec) {
    const GemmOperand& a = spec.a;
    const GemmOperand& b = spec.b;
    m_ = a.rows;
    k_ = a.cols;
    n_ = b.cols;
    // Orientation: the one that packs fewer elements (X read in place when
    // its rows are K-contiguous and K is a whole number of tile rows).
    // A transposing pack of X costs about what Y's does; a copy, little.
    const auto x_cost = [&](std::int64_t cs, std::int64_t rows) { return cs == 1 ? rows * k_ / 4 : rows * k_; };
    const std::int64_t cost_plain = x_cost(a.col_stride, m_) + k_ * n_;
    const std::int64_t cost_swapped = x_cost(b.row_stride, n_) + k_ * m_;
    // A shared operand (packed once for many calls) takes Y's place.
    swapped_ = spec.shared == SharedOperand::a   ? true
               : spec.shared == SharedOperand::b ? false
                                                 : cost_swapped < cost_plain;
    if (!swapped_) {
      mx_ = m_;
      ny_ = n_;
      x_ = {a.row_stride, a.col_stride};
      y_ = {b.row_stride, b.col_stride};
    } else {
      mx_ = n_;
      ny_ = m_;
      x_ = {b.col_stride, b.row_stride};  // X = B^T
      y_ = {a.col_stride, a.row_stride};  // Y = A^T
    }
    x_kcontig_ = x_.cs == 1;
    // Blocking of Y: nc columns by kc rows within kYBlockBytes; kc as long as
    // possible first (fewer partial-sum round trips), then nc grows into it.
    const std::int64_t k32 = round_up(k_, kKStep);
    const std::int64_t ny32 = round_up(ny_, kPanel);
    nc_ = std::min<std::int64_t>(ny32, 256);
    kc_ = std::min<std::int64_t>(k32, std::max<std::int64_t>(kKStep, static_cast<std::int64_t>(kYBlockBytes) /
                                                                         (nc_ * kYElem) / kKStep * kKStep));
    nc_ = std::min<std::int64_t>(
        ny32, std::max<std::int64_t>(nc_, static_cast<std::int64_t>(kYBlockBytes) / (kc_ * kYElem) / kPanel * kPanel));
    if (Micro::kWholeSharedY) {
      // Y taken whole across its columns, in k blocks of kc_whole (0: the
      // L2 blocks above stay). Its panels then come from L3 a 32-column
      // panel at a time, so only while the block is a small part of L3.
      std::int64_t kc_whole = 0;
      if (spec.shared != SharedOperand::none) {
        // Y packed once for many calls (the forward's hidden rows): k blocks
        // of up to kSharedKBlock, so each X panel is packed once and used
        // against all of Y while it is in L2, and there are no partial sums
        // for K <= kSharedKBlock. Zen 4, forward 640 x 4096 x 2048, one
        // thread: 53.4 -> 48.7 ms; in the step with 2624-row blocks (21 MiB
        // of Y) the forward took 37% longer.
        const std::int64_t kc = std::min(k32, kSharedKBlock);
        max_shared_rows_ = static_cast<std::int64_t>(kSharedYWholeBytes) / (kc * kYElem) / kPanel * kPanel;
        if (ny32 <= max_shared_rows_) kc_whole = kc;
      } else if (y_.cs == 1 && nc_ < ny32) {
        // Y packed by this call from N-contiguous rows too wide for one L2
        // block (dhidden's W chunk: 2048 columns of rows 8 KiB apart), read
        // as whole row runs (each a 4 KiB page at the headline, which the
        // prefetchers follow) instead of 512-byte pieces of 2048 rows per
        // block. Zen 4, one thread, dhidden 512 x 151936 x 2048: packing
        // 170 -> 77 ms of 1.6 s, 83 -> 88-89% of the peak.
        const std::int64_t kc =
            std::min(k32, static_cast<std::int64_t>(kWideYBytes) / (ny32 * kYElem) / kKStep * kKStep);
        if (kc >= kWideYMinK) kc_whole = kc;
      }
      if (kc_whole > 0) {
        kc_ = kc_whole;
        nc_ = ny32;
      }
    }
    const std::int64_t mx32 = round_up(mx_, kPanel);
    if (spec.shared != SharedOperand::none && max_shared_rows_ == 0 && kc_ < k_) {
      // A shared Y in L2 blocks: a call's partial sums are [X rows x Y
      // columns] f32, read and written once per k block. Calls of at most
      // kSharedAccBytes of them: without a cap the default 640 MiB budget
      // gave the headline's forward 1632-row calls, 13 MiB of sums (never
      // measured on AMX; with avx512fma in this layout the scratch of such
      // calls left the budget one slot, Xeon model 207, docs/benchmarks.md).
      max_shared_rows_ = std::max(
          kPanel, static_cast<std::int64_t>(kSharedAccBytes / (static_cast<std::size_t>(mx32) * sizeof(float))) /
                      kPanel * kPanel);
    }
    // Scratch: [Y block][X panels (or one tail panel)][partial sums][store tile].
    y_bytes_ = align_up(static_cast<std::size_t>(kc_ * nc_) * kYElem);
    // X: one panel at a time when Y is a single column block (each panel is
    // used once per k block), else the whole k block, packed once.
    // (at most kXWholeBytes: past that, e.g. a whole-vocabulary GEMM, the
    // panels are packed again for every column block).
    x_whole_ = nc_ < ny32 && static_cast<std::size_t>(mx32 * kc_ * kXElem) <= kXWholeBytes;
    x_bytes_ = align_up(static_cast<std::size_t>((x_whole_ ? mx32 : kPanel) * kc_ * kXElem));
    acc_bytes_ = kc_ < k_ ? align_up(static_cast<std::size_t>(mx32 * ny32) * sizeof(float)) : 0;
    acc_ld_ = ny32;
    scratch_bytes_ = y_bytes_ + x_bytes_ + acc_bytes_ + kStagedFloats * sizeof(float) + Micro::kStateBytes;
  }

  // Bytes of a packed Y element: f32 for a kYF32 Micro, so its Y blocks
  // hold half the elements in the same bytes. Xeon model 207, one thread:
  // dhidden 512 x 151936 x 2048 115.5 GFLOP/s with f32 blocks of the bf16
  // blocks' elements (8 MiB of W chunk), 164.9 within the same bytes.
  static constexpr std::int64_t kYElem = Micro::kYF32 ? 4 : 2;
  // Bytes of a packed X element: f32 for a kXF32 Micro.
  static constexpr std::int64_t kXElem = Micro::kXF32 ? 4 : 2;

  // The staged tile sets (none for a Micro that stores from registers).
  static constexpr std::int64_t kStagedFloats = Micro::kDirectC ? 0 : kStaged;

  GemmBackendKind kind() const override { return Micro::kKind; }

  // Y whole: every (k block, column block) of pack_y in run()'s order.
  std::size_t shared_packed_bytes() const override {
    if (spec_.shared == SharedOperand::none) return 0;
    return static_cast<std::size_t>(k_blocks() * n_blocks()) * y_bytes_;
  }
  void pack_shared(const void* operand, void* packed) const override {
    const auto* y = static_cast<const std::uint16_t*>(operand);
    auto* out = static_cast<std::byte*>(packed);
    for (std::int64_t k0 = 0; k0 < k_; k0 += kc_) {
      const std::int64_t kb = std::min(kc_, k_ - k0);
      for (std::int64_t n0 = 0; n0 < ny_; n0 += nc_) {
        const std::int64_t nb = std::min(nc_, ny_ - n0);
        pack_y(y, k0, kb, round_up(kb, kKStep), n0, nb, round_up(nb, kPanel), reinterpret_cast<std::uint16_t*>(out));
        out += y_bytes_;
      }
    }
  }
  const char* implementation() const override { return swapped_ ? Micro::kSwappedName : Micro::kName; }
  GemmTraits traits() const override { return {.m_independent = true, .max_shared_rows = max_shared_rows_}; }
  std::size_t scratchpad_bytes() const override { return scratch_bytes_; }
  // Given the packed shared Y, run() packs no Y block: its room goes.
  std::size_t scratchpad_bytes_with_packed() const override {
    return spec_.shared == SharedOperand::none ? scratch_bytes_ : scratch_bytes_ - y_bytes_;
  }

  void run(const void* a, const void* b, void* c, const void* bias, void* scratch, const void* packed) const override {
    const auto* xs = static_cast<const std::uint16_t*>(swapped_ ? b : a);
    const auto* ys = static_cast<const std::uint16_t*>(swapped_ ? a : b);
    auto* s = static_cast<std::byte*>(scratch);
    // Scratch: [Y block, unless Y comes packed][X][partial sums][staged tiles][Micro's state].
    const std::size_t y_room = packed != nullptr ? 0 : y_bytes_;
    auto* yscratch = reinterpret_cast<std::uint16_t*>(s);
    const std::uint16_t* ypack = yscratch;
    auto* xpack = reinterpret_cast<std::uint16_t*>(s + y_room);
    auto* acc = reinterpret_cast<float*>(s + y_room + x_bytes_);
    auto* tmp = reinterpret_cast<float*>(s + y_room + x_bytes_ + acc_bytes_);
    Micro::begin(tmp + kStagedFloats);

    const std::int64_t mx32 = round_up(mx_, kPanel);
    // The staged block whose tiles wait for store(): X row, Y column, set.
    std::int64_t pending_m = -1;
    std::int64_t pending_n = 0;
    std::int64_t set = 0;
    const auto flush = [&] {
      if (pending_m < 0) return;
      float* t = tmp + (1 - set) * 4 * kTile * kTile;
      store(t, pending_m, pending_n, c, bias);
      store(t + kTile * kTile, pending_m, pending_n + kTile, c, bias);
      store(t + 2 * kTile * kTile, pending_m + kTile, pending_n, c, bias);
      store(t + 3 * kTile * kTile, pending_m + kTile, pending_n + kTile, c, bias);
      pending_m = -1;
    };
    for (std::int64_t k0 = 0; k0 < k_; k0 += kc_) {
      const std::int64_t kb = std::min(kc_, k_ - k0);
      const std::int64_t kb32 = round_up(kb, kKStep);
      const bool first = k0 == 0;
      const bool last = k0 + kb >= k_;
      // Whether this k block's whole panels are read in place (below).
      const bool rows_in_place = Micro::kXInPlace && !x_whole_ && x_kcontig_ && x_.rs >= kb && kb == kb32;
      for (std::int64_t n0 = 0; n0 < ny_; n0 += nc_) {
        const std::int64_t nb = std::min(nc_, ny_ - n0);
        const std::int64_t nb32 = round_up(nb, kPanel);
        if (packed != nullptr) {
          ypack = reinterpret_cast<const std::uint16_t*>(static_cast<const std::byte*>(packed) +
                                                         static_cast<std::size_t>((k0 / kc_) * n_blocks() + n0 / nc_) *
                                                             y_bytes_);
        } else {
          ypack = yscratch;
          pack_y(ys, k0, kb, kb32, n0, nb, nb32, yscratch);
        }
        // X panels are packed when first needed (a whole k block's panels
        // are kept for the later column blocks), not in a packing pass of
        // their own that waited on DRAM (Zen 4, T = 640: forward 58.1 ->
        // 56.2 ms; a look-ahead prefetch of the next panel into L2, dead code
        // until prefetch.hpp, then measured 0.6% slower at T = 512: gone).
        const bool pack_now = !x_whole_ || n0 == 0;
        for (std::int64_t m0 = 0; m0 < mx32; m0 += kPanel) {
          // The panel, in Micro's layout (f32 elements for a kXF32 Micro).
          std::uint16_t* xp = x_whole_ ? xpack + m0 * kb32 * (kXElem / 2) : xpack;
          // A panel used once per k block whose rows are all there,
          // K-contiguous and whole k steps is read where it is by a Micro
          // that can (kXInPlace): the forward's W tile rows, dhidden's
          // dlogits rows. Zen 4, one thread, forward 640 x 4096 x 2048,
          // six interleaved pairs: 94.9-95.8% -> 96.2-97.2% of the peak
          // (dhidden the same either way); headline step, two pairs: the
          // forward 46.3-47.0 -> 45.4-45.5 thread-s.
          const bool in_place = rows_in_place && m0 + kPanel <= mx_;
          if (!in_place && pack_now) pack_x(xs, m0, std::min(kPanel, mx_ - m0), k0, kb, kb32, xp);
          const std::uint16_t* xin = in_place ? xs + m0 * x_.rs + k0 : xp;
          for (std::int64_t nn = 0; nn < nb32; nn += kPanel) {
            const std::int64_t ncol = n0 + nn;  // Y column of the block
            float* acc_at = acc + m0 * acc_ld_ + ncol;
            const std::uint16_t* y0 = ypack + (nn / kTile) * (kb32 / 2) * 32 * (kYElem / 2);
            const std::uint16_t* y1 = y0 + (kb32 / 2) * 32 * (kYElem / 2);
            // The previous block's staged tiles go to C first (with AMX,
            // while this block's tile loads are under way).
            flush();
            // What this block's and the next one's stores and loads will
            // touch, into L2 while this block runs: its C lines (stored as
            // each group ends, or staged ones after the next block; an
            // accumulating C is read too) and the next block's partial sums.
            // Both come from beyond L2 (dW's C, a 32 MiB tile; dhidden's
            // partial sums, 4 MiB), and a C block's 32 rows lie 16 KiB
            // apart, more streams than the hardware prefetchers follow.
            // Zen 4, one thread, T = 512: dW 43.6 -> 41.2-41.9 ms, dhidden
            // 2% faster.
            if (last) prefetch_c(c, m0, ncol);
            if (!first && nn + kPanel < nb32) prefetch_acc(acc_at + kPanel);
            if constexpr (Micro::kDirectC) {
              // Each finished group goes to C from registers as it ends (its
              // C lines came into L2 while the block ran); the next group's
              // vdpbf16ps run meanwhile.
              const auto to_c = [&](std::int64_t g, const __m512(&sums)[Micro::kXGroupRows][2]) {
                store_group(m0 + g, ncol, sums, c, bias);
              };
              Micro::block(xin, in_place ? x_.rs : 0, y0, y1, kb32, acc_at, acc_ld_, first, last, to_c);
            } else {
              Micro::block(xp, y0, y1, kb32, acc_at, acc_ld_, first, last, tmp + set * 4 * kTile * kTile);
              if (!last) continue;
              // This block's tiles wait in one set while the next block runs.
              pending_m = m0;
              pending_n = ncol;
              set = 1 - set;
            }
          }
        }
      }
    }
    flush();
    Micro::end();
  }

 private:
  std::int64_t k_blocks() const { return (k_ + kc_ - 1) / kc_; }
  std::int64_t n_blocks() const { return (ny_ + nc_ - 1) / nc_; }

  // X rows [m0, m0 + rows) x k [k0, k0 + kb) -> panels of 32 rows, each
  // [kb32 / 32 k steps][2 tiles][16 rows][32 k] bf16, zero-padded.
  static std::int64_t panel_at(std::int64_t r, std::int64_t kk, std::int64_t kb32) {
    return (r / kPanel) * kPanel * kb32 + kk * kPanel + (r % kPanel) * kKStep;
  }
  void pack_x(const std::uint16_t* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb,
              std::int64_t kb32, std::uint16_t* out) const {
    if constexpr (Micro::kXGroupRows > 0) {
      pack_x_groups(x, m0, rows, k0, kb, kb32, out);
      if constexpr (Micro::kXF32) widen_pairs(out, kPanel * kb32 / 2);
      return;
    }
    const std::int64_t rows32 = round_up(rows, kPanel);
    if (x_kcontig_) {  // rows K-contiguous: copy
      // The rows are short runs (kb elements) of rows far apart (W's 8 KiB):
      // the hardware prefetchers do not follow; ask for kPrefetchRows ahead.
      constexpr std::int64_t kPrefetchRows = 4;
      for (std::int64_t r = 0; r < rows32; ++r) {
        if (r + kPrefetchRows < rows) prefetch_row(x, m0 + r + kPrefetchRows, k0, kb);
        for (std::int64_t kk = 0; kk < kb32; kk += 32) {
          const __m512i v = r < rows ? _mm512_maskz_loadu_epi16(mask32(kb - kk), x + (m0 + r) * x_.rs + k0 + kk)
                                     : _mm512_setzero_si512();
          _mm512_store_si512(out + panel_at(r, kk, kb32), v);
        }
      }
      return;
    }
    // Columns contiguous (x_.rs == 1): per 16 rows x 32 k, pair k and k + 1
    // of each row into a u32 ([kp][row] in tmp), then gather the transpose.
    alignas(64) std::uint32_t pairs[kTile * kTile];
    const __m512i cols = column_offsets(kTile);
    for (std::int64_t r0 = 0; r0 < rows32; r0 += kTile) {
      const std::int64_t rn = std::clamp<std::int64_t>(rows - r0, 0, kTile);
      const __mmask16 rmask = mask16(rn);
      for (std::int64_t kk = 0; kk < kb32; kk += 32) {
        for (std::int64_t kp = 0; kp < kTile; ++kp) {
          const std::int64_t k = kk + 2 * kp;
          const __m256i lo =
              k < kb ? _mm256_maskz_loadu_epi16(rmask, x + (m0 + r0) + (k0 + k) * x_.cs) : _mm256_setzero_si256();
          const __m256i hi = k + 1 < kb ? _mm256_maskz_loadu_epi16(rmask, x + (m0 + r0) + (k0 + k + 1) * x_.cs)
                                        : _mm256_setzero_si256();
          const __m512i v =
              _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
          _mm512_store_si512(pairs + kp * kTile, v);
        }
        for (std::int64_t r = 0; r < kTile; ++r) {
          const __m512i row =
              _mm512_i32gather_epi32(_mm512_add_epi32(cols, _mm512_set1_epi32(static_cast<int>(r))), pairs, 4);
          _mm512_store_si512(out + panel_at(r0 + r, kk, kb32), row);
        }
      }
    }
  }

  // pack_x for a Micro reading row groups: each 8 rows x kb k of the panel
  // as [kb32 / 2 k pairs][8 rows] u32, the groups one after another.
  void pack_x_groups(const std::uint16_t* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb,
                     std::int64_t kb32, std::uint16_t* out) const {
    constexpr std::int64_t kG = Micro::kXGroupRows;
    static_assert(kG == 8, "the group packing below transposes 8 rows");
    auto* pairs = reinterpret_cast<std::uint32_t*>(out);
    const std::int64_t kp32 = kb32 / 2;
    if (x_kcontig_) {
      // Per group and 32 k: 8 rows of 16 pairs -> 16 pairs of 8 rows, an
      // 8 x 16 u32 transpose (two unpack rounds, then 128-bit quarters).
      for (std::int64_t g = 0; g < kPanel; g += kG) {
        std::uint32_t* og = pairs + g * kp32;  // group g's pairs (the group of panel row g)
        // The next group's rows into L2 while this one is copied, when the
        // rows lie apart (dhidden's dlogits rows, V elements apart, each a
        // separate stream). The forward's W tile rows are one contiguous run
        // that the hardware prefetchers follow; asking for them too (into
        // L1: 8 rows of 8 KiB, twice its size) only cost time. Zen 4, one
        // thread, T = 512: dhidden 88.1-89.4% -> 90.4-91.0% of the peak,
        // forward 94.0-94.4% -> 94.4-94.6%; headline step, four pairs:
        // 62.0-63.6 s -> 61.3-63.0 s, each pair faster. (Measured before
        // such panels were read in place, see run(); packed now are only
        // the last, partial panel, ragged k blocks and X packed whole.)
        if (x_.rs > kb) {
          for (std::int64_t r = g + kG; r < std::min(rows, g + 2 * kG); ++r) prefetch_row<true>(x, m0 + r, k0, kb);
        }
        for (std::int64_t kk = 0; kk < kb32; kk += kKStep) {
          __m512i v[kG];
          for (std::int64_t r = 0; r < kG; ++r) {
            v[r] = g + r < rows ? _mm512_maskz_loadu_epi16(mask32(kb - kk), x + (m0 + g + r) * x_.rs + k0 + kk)
                                : _mm512_setzero_si512();
          }
          __m512i t[kG];
          for (std::int64_t r = 0; r < kG; r += 2) {
            t[r] = _mm512_unpacklo_epi32(v[r], v[r + 1]);
            t[r + 1] = _mm512_unpackhi_epi32(v[r], v[r + 1]);
          }
          // lo[j] / hi[j], 128-bit quarter q: pair 4q + j of rows 0-3 / 4-7.
          const __m512i lo[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                                 _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
          const __m512i hi[4] = {_mm512_unpacklo_epi64(t[4], t[6]), _mm512_unpackhi_epi64(t[4], t[6]),
                                 _mm512_unpacklo_epi64(t[5], t[7]), _mm512_unpackhi_epi64(t[5], t[7])};
          std::uint32_t* o = og + (kk / 2) * kG;
          for (int j = 0; j < 4; ++j) {
            // Pair 4q + j: rows 0-3 then 4-7 (the quarter index must be a literal).
            const auto put = [&](int q, __m128i rows03, __m128i rows47) {
              auto* at = reinterpret_cast<__m128i*>(o + (4 * q + j) * kG);
              _mm_store_si128(at, rows03);
              _mm_store_si128(at + 1, rows47);
            };
            put(0, _mm512_extracti32x4_epi32(lo[j], 0), _mm512_extracti32x4_epi32(hi[j], 0));
            put(1, _mm512_extracti32x4_epi32(lo[j], 1), _mm512_extracti32x4_epi32(hi[j], 1));
            put(2, _mm512_extracti32x4_epi32(lo[j], 2), _mm512_extracti32x4_epi32(hi[j], 2));
            put(3, _mm512_extracti32x4_epi32(lo[j], 3), _mm512_extracti32x4_epi32(hi[j], 3));
          }
        }
      }
      return;
    }
    // Columns contiguous (x_.rs == 1): per k pair, the panel's 32 rows at k
    // and at k + 1 interleaved into 32 pairs, 8 to each group.
    const __mmask32 rmask = mask32(rows);
    for (std::int64_t kp = 0; kp < kp32; ++kp) {
      const std::int64_t k = 2 * kp;
      const __m512i r0 = k < kb ? _mm512_maskz_loadu_epi16(rmask, x + m0 + (k0 + k) * x_.cs) : _mm512_setzero_si512();
      const __m512i r1 =
          k + 1 < kb ? _mm512_maskz_loadu_epi16(rmask, x + m0 + (k0 + k + 1) * x_.cs) : _mm512_setzero_si512();
      __m512i lo;  // rows 0-15
      __m512i hi;  // 16-31
      interleave_pairs(r0, r1, lo, hi);
      std::uint32_t* o = pairs + kp * kG;
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), _mm512_extracti64x4_epi64(lo, 0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + kp32 * kG), _mm512_extracti64x4_epi64(lo, 1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 2 * kp32 * kG), _mm512_extracti64x4_epi64(hi, 0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 3 * kp32 * kG), _mm512_extracti64x4_epi64(hi, 1));
    }
  }

  // n (k, k + 1) bf16 pairs at out (u32 each, n a multiple of 16) -> 2 n
  // f32 in place, each pair's k value first: exact (a bf16 is the top half
  // of an f32). From the end, so no pair is overwritten before it is read.
  static void widen_pairs(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000U));
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_load_si512(pairs + i);
      const __m512i k0 = _mm512_slli_epi32(v, 16);
      const __m512i k1 = _mm512_and_si512(v, high);
      _mm512_store_si512(f + 2 * i, _mm512_permutex2var_epi32(k0, lo_idx, k1));
      _mm512_store_si512(f + 2 * i + 16, _mm512_permutex2var_epi32(k0, hi_idx, k1));
    }
  }

  // X row `row`'s k [k0, k0 + kb) (K-contiguous) into L1, or L2 when kIntoL2.
  template <bool kIntoL2 = false>
  void prefetch_row(const std::uint16_t* x, std::int64_t row, std::int64_t k0, std::int64_t kb) const {
    const auto* at = reinterpret_cast<const char*>(x + row * x_.rs + k0);
    for (std::int64_t b = 0; b < kb * 2; b += 64) {
      if constexpr (kIntoL2) {
        prefetch_l2(at + b);
      } else {
        prefetch_l1(at + b);
      }
    }
  }

  // C's lines of the 32 x 32 block at X row xr0, Y column yc0 (C's column,
  // row when swapped), into L2.
  void prefetch_c(const void* c, std::int64_t xr0, std::int64_t yc0) const {
    const std::int64_t r0 = swapped_ ? yc0 : xr0;
    const std::int64_t c0 = swapped_ ? xr0 : yc0;
    const std::int64_t rows = std::min(kPanel, (swapped_ ? ny_ : mx_) - r0);
    const std::int64_t cols = std::min(kPanel, (swapped_ ? mx_ : ny_) - c0);
    if (rows <= 0 || cols <= 0) return;
    const std::size_t elem = spec_.c.dtype == DType::f32 ? sizeof(float) : sizeof(std::uint16_t);
    const auto* base = static_cast<const char*>(c);
    for (std::int64_t r = 0; r < rows; ++r) {
      const char* first = base + static_cast<std::size_t>((r0 + r) * spec_.c.row_stride + c0) * elem;
      const char* last = first + static_cast<std::size_t>(cols) * elem - 1;
      for (const char* line = first - (reinterpret_cast<std::uintptr_t>(first) & 63); line <= last; line += 64) {
        prefetch_l2(line);
      }
    }
  }

  // The partial sums of a 32 x 32 block (32 rows of acc_ld_ floats from at), into L2.
  void prefetch_acc(const float* at) const {
    for (std::int64_t r = 0; r < kPanel; ++r) {
      const auto* row = reinterpret_cast<const char*>(at + r * acc_ld_);
      prefetch_l2(row);
      prefetch_l2(row + 64);
    }
  }

  // Y k [k0, k0 + kb) x columns [n0, n0 + nb) -> VNNI tiles: for each 16
  // columns t, kb32 / 2 rows of 16 (k, k + 1) pairs; zero-padded.
  void pack_y(const std::uint16_t* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0,
              std::int64_t nb, std::int64_t nb32, std::uint16_t* out) const {
    pack_y_vnni(y, k0, kb, kb32, n0, nb, nb32, out);
    if constexpr (Micro::kYF32) widen_rows(out, nb32 * kb32 / 2);
  }
  // n VNNI u32 at out (rows of 16 (k, k + 1) pairs, n a multiple of 16) ->
  // 2 n f32 in place: each row of 16 pairs becomes the 16 k values, then the
  // 16 k + 1 values. From the end, as widen_pairs.
  static void widen_rows(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000U));
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_loadu_si512(pairs + i);
      _mm512_storeu_si512(f + 2 * i, _mm512_slli_epi32(v, 16));
      _mm512_storeu_si512(f + 2 * i + 16, _mm512_and_si512(v, high));
    }
  }
  void pack_y_vnni(const std::uint16_t* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0,
                   std::int64_t nb, std::int64_t nb32, std::uint16_t* out) const {
    const std::int64_t rows_per_tile = kb32 / 2;
    if (y_.cs == 1) {  // rows (k) N-contiguous: interleave row pairs, each pair's columns in one run
      for (std::int64_t kp = 0; kp < rows_per_tile; ++kp) {
        const std::int64_t k = 2 * kp;
        for (std::int64_t nn = 0; nn < nb32; nn += 32) {
          const __mmask32 cmask = mask32(nb - nn);
          std::uint16_t* t0 = out + (nn / kTile) * rows_per_tile * 32;
          std::uint16_t* t1 = t0 + rows_per_tile * 32;
          const __m512i r0 = k < kb && nn < nb ? _mm512_maskz_loadu_epi16(cmask, y + (k0 + k) * y_.rs + n0 + nn)
                                               : _mm512_setzero_si512();
          const __m512i r1 = k + 1 < kb && nn < nb ? _mm512_maskz_loadu_epi16(cmask, y + (k0 + k + 1) * y_.rs + n0 + nn)
                                                   : _mm512_setzero_si512();
          __m512i lo;  // columns 0-15
          __m512i hi;  // 16-31
          interleave_pairs(r0, r1, lo, hi);
          _mm512_storeu_si512(t0 + kp * 32, lo);
          _mm512_storeu_si512(t1 + kp * 32, hi);
        }
      }
      return;
    }
    // Columns K-contiguous (y_.rs == 1): a (k, k + 1) pair is one u32 of a
    // column; a 16 x 16 u32 transpose per 16 columns x 32 k.
    alignas(64) std::uint32_t block[kTile * kTile];
    const __m512i cols = column_offsets(kTile);
    for (std::int64_t nn = 0; nn < nb32; nn += kTile) {
      std::uint16_t* t = out + (nn / kTile) * rows_per_tile * 32;
      for (std::int64_t kk = 0; kk < kb32; kk += 32) {
        const __mmask32 kmask = mask32(kb - kk);
        for (std::int64_t j = 0; j < kTile; ++j) {
          const __m512i v = nn + j < nb ? _mm512_maskz_loadu_epi16(kmask, y + (n0 + nn + j) * y_.cs + k0 + kk)
                                        : _mm512_setzero_si512();
          _mm512_store_si512(block + j * kTile, v);
        }
        for (std::int64_t kp = 0; kp < kTile; ++kp) {
          const __m512i row =
              _mm512_i32gather_epi32(_mm512_add_epi32(cols, _mm512_set1_epi32(static_cast<int>(kp))), block, 4);
          _mm512_storeu_si512(t + (kk / 2 + kp) * 32, row);
        }
      }
    }
  }

  // One finished 16 x 16 accumulator tile (tmp, X rows xr0.., Y columns yc0..)
  // into C: transposed back when swapped; + bias, + C when accumulating;
  // rounded to bf16 (nearest even) for a bf16 C. Rows and columns past C's
  // edges are dropped.
  void store(float* tmp, std::int64_t xr0, std::int64_t yc0, void* c, const void* bias) const {
    if (xr0 >= mx_ || yc0 >= ny_) return;
    std::int64_t rows = 0;  // of C
    std::int64_t cols = 0;
    std::int64_t r0 = 0;
    std::int64_t c0 = 0;
    if (swapped_) {
      // tmp[i][j] = C[yc0 + j][xr0 + i]: transpose in place through a copy.
      alignas(64) float t[kTile * kTile];
      std::memcpy(t, tmp, sizeof(t));
      const __m512i idx = column_offsets(kTile);
      for (std::int64_t j = 0; j < kTile; ++j) {
        _mm512_store_ps(tmp + j * kTile,
                        _mm512_i32gather_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(static_cast<int>(j))), t, 4));
      }
      r0 = yc0;
      c0 = xr0;
      rows = std::min(kTile, ny_ - yc0);
      cols = std::min(kTile, mx_ - xr0);
    } else {
      r0 = xr0;
      c0 = yc0;
      rows = std::min(kTile, mx_ - xr0);
      cols = std::min(kTile, ny_ - yc0);
    }
    const __mmask16 cmask = mask16(cols);
    const __m512 bv = spec_.has_bias ? bias_at(bias, c0, cmask) : _mm512_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r) put(_mm512_load_ps(tmp + r * kTile), r0 + r, c0, cmask, bv, c);
  }

  // A finished group straight from registers (a kDirectC Micro): X rows
  // [xr0, xr0 + g) x Y columns [yc0, yc0 + 32), acc[r][h] holding row r's
  // columns 16 h .. 16 h + 15; clipped to C's edges. Zen 4, one thread, dW
  // 2048 x 512 x 4096 (its C read and written once per call): 87-89% ->
  // 90-92% of the peak against staged tiles stored in a pass of their own.
  template <std::int64_t g>
  void store_group(std::int64_t xr0, std::int64_t yc0, const __m512 (&acc)[g][2], void* c, const void* bias) const {
    static_assert(g == 8, "the swapped store transposes 8 rows");
    if (xr0 >= mx_ || yc0 >= ny_) return;
    if (!swapped_) {
      for (std::int64_t h = 0; h < 2 && yc0 + h * kTile < ny_; ++h) {
        const std::int64_t c0 = yc0 + h * kTile;
        const __mmask16 cmask = mask16(ny_ - c0);
        const __m512 bv = spec_.has_bias ? bias_at(bias, c0, cmask) : _mm512_setzero_ps();
        for (std::int64_t r = 0; r < std::min(g, mx_ - xr0); ++r) put(acc[r][h], xr0 + r, c0, cmask, bv, c);
      }
      return;
    }
    // Swapped: C row yc0 + j, columns [xr0, xr0 + 8) is column j of the
    // group: an 8 x 16 transpose per half (two unpack rounds, then each
    // 128-bit quarter's rows 0-3 and 4-7 side by side).
    const __mmask16 cmask = mask16(std::min<std::int64_t>(g, mx_ - xr0));  // 8 columns of C
    const __m512 bv = spec_.has_bias ? bias_at(bias, xr0, cmask) : _mm512_setzero_ps();
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (std::int64_t h = 0; h < 2 && yc0 + h * kTile < ny_; ++h) {
      __m512 t[8];
      for (int r = 0; r < 8; r += 2) {
        t[r] = _mm512_unpacklo_ps(acc[r][h], acc[r + 1][h]);
        t[r + 1] = _mm512_unpackhi_ps(acc[r][h], acc[r + 1][h]);
      }
      const auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
      const auto ps = [](__m512d v) { return _mm512_castpd_ps(v); };
      // u[q] / w[q], quarter l: column 4 l + q's rows 0-3 / 4-7.
      const __m512 u[4] = {ps(_mm512_unpacklo_pd(pd(t[0]), pd(t[2]))), ps(_mm512_unpackhi_pd(pd(t[0]), pd(t[2]))),
                           ps(_mm512_unpacklo_pd(pd(t[1]), pd(t[3]))), ps(_mm512_unpackhi_pd(pd(t[1]), pd(t[3])))};
      const __m512 w[4] = {ps(_mm512_unpacklo_pd(pd(t[4]), pd(t[6]))), ps(_mm512_unpackhi_pd(pd(t[4]), pd(t[6]))),
                           ps(_mm512_unpacklo_pd(pd(t[5]), pd(t[7]))), ps(_mm512_unpackhi_pd(pd(t[5]), pd(t[7])))};
      const std::int64_t rows = std::min(kTile, ny_ - (yc0 + h * kTile));
      for (int q = 0; q < 4; ++q) {
        // Columns q and 4 + q of the group (low / high 256 bits), then 8 + q and 12 + q.
        const __m512 a = _mm512_permutex2var_ps(u[q], lo_idx, w[q]);
        const __m512 b = _mm512_permutex2var_ps(u[q], hi_idx, w[q]);
        const __m512 cols[4] = {a, _mm512_shuffle_f32x4(a, a, 0xee), b, _mm512_shuffle_f32x4(b, b, 0xee)};
        for (int l = 0; l < 4; ++l) {
          const std::int64_t j = 4 * l + q;
          if (j < rows) put(cols[l], yc0 + h * kTile + j, xr0, cmask, bv, c);
        }
      }
    }
  }

  // The bias of C's columns [c0, c0 + 16) under cmask, as f32.
  __m512 bias_at(const void* bias, std::int64_t c0, __mmask16 cmask) const {
    if (spec_.bias_dtype == DType::f32) return _mm512_maskz_loadu_ps(cmask, static_cast<const float*>(bias) + c0);
    const __m256i h = _mm256_maskz_loadu_epi16(cmask, static_cast<const std::uint16_t*>(bias) + c0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }

  // 16 f32 -> bf16, rounded to nearest even: vcvtneps2bf16 where the unit
  // is compiled for AVX512-BF16; else in integer instructions, a NaN to the
  // quiet NaN 0x7fc0 (the two differ only on NaN payloads and subnormals,
  // which vcvtneps2bf16 takes as zero).
  static __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return std::bit_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
    return float_to_bf16x16<Bf16Nan::canonical>(v);
#endif
  }

  // C[r][c0 + j] (+)= v[j] + bv[j] for the columns under cmask (bv only with
  // a bias); rounded to bf16 (nearest even) for a bf16 C.
  void put(__m512 v, std::int64_t r, std::int64_t c0, __mmask16 cmask, __m512 bv, void* c) const {
    if (spec_.has_bias) v = _mm512_add_ps(v, bv);
    const GemmOperand& co = spec_.c;
    const std::int64_t at = r * co.row_stride + c0;
    if (co.dtype == DType::f32) {
      float* dst = static_cast<float*>(c) + at;
      if (spec_.accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(cmask, dst), v);
      _mm512_mask_storeu_ps(dst, cmask, v);
    } else {
      std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at;
      if (spec_.accumulate) {
        const __m256i old = _mm256_maskz_loadu_epi16(cmask, dst);
        v = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), v);
      }
      _mm256_mask_storeu_epi16(dst, cmask, to_bf16(v));
    }
  }

  GemmSpec spec_;
  std::int64_t m_ = 0, n_ = 0, k_ = 0;
  bool swapped_ = false;
  std::int64_t mx_ = 0, ny_ = 0;
  View x_, y_;
  bool x_kcontig_ = false;  // X's rows are K-contiguous: packing is a copy
  bool x_whole_ = false;    // X packed a whole k block at a time (Y spans several column blocks)
  // The most of a shared Y's columns taken whole (kSharedYWholeBytes in k
  // blocks of up to kSharedKBlock; see the constructor), 0 when it never is:
  // GemmTraits::max_shared_rows.
  std::int64_t max_shared_rows_ = 0;
  std::int64_t kc_ = 0, nc_ = 0;
  std::int64_t acc_ld_ = 0;
  std::size_t y_bytes_ = 0, x_bytes_ = 0, acc_bytes_ = 0, scratch_bytes_ = 0;
};

bool serves(const GemmSpec& s) {
  const auto one_dim_contiguous = [](const GemmOperand& o) { return o.col_stride == 1 || o.row_stride == 1; };
  return s.a.dtype == DType::bf16 && s.b.dtype == DType::bf16 && s.c.col_stride == 1 && one_dim_contiguous(s.a) &&
         one_dim_contiguous(s.b) && s.a.rows > 0 && s.a.cols > 0 && s.b.cols > 0;
}

}  // namespace
}  // namespace grpo::kernels
