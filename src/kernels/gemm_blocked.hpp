// The blocked GEMM shared by our microkernel backends (gemm_amx.cpp,
// gemm_avx512_bf16.cpp, gemm_avx512_fma.cpp, gemm_avx2.cpp): C (+)= A B
// (+ bias) on the calling thread. This file is the driver loop (oneDNN's
// brgemm_matmul.cpp, ruy's trmul), the same for every ISA: the blocking is
// gemm_blocking.hpp's (pure, tested without the ISA), the packing and the
// epilogue are the micro's ISA's (gemm_pack_avx512.hpp and
// gemm_epilogue_avx512.hpp, gemm_pack_avx2.hpp and gemm_epilogue_avx2.hpp),
// the packing chosen by the micro's declared layouts (gemm_micro.hpp), and
// a micro supplies the kPanelRows x 32 block (gemm_amx_micro.hpp,
// gemm_avx512_micro.hpp, gemm_avx2_micro.hpp).
//
// Only for translation units compiled for the micro's ISA; everything is in
// an unnamed namespace (one copy per such unit).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <type_traits>

#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"
#include "kernels/gemm_blocking.hpp"
#include "kernels/gemm_micro.hpp"
#include "kernels/prefetch.hpp"

namespace grpo::kernels::blocked {
namespace {

// Where a DirectGroups micro's finished row groups go: C, through the
// epilogue, from registers (sums: the ISA's accumulators of one group).
template <class Epilogue>
struct GroupSink {
  const Epilogue& out;
  std::int64_t xr0;  // the block's first X row and Y column
  std::int64_t yc0;
  void* c;
  const void* bias;
  template <class Sums>
  void group(std::int64_t r, std::int64_t col, const Sums& sums) const {
    out.store_group(xr0 + r, yc0 + col, sums, c, bias);
  }
};

// Where a StagedTiles micro stores its four finished tiles.
struct StagedSink {
  float* at;
  float* staged() const { return at; }
};

template <class Micro>
using SinkFor = std::conditional_t<std::is_same_v<typename Micro::Output, DirectGroups>,
                                   GroupSink<typename Micro::Epilogue>, StagedSink>;

// The micro contract of gemm_micro.hpp.
template <class M>
concept GemmMicro = requires(void* state, const MicroBlock& blk, SinkFor<M>& sink) {
  { M::kKind } -> std::convertible_to<GemmBackendKind>;
  { M::kName } -> std::convertible_to<const char*>;
  { M::kSwappedName } -> std::convertible_to<const char*>;
  { M::kStateBytes } -> std::convertible_to<std::size_t>;
  { M::kWholeSharedY } -> std::convertible_to<bool>;
  { M::kMr } -> std::convertible_to<std::int64_t>;
  { M::kNr } -> std::convertible_to<std::int64_t>;
  { M::kKr } -> std::convertible_to<std::int64_t>;
  { M::kPanelRows } -> std::convertible_to<std::int64_t>;
  { M::kYBlockBytes } -> std::convertible_to<std::size_t>;
  { M::XLayout::kInPlace } -> std::convertible_to<bool>;
  typename M::YLayout::Elem;
  typename M::Packer;
  typename M::Epilogue;
  M::begin(state);
  M::end();
  M::block(blk, sink);
};

template <GemmMicro Micro>
class BlockedGemm final : public GemmBackend {
 public:
  static constexpr MicroShape kShape = micro_shape<Micro>();
  static constexpr std::int64_t kRows = Micro::kPanelRows;  // X rows of a block (its Y columns: kPanel)
  static_assert(kRows % Micro::kMr == 0);

  explicit BlockedGemm(const GemmSpec& spec)
      : spec_(spec), b_(plan_blocking(spec, kShape)), pack_(b_.x, b_.y), out_(spec, b_) {}

  GemmBackendKind kind() const override { return Micro::kKind; }
  GemmTile tile() const override { return {.mr = Micro::kMr, .nr = Micro::kNr, .kr = Micro::kKr}; }
  std::size_t shared_packed_bytes() const override { return blocked::shared_packed_bytes(spec_, b_); }
  void pack_shared(const void* y, void* packed) const override {
    auto* out = static_cast<std::byte*>(packed);
    for (std::int64_t k0 = 0; k0 < b_.k; k0 += b_.kc) {
      const std::int64_t kb = std::min(b_.kc, b_.k - k0);
      for (std::int64_t n0 = 0; n0 < b_.ny; n0 += b_.nc) {
        const std::int64_t nb = std::min(b_.nc, b_.ny - n0);
        pack_.pack_y(y, k0, kb, round_up(kb, kKStep), n0, nb, round_up(nb, kPanel),
                     reinterpret_cast<std::uint16_t*>(out));
        out += b_.y_bytes;
      }
    }
  }
  const char* implementation() const override { return b_.swapped ? Micro::kSwappedName : Micro::kName; }
  GemmTraits traits() const override { return {.m_independent = true, .max_shared_rows = b_.max_shared_rows}; }
  std::size_t scratchpad_bytes() const override { return b_.scratch_bytes; }
  std::size_t scratchpad_bytes_with_packed() const override { return scratch_bytes_with_packed(spec_, b_); }

  void run(const void* a, const void* b, void* c, const void* bias, void* scratch, const void* packed) const override {
    const void* xs = b_.swapped ? b : a;
    const void* ys = b_.swapped ? a : b;
    auto* s = static_cast<std::byte*>(scratch);
    // Scratch: [Y block, unless Y comes packed][X][partial sums][staged tiles][Micro's state].
    const std::size_t y_room = packed != nullptr ? 0 : b_.y_bytes;
    auto* yscratch = reinterpret_cast<std::uint16_t*>(s);
    const std::uint16_t* ypack = yscratch;
    auto* xpack = reinterpret_cast<std::uint16_t*>(s + y_room);
    auto* acc = reinterpret_cast<float*>(s + y_room + b_.x_bytes);
    auto* tmp = reinterpret_cast<float*>(s + y_room + b_.x_bytes + b_.acc_bytes);
    Micro::begin(tmp + kShape.staged_floats);

    const std::int64_t mx_padded = round_up(b_.mx, kRows);
    // The staged block whose tiles wait for store(): X row, Y column, set.
    std::int64_t pending_m = -1;
    std::int64_t pending_n = 0;
    std::int64_t set = 0;
    const auto flush = [&] {
      if constexpr (std::is_same_v<typename Micro::Output, StagedTiles>) {
        if (pending_m < 0) return;
        float* t = tmp + (1 - set) * 4 * kTile * kTile;
        out_.store(t, pending_m, pending_n, c, bias);
        out_.store(t + kTile * kTile, pending_m, pending_n + kTile, c, bias);
        out_.store(t + 2 * kTile * kTile, pending_m + kTile, pending_n, c, bias);
        out_.store(t + 3 * kTile * kTile, pending_m + kTile, pending_n + kTile, c, bias);
        pending_m = -1;
      }
    };
    for (std::int64_t k0 = 0; k0 < b_.k; k0 += b_.kc) {
      const std::int64_t kb = std::min(b_.kc, b_.k - k0);
      const std::int64_t kb32 = round_up(kb, kKStep);
      const bool first = k0 == 0;
      const bool last = k0 + kb >= b_.k;
      // Whether this k block's whole panels are read in place (below).
      const bool rows_in_place = Micro::XLayout::kInPlace && !b_.x_whole && b_.x_kcontig && b_.x.rs >= kb && kb == kb32;
      for (std::int64_t n0 = 0; n0 < b_.ny; n0 += b_.nc) {
        const std::int64_t nb = std::min(b_.nc, b_.ny - n0);
        const std::int64_t nb32 = round_up(nb, kPanel);
        if (packed != nullptr) {
          ypack = reinterpret_cast<const std::uint16_t*>(
              static_cast<const std::byte*>(packed) +
              static_cast<std::size_t>((k0 / b_.kc) * b_.n_blocks() + n0 / b_.nc) * b_.y_bytes);
        } else {
          ypack = yscratch;
          pack_.pack_y(ys, k0, kb, kb32, n0, nb, nb32, yscratch);
        }
        // X panels are packed when first needed (a whole k block's panels
        // are kept for the later column blocks), not in a packing pass of
        // their own that waited on DRAM (docs/benchmarks.md, "Where the GEMM
        // layer's constants came from").
        const bool pack_now = !b_.x_whole || n0 == 0;
        for (std::int64_t m0 = 0; m0 < mx_padded; m0 += kRows) {
          // The panel, in the micro's XLayout (f32 elements for F32).
          std::uint16_t* xp = b_.x_whole ? xpack + m0 * kb32 * (kShape.x_elem_bytes / 2) : xpack;
          // A panel used once per k block whose rows are all there,
          // K-contiguous and whole k steps is read where it is by a micro
          // that can (XLayout::kInPlace): the forward's W tile rows,
          // dhidden's dlogits rows (docs/benchmarks.md, "X rows read in
          // place").
          const bool in_place = rows_in_place && m0 + kRows <= b_.mx;
          if (!in_place && pack_now) pack_.pack_x(xs, m0, std::min(kRows, b_.mx - m0), k0, kb, kb32, xp);
          // In place only for a Bf16 XLayout (kInPlace).
          const std::uint16_t* xin = in_place ? static_cast<const std::uint16_t*>(xs) + m0 * b_.x.rs + k0 : xp;
          for (std::int64_t nn = 0; nn < nb32; nn += kPanel) {
            const std::int64_t ncol = n0 + nn;  // Y column of the block
            float* acc_at = acc + m0 * b_.acc_ld + ncol;
            const std::uint16_t* y0 = ypack + (nn / kTile) * (kb32 / 2) * 32 * (kShape.y_elem_bytes / 2);
            const std::uint16_t* y1 = y0 + (kb32 / 2) * 32 * (kShape.y_elem_bytes / 2);
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
            if (last) prefetch_c(c, m0, ncol);
            if (!first && nn + kPanel < nb32) prefetch_acc(acc_at + kPanel);
            const MicroBlock blk{.x = xin,
                                 .x_rs = in_place ? b_.x.rs : 0,
                                 .y0 = y0,
                                 .y1 = y1,
                                 .kb32 = kb32,
                                 .acc = acc_at,
                                 .acc_ld = b_.acc_ld,
                                 .first = first,
                                 .last = last};
            if constexpr (std::is_same_v<typename Micro::Output, DirectGroups>) {
              // Each finished group goes to C from registers as it ends (its
              // C lines came into L2 while the block ran); the next group's
              // vdpbf16ps run meanwhile.
              const GroupSink<typename Micro::Epilogue> sink{out_, m0, ncol, c, bias};
              Micro::block(blk, sink);
            } else {
              StagedSink sink{tmp + set * 4 * kTile * kTile};
              Micro::block(blk, sink);
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
  // C's lines of the block at X row xr0, Y column yc0 (C's column, row
  // when swapped), into L2.
  void prefetch_c(const void* c, std::int64_t xr0, std::int64_t yc0) const {
    const std::int64_t r0 = b_.swapped ? yc0 : xr0;
    const std::int64_t c0 = b_.swapped ? xr0 : yc0;
    const std::int64_t rows = std::min(b_.swapped ? kPanel : kRows, (b_.swapped ? b_.ny : b_.mx) - r0);
    const std::int64_t cols = std::min(b_.swapped ? kRows : kPanel, (b_.swapped ? b_.mx : b_.ny) - c0);
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

  // The partial sums of a block (kRows rows of b_.acc_ld floats from at), into L2.
  void prefetch_acc(const float* at) const {
    for (std::int64_t r = 0; r < kRows; ++r) {
      const auto* row = reinterpret_cast<const char*>(at + r * b_.acc_ld);
      prefetch_l2(row);
      prefetch_l2(row + 64);
    }
  }

  GemmSpec spec_;
  Blocking b_;
  typename Micro::Packer pack_;
  typename Micro::Epilogue out_;
};

}  // namespace
}  // namespace grpo::kernels::blocked
