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
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "driver/lm_head_plan.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "driver/step_exchange.hpp"
#include "driver/tail_basis.hpp"

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
  // The filtered backward: whether a row of the block had more remainders
  // than kept_lo holds; whether a block ran filtered (the tail's dW
  // coordinates need applying) and whether this call's hidden basis exists.
  std::atomic<bool> lo_overflow{false};
  bool tail_used = false;
  bool hidden_basis_ready = false;
  // The guard (filter_guard): the exact step's estimated dW error (squared)
  // over the call's blocks so far.
  double exact_dweight_error = 0.0;

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
        ws(workspace, plan.layout, plan.block_rows_alloc, plan.rows, plan.entropy_bonus, plan.shape.vocab, plan.tiles,
           tail_dims(plan)),
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
  // logits GEMM call has exactly forward_rows rows (see kForwardRows), or
  // forward_tail_rows for the shorter last block that has its own GEMMs: a
  // partial last chunk is copied to the stage buffer and zero-padded.
  void forward(std::int64_t b0, std::int64_t nb, bool keep) {
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
    forward_rows(
        nb, keep, tail ? p.forward_tail : p.forward, fr,
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
        na, true, p.forward, p.forward_rows,
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

  // dhidden's output row (f32, or rounded to bf16) from f32 src.
  void write_dhidden_row(std::int64_t row, const float* src) const {
    auto* dst = static_cast<std::byte*>(out.dhidden.data) +
                static_cast<std::size_t>(row * out.dhidden.ld) * size_of(out.dhidden.dtype);
    if (out.dhidden.dtype == DType::f32) {
      std::memcpy(dst, src, static_cast<std::size_t>(p.shape.hidden) * sizeof(float));
    } else {
      k.f32_to_bf16(src, reinterpret_cast<std::uint16_t*>(dst), p.shape.hidden);
    }
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
  // Without the filter each vocab tile's task writes its dlogits and runs its
  // dW GEMM while they are in cache; with it (LmHeadOptions::grad_filter) the
  // tiles first write dlogits and mark the kept columns, then the block runs
  // either the same dW GEMMs (kept columns past kept_cap: bitwise the
  // unfiltered block) or backward_kept().
  void backward(std::int64_t b0, std::int64_t nb, std::int64_t na, bool compacted, const float* logp_coef,
                const float* entropy_coef, bool* dweight_written) {
    const std::int64_t hidden = p.shape.hidden;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t vt = p.schedule.vocab_tile;
    if (na == 0) {
      for (std::int64_t r = 0; r < nb; ++r) zero_dhidden_row(b0 + r);
      return;
    }
    const std::int64_t padded = p.row_ladder.padded(na);
    const bool dweight = !p.options.frozen_weight;
    const bool filter = p.kept_cap > 0;
    stats.dhidden_gemm_rows += padded;
    stats.active_rows += na;
    if (dweight) stats.dweight_gemm_rows += padded;
    const int accumulate = *dweight_written ? 1 : 0;
    const kernels::Elem dl_type = elem_of(p.dlogits_dtype);
    const std::size_t dw_size = size_of(p.options.dweight_dtype);
    const DweightTile dw_tile{p.shape};
    float* dbias = out.dbias.empty() ? nullptr : out.dbias.data();
    // The call's gradient scale (LmHeadInputs::grad_scale) rides on the row coefficients.
    const auto call_scale = static_cast<float>(in.grad_scale);
    const float logp_scale = transform.grad_scale * call_scale;
    const float entropy_scale = transform.entropy_grad_scale * call_scale;
    // The filter's bound on a row's |g_v| / eps: |a| + |b|, times s under a softcap (|dz'/dz| <= s).
    const float chain = transform.capped() ? transform.softcap_scale : 1.0F;

    // The tile's dlogits rows (+ dbias), and under the filter its kept columns.
    // With bf16 dlogits under the filter (kept_lo_cap > 0) each row is
    // computed in f32 in the slot's tile, written rounded as the kernel
    // rounds, and each entry at or above the row's threshold (the entries
    // whose rounding matters; the kept columns are theirs) leaves its
    // remainder g - bf16(g) in the row's list in kept_lo.
    const bool with_lo = p.kept_lo_cap > 0;
    const auto tile_dlogits = [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      dlogits_clock.time([&] {
        std::uint8_t* mark = filter ? ws.kept.mark.data() + c0 : nullptr;
        if (filter) std::memset(mark, 0, static_cast<std::size_t>(cols));
        // Row i's dlogits into out (+ dbias); its filter threshold returned.
        const auto row_dlogits = [&](std::int64_t i, void* out, kernels::Elem out_type) {
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
          dlogits_row(k, transform, block_at(s, c0, store_size), p.store_type, cols, 1.0F,
                      ws.tile_stats[s * p.tiles + j].max, ws.rows.lse[s], u, tgt, out, out_type,
                      dbias != nullptr ? dbias + c0 : nullptr);
          return p.grad_filter * (std::fabs(u.a) + std::fabs(u.b)) * chain;
        };
        // with_lo: one row's f32 dlogits, its own marks and their columns, in the slot's tile.
        float* f = slot_tile(slot);
        auto* own = reinterpret_cast<std::uint8_t*>(f + vt);
        auto* found = reinterpret_cast<std::int32_t*>(f + 2 * vt);
        for (std::int64_t i = 0; i < na; ++i) {
          // Row i <= s: the compacted output never overwrites a stored row not yet read.
          std::byte* g = block_at(i, c0, dl_size);
          if (!with_lo) {
            const float threshold = row_dlogits(i, g, dl_type);
            if (!filter) continue;
            ws.tail.below[i * p.tiles + j] = k.mark_kept(g, dl_type, cols, threshold, mark);
            if (j == 0) ws.tail.row_scale[i] = threshold / p.grad_filter;
            // f32 dlogits: the exact step's error at an entry taken as its
            // rounding's mean square, g^2 2^-48 / 3.
            if (p.filter_guard) guard_row_errors(i, j, reinterpret_cast<const float*>(g), cols, threshold);
            continue;
          }
          const float threshold = row_dlogits(i, f, kernels::Elem::f32);
          auto* hi = reinterpret_cast<std::uint16_t*>(g);
          k.f32_to_bf16(f, hi, cols);  // bit for bit the kernel's own bf16 output
          std::memset(own, 0, static_cast<std::size_t>(cols));
          ws.tail.below[i * p.tiles + j] = k.mark_kept(f, kernels::Elem::f32, cols, threshold, own);
          if (j == 0) ws.tail.row_scale[i] = threshold / p.grad_filter;
          // This row's marked entries (8 marks at a time): the tile's marks, and their remainders.
          std::int64_t n = 0;
          for (std::int64_t w = 0; w < cols; w += 8) {
            std::uint64_t word = 0;
            std::memcpy(&word, own + w, static_cast<std::size_t>(std::min<std::int64_t>(8, cols - w)));
            if (word == 0) continue;
            for (std::int64_t c = w; c < std::min(w + 8, cols); ++c) {
              if (own[c] == 0) continue;
              mark[c] = 1;
              found[n++] = static_cast<std::int32_t>(c);
            }
          }
          if (p.filter_guard) {  // the exact step's error at these entries: its rounding of each to bf16
            float eh = 0.0F, ew = 0.0F;
            for (std::int64_t x = 0; x < n; ++x) {
              const std::int64_t c = found[x];
              const float d = f[c] - kernels::bf16_to_float(hi[c]);
              eh += d * d * ws.tail.norm_w[c0 + c];
              ew += d * d;
            }
            ws.tail.err_h[i * p.tiles + j] = eh;
            ws.tail.err_w[i * p.tiles + j] = ew;
          }
          const KeptRemainders& lo = ws.kept_lo;
          const std::int32_t at = std::atomic_ref<std::int32_t>(lo.count[i]).fetch_add(static_cast<std::int32_t>(n));
          if (at + n > p.kept_lo_cap) {
            lo_overflow.store(true, std::memory_order_relaxed);
            continue;
          }
          for (std::int64_t x = 0; x < n; ++x) {
            const std::int64_t c = found[x];
            lo.column[i * p.kept_lo_cap + at + x] = static_cast<std::int32_t>(c0 + c);
            lo.value[i * p.kept_lo_cap + at + x] = kernels::float_to_bf16(f[c] - kernels::bf16_to_float(hi[c]));
          }
        }
        if (filter) {
          std::int32_t* kept = ws.kept.column.data() + c0;
          std::int64_t n = 0;
          for (std::int64_t c = 0; c < cols; ++c) {
            if (mark[c] != 0) kept[n++] = static_cast<std::int32_t>(c0 + c);
          }
          ws.kept.count[j] = n;
        }
        for (std::int64_t i = na; i < padded; ++i) std::memset(block_at(i, c0, dl_size), 0, cols * dl_size);
      });
    };
    const void* packed_act = nullptr;
    // The tile's dW GEMM (dense: every column of the tile).
    const auto tile_dweight = [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const kernels::Gemm& gemm = *p.dweight[p.row_ladder.index_of(padded)].pick(j == p.tiles - 1)[accumulate];
      auto* dw = static_cast<std::byte*>(out.dweight.data) + dw_tile.offset(c0) * dw_size;
      const std::array<const void*, 2> ab = dw_tile.operands(block_at(0, c0, dl_size), ws.hidden_act.data());
      dweight_clock.time(
          [&] { bindings.at(gemm, slot).run(ab[0], ab[1], dw, nullptr, slot_scratch(slot), packed_act); });
    };

    std::int64_t kept_total = vocab;  // columns the backward GEMMs run over
    bool kept_path = false;           // the filtered GEMMs (backward_kept)
    std::int64_t dense = 0;           // its dense rows (tail.dense_block)
    if (!filter) {
      if (dweight) packed_act = pack_active_rows(*p.dweight[p.row_ladder.index_of(padded)].full[0]);
      for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
        tile_dlogits(j, slot);
        if (dweight) tile_dweight(j, slot);  // frozen weight: the tile's dlogits feed dhidden alone
      });
    } else {
      lo_overflow.store(false, std::memory_order_relaxed);
      if (with_lo) std::memset(ws.kept_lo.count, 0, static_cast<std::size_t>(na) * sizeof(std::int32_t));
      for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) { tile_dlogits(j, slot); });
      // Every tile's kept columns, in column order, from kept.column[0].
      kept_total = 0;
      for (std::int64_t j = 0; j < p.tiles; ++j) {
        const std::int64_t n = ws.kept.count[j];
        std::memmove(ws.kept.column.data() + kept_total, ws.kept.column.data() + j * vt, n * sizeof(std::int32_t));
        kept_total += n;
      }
      kept_path = kept_total <= p.kept_cap && kept_total < vocab && !lo_overflow.load(std::memory_order_relaxed);
      if (kept_path) dense = dense_rows(na, compacted);
      kept_path = kept_path && dense <= kRowQuantum;
      // The tail correction's coordinates (and the guard's probes) before the
      // block commits to the filter: with grad_filter = auto a block whose
      // left-out entries the correction does not hold runs exact.
      // A block the guard refuses at eps tries again at eps / 4, eps / 16, ...
      // (kFilterRungs): the columns whose entries reach the lower threshold
      // join the kept ones (their bf16 dlogits as the exact step has them).
      if (kept_path && p.tail_rank > 0) {
        tail_block(padded, na, dweight);
        if (p.filter_guard) {
          const double exact_dhidden = block_exact_errors(na, dense, dweight);
          int rung = 0;
          while (!guard_holds(na, dense, dweight, exact_dhidden)) {
            if (++rung == kFilterRungs || (kept_total = keep_at_rung(na, rung)) > p.kept_cap || kept_total >= vocab) {
              kept_path = false;
              kept_total = vocab;
              break;
            }
            tail_kept_terms(na, rung);
          }
          // Either count, never both: a block lowered and still refused ran exact.
          if (!kept_path) {
            ++stats.filter_guard_blocks;
          } else if (rung > 0) {
            ++stats.filter_lowered_blocks;
          }
        }
        if (kept_path && dweight) commit_tail_dweight();
      }
      if (!kept_path) {  // too many to pay (or the guard): the unfiltered block, bitwise
        kept_total = vocab;
        if (dweight) {
          packed_act = pack_active_rows(*p.dweight[p.row_ladder.index_of(padded)].full[0]);
          for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) { tile_dweight(j, slot); });
        }
      }
    }
    {  // what this block's backward moves (LmHeadStepStats::schedule_bytes)
      const std::int64_t run = kept_path ? kept_groups(kept_total) * p.kept_tile : vocab;  // GEMM columns
      const auto cols = static_cast<double>(run);
      const double dl_bytes = static_cast<double>(padded) * cols * static_cast<double>(dl_size);
      const double w_bytes = cols * static_cast<double>(hidden) * static_cast<double>(in_size);
      // The stored logits read and the dlogits written (and under the filter
      // the kept ones moved into the compact matrix).
      stats.schedule_bytes +=
          static_cast<double>(padded) * static_cast<double>(vocab) * (store_size + static_cast<double>(dl_size)) +
          (kept_path ? 2.0 * dl_bytes : 0.0);
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
        stats.schedule_bytes += dl_bytes + (kept_path ? 2.0 * dw_kept + (*dweight_written ? 0.0 : dw_all)
                                                      : dw_all * (*dweight_written ? 2.0 : 1.0));
      }
    }
    if (kept_path) {
      if (dense > 0) dense_dhidden(dense);
      backward_kept(padded, na, kept_total, dweight, dweight_written);
      if (p.tail_rank > 0) tail_dhidden(na);
      for (std::int64_t x = 0; x < dense; ++x) {  // over the dense rows' filtered dhidden
        std::memcpy(ws.dhidden_act.data() + ws.tail.dense_block[x] * hidden, ws.tail.dense_out + x * hidden,
                    static_cast<std::size_t>(hidden) * sizeof(float));
      }
    } else {
      const auto& dhidden_gemms = p.dhidden[p.row_ladder.index_of(padded)];
      for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
        const std::int64_t h0 = chunk * p.hidden_chunk;
        const kernels::Gemm& gemm = *dhidden_gemms.pick(chunk == p.hidden_chunks - 1);
        dhidden_clock.time([&] {
          bindings.at(gemm, slot)
              .run(ws.block.data(), weight_at_hidden(h0), ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
        });
      });
    }
    *dweight_written = *dweight_written || dweight;
    exchange.sum_dhidden(ws.dhidden_act.data(), na * hidden);

    std::int64_t i = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (i < na && ws.rows.active[i] == r) {
        write_dhidden_row(b0 + r, ws.dhidden_act.data() + i * hidden);
        ++i;
      } else {
        zero_dhidden_row(b0 + r);
      }
    }
  }

  // The filtered backward's tail correction, per call (before any block): a
  // rank-k basis B_w of W's rows (a randomized range finder: the sketch
  // Omega W of every tail_stride-th row, Omega's first row all ones,
  // the rest random signs), its dual, and A = W B_w^T per vocab column in
  // the dlogits dtype (the tail_project GEMMs; bf16's 2^-9 on a correction
  // that is itself a few percent of dhidden). Depends on W alone.
  void prepare_tail() {
    if (p.tail_rank == 0) return;
    const std::int64_t k = p.tail_rank;
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t hidden = p.shape.hidden;
    const DType dl = p.dlogits_dtype;
    const TailRegions& t = ws.tail;
    tail_used = false;
    hidden_basis_ready = false;
    // Omega [kTailRows, V / tail_stride] in the block buffer (rows past k
    // zero) against every tail_stride-th row of W: the sketch of a sample of
    // W's rows (their shared directions are every row's).
    const std::int64_t sampled = (vocab + p.tail_stride - 1) / p.tail_stride;
    for_each_item(kTailRows, p.schedule.slots, [&](std::int64_t r, int /*slot*/) {
      std::byte* row = ws.block.data() + static_cast<std::size_t>(r * sampled) * dl_size;
      for (std::int64_t m = 0; m < sampled; ++m) {
        const float sgn = r < k ? tail_sign(m * p.tail_stride, r) : 0.0F;
        if (dl == DType::bf16) {
          reinterpret_cast<std::uint16_t*>(row)[m] = kernels::float_to_bf16(sgn);
        } else {
          reinterpret_cast<float*>(row)[m] = sgn;
        }
      }
    });
    for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
      const std::int64_t h0 = chunk * p.hidden_chunk;
      bindings.at(*p.tail_sketch.pick(chunk == p.hidden_chunks - 1), slot)
          .run(ws.block.data(), weight_at_hidden(h0), ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
    });
    // B_w and the guard's probes as hidden rows [kTailRows, hidden_ld] in
    // the stage buffer (rows past kc zero).
    constexpr std::int64_t kc = kTailCoords;
    fill_probes(ws.dhidden_act.data(), hidden, k, kc, hidden);
    std::memset(ws.stage.data(), 0, static_cast<std::size_t>(kTailRows) * act_row_bytes);
    tail_basis(ws.dhidden_act.data(), hidden, kc, k, hidden, t.work, ws.stage.data(), p.shape.hidden_ld, p.shape.dtype,
               t.dual_w);
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      float* tile = slot_tile(slot);  // [kTailRows, cols]
      bindings.at(*p.tail_project.pick(j == p.tiles - 1), slot)
          .run(ws.stage.data(), weight_at_vocab(c0), tile, nullptr, slot_scratch(slot), nullptr);
      for (std::int64_t c = 0; c < cols; ++c) {
        for (std::int64_t r = 0; r < kc; ++r) tail_store(t.coord, (c0 + c) * kc + r, tile[r * cols + c], dl);
      }
      if (p.filter_guard) column_norms(c0, cols, t.norm_w + c0);
    });
    exact_dweight_error = 0.0;
    if (!p.options.frozen_weight) {
      std::memset(t.cdw, 0, static_cast<std::size_t>(vocab * k) * sizeof(float));
      std::memset(t.probe_w, 0, static_cast<std::size_t>(vocab * (kc - k)) * sizeof(float));
      std::memset(t.left, 0, static_cast<std::size_t>(vocab));
    }
  }

  // Adds the tail's dW part (tail_block's coordinates C_w of every column some
  // block left out, times the hidden basis' dual) into dW: dW tile += C D
  // through the tail_apply GEMMs. After the last block.
  void finish_tail() {
    if (!tail_used || p.options.frozen_weight) return;
    const std::int64_t k = p.tail_rank;
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const DType dl = p.dlogits_dtype;
    const TailRegions& t = ws.tail;
    const DweightTile dw_tile{p.shape};
    const std::size_t dw_size = size_of(p.options.dweight_dtype);
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      bool any = false;
      for (std::int64_t c = c0; c < c0 + cols; ++c) {
        std::byte* row = ws.block.data() + static_cast<std::size_t>(c * kTailApplyLd) * dl_size;
        std::memset(row, 0, static_cast<std::size_t>(kTailApplyLd) * dl_size);
        if (t.left[c] == 0) continue;
        any = true;
        for (std::int64_t r = 0; r < k; ++r) {
          const float v = t.cdw[c * k + r];
          if (dl == DType::bf16) {  // [hi, hi, lo] against D's [hi; lo; hi]
            tail_store_pair(row, r, 2 * k, v, dl);
            reinterpret_cast<std::uint16_t*>(row)[k + r] = reinterpret_cast<std::uint16_t*>(row)[r];
          } else {
            reinterpret_cast<float*>(row)[r] = v;
          }
        }
      }
      if (!any) return;
      const std::byte* c_rows = ws.block.data() + static_cast<std::size_t>(c0 * kTailApplyLd) * dl_size;
      auto* dw = static_cast<std::byte*>(out.dweight.data) + dw_tile.offset(c0) * dw_size;
      const bool vm = vocab_major;
      dweight_clock.time([&] {
        bindings.at(*p.tail_apply.pick(j == p.tiles - 1), slot)
            .run(vm ? static_cast<const void*>(c_rows) : t.apply_b, vm ? static_cast<const void*>(t.apply_b) : c_rows,
                 dw, nullptr, slot_scratch(slot), nullptr);
      });
    });
  }

  void zero_dweight() const {
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

 private:
  // The block's active hidden rows packed once for every dW GEMM that takes
  // them (gemm's shared operand; all of a block's dW GEMMs pack them alike,
  // only the dlogits side differs); null when the backend reads them as they are.
  const void* pack_active_rows(const kernels::Gemm& gemm) const {
    if (gemm.shared_packed_bytes() == 0) return nullptr;
    gemm.pack_shared(ws.hidden_act.data(), ws.packed_hidden.data());
    return ws.packed_hidden.data();
  }

  // The tail correction of a block that runs filtered, before the kept
  // columns are compacted (every dlogits entry still in the block buffer):
  //   dhidden row t += (sum over left-out v of g_tv A_v) dual_w: the left-out
  //     entries' sum projected onto span(B_w), as the tile GEMMs' g A over all
  //     columns minus the kept columns' own terms, summed in tile order;
  //   dW column v += (sum over t of g_tv H_t) dual_h for every left-out v,
  //     H_t the hidden row's coordinates in a basis B_h of the hidden rows
  //     (made from the call's first filtered block), accumulated in C_w over
  //     the blocks and applied once by finish_tail.
  // The error left is the left-out entries' part orthogonal to the basis.
  void tail_block(std::int64_t padded, std::int64_t na, bool dweight) {
    const std::int64_t k = p.tail_rank;
    constexpr std::int64_t kc = kTailCoords;
    constexpr std::int64_t pw = kTailPairProbes;
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t hidden = p.shape.hidden;
    const std::int64_t rows = p.block_rows_alloc;
    const DType dl = p.dlogits_dtype;
    const TailRegions& t = ws.tail;
    const std::size_t rung = p.row_ladder.index_of(padded);
    tail_used = true;
    if (dweight) {
      if (!hidden_basis_ready) {
        // The sketch of the active hidden rows and the guard's probes, in
        // dhidden_act rows [0, kc) (free until backward_kept).
        float* y = ws.dhidden_act.data();
        std::memset(y, 0, static_cast<std::size_t>(k * hidden) * sizeof(float));
        for (std::int64_t i = 0; i < na; ++i) {
          const std::byte* h = ws.hidden_act.data() + static_cast<std::size_t>(i) * act_row_bytes;
          for (std::int64_t r = 0; r < k; ++r) {
            const float sgn = tail_sign(i, r);
            for (std::int64_t c = 0; c < hidden; ++c) y[r * hidden + c] += sgn * tail_load(h, c, p.shape.dtype);
          }
        }
        fill_probes(y, hidden, k, kc, hidden);
        tail_basis(y, hidden, kc, k, hidden, t.work, t.basis_h, hidden, p.shape.dtype, t.dual_h);
        // The apply GEMM's D: [hi; lo; hi] of the dual (bf16, zero-padded to kTailApplyLd rows) or the dual (f32).
        std::memset(t.apply_b, 0, static_cast<std::size_t>(kTailApplyLd * hidden) * dl_size);
        for (std::int64_t r = 0; r < k; ++r) {
          for (std::int64_t c = 0; c < hidden; ++c) {
            tail_store_pair(t.apply_b, r * hidden + c, k * hidden, t.dual_h[r * hidden + c], dl);
            if (dl == DType::bf16) {
              reinterpret_cast<std::uint16_t*>(t.apply_b)[(2 * k + r) * hidden + c] =
                  reinterpret_cast<std::uint16_t*>(t.apply_b)[r * hidden + c];
            }
          }
        }
        hidden_basis_ready = true;
      }
      dweight_clock.time([&] {
        bindings.at(*p.tail_hidden[rung], 0)
            .run(ws.hidden_act.data(), t.basis_h, t.hidden_f, nullptr, slot_scratch(0), nullptr);
        // [hi, lo] of the basis coordinates, then the probes' (an estimate: one rounding is enough).
        for (std::int64_t i = 0; i < padded; ++i) {
          for (std::int64_t r = 0; r < k; ++r)
            tail_store_pair(t.hidden_pair, i * pw + r, k, t.hidden_f[i * kc + r], dl);
          for (std::int64_t r = k; r < kc; ++r) tail_store(t.hidden_pair, i * pw + k + r, t.hidden_f[i * kc + r], dl);
        }
      });
    }
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      const bool last = j == p.tiles - 1;
      const std::byte* g = block_at(0, c0, dl_size);
      float* part = t.partial + j * rows * kc;  // the tile's partial sums [padded, kc]
      dhidden_clock.time([&] {
        bindings.at(*p.tail_dhidden[rung].pick(last), slot)
            .run(g, t.coord + static_cast<std::size_t>(c0 * kc) * dl_size, part, nullptr, slot_scratch(slot), nullptr);
        tile_kept_terms(j, slot, na, 1);
      });
      if (!dweight) return;
      dweight_clock.time([&] {
        float* coords = slot_tile(slot);  // [cols, pw]
        bindings.at(*p.tail_dweight[rung].pick(last), slot)
            .run(g, t.hidden_pair, coords, nullptr, slot_scratch(slot), nullptr);
        // Every column's, into pending: commit_tail_dweight adds the left-out ones once the guard holds.
        for (std::int64_t c = 0; c < cols; ++c) {
          float* to = t.pending + (c0 + c) * kc;
          for (std::int64_t r = 0; r < k; ++r) to[r] = coords[c * pw + r] + coords[c * pw + k + r];
          for (std::int64_t r = k; r < kc; ++r) to[r] = coords[c * pw + k + r];
        }
      });
    });
    sum_tail_partials(na);
  }

  // Tile j's partial sums less the terms of the columns marked `tag` (the
  // kept GEMMs have them): their A rows gathered after the slot's dW
  // coordinates [cols, kTailPairProbes], then row by row.
  void tile_kept_terms(std::int64_t j, int slot, std::int64_t na, std::uint8_t tag) const {
    constexpr std::int64_t kc = kTailCoords;
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t c0 = j * vt;
    const std::int64_t cols = std::min(vt, vocab - c0);
    const DType dl = p.dlogits_dtype;
    const TailRegions& t = ws.tail;
    const std::uint8_t* mark = ws.kept.mark.data();
    const std::byte* g = block_at(0, c0, dl_size);
    float* part = t.partial + j * p.block_rows_alloc * kc;
    float* a_kept = slot_tile(slot) + vt * kTailPairProbes;        // [n, kc]
    auto* at = reinterpret_cast<std::int32_t*>(a_kept + vt * kc);  // [n] tile columns
    std::int64_t n = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (mark[c0 + c] != tag) continue;
      for (std::int64_t r = 0; r < kc; ++r) a_kept[n * kc + r] = tail_load(t.coord, (c0 + c) * kc + r, dl);
      at[n++] = static_cast<std::int32_t>(c);
    }
    for (std::int64_t i = 0; i < na; ++i) {
      float* row = part + i * kc;
      for (std::int64_t x = 0; x < n; ++x) {
        const float gv = tail_load(g, i * vocab + at[x], dl);
        const float* a = a_kept + x * kc;
        for (std::int64_t r = 0; r < kc; ++r) row[r] -= gv * a[r];
      }
    }
  }

  // dhidden's tail coordinates (and probes), the tiles' partial sums added in tile order.
  void sum_tail_partials(std::int64_t na) const {
    constexpr std::int64_t kc = kTailCoords;
    const TailRegions& t = ws.tail;
    const std::int64_t rows = p.block_rows_alloc;
    for (std::int64_t i = 0; i < na; ++i) {
      for (std::int64_t r = 0; r < kc; ++r) {
        float sum = 0.0F;
        for (std::int64_t j = 0; j < p.tiles; ++j) sum += t.partial[(j * rows + i) * kc + r];
        t.cdh[i * kc + r] = sum;
      }
    }
  }

  // The guard's ladder, rung >= 1: every column no row keeps yet is kept
  // (marked rung + 1) where some active row's stored dlogits reach eps 4^-rung
  // of its scale; the kept columns listed again in column order. Returns
  // their count.
  std::int64_t keep_at_rung(std::int64_t na, int rung) {
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const float factor = std::ldexp(p.grad_filter, -2 * rung);
    const auto tag = static_cast<std::uint8_t>(rung + 1);
    const TailRegions& t = ws.tail;
    std::uint8_t* mark = ws.kept.mark.data();
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int /*slot*/) {
      dlogits_clock.time([&] {
        const std::int64_t c0 = j * vt;
        const std::int64_t cols = std::min(vt, vocab - c0);
        for (std::int64_t i = 0; i < na; ++i) {
          const float threshold = factor * t.row_scale[i];
          const std::byte* g = block_at(i, c0, dl_size);
          for (std::int64_t c = 0; c < cols; ++c) {
            if (mark[c0 + c] == 0 && std::fabs(tail_load(g, c, p.dlogits_dtype)) >= threshold) mark[c0 + c] = tag;
          }
        }
      });
    });
    std::int64_t kept = 0;
    for (std::int64_t v = 0; v < vocab; ++v) {
      if (mark[v] != 0) ws.kept.column[kept++] = static_cast<std::int32_t>(v);
    }
    return kept;
  }

  // The tail coordinates after keep_at_rung(rung): less the newly kept columns' terms.
  void tail_kept_terms(std::int64_t na, int rung) {
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
      dhidden_clock.time([&] { tile_kept_terms(j, slot, na, static_cast<std::uint8_t>(rung + 1)); });
    });
    sum_tail_partials(na);
  }

  // The block's tail dW coordinates (tail_block's pending) added to the
  // call's for every column it leaves out, and their probe sums to the guard's.
  void commit_tail_dweight() {
    const std::int64_t k = p.tail_rank;
    constexpr std::int64_t kc = kTailCoords;
    const std::int64_t vt = p.schedule.vocab_tile;
    const TailRegions& t = ws.tail;
    const std::uint8_t* mark = ws.kept.mark.data();
    for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int /*slot*/) {
      for (std::int64_t v = j * vt; v < std::min(p.shape.vocab, (j + 1) * vt); ++v) {
        if (mark[v] != 0) continue;
        t.left[v] = 1;
        const float* from = t.pending + v * kc;
        for (std::int64_t r = 0; r < k; ++r) t.cdw[v * k + r] += from[r];
        for (std::int64_t r = k; r < kc; ++r) t.probe_w[v * (kc - k) + r - k] += from[r];
      }
    });
  }

  // The exact step's estimated error (squared) on the block, from its
  // roundings of the kept entries (err_h: sum d^2 |W_v|^2; err_w: sum d^2,
  // times |h_t|^2 here; the left-out entries' roundings are smaller by their
  // size, and leaving them out makes the estimate lower, so the guard
  // stricter): dhidden's over its rows but the dense ones (computed over
  // every column) is returned, dW's is added to the call's.
  double block_exact_errors(std::int64_t na, std::int64_t dense, bool dweight) {
    const TailRegions& t = ws.tail;
    double exact = 0.0, exact_w = 0.0;
    std::int64_t x = 0;  // dense rows are listed in order (dense_rows)
    for (std::int64_t i = 0; i < na; ++i) {
      double eh = 0.0, ew = 0.0;
      for (std::int64_t j = 0; j < p.tiles; ++j) {
        eh += t.err_h[i * p.tiles + j];
        ew += t.err_w[i * p.tiles + j];
      }
      if (dweight) {
        const std::byte* h = ws.hidden_act.data() + static_cast<std::size_t>(i) * act_row_bytes;
        double hh = 0.0;
        for (std::int64_t c = 0; c < p.shape.hidden; ++c) {
          const double v = tail_load(h, c, p.shape.dtype);
          hh += v * v;
        }
        exact_w += ew * hh;
      }
      if (x < dense && t.dense_block[x] == i) {
        ++x;
        continue;
      }
      exact += eh;
    }
    exact_dweight_error += exact_w;  // this block's, whichever GEMMs it runs
    return exact;
  }

  // grad_filter = auto: whether the block may run filtered. What the filter
  // leaves of a row's dhidden after the tail correction is off the basis
  // B_w; its coordinates along the kTailProbes probes orthogonal to B_w
  // (cdh's last columns) estimate its norm: E sum_j (q_j x)^2 = m |x|^2 /
  // (H - k). dhidden: the block's rows (the dense rows aside) against
  // exact_dhidden (block_exact_errors). dW: a column's left-out sum adds up
  // over the blocks, so the probe sums of every block run filtered so far
  // plus this one's, against the exact step's error over every block so far.
  bool guard_holds(std::int64_t na, std::int64_t dense, bool dweight, double exact_dhidden) const {
    const std::int64_t k = p.tail_rank;
    constexpr std::int64_t kc = kTailCoords;
    constexpr std::int64_t m = kc - kTailRank;
    const TailRegions& t = ws.tail;
    // Past H - k probes the complement of the basis is spanned (a small H):
    // the probes' sum is then the norm itself.
    const std::int64_t off = std::max<std::int64_t>(p.shape.hidden - k, 1);
    const double off_basis = static_cast<double>(off) / static_cast<double>(std::min(m, off));
    const double limit = kGuardRatio * kGuardRatio;
    double left = 0.0;
    std::int64_t x = 0;
    for (std::int64_t i = 0; i < na; ++i) {
      if (x < dense && t.dense_block[x] == i) {
        ++x;
        continue;
      }
      for (std::int64_t r = k; r < kc; ++r) left += static_cast<double>(t.cdh[i * kc + r]) * t.cdh[i * kc + r];
    }
    if (left * off_basis > limit * exact_dhidden) return false;
    if (!dweight) return true;
    const std::uint8_t* mark = ws.kept.mark.data();
    double left_w = 0.0;
    for (std::int64_t v = 0; v < p.shape.vocab; ++v) {
      const float* sum = t.probe_w + v * m;
      const float* add = t.pending + v * kc + k;
      for (std::int64_t r = 0; r < m; ++r) {
        const double s = sum[r] + (mark[v] == 0 ? add[r] : 0.0F);
        left_w += s * s;
      }
    }
    return left_w * off_basis <= limit * exact_dweight_error;
  }

  // |W_v|^2 of vocab columns [c0, c0 + cols) into out (the guard's weights):
  // a pass over W per call, in loops the compiler vectorizes.
  void column_norms(std::int64_t c0, std::int64_t cols, float* out) const {
    if (p.shape.dtype == DType::bf16) {
      column_norms_of<std::uint16_t>(c0, cols, out);
    } else {
      column_norms_of<float>(c0, cols, out);
    }
  }
  template <class E>
  void column_norms_of(std::int64_t c0, std::int64_t cols, float* out) const {
    const auto square = [](E x) {
      float v = 0.0F;
      if constexpr (std::is_same_v<E, float>) {
        v = x;
      } else {
        v = std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16);  // bf16 widened exactly
      }
      return v * v;
    };
    const std::int64_t hidden = p.shape.hidden;
    if (!vocab_major) {  // W [H, V]: a row of W adds into every column's sum
      std::fill(out, out + cols, 0.0F);
      for (std::int64_t h = 0; h < hidden; ++h) {
        const auto* row = reinterpret_cast<const E*>(weight_at_hidden(h)) + c0;
        for (std::int64_t c = 0; c < cols; ++c) out[c] += square(row[c]);
      }
      return;
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto* row = reinterpret_cast<const E*>(weight_at_vocab(c0 + c));
      std::array<float, 16> lane{};  // 16 partial sums: no serial dependence in the loop
      std::int64_t h = 0;
      for (; h + 16 <= hidden; h += 16) {
        for (std::size_t l = 0; l < lane.size(); ++l) lane[l] += square(row[h + static_cast<std::int64_t>(l)]);
      }
      float sum = 0.0F;
      for (; h < hidden; ++h) sum += square(row[h]);
      for (const float l : lane) sum += l;
      out[c] = sum;
    }
  }

  // f32 dlogits: row i's tile-j share of the guard's exact-step error, each
  // entry at or above the threshold taken at its rounding's mean square
  // g^2 2^-48 / 3 (f32's unit roundoff 2^-24, uniform).
  void guard_row_errors(std::int64_t i, std::int64_t j, const float* g, std::int64_t cols, float threshold) const {
    const std::int64_t c0 = j * p.schedule.vocab_tile;
    constexpr float kMeanSquare = 0x1p-48F / 3.0F;
    float eh = 0.0F, ew = 0.0F;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (!(std::fabs(g[c]) >= threshold)) continue;
      const float d2 = g[c] * g[c] * kMeanSquare;
      eh += d2 * ws.tail.norm_w[c0 + c];
      ew += d2;
    }
    ws.tail.err_h[i * p.tiles + j] = eh;
    ws.tail.err_w[i * p.tiles + j] = ew;
  }

  // dhidden_act rows [0, na) += their tail coordinates x dual_w (after backward_kept).
  void tail_dhidden(std::int64_t na) {
    const std::int64_t k = p.tail_rank;
    const std::int64_t hidden = p.shape.hidden;
    const TailRegions& t = ws.tail;
    constexpr std::int64_t kRows = 32;
    for_each_item((na + kRows - 1) / kRows, p.schedule.slots, [&](std::int64_t chunk, int /*slot*/) {
      dhidden_clock.time([&] {
        for (std::int64_t i = chunk * kRows; i < std::min(na, (chunk + 1) * kRows); ++i) {
          float* d = ws.dhidden_act.data() + i * hidden;
          for (std::int64_t r = 0; r < k; ++r) {
            const float c = t.cdh[i * kTailCoords + r];
            const float* dual = t.dual_w + r * hidden;
            for (std::int64_t h = 0; h < hidden; ++h) d[h] += c * dual[h];
          }
        }
      });
    });
  }

  // The block's dense rows (kDenseRowMass, kDenseRowEntropyGap), their active indices into
  // tail.dense_block; their count (more than kRowQuantum: the caller runs the
  // exact GEMMs).
  std::int64_t dense_rows(std::int64_t na, bool compacted) const {
    const TailRegions& t = ws.tail;
    const float broad = std::log(static_cast<float>(p.shape.vocab)) - kDenseRowEntropyGap;
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < na; ++i) {
      const std::int64_t s = compacted ? i : ws.rows.active[i];  // where row i's statistics are
      if (!(ws.rows.entropy[s] > broad)) continue;
      float below = 0.0F;
      for (std::int64_t j = 0; j < p.tiles; ++j) below += t.below[i * p.tiles + j];
      if (!(below <= kDenseRowMass * t.row_scale[i])) {
        if (n < kRowQuantum) t.dense_block[n] = i;
        ++n;
      }
    }
    return n;
  }

  // The block's dense rows' dhidden over every column, before compaction
  // (their dlogits rows still whole): kDenseRows rows at a time copied to
  // tail.dense, the dense_dhidden GEMMs into tail.dense_out; backward copies
  // them over the rows' filtered dhidden.
  void dense_dhidden(std::int64_t dense) {
    const TailRegions& t = ws.tail;
    const std::size_t row_bytes = static_cast<std::size_t>(p.shape.vocab) * dl_size;
    for (std::int64_t x0 = 0; x0 < dense; x0 += kDenseRows) {
      const std::int64_t n = std::min(kDenseRows, dense - x0);
      for_each_item(kDenseRows, p.schedule.slots, [&](std::int64_t x, int /*slot*/) {
        std::byte* to = t.dense + x * row_bytes;
        if (x < n) {
          std::memcpy(to, block_at(t.dense_block[x0 + x], 0, dl_size), row_bytes);
        } else {
          std::memset(to, 0, row_bytes);
        }
      });
      // Every column of kDenseRows rows, counted as work the filter did not skip.
      stats.dhidden_skipped_row_columns -= kDenseRows * p.shape.vocab;
      for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
        const std::int64_t h0 = chunk * p.hidden_chunk;
        dhidden_clock.time([&] {
          bindings.at(*p.dense_dhidden.pick(chunk == p.hidden_chunks - 1), slot)
              .run(t.dense, weight_at_hidden(h0), t.dense_out + x0 * p.shape.hidden + h0, nullptr, slot_scratch(slot));
        });
      });
    }
  }

  std::int64_t kept_groups(std::int64_t kept) const { return (kept + p.kept_tile - 1) / p.kept_tile; }

  // The filtered backward of a block whose kept columns (kept.column[0,
  // kept)) fit in kept_cap: the block buffer's dlogits [padded, V] compacted in
  // place to [padded, kept_cap] (the kept columns, then zeros up to a whole
  // group), dW of each group of kept_tile columns into a slot buffer added
  // into dW's kept rows, and dhidden from the groups against their gathered
  // W rows, in group order. With bf16 dlogits (kept_lo_cap) each GEMM runs
  // again on the kept entries' remainders, compacted alike past the matrix:
  // the kept part is then exact to ~2^-16, not bf16's 2^-9.
  void backward_kept(std::int64_t padded, std::int64_t na, std::int64_t kept, bool dweight,
                     const bool* dweight_written) {
    const bool with_lo = p.kept_lo_cap > 0;
    const std::int64_t hidden = p.shape.hidden;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t cap = p.kept_cap;
    const std::int64_t groups = kept_groups(kept);
    const std::int32_t* column = ws.kept.column.data();
    const std::size_t esz = dl_size;
    std::byte* dl = ws.block.data();
    dlogits_clock.time([&] {
      // Element (i, c) moves from i V + column[c] to i cap + c: never past where
      // it came from, never onto an element not yet moved (cap <= V, columns ascending).
      for (std::int64_t i = 0; i < padded; ++i) {
        std::byte* to = dl + static_cast<std::size_t>(i * cap) * esz;
        const std::byte* from = dl + static_cast<std::size_t>(i * vocab) * esz;
        if (esz == 2) {
          auto* t = reinterpret_cast<std::uint16_t*>(to);
          const auto* f = reinterpret_cast<const std::uint16_t*>(from);
          for (std::int64_t c = 0; c < kept; ++c) t[c] = f[column[c]];
        } else {
          auto* t = reinterpret_cast<float*>(to);
          const auto* f = reinterpret_cast<const float*>(from);
          for (std::int64_t c = 0; c < kept; ++c) t[c] = f[column[c]];
        }
        std::memset(to + static_cast<std::size_t>(kept) * esz, 0,
                    static_cast<std::size_t>(groups * p.kept_tile - kept) * esz);
      }
      if (!with_lo) return;
      // The remainders, from each row's list to its kept columns' places past
      // the compacted matrix (the block's second half: 2 cap <= V).
      std::int32_t* index = ws.kept.index.data();
      for (std::int64_t c = 0; c < kept; ++c) index[column[c]] = static_cast<std::int32_t>(c);
      auto* to = reinterpret_cast<std::uint16_t*>(dl) + padded * cap;
      const KeptRemainders& lo = ws.kept_lo;
      for (std::int64_t i = 0; i < padded; ++i) {
        std::uint16_t* t = to + i * cap;
        std::memset(t, 0, static_cast<std::size_t>(groups * p.kept_tile) * esz);
        if (i >= na) continue;
        for (std::int64_t e = 0; e < lo.count[i]; ++e) {
          t[index[lo.column[i * p.kept_lo_cap + e]]] = lo.value[i * p.kept_lo_cap + e];
        }
      }
    });
    const auto group_dlogits = [&](std::int64_t g) { return dl + static_cast<std::size_t>(g * p.kept_tile) * esz; };
    const auto group_lo = [&](std::int64_t g) {
      return dl + static_cast<std::size_t>(padded * cap + g * p.kept_tile) * esz;
    };

    if (dweight) {
      const kernels::Elem dw_type = elem_of(p.options.dweight_dtype);
      const std::size_t dw_size = size_of(p.options.dweight_dtype);
      auto* dw = static_cast<std::byte*>(out.dweight.data);
      if (!*dweight_written) zero_dweight();  // overwrite mode, first block: the columns left out get zeros
      const kernels::Gemm& gemm = *p.dweight_kept[p.row_ladder.index_of(padded)];
      const void* packed = pack_active_rows(gemm);
      for_each_item(groups, p.schedule.slots, [&](std::int64_t g, int slot) {
        float* rows = slot_tile(slot);  // [kept_tile, H]
        dweight_clock.time([&] {
          bindings.at(gemm, slot)
              .run(group_dlogits(g), ws.hidden_act.data(), rows, nullptr, slot_scratch(slot), packed);
          if (with_lo) {
            bindings.at(*p.dweight_kept_lo[p.row_ladder.index_of(padded)], slot)
                .run(group_lo(g), ws.hidden_act.data(), rows, nullptr, slot_scratch(slot), packed);
          }
          const std::int64_t n = std::min(p.kept_tile, kept - g * p.kept_tile);
          for (std::int64_t c = 0; c < n; ++c) {
            const std::int64_t v = column[g * p.kept_tile + c];
            const float* src = rows + c * hidden;
            if (vocab_major) {
              k.add_row(src, dw + static_cast<std::size_t>(v * p.shape.dweight_ld) * dw_size, dw_type, hidden);
              continue;
            }
            for (std::int64_t h = 0; h < hidden; ++h) {
              k.add_row(src + h, dw + static_cast<std::size_t>(h * p.shape.dweight_ld + v) * dw_size, dw_type, 1);
            }
          }
        });
      });
    }

    std::memset(ws.dhidden_act.data(), 0, static_cast<std::size_t>(padded * hidden) * sizeof(float));
    const auto& gemms = p.dhidden_kept[p.row_ladder.index_of(padded)];
    for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
      const std::int64_t h0 = chunk * p.hidden_chunk;
      const std::int64_t cols = std::min(p.hidden_chunk, hidden - h0);
      const kernels::Gemm& gemm = *gemms.pick(chunk == p.hidden_chunks - 1);
      auto* w_rows = reinterpret_cast<std::byte*>(slot_tile(slot));  // [kept_tile, hidden_chunk], input dtype
      const std::size_t row_bytes = static_cast<std::size_t>(p.hidden_chunk) * in_size;
      dhidden_clock.time([&] {
        for (std::int64_t g = 0; g < groups; ++g) {
          for (std::int64_t c = 0; c < p.kept_tile; ++c) {
            std::byte* to = w_rows + static_cast<std::size_t>(c) * row_bytes;
            const std::int64_t at = g * p.kept_tile + c;
            if (at >= kept) {
              std::memset(to, 0, static_cast<std::size_t>(cols) * in_size);
            } else if (vocab_major) {
              std::memcpy(to, weight_at_vocab(column[at]) + static_cast<std::size_t>(h0) * in_size,
                          static_cast<std::size_t>(cols) * in_size);
            } else {
              const std::byte* from = weight_at_vocab(column[at]);
              for (std::int64_t h = 0; h < cols; ++h) {
                std::memcpy(to + static_cast<std::size_t>(h) * in_size,
                            from + static_cast<std::size_t>((h0 + h) * p.shape.weight_ld) * in_size, in_size);
              }
            }
          }
          bindings.at(gemm, slot)
              .run(group_dlogits(g), w_rows, ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
          if (with_lo) {
            bindings.at(gemm, slot).run(group_lo(g), w_rows, ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
          }
        }
      });
    });
  }

  // The forward of nb rows by `gemms`, calls of fr rows: chunk_source(c) is
  // the GEMM's A operand for rows [c * fr, (c + 1) * fr) (fr rows of stride
  // hidden_ld), row_of(r) the batch row of block row r.
  template <class ChunkSource, class RowOf>
  void forward_rows(std::int64_t nb, bool keep, const FullAndLast<std::unique_ptr<kernels::Gemm>>& gemms,
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
