// The fused LM-head GRPO kernel: hidden x W -> log-sum-exp -> loss and its
// gradients, streaming over vocabulary tiles; the [N, V] logits never exist.
//
//   grpo::LmHeadShape shape{.batch = 1, .seq_len = 8192, .hidden = 4096,
//                           .vocab = 151936, .dtype = grpo::DType::bf16};
//   grpo::LmHeadLossPlan plan(shape, config);          // validates, creates oneDNN primitives
//   std::span<std::byte> ws = ...;  // >= plan.workspace_size() bytes, 64-byte aligned; or {} to let execute allocate
//   plan.execute({hidden, weight, {}, batch},
//                {.tokens = {logp}, .dhidden = dh, .dweight = dw, .metrics = &m},
//                ws);
//
// Ownership: views are borrowed for the duration of the call only.
// Thread safety: a plan is immutable after construction; concurrent execute()
// calls on one plan need distinct workspaces (or none) and distinct outputs.
// Threads: execute() runs in the caller's tbb::task_arena, uses at most
// LmHeadOptions::max_threads of them, and runs every oneDNN call
// single-threaded inside its task, so oneDNN's OpenMP runtime never adds
// threads of its own. Results are bitwise identical for any thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "grpo/communicator.hpp"
#include "grpo/logits_loss.hpp"
#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"

namespace grpo {

enum class WeightLayout : std::uint8_t {
  vocab_major,   // [V, H], PyTorch / HF lm_head.weight
  hidden_major,  // [H, V], JAX / Flax kernel
};

const char* to_string(WeightLayout layout);

struct LmHeadShape {
  std::int64_t batch = 0;    // B
  std::int64_t seq_len = 0;  // T; N = B * T token rows
  std::int64_t hidden = 0;   // H
  std::int64_t vocab = 0;    // V
  DType dtype = DType::f32;  // of hidden and weight; bf16 GEMMs accumulate in f32
  WeightLayout layout = WeightLayout::vocab_major;
  bool has_bias = false;  // bias [V]
  DType bias_dtype = DType::f32;
  // Row strides (elements) of the views execute() will get; 0 = dense. They are
  // part of the plan because the oneDNN primitives are created for them.
  std::int64_t hidden_ld = 0;
  std::int64_t weight_ld = 0;
  std::int64_t dweight_ld = 0;
  // Vocabulary parallelism (ScaleOut::vocab_group, grpo/communicator.hpp):
  // this rank's W (and bias, dweight, dbias) hold tokens [vocab_offset,
  // vocab_offset + vocab) of a vocabulary of global_vocab tokens (rows of a
  // vocab-major W, columns of a hidden-major one: a view with weight_ld =
  // global_vocab); ids stay global. 0 / 0 = unsharded.
  std::int64_t vocab_offset = 0;
  std::int64_t global_vocab = 0;
};

// LmHeadOptions::grad_filter's automatic threshold: the machine epsilon of the
// weight's dtype / 32 (2^-12 for bf16, 2^-28 for f32), as Cut Cross-Entropy.
inline constexpr double kGradFilterAuto = -1.0;

// LmHeadOptions::workspace_budget's default. A plan of the whole vocabulary
// takes kDefaultWorkspaceBudget: token blocks long enough for the backward
// GEMMs to reach their speed at a 151936-token vocabulary (1600 rows at H =
// 4096: 595 MB at the headline, on a Zen 4 2-3% faster than 256 MiB's 640
// rows, docs/benchmarks.md). A vocab shard (shape.global_vocab > vocab) takes
// the shard's share, vocab / global_vocab of it, and at least
// kMinAutoWorkspaceBudget: about the same token block in its share of the
// bytes, so P shards hold about one process's workspace between them. An
// explicit budget is the process's own, sharded or not.
inline constexpr std::size_t kWorkspaceBudgetAuto = 0;
inline constexpr std::size_t kDefaultWorkspaceBudget = std::size_t{640} << 20;
inline constexpr std::size_t kMinAutoWorkspaceBudget = std::size_t{64} << 20;

struct LmHeadOptions {
  // 0 = chosen by the plan from the workspace budget; otherwise rows per
  // token block (rounded to the GEMM row quantum) / columns per vocab tile.
  std::int64_t token_block = 0;
  std::int64_t vocab_tile = 0;
  // Upper bound on the workspace, whatever N is; kWorkspaceBudgetAuto (the
  // default): kDefaultWorkspaceBudget for the whole vocabulary, a vocab
  // shard's share of it (see kDefaultWorkspaceBudget).
  std::size_t workspace_budget = kWorkspaceBudgetAuto;
  int max_threads = 0;  // 0 = the current task_arena's concurrency
  bool forward_only = false;
  DType dweight_dtype = DType::f32;
  DType dhidden_dtype = DType::f32;
  // false: dweight / dbias are overwritten; true: the step adds into them.
  bool accumulate_weight_grads = false;
  // true: the weight (and bias) is frozen, as in LoRA training: the backward
  // computes dhidden alone, dweight and dbias must be empty, and the dW GEMMs
  // (half of the backward's FLOPs) are not run. dhidden is bitwise the one a
  // plan without this option computes.
  bool frozen_weight = false;
  // The filtered backward (docs/filtered_backward.md): 0 = off, every gradient
  // exact; kGradFilterAuto; or a threshold eps > 0. Per token block, the
  // vocabulary columns in which every active row's dlogits entry is below eps
  // times the row's coefficient in magnitude (|g_tv| < eps (|a_t| + |b_t|) s,
  // see the page) are left out of the dW and dhidden GEMMs; their sum comes
  // back through a rank-8 correction, the kept entries carry their bf16
  // remainders, nearly uniform rows get a dhidden over every column. loss,
  // logp, entropy, KL, metrics and dbias stay bitwise the unfiltered ones. A
  // block keeping more columns than it has room for (half of V; with bf16
  // dlogits V / 32, at least 4096) runs unfiltered.
  double grad_filter = 0.0;
  Allocator* allocator = nullptr;  // nullptr = default_allocator()
  // Several processes (grpo/communicator.hpp); none = this process alone.
  // Not offered with accumulate_weight_grads under data parallelism (the
  // group sum would add every rank's earlier dweight again).
  ScaleOut scale_out;
};

struct LmHeadInputs {
  MatrixView hidden;  // [N, H]
  MatrixView weight;  // [V, H] or [H, V] per LmHeadShape::layout
  VectorView bias;    // [V] or empty
  BatchInputs batch;
  // Multiplies every gradient this call writes (dhidden, dweight, dbias; not
  // the loss, metrics or per-token outputs), applied to the per-row
  // coefficients before the backward GEMMs: the upstream dTotal/dLoss, or a
  // normalizer kept out of the plan (dapo's num_items_in_batch, which changes
  // every step: a plan built with num_items_in_batch = 1 and grad_scale =
  // 1 / num_items serves them all). No pass over dW follows the kernel. Finite;
  // 1 = bitwise the unscaled step.
  double grad_scale = 1.0;
};

// What a step executed, for FLOP accounting (a benchmark's executed GFLOP/s):
// rows that went through the logits GEMM (N per pass over the blocks; 2N when
// the plan recomputes logits), through the dhidden GEMM and through the dW
// GEMM (the same rows, or none with frozen_weight), zero padding included
// (the backward pads a block's active rows to a multiple of 32, and past 512
// rows (oneDNN's GEMMs) or 4096 (ours, e.g. AMX bf16) by under 1/8 or 1/64 of
// them: the plan holds one GEMM per padded row count), rows with a zero
// coefficient excluded. Each row costs 2 * V * H FLOPs per GEMM.
struct LmHeadStepStats {
  std::int64_t logits_gemm_rows = 0;
  std::int64_t dhidden_gemm_rows = 0;
  std::int64_t dweight_gemm_rows = 0;
  // Bytes the schedule itself moves to or from memory (a roofline's byte
  // count, caches assumed to hold nothing bigger than a GEMM's own blocks):
  // W read by every forward call and once per block by dhidden, the block's
  // stored logits written and read back as dlogits, dlogits read by the dW
  // GEMM and by every dhidden chunk, dW read (accumulating) and written per
  // block. Inputs and outputs of size N x H are left out (small beside these).
  double schedule_bytes = 0.0;
  // Rows with a nonzero upstream coefficient (the backward GEMMs' rows before
  // the padding), summed over the passes.
  std::int64_t active_rows = 0;
  // Where the time went, in thread-seconds summed over the threads (a
  // steady_clock pair around each piece of work inside the tasks):
  //   forward_gemm_s   the logits GEMM calls (forward, and any recompute)
  //   forward_stage_s  the row statistics over each logits tile (+ the softcap pass)
  //   dlogits_s        the dlogits rows (+ dbias) before each dW GEMM
  //   dweight_gemm_s   the dW GEMM calls; dhidden_gemm_s the dhidden GEMM calls
  // The rest of the wall time (loss coefficients, gathers, copies, waits at
  // the end of each parallel loop) is the step time minus these / threads.
  // Under LmHeadOptions::grad_filter: rows x vocab columns of the dhidden /
  // dW GEMMs the filter left out (2 H FLOPs each), summed over the blocks
  // (the GEMM rows above times V is what they would run unfiltered). 0 without it.
  std::int64_t dhidden_skipped_row_columns = 0;
  std::int64_t dweight_skipped_row_columns = 0;
  // grad_filter = auto: the token blocks whose left-out entries the guard
  // found too large beside the exact step's own error (docs/filtered_backward.md),
  // run through the exact GEMMs instead.
  std::int64_t filter_guard_blocks = 0;
  // ... and those it let run filtered at a lower threshold (eps / 4^r, r = 1..5).
  std::int64_t filter_lowered_blocks = 0;
  // f16 gradients (dhidden / dweight of DType::f16): entries written as
  // +-65504, the largest finite f16, where the f32 value would round to an
  // infinity (docs/semantics.md, "fp16"). 0 for other dtypes.
  std::int64_t f16_saturated = 0;
  double forward_gemm_s = 0.0;
  double forward_stage_s = 0.0;
  double dlogits_s = 0.0;
  double dweight_gemm_s = 0.0;
  double dhidden_gemm_s = 0.0;
};

struct LmHeadOutputs {
  TokenOutputs tokens;
  MutMatrixView dhidden;   // [N, H], dtype = options.dhidden_dtype; empty when forward_only
  MutMatrixView dweight;   // weight's layout, dtype = options.dweight_dtype; empty when forward_only / frozen_weight
  std::span<float> dbias;  // [V] when has_bias and neither forward_only nor frozen_weight
  Metrics* metrics = nullptr;
  LmHeadStepStats* stats = nullptr;  // optional
};

// The schedule a plan chose (see LmHeadLossPlan::describe()).
struct LmHeadSchedule {
  std::int64_t token_block = 0;
  std::int64_t vocab_tile = 0;
  // Tile tasks that run at once, each with its own GEMM tile and scratchpad
  // in the workspace: the thread cap, or fewer when the budget holds fewer.
  int slots = 0;
  bool recompute_logits = false;  // sequence-level IS whose sequences span blocks
  std::size_t workspace_bytes = 0;
  // The plan's own memory, beside the workspace: its GEMM objects (oneDNN
  // primitives with their JIT code, or our backends' objects) and one set of
  // per-call GEMM bindings. gemm_count is exact; plan_bytes is an estimate:
  // the larger of the process's heap growth and anonymous resident growth
  // while the plan created them, so another thread's allocations at that
  // moment count too, and a oneDNN primitive already in oneDNN's process-wide
  // cache (a plan of the same shapes) counts only for the plan that made it.
  // Each execute() running beside another adds one more binding set.
  // workspace_bytes (workspace_size()) stays the caller-provided workspace
  // alone: plan memory is held for the plan's life, not lent per call.
  std::size_t gemm_count = 0;
  std::size_t plan_bytes = 0;
};

class LmHeadLossPlan {
 public:
  LmHeadLossPlan(const LmHeadShape& shape, const LossConfig& config, const LmHeadOptions& options = {});
  ~LmHeadLossPlan();
  LmHeadLossPlan(LmHeadLossPlan&&) noexcept;
  LmHeadLossPlan& operator=(LmHeadLossPlan&&) noexcept;

  std::size_t workspace_size() const;
  const LmHeadSchedule& schedule() const;
  // One line: token block, vocab tile, slots (printed as threads=), GEMM passes, workspace bytes,
  // the plan's own bytes and GEMM count.
  std::string describe() const;

  // Validates every argument (shapes, ids, finiteness), then computes.
  // workspace: empty = allocated through options.allocator for this call;
  // otherwise at least workspace_size() bytes, 64-byte aligned.
  void execute(const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::span<std::byte> workspace = {}) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo
