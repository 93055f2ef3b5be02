// The fused LM-head schedule. Per token block of `token_block` rows:
//   forward   tasks over vocab tiles: logits tile = hidden block x W tile (oneDNN,
//             single-threaded in the task), then the row-statistics stage on the
//             tile while it is in cache; the block buffer keeps x - max per tile.
//   merge     per row, tile statistics merged in tile order -> LSE, logp, entropy.
//   loss      the coefficient stage for the block's rows.
//   backward  tasks over vocab tiles: dlogits written in place over the block
//             buffer (active rows compacted to the top), dbias, then
//             dW tile (+)= dlogits tile^T x active hidden rows;
//             then tasks over hidden chunks: dhidden = dlogits x W chunk.
// Three GEMMs' worth of FLOPs: the logits are never recomputed unless
// sequence-level importance sampling has sequences that span blocks.
#include <cstring>
#include <string>

#include "api/validate.hpp"
#include "driver/lm_head_plan.hpp"
#include "driver/loss_accumulator.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"

namespace grpo::detail {

const char* const kEarlierBlocksWritten = "outputs of earlier token blocks were already written";

namespace {

struct Step {
  const LmHeadPlanData& p;
  const LmHeadInputs& in;
  const LmHeadOutputs& out;
  BindingPool::Lease bindings;
  const kernels::StageKernels& k = kernels::kernels();
  Temperature temp;
  std::size_t in_size;
  std::size_t store_size;
  std::size_t dl_size;
  bool vocab_major;

  // Workspace regions.
  std::byte* block;
  kernels::RowStats* tile_stats;
  float* target;
  float* lse;
  float* logp;
  float* entropy;
  float* coef;
  float* kl;
  std::int64_t* active;
  std::byte* stage;
  std::byte* hidden_act;
  float* dhidden_act;
  float* coef_all;
  std::byte* slots;
  LmHeadStepStats stats;

  Step(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::byte* ws)
      : p(plan), in(inputs), out(outputs), bindings(plan.bindings.acquire()), temp(plan.config) {
    in_size = size_of(p.shape.dtype);
    store_size = p.store_type == kernels::Elem::f32 ? 4 : 2;
    dl_size = size_of(p.dlogits_dtype);
    vocab_major = p.shape.layout == WeightLayout::vocab_major;
    const WorkspaceLayout& l = p.layout;
    const std::int64_t n = p.block_rows_alloc;
    block = ws + l.block;
    tile_stats = reinterpret_cast<kernels::RowStats*>(ws + l.tile_stats);
    target = reinterpret_cast<float*>(ws + l.rows);
    lse = target + n;
    logp = lse + n;
    entropy = logp + n;
    coef = entropy + n;
    kl = coef + n;
    active = reinterpret_cast<std::int64_t*>(kl + n);
    stage = ws + l.stage;
    hidden_act = ws + l.hidden_act;
    dhidden_act = reinterpret_cast<float*>(ws + l.dhidden_act);
    coef_all = reinterpret_cast<float*>(ws + l.coef_all);
    slots = ws + l.slots;
  }

  float* slot_tile(int slot) const { return reinterpret_cast<float*>(slots + slot * p.layout.slot_bytes); }
  void* slot_scratch(int slot) const { return slots + slot * p.layout.slot_bytes + p.layout.tile_bytes; }
  bool valid(std::int64_t row) const { return in.batch.mask[row] != 0.0F; }
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
    return block +
           (static_cast<std::size_t>(row) * static_cast<std::size_t>(p.shape.vocab) + static_cast<std::size_t>(col)) *
               elem;
  }

  // Logits, statistics, LSE, logp and entropy of rows [b0, b0 + nb). Every
  // logits GEMM call has exactly forward_rows rows (see kForwardRows): a
  // partial last chunk is copied to the stage buffer and zero-padded.
  void forward(std::int64_t b0, std::int64_t nb, bool keep) {
    const std::int64_t vt = p.schedule.vocab_tile;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t fr = p.forward_rows;
    const std::int64_t chunks = (nb + fr - 1) / fr;
    const std::int64_t partial = nb - (chunks - 1) * fr;  // rows of the last chunk
    const bool staged = partial != fr;
    if (staged) {
      const std::size_t row_bytes = static_cast<std::size_t>(p.shape.hidden_ld) * in_size;
      const std::byte* src = hidden_row(b0 + (chunks - 1) * fr);
      std::memcpy(stage, src, static_cast<std::size_t>(partial - 1) * row_bytes + p.shape.hidden * in_size);
      std::memset(stage + static_cast<std::size_t>(partial - 1) * row_bytes + p.shape.hidden * in_size, 0,
                  static_cast<std::size_t>(fr) * row_bytes - (static_cast<std::size_t>(partial - 1) * row_bytes +
                                                              static_cast<std::size_t>(p.shape.hidden) * in_size));
    }
    stats.logits_gemm_rows += chunks * fr;
    const std::size_t bias_size = in.bias.empty() ? 0 : size_of(in.bias.dtype);
    for_each_item(p.tiles, p.schedule.threads, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      float* tile = slot_tile(slot);
      const kernels::Gemm& gemm = *p.forward.pick(j == p.tiles - 1);
      const void* bias = in.bias.empty() ? nullptr : static_cast<const std::byte*>(in.bias.data) + c0 * bias_size;
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t r0 = c * fr;
        const bool last = c == chunks - 1;
        bindings.at(gemm, slot)
            .run(last && staged ? stage : hidden_row(b0 + r0), weight_at_vocab(c0), tile, bias, slot_scratch(slot));
        for (std::int64_t r = r0; r < (last ? nb : r0 + fr); ++r) {
          const float* z = tile + (r - r0) * cols;
          tile_stats[r * p.tiles + j] =
              keep ? k.row_stats_store(z, cols, temp.scale, block_at(r, c0, store_size), p.store_type)
                   : k.row_stats(z, kernels::Elem::f32, cols, temp.scale);
          const std::int64_t row = b0 + r;
          if (valid(row)) {
            const std::int64_t id = in.batch.ids[row];
            if (id >= c0 && id < c0 + cols) target[r] = z[id - c0] * temp.scale;
          }
        }
      }
    });
    for (std::int64_t r = 0; r < nb; ++r) {
      kernels::RowStats st;
      for (std::int64_t j = 0; j < p.tiles; ++j) st = kernels::merge(st, tile_stats[r * p.tiles + j]);
      const RowResult res = finish_row(st, target[r], valid(b0 + r), temp);
      check_row(res.lse, res.logp, valid(b0 + r), b0 + r, "hidden");
      lse[r] = res.lse;
      logp[r] = res.logp;
      entropy[r] = res.entropy;
    }
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

  // Gradients of rows [b0, b0 + nb) with coefficients c (block-relative).
  void backward(std::int64_t b0, std::int64_t nb, const float* c, bool* dweight_written) {
    const std::int64_t hidden = p.shape.hidden;
    const std::int64_t vocab = p.shape.vocab;
    const std::int64_t vt = p.schedule.vocab_tile;
    std::int64_t na = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (c[r] != 0.0F) active[na++] = r;  // exact zeros (masked, clipped, A = 0) drop out of both GEMMs
    }
    if (na == 0) {
      for (std::int64_t r = 0; r < nb; ++r) zero_dhidden_row(b0 + r);
      return;
    }
    const std::int64_t padded = (na + kRowQuantum - 1) / kRowQuantum * kRowQuantum;
    stats.backward_gemm_rows += padded;
    const std::size_t hidden_bytes = static_cast<std::size_t>(hidden) * in_size;
    for (std::int64_t i = 0; i < na; ++i) {
      std::memcpy(hidden_act + i * hidden_bytes, hidden_row(b0 + active[i]), hidden_bytes);
    }
    std::memset(hidden_act + na * hidden_bytes, 0, (padded - na) * hidden_bytes);
    const auto& dweight_gemms = p.dweight[padded / kRowQuantum - 1];
    const int accumulate = *dweight_written ? 1 : 0;
    const kernels::Elem dl_type = elem_of(p.dlogits_dtype);
    const std::size_t dw_size = size_of(p.options.dweight_dtype);
    float* dbias = out.dbias.empty() ? nullptr : out.dbias.data();

    for_each_item(p.tiles, p.schedule.threads, [&](std::int64_t j, int slot) {
      const std::int64_t c0 = j * vt;
      const std::int64_t cols = std::min(vt, vocab - c0);
      for (std::int64_t i = 0; i < na; ++i) {
        const std::int64_t r = active[i];
        const std::int64_t row = b0 + r;
        const std::int64_t tgt = valid(row) ? in.batch.ids[row] - c0 : -1;
        // Row i <= r: the compacted output never overwrites a stored row not yet read.
        k.dlogits_row(block_at(r, c0, store_size), p.store_type, cols, 1.0F, tile_stats[r * p.tiles + j].max, lse[r],
                      c[r] * temp.grad_scale, tgt, block_at(i, c0, dl_size), dl_type,
                      dbias != nullptr ? dbias + c0 : nullptr);
      }
      for (std::int64_t i = na; i < padded; ++i) std::memset(block_at(i, c0, dl_size), 0, cols * dl_size);
      const kernels::Gemm& gemm = *dweight_gemms.pick(j == p.tiles - 1)[accumulate];
      auto* dw = static_cast<std::byte*>(out.dweight.data) +
                 static_cast<std::size_t>(vocab_major ? c0 * p.shape.dweight_ld : c0) * dw_size;
      if (vocab_major) {
        bindings.at(gemm, slot).run(block_at(0, c0, dl_size), hidden_act, dw, nullptr, slot_scratch(slot));
      } else {
        bindings.at(gemm, slot).run(hidden_act, block_at(0, c0, dl_size), dw, nullptr, slot_scratch(slot));
      }
    });
    *dweight_written = true;

    const auto& dhidden_gemms = p.dhidden[padded / kRowQuantum - 1];
    for_each_item(p.hidden_chunks, p.schedule.threads, [&](std::int64_t chunk, int slot) {
      const std::int64_t h0 = chunk * kHiddenChunk;
      const kernels::Gemm& gemm = *dhidden_gemms.pick(chunk == p.hidden_chunks - 1);
      bindings.at(gemm, slot).run(block, weight_at_hidden(h0), dhidden_act + h0, nullptr, slot_scratch(slot));
    });

    std::int64_t i = 0;
    for (std::int64_t r = 0; r < nb; ++r) {
      if (i < na && active[i] == r) {
        auto* dst = static_cast<std::byte*>(out.dhidden.data) +
                    static_cast<std::size_t>((b0 + r) * out.dhidden.ld) * size_of(out.dhidden.dtype);
        const float* src = dhidden_act + i * hidden;
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
    const std::size_t elem = size_of(out.dweight.dtype);
    for (std::int64_t r = 0; r < out.dweight.rows; ++r) {
      std::memset(static_cast<std::byte*>(out.dweight.data) + static_cast<std::size_t>(r * out.dweight.ld) * elem, 0,
                  static_cast<std::size_t>(out.dweight.cols) * elem);
    }
  }
};

}  // namespace

void run_lm_head(const LmHeadPlanData& p, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                 std::byte* workspace, double max_abs_coef) {
  Step step(p, inputs, outputs, workspace);
  const bool backward = !p.options.forward_only;
  const std::int64_t nb = p.schedule.token_block;
  LossAccumulator acc(p.config, p.shape.batch, p.shape.seq_len, inputs.batch, max_abs_coef);
  bool dweight_written = p.options.accumulate_weight_grads;  // accumulate: always add
  // dbias is zeroed (overwrite mode) just before the first backward, after the
  // first coefficients: a refusal there leaves it untouched.
  bool dbias_ready = outputs.dbias.empty() || p.options.accumulate_weight_grads;
  auto backward_block = [&](std::int64_t b0, std::int64_t rows, const float* c) {
    if (!dbias_ready) std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
    dbias_ready = true;
    step.backward(b0, rows, c, &dweight_written);
  };

  if (!p.sequence_spans_blocks) {
    // A block's outputs are written only after its coefficients read every
    // per-token input of its rows (logp may be the very array old_logp is).
    for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, backward);
      try {
        acc.add_rows(b0, b0 + rows, step.logp, step.entropy, step.coef, step.kl);
      } catch (const Error& e) {
        // The one refusal that needs the policy's own logp (a k3 KL beyond
        // f32, see LossConfig::beta) is met block by block: say so when
        // earlier blocks' outputs exist. kl_clamp makes it impossible.
        if (b0 == 0) throw;
        throw Error(e.argument(), std::string(e.what()) + "; " + kEarlierBlocksWritten, e.kind());
      }
      step.write_token_outputs(b0, rows, step.logp, step.entropy, step.kl);
      if (backward) backward_block(b0, rows, step.coef);
    }
  } else {
    // Sequence-level ratios of sequences longer than a block: a first forward
    // pass for every logp, then the coefficients, then (with gradients) the
    // logits again, block by block, and the backward. Nothing is written
    // before the coefficients have read every per-token input.
    float* entropy_all = step.coef_all + p.rows;
    float* logp_all = entropy_all + p.rows;
    float* kl_all = logp_all + p.rows;
    for (std::int64_t b0 = 0; b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, false);
      std::memcpy(logp_all + b0, step.logp, static_cast<std::size_t>(rows) * sizeof(float));
      std::memcpy(entropy_all + b0, step.entropy, static_cast<std::size_t>(rows) * sizeof(float));
    }
    acc.add_rows(0, p.rows, logp_all, entropy_all, step.coef_all, kl_all);
    step.write_token_outputs(0, p.rows, logp_all, entropy_all, kl_all);
    for (std::int64_t b0 = 0; backward && b0 < p.rows; b0 += nb) {
      const std::int64_t rows = std::min(nb, p.rows - b0);
      step.forward(b0, rows, true);
      backward_block(b0, rows, step.coef_all + b0);
    }
  }
  if (backward && !dbias_ready) std::fill(outputs.dbias.begin(), outputs.dbias.end(), 0.0F);
  if (backward && !dweight_written) step.zero_dweight();  // every row inactive, overwrite mode
  if (outputs.metrics != nullptr) *outputs.metrics = acc.metrics();
  if (outputs.stats != nullptr) *outputs.stats = step.stats;
}

}  // namespace grpo::detail
