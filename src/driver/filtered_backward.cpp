// The filtered backward's block: the marked dlogits, the decision, the kept
// columns' GEMMs and the dense rows (see filtered_backward.hpp; the tail
// correction and the guard are filter_tail.cpp's).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "driver/filtered_backward.hpp"
#include "driver/parallel.hpp"

namespace grpo::detail {

void FilteredBackward::block(const BackwardBlock& b, bool* dweight_written) {
  const std::int64_t hidden = p.shape.hidden;
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t na = b.na;
  const std::int64_t padded = b.padded;
  const bool dweight = !p.options.frozen_weight;
  lo_overflow_.store(false, std::memory_order_relaxed);
  if (f_.kept_lo_cap > 0) std::memset(fws_.kept_lo.count, 0, static_cast<std::size_t>(na) * sizeof(std::int32_t));
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) { tile_dlogits(b, j, slot); });
  // Every tile's kept columns, in column order, from kept.column[0].
  std::int64_t kept_total = 0;  // columns the backward GEMMs run over
  for (std::int64_t j = 0; j < p.tiles; ++j) {
    const std::int64_t n = fws_.kept.count[j];
    std::memmove(fws_.kept.column.data() + kept_total, fws_.kept.column.data() + j * vt, n * sizeof(std::int32_t));
    kept_total += n;
  }
  // The filtered GEMMs (backward_kept), and their dense rows (tail.dense_block).
  bool kept_path = kept_total <= f_.kept_cap && kept_total < vocab && !lo_overflow_.load(std::memory_order_relaxed);
  std::int64_t dense = 0;
  if (kept_path) dense = dense_rows(na, b.compacted);
  kept_path = kept_path && dense <= kRowQuantum;
  // The tail correction's coordinates (and the guard's probes) before the
  // block commits to the filter: with grad_filter = auto a block whose
  // left-out entries the correction does not hold runs exact.
  // A block the guard refuses at eps tries again at eps / 4, eps / 16, ...
  // (kFilterRungs): the columns whose entries reach the lower threshold
  // join the kept ones (their bf16 dlogits as the exact step has them).
  if (kept_path && f_.tail_rank > 0) {
    tail_block(padded, na, dweight);
    if (f_.guard) {
      const double exact_dhidden = block_exact_errors(na, dense, dweight);
      int rung = 0;
      while (!guard_holds(na, dense, dweight, exact_dhidden)) {
        if (++rung == kFilterRungs || (kept_total = keep_at_rung(na, rung)) > f_.kept_cap || kept_total >= vocab) {
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
      const void* packed_act = dense_.pack_active_rows(*p.backward.dweight[p.row_ladder.index_of(padded)].full[0]);
      for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
        dense_.tile_dweight(j, slot, padded, *dweight_written, packed_act);
      });
    }
  }
  dense_.count(b, kept_path ? kept_groups(kept_total) * f_.kept_tile : vocab, kept_path, dweight, *dweight_written);
  if (kept_path) {
    if (dense > 0) dense_dhidden(dense);
    backward_kept(padded, na, kept_total, dweight, dweight_written);
    if (f_.tail_rank > 0) tail_dhidden(na);
    for (std::int64_t x = 0; x < dense; ++x) {  // over the dense rows' filtered dhidden
      std::memcpy(ws.dhidden_act.data() + fws_.tail.dense_block[x] * hidden, fws_.tail.dense_out + x * hidden,
                  static_cast<std::size_t>(hidden) * sizeof(float));
    }
  } else {
    dense_.dhidden(padded);
  }
  dense_.finish(b, dweight, dweight_written);
}

void FilteredBackward::tile_dlogits(const BackwardBlock& b, std::int64_t j, int slot) {
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t c0 = j * vt;
  const std::int64_t cols = std::min(vt, p.shape.vocab - c0);
  const bool with_lo = f_.kept_lo_cap > 0;
  const kernels::Elem dl_type = elem_of(p.dlogits_dtype);
  // The filter's bound on a row's |g_v| / eps: |a| + |b|, times s under a softcap (|dz'/dz| <= s).
  const float chain = transform.capped() ? transform.softcap_scale : 1.0F;
  dlogits_clock.time([&] {
    std::uint8_t* mark = fws_.kept.mark.data() + c0;
    std::memset(mark, 0, static_cast<std::size_t>(cols));
    // Row i's dlogits into out (+ dbias); its filter threshold returned.
    const auto row_dlogits = [&](std::int64_t i, void* out, kernels::Elem out_type) {
      return f_.eps * dense_.row_dlogits(b, i, j, out, out_type) * chain;
    };
    // with_lo: one row's f32 dlogits, its own marks and their columns, in the slot's tile.
    auto* f = slot_piece<float>(slot, FilterSlotUse::kMarkedRow, FilterSlotUse::kRow);
    auto* own = slot_piece<std::uint8_t>(slot, FilterSlotUse::kMarkedRow, FilterSlotUse::kOwnMarks);
    auto* found = slot_piece<std::int32_t>(slot, FilterSlotUse::kMarkedRow, FilterSlotUse::kFound);
    for (std::int64_t i = 0; i < b.na; ++i) {
      // Row i <= s: the compacted output never overwrites a stored row not yet read.
      std::byte* g = block_at(i, c0, dl_size);
      if (!with_lo) {
        const float threshold = row_dlogits(i, g, dl_type);
        fws_.tail.below[i * p.tiles + j] = k.mark_kept(g, dl_type, cols, threshold, mark);
        if (j == 0) fws_.tail.row_scale[i] = threshold / f_.eps;
        // f32 dlogits: the exact step's error at an entry taken as its
        // rounding's mean square, g^2 2^-48 / 3.
        if (f_.guard) guard_row_errors(i, j, reinterpret_cast<const float*>(g), cols, threshold);
        continue;
      }
      const float threshold = row_dlogits(i, f, kernels::Elem::f32);
      auto* hi = reinterpret_cast<std::uint16_t*>(g);
      k.f32_to_bf16(f, hi, cols);  // bit for bit the kernel's own bf16 output
      std::memset(own, 0, static_cast<std::size_t>(cols));
      fws_.tail.below[i * p.tiles + j] = k.mark_kept(f, kernels::Elem::f32, cols, threshold, own);
      if (j == 0) fws_.tail.row_scale[i] = threshold / f_.eps;
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
      if (f_.guard) {  // the exact step's error at these entries: its rounding of each to bf16
        float eh = 0.0F, ew = 0.0F;
        for (std::int64_t x = 0; x < n; ++x) {
          const std::int64_t c = found[x];
          const float d = f[c] - kernels::bf16_to_float(hi[c]);
          eh += d * d * fws_.tail.norm_w[c0 + c];
          ew += d * d;
        }
        fws_.tail.err_h[i * p.tiles + j] = eh;
        fws_.tail.err_w[i * p.tiles + j] = ew;
      }
      const KeptRemainders& lo = fws_.kept_lo;
      const std::int32_t at = std::atomic_ref<std::int32_t>(lo.count[i]).fetch_add(static_cast<std::int32_t>(n));
      if (at + n > f_.kept_lo_cap) {
        lo_overflow_.store(true, std::memory_order_relaxed);
        continue;
      }
      for (std::int64_t x = 0; x < n; ++x) {
        const std::int64_t c = found[x];
        lo.column[i * f_.kept_lo_cap + at + x] = static_cast<std::int32_t>(c0 + c);
        lo.value[i * f_.kept_lo_cap + at + x] = kernels::float_to_bf16(f[c] - kernels::bf16_to_float(hi[c]));
      }
    }
    std::int32_t* kept = fws_.kept.column.data() + c0;
    std::int64_t n = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (mark[c] != 0) kept[n++] = static_cast<std::int32_t>(c0 + c);
    }
    fws_.kept.count[j] = n;
    dense_.zero_padding(b, j);
  });
}

std::int64_t FilteredBackward::dense_rows(std::int64_t na, bool compacted) const {
  const TailRegions& t = fws_.tail;
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

void FilteredBackward::dense_dhidden(std::int64_t dense) {
  const TailRegions& t = fws_.tail;
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
        bindings.at(*f_.dense_dhidden.pick(chunk == p.hidden_chunks - 1), slot)
            .run(t.dense, weight_at_hidden(h0), t.dense_out + x0 * p.shape.hidden + h0, nullptr, slot_scratch(slot));
      });
    });
  }
}

void FilteredBackward::backward_kept(std::int64_t padded, std::int64_t na, std::int64_t kept, bool dweight,
                                     const bool* dweight_written) {
  const bool with_lo = f_.kept_lo_cap > 0;
  const std::int64_t hidden = p.shape.hidden;
  const std::int64_t cap = f_.kept_cap;
  const std::int64_t groups = kept_groups(kept);
  const std::int32_t* column = fws_.kept.column.data();
  const std::size_t esz = dl_size;
  std::byte* dl = fws_.kept_dlogits.data();  // the block buffer's first bytes
  dlogits_clock.time([&] {
    // Element (i, c) moves from i V + column[c] to i cap + c: never past where
    // it came from, never onto an element not yet moved (cap <= V, columns ascending).
    for (std::int64_t i = 0; i < padded; ++i) {
      std::byte* to = dl + static_cast<std::size_t>(i * cap) * esz;
      const std::byte* from = block_at(i, 0, esz);
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
                  static_cast<std::size_t>(groups * f_.kept_tile - kept) * esz);
    }
    if (!with_lo) return;
    // The remainders, from each row's list to its kept columns' places, in
    // a matrix of their own after the compacted one (2 cap <= V).
    std::int32_t* index = fws_.kept.index.data();
    for (std::int64_t c = 0; c < kept; ++c) index[column[c]] = static_cast<std::int32_t>(c);
    auto* to = reinterpret_cast<std::uint16_t*>(fws_.kept_remainders.data());
    const KeptRemainders& lo = fws_.kept_lo;
    for (std::int64_t i = 0; i < padded; ++i) {
      std::uint16_t* t = to + i * cap;
      std::memset(t, 0, static_cast<std::size_t>(groups * f_.kept_tile) * esz);
      if (i >= na) continue;
      for (std::int64_t e = 0; e < lo.count[i]; ++e) {
        t[index[lo.column[i * f_.kept_lo_cap + e]]] = lo.value[i * f_.kept_lo_cap + e];
      }
    }
  });
  const auto group_dlogits = [&](std::int64_t g) { return dl + static_cast<std::size_t>(g * f_.kept_tile) * esz; };
  const auto group_lo = [&](std::int64_t g) {
    return fws_.kept_remainders.data() + static_cast<std::size_t>(g * f_.kept_tile) * esz;
  };

  if (dweight) {
    const kernels::Elem dw_type = elem_of(p.options.dweight_dtype);
    const std::size_t dw_size = size_of(p.options.dweight_dtype);
    auto* dw = static_cast<std::byte*>(out.dweight.data);
    if (!*dweight_written) dense_.zero_dweight();  // overwrite mode, first block: the columns left out get zeros
    const kernels::Gemm& gemm = *f_.dweight_kept[p.row_ladder.index_of(padded)];
    const void* packed = dense_.pack_active_rows(gemm);
    for_each_item(groups, p.schedule.slots, [&](std::int64_t g, int slot) {
      auto* rows = slot_piece<float>(slot, FilterSlotUse::kKeptDweight, 0);  // [kept_tile, H]
      dweight_clock.time([&] {
        bindings.at(gemm, slot).run(group_dlogits(g), ws.hidden_act.data(), rows, nullptr, slot_scratch(slot), packed);
        if (with_lo) {
          bindings.at(*f_.dweight_kept_lo[p.row_ladder.index_of(padded)], slot)
              .run(group_lo(g), ws.hidden_act.data(), rows, nullptr, slot_scratch(slot), packed);
        }
        const std::int64_t n = std::min(f_.kept_tile, kept - g * f_.kept_tile);
        for (std::int64_t c = 0; c < n; ++c) {
          const std::int64_t v = column[g * f_.kept_tile + c];
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
  const auto& gemms = f_.dhidden_kept[p.row_ladder.index_of(padded)];
  for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
    const std::int64_t h0 = chunk * p.hidden_chunk;
    const std::int64_t cols = std::min(p.hidden_chunk, hidden - h0);
    const kernels::Gemm& gemm = *gemms.pick(chunk == p.hidden_chunks - 1);
    auto* w_rows = slot_piece<std::byte>(slot, FilterSlotUse::kKeptW, 0);  // [kept_tile, hidden_chunk], input dtype
    const std::size_t row_bytes = static_cast<std::size_t>(p.hidden_chunk) * in_size;
    dhidden_clock.time([&] {
      for (std::int64_t g = 0; g < groups; ++g) {
        for (std::int64_t c = 0; c < f_.kept_tile; ++c) {
          std::byte* to = w_rows + static_cast<std::size_t>(c) * row_bytes;
          const std::int64_t at = g * f_.kept_tile + c;
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
        bindings.at(gemm, slot).run(group_dlogits(g), w_rows, ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
        if (with_lo) {
          bindings.at(gemm, slot).run(group_lo(g), w_rows, ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
        }
      }
    });
  });
}

}  // namespace grpo::detail
