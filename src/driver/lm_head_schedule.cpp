// Plan building for the fused LM head: token block and vocab tile from the
// workspace budget, the GEMMs for every shape the schedule produces (the
// backward ones per rung of the row ladder), the workspace layout, and the
// plan's own bytes.
#include <malloc.h>  // mallinfo2 (glibc)
#include <unistd.h>  // sysconf

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "driver/lm_head_plan.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"

namespace grpo::detail {
namespace {

using kernels::Gemm;
using kernels::GemmOperand;
using kernels::GemmSpec;

// Forward-only blocks need no [block, V] buffer; past 1024 rows a bigger block
// only grows the per-slot GEMM tile without saving passes over W worth having.
constexpr std::int64_t kMaxForwardOnlyBlock = 1024;

std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }

bool vocab_major(const LmHeadShape& s) { return s.layout == WeightLayout::vocab_major; }

// The forward logits tile: hidden block [rows, H] x W^T tile [H, cols] -> f32 [rows, cols] (ld cols).
GemmSpec forward_spec(const LmHeadShape& s, std::int64_t rows, std::int64_t cols, std::int64_t tile_ld) {
  GemmSpec g;
  g.a = {s.dtype, rows, s.hidden, s.hidden_ld, 1};
  g.b = vocab_major(s) ? GemmOperand{s.dtype, s.hidden, cols, 1, s.weight_ld}
                       : GemmOperand{s.dtype, s.hidden, cols, s.weight_ld, 1};
  g.c = {DType::f32, rows, cols, tile_ld, 1};
  g.has_bias = s.has_bias;
  g.bias_dtype = s.bias_dtype;
  g.shared = kernels::SharedOperand::a;  // the block's hidden rows, for every vocab tile
  return g;
}

// dhidden chunk: dl [k, V] (ld V) x W[:, chunk] [V, cols] -> f32 [k, cols] (ld H).
GemmSpec dhidden_spec(const LmHeadShape& s, DType dl_dtype, std::int64_t k, std::int64_t cols) {
  GemmSpec g;
  g.a = {dl_dtype, k, s.vocab, s.vocab, 1};
  g.b = vocab_major(s) ? GemmOperand{s.dtype, s.vocab, cols, s.weight_ld, 1}
                       : GemmOperand{s.dtype, s.vocab, cols, 1, s.weight_ld};
  g.c = {DType::f32, k, cols, s.hidden, 1};
  return g;
}

// The filtered backward's dW of one group of kept columns: the compacted
// dlogits' columns [k, kept_tile] (ld kept_cap) transposed x the active
// hidden rows [k, H] -> f32 [kept_tile, H] (a slot's buffer), for either
// weight layout (the rows are added into dW's kept rows or columns after).
GemmSpec dweight_kept_spec(const LmHeadPlanData& p, std::int64_t k) {
  const LmHeadShape& s = p.shape;
  GemmSpec g;
  g.a = {p.dlogits_dtype, p.kept_tile, k, 1, p.kept_cap};
  g.b = {s.dtype, k, s.hidden, s.hidden_ld, 1};
  g.c = {DType::f32, p.kept_tile, s.hidden, s.hidden, 1};
  g.shared = kernels::SharedOperand::b;  // the active hidden rows, for every group
  return g;
}

// The filtered backward's dhidden chunk: += compacted dlogits [k, kept_tile]
// (ld kept_cap) x the group's W rows gathered into [kept_tile, cols] (ld
// hidden_chunk) -> f32 [k, cols] (ld H).
GemmSpec dhidden_kept_spec(const LmHeadPlanData& p, std::int64_t k, std::int64_t cols) {
  const LmHeadShape& s = p.shape;
  GemmSpec g;
  g.a = {p.dlogits_dtype, k, p.kept_tile, p.kept_cap, 1};
  g.b = {s.dtype, p.kept_tile, cols, p.hidden_chunk, 1};
  g.c = {DType::f32, k, cols, s.hidden, 1};
  g.accumulate = true;
  return g;
}

// The tail correction's GEMMs (LmHeadStep::tail_block). dhidden's: the
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
  const std::int64_t sampled = (s.vocab + p.tail_stride - 1) / p.tail_stride;
  GemmSpec g;
  g.a = {p.dlogits_dtype, kTailRows, sampled, sampled, 1};
  g.b = vocab_major(s) ? GemmOperand{s.dtype, sampled, cols, p.tail_stride * s.weight_ld, 1}
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

// The slot's GEMM tile: the forward's logits tile; under the filter also the
// kept columns' f32 dW buffer and the gathered W rows (never at once).
std::size_t slot_tile_bytes(const LmHeadPlanData& p) {
  std::size_t b = static_cast<std::size_t>(p.forward_rows * p.schedule.vocab_tile) * sizeof(float);
  if (p.kept_cap > 0) {
    b = std::max(b, static_cast<std::size_t>(p.kept_tile * p.shape.hidden) * sizeof(float));
    b = std::max(b, static_cast<std::size_t>(p.kept_tile * p.hidden_chunk) * size_of(p.shape.dtype));
    // The tail correction's W projection tile [kTailRows, tile]; its dW
    // coordinates [tile, kTailPairProbes], the kept columns' A rows [tile,
    // kTailCoords] and places [tile]; the remainders' row, marks and columns.
    b = std::max(
        b, static_cast<std::size_t>(std::max(kTailRows, kTailPairProbes + kTailCoords + 1) * p.schedule.vocab_tile) *
               sizeof(float));
  }
  return b;
}

std::size_t store_bytes(const LmHeadPlanData& p) { return p.store_type == kernels::Elem::f32 ? 4 : 2; }

// Books every region of the step's workspace. Before the GEMMs exist
// (packed_estimate), the packed hidden rows are booked as about one bf16 row
// per block row; after, as the bytes the backend asked for.
WorkspaceRegistry book_workspace(const LmHeadPlanData& p, bool packed_estimate) {
  const LmHeadShape& s = p.shape;
  const std::size_t in_size = size_of(s.dtype);
  const bool backward = !p.options.forward_only;
  const auto rows = static_cast<std::size_t>(p.rows);
  WorkspaceRegistry w;
  w.book(Region::block, backward ? static_cast<std::size_t>(s.vocab) * store_bytes(p) : 0);
  w.book(Region::stage, 0, static_cast<std::size_t>(p.forward_rows * s.hidden_ld) * in_size);
  w.book(Region::tile_stats, static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats));
  w.book(Region::row_arrays, RowArrays::kBytesPerRow);
  w.book(Region::hidden_act, backward ? static_cast<std::size_t>(s.hidden_ld) * in_size : 0);
  w.book(Region::dhidden_act, backward ? static_cast<std::size_t>(s.hidden) * sizeof(float) : 0);
  if (packed_estimate) {
    w.book(Region::packed_hidden, s.dtype == DType::bf16 ? static_cast<std::size_t>(s.hidden) * 2 : 0);
  } else {
    w.book(Region::packed_hidden, 0, p.packed_hidden_bytes);
  }
  w.book(Region::batch_arrays, 0, p.two_pass ? BatchArrays::arrays(p.entropy_bonus) * rows * sizeof(float) : 0);
  w.book(Region::entropy_coef, p.entropy_bonus ? sizeof(float) : 0);
  w.book(Region::quantile, 0, needs_all_rows(p.config) ? rows * sizeof(float) : 0);
  w.book(Region::exchange, p.scale_out ? p.scale_out->bytes_per_row() : 0,
         p.scale_out ? p.scale_out->fixed_bytes() : 0);
  w.book(Region::kept_columns, 0, p.kept_cap > 0 ? KeptColumns::bytes(s.vocab, p.tiles) : 0);
  w.book(Region::kept_lo, p.kept_lo_cap > 0 ? KeptRemainders::bytes_per_row(p.kept_lo_cap) : 0);
  const TailRegions::Dims tail = tail_dims(p);
  w.book(Region::tail, tail.rank > 0 ? TailRegions::per_row_bytes(tail) : 0,
         tail.rank > 0 ? TailRegions::fixed_bytes(tail) : 0);
  w.book_slot(slot_tile_bytes(p), p.max_scratchpad);
  return w;
}

// What the process holds, seen two ways (see bytes_since).
struct MemorySample {
  std::size_t heap = 0;           // malloc's bytes in use (glibc mallinfo2), 0 where unavailable
  std::size_t anon_resident = 0;  // resident anonymous pages (/proc/self/statm), 0 where unavailable
};

MemorySample sample_memory() {
  MemorySample m;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 mi = mallinfo2();
  m.heap = mi.uordblks + mi.hblkhd;  // small chunks in use + chunks malloc mapped on its own
#endif
  // statm: resident pages, then those backed by a file or shared memory; the
  // difference is anonymous memory (a library's code paged in is not counted).
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    std::size_t size = 0, resident = 0, shared = 0;
    if (std::fscanf(f, "%zu %zu %zu", &size, &resident, &shared) == 3 && resident >= shared) {
      m.anon_resident = (resident - shared) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    }
    std::fclose(f);
  }
  return m;
}

// The plan's own bytes allocated since `before` (LmHeadSchedule::plan_bytes):
// the larger of the heap's growth and the anonymous resident growth. Each
// misses what the other sees: malloc's count misses oneDNN's JIT code (Xbyak
// maps it with mmap: ~20% of a f32 primitive's bytes at H = 8, V = 16), the
// resident count misses objects placed in heap pages already resident (freed
// by an earlier plan or try). Both are process-wide: another thread's
// allocations (or frees) in the window are counted (or subtracted) too. And
// a primitive oneDNN's process-wide cache already held (another plan of the
// same shapes) costs this plan nothing here; the cache keeps recently used
// primitives alive (1024 by default) after their plans are destroyed.
std::size_t bytes_since(const MemorySample& before) {
  const MemorySample now = sample_memory();
  const auto growth = [](std::size_t from, std::size_t to) { return to > from ? to - from : std::size_t{0}; };
  return std::max(growth(before.heap, now.heap), growth(before.anon_resident, now.anon_resident));
}

// `rows` (a multiple of kRowQuantum) in equal calls of at most `cap` rows
// (0: one call): how many calls, and the rows of each (a multiple of
// kRowQuantum; the last call's are padded when the calls do not divide them).
std::int64_t calls_of(std::int64_t rows, std::int64_t cap) { return cap > 0 ? (rows + cap - 1) / cap : 1; }
std::int64_t rows_per_call(std::int64_t rows, std::int64_t cap) {
  const std::int64_t calls = calls_of(rows, cap);
  return round_up((rows + calls - 1) / calls, kRowQuantum);
}

// Every GEMM of the plan, gone (before another try of the block builds its own).
void release_gemms(LmHeadPlanData& p) {
  p.gemms.clear();
  p.forward = {};
  p.forward_tail = {};
  p.forward_tail_rows = 0;
  p.forward_tail_block = 0;
  p.dweight.clear();
  p.dhidden.clear();
  p.dweight_kept.clear();
  p.dhidden_kept.clear();
  p.dweight_kept_lo.clear();
  p.tail_dhidden.clear();
  p.tail_dweight.clear();
  p.tail_hidden.clear();
  p.tail_project = {};
  p.tail_sketch = {};
  p.dense_dhidden = {};
  p.tail_apply = {};
}

// Builds the GEMMs for the plan's block; returns the bytes they took (bytes_since).
std::size_t create_gemms(LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  const kernels::GemmEngine& e = *p.engine;
  release_gemms(p);
  const MemorySample before = sample_memory();
  std::size_t scratch = 0;
  auto make = [&](const GemmSpec& spec) {
    auto g = std::make_unique<Gemm>(e, spec);
    // The step runs every GEMM with a shared operand on it packed.
    scratch = std::max(scratch, g->scratchpad_bytes_with_packed());
    g->set_index(p.gemms.size());
    p.gemms.push_back(g.get());
    return g;
  };
  p.forward.full = make(forward_spec(s, p.forward_rows, vt, vt));
  p.forward.last = make(forward_spec(s, p.forward_rows, last_tile, last_tile));
  // Full and last tiles pack the shared hidden rows alike (only W's side differs).
  std::size_t packed =
      static_cast<std::size_t>(p.block_rows_alloc / p.forward_rows) * p.forward.full->shared_packed_bytes();
  // A shorter last block, when the block's forward calls are ours (rows
  // independent of M): GEMMs of its own, as many calls as a block's at most,
  // so it computes its rows (rounded up to kRowQuantum), not the block's
  // (T = 8192 in 640-row blocks: 512 rows, not 640, in the last).
  const std::int64_t block = p.schedule.token_block;
  const std::int64_t tail_rows = round_up(p.rows - (p.rows - 1) / block * block, kRowQuantum);
  if (tail_rows < p.block_rows_alloc && p.forward.full->traits().m_independent) {
    const std::int64_t calls = calls_of(tail_rows, p.forward_rows);
    p.forward_tail_block = tail_rows;
    p.forward_tail_rows = rows_per_call(tail_rows, p.forward_rows);
    p.forward_tail.full = make(forward_spec(s, p.forward_tail_rows, vt, vt));
    p.forward_tail.last = make(forward_spec(s, p.forward_tail_rows, last_tile, last_tile));
    packed = std::max(packed, static_cast<std::size_t>(calls) * p.forward_tail.full->shared_packed_bytes());
  }
  p.row_ladder = RowLadder();
  if (!p.options.forward_only) {
    const std::int64_t last_chunk = s.hidden - (p.hidden_chunks - 1) * p.hidden_chunk;
    const std::int64_t chunk = std::min(p.hidden_chunk, s.hidden);
    // The dense rungs when every backward GEMM is one of ours (GemmTraits::
    // m_independent: ours are, oneDNN's are not), whose objects are cheap
    // (see kLadderRungsOwn); the backend does not depend on the rows.
    const auto ours = [](const GemmSpec& spec) { return kernels::gemm_traits(spec).m_independent; };
    const DweightTile dw_tile{s};
    bool cheap = ours(dhidden_spec(s, p.dlogits_dtype, kRowQuantum, chunk));
    if (!p.options.frozen_weight) {
      cheap = cheap && ours(dw_tile.spec(p.dlogits_dtype, p.options.dweight_dtype, kRowQuantum, vt, false));
    }
    if (p.kept_cap > 0) {
      cheap = cheap && ours(dhidden_kept_spec(p, kRowQuantum, chunk)) &&
              (p.options.frozen_weight || ours(dweight_kept_spec(p, kRowQuantum)));
    }
    p.row_ladder = RowLadder(p.block_rows_alloc, cheap ? kLadderRungsOwn : kLadderRungsOnednn);
    for (const std::int64_t k : p.row_ladder.entries()) {
      auto& dw = p.dweight.emplace_back();
      for (int acc = 0; acc < 2 && !p.options.frozen_weight; ++acc) {
        dw.full[acc] = make(dw_tile.spec(p.dlogits_dtype, p.options.dweight_dtype, k, vt, acc == 1));
        dw.last[acc] = make(dw_tile.spec(p.dlogits_dtype, p.options.dweight_dtype, k, last_tile, acc == 1));
      }
      if (!p.options.frozen_weight) packed = std::max(packed, dw.full[0]->shared_packed_bytes());
      auto& dh = p.dhidden.emplace_back();
      dh.full = make(dhidden_spec(s, p.dlogits_dtype, k, chunk));
      dh.last = make(dhidden_spec(s, p.dlogits_dtype, k, last_chunk));
      if (p.kept_cap == 0) continue;
      if (!p.options.frozen_weight) {
        p.dweight_kept.push_back(make(dweight_kept_spec(p, k)));
        packed = std::max(packed, p.dweight_kept.back()->shared_packed_bytes());
      }
      auto& dhk = p.dhidden_kept.emplace_back();
      dhk.full = make(dhidden_kept_spec(p, k, chunk));
      dhk.last = make(dhidden_kept_spec(p, k, last_chunk));
      if (p.kept_lo_cap > 0 && !p.options.frozen_weight) {
        GemmSpec lo = dweight_kept_spec(p, k);
        lo.accumulate = true;
        p.dweight_kept_lo.push_back(make(lo));
      }
      if (p.tail_rank == 0) continue;
      auto& tdh = p.tail_dhidden.emplace_back();
      tdh.full = make(tail_dhidden_spec(p, k, vt));
      tdh.last = make(tail_dhidden_spec(p, k, last_tile));
      auto& tdw = p.tail_dweight.emplace_back();
      if (!p.options.frozen_weight) {
        tdw.full = make(tail_dweight_spec(p, k, vt));
        tdw.last = make(tail_dweight_spec(p, k, last_tile));
      }
      p.tail_hidden.push_back(make(tail_hidden_spec(p, k)));
    }
    if (p.tail_rank > 0) {
      GemmSpec full = forward_spec(s, kTailRows, vt, vt);
      GemmSpec last = forward_spec(s, kTailRows, last_tile, last_tile);
      full.has_bias = last.has_bias = false;
      full.shared = last.shared = kernels::SharedOperand::none;
      p.tail_project.full = make(full);
      p.tail_project.last = make(last);
      p.tail_sketch.full = make(tail_sketch_spec(p, chunk));
      p.tail_sketch.last = make(tail_sketch_spec(p, last_chunk));
      p.dense_dhidden.full = make(dhidden_spec(s, p.dlogits_dtype, kDenseRows, chunk));
      p.dense_dhidden.last = make(dhidden_spec(s, p.dlogits_dtype, kDenseRows, last_chunk));
      if (!p.options.frozen_weight) {
        p.tail_apply.full = make(tail_apply_spec(p, vt));
        p.tail_apply.last = make(tail_apply_spec(p, last_tile));
      }
    }
  }
  p.max_scratchpad = scratch;
  p.packed_hidden_bytes = packed;
  return bytes_since(before);
}

std::string budget_error(std::size_t budget, std::size_t need) {
  return std::to_string(budget) + " bytes cannot hold one " + std::to_string(kRowQuantum) +
         "-row block at this shape; need " + std::to_string(need);
}

}  // namespace

GemmSpec DweightTile::spec(DType dlogits, DType dweight, std::int64_t k, std::int64_t cols, bool accumulate) const {
  const LmHeadShape& s = shape;
  GemmSpec g;
  if (vocab_major()) {
    g.a = {dlogits, cols, k, 1, s.vocab};
    g.b = {s.dtype, k, s.hidden, s.hidden_ld, 1};
    g.c = {dweight, cols, s.hidden, s.dweight_ld, 1};
  } else {
    g.a = {s.dtype, s.hidden, k, 1, s.hidden_ld};
    g.b = {dlogits, k, cols, s.vocab, 1};
    g.c = {dweight, s.hidden, cols, s.dweight_ld, 1};
  }
  g.accumulate = accumulate;
  // The active hidden rows, for every vocab tile of the block.
  g.shared = vocab_major() ? kernels::SharedOperand::b : kernels::SharedOperand::a;
  return g;
}

BindingPool::Lease BindingPool::acquire() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      std::unique_ptr<Set> set = std::move(free_.back());
      free_.pop_back();
      return {*this, std::move(set)};
    }
  }
  // Every set is in use (or this is the first call): build one.
  auto set = std::make_unique<Set>();
  set->reserve(gemms_.size() * static_cast<std::size_t>(slots_));
  for (const kernels::Gemm* g : gemms_) {
    for (int s = 0; s < slots_; ++s) set->emplace_back(*g);
  }
  return {*this, std::move(set)};
}

void BindingPool::give_back(std::unique_ptr<Set> set) {
  const std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(set));  // capacity grows only with the most concurrent calls seen
}

std::unique_ptr<LmHeadPlanData> build_lm_head_plan(const LmHeadShape& shape, const LossConfig& config,
                                                   const LmHeadOptions& options,
                                                   std::shared_ptr<const ScaleOutPlan> scale_out,
                                                   const BlockChoice* forced) {
  auto p = std::make_unique<LmHeadPlanData>();
  p->shape = shape;  // strides already resolved by the caller
  p->config = config;
  p->options = options;
  p->scale_out = std::move(scale_out);
  p->rows = shape.batch * shape.seq_len;
  p->schedule.vocab_tile = plan_vocab_tile(shape, options);
  p->tiles = (shape.vocab + p->schedule.vocab_tile - 1) / p->schedule.vocab_tile;
  // bf16 GEMMs: the block keeps x - max in f16 (see row_stats_store) and takes
  // the bf16 dlogits in place; f32 GEMMs keep f32 throughout.
  p->store_type = shape.dtype == DType::bf16 ? kernels::Elem::f16 : kernels::Elem::f32;
  p->dlogits_dtype = shape.dtype;
  p->engine = std::make_unique<kernels::GemmEngine>();
  p->entropy_bonus = config.entropy_coef != 0.0F;
  if (options.grad_filter != 0.0 && !options.forward_only) {
    // auto: eps(weight dtype) / 32: 2^-7 / 32 for bf16, 2^-23 / 32 for f32.
    p->grad_filter = options.grad_filter == kGradFilterAuto ? std::ldexp(1.0F, shape.dtype == DType::bf16 ? -12 : -28)
                                                            : static_cast<float>(options.grad_filter);
    // A block runs filtered while its kept columns fit in half of V, in
    // groups of kKeptTile columns (fewer, a multiple of kRowQuantum, for a
    // small vocabulary; one under 2 kRowQuantum columns is never filtered).
    p->kept_tile = std::min(kKeptTile, shape.vocab / 2 / kRowQuantum * kRowQuantum);
    if (p->kept_tile > 0) p->kept_cap = shape.vocab / 2 / p->kept_tile * p->kept_tile;
    if (p->kept_cap > 0) {
      p->tail_rank = kTailRank;
      p->filter_guard = options.grad_filter == kGradFilterAuto;
      p->tail_stride = shape.layout == WeightLayout::vocab_major ? kTailSketchStride : 1;
      // Room for the remainders of kKeptRemainders entries per row.
      if (shape.dtype == DType::bf16) p->kept_lo_cap = kKeptRemainders;
    }
  }

  // The schedule is a function of the shape, the options and the budget: the
  // thread count only decides how many slots run at once (see kSlotBudgetDivisor).
  // Coefficients that need whole sequences: s_i, vespo's phi_i, the off-policy mask.
  const bool sequence = needs_whole_sequences(config);
  // A top-entropy mask needs every row's entropy: two passes unless one block holds them all.
  const bool all_rows = needs_all_rows(config);
  const std::size_t budget = options.workspace_budget;
  const std::size_t block_budget = budget - budget / kSlotBudgetDivisor;
  const std::int64_t cap = options.forward_only ? kMaxForwardOnlyBlock : std::numeric_limits<std::int64_t>::max();
  std::int64_t limit = options.token_block > 0 ? options.token_block : 0;
  if (limit == 0) {
    // The recompute schedule's [N] arrays are fixed bytes; whether it applies
    // depends on the block, so size the block once without them, then check.
    p->two_pass = sequence || all_rows;  // conservative: the block decides below
    p->forward_rows = kForwardRows;
    const WorkspaceRegistry estimate = book_workspace(*p, /*packed_estimate=*/true);
    p->two_pass = false;
    const std::size_t fixed = estimate.fixed_bytes();
    const std::size_t per_row = estimate.bytes_per_row();
    limit = block_budget > fixed ? static_cast<std::int64_t>((block_budget - fixed) / per_row) : 0;
    if (limit < kRowQuantum) throw Error("options.workspace_budget", budget_error(budget, fixed + 32 * per_row));
  }
  limit = std::min(limit, cap);
  // Rows per forward call: kForwardRows, or fewer (a multiple of kRowQuantum)
  // when the budget or the requested block is smaller. Never from N. A
  // requested block below forward_rows is kept exactly (one staged chunk);
  // above, it is rounded down to a multiple of forward_rows.
  const bool requested = options.token_block > 0;
  p->forward_rows = std::min(kForwardRows, requested ? round_up(limit, kRowQuantum)
                                                     : std::max(kRowQuantum, limit / kRowQuantum * kRowQuantum));
  // A backend whose rows do not depend on the batch (GemmTraits) takes the
  // whole block in one forward call per vocab tile: W is read once per block,
  // not once per kForwardRows rows. Or, when the block's packed hidden rows
  // are more than the backend takes whole (GemmTraits::max_shared_rows), in
  // equal calls of at most that many. Zen 4, one thread, forward x 4096 x
  // 2048: 96.7% of the peak at 832 rows, 92.1% at 1664 in one call (its 13
  // MiB of packed rows in L2-sized blocks).
  const kernels::GemmTraits forward_traits =
      kernels::gemm_traits(forward_spec(shape, p->forward_rows, p->schedule.vocab_tile, p->schedule.vocab_tile));
  const bool whole_block = forced == nullptr && forward_traits.m_independent;
  const std::int64_t forward_cap = forward_traits.max_shared_rows;
  // Such a backend needs no multiple of forward_rows: the block is any
  // multiple of kRowQuantum (unless requested).
  const bool any_rows = !requested && whole_block;
  const std::int64_t quantum = any_rows ? kRowQuantum : p->forward_rows;
  std::int64_t nb = limit <= p->forward_rows ? limit : limit / quantum * quantum;
  nb = std::min(nb, round_up(p->rows, p->forward_rows));  // no block longer than the batch needs
  if (forced != nullptr) {
    p->forward_rows = forced->forward_rows;
    nb = forced->token_block;
  }

  const int threads = resolve_threads(options.max_threads);
  // dhidden's columns per task. Each task's GEMM reads the block's whole
  // dlogits [block, V] once, so fewer, wider chunks read less; a backend
  // whose every element is reduced over K alone (GemmTraits) gives the same
  // bits for any chunking, so it takes one chunk per thread (H / threads,
  // rounded up to kHiddenChunk). oneDNN keeps kHiddenChunk whatever the
  // thread count (its blocking, and so its sums, follow N).
  p->hidden_chunk = whole_block ? round_up((shape.hidden + threads - 1) / threads, kHiddenChunk) : kHiddenChunk;
  p->hidden_chunk = std::min(p->hidden_chunk, shape.hidden);
  p->hidden_chunks = (shape.hidden + p->hidden_chunk - 1) / p->hidden_chunk;
  for (;;) {
    std::int64_t block = std::min(nb, p->rows);
    if (whole_block && block < p->rows) {
      // Of several blocks, each one a whole number of equal calls of whole
      // 32-row panels, so that no call computes padding rows (Zen 4, 640 MiB
      // budget: 1632 rows took 2 x 832).
      const std::int64_t unit = calls_of(round_up(block, kRowQuantum), forward_cap) * kRowQuantum;
      block = std::max(unit, block / unit * unit);
    }
    p->schedule.recompute_logits = false;
    p->two_pass = false;
    if (sequence) {
      if (shape.seq_len <= block) {
        block = block / shape.seq_len * shape.seq_len;  // whole sequences per block
      } else {
        // A sequence spans blocks: its ratio needs every block's logp first
        // (forward pass over all blocks), and the backward then recomputes logits.
        p->two_pass = true;
        p->schedule.recompute_logits = !options.forward_only;
      }
    }
    if (all_rows && p->rows > block) {
      p->two_pass = true;
      p->schedule.recompute_logits = !options.forward_only;
    }
    p->schedule.token_block = block;
    if (whole_block) p->forward_rows = rows_per_call(round_up(block, kRowQuantum), forward_cap);
    p->block_rows_alloc = round_up(block, p->forward_rows);
    p->schedule.plan_bytes = create_gemms(*p);
    const WorkspaceRegistry regions = book_workspace(*p, /*packed_estimate=*/false);
    // Slots (concurrent tile tasks): one per thread, as many as the budget
    // holds beside everything else, at least one.
    const WorkspaceLayout no_slots = regions.lay_out(p->block_rows_alloc, 0);
    const std::size_t room = budget > no_slots.total ? budget - no_slots.total : 0;
    const auto fit_slots = static_cast<int>(std::min<std::size_t>(room / no_slots.slot_bytes, 1024));
    p->schedule.slots = std::max(1, std::min(threads, fit_slots));
    p->layout = regions.lay_out(p->block_rows_alloc, p->schedule.slots);
    p->schedule.workspace_bytes = p->layout.total;
    if (p->layout.total <= budget || options.token_block > 0 || forced != nullptr) break;
    const std::int64_t step = whole_block ? kRowQuantum : p->forward_rows;
    if (nb <= step) throw Error("options.workspace_budget", budget_error(budget, p->layout.total));
    nb -= step;
  }
  p->threads = threads;
  p->bindings.reset(p->gemms, p->schedule.slots);
  if (p->layout.total > budget) {
    throw Error("options.token_block", "token block " + std::to_string(nb) + " needs " +
                                           std::to_string(p->layout.total) + " bytes, over the workspace budget " +
                                           std::to_string(budget));
  }
  p->schedule.gemm_count = p->gemms.size();
  {
    // One set of bindings built now rather than by the first execute(), so
    // that the plan's bytes count it (and the first call allocates no more
    // than later ones).
    const MemorySample before = sample_memory();
    { const BindingPool::Lease first = p->bindings.acquire(); }  // back to the pool at the brace
    p->schedule.plan_bytes += bytes_since(before);
  }
  return p;
}

}  // namespace grpo::detail
