// Plan building for the fused LM head: token block and vocab tile from the
// workspace budget, the oneDNN GEMMs for every shape the schedule produces,
// and the workspace layout.
#include <algorithm>
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

constexpr std::size_t kAlign = 64;
// Forward-only blocks need no [block, V] buffer; past 1024 rows a bigger block
// only grows the per-slot GEMM tile without saving passes over W worth having.
constexpr std::int64_t kMaxForwardOnlyBlock = 1024;

std::size_t align_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
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

// dweight tile from dlogits tile [k, cols] (ld V) and active hidden [k, H]
// (ld hidden_ld: the rows the generic head's backward also feeds to the
// forward GEMM, which was created for that stride).
GemmSpec dweight_spec(const LmHeadShape& s, DType dl_dtype, DType dw_dtype, std::int64_t k, std::int64_t cols,
                      bool accumulate) {
  GemmSpec g;
  if (vocab_major(s)) {  // dW[tile] [cols, H] = dl^T [cols, k] x h [k, H]
    g.a = {dl_dtype, cols, k, 1, s.vocab};
    g.b = {s.dtype, k, s.hidden, s.hidden_ld, 1};
    g.c = {dw_dtype, cols, s.hidden, s.dweight_ld, 1};
  } else {  // dW^T[:, tile] [H, cols] = h^T [H, k] x dl [k, cols]
    g.a = {s.dtype, s.hidden, k, 1, s.hidden_ld};
    g.b = {dl_dtype, k, cols, s.vocab, 1};
    g.c = {dw_dtype, s.hidden, cols, s.dweight_ld, 1};
  }
  g.accumulate = accumulate;
  // The active hidden rows, for every vocab tile of the block.
  g.shared = vocab_major(s) ? kernels::SharedOperand::b : kernels::SharedOperand::a;
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

// [N] arrays of the two-pass schedule: coefficients, entropies, logp, kl, and
// the entropy coefficients with an entropy bonus.
std::size_t coef_all_arrays(const LmHeadPlanData& p) { return p.entropy_bonus ? 5 : 4; }
std::size_t quantile_bytes(const LmHeadPlanData& p) {
  return needs_all_rows(p.config) ? static_cast<std::size_t>(p.rows) * sizeof(float) : 0;
}

std::size_t store_bytes(const LmHeadPlanData& p) { return p.store_type == kernels::Elem::f32 ? 4 : 2; }

// Bytes that grow with the token block, per block row (thread count excluded).
std::size_t bytes_per_row(const LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  std::size_t b = static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats) + 6 * sizeof(float) + 8 +
                  (p.entropy_bonus ? sizeof(float) : 0);
  if (p.scale_out) b += p.scale_out->bytes_per_row();
  // The packed hidden rows (Gemm::pack_shared), about one bf16 row each.
  if (s.dtype == DType::bf16) b += static_cast<std::size_t>(s.hidden) * 2;
  if (!p.options.forward_only) {
    b += static_cast<std::size_t>(s.vocab) * store_bytes(p) + static_cast<std::size_t>(s.hidden_ld) * size_of(s.dtype) +
         static_cast<std::size_t>(s.hidden) * sizeof(float);
  }
  return b;
}

// Bytes that depend on neither the block nor the threads.
std::size_t fixed_bytes(const LmHeadPlanData& p, std::int64_t forward_rows) {
  const auto stage = static_cast<std::size_t>(forward_rows * p.shape.hidden_ld) * size_of(p.shape.dtype);
  const std::size_t coef_all =
      p.sequence_spans_blocks ? coef_all_arrays(p) * static_cast<std::size_t>(p.rows) * sizeof(float) : 0;
  const std::size_t scale_out = p.scale_out ? p.scale_out->fixed_bytes() : 0;
  return align_up(stage) + align_up(coef_all) + align_up(quantile_bytes(p)) + align_up(scale_out) + 8 * kAlign;
}

WorkspaceLayout lay_out(const LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const auto rows = static_cast<std::size_t>(p.block_rows_alloc);
  const std::size_t in_size = size_of(s.dtype);
  const bool backward = !p.options.forward_only;
  WorkspaceLayout l;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  l.block = take(backward ? rows * static_cast<std::size_t>(s.vocab) * store_bytes(p) : 0);
  l.stage = take(static_cast<std::size_t>(p.forward_rows * s.hidden_ld) * in_size);
  l.tile_stats = take(rows * static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats));
  l.rows = take(rows * (6 * sizeof(float) + sizeof(std::int64_t)));
  l.hidden_act = take(backward ? rows * static_cast<std::size_t>(s.hidden_ld) * in_size : 0);
  l.dhidden_act = take(backward ? rows * static_cast<std::size_t>(s.hidden) * sizeof(float) : 0);
  l.packed_hidden = take(p.packed_hidden_bytes);
  l.coef_all =
      take(p.sequence_spans_blocks ? coef_all_arrays(p) * static_cast<std::size_t>(p.rows) * sizeof(float) : 0);
  l.ent_coef = take(p.entropy_bonus ? rows * sizeof(float) : 0);
  l.quantile = take(quantile_bytes(p));
  l.scale_out = take(p.scale_out ? p.scale_out->fixed_bytes() + rows * p.scale_out->bytes_per_row() : 0);
  l.tile_bytes = align_up(static_cast<std::size_t>(p.forward_rows * p.schedule.vocab_tile) * sizeof(float));
  l.slot_bytes = l.tile_bytes + align_up(p.max_scratchpad);
  l.slots = take(l.slot_bytes * static_cast<std::size_t>(p.schedule.threads));
  l.total = at;
  return l;
}

void create_gemms(LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  const kernels::GemmEngine& e = *p.engine;
  std::size_t scratch = 0;
  p.gemms.clear();
  auto make = [&](const GemmSpec& spec) {
    auto g = std::make_unique<Gemm>(e, spec);
    scratch = std::max(scratch, g->scratchpad_bytes());
    g->set_index(p.gemms.size());
    p.gemms.push_back(g.get());
    return g;
  };
  p.forward.full = make(forward_spec(s, p.forward_rows, vt, vt));
  p.forward.last = make(forward_spec(s, p.forward_rows, last_tile, last_tile));
  // Full and last tiles pack the shared hidden rows alike (only W's side differs).
  std::size_t packed =
      static_cast<std::size_t>(p.block_rows_alloc / p.forward_rows) * p.forward.full->shared_packed_bytes();
  p.dweight.clear();
  p.dhidden.clear();
  if (!p.options.forward_only) {
    const std::int64_t last_chunk = s.hidden - (p.hidden_chunks - 1) * p.hidden_chunk;
    const std::int64_t chunk = std::min(p.hidden_chunk, s.hidden);
    for (std::int64_t k = kRowQuantum; k <= p.block_rows_alloc; k += kRowQuantum) {
      auto& dw = p.dweight.emplace_back();
      for (int acc = 0; acc < 2 && !p.options.frozen_weight; ++acc) {
        dw.full[acc] = make(dweight_spec(s, p.dlogits_dtype, p.options.dweight_dtype, k, vt, acc == 1));
        dw.last[acc] = make(dweight_spec(s, p.dlogits_dtype, p.options.dweight_dtype, k, last_tile, acc == 1));
      }
      if (!p.options.frozen_weight) packed = std::max(packed, dw.full[0]->shared_packed_bytes());
      auto& dh = p.dhidden.emplace_back();
      dh.full = make(dhidden_spec(s, p.dlogits_dtype, k, chunk));
      dh.last = make(dhidden_spec(s, p.dlogits_dtype, k, last_chunk));
    }
  }
  p.max_scratchpad = scratch;
  p.packed_hidden_bytes = packed;
}

std::string budget_error(std::size_t budget, std::size_t need) {
  return std::to_string(budget) + " bytes cannot hold one " + std::to_string(kRowQuantum) +
         "-row block at this shape; need " + std::to_string(need);
}

}  // namespace

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
    p->sequence_spans_blocks = sequence || all_rows;  // conservative: the block decides below
    const std::size_t fixed = fixed_bytes(*p, kForwardRows);
    p->sequence_spans_blocks = false;
    const std::size_t per_row = bytes_per_row(*p);
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
  std::int64_t nb = limit <= p->forward_rows ? limit : limit / p->forward_rows * p->forward_rows;
  nb = std::min(nb, round_up(p->rows, p->forward_rows));  // no block longer than the batch needs
  if (forced != nullptr) {
    p->forward_rows = forced->forward_rows;
    nb = forced->token_block;
  }

  // A backend whose rows do not depend on the batch (GemmTraits) takes the
  // whole block in one forward call per vocab tile: W is read once per block,
  // not once per kForwardRows rows.
  const bool whole_block =
      forced == nullptr &&
      kernels::gemm_traits(forward_spec(shape, p->forward_rows, p->schedule.vocab_tile, p->schedule.vocab_tile))
          .m_independent;
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
    p->schedule.recompute_logits = false;
    p->sequence_spans_blocks = false;
    if (sequence) {
      if (shape.seq_len <= block) {
        block = block / shape.seq_len * shape.seq_len;  // whole sequences per block
      } else {
        // A sequence spans blocks: its ratio needs every block's logp first
        // (forward pass over all blocks), and the backward then recomputes logits.
        p->sequence_spans_blocks = true;
        p->schedule.recompute_logits = !options.forward_only;
      }
    }
    if (all_rows && p->rows > block) {
      p->sequence_spans_blocks = true;
      p->schedule.recompute_logits = !options.forward_only;
    }
    p->schedule.token_block = block;
    if (whole_block) p->forward_rows = round_up(block, kRowQuantum);
    p->block_rows_alloc = round_up(block, p->forward_rows);
    p->schedule.threads = 1;
    create_gemms(*p);
    p->layout = lay_out(*p);
    // Slots (concurrent tile tasks): one per thread, as many as the budget
    // holds beside everything else, at least one.
    const std::size_t base = p->layout.total - p->layout.slot_bytes;
    const std::size_t room = budget > base ? budget - base : 0;
    const auto fit_slots = static_cast<int>(std::min<std::size_t>(room / p->layout.slot_bytes, 1024));
    p->schedule.threads = std::max(1, std::min(threads, fit_slots));
    p->layout = lay_out(*p);
    p->schedule.workspace_bytes = p->layout.total;
    if (p->layout.total <= budget || options.token_block > 0 || forced != nullptr) break;
    const std::int64_t step = whole_block ? kRowQuantum : p->forward_rows;
    if (nb <= step) throw Error("options.workspace_budget", budget_error(budget, p->layout.total));
    nb -= step;
  }
  p->bindings.reset(p->gemms, p->schedule.threads);
  if (p->layout.total > budget) {
    throw Error("options.token_block", "token block " + std::to_string(nb) + " needs " +
                                           std::to_string(p->layout.total) + " bytes, over the workspace budget " +
                                           std::to_string(budget));
  }
  return p;
}

}  // namespace grpo::detail
