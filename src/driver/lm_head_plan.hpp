// What an LM-head plan holds: the schedule (token block, vocab tile, hidden
// chunk, slots), the oneDNN GEMMs for every block/tile shape the schedule
// produces, and the workspace layout. Built once by build_lm_head_plan();
// read-only afterwards.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "driver/scale_out.hpp"
#include "driver/workspace_registry.hpp"
#include "grpo/lm_head_loss.hpp"
#include "kernels/gemm.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

// Active rows of a block are padded with zero rows to a rung of the plan's
// RowLadder (below), every rung a multiple of this. Zero rows add exact zeros.
// 32 = two AVX-512 rows of 16 f32 lanes, the M blocking of oneDNN's avx512
// kernels.
inline constexpr std::int64_t kRowQuantum = 32;
// Rungs per doubling of the backward GEMMs' row ladder (RowLadder). oneDNN:
// a matmul primitive with its JIT code and its two slots' bindings measured
// ~57 KiB at H = 8, V = 16 (13142 of them held 726 MiB after one call at
// T = 70000, f32), so 8 rungs: every multiple of 32 up to 512 rows (the f32
// headline block, 320 rows, pads as before), padding under 1/8 past 256.
// Our backends (GemmTraits::m_independent): ~0.5 KiB an object and ~0.14 KiB
// a binding, so 64 rungs: every multiple of 32 up to 4096 (the bf16 headline
// block, 640), padding under 1/64 past 2048.
inline constexpr std::int64_t kLadderRungsOnednn = 8;
inline constexpr std::int64_t kLadderRungsOwn = 64;
// Columns of dhidden per backward task: 4096 / 256 = 16 tasks at the headline
// shape, enough to balance 2-8 threads; each is a K = V GEMM that streams its
// column slice of W once (measured 760-830 GFLOP/s bf16 on 2 cores).
inline constexpr std::int64_t kHiddenChunk = 256;
// Default vocab tile: a [forward_rows, 2048] f32 GEMM tile (1.25 MiB at 160
// rows) is consumed by the row-statistics stage while still in L2.
inline constexpr std::int64_t kDefaultVocabTile = 2048;
// Rows of every forward (logits) GEMM call. oneDNN's bf16 brgemm picks its K
// blocking from M (measured on AMX: rows computed in a 7-row and a 608-row
// call differ in ~80% of their logits), so a row's logits, and so its logp and
// entropy, would depend on the batch it came in. Every forward call therefore
// has exactly forward_rows rows (a partial chunk is staged and zero-padded),
// and forward_rows depends on the shape, options and budget, never on N.
// (A backend whose rows do not depend on M takes a shorter last block in
// calls of its own rows: ForwardPlan::tail.)
// 160 = 5 x kRowQuantum: single-thread bf16 AMX brgemm with K = 4096 over a
// 2048-column tile measured 348 / 508 / 622 / 665 / 588 GFLOP/s at M = 32 / 64 /
// 128 / 160 / 640, and f32 83 / 150 / 165 / 175 / 176.
inline constexpr std::int64_t kForwardRows = 160;
// Share of the workspace budget the per-slot GEMM tiles and scratchpads may
// take; the token block is sized from the rest. Fixing the split (rather
// than sizing the block after the slots) keeps the token block, and so the
// order of every reduction, independent of the thread count. A sixth: two
// slots of our AMX backend at the headline (a 640-row logits tile and the
// GEMMs' packing scratch, 22 MiB each) fit in it at a 256 MiB budget.
inline constexpr std::size_t kSlotBudgetDivisor = 6;

// The padded row counts a block's backward GEMMs are created for (one GEMM
// shape per rung), in one place for the plan (create_gemms) and the step
// (LmHeadStep::backward): every multiple of kRowQuantum up to 2 * kRowQuantum
// * rungs, then `rungs` per doubling, each a multiple of kRowQuantum, the last
// exactly top (the block's allocated rows, a multiple of kRowQuantum). Past
// kRowQuantum * rungs active rows, padded(active) < active * (1 + 1 / rungs)
// (a step is bit_floor(rung) / rungs). So a plan holds O(rungs * log(block))
// backward GEMMs, not block / 32 of them. Depends on the block and the
// backends alone, never on the thread count.
class RowLadder {
 public:
  RowLadder() = default;
  // rungs: a power of two.
  RowLadder(std::int64_t top, std::int64_t rungs) {
    for (std::int64_t r = kRowQuantum; r < top;) {
      rows_.push_back(r);
      r += std::max(kRowQuantum, static_cast<std::int64_t>(std::bit_floor(static_cast<std::uint64_t>(r))) / rungs);
    }
    rows_.push_back(top);
  }
  const std::vector<std::int64_t>& entries() const { return rows_; }
  // The rung for `active` rows (1 <= active <= top): the smallest entry >= active.
  std::size_t index_of(std::int64_t active) const {
    return static_cast<std::size_t>(std::lower_bound(rows_.begin(), rows_.end(), active) - rows_.begin());
  }
  // active rounded up to its rung (0 stays 0: no GEMM runs).
  std::int64_t padded(std::int64_t active) const { return active == 0 ? 0 : rows_[index_of(active)]; }

 private:
  std::vector<std::int64_t> rows_;
};

// v rounded up to a multiple of q.
inline std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }

// `rows` (a multiple of kRowQuantum) in equal calls of at most `cap` rows
// (0: one call): how many calls, and the rows of each (a multiple of
// kRowQuantum; the last call's are padded when the calls do not divide them).
inline std::int64_t calls_of(std::int64_t rows, std::int64_t cap) { return cap > 0 ? (rows + cap - 1) / cap : 1; }
inline std::int64_t rows_per_call(std::int64_t rows, std::int64_t cap) {
  const std::int64_t calls = calls_of(rows, cap);
  return round_up((rows + calls - 1) / calls, kRowQuantum);
}

// A value with a "full" and a "remainder" variant (last block, last tile, last chunk).
template <class T>
struct FullAndLast {
  T full;
  T last;
  const T& pick(bool is_last) const { return is_last ? last : full; }
};

// Sets of GemmBindings (one per GEMM of the plan and slot), one set per
// concurrent execute(): a call takes a set and gives it back, so execute
// allocates none after the first call (and none while no more calls run at
// once than ever before). Thread-safe.
class BindingPool {
 public:
  using Set = std::vector<kernels::GemmBinding>;  // [gemm index * slots + slot]

  // Returns its set to the pool when destroyed.
  class Lease {
   public:
    Lease(BindingPool& pool, std::unique_ptr<Set> set) : pool_(&pool), set_(std::move(set)) {}
    ~Lease() {
      if (set_) pool_->give_back(std::move(set_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    const kernels::GemmBinding& at(const kernels::Gemm& gemm, int slot) const {
      return (*set_)[gemm.index() * static_cast<std::size_t>(pool_->slots_) + static_cast<std::size_t>(slot)];
    }

   private:
    BindingPool* pool_;
    std::unique_ptr<Set> set_;
  };

  void reset(std::vector<const kernels::Gemm*> gemms, int slots) {
    const std::lock_guard<std::mutex> lock(mutex_);
    gemms_ = std::move(gemms);
    slots_ = slots;
    free_.clear();
  }
  Lease acquire();

 private:
  void give_back(std::unique_ptr<Set> set);

  std::mutex mutex_;
  std::vector<const kernels::Gemm*> gemms_;  // by index
  int slots_ = 1;
  std::vector<std::unique_ptr<Set>> free_;
};

// The forward pass's GEMMs (ForwardPass, lm_head_forward.cpp).
struct ForwardPlan {
  // The logits tile: [forward_rows] x [tile or last tile].
  FullAndLast<std::unique_ptr<kernels::Gemm>> gemms;
  // The last token block's, when it is shorter than the others and the
  // forward calls' rows do not depend on M (ours, GemmTraits::m_independent:
  // the same bits): [tail_rows] x [tile or last tile], in as many calls as a
  // block's at most, for the last block's tail_block rows (rounded up to
  // kRowQuantum). Null otherwise (the last block is zero-padded to forward_rows).
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail;
  std::int64_t tail_rows = 0;
  std::int64_t tail_block = 0;
};

// The dense backward's GEMMs (DenseBackward, lm_head_backward.cpp), indexed
// by row_ladder.index_of(padded active rows).
struct DenseBackwardPlan {
  // dweight tile: [tile kind][overwrite=0 / accumulate=1].
  std::vector<FullAndLast<std::array<std::unique_ptr<kernels::Gemm>, 2>>> dweight;
  // dhidden chunk: [chunk kind].
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> dhidden;
};

// The filtered backward's plan (filter_plan.hpp).
struct FilterPlan;

// The plan's common core (shape, schedule, workspace layout, bindings) and
// one plan per phase.
struct LmHeadPlanData {
  LmHeadPlanData();
  ~LmHeadPlanData();
  LmHeadPlanData(const LmHeadPlanData&) = delete;
  LmHeadPlanData& operator=(const LmHeadPlanData&) = delete;

  LmHeadShape shape;
  LossConfig config;
  LmHeadOptions options;
  LmHeadSchedule schedule;
  std::int64_t rows = 0;              // N
  std::int64_t forward_rows = 0;      // rows of every forward GEMM call (see kForwardRows)
  std::int64_t block_rows_alloc = 0;  // token_block rounded up to forward_rows
  std::int64_t tiles = 0;             // ceil(V / vocab_tile)
  std::int64_t hidden_chunk = 0;      // dhidden columns per task (see build_lm_head_plan)
  std::int64_t hidden_chunks = 0;     // ceil(H / hidden_chunk)
  // The two-pass schedule: the coefficients need rows of more than one block
  // (sequence-level IS or another whole-sequence term with sequences longer
  // than a block, or a top-entropy mask over more rows than a block), so a
  // forward pass over every block comes before any coefficient, and the
  // backward recomputes the logits (schedule.recompute_logits).
  bool two_pass = false;
  bool entropy_bonus = false;                     // config.entropy_coef != 0: per-row dLoss/dEnt arrays
  kernels::Elem store_type = kernels::Elem::f32;  // block buffer before backward
  DType dlogits_dtype = DType::f32;               // block buffer during backward (= GEMM dtype)
  WorkspaceLayout layout;                         // booked by book_workspace (lm_head_schedule.cpp)
  // The threads the plan was made for (options.max_threads, capped by the
  // arena): schedule.slots is fewer when the budget holds fewer (describe()
  // says so).
  int threads = 1;
  std::unique_ptr<kernels::GemmEngine> engine;
  // The backward GEMMs' padded rows (both strategies' GEMMs are indexed by its rungs).
  RowLadder row_ladder;
  // One plan per phase, each with its own GEMMs (and workspace regions,
  // booked by book_workspace): the forward pass, the dense backward, and the
  // filtered backward when LmHeadOptions::grad_filter chose it (null: the
  // dense backward runs every block).
  ForwardPlan forward;
  DenseBackwardPlan backward;
  std::unique_ptr<FilterPlan> filter;
  std::size_t max_scratchpad = 0;
  // Bytes of the packed hidden rows: every forward chunk of a block, or the
  // block's active rows for dW, whichever is more (0: the backend packs nothing).
  std::size_t packed_hidden_bytes = 0;
  // Several processes (grpo/communicator.hpp); null = this process alone.
  std::shared_ptr<const ScaleOutPlan> scale_out;
  // Every GEMM above, by Gemm::index(); bindings for them, per concurrent call.
  std::vector<const kernels::Gemm*> gemms;
  mutable BindingPool bindings;
};

// dW's tile of vocab columns [c0, c0 + cols), for either weight layout, in
// one place: the GEMM that writes it, where it starts, which operand is which.
//   vocab-major   dW[c0.., :] [cols, H] = dlogits^T [cols, k] x hidden [k, H]
//   hidden-major  dW[:, c0..] [H, cols] = hidden^T [H, k] x dlogits [k, cols]
// dlogits: the tile's columns of the block buffer (ld V); hidden: the active
// hidden rows (ld hidden_ld, the stride the generic head's backward also
// feeds to the forward GEMM, which was created for it).
struct DweightTile {
  const LmHeadShape& shape;

  bool vocab_major() const { return shape.layout == WeightLayout::vocab_major; }
  kernels::GemmSpec spec(DType dlogits, DType dweight, std::int64_t k, std::int64_t cols, bool accumulate) const;
  // Elements from dW's first element to the tile's.
  std::size_t offset(std::int64_t c0) const {
    return static_cast<std::size_t>(vocab_major() ? c0 * shape.dweight_ld : c0);
  }
  // The GEMM's A and B operands.
  std::array<const void*, 2> operands(const void* dlogits, const void* hidden) const {
    if (vocab_major()) return {dlogits, hidden};
    return {hidden, dlogits};
  }
};

// Builds a plan's GEMMs (lm_head_schedule.cpp): each indexed for the plan's
// bindings, the largest scratchpad any of them asks (with its shared operand
// packed) kept for the slots. Or, sizing (build false), builds none and asks
// kernels::gemm_sizes what each would need: the planner's block search sizes
// every try that way and builds the GEMMs once, for the block it chose.
class GemmFactory {
 public:
  GemmFactory(LmHeadPlanData& plan, bool build) : plan_(plan), build_(build) {}
  // The GEMM of spec (null when sizing); sizes, when given, gets what it
  // needs (the same built or not).
  std::unique_ptr<kernels::Gemm> make(const kernels::GemmSpec& spec, kernels::GemmSizes* sizes = nullptr);
  std::size_t max_scratchpad() const { return scratch_; }

 private:
  LmHeadPlanData& plan_;
  bool build_ = true;
  std::size_t scratch_ = 0;
};

// The forward logits tile: hidden block [rows, H] x W^T tile [H, cols] -> f32
// [rows, cols] (ld tile_ld) (lm_head_forward.cpp).
kernels::GemmSpec forward_spec(const LmHeadShape& s, std::int64_t rows, std::int64_t cols, std::int64_t tile_ld);
// dhidden chunk: dl [k, V] (ld V) x W[:, chunk] [V, cols] -> f32 [k, cols] (ld H) (lm_head_backward.cpp).
kernels::GemmSpec dhidden_spec(const LmHeadShape& s, DType dl_dtype, std::int64_t k, std::int64_t cols);

// Each phase's GEMMs for the plan's block (the plan's core already chosen;
// null ones when the factory only sizes them), and its regions of the step's
// workspace. packed: the bytes of the packed hidden rows, raised to what the
// phase's GEMMs need.
void create_forward_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed);
void book_forward(const LmHeadPlanData& p, bool packed_estimate, WorkspaceRegistry& w);
void create_dense_backward_gemms(LmHeadPlanData& p, GemmFactory& make, std::size_t* packed);
void book_dense_backward(const LmHeadPlanData& p, WorkspaceRegistry& w);

// The token block and GEMM rows a plan chose; a plan over a vocab group is
// rebuilt with the group's smallest (scale_out.cpp), so its per-block
// exchanges pair up.
struct BlockChoice {
  std::int64_t token_block = 0;
  std::int64_t forward_rows = 0;
};

// The vocab tile a plan of this shape and options uses.
inline std::int64_t plan_vocab_tile(const LmHeadShape& shape, const LmHeadOptions& options) {
  return std::min(options.vocab_tile > 0 ? options.vocab_tile : kDefaultVocabTile, shape.vocab);
}

// The workspace budget a plan of this shape works within (LmHeadOptions::
// workspace_budget: given, or the default for the whole vocabulary or a
// shard's share of it).
inline std::size_t plan_workspace_budget(const LmHeadShape& shape, const LmHeadOptions& options) {
  if (options.workspace_budget != kWorkspaceBudgetAuto) return options.workspace_budget;
  if (shape.global_vocab <= shape.vocab) return kDefaultWorkspaceBudget;
  const auto share =
      static_cast<std::size_t>(static_cast<double>(kDefaultWorkspaceBudget) * static_cast<double>(shape.vocab) /
                               static_cast<double>(shape.global_vocab));
  return std::max(share, kMinAutoWorkspaceBudget);
}

// Chooses the schedule, creates the GEMMs, lays out the workspace. shape's
// *_ld must be resolved (no zeros). scale_out: the plan's groups (their
// exchanges take workspace); forced: use this block choice, no search.
// Throws grpo::Error for shapes/options it cannot serve.
std::unique_ptr<LmHeadPlanData> build_lm_head_plan(const LmHeadShape& shape, const LossConfig& config,
                                                   const LmHeadOptions& options,
                                                   std::shared_ptr<const ScaleOutPlan> scale_out = nullptr,
                                                   const BlockChoice* forced = nullptr);

// Said by the one refusal that can come after a step wrote outputs (see run_lm_head).
inline constexpr char kEarlierBlocksWritten[] = "outputs of earlier token blocks were already written";

// Runs one step. Arguments already validated. With a data group, a refusal
// met inside the schedule is exchanged before it leaves (the other ranks wait
// for this one at the end of the step; StepExchange::abandon).
// max_abs_coef: from validation (LossAccumulator's bound on |c_t|).
// counts: the data group's batch and valid tokens (agree_on_call).
void run_lm_head(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs,
                 std::byte* workspace, double max_abs_coef, const GlobalCounts& counts = {});

}  // namespace grpo::detail
