// Plan building for the fused LM head: token block and vocab tile from the
// workspace budget, the oneDNN GEMMs for every shape the schedule produces,
// and the workspace layout.
#include <algorithm>
#include <string>

#include "driver/lm_head_plan.hpp"
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
  return g;
}

// dweight tile from dlogits tile [k, cols] (ld V) and active hidden [k, H].
GemmSpec dweight_spec(const LmHeadShape& s, DType dl_dtype, DType dw_dtype, std::int64_t k, std::int64_t cols,
                      bool accumulate) {
  GemmSpec g;
  if (vocab_major(s)) {  // dW[tile] [cols, H] = dl^T [cols, k] x h [k, H]
    g.a = {dl_dtype, cols, k, 1, s.vocab};
    g.b = {s.dtype, k, s.hidden, s.hidden, 1};
    g.c = {dw_dtype, cols, s.hidden, s.dweight_ld, 1};
  } else {  // dW^T[:, tile] [H, cols] = h^T [H, k] x dl [k, cols]
    g.a = {s.dtype, s.hidden, k, 1, s.hidden};
    g.b = {dl_dtype, k, cols, s.vocab, 1};
    g.c = {dw_dtype, s.hidden, cols, s.dweight_ld, 1};
  }
  g.accumulate = accumulate;
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

WorkspaceLayout lay_out(const LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const auto rows = static_cast<std::size_t>(p.block_rows_alloc);
  const std::size_t in_size = size_of(s.dtype);
  const std::size_t store_size = p.store_type == kernels::Elem::f32 ? 4 : 2;
  const bool backward = !p.options.forward_only;
  WorkspaceLayout l;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  l.block = take(backward ? rows * static_cast<std::size_t>(s.vocab) * store_size : 0);
  l.tile_stats = take(rows * static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats));
  l.rows = take(rows * (5 * sizeof(float) + sizeof(std::int64_t)));
  l.hidden_act = take(backward ? rows * static_cast<std::size_t>(s.hidden) * in_size : 0);
  l.dhidden_act = take(backward ? rows * static_cast<std::size_t>(s.hidden) * sizeof(float) : 0);
  l.coef_all = take(p.sequence_spans_blocks ? 2 * static_cast<std::size_t>(p.rows) * sizeof(float) : 0);
  l.tile_bytes = align_up(rows * static_cast<std::size_t>(p.schedule.vocab_tile) * sizeof(float));
  l.slot_bytes = l.tile_bytes + align_up(p.max_scratchpad);
  l.slots = take(l.slot_bytes * static_cast<std::size_t>(p.schedule.threads));
  l.total = at;
  return l;
}

void create_gemms(LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const std::int64_t nb = p.schedule.token_block;
  const std::int64_t vt = p.schedule.vocab_tile;
  const std::int64_t last_block = p.rows - (p.rows - 1) / nb * nb;
  const std::int64_t last_tile = s.vocab - (p.tiles - 1) * vt;
  const kernels::GemmEngine& e = *p.engine;
  std::size_t scratch = 0;
  auto make = [&](const GemmSpec& spec) {
    auto g = std::make_unique<Gemm>(e, spec);
    scratch = std::max(scratch, g->scratchpad_bytes());
    return g;
  };
  for (int b = 0; b < 2; ++b) {
    const std::int64_t rows = b ? last_block : nb;
    auto& slot = b ? p.forward.last : p.forward.full;
    slot.full = make(forward_spec(s, rows, vt, vt));
    slot.last = make(forward_spec(s, rows, last_tile, last_tile));
  }
  p.dweight.clear();
  p.dhidden.clear();
  if (!p.options.forward_only) {
    const std::int64_t last_chunk = s.hidden - (p.hidden_chunks - 1) * kHiddenChunk;
    const std::int64_t chunk = std::min(kHiddenChunk, s.hidden);
    for (std::int64_t k = kRowQuantum; k <= p.block_rows_alloc; k += kRowQuantum) {
      auto& dw = p.dweight.emplace_back();
      for (int acc = 0; acc < 2; ++acc) {
        dw.full[acc] = make(dweight_spec(s, p.dlogits_dtype, p.options.dweight_dtype, k, vt, acc == 1));
        dw.last[acc] = make(dweight_spec(s, p.dlogits_dtype, p.options.dweight_dtype, k, last_tile, acc == 1));
      }
      auto& dh = p.dhidden.emplace_back();
      dh.full = make(dhidden_spec(s, p.dlogits_dtype, k, chunk));
      dh.last = make(dhidden_spec(s, p.dlogits_dtype, k, last_chunk));
    }
  }
  p.max_scratchpad = scratch;
}

// Bytes per block row, to size the block from the budget before the GEMMs exist.
std::size_t bytes_per_row(const LmHeadPlanData& p) {
  const LmHeadShape& s = p.shape;
  const std::size_t store_size = p.store_type == kernels::Elem::f32 ? 4 : 2;
  std::size_t b = static_cast<std::size_t>(p.tiles) * sizeof(kernels::RowStats) + 5 * sizeof(float) + 8 +
                  static_cast<std::size_t>(p.schedule.vocab_tile) * sizeof(float) * p.schedule.threads;
  if (!p.options.forward_only) {
    b += static_cast<std::size_t>(s.vocab) * store_size +
         static_cast<std::size_t>(s.hidden) * (size_of(s.dtype) + sizeof(float));
  }
  return b;
}

}  // namespace

std::unique_ptr<LmHeadPlanData> build_lm_head_plan(const LmHeadShape& shape, const LossConfig& config,
                                                   const LmHeadOptions& options) {
  auto p = std::make_unique<LmHeadPlanData>();
  p->shape = shape;  // strides already resolved by the caller
  p->config = config;
  p->options = options;
  p->rows = shape.batch * shape.seq_len;
  p->schedule.threads = resolve_threads(options.max_threads);
  p->schedule.vocab_tile = std::min(options.vocab_tile > 0 ? options.vocab_tile : kDefaultVocabTile, shape.vocab);
  p->tiles = (shape.vocab + p->schedule.vocab_tile - 1) / p->schedule.vocab_tile;
  p->hidden_chunks = (shape.hidden + kHiddenChunk - 1) / kHiddenChunk;
  // bf16 GEMMs: the block keeps x - max in f16 (see row_stats_store) and takes
  // the bf16 dlogits in place; f32 GEMMs keep f32 throughout.
  p->store_type = shape.dtype == DType::bf16 ? kernels::Elem::f16 : kernels::Elem::f32;
  p->dlogits_dtype = shape.dtype;
  p->engine = std::make_unique<kernels::GemmEngine>();

  const bool sequence = config.importance_sampling_level == IsLevel::sequence;
  const std::size_t budget = options.workspace_budget;
  const std::int64_t cap = options.forward_only ? std::min(kMaxForwardOnlyBlock, p->rows) : p->rows;
  std::int64_t nb = options.token_block > 0 ? std::min(options.token_block, p->rows) : 0;
  if (nb == 0) {
    // Leave 1/16 of the budget for oneDNN scratchpads and alignment; checked exactly below.
    const std::size_t usable = budget - budget / 16;
    const auto fit = static_cast<std::int64_t>(usable / bytes_per_row(*p));
    nb = std::min(cap, fit / kRowQuantum * kRowQuantum);
    if (nb <= 0) nb = std::min<std::int64_t>(cap, kRowQuantum);
  }
  for (;;) {
    std::int64_t block = nb;
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
    p->schedule.token_block = block;
    p->block_rows_alloc = round_up(block, kRowQuantum);
    create_gemms(*p);
    p->layout = lay_out(*p);
    p->schedule.workspace_bytes = p->layout.total;
    if (p->layout.total <= budget || options.token_block > 0) break;
    if (nb <= kRowQuantum) {
      throw Error("options.workspace_budget", std::to_string(budget) + " bytes cannot hold one " +
                                                  std::to_string(kRowQuantum) + "-row block at this vocabulary; need " +
                                                  std::to_string(p->layout.total));
    }
    nb -= kRowQuantum;
  }
  if (p->layout.total > budget) {
    throw Error("options.token_block", "token block " + std::to_string(nb) + " needs " +
                                           std::to_string(p->layout.total) + " bytes, over the workspace budget " +
                                           std::to_string(budget));
  }
  return p;
}

}  // namespace grpo::detail
