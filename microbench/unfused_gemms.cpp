#include "unfused_gemms.hpp"

#include <chrono>
#include <cstring>

#include "baseline/unfused_lm_head.hpp"
#include "driver/buffer.hpp"

namespace grpo::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

LmHeadShape dense(LmHeadShape s) {
  const std::int64_t weight_cols = s.layout == WeightLayout::vocab_major ? s.hidden : s.vocab;
  s.hidden_ld = s.hidden;
  s.weight_ld = weight_cols;
  s.dweight_ld = weight_cols;
  return s;
}

}  // namespace

UnfusedGemms::UnfusedGemms(const LmHeadShape& shape, const LossConfig& config, const LmHeadBaselineOptions& options)
    : data_(detail::build_lm_head_baseline(dense(shape), config, options)) {}

UnfusedGemms::~UnfusedGemms() = default;
UnfusedGemms::UnfusedGemms(UnfusedGemms&&) noexcept = default;
UnfusedGemms& UnfusedGemms::operator=(UnfusedGemms&&) noexcept = default;

UnfusedGemmTimes UnfusedGemms::run(const LmHeadInputs& in, const LmHeadOutputs& out) const {
  const detail::LmHeadBaselineData& d = *data_;
  Allocator& alloc = detail::resolve(d.options.allocator);
  const auto elems =
      static_cast<std::size_t>(d.shape.batch * d.shape.seq_len) * static_cast<std::size_t>(d.shape.vocab);
  detail::Buffer logits(alloc, elems * size_of(d.options.logits_dtype));
  detail::Buffer dlogits(alloc, d.options.forward_only ? 0 : elems * size_of(d.dlogits_dtype));
  detail::Buffer scratch(alloc, d.max_scratchpad);
  // Touched before timing so first-touch page faults are not counted.
  std::memset(logits.as(), 0, logits.size());
  if (dlogits.size() != 0) std::memset(dlogits.as(), 0, dlogits.size());

  UnfusedGemmTimes t;
  auto t0 = Clock::now();
  d.logits->run(in.hidden.data, in.weight.data, logits.as(), in.bias.data, scratch.as());
  t.logits_s = seconds_since(t0);
  if (d.options.forward_only) return t;
  t0 = Clock::now();
  d.dhidden->run(dlogits.as(), in.weight.data, out.dhidden.data, nullptr, scratch.as());
  t.dhidden_s = seconds_since(t0);
  t0 = Clock::now();
  if (d.shape.layout == WeightLayout::vocab_major) {
    d.dweight->run(dlogits.as(), in.hidden.data, out.dweight.data, nullptr, scratch.as());
  } else {
    d.dweight->run(in.hidden.data, dlogits.as(), out.dweight.data, nullptr, scratch.as());
  }
  t.dweight_s = seconds_since(t0);
  return t;
}

}  // namespace grpo::bench
