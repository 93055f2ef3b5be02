#include "kernels/gemm_blocking.hpp"

#include <algorithm>

namespace grpo::kernels::blocked {

Blocking plan_blocking(const GemmSpec& spec, const MicroShape& micro) {
  Blocking p;
  const GemmOperand& a = spec.a;
  const GemmOperand& b = spec.b;
  p.m = a.rows;
  p.k = a.cols;
  p.n = b.cols;
  // Orientation: the one that packs fewer elements (X read in place when
  // its rows are K-contiguous and K is a whole number of tile rows).
  // A transposing pack of X costs about what Y's does; a copy, little.
  const auto x_cost = [&](std::int64_t cs, std::int64_t rows) { return cs == 1 ? rows * p.k / 4 : rows * p.k; };
  const std::int64_t cost_plain = x_cost(a.col_stride, p.m) + p.k * p.n;
  const std::int64_t cost_swapped = x_cost(b.row_stride, p.n) + p.k * p.m;
  // A shared operand (packed once for many calls) takes Y's place.
  p.swapped = spec.shared == SharedOperand::a   ? true
              : spec.shared == SharedOperand::b ? false
                                                : cost_swapped < cost_plain;
  if (!p.swapped) {
    p.mx = p.m;
    p.ny = p.n;
    p.x = {a.row_stride, a.col_stride, a.dtype};
    p.y = {b.row_stride, b.col_stride, b.dtype};
  } else {
    p.mx = p.n;
    p.ny = p.m;
    p.x = {b.col_stride, b.row_stride, b.dtype};  // X = B^T
    p.y = {a.col_stride, a.row_stride, a.dtype};  // Y = A^T
  }
  p.x_kcontig = p.x.cs == 1;
  const std::int64_t y_elem = micro.y_elem_bytes;
  // Blocking of Y: nc columns by kc rows within kYBlockBytes; kc as long as
  // possible first (fewer partial-sum round trips), then nc grows into it.
  const std::int64_t k32 = round_up(p.k, kKStep);
  const std::int64_t ny32 = round_up(p.ny, kPanel);
  const auto y_budget = static_cast<std::int64_t>(micro.y_block_bytes);
  p.nc = std::min<std::int64_t>(ny32, 256);
  p.kc = std::min<std::int64_t>(k32, std::max<std::int64_t>(kKStep, y_budget / (p.nc * y_elem) / kKStep * kKStep));
  p.nc = std::min<std::int64_t>(ny32, std::max<std::int64_t>(p.nc, y_budget / (p.kc * y_elem) / kPanel * kPanel));
  if (micro.whole_shared_y) {
    // Y taken whole across its columns, in k blocks of kc_whole (0: the
    // L2 blocks above stay). Its panels then come from L3 a 32-column
    // panel at a time, so only while the block is a small part of L3.
    std::int64_t kc_whole = 0;
    if (spec.shared != SharedOperand::none) {
      // Y packed once for many calls (the forward's hidden rows): k blocks
      // of up to kSharedKBlock, so each X panel is packed once and used
      // against all of Y while it is in L2, and there are no partial sums
      // for K <= kSharedKBlock.
      const std::int64_t kc = std::min(k32, kSharedKBlock);
      p.max_shared_rows = static_cast<std::int64_t>(kSharedYWholeBytes) / (kc * y_elem) / kPanel * kPanel;
      if (ny32 <= p.max_shared_rows) kc_whole = kc;
    } else if (p.y.cs == 1 && p.nc < ny32) {
      // Y packed by this call from N-contiguous rows too wide for one L2
      // block (dhidden's W chunk: 2048 columns of rows 8 KiB apart), read
      // as whole row runs (which the prefetchers follow) instead of short
      // pieces of every row per block.
      const std::int64_t kc = std::min(k32, static_cast<std::int64_t>(kWideYBytes) / (ny32 * y_elem) / kKStep * kKStep);
      if (kc >= kWideYMinK) kc_whole = kc;
    }
    if (kc_whole > 0) {
      p.kc = kc_whole;
      p.nc = ny32;
    }
  }
  const std::int64_t panel = micro.panel_rows;
  const std::int64_t mx_padded = round_up(p.mx, panel);  // X rows in whole panels
  if (spec.shared != SharedOperand::none && p.max_shared_rows == 0 && p.kc < p.k) {
    // A shared Y in L2 blocks: a call's partial sums are [X rows x Y
    // columns] f32, read and written once per k block. Calls of at most
    // kSharedAccBytes of them.
    p.max_shared_rows = std::max(
        kPanel, static_cast<std::int64_t>(kSharedAccBytes / (static_cast<std::size_t>(mx_padded) * sizeof(float))) /
                    kPanel * kPanel);
  }
  p.y_bytes = align_up(static_cast<std::size_t>(p.kc * p.nc * y_elem));
  // X: one panel at a time when Y is a single column block (each panel is
  // used once per k block), else the whole k block, packed once (at most
  // kXWholeBytes: past that, e.g. a whole-vocabulary GEMM, the panels are
  // packed again for every column block).
  p.x_whole = p.nc < ny32 && static_cast<std::size_t>(mx_padded * p.kc * micro.x_elem_bytes) <= kXWholeBytes;
  p.x_bytes = align_up(static_cast<std::size_t>((p.x_whole ? mx_padded : panel) * p.kc * micro.x_elem_bytes));
  p.acc_bytes = p.kc < p.k ? align_up(static_cast<std::size_t>(mx_padded * ny32) * sizeof(float)) : 0;
  p.acc_ld = ny32;
  p.scratch_bytes = p.y_bytes + p.x_bytes + p.acc_bytes +
                    static_cast<std::size_t>(micro.staged_floats) * sizeof(float) + micro.state_bytes;
  return p;
}

std::size_t shared_packed_bytes(const GemmSpec& spec, const Blocking& b) {
  if (spec.shared == SharedOperand::none) return 0;
  return static_cast<std::size_t>(b.k_blocks() * b.n_blocks()) * b.y_bytes;
}

std::size_t scratch_bytes_with_packed(const GemmSpec& spec, const Blocking& b) {
  return spec.shared == SharedOperand::none ? b.scratch_bytes : b.scratch_bytes - b.y_bytes;
}

namespace {

bool one_dim_contiguous(const GemmOperand& o) { return o.col_stride == 1 || o.row_stride == 1; }

// The strides and extents every micro takes, whatever the dtypes.
bool served_layout(const GemmSpec& s) {
  return s.c.col_stride == 1 && one_dim_contiguous(s.a) && one_dim_contiguous(s.b) && s.a.rows > 0 && s.a.cols > 0 &&
         s.b.cols > 0;
}

// A dtype the packers widen to f32 (f32 itself copied).
bool widened(DType d) {
  switch (d) {
    case DType::f32:
    case DType::bf16:
    case DType::f16: return true;
  }
  return false;
}

}  // namespace

bool serves_widened(const GemmSpec& s) { return widened(s.a.dtype) && widened(s.b.dtype) && served_layout(s); }

bool serves_f16_mix(const GemmSpec& s) {
  return (s.a.dtype == DType::f16 || s.b.dtype == DType::f16) && serves_widened(s);
}

bool serves(const GemmSpec& s) { return s.a.dtype == DType::bf16 && s.b.dtype == DType::bf16 && served_layout(s); }

}  // namespace grpo::kernels::blocked
