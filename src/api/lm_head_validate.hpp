// Validation of one LM-head call, shared by the fused plan and the baseline.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include "api/validate.hpp"
#include "driver/buffer.hpp"
#include "grpo/lm_head_loss.hpp"

namespace grpo::detail {

struct LmHeadPlanData;

struct LmHeadCallSpec {
  LmHeadShape shape;  // with the *_ld resolved (no zeros)
  LossConfig config;
  bool forward_only = false;
  DType dweight_dtype = DType::f32;
  DType dhidden_dtype = DType::f32;
  DType bias_dtype = DType::f32;
  bool dhidden_dense = false;  // the baseline writes dhidden with one GEMM of ld = H
  int threads = 1;             // for the finiteness scans
  bool frozen_weight = false;  // no dweight / dbias (LmHeadOptions::frozen_weight)
};

// Throws grpo::Error naming the argument; writes nothing. Returns the largest
// |c_t| whose gradients stay finite (LossAccumulator's max_abs_coef).
double validate_lm_head_call(const LmHeadCallSpec& spec, const LmHeadInputs& inputs, const LmHeadOutputs& outputs);

// The pieces of validate_lm_head_call, for the generic log-prob head too.
// hidden, weight, bias views against the plan (shapes, strides, dtypes).
void validate_lm_head_operands(const LmHeadCallSpec& spec, const LmHeadInputs& inputs);
// dhidden, dweight, dbias views (or their absence when forward_only).
void validate_lm_head_gradients(const LmHeadCallSpec& spec, const LmHeadOutputs& outputs);

struct OperandBounds {
  float max_hidden = 0.0F;  // max |h|
  float max_weight = 0.0F;  // max |W|
  double x_bound = 0.0;     // bound on |x| = |z| * scale over every finite logit
};
// Values: bias (no NaN / +inf, not all -inf, not -inf at a valid row's id;
// inputs.batch.ids / mask are read, an empty mask meaning every row valid),
// finiteness of hidden and weight, and logits / logp that cannot overflow f32.
// ids must already be validated.
OperandBounds validate_lm_head_values(const LmHeadCallSpec& spec, const LmHeadInputs& inputs);

// Shape and option checks done once at plan creation.
void validate_lm_head_shape(const LmHeadShape& shape);
// The shape with every *_ld resolved (0 = dense).
LmHeadShape resolve_lds(LmHeadShape shape);
// dweight / dhidden dtypes the plan can produce from the shape's dtype, and
// the option fields both fused heads take (threads, block, tile, frozen weight).
void validate_grad_dtypes(const LmHeadShape& shape, DType dweight, DType dhidden);
void validate_head_options(const LmHeadShape& shape, const LmHeadOptions& options);

// The alias and workspace checks of both fused heads' calls (LmHeadLossPlan,
// LmHeadLogProbPlan), written once so both refuse alike and name the same argument.
using NamedRange = std::pair<ByteRange, const char*>;

// hidden, weight, bias: the bytes an LM-head call's operands span.
std::array<NamedRange, 3> operand_ranges(const LmHeadInputs& inputs);

// Every output against every input and every later output (the later one is
// named), output by output; after output a's checks, each(a) runs (the loss
// plan checks it against the per-token batch there).
template <class Each>
void check_outputs_apart(std::span<const NamedRange> outputs, std::span<const NamedRange> inputs, Each&& each) {
  for (std::size_t a = 0; a < outputs.size(); ++a) {
    for (const auto& [range, name] : inputs) check_no_overlap(outputs[a].first, outputs[a].second, range, name);
    for (std::size_t b = a + 1; b < outputs.size(); ++b) {
      check_no_overlap(outputs[b].first, outputs[b].second, outputs[a].first, outputs[a].second);
    }
    each(a);
  }
}

// The call's workspace: the caller's (at least `need` bytes, 64-byte aligned;
// Error("workspace") otherwise) or, when the caller passed none, `need` bytes
// from the plan's allocator held by `owned` for the call.
// describe()'s GEMM part: the backend of each GEMM kind the plan runs and the
// plan's own memory, e.g. " gemm=forward:grpo:amx_bf16,dweight:grpo:amx_bf16,
// dhidden:grpo:amx_bf16 plan=123456B (92 gemms; backward rows padded to 15
// sizes up to 480)".
std::string describe_gemms(const LmHeadPlanData& plan);
// describe()'s slot count, " threads=2", and when the budget holds fewer
// slots than the plan's threads, how many were asked and the budget that
// would run them all.
std::string describe_threads(const LmHeadPlanData& plan);

std::byte* call_workspace(std::span<std::byte> given, std::size_t need, Allocator* allocator, Buffer& owned);

}  // namespace grpo::detail
