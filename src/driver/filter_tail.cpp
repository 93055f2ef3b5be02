// The filtered backward's tail correction and its guard (see
// filtered_backward.hpp): the call's bases of W's rows and of the hidden
// rows, each filtered block's left-out sum in their coordinates, the guard's
// probes and ladder of thresholds, and dW's correction after the last block.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "driver/filtered_backward.hpp"
#include "driver/parallel.hpp"
#include "driver/tail_basis.hpp"

namespace grpo::detail {

void FilteredBackward::prepare() {
  if (f_.tail_rank == 0) return;
  const std::int64_t k = f_.tail_rank;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t hidden = p.shape.hidden;
  const DType dl = p.dlogits_dtype;
  const TailRegions& t = fws_.tail;
  tail_used_ = false;
  hidden_basis_ready_ = false;
  // Omega [kTailRows, V / tail_stride] in the block buffer (rows past k
  // zero) against every tail_stride-th row of W: the sketch of a sample of
  // W's rows (their shared directions are every row's).
  const std::int64_t sampled = (vocab + f_.tail_stride - 1) / f_.tail_stride;
  for_each_item(kTailRows, p.schedule.slots, [&](std::int64_t r, int /*slot*/) {
    std::byte* row = fws_.tail_sketch.data() + static_cast<std::size_t>(r * sampled) * dl_size;
    for (std::int64_t m = 0; m < sampled; ++m) {
      const float sgn = r < k ? tail_sign(m * f_.tail_stride, r) : 0.0F;
      if (dl == DType::bf16) {
        reinterpret_cast<std::uint16_t*>(row)[m] = kernels::float_to_bf16(sgn);
      } else {
        reinterpret_cast<float*>(row)[m] = sgn;
      }
    }
  });
  for_each_item(p.hidden_chunks, p.schedule.slots, [&](std::int64_t chunk, int slot) {
    const std::int64_t h0 = chunk * p.hidden_chunk;
    bindings.at(*f_.tail_sketch.pick(chunk == p.hidden_chunks - 1), slot)
        .run(fws_.tail_sketch.data(), weight_at_hidden(h0), ws.dhidden_act.data() + h0, nullptr, slot_scratch(slot));
  });
  // B_w and the guard's probes as hidden rows [kTailRows, hidden_ld] in
  // the stage buffer (rows past kc zero).
  constexpr std::int64_t kc = kTailCoords;
  std::byte* probes = fws_.tail_probes.data();
  fill_probes(ws.dhidden_act.data(), hidden, k, kc, hidden);
  std::memset(probes, 0, static_cast<std::size_t>(kTailRows) * act_row_bytes);
  tail_basis(ws.dhidden_act.data(), hidden, kc, k, hidden, t.work, probes, p.shape.hidden_ld, p.shape.dtype, t.dual_w);
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
    const std::int64_t c0 = j * vt;
    const std::int64_t cols = std::min(vt, vocab - c0);
    auto* tile = slot_piece<float>(slot, FilterSlotUse::kTailProject, 0);  // [kTailRows, cols]
    bindings.at(*f_.tail_project.pick(j == p.tiles - 1), slot)
        .run(probes, weight_at_vocab(c0), tile, nullptr, slot_scratch(slot), nullptr);
    for (std::int64_t c = 0; c < cols; ++c) {
      for (std::int64_t r = 0; r < kc; ++r) tail_store(t.coord, (c0 + c) * kc + r, tile[r * cols + c], dl);
    }
    if (f_.guard) column_norms(c0, cols, t.norm_w + c0);
  });
  exact_dweight_error_ = 0.0;
  if (!p.options.frozen_weight) {
    std::memset(t.cdw, 0, static_cast<std::size_t>(vocab * k) * sizeof(float));
    std::memset(t.probe_w, 0, static_cast<std::size_t>(vocab * (kc - k)) * sizeof(float));
    std::memset(t.left, 0, static_cast<std::size_t>(vocab));
  }
}

void FilteredBackward::finish() {
  if (!tail_used_ || p.options.frozen_weight) return;
  const std::int64_t k = f_.tail_rank;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const DType dl = p.dlogits_dtype;
  const TailRegions& t = fws_.tail;
  const DweightTile dw_tile{p.shape};
  const std::size_t dw_size = size_of(p.options.dweight_dtype);
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
    const std::int64_t c0 = j * vt;
    const std::int64_t cols = std::min(vt, vocab - c0);
    bool any = false;
    for (std::int64_t c = c0; c < c0 + cols; ++c) {
      std::byte* row = fws_.tail_apply.data() + static_cast<std::size_t>(c * kTailApplyLd) * dl_size;
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
    const std::byte* c_rows = fws_.tail_apply.data() + static_cast<std::size_t>(c0 * kTailApplyLd) * dl_size;
    auto* dw = static_cast<std::byte*>(out.dweight.data) + dw_tile.offset(c0) * dw_size;
    const bool vm = vocab_major;
    dweight_clock.time([&] {
      bindings.at(*f_.tail_apply.pick(j == p.tiles - 1), slot)
          .run(vm ? static_cast<const void*>(c_rows) : t.apply_b, vm ? static_cast<const void*>(t.apply_b) : c_rows, dw,
               nullptr, slot_scratch(slot), nullptr);
    });
  });
}

void FilteredBackward::tail_block(std::int64_t padded, std::int64_t na, bool dweight) {
  const std::int64_t k = f_.tail_rank;
  constexpr std::int64_t kc = kTailCoords;
  constexpr std::int64_t pw = kTailPairProbes;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t hidden = p.shape.hidden;
  const std::int64_t rows = p.block_rows_alloc;
  const DType dl = p.dlogits_dtype;
  const TailRegions& t = fws_.tail;
  const std::size_t rung = p.row_ladder.index_of(padded);
  tail_used_ = true;
  if (dweight) {
    if (!hidden_basis_ready_) {
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
      hidden_basis_ready_ = true;
    }
    dweight_clock.time([&] {
      bindings.at(*f_.tail_hidden[rung], 0)
          .run(ws.hidden_act.data(), t.basis_h, t.hidden_f, nullptr, slot_scratch(0), nullptr);
      // [hi, lo] of the basis coordinates, then the probes' (an estimate: one rounding is enough).
      for (std::int64_t i = 0; i < padded; ++i) {
        for (std::int64_t r = 0; r < k; ++r) tail_store_pair(t.hidden_pair, i * pw + r, k, t.hidden_f[i * kc + r], dl);
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
      bindings.at(*f_.tail_dhidden[rung].pick(last), slot)
          .run(g, t.coord + static_cast<std::size_t>(c0 * kc) * dl_size, part, nullptr, slot_scratch(slot), nullptr);
      tile_kept_terms(j, slot, na, 1);
    });
    if (!dweight) return;
    dweight_clock.time([&] {
      auto* coords = slot_piece<float>(slot, FilterSlotUse::kTailTerms, FilterSlotUse::kCoords);  // [cols, pw]
      bindings.at(*f_.tail_dweight[rung].pick(last), slot)
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

void FilteredBackward::tile_kept_terms(std::int64_t j, int slot, std::int64_t na, std::uint8_t tag) const {
  constexpr std::int64_t kc = kTailCoords;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const std::int64_t c0 = j * vt;
  const std::int64_t cols = std::min(vt, vocab - c0);
  const DType dl = p.dlogits_dtype;
  const TailRegions& t = fws_.tail;
  const std::uint8_t* mark = fws_.kept.mark.data();
  const std::byte* g = block_at(0, c0, dl_size);
  float* part = t.partial + j * p.block_rows_alloc * kc;
  auto* a_kept = slot_piece<float>(slot, FilterSlotUse::kTailTerms, FilterSlotUse::kKeptA);      // [n, kc]
  auto* at = slot_piece<std::int32_t>(slot, FilterSlotUse::kTailTerms, FilterSlotUse::kKeptAt);  // [n] tile columns
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

void FilteredBackward::sum_tail_partials(std::int64_t na) const {
  constexpr std::int64_t kc = kTailCoords;
  const TailRegions& t = fws_.tail;
  const std::int64_t rows = p.block_rows_alloc;
  for (std::int64_t i = 0; i < na; ++i) {
    for (std::int64_t r = 0; r < kc; ++r) {
      float sum = 0.0F;
      for (std::int64_t j = 0; j < p.tiles; ++j) sum += t.partial[(j * rows + i) * kc + r];
      t.cdh[i * kc + r] = sum;
    }
  }
}

std::int64_t FilteredBackward::keep_at_rung(std::int64_t na, int rung) {
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t vocab = p.shape.vocab;
  const float factor = std::ldexp(f_.eps, -2 * rung);
  const auto tag = static_cast<std::uint8_t>(rung + 1);
  const TailRegions& t = fws_.tail;
  std::uint8_t* mark = fws_.kept.mark.data();
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
    if (mark[v] != 0) fws_.kept.column[kept++] = static_cast<std::int32_t>(v);
  }
  return kept;
}

void FilteredBackward::tail_kept_terms(std::int64_t na, int rung) {
  for_each_item(p.tiles, p.schedule.slots, [&](std::int64_t j, int slot) {
    dhidden_clock.time([&] { tile_kept_terms(j, slot, na, static_cast<std::uint8_t>(rung + 1)); });
  });
  sum_tail_partials(na);
}

void FilteredBackward::commit_tail_dweight() {
  const std::int64_t k = f_.tail_rank;
  constexpr std::int64_t kc = kTailCoords;
  const std::int64_t vt = p.schedule.vocab_tile;
  const TailRegions& t = fws_.tail;
  const std::uint8_t* mark = fws_.kept.mark.data();
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

double FilteredBackward::block_exact_errors(std::int64_t na, std::int64_t dense, bool dweight) {
  const TailRegions& t = fws_.tail;
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
  exact_dweight_error_ += exact_w;  // this block's, whichever GEMMs it runs
  return exact;
}

bool FilteredBackward::guard_holds(std::int64_t na, std::int64_t dense, bool dweight, double exact_dhidden) const {
  const std::int64_t k = f_.tail_rank;
  constexpr std::int64_t kc = kTailCoords;
  constexpr std::int64_t m = kc - kTailRank;
  const TailRegions& t = fws_.tail;
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
  const std::uint8_t* mark = fws_.kept.mark.data();
  double left_w = 0.0;
  for (std::int64_t v = 0; v < p.shape.vocab; ++v) {
    const float* sum = t.probe_w + v * m;
    const float* add = t.pending + v * kc + k;
    for (std::int64_t r = 0; r < m; ++r) {
      const double s = sum[r] + (mark[v] == 0 ? add[r] : 0.0F);
      left_w += s * s;
    }
  }
  return left_w * off_basis <= limit * exact_dweight_error_;
}

template <class E>
void FilteredBackward::column_norms_of(std::int64_t c0, std::int64_t cols, float* out) const {
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

void FilteredBackward::column_norms(std::int64_t c0, std::int64_t cols, float* out) const {
  if (p.shape.dtype == DType::bf16) {
    column_norms_of<std::uint16_t>(c0, cols, out);
  } else {
    column_norms_of<float>(c0, cols, out);
  }
}

void FilteredBackward::guard_row_errors(std::int64_t i, std::int64_t j, const float* g, std::int64_t cols,
                                        float threshold) const {
  const std::int64_t c0 = j * p.schedule.vocab_tile;
  constexpr float kMeanSquare = 0x1p-48F / 3.0F;
  float eh = 0.0F, ew = 0.0F;
  for (std::int64_t c = 0; c < cols; ++c) {
    if (!(std::fabs(g[c]) >= threshold)) continue;
    const float d2 = g[c] * g[c] * kMeanSquare;
    eh += d2 * fws_.tail.norm_w[c0 + c];
    ew += d2;
  }
  fws_.tail.err_h[i * p.tiles + j] = eh;
  fws_.tail.err_w[i * p.tiles + j] = ew;
}

void FilteredBackward::tail_dhidden(std::int64_t na) {
  const std::int64_t k = f_.tail_rank;
  const std::int64_t hidden = p.shape.hidden;
  const TailRegions& t = fws_.tail;
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

}  // namespace grpo::detail
