// One LM-head call's state and what every phase of the step (lm_head_step.hpp)
// shares: the plan, the call's views, the workspace's regions, the GEMM
// bindings, the counters and the phase clocks.
#pragma once

#include <atomic>
#include <chrono>

#include "driver/lm_head_plan.hpp"
#include "driver/row_math.hpp"
#include "driver/step_exchange.hpp"

namespace grpo::detail {

// Thread-nanoseconds of one phase, added from concurrent tasks (relaxed: read after the loops join).
class PhaseClock {
 public:
  template <class F>
  void time(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                  std::memory_order_relaxed);
  }
  double seconds() const { return static_cast<double>(ns_.load(std::memory_order_relaxed)) * 1e-9; }

 private:
  std::atomic<std::int64_t> ns_{0};
};

// What one call owns: its GEMM bindings, the workspace's views, the counters.
struct StepState {
  StepState(const LmHeadPlanData& plan, const LmHeadInputs& inputs, const LmHeadOutputs& outputs, std::byte* workspace,
            StepExchange& call_exchange);

  const LmHeadPlanData& plan;
  const LmHeadInputs& inputs;
  const LmHeadOutputs& outputs;
  std::byte* workspace;
  BindingPool::Lease leased;
  LogitTransform logit_transform;
  StepRegions regions;          // the workspace, as book_workspace (lm_head_schedule.cpp) booked it
  StepExchange& step_exchange;  // the call's, see step_exchange.hpp
  LmHeadStepStats counters;
  struct {
    PhaseClock forward_gemm, forward_stage, dlogits, dweight, dhidden;
  } clocks;
  // f16 dW entries the GEMMs saturated (kernels::take_f16_saturations), added
  // from concurrent tile tasks.
  std::atomic<std::int64_t> gemm_f16_saturated{0};
};

// The call's state as every component sees it (references into StepState),
// with the addressing every phase shares. Members public, as a struct's: the
// components are this state's views, not its owners.
struct StepPart {
  explicit StepPart(StepState& s);

  // No mask (the generic head's option): every row is valid.
  bool valid(std::int64_t row) const { return in.batch.mask.empty() || in.batch.mask[row] != 0.0F; }

  // A slot's GEMM tile and scratchpad, and piece i of a booked use of its tile (WorkspaceLayout).
  float* slot_tile(int slot) const { return p.layout.slot_tile(ws.slots, slot); }
  void* slot_scratch(int slot) const { return p.layout.slot_scratch(ws.slots, slot); }
  template <class T>
  T* slot_piece(int slot, std::size_t use, std::size_t i) const {
    return p.layout.slot_piece<T>(ws.slots, slot, use, i);
  }
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
    return ws.block.data() +
           (static_cast<std::size_t>(row) * static_cast<std::size_t>(p.shape.vocab) + static_cast<std::size_t>(col)) *
               elem;
  }

  const LmHeadPlanData& p;
  const LmHeadInputs& in;
  const LmHeadOutputs& out;
  const BindingPool::Lease& bindings;
  const kernels::StageKernels& k = kernels::kernels();
  const LogitTransform& transform;
  std::size_t in_size;
  std::size_t store_size;
  std::size_t dl_size;
  std::size_t act_row_bytes;  // row stride of hidden_act: hidden_ld elements, as the forward GEMM reads it
  bool vocab_major;
  StepRegions& ws;
  StepExchange& exchange;
  LmHeadStepStats& stats;
  PhaseClock &forward_gemm_clock, &forward_stage_clock, &dlogits_clock, &dweight_clock, &dhidden_clock;
  std::atomic<std::int64_t>& gemm_f16_saturated;
};

}  // namespace grpo::detail
