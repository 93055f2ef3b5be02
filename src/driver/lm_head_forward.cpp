// The step's forward pass (see lm_head_forward.hpp).
#include "driver/lm_head_forward.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "driver/parallel.hpp"

namespace grpo::detail {

kernels::GemmSpec forward_spec(const LmHeadShape& s, std::int64_t rows, std::int64_t cols, std::int64_t tile_ld) {
  kernels::GemmSpec g;
  g.a = {s.dtype, rows, s.hidden, s.hidden_ld, 1};
  g.b = s.layout == WeightLayout::vocab_major ? kernels::GemmOperand{s.dtype, s.hidden, cols, 1, s.weight_ld}
                                              : kernels::GemmOperand{s.dtype, s.hidden, cols, s.weight_ld, 1};
  g.c = {DType::f32, rows, cols, tile_ld, 1};
  g.has_bias = s.has_bias;
  g.bias_dtype = s.bias_dtype;
  g.shared = kernels::SharedOperand::a;  // the block's hidden rows, for every vocab tile
  return g;
}

void create_forward_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed) {
  const LmHeadShape& s = p.shape;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  ForwardPlan& f = p.forward;
  kernels::GemmSizes full;
  f.gemms.full = make.make(forward_spec(s, p.forward_rows, vt, vt), &full);
  f.gemms.last = make.make(forward_spec(s, p.forward_rows, last_tile, last_tile));
  // Full and last tiles pack the shared hidden rows alike (only W's side differs).
  *packed = std::max(*packed, static_cast<std::size_t>(p.block_rows_alloc / p.forward_rows) * full.shared_packed_bytes);
  // A shorter last block, when the block's forward calls are ours (rows
  // independent of M): GEMMs of its own, as many calls as a block's at most,
  // so it computes its rows (rounded up to kRowQuantum), not the block's
  // (T = 8192 in 640-row blocks: 512 rows, not 640, in the last).
  const std::int64_t block = p.schedule.token_block;
  const std::int64_t tail_rows = round_up(p.rows - (p.rows - 1) / block * block, kRowQuantum);
  if (tail_rows < p.block_rows_alloc && full.traits.m_independent) {
    const std::int64_t calls = calls_of(tail_rows, p.forward_rows);
    f.tail_block = tail_rows;
    f.tail_rows = rows_per_call(tail_rows, p.forward_rows);
    kernels::GemmSizes tail;
    f.tail.full = make.make(forward_spec(s, f.tail_rows, vt, vt), &tail);
    f.tail.last = make.make(forward_spec(s, f.tail_rows, last_tile, last_tile));
    *packed = std::max(*packed, static_cast<std::size_t>(calls) * tail.shared_packed_bytes);
  }
}

void book_forward(const LmHeadPlanData& p, bool packed_estimate, WorkspaceRegistry& w) {
  const LmHeadShape& s = p.shape;
  const std::size_t in_size = size_of(s.dtype);
  const std::size_t store_bytes = p.store_type == kernels::Elem::f32 ? 4 : 2;
  // The block buffer keeps the logits for the backward only (whose dlogits it then holds).
  w.book(Region::block, p.options.forward_only ? 0 : static_cast<std::size_t>(s.vocab) * store_bytes);
  w.book(Region::stage, 0, static_cast<std::size_t>(p.forward_rows * s.hidden_ld) * in_size);
  w.book(Region::tile_stats, static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats));
  std::array<WorkspacePiece, RowArrays::kFloatArrays + 1> rows{};
  for (WorkspacePiece& piece : rows) piece = {sizeof(float), 0, 1};
  rows.back().per_row = sizeof(std::int64_t);  // active
  w.book_pieces(Region::row_arrays, rows);
  // The hidden rows as the backend packs them, for the forward's chunks and the backward's active rows.
  if (packed_estimate) {
    // bf16 rows packed as bf16 (f32 by the widening backends: an estimate),
    // f16 rows widened to f32; f32 rows are not packed (oneDNN takes them).
    const std::size_t per_row = s.dtype == DType::bf16 ? 2 : s.dtype == DType::f16 ? 4 : 0;
    w.book(Region::packed_hidden, static_cast<std::size_t>(s.hidden) * per_row);
  } else {
    w.book(Region::packed_hidden, 0, p.packed_hidden_bytes);
  }
}

template <class ChunkSource, class RowOf>
void ForwardPass::compute_rows(std::int64_t nb, bool keep, const FullAndLast<std::unique_ptr<kernels::Gemm>>& gemms,
                               std::int64_t fr, ChunkSource&& chunk_source, RowOf&& row_of) {
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t chunks = (nb + fr - 1) / fr;
  stats.logits_gemm_rows += chunks * fr;
  // W read by every chunk's calls; the kept logits written once.
  stats.schedule_bytes += static_cast<double>(chunks) * static_cast<double>(vocab) *
                              static_cast<double>(p.shape.hidden) * static_cast<double>(in_size) +
                          (keep ? static_cast<double>(nb) * static_cast<double>(vocab) * store_size : 0.0);
  const std::size_t bias_size = in.bias.empty() ? 0 : size_of(in.bias.dtype);
  // Each chunk's hidden rows packed once for every vocab tile (full and last
  // tiles pack them alike), the chunks in parallel.
  const std::size_t chunk_packed = gemms.full->shared_packed_bytes();
  if (chunk_packed > 0) {
    for_each_item(chunks, p.schedule.slots, [&](std::int64_t c, int /*slot*/) {
      gemms.full->pack_shared(chunk_source(c), ws.packed_hidden.data() + static_cast<std::size_t>(c) * chunk_packed);
    });
  }
  const auto packed_chunk = [&](std::int64_t c) -> const void* {
    return chunk_packed > 0 ? ws.packed_hidden.data() + static_cast<std::size_t>(c) * chunk_packed : nullptr;
  };
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
    const std::int64_t c0 = j * vt;
    const std::int64_t cols = std::min(vt, vocab - c0);
    float* tile = slot_tile(slot);
    const kernels::Gemm& gemm = *gemms.pick(j == p.tiles - 1);
    const void* bias = in.bias.empty() ? nullptr : static_cast<const std::byte*>(in.bias.data) + c0 * bias_size;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t r0 = c * fr;
      forward_gemm_clock.time([&] {
        bindings.at(gemm, slot)
            .run(chunk_source(c), weight_at_vocab(c0), tile, bias, slot_scratch(slot), packed_chunk(c));
      });
      forward_stage_clock.time([&] {
        for (std::int64_t r = r0; r < std::min(nb, r0 + fr); ++r) {
          float* z = tile + (r - r0) * cols;
          // z -> z' = c tanh(s z / c) in place, while the row is in cache.
          if (transform.capped()) k.softcap(z, kernels::Elem::f32, cols, transform.softcap_scale, transform.softcap, z);
          ws.tile_stats[r * p.tiles + j] =
              keep ? k.row_stats_store(z, cols, transform.scale, block_at(r, c0, store_size), p.store_type)
                   : k.row_stats(z, kernels::Elem::f32, cols, transform.scale);
          const std::int64_t row = row_of(r);
          if (valid(row)) {
            const std::int64_t id = exchange.column_of(in.batch.ids[row]);
            if (id >= c0 && id < c0 + cols) ws.rows.target[r] = z[id - c0] * transform.scale;
          }
        }
      });
    }
  });
  // The statistics of every tile of each row (every shard's, see StepExchange).
  std::int64_t tiles = 0;
  const kernels::RowStats* row_tiles = exchange.row_stats(
      nb, ws.tile_stats.data(), ws.rows.target.data(),
      [&](std::int64_t r) -> std::int64_t {
        const std::int64_t row = row_of(r);
        return valid(row) ? in.batch.ids[row] : -1;
      },
      &tiles);
  for (std::int64_t r = 0; r < nb; ++r) {
    kernels::RowStats st;
    for (std::int64_t j = 0; j < tiles; ++j) st = kernels::merge(st, row_tiles[r * tiles + j]);
    const std::int64_t row = row_of(r);
    const RowResult res = finish_row(st, ws.rows.target[r], valid(row), transform);
    check_row(res.lse, res.logp, valid(row), row, "hidden");
    ws.rows.lse[r] = res.lse;
    ws.rows.logp[r] = res.logp;
    ws.rows.entropy[r] = res.entropy;
  }
}

void ForwardPass::block(std::int64_t b0, std::int64_t nb, bool keep) {
  const bool tail = p.forward.tail.full != nullptr && nb <= p.forward.tail_block;
  const std::int64_t fr = tail ? p.forward.tail_rows : p.forward_rows;
  const std::int64_t chunks = (nb + fr - 1) / fr;
  const std::int64_t partial = nb - (chunks - 1) * fr;  // rows of the last chunk
  const bool staged = partial != fr;
  if (staged) {
    const std::size_t used = static_cast<std::size_t>(partial - 1) * act_row_bytes + p.shape.hidden * in_size;
    std::memcpy(ws.stage.data(), hidden_row(b0 + (chunks - 1) * fr), used);
    std::memset(ws.stage.data() + used, 0, static_cast<std::size_t>(fr) * act_row_bytes - used);
  }
  compute_rows(
      nb, keep, tail ? p.forward.tail : p.forward.gemms, fr,
      [&](std::int64_t c) -> const void* {
        return c == chunks - 1 && staged ? ws.stage.data() : static_cast<const void*>(hidden_row(b0 + c * fr));
      },
      [&](std::int64_t r) { return b0 + r; });
}

void ForwardPass::gathered(std::int64_t b0, std::int64_t na) {
  compute_rows(
      na, true, p.forward.gemms, p.forward_rows,
      [&](std::int64_t c) -> const void* {
        return ws.hidden_act.data() + static_cast<std::size_t>(c * p.forward_rows) * act_row_bytes;
      },
      [&](std::int64_t r) { return b0 + ws.rows.active[r]; });
}

}  // namespace grpo::detail
