// One call's pass over the LM-head schedule, shared by the fused GRPO loss
// (lm_head_driver.cpp) and the generic log-prob head (log_prob_head_driver.cpp):
//   forward   tasks over vocab tiles: logits tile = hidden rows x W tile
//             (oneDNN, single-threaded in the task), then the row-statistics
//             stage on the tile while it is in cache; with keep, the block
//             buffer keeps x - max per tile. Then per row, the tile statistics
//             merged in tile order -> LSE, logp, entropy.
//   backward  the active rows (nonzero upstream) compacted to the top of the
//             block: tasks over vocab tiles write dlogits in place over the
//             block buffer, add dbias, then dW tile (+)= dlogits tile^T x
//             active hidden rows; then tasks over hidden chunks: dhidden =
//             dlogits x W chunk.
// What differs between the two heads is only where the per-row coefficients
// come from (the loss's c_t, or the caller's dL/dlogp and dL/dEnt) and whether
// the backward's logits are the forward's stored block or a recompute of the
// active rows alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "driver/lm_head_plan.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "driver/step_exchange.hpp"

namespace grpo::detail {

// Thread-nanoseconds of one phase, added from concurrent tasks (relaxed: read after the loops join).
class PhaseClock {
 public:
  template <class F>
  void time(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                  std::memory_order_relaxed);
  }
  double seconds() const { return static_cast<double>(ns_.load(std::memory_order_relaxed)) * 1e-9; }

 private:
  std::atomic<std::int64_t> ns_{0};
};

struct LmHeadStep {
  const LmHeadPlanData& p;
  const LmHeadInputs& in;
  const LmHeadOutputs& out;
  BindingPool::Lease bindings;
  const kernels::StageKernels& k = kernels::kernels();
  LogitTransform transform;
  std::size_t in_size;
  std::size_t store_size;
  std::size_t dl_size;
  std::size_t act_row_bytes;  // row stride of hidden_act: hidden_ld elements, as the forward GEMM reads it
  bool vocab_major;
  StepRegions ws;          // the workspace, as book_workspace (lm_head_schedule.cpp) booked it
  StepExchange& exchange;  // the call's, see step_exchange.hpp
  LmHeadStepStats stats;
  PhaseClock forward_gemm_clock, forward_stage_clock, dlogits_clock, dweight_clock, dhidden_clock;

  // stats with the phase times filled in.
  LmHeadStepStats step_stats() const {
    LmHeadStepStats s = stats;
    s.forward_gemm_s = forward_gemm_clock.seconds();
    s.forward_stage_s = forward_stage_clock.seconds();
    s.dlogits_s = dlogits_clock.seconds();
    s.dweight_gemm_s = dweight_clock.seconds();
    s.dhidden_gemm_s = dhidden_clock.seconds();
    return s;
  }

  LmHeadStep(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::byte* workspace,
             StepExchange& call_exchange)
      : p(plan),
        in(inputs),
        out(outputs),
        bindings(plan.bindings.acquire()),
        transform(plan.config),
        in_size(size_of(plan.shape.dtype)),
        store_size(plan.store_type == kernels::Elem::f32 ? 4 : 2),
        dl_size(size_of(plan.dlogits_dtype)),
        act_row_bytes(static_cast<std::size_t>(plan.shape.hidden_ld) * in_size),
        vocab_major(plan.shape.layout == WeightLayout::vocab_major),
        ws(workspace, plan.layout, plan.block_rows_alloc, plan.rows, plan.entropy_bonus),
        exchange(call_exchange) {}

  float* slot_tile(int slot) const { return reinterpret_cast<float*>(ws.slots + slot * p.layout.slot_bytes); }
  void* slot_scratch(int slot) const { return ws.slots + slot * p.layout.slot_bytes + p.layout.tile_bytes; }
  // No mask (the generic head's option): every row is valid.
  bool valid(std::int64_t row) const { return in.batch.mask.empty() || in.batch.mask[row] != 0.0F; }
  const std::byte* hidden_row(std::int64_t row) const {
    return static_cast<const std::byte*>(in.hidden.data) + static_cast<std::size_t>(row * p.shape.hidden_ld) * in_size;
  }
  // The first element of W's vocab column range / hidden column range.
  const std::byte* weight_at_vocab(std::int64_t v) const {
    const auto* w = static_cast<const std::byte*>(in.weight.data);
    return w + static_cast<std::size_t>(vocab_major ? v * p.shape.weight_ld : v) * in_size;
  }
  const std::byte* weight_at_hidden(std::int64_t h) const {
    const auto* w = static_cast<const std::byte*>(in.weight.data);
    return w + static_cast<std::size_t>(vocab_major ? h : h * p.shape.weight_ld) * in_size;
  }
  std::byte* block_at(std::int64_t row, std::int64_t col, std::size_t elem) const {
    return ws.block.data() +
           (static_cast<std::size_t>(row) * static_cast<std::size_t>(p.shape.vocab) + static_cast<std::size_t>(col)) *
               elem;
  }

  // Logits, statistics, LSE, logp and entropy of rows [b0, b0 + nb). Every
  // logits GEMM call has exactly forward_rows rows (see kForwardRows): a
  // partial last chunk is copied to the stage buffer and zero-padded.
  void forward(std::int64_t b0, std::int64_t nb, bool keep) {
    const std::int64_t fr = p.forward_rows;
    const std::int64_t chunks = (nb + fr - 1) / fr;
    const std::int64_t partial = nb - (chunks - 1) * fr;  // rows of the last chunk
    const bool staged = partial != fr;
    if (staged) {
      const std::size_t used = static_cast<std::size_t>(partial - 1) * act_row_bytes + p.shape.hidden * in_size;
      std::memcpy(ws.stage.data(), hidden_row(b0 + (chunks - 1) * fr), used);
      std::memset(ws.stage.data() + used, 0, static_cast<std::size_t>(fr) * act_row_bytes - used);
    }
    forward_rows(
        nb, keep,
        [&](std::int64_t c) -> const void* {
          return c == chunks - 1 && staged ? ws.stage.data() : static_cast<const void*>(hidden_row(b0 + c * fr));
        },
        [&](std::int64_t r) { return b0 + r; });
  }

  // forward() of the rows gathered by gather_active() (block row i is row
  // b0 + active[i]), with keep: the generic head's backward recomputes only
  // the logits of rows with a nonzero upstream gradient. The GEMM calls have
  // forward_rows rows and the forward's row stride, so each row's logits are
  // bitwise the forward pass's.
  void forward_gathered(std::int64_t b0, std::int64_t na) {
    forward_rows(
        na, true,
        [&](std::int64_t c) -> const void* {
          return ws.hidden_act.data() + static_cast<std::size_t>(c * p.forward_rows) * act_row_bytes;
        },
        [&](std::int64_t r) { return b0 + ws.rows.active[r]; });
  }

  // Copies rows [b0, b0 + nb) of logp / entropy / kl (block-relative arrays)
  // to the token outputs.
  void write_token_outputs(std::int64_t b0, std::int64_t nb, const float* lp, const float* ent,
                           const float* kl_terms) const {
    const auto bytes = static_cast<std::size_t>(nb) * sizeof(float);
    std::memcpy(out.tokens.logp.data() + b0, lp, bytes);
    if (!out.tokens.entropy.empty()) std::memcpy(out.tokens.entropy.data() + b0, ent, bytes);
    if (!out.tokens.kl.empty()) std::memcpy(out.tokens.kl.data() + b0, kl_terms, bytes);
  }

  void zero_dhidden_row(std::int64_t row) const {
    const std::size_t elem = size_of(out.dhidden.dtype);
    std::memset(static_cast<std::byte*>(out.dhidden.data) + static_cast<std::size_t>(row * out.dhidden.ld) * elem, 0,
                static_cast<std::size_t>(p.shape.hidden) * elem);
  }

  // Collects the block rows r in [0, nb) with is_active(r) into active[]; returns their count.
  template <class Pred>
  std::int64_t select_active(std::int64_t nb, Pred&& is_active) {
    std::int64_t na = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (is_active(r)) ws.rows.active[na++] = r;
    }
    return na;
  }

  // Copies the active rows' hidden rows (block b0) to hidden_act and zeroes
  // rows [na, padded): padding rows add exact zeros to every GEMM.
  void gather_active(std::int64_t b0, std::int64_t na, std::int64_t padded) {
    const std::size_t hidden_bytes = static_cast<std::size_t>(p.shape.hidden) * in_size;
    for (std::int64_t i = 0; i < na; ++i) {
      std::memcpy(ws.hidden_act.data() + static_cast<std::size_t>(i) * act_row_bytes,
                  hidden_row(b0 + ws.rows.active[i]), hidden_bytes);
    }
    std::memset(ws.hidden_act.data() + static_cast<std::size_t>(na) * act_row_bytes, 0,
                static_cast<std::size_t>(padded - na) * act_row_bytes);
  }

  // Gradients of rows [b0, b0 + nb) whose active rows (active[0, na), see
  // select_active / gather_active) have upstream coefficients
  //   a_r = logp_coef[r] (dL/dlogp) and, when entropy_coef is non-null,
  //   b_r = entropy_coef[r] (dL/dEnt), r the block row.
  // The statistics and stored logits of active row i sit at row active[i]
  // (the fused forward's block) or, when compacted, at row i (forward_gathered).
  void backward(std::int64_t b0, std::int64_t nb, std::int64_t na, bool compacted, const float* logp_coef,
                const float* entropy_coef, bool* dweight_written) {
    const std::int64_t hidden = p.shape.hidden;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t vt = p.schedule.vocab_tile;
    if (na == 0) {
      for (std::int64_t r = 0; r < nb; ++r) zero_dhidden_row(b0 + r);
      return;
    }
    const std::int64_t padded = (na + kRowQuantum - 1) / kRowQuantum * kRowQuantum;
    const bool dweight = !p.options.frozen_weight;
    stats.dhidden_gemm_rows += padded;
    stats.active_rows += na;
    if (dweight) stats.dweight_gemm_rows += padded;
    {  // what this block's backward moves (LmHeadStepStats::schedule_bytes)
      const double dl_bytes = static_cast<double>(padded) * static_cast<double>(vocab) * static_cast<double>(dl_size);
      const double w_bytes = static_cast<double>(vocab) * static_cast<double>(hidden) * static_cast<double>(in_size);
      stats.schedule_bytes += static_cast<double>(padded) * static_cast<double>(vocab) * store_size + dl_bytes;
      stats.schedule_bytes += w_bytes + static_cast<double>(p.hidden_chunks) * dl_bytes;
      if (dweight) {
        const double dw = static_cast<double>(vocab) * static_cast<double>(hidden) *
                          static_cast<double>(size_of(p.options.dweight_dtype));
        stats.schedule_bytes += dl_bytes + dw * (*dweight_written ? 2.0 : 1.0);
      }
    }
    const int accumulate = *dweight_written ? 1 : 0;
    const kernels::Elem dl_type = elem_of(p.dlogits_dtype);
    const std::size_t dw_size = size_of(p.options.dweight_dtype);
    const DweightTile dw_tile{p.shape};
    float* dbias = out.dbias.empty() ? nullptr : out.dbias.data();
    // The active hidden rows packed once for every vocab tile's dW GEMM (all
    // of this block's dW GEMMs pack them alike: only the dlogits side differs).
    const void* packed_act = nullptr;
    if (dweight) {
      const kernels::Gemm& any = *p.dweight[padded / kRowQuantum - 1].full[0];
      if (any.shared_packed_bytes() > 0) {
        any.pack_shared(ws.hidden_act.data(), ws.packed_hidden.data());
        packed_act = ws.packed_hidden.data();
      }
    }
    // The call's gradient scale (LmHeadInputs::grad_scale) rides on the row coefficients.
    const auto call_scale = static_cast<float>(in.grad_scale);
    const float logp_scale = transform.grad_scale * call_scale;
    const float entropy_scale = transform.entropy_grad_scale * call_scale;

    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      dlogits_clock.time([&] {
        for (std::int64_t i = 0; i < na; ++i) {
          const std::int64_t r = ws.rows.active[i];
          const std::int64_t s = compacted ? i : r;  // where row r's statistics and logits are
          const std::int64_t row = b0 + r;
          // A target column outside the tile (or W) takes no one-hot.
          const std::int64_t tgt = valid(row) ? exchange.column_of(in.batch.ids[row]) - c0 : -1;
          // E_p[x] = M + D/S = LSE - entropy (RowStats); dEnt/dx_v = -p_v (x_v - E_p[x]).
          RowUpstream u{logp_coef[r] * logp_scale};
          if (entropy_coef != nullptr) {
            u = {u.a, entropy_coef[r] * entropy_scale, ws.rows.lse[s] - ws.rows.entropy[s], true};
          }
          // Row i <= s: the compacted output never overwrites a stored row not yet read.
          dlogits_row(k, transform, block_at(s, c0, store_size), p.store_type, cols, 1.0F,
                      ws.tile_stats[s * p.tiles + j].max, ws.rows.lse[s], u, tgt, block_at(i, c0, dl_size), dl_type,
                      dbias != nullptr ? dbias + c0 : nullptr);
        }
        for (std::int64_t i = na; i < padded; ++i) std::memset(block_at(i, c0, dl_size), 0, cols * dl_size);
      });
      if (!dweight) return;  // frozen weight: the tile's dlogits feed dhidden alone
      const kernels::Gemm& gemm = *p.dweight[padded / kRowQuantum - 1].pick(j == p.tiles - 1)[accumulate];
      auto* dw = static_cast<std::byte*>(out.dweight.data) + dw_tile.offset(c0) * dw_size;
      const std::array<const void*, 2> ab = dw_tile.operands(block_at(0, c0, dl_size), ws.hidden_act.data());
      dweight_clock.time(
          [&] { bindings.at(gemm, slot).run(ab[0], ab[1], dw, nullptr, slot_scratch(slot), packed_act); });
    });
    *dweight_written = dweight;

    const auto& dhidden_gemms = p.dhidden[padded / kRowQuantum - 1];
    for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
      const std::int64_t h0 = chunk * p.hidden_chunk;
      const kernels::Gemm& gemm = *dhidden_gemms.pick(chunk == p.hidden_chunks - 1);
      dhidden_clock.time([&] {
        bindings.at(gemm, slot)
            .run(ws.block.data(), weight_at_hidden(h0), ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
      });
    });
    exchange.sum_dhidden(ws.dhidden_act.data(), na * hidden);

    std::int64_t i = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (i < na && ws.rows.active[i] == r) {
        auto* dst = static_cast<std::byte*>(out.dhidden.data) +
                    static_cast<std::size_t>((b0 + r) * out.dhidden.ld) * size_of(out.dhidden.dtype);
        const float* src = ws.dhidden_act.data() + i * hidden;
        if (out.dhidden.dtype == DType::f32) {
          std::memcpy(dst, src, static_cast<std::size_t>(hidden) * sizeof(float));
        } else {
          k.f32_to_bf16(src, reinterpret_cast<std::uint16_t*>(dst), hidden);
        }
        ++i;
      } else {
        zero_dhidden_row(b0 + r);
      }
    }
  }

  void zero_dweight() const {
    if (p.options.frozen_weight) return;
    const std::size_t elem = size_of(out.dweight.dtype);
    for (std::int64_t r = 0; r < out.dweight.rows; ++r) {
      std::memset(static_cast<std::byte*>(out.dweight.data) + static_cast<std::size_t>(r * out.dweight.ld) * elem, 0,
                  static_cast<std::size_t>(out.dweight.cols) * elem);
    }
  }

 private:
  // The forward of nb rows: chunk_source(c) is the GEMM's A operand for rows
  // [c * forward_rows, (c + 1) * forward_rows) (forward_rows rows of stride
  // hidden_ld), row_of(r) the batch row of block row r.
  template <class ChunkSource, class RowOf>
  void forward_rows(std::int64_t nb, bool keep, ChunkSource&& chunk_source, RowOf&& row_of) {
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t fr = p.forward_rows;
    const std::int64_t chunks = (nb + fr - 1) / fr;
    stats.logits_gemm_rows += chunks * fr;
    // W read by every chunk's calls; the kept logits written once.
    stats.schedule_bytes += static_cast<double>(chunks) * static_cast<double>(vocab) *
                                static_cast<double>(p.shape.hidden) * static_cast<double>(in_size) +
                            (keep ? static_cast<double>(nb) * static_cast<double>(vocab) * store_size : 0.0);
    const std::size_t bias_size = in.bias.empty() ? 0 : size_of(in.bias.dtype);
    // Each chunk's hidden rows packed once for every vocab tile (full and last
    // tiles pack them alike), the chunks in parallel.
    const std::size_t chunk_packed = p.forward.full->shared_packed_bytes();
    if (chunk_packed > 0) {
      for_each_item(chunks, p.schedule.slots, [&](std::int64_t c, int /*slot*/) {
        p.forward.full->pack_shared(chunk_source(c),
                                    ws.packed_hidden.data() + static_cast<std::size_t>(c) * chunk_packed);
      });
    }
    const auto packed_chunk = [&](std::int64_t c) -> const void* {
      return chunk_packed > 0 ? ws.packed_hidden.data() + static_cast<std::size_t>(c) * chunk_packed : nullptr;
    };
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      float* tile = slot_tile(slot);
      const kernels::Gemm& gemm = *p.forward.pick(j == p.tiles - 1);
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
            if (transform.capped())
              k.softcap(z, kernels::Elem::f32, cols, transform.softcap_scale, transform.softcap, z);
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
};

}  // namespace grpo::detail
