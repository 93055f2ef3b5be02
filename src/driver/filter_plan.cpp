// The filtered backward's plan: its GEMMs and its workspace (see filter_plan.hpp).
#include "driver/filter_plan.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace grpo::detail {
namespace {

using kernels::GemmOperand;
using kernels::GemmSpec;

bool vocab_major(const LmHeadShape& s) { return s.layout == WeightLayout::vocab_major; }

// The filtered backward's dW of one group of kept columns: the compacted
// dlogits' columns [k, kept_tile] (ld kept_cap) transposed x the active
// hidden rows [k, H] -> f32 [kept_tile, H] (a slot's buffer), for either
// weight layout (the rows are added into dW's kept rows or columns after).
GemmSpec dweight_kept_spec(const LmHeadPlanData& p, std::int64_t k) {
  const LmHeadShape& s = p.shape;
  const FilterPlan& f = *p.filter;
  GemmSpec g;
  g.a = {p.dlogits_dtype, f.kept_tile, k, 1, f.kept_cap};
  g.b = {s.dtype, k, s.hidden, s.hidden_ld, 1};
  g.c = {DType::f32, f.kept_tile, s.hidden, s.hidden, 1};
  g.shared = kernels::SharedOperand::b;  // the active hidden rows, for every group
  return g;
}

// The filtered backward's dhidden chunk: += compacted dlogits [k, kept_tile]
// (ld kept_cap) x the group's W rows gathered into [kept_tile, cols] (ld
// hidden_chunk) -> f32 [k, cols] (ld H).
GemmSpec dhidden_kept_spec(const LmHeadPlanData& p, std::int64_t k, std::int64_t cols) {
  const LmHeadShape& s = p.shape;
  const FilterPlan& f = *p.filter;
  GemmSpec g;
  g.a = {p.dlogits_dtype, k, f.kept_tile, f.kept_cap, 1};
  g.b = {s.dtype, f.kept_tile, cols, p.hidden_chunk, 1};
  g.c = {DType::f32, k, cols, s.hidden, 1};
  g.accumulate = true;
  return g;
}

// The tail correction's GEMMs (FilteredBackward::tail_block). dhidden's: the
// block's dlogits tile [k, cols] (ld V) x A's rows [cols, kTailRank].
GemmSpec tail_dhidden_spec(const LmHeadPlanData& p, std::int64_t k, std::int64_t cols) {
  GemmSpec g;
  g.a = {p.dlogits_dtype, k, cols, p.shape.vocab, 1};
  g.b = {p.dlogits_dtype, cols, kTailCoords, kTailCoords, 1};
  g.c = {DType::f32, k, kTailCoords, kTailCoords, 1};
  return g;
}

// dW's: the dlogits tile transposed [cols, k] x the hidden rows' coordinates
// and probes [k, kTailPairProbes].
GemmSpec tail_dweight_spec(const LmHeadPlanData& p, std::int64_t k, std::int64_t cols) {
  GemmSpec g;
  g.a = {p.dlogits_dtype, cols, k, 1, p.shape.vocab};
  g.b = {p.dlogits_dtype, k, kTailPairProbes, kTailPairProbes, 1};
  g.c = {DType::f32, cols, kTailPairProbes, kTailPairProbes, 1};
  return g;
}

// The hidden rows' coordinates: active hidden rows [k, H] x the basis and probes^T [H, kTailCoords].
GemmSpec tail_hidden_spec(const LmHeadPlanData& p, std::int64_t k) {
  const LmHeadShape& s = p.shape;
  GemmSpec g;
  g.a = {s.dtype, k, s.hidden, s.hidden_ld, 1};
  g.b = {s.dtype, s.hidden, kTailCoords, 1, s.hidden};
  g.c = {DType::f32, k, kTailCoords, kTailCoords, 1};
  return g;
}

// The sketch of W's basis: Omega [kTailRows, V / stride] (ld V / stride) x
// every tail_stride-th row of W [V / stride, cols] -> f32 [kTailRows, cols] (ld H).
GemmSpec tail_sketch_spec(const LmHeadPlanData& p, std::int64_t cols) {
  const LmHeadShape& s = p.shape;
  const FilterPlan& f = *p.filter;
  const std::int64_t sampled = (s.vocab + f.tail_stride - 1) / f.tail_stride;
  GemmSpec g;
  g.a = {p.dlogits_dtype, kTailRows, sampled, sampled, 1};
  g.b = vocab_major(s) ? GemmOperand{s.dtype, sampled, cols, f.tail_stride * s.weight_ld, 1}
                       : GemmOperand{s.dtype, sampled, cols, 1, s.weight_ld};
  g.c = {DType::f32, kTailRows, cols, s.hidden, 1};
  return g;
}

// dW tile of cols vocab columns += C [cols, K] (ld kTailApplyLd) x D [K, H],
// K = kTailApplyLd for bf16 dlogits (C's [hi, hi, lo] x D's [hi; lo; hi],
// zero-padded), kTailRank for f32.
GemmSpec tail_apply_spec(const LmHeadPlanData& p, std::int64_t cols) {
  const LmHeadShape& s = p.shape;
  const std::int64_t kk = p.dlogits_dtype == DType::bf16 ? kTailApplyLd : kTailRank;
  GemmSpec g;
  if (vocab_major(s)) {
    g.a = {p.dlogits_dtype, cols, kk, kTailApplyLd, 1};
    g.b = {p.dlogits_dtype, kk, s.hidden, s.hidden, 1};
    g.c = {p.options.dweight_dtype, cols, s.hidden, s.dweight_ld, 1};
  } else {
    g.a = {p.dlogits_dtype, s.hidden, kk, 1, s.hidden};
    g.b = {p.dlogits_dtype, kk, cols, 1, kTailApplyLd};
    g.c = {p.options.dweight_dtype, s.hidden, cols, s.dweight_ld, 1};
  }
  g.accumulate = true;
  return g;
}

}  // namespace

std::unique_ptr<FilterPlan> make_filter_plan(const LmHeadShape& shape, const LmHeadOptions& options) {
  if (options.grad_filter == 0.0 || options.forward_only) return nullptr;
  auto f = std::make_unique<FilterPlan>();
  // auto: eps(weight dtype) / 32: 2^-7 / 32 for bf16, 2^-23 / 32 for f32.
  f->eps = options.grad_filter == kGradFilterAuto ? std::ldexp(1.0F, shape.dtype == DType::bf16 ? -12 : -28)
                                                  : static_cast<float>(options.grad_filter);
  // A block runs filtered while its kept columns fit in half of V, in
  // groups of kKeptTile columns (fewer, a multiple of kRowQuantum, for a
  // small vocabulary; one under 2 kRowQuantum columns is never filtered).
  f->kept_tile = std::min(kKeptTile, shape.vocab / 2 / kRowQuantum * kRowQuantum);
  if (f->kept_tile > 0) f->kept_cap = shape.vocab / 2 / f->kept_tile * f->kept_tile;
  if (f->kept_cap == 0) return nullptr;
  f->tail_rank = kTailRank;
  f->guard = options.grad_filter == kGradFilterAuto;
  f->tail_stride = shape.layout == WeightLayout::vocab_major ? kTailSketchStride : 1;
  // Room for the remainders of kKeptRemainders entries per row.
  if (shape.dtype == DType::bf16) f->kept_lo_cap = kKeptRemainders;
  return f;
}

bool filter_gemms_m_independent(const LmHeadPlanData& p, std::int64_t chunk) {
  const auto ours = [](const GemmSpec& spec) { return kernels::gemm_traits(spec).m_independent; };
  return ours(dhidden_kept_spec(p, kRowQuantum, chunk)) &&
         (p.options.frozen_weight || ours(dweight_kept_spec(p, kRowQuantum)));
}

void create_filter_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed) {
  FilterPlan& f = *p.filter;
  const LmHeadShape& s = p.shape;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  const std::int64_t last_chunk = s.hidden - (p.hidden_chunks - 1) * p.hidden_chunk;
  const std::int64_t chunk = std::min(p.hidden_chunk, s.hidden);
  const bool dweight = !p.options.frozen_weight;
  for (const std::int64_t k : p.row_ladder.entries()) {
    if (dweight) {
      kernels::GemmSizes kept;
      f.dweight_kept.push_back(make.make(dweight_kept_spec(p, k), &kept));
      *packed = std::max(*packed, kept.shared_packed_bytes);
    }
    auto& dhk = f.dhidden_kept.emplace_back();
    dhk.full = make.make(dhidden_kept_spec(p, k, chunk));
    dhk.last = make.make(dhidden_kept_spec(p, k, last_chunk));
    if (f.kept_lo_cap > 0 && dweight) {
      GemmSpec lo = dweight_kept_spec(p, k);
      lo.accumulate = true;
      f.dweight_kept_lo.push_back(make.make(lo));
    }
    auto& tdh = f.tail_dhidden.emplace_back();
    tdh.full = make.make(tail_dhidden_spec(p, k, vt));
    tdh.last = make.make(tail_dhidden_spec(p, k, last_tile));
    auto& tdw = f.tail_dweight.emplace_back();
    if (dweight) {
      tdw.full = make.make(tail_dweight_spec(p, k, vt));
      tdw.last = make.make(tail_dweight_spec(p, k, last_tile));
    }
    f.tail_hidden.push_back(make.make(tail_hidden_spec(p, k)));
  }
  GemmSpec full = forward_spec(s, kTailRows, vt, vt);
  GemmSpec last = forward_spec(s, kTailRows, last_tile, last_tile);
  full.has_bias = last.has_bias = false;
  full.shared = last.shared = kernels::SharedOperand::none;
  f.tail_project.full = make.make(full);
  f.tail_project.last = make.make(last);
  f.tail_sketch.full = make.make(tail_sketch_spec(p, chunk));
  f.tail_sketch.last = make.make(tail_sketch_spec(p, last_chunk));
  f.dense_dhidden.full = make.make(dhidden_spec(s, p.dlogits_dtype, kDenseRows, chunk));
  f.dense_dhidden.last = make.make(dhidden_spec(s, p.dlogits_dtype, kDenseRows, last_chunk));
  if (dweight) {
    f.tail_apply.full = make.make(tail_apply_spec(p, vt));
    f.tail_apply.last = make.make(tail_apply_spec(p, last_tile));
  }
}

void book_filter(const LmHeadPlanData& p, WorkspaceRegistry& w) {
  const FilterPlan& f = *p.filter;
  const auto vocab = static_cast<std::size_t>(p.shape.vocab);
  const auto tiles = static_cast<std::size_t>(p.tiles);
  const auto h = static_cast<std::size_t>(p.shape.hidden);
  const auto k = static_cast<std::size_t>(f.tail_rank);
  constexpr auto kc = static_cast<std::size_t>(kTailCoords);
  const std::size_t dl = size_of(p.dlogits_dtype);
  const std::size_t in = size_of(p.shape.dtype);
  // KeptColumns, packed: count [tiles], column [V], index [V], mark [V].
  const std::array<WorkspacePiece, 4> kept{{{0, tiles * sizeof(std::int64_t), 1},
                                            {0, vocab * sizeof(std::int32_t), 1},
                                            {0, vocab * sizeof(std::int32_t), 1},
                                            {0, vocab * sizeof(std::uint8_t), 1}}};
  w.book_pieces(Region::kept_columns, kept);
  if (f.kept_lo_cap > 0) {  // KeptRemainders, packed: count, column, value per row
    const auto cap = static_cast<std::size_t>(f.kept_lo_cap);
    const std::array<WorkspacePiece, 3> lo{
        {{sizeof(std::int32_t), 0, 1}, {cap * sizeof(std::int32_t), 0, 1}, {cap * sizeof(std::uint16_t), 0, 1}}};
    w.book_pieces(Region::kept_lo, lo);
  }
  // TailPiece's order.
  const auto block = static_cast<std::size_t>(kRowQuantum);
  const std::array<WorkspacePiece, static_cast<std::size_t>(TailPiece::count)> tail{{
      {0, vocab * kc * dl},                                    // coord
      {0, k * h * sizeof(float)},                              // dual_w
      {0, k * h * sizeof(float)},                              // dual_h
      {0, kc * h * in},                                        // basis_h
      {0, static_cast<std::size_t>(kTailApplyLd) * h * dl},    // apply_b
      {0, vocab * k * sizeof(float)},                          // cdw
      {0, vocab},                                              // left
      {0, kc * (h + kc) * sizeof(double)},                     // work
      {0, static_cast<std::size_t>(kDenseRows) * vocab * dl},  // dense
      {0, block * h * sizeof(float)},                          // dense_out
      {0, block * sizeof(std::int64_t)},                       // dense_block
      {0, vocab * kc * sizeof(float)},                         // pending
      {0, vocab * (kc - k) * sizeof(float)},                   // probe_w
      {0, vocab * sizeof(float)},                              // norm_w
      {static_cast<std::size_t>(kTailPairProbes) * dl, 0},     // hidden_pair
      {tiles * sizeof(float), 0},                              // below
      {sizeof(float), 0},                                      // row_scale
      {kc * sizeof(float), 0},                                 // hidden_f
      {kc * sizeof(float), 0},                                 // cdh
      {tiles * kc * sizeof(float), 0},                         // partial
      {tiles * sizeof(float), 0},                              // err_h
      {tiles * sizeof(float), 0},                              // err_w
  }};
  w.book_pieces(Region::tail, tail);
  const auto vt = static_cast<std::size_t>(p.schedule.vocab_tile);
  const std::array<WorkspacePiece, 3> marked_row{{{0, vt * sizeof(float), alignof(float)},
                                                  {0, vt * sizeof(std::uint8_t), alignof(std::int32_t)},
                                                  {0, vt * sizeof(std::int32_t), alignof(std::int32_t)}}};
  w.book_slot_pieces(FilterSlotUse::kMarkedRow, marked_row);
  const std::array<WorkspacePiece, 3> tail_terms{
      {{0, vt * static_cast<std::size_t>(kTailPairProbes) * sizeof(float), alignof(float)},
       {0, vt * kc * sizeof(float), alignof(float)},
       {0, vt * sizeof(std::int32_t), alignof(std::int32_t)}}};
  w.book_slot_pieces(FilterSlotUse::kTailTerms, tail_terms);
  const auto kept_tile = static_cast<std::size_t>(f.kept_tile);
  const std::array<WorkspacePiece, 1> kept_dweight{{{0, kept_tile * h * sizeof(float)}}};
  w.book_slot_pieces(FilterSlotUse::kKeptDweight, kept_dweight);
  const std::array<WorkspacePiece, 1> kept_w{{{0, kept_tile * static_cast<std::size_t>(p.hidden_chunk) * in}}};
  w.book_slot_pieces(FilterSlotUse::kKeptW, kept_w);
  const std::array<WorkspacePiece, 1> project{{{0, static_cast<std::size_t>(kTailRows) * vt * sizeof(float)}}};
  w.book_slot_pieces(FilterSlotUse::kTailProject, project);
  // The block buffer's dlogits compacted to the kept columns, in place, and
  // their remainders after them.
  const auto cap = static_cast<std::size_t>(f.kept_cap);
  const std::array<WorkspacePiece, 2> kept_dl{
      {{cap * dl, 0}, {f.kept_lo_cap > 0 ? cap * sizeof(std::uint16_t) : 0, 0}}};
  w.book_use(RegionUse::kept_dlogits, Region::block, kept_dl);
  if (f.tail_rank > 0) {
    const auto rows = static_cast<std::size_t>(kTailRows);
    const auto sampled = static_cast<std::size_t>((p.shape.vocab + f.tail_stride - 1) / f.tail_stride);
    const std::array<WorkspacePiece, 1> sketch{{{0, rows * sampled * dl}}};
    w.book_use(RegionUse::tail_sketch, Region::block, sketch);
    const std::array<WorkspacePiece, 1> probes{{{0, rows * static_cast<std::size_t>(p.shape.hidden_ld) * in}}};
    w.book_use(RegionUse::tail_probes, Region::stage, probes);
    if (!p.options.frozen_weight) {
      const std::array<WorkspacePiece, 1> apply{{{0, vocab * static_cast<std::size_t>(kTailApplyLd) * dl}}};
      w.book_use(RegionUse::tail_apply, Region::block, apply);
    }
  }
}

std::size_t filter_slot_tile_bytes(const LmHeadPlanData& p) {
  const FilterPlan& f = *p.filter;
  // The kept columns' f32 dW buffer and the gathered W rows (never at once).
  std::size_t b = static_cast<std::size_t>(f.kept_tile * p.shape.hidden) * sizeof(float);
  b = std::max(b, static_cast<std::size_t>(f.kept_tile * p.hidden_chunk) * size_of(p.shape.dtype));
  // The tail correction's W projection tile [kTailRows, tile]; its
  // tail_terms (FilterSlotUse) and marked_row, the larger of the two.
  return std::max(
      b, static_cast<std::size_t>(std::max(kTailRows, kTailPairProbes + kTailCoords + 1) * p.schedule.vocab_tile) *
             sizeof(float));
}

FilterRegions::FilterRegions(std::byte* ws, const WorkspaceLayout& l) {
  kept.count = l.piece<std::int64_t>(ws, Region::kept_columns, 0);
  kept.column = l.piece<std::int32_t>(ws, Region::kept_columns, 1);
  kept.index = l.piece<std::int32_t>(ws, Region::kept_columns, 2);
  kept.mark = l.piece<std::uint8_t>(ws, Region::kept_columns, 3);
  kept_lo.count = l.piece<std::int32_t>(ws, Region::kept_lo, 0).data();
  kept_lo.column = l.piece<std::int32_t>(ws, Region::kept_lo, 1).data();
  kept_lo.value = l.piece<std::uint16_t>(ws, Region::kept_lo, 2).data();
  const auto piece = [&]<class T>(T** to, TailPiece at) {
    *to = l.piece<T>(ws, Region::tail, static_cast<std::size_t>(at)).data();
  };
  TailRegions& t = tail;
  piece(&t.coord, TailPiece::coord);
  piece(&t.dual_w, TailPiece::dual_w);
  piece(&t.dual_h, TailPiece::dual_h);
  piece(&t.basis_h, TailPiece::basis_h);
  piece(&t.apply_b, TailPiece::apply_b);
  piece(&t.cdw, TailPiece::cdw);
  piece(&t.left, TailPiece::left);
  piece(&t.work, TailPiece::work);
  piece(&t.dense, TailPiece::dense);
  piece(&t.dense_out, TailPiece::dense_out);
  piece(&t.dense_block, TailPiece::dense_block);
  piece(&t.pending, TailPiece::pending);
  piece(&t.probe_w, TailPiece::probe_w);
  piece(&t.norm_w, TailPiece::norm_w);
  piece(&t.hidden_pair, TailPiece::hidden_pair);
  piece(&t.below, TailPiece::below);
  piece(&t.row_scale, TailPiece::row_scale);
  piece(&t.hidden_f, TailPiece::hidden_f);
  piece(&t.cdh, TailPiece::cdh);
  piece(&t.partial, TailPiece::partial);
  piece(&t.err_h, TailPiece::err_h);
  piece(&t.err_w, TailPiece::err_w);
  kept_dlogits = l.use_piece<std::byte>(ws, RegionUse::kept_dlogits, 0);
  kept_remainders = l.use_piece<std::byte>(ws, RegionUse::kept_dlogits, 1);
  tail_sketch = l.use_piece<std::byte>(ws, RegionUse::tail_sketch, 0);
  tail_apply = l.use_piece<std::byte>(ws, RegionUse::tail_apply, 0);
  tail_probes = l.use_piece<std::byte>(ws, RegionUse::tail_probes, 0);
}

}  // namespace grpo::detail
