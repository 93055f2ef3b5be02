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
#include <stdexcept>
#include <string>
#include <vector>

#include "driver/filter_plan.hpp"
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

// The slot's GEMM tile: the forward's logits tile; under the filter also its
// per-slot buffers (filter_slot_tile_bytes).
std::size_t slot_tile_bytes(const LmHeadPlanData& p) {
  const std::size_t b = static_cast<std::size_t>(p.forward_rows * p.schedule.vocab_tile) * sizeof(float);
  return p.filter ? std::max(b, filter_slot_tile_bytes(p)) : b;
}

// Books every region of the step's workspace: each phase its own, the loss
// stage's per-batch arrays and the exchange here. Before the GEMMs exist
// (packed_estimate), the packed hidden rows are booked as about one bf16 row
// per block row; after, as the bytes the backend asked for.
WorkspaceRegistry book_workspace(const LmHeadPlanData& p, bool packed_estimate) {
  const auto rows = static_cast<std::size_t>(p.rows);
  WorkspaceRegistry w;
  book_forward(p, packed_estimate, w);
  book_dense_backward(p, w);
  if (p.filter) book_filter(p, w);
  if (p.two_pass) {
    const std::vector<WorkspacePiece> batch(BatchArrays::arrays(p.entropy_bonus), {0, rows * sizeof(float), 1});
    w.book_pieces(Region::batch_arrays, batch);
  }
  w.book(Region::entropy_coef, p.entropy_bonus ? sizeof(float) : 0);
  w.book(Region::quantile, 0, needs_all_rows(p.config) ? rows * sizeof(float) : 0);
  if (p.scale_out) w.book_pieces(Region::exchange, p.scale_out->workspace_pieces());
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

// Every phase's GEMMs for the plan's block, built (build) or only sized:
// the row ladder, the slots' scratchpad and the packed hidden rows' bytes
// either way. Returns the bytes the built GEMMs took (bytes_since), 0 when
// sizing.
std::size_t create_gemms(LmHeadPlanData& p, bool build) {
  // Every GEMM of an earlier try of the block, gone before this one makes its own.
  p.gemms.clear();
  p.forward = {};
  p.backward = {};
  if (p.filter) p.filter->release_gemms();
  const MemorySample before = sample_memory();
  GemmFactory make(p, build);
  std::size_t packed = 0;
  create_forward_gemms(p, make, &packed);
  p.row_ladder = RowLadder();
  if (!p.options.forward_only) {
    // The dense rungs when every backward GEMM is one of ours (GemmTraits::
    // m_independent: ours are, oneDNN's are not), whose objects are cheap
    // (see kLadderRungsOwn); the backend does not depend on the rows.
    const auto ours = [](const GemmSpec& spec) { return kernels::gemm_traits(spec).m_independent; };
    const LmHeadShape& s = p.shape;
    const std::int64_t chunk = std::min(p.hidden_chunk, s.hidden);
    bool cheap = ours(dhidden_spec(s, p.dlogits_dtype, kRowQuantum, chunk));
    if (!p.options.frozen_weight) {
      cheap = cheap && ours(DweightTile{s}.spec(p.dlogits_dtype, p.options.dweight_dtype, kRowQuantum,
                                                p.schedule.vocab_tile, false));
    }
    if (p.filter) cheap = cheap && filter_gemms_m_independent(p, chunk);
    p.row_ladder = RowLadder(p.block_rows_alloc, cheap ? kLadderRungsOwn : kLadderRungsOnednn);
    create_dense_backward_gemms(p, make, &packed);
    if (p.filter) create_filter_gemms(p, make, &packed);
  }
  p.max_scratchpad = make.max_scratchpad();
  p.packed_hidden_bytes = packed;
  return build ? bytes_since(before) : 0;
}

std::string budget_error(std::size_t budget, std::size_t need) {
  return std::to_string(budget) + " bytes cannot hold one " + std::to_string(kRowQuantum) +
         "-row block at this shape; need " + std::to_string(need);
}

}  // namespace

LmHeadPlanData::LmHeadPlanData() = default;
LmHeadPlanData::~LmHeadPlanData() = default;

std::unique_ptr<Gemm> GemmFactory::make(const GemmSpec& spec, kernels::GemmSizes* sizes) {
  if (!build_) {
    const kernels::GemmSizes z = kernels::gemm_sizes(*plan_.engine, spec);
    // The step runs every GEMM with a shared operand on it packed.
    scratch_ = std::max(scratch_, z.scratchpad_bytes_with_packed);
    if (sizes != nullptr) *sizes = z;
    return nullptr;
  }
  auto g = std::make_unique<Gemm>(*plan_.engine, spec);
  scratch_ = std::max(scratch_, g->scratchpad_bytes_with_packed());
  if (sizes != nullptr) {
    *sizes = {g->backend(), g->scratchpad_bytes(), g->shared_packed_bytes(), g->scratchpad_bytes_with_packed(),
              g->traits()};
  }
  g->set_index(plan_.gemms.size());
  plan_.gemms.push_back(g.get());
  return g;
}

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
  p->options.workspace_budget = plan_workspace_budget(shape, options);  // describe() and refusals name it
  p->scale_out = std::move(scale_out);
  p->rows = shape.batch * shape.seq_len;
  p->schedule.vocab_tile = plan_vocab_tile(shape, options);
  p->tiles = (shape.vocab + p->schedule.vocab_tile - 1) / p->schedule.vocab_tile;
  // bf16 GEMMs: the block keeps x - max in f16 (see row_stats_store) and takes
  // the bf16 dlogits in place; f32 GEMMs keep f32 throughout, and so do f16
  // ones: an f16 dlogits entry would lose most of a row's small probabilities
  // to f16's range (p / N below 2^-24 is 0), so f16 W and hidden meet f32
  // dlogits in the backward GEMMs, widened as they are packed.
  p->store_type = shape.dtype == DType::bf16 ? kernels::Elem::f16 : kernels::Elem::f32;
  p->dlogits_dtype = shape.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  p->engine = std::make_unique<kernels::GemmEngine>();
  p->entropy_bonus = config.entropy_coef != 0.0F;
  p->filter = make_filter_plan(shape, options);  // the backward strategy: null = dense

  // The schedule is a function of the shape, the options and the budget: the
  // thread count only decides how many slots run at once (see kSlotBudgetDivisor).
  // Coefficients that need whole sequences: s_i, vespo's phi_i, the off-policy mask.
  const bool sequence = needs_whole_sequences(config);
  // A top-entropy mask needs every row's entropy: two passes unless one block holds them all.
  const bool all_rows = needs_all_rows(config);
  const std::size_t budget = p->options.workspace_budget;
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
    create_gemms(*p, /*build=*/false);
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
  // The block chosen: its GEMMs, built once. They need what the size query
  // said (kernels::gemm_sizes picks the backend a Gemm would take and
  // computes its bytes as the backend does); the layout above relies on it.
  const std::size_t sized_scratchpad = p->max_scratchpad;
  const std::size_t sized_packed = p->packed_hidden_bytes;
  p->schedule.plan_bytes = create_gemms(*p, /*build=*/true);
  if (p->max_scratchpad != sized_scratchpad || p->packed_hidden_bytes != sized_packed) {
    throw std::logic_error("grpo: the GEMMs built need other bytes than kernels::gemm_sizes said");
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
