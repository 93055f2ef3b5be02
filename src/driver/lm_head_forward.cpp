// The step's forward pass (see lm_head_forward.hpp).
#include "driver/lm_head_forward.hpp"

#include <algorithm>
#include <cstring>

#include "driver/parallel.hpp"

namespace grpo::detail {

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
  const bool tail = p.forward_tail.full != nullptr && nb <= p.forward_tail_block;
  const std::int64_t fr = tail ? p.forward_tail_rows : p.forward_rows;
  const std::int64_t chunks = (nb + fr - 1) / fr;
  const std::int64_t partial = nb - (chunks - 1) * fr;  // rows of the last chunk
  const bool staged = partial != fr;
  if (staged) {
    const std::size_t used = static_cast<std::size_t>(partial - 1) * act_row_bytes + p.shape.hidden * in_size;
    std::memcpy(ws.stage.data(), hidden_row(b0 + (chunks - 1) * fr), used);
    std::memset(ws.stage.data() + used, 0, static_cast<std::size_t>(fr) * act_row_bytes - used);
  }
  compute_rows(
      nb, keep, tail ? p.forward_tail : p.forward, fr,
      [&](std::int64_t c) -> const void* {
        return c == chunks - 1 && staged ? ws.stage.data() : static_cast<const void*>(hidden_row(b0 + c * fr));
      },
      [&](std::int64_t r) { return b0 + r; });
}

void ForwardPass::gathered(std::int64_t b0, std::int64_t na) {
  compute_rows(
      na, true, p.forward, p.forward_rows,
      [&](std::int64_t c) -> const void* {
        return ws.hidden_act.data() + static_cast<std::size_t>(c * p.forward_rows) * act_row_bytes;
      },
      [&](std::int64_t r) { return b0 + ws.rows.active[r]; });
}

}  // namespace grpo::detail
