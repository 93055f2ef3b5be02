#include "baseline/unfused_lm_head.hpp"

#include <algorithm>
#include <memory>
#include <utility>

#include "api/lm_head_validate.hpp"
#include "api/scale_out_plan.hpp"
#include "api/validate.hpp"
#include "baseline/unfused_logits.hpp"
#include "driver/buffer.hpp"
#include "driver/parallel.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {
namespace {

using kernels::GemmOperand;
using kernels::GemmSpec;

struct FullBuffers {
  Buffer logits;
  Buffer dlogits;
  Buffer scratch;
};

FullBuffers allocate(const LmHeadBaselineData& d, Allocator& a) {
  const auto elems =
      static_cast<std::size_t>(d.shape.batch * d.shape.seq_len) * static_cast<std::size_t>(d.shape.vocab);
  return {Buffer(a, elems * size_of(d.options.logits_dtype), "logits"),
          Buffer(a, elems * size_of(d.dlogits_dtype), "dlogits"), Buffer(a, d.max_scratchpad)};
}

void run_backward_gemms(const LmHeadBaselineData& d, const LmHeadInputs& in, const LmHeadOutputs& out,
                        const void* dlogits, void* scratch) {
  d.dhidden->run(dlogits, in.weight.data, out.dhidden.data, nullptr, scratch);
  if (d.shape.layout == WeightLayout::vocab_major) {
    d.dweight->run(dlogits, in.hidden.data, out.dweight.data, nullptr, scratch);
  } else {
    d.dweight->run(in.hidden.data, dlogits, out.dweight.data, nullptr, scratch);
  }
}

}  // namespace

std::unique_ptr<LmHeadBaselineData> build_lm_head_baseline(const LmHeadShape& shape, const LossConfig& config,
                                                           const LmHeadBaselineOptions& options) {
  auto d = std::make_unique<LmHeadBaselineData>();
  d->shape = shape;
  d->config = config;
  d->options = options;
  d->threads = resolve_threads(options.max_threads);
  d->dlogits_dtype = shape.dtype;
  // The baseline runs what an eager framework runs: oneDNN's matmul over the
  // whole batch, multi-threaded, whatever GRPO_GEMM says (our backends run
  // one call per thread, inside the fused plans' tasks), except where oneDNN
  // has no kernel for the spec (BaselineGemm, baseline_gemm.hpp).
  d->engine = std::make_unique<kernels::GemmEngine>();
  const LmHeadShape& s = d->shape;
  const std::int64_t n = s.batch * s.seq_len;
  const bool vm = s.layout == WeightLayout::vocab_major;
  GemmSpec logits;
  logits.a = {s.dtype, n, s.hidden, s.hidden_ld, 1};
  logits.b = vm ? GemmOperand{s.dtype, s.hidden, s.vocab, 1, s.weight_ld}
                : GemmOperand{s.dtype, s.hidden, s.vocab, s.weight_ld, 1};
  logits.c = {options.logits_dtype, n, s.vocab, s.vocab, 1};
  logits.has_bias = s.has_bias;
  logits.bias_dtype = s.bias_dtype;
  logits.threads = d->threads;
  d->logits = std::make_unique<BaselineGemm>(*d->engine, logits);
  std::size_t scratch = d->logits->scratchpad_bytes();
  if (!options.forward_only) {
    GemmSpec dh;
    dh.a = {d->dlogits_dtype, n, s.vocab, s.vocab, 1};
    dh.b = vm ? GemmOperand{s.dtype, s.vocab, s.hidden, s.weight_ld, 1}
              : GemmOperand{s.dtype, s.vocab, s.hidden, 1, s.weight_ld};
    dh.c = {options.dhidden_dtype, n, s.hidden, s.hidden, 1};
    dh.threads = d->threads;
    d->dhidden = std::make_unique<BaselineGemm>(*d->engine, dh);
    GemmSpec dw;
    if (vm) {
      dw.a = {d->dlogits_dtype, s.vocab, n, 1, s.vocab};
      dw.b = {s.dtype, n, s.hidden, s.hidden_ld, 1};
      dw.c = {options.dweight_dtype, s.vocab, s.hidden, s.dweight_ld, 1};
    } else {
      dw.a = {s.dtype, s.hidden, n, 1, s.hidden_ld};
      dw.b = {d->dlogits_dtype, n, s.vocab, s.vocab, 1};
      dw.c = {options.dweight_dtype, s.hidden, s.vocab, s.dweight_ld, 1};
    }
    dw.accumulate = options.accumulate_weight_grads;
    dw.threads = d->threads;
    d->dweight = std::make_unique<BaselineGemm>(*d->engine, dw);
    scratch = std::max({scratch, d->dhidden->scratchpad_bytes(), d->dweight->scratchpad_bytes()});
  }
  d->max_scratchpad = scratch;
  return d;
}

void run_lm_head_baseline(const LmHeadBaselineData& d, const LmHeadInputs& in, const LmHeadOutputs& out,
                          double max_abs_coef) {
  Allocator& alloc = resolve(d.options.allocator);
  const LmHeadShape& s = d.shape;
  const std::int64_t n = s.batch * s.seq_len;
  FullBuffers b = allocate(d, alloc);
  if (d.options.forward_only) b.dlogits.reset();
  if (out.stats != nullptr) {  // no row is ever skipped
    const std::int64_t backward_rows = d.options.forward_only ? 0 : n;
    *out.stats = {n, backward_rows, backward_rows};
  }
  d.logits->run(in.hidden.data, in.weight.data, b.logits.as(), in.bias.data, b.scratch.as());
  LogitsShape ls{s.batch, s.seq_len, s.vocab, d.options.logits_dtype};
  LogitsOutputs lo;
  lo.tokens = out.tokens;
  lo.metrics = out.metrics;
  if (!d.options.forward_only) lo.dlogits = {b.dlogits.as(), d.dlogits_dtype, n, s.vocab, s.vocab};
  run_unfused_logits(ls, d.config, d.threads, alloc, {b.logits.as(), d.options.logits_dtype, n, s.vocab, s.vocab},
                     in.batch, lo, max_abs_coef);
  if (d.options.forward_only) return;
  run_backward_gemms(d, in, out, b.dlogits.as(), b.scratch.as());
  if (!out.dbias.empty()) {
    // dbias = column sums of dlogits, accumulated row by row in f32.
    if (!d.options.accumulate_weight_grads) std::fill(out.dbias.begin(), out.dbias.end(), 0.0F);
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t v = 0; v < s.vocab; ++v) {
        const auto at = static_cast<std::size_t>(r * s.vocab + v);
        out.dbias[v] += d.dlogits_dtype == DType::f32 ? b.dlogits.as<float>()[at]
                                                      : kernels::bf16_to_float(b.dlogits.as<std::uint16_t>()[at]);
      }
    }
  }
}

}  // namespace grpo::detail

namespace grpo {

// The public class: the LM-head plan's shape and call validation
// (api/lm_head_validate.hpp), then build / run above.
struct LmHeadBaseline::Impl {
  std::unique_ptr<detail::LmHeadBaselineData> data;
  detail::LmHeadCallSpec call;
};

LmHeadBaseline::LmHeadBaseline(const LmHeadShape& shape, const LossConfig& config,
                               const LmHeadBaselineOptions& options) {
  detail::validate_lm_head_shape(shape);
  // The baseline is the unfused comparison of the bf16 and f32 steps; its
  // [N, V] logits would have to be f16 or f32 for an f16 model.
  if (shape.dtype == DType::f16)
    throw Error("shape.dtype", "the unfused baseline takes f32 or bf16", ErrorKind::unsupported);
  detail::validate_config(config);
  detail::refuse_baseline_features(config);
  detail::validate_grad_dtypes(shape, options.dweight_dtype, options.dhidden_dtype);
  if (options.dhidden_dtype == DType::bf16 && shape.dtype != DType::bf16) {
    throw Error("options.dhidden_dtype", "the baseline's bf16 dhidden needs bf16 inputs (one f32 x f32 -> bf16 matmul)",
                ErrorKind::unsupported);
  }
  if (options.logits_dtype == DType::bf16 && shape.dtype != DType::bf16) {
    throw Error("options.logits_dtype", "bf16 logits need bf16 inputs", ErrorKind::unsupported);
  }
  if (options.max_threads < 0) throw Error("options.max_threads", "must be >= 0");
  detail::refuse_scale_out(shape, nullptr, "the baseline");
  auto impl = std::make_unique<Impl>();
  impl->data = detail::build_lm_head_baseline(detail::resolve_lds(shape), config, options);
  impl->call = {impl->data->shape, config, options.forward_only, options.dweight_dtype, options.dhidden_dtype,
                shape.bias_dtype,  true,   impl->data->threads};
  impl_ = std::move(impl);
}

LmHeadBaseline::~LmHeadBaseline() = default;
LmHeadBaseline::LmHeadBaseline(LmHeadBaseline&&) noexcept = default;
LmHeadBaseline& LmHeadBaseline::operator=(LmHeadBaseline&&) noexcept = default;

void LmHeadBaseline::execute(const LmHeadInputs& inputs, const LmHeadOutputs& outputs) const {
  const double max_abs_coef = detail::validate_lm_head_call(impl_->call, inputs, outputs);
  detail::run_lm_head_baseline(*impl_->data, inputs, outputs, max_abs_coef);
}

}  // namespace grpo
