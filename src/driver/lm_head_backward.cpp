// The step's dense backward (see lm_head_backward.hpp).
#include "driver/lm_head_backward.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "driver/parallel.hpp"

namespace grpo::detail {

kernels::GemmSpec dhidden_spec(const LmHeadShape& s, DType dl_dtype, std::int64_t k, std::int64_t cols) {
  kernels::GemmSpec g;
  g.a = {dl_dtype, k, s.vocab, s.vocab, 1};
  g.b = s.layout == WeightLayout::vocab_major ? kernels::GemmOperand{s.dtype, s.vocab, cols, s.weight_ld, 1}
                                              : kernels::GemmOperand{s.dtype, s.vocab, cols, 1, s.weight_ld};
  g.c = {DType::f32, k, cols, s.hidden, 1};
  return g;
}

void create_dense_backward_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed) {
  const LmHeadShape& s = p.shape;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  const std::int64_t last_chunk = s.hidden - (p.hidden_chunks - 1) * p.hidden_chunk;
  const std::int64_t chunk = std::min(p.hidden_chunk, s.hidden);
  const DweightTile dw_tile{s};
  DenseBackwardPlan& b = p.backward;
  for (const std::int64_t k : p.row_ladder.entries()) {
    auto& dw = b.dweight.emplace_back();
    kernels::GemmSizes full;
    for (int acc = 0; acc < 2 && !p.options.frozen_weight; ++acc) {
      dw.full[acc] = make.make(dw_tile.spec(p.dlogits_dtype, p.options.dweight_dtype, k, vt, acc == 1),
                               acc == 0 ? &full : nullptr);
      dw.last[acc] = make.make(dw_tile.spec(p.dlogits_dtype, p.options.dweight_dtype, k, last_tile, acc == 1));
    }
    if (!p.options.frozen_weight) *packed = std::max(*packed, full.shared_packed_bytes);
    auto& dh = b.dhidden.emplace_back();
    dh.full = make.make(dhidden_spec(s, p.dlogits_dtype, k, chunk));
    dh.last = make.make(dhidden_spec(s, p.dlogits_dtype, k, last_chunk));
  }
}

void book_dense_backward(const LmHeadPlanData& p, WorkspaceRegistry& w) {
  const LmHeadShape& s = p.shape;
  const bool backward = !p.options.forward_only;
  // The active rows' hidden rows (the stride the forward GEMM reads) and their f32 dhidden.
  w.book(Region::hidden_act, backward ? static_cast<std::size_t>(s.hidden_ld) * size_of(s.dtype) : 0);
  w.book(Region::dhidden_act, backward ? static_cast<std::size_t>(s.hidden) * sizeof(float) : 0);
}

void DenseBackward::block(const BackwardBlock& b, bool* dweight_written) {
  const bool dweight = !p.options.frozen_weight;
  const bool accumulate = *dweight_written;
  const void* packed_act = nullptr;
  if (dweight) packed_act = pack_active_rows(*p.backward.dweight[p.row_ladder.index_of(b.padded)].full[0]);
  const kernels::Elem dl_type = elem_of(p.dlogits_dtype);
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
    dlogits_clock.time([&] {
      for (std::int64_t i = 0; i < b.na; ++i)
        row_dlogits(b, i, j, block_at(i, j * p.schedule.vocab_tile, dl_size), dl_type);
      zero_padding(b, j);
    });
    if (dweight) tile_dweight(j, slot, b.padded, accumulate, packed_act);  // frozen weight: dlogits feed dhidden alone
  });
  count(b, p.shape.vocab, false, dweight, *dweight_written);
  dhidden(b.padded);
  finish(b, dweight, dweight_written);
}

float DenseBackward::row_dlogits(const BackwardBlock& b, std::int64_t i, std::int64_t j, void* out,
                                 kernels::Elem out_type) const {
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t c0 = j * vt;
  const std::int64_t cols = std::min(vt, p.shape.vocab - c0);
  const std::int64_t r = ws.rows.active[i];
  const std::int64_t s = b.compacted ? i : r;  // where row r's statistics and logits are
  const std::int64_t row = b.b0 + r;
  // A target column outside the tile (or W) takes no one-hot.
  const std::int64_t tgt = valid(row) ? exchange.column_of(in.batch.ids[row]) - c0 : -1;
  // E_p[x] = M + D/S = LSE - entropy (RowStats); dEnt/dx_v = -p_v (x_v - E_p[x]).
  RowUpstream u{b.logp_coef[r] * b.logp_scale};
  if (b.entropy_coef != nullptr) {
    u = {u.a, b.entropy_coef[r] * b.entropy_scale, ws.rows.lse[s] - ws.rows.entropy[s], true};
  }
  dlogits_row(k, transform, block_at(s, c0, store_size), p.store_type, cols, 1.0F, ws.tile_stats[s * p.tiles + j].max,
              ws.rows.lse[s], u, tgt, out, out_type, b.dbias != nullptr ? b.dbias + c0 : nullptr);
  return std::fabs(u.a) + std::fabs(u.b);
}

void DenseBackward::zero_padding(const BackwardBlock& b, std::int64_t j) const {
  const std::int64_t c0 = j * p.schedule.vocab_tile;
  const std::int64_t cols = std::min(p.schedule.vocab_tile, p.shape.vocab - c0);
  for (std::int64_t i = b.na; i < b.padded; ++i) std::memset(block_at(i, c0, dl_size), 0, cols * dl_size);
}

const void* DenseBackward::pack_active_rows(const kernels::Gemm& gemm) const {
  if (gemm.shared_packed_bytes() == 0) return nullptr;
  gemm.pack_shared(ws.hidden_act.data(), ws.packed_hidden.data());
  return ws.packed_hidden.data();
}

void DenseBackward::tile_dweight(std::int64_t j, int slot, std::int64_t padded, bool accumulate,
                                 const void* packed_act) {
  const std::int64_t c0 = j * p.schedule.vocab_tile;
  const kernels::Gemm& gemm =
      *p.backward.dweight[p.row_ladder.index_of(padded)].pick(j == p.tiles - 1)[accumulate ? 1 : 0];
  const DweightTile dw_tile{p.shape};
  auto* dw = static_cast<std::byte*>(out.dweight.data) + dw_tile.offset(c0) * size_of(p.options.dweight_dtype);
  const std::array<const void*, 2> ab = dw_tile.operands(block_at(0, c0, dl_size), ws.hidden_act.data());
  dweight_clock.time([&] { bindings.at(gemm, slot).run(ab[0], ab[1], dw, nullptr, slot_scratch(slot), packed_act); });
  // Taken on the thread that ran the GEMM (the count is the thread's).
  if (out.dweight.dtype == DType::f16) {
    gemm_f16_saturated.fetch_add(kernels::take_f16_saturations(), std::memory_order_relaxed);
  }
}

void DenseBackward::dhidden(std::int64_t padded) {
  const auto& dhidden_gemms = p.backward.dhidden[p.row_ladder.index_of(padded)];
  for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
    const std::int64_t h0 = chunk * p.hidden_chunk;
    const kernels::Gemm& gemm = *dhidden_gemms.pick(chunk == p.hidden_chunks - 1);
    dhidden_clock.time([&] {
      bindings.at(gemm, slot)
          .run(ws.block.data(), weight_at_hidden(h0), ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
    });
  });
}

void DenseBackward::count(const BackwardBlock& b, std::int64_t run, bool kept, bool dweight, bool dweight_written) {
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t hidden = p.shape.hidden;
  const std::int64_t padded = b.padded;
  const std::size_t dw_size = size_of(p.options.dweight_dtype);
  const auto cols = static_cast<double>(run);
  const double dl_bytes = static_cast<double>(padded) * cols * static_cast<double>(dl_size);
  const double w_bytes = cols * static_cast<double>(hidden) * static_cast<double>(in_size);
  // The stored logits read and the dlogits written (and under the filter
  // the kept ones moved into the compact matrix).
  stats.schedule_bytes +=
      static_cast<double>(padded) * static_cast<double>(vocab) * (store_size + static_cast<double>(dl_size)) +
      (kept ? 2.0 * dl_bytes : 0.0);
  stats.schedule_bytes += w_bytes + static_cast<double>(p.hidden_chunks) * dl_bytes;
  const double row_columns = static_cast<double>(padded) * static_cast<double>(vocab - run);
  stats.dhidden_skipped_row_columns += static_cast<std::int64_t>(row_columns);
  if (dweight) {
    stats.dweight_skipped_row_columns += static_cast<std::int64_t>(row_columns);
    const double dw_all = static_cast<double>(vocab) * static_cast<double>(hidden) * static_cast<double>(dw_size);
    const double dw_kept = cols * static_cast<double>(hidden) * static_cast<double>(dw_size);
    // Unfiltered: dW written (and read when accumulating). Filtered: the
    // kept rows read and written, after a zero fill of all of dW when
    // nothing is there yet.
    stats.schedule_bytes +=
        dl_bytes + (kept ? 2.0 * dw_kept + (dweight_written ? 0.0 : dw_all) : dw_all * (dweight_written ? 2.0 : 1.0));
  }
}

void DenseBackward::finish(const BackwardBlock& b, bool dweight, bool* dweight_written) {
  const std::int64_t hidden = p.shape.hidden;
  *dweight_written = *dweight_written || dweight;
  exchange.sum_dhidden(ws.dhidden_act.data(), b.na * hidden);
  std::int64_t i = 0;
  for (std::int64_t r = 0; r < b.nb; ++r) {
    if (i < b.na && ws.rows.active[i] == r) {
      stats.f16_saturated += write_dhidden_row(b.b0 + r, ws.dhidden_act.data() + i * hidden);
      ++i;
    } else {
      zero_dhidden_row(b.b0 + r);
    }
  }
}

void DenseBackward::zero_dhidden_rows(std::int64_t b0, std::int64_t nb) const {
  for (std::int64_t r = 0; r < nb; ++r) zero_dhidden_row(b0 + r);
}

void DenseBackward::zero_dweight() const {
  if (p.options.frozen_weight) return;
  const std::size_t elem = size_of(out.dweight.dtype);
  // In runs of rows over the slots: a whole [V, H] dW is gigabytes.
  constexpr std::int64_t kRows = 256;
  for_each_item((out.dweight.rows + kRows - 1) / kRows, p.schedule.slots, [&](std::int64_t chunk, int /*slot*/) {
    for (std::int64_t r = chunk * kRows; r < std::min(out.dweight.rows, (chunk + 1) * kRows); ++r) {
      std::memset(static_cast<std::byte*>(out.dweight.data) + static_cast<std::size_t>(r * out.dweight.ld) * elem, 0,
                  static_cast<std::size_t>(out.dweight.cols) * elem);
    }
  });
}

std::int64_t DenseBackward::write_dhidden_row(std::int64_t row, const float* src) const {
  auto* dst = static_cast<std::byte*>(out.dhidden.data) +
              static_cast<std::size_t>(row * out.dhidden.ld) * size_of(out.dhidden.dtype);
  return store_f32_as(k, src, dst, out.dhidden.dtype, p.shape.hidden);
}

void DenseBackward::zero_dhidden_row(std::int64_t row) const {
  const std::size_t elem = size_of(out.dhidden.dtype);
  std::memset(static_cast<std::byte*>(out.dhidden.data) + static_cast<std::size_t>(row * out.dhidden.ld) * elem, 0,
              static_cast<std::size_t>(p.shape.hidden) * elem);
}

}  // namespace grpo::detail
