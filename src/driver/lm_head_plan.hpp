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
// calls of its own rows: LmHeadPlanData::forward_tail.)
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
// The filtered backward (LmHeadOptions::grad_filter) runs its GEMMs over a
// block's kept vocabulary columns in groups of this many (the last one
// zero-padded): dW of one group is a [kKeptTile, H] f32 slot buffer, then
// added into the kept rows of dW.
inline constexpr std::int64_t kKeptTile = 256;
// The filtered backward gives the left-out entries back in a subspace of
// this many directions (LmHeadStep's tail correction): dhidden in a basis of
// W's rows, dW in a basis of the block's hidden rows. The left-out entries
// of a trained model's logits are each tiny but many (~150k per row at Qwen's
// vocabulary), and their sum points along the few directions most rows of W
// share; 8 directions, the first their plain sum, take that coherent part.
inline constexpr std::int64_t kTailRank = 8;
// Remainders a block row may carry (its entries at or above the filter's
// threshold: ~12-96 per row on the trained-like inputs, 16 on the A/B head).
inline constexpr std::int64_t kKeptRemainders = 512;
// Columns of the tail GEMM operands that carry a rank-k value split in two
// bf16 halves (hi, lo), and of the dW apply GEMM's [hi, hi, lo] x [hi; lo; hi]
// (padded to the AMX tile's 32 rows of K).
inline constexpr std::int64_t kTailPair = 2 * kTailRank;
inline constexpr std::int64_t kTailApplyLd = 32;
// The basis of W's rows is sketched from every kTailSketchStride-th row (of
// a vocab-major W; every row of a hidden-major one, whose sampled rows would
// be columns two strides apart, which oneDNN's memory descriptors refuse), in
// GEMMs of kTailRows rows (>= kTailRank + kTailProbes; two AMX tiles of 16).
inline constexpr std::int64_t kTailSketchStride = 8;
inline constexpr std::int64_t kTailRows = 32;
// The guard of grad_filter = auto (LmHeadStep::guard_holds): beside the
// basis, kTailProbes random directions orthogonal to it ride in the same
// tail GEMMs; a left-out sum's coordinates along them estimate the norm of
// what the correction leaves (E sum_j (q_j x)^2 = m |x|^2 / (H - k) for x off
// the basis). A block runs filtered only while that estimate is within
// kGuardRatio of the exact step's own error there (its bf16 roundings of the
// kept entries), for dhidden per block and for dW summed over the call's
// blocks so far; else it tries a lower threshold (kFilterRungs) or runs the
// exact GEMMs. Measured over the head families of
// python/grpo/head_families.py (docs/filtered_backward.md): both estimates
// within 0.84-1.33x of the errors they estimate, so 0.75 keeps the filtered
// gradients under the exact step's error there. What the estimate can
// miss: a left-out sum along one direction only, whose probe coordinates
// are then a chi-square of m degrees; it passes a block at 1.2x the exact
// error when that falls under (0.75 / 1.2)^2 = 0.39 of its mean: p = 0.073
// with 8 probes, 0.0033 with 24 (24 + 8 = the AMX tile's 32 rows).
inline constexpr std::int64_t kTailProbes = 24;
inline constexpr std::int64_t kTailCoords = kTailRank + kTailProbes;      // a coordinate row: basis, then probes
inline constexpr std::int64_t kTailPairProbes = kTailPair + kTailProbes;  // hidden rows' [hi, lo, probes]
inline constexpr double kGuardRatio = 0.75;
// A block the guard refuses tries lower thresholds, eps / 4^r for r = 1..5
// (down to eps / 1024), before the exact GEMMs: what the correction leaves
// is mostly the sum of many small entries, not a direction a basis could
// hold. On python/grpo/head_families.py's heads at T=512 H=1024 V=151936
// (Zen 5) three rungs let 4 of 9 run filtered, six rungs 8 of 9, at
// 60-99% of the backward left out (docs/filtered_backward.md).
inline constexpr int kFilterRungs = 6;
static_assert(kTailCoords <= kTailRows, "the W projection GEMM's rows hold the basis and the probes");
// A dense row: nearly uniform (entropy above ln V - kDenseRowEntropyGap,
// support beyond ~V / 20 columns) with entries under the filter's threshold
// adding up to more than kDenseRowMass of its scale (|a| + |b|, see the
// rule). Its left-out mass is most of its gradient and points along
// E_p[W] - mean W, which depends on the row and which no fixed basis holds
// (measured on the A/B's real head: rows of 9-11.4 nats, 47-430x the exact
// step's row error after the tail correction). Its dhidden is computed over
// every column (up to kRowQuantum such rows per block, else the block runs
// the exact GEMMs). Peaked rows whose tail is heavy (trained-like inputs up
// to 6 nats) are left to the tail correction, which holds them.
inline constexpr float kDenseRowMass = 0.25F;
inline constexpr float kDenseRowEntropyGap = 3.0F;
inline constexpr std::int64_t kDenseRows = 8;

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

struct LmHeadPlanData {
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
  // The filtered backward (LmHeadOptions::grad_filter; LmHeadStep::backward):
  // eps (0: off), the kept columns' GEMM group (kKeptTile, or less for a
  // small vocabulary) and the most kept columns a block may have and still
  // run filtered (a multiple of kept_tile, <= V: the row stride of the
  // compacted dlogits, written in place over the block buffer).
  float grad_filter = 0.0F;
  std::int64_t kept_tile = 0;
  std::int64_t kept_cap = 0;
  // With bf16 dlogits the kept entries also carry their rounding's remainder
  // (lo = g - bf16(g), a second bf16 GEMM pass): per block row, room for the
  // remainders of this many entries at or above the row's threshold
  // (Region::kept_lo, kKeptRemainders); a block with a row holding more runs
  // the exact GEMMs. 0 with f32 dlogits (nothing to carry).
  std::int64_t kept_lo_cap = 0;
  // The tail correction's rank (kTailRank; 0: filter off) and the stride of
  // the W rows its sketch samples (kTailSketchStride or 1).
  std::int64_t tail_rank = 0;
  std::int64_t tail_stride = 1;
  // grad_filter = auto: a block runs filtered only where the guard's
  // estimate of what the filter leaves out holds (kGuardRatio).
  bool filter_guard = false;

  std::unique_ptr<kernels::GemmEngine> engine;
  // Forward logits tile: [forward_rows] x [tile or last tile].
  FullAndLast<std::unique_ptr<kernels::Gemm>> forward;
  // The last token block's, when it is shorter than the others and the
  // forward calls' rows do not depend on M (ours, GemmTraits::m_independent:
  // the same bits): [forward_tail_rows] x [tile or last tile], in as many
  // calls as a block's at most, for the last block's forward_tail_block rows
  // (rounded up to kRowQuantum). Null otherwise (the last block is
  // zero-padded to forward_rows).
  FullAndLast<std::unique_ptr<kernels::Gemm>> forward_tail;
  std::int64_t forward_tail_rows = 0;
  std::int64_t forward_tail_block = 0;
  // The backward GEMMs' padded rows; the vectors below are indexed by its rungs.
  RowLadder row_ladder;
  // Backward, indexed by row_ladder.index_of(padded active rows).
  // dweight tile: [tile kind][overwrite=0 / accumulate=1].
  std::vector<FullAndLast<std::array<std::unique_ptr<kernels::Gemm>, 2>>> dweight;
  // dhidden chunk: [chunk kind].
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> dhidden;
  // The filtered backward's, indexed alike: dW of a group of kept columns
  // into a slot's f32 [kept_tile, H] (empty with frozen_weight); dhidden
  // chunk += kept dlogits [k, kept_tile] x the group's gathered W rows
  // [kept_tile, chunk] (ld hidden_chunk) [chunk kind].
  std::vector<std::unique_ptr<kernels::Gemm>> dweight_kept;
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> dhidden_kept;
  // dweight_kept accumulating (the remainders' pass), with kept_lo_cap.
  std::vector<std::unique_ptr<kernels::Gemm>> dweight_kept_lo;
  // The tail correction's (tail_rank > 0; see LmHeadStep::tail_block), per
  // rung: dlogits tile [k, cols] x A tile [cols, kTailRank] -> f32 [k,
  // kTailRank]; dlogits tile^T [cols, k] x the hidden rows' coordinates [k,
  // kTailPair] -> f32 [cols, kTailPair] (empty with frozen_weight); the active
  // hidden rows [k, H] x the hidden basis^T [H, kTailRank] -> f32.
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> tail_dhidden;
  std::vector<FullAndLast<std::unique_ptr<kernels::Gemm>>> tail_dweight;
  std::vector<std::unique_ptr<kernels::Gemm>> tail_hidden;
  // Per call: W's basis rows [kTailRows, H] x W tile^T -> f32 [kTailRows,
  // cols] (A = W B^T), and dW tile += C [cols, kTailApplyLd] x D
  // [kTailApplyLd, H] (either layout; empty with frozen_weight).
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_project;
  // Omega [kTailRows, V / tail_stride] x W's sampled rows [., chunk] -> f32 [kTailRows, chunk] (ld H).
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_sketch;
  // The dense rows' dhidden chunk: their dlogits [kDenseRows, V] x W[:, chunk] (dhidden's spec).
  FullAndLast<std::unique_ptr<kernels::Gemm>> dense_dhidden;
  FullAndLast<std::unique_ptr<kernels::Gemm>> tail_apply;
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

// The token block and GEMM rows a plan chose; a plan over a vocab group is
// rebuilt with the group's smallest (scale_out.cpp), so its per-block
// exchanges pair up.
struct BlockChoice {
  std::int64_t token_block = 0;
  std::int64_t forward_rows = 0;
};

// The tail correction's workspace dimensions (rank 0 when it is off).
inline TailRegions::Dims tail_dims(const LmHeadPlanData& p) {
  return {p.shape.vocab, p.shape.hidden, p.tiles,     p.tail_rank, size_of(p.dlogits_dtype), size_of(p.shape.dtype),
          kTailApplyLd,  kDenseRows,     kRowQuantum, kTailCoords, kTailPairProbes};
}

// The vocab tile a plan of this shape and options uses.
inline std::int64_t plan_vocab_tile(const LmHeadShape& shape, const LmHeadOptions& options) {
  return std::min(options.vocab_tile > 0 ? options.vocab_tile : kDefaultVocabTile, shape.vocab);
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
