// Validation of an LM-head call (fused and baseline share it): shapes, the
// strides the plan was built for, dtypes, aliasing, ids, and a finiteness scan
// of hidden, weight and bias. Everything here runs before any output is written.
#include "api/lm_head_validate.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <tbb/parallel_for.h>

#include "api/scale_out_plan.hpp"
#include "api/validate.hpp"
#include "driver/filter_plan.hpp"
#include "driver/lm_head_plan.hpp"
#include "driver/parallel.hpp"
#include "driver/row_math.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {
namespace {

// max |x| over a matrix and the first row holding a NaN or an infinity (-1 if none).
struct Magnitude {
  float max_abs = 0.0F;
  std::int64_t first_bad_row = -1;
};

Magnitude scan_magnitude(const MatrixView& m, int threads) {
  const kernels::StageKernels& k = kernels::kernels();
  std::atomic<std::int64_t> first{std::numeric_limits<std::int64_t>::max()};
  std::atomic<float> largest{0.0F};
  const std::size_t row_bytes = static_cast<std::size_t>(m.ld) * size_of(m.dtype);
  // Chunks of 64 rows, at most `threads` at once, in the caller's arena (no
  // arena of our own: execute allocates nothing here).
  constexpr std::int64_t kChunk = 64;
  for_each_item((m.rows + kChunk - 1) / kChunk, threads, [&](std::int64_t chunk, int) {
    const std::int64_t end = std::min(m.rows, (chunk + 1) * kChunk);
    {
      float local = 0.0F;
      for (std::int64_t r = chunk * kChunk; r != end; ++r) {
        const auto* row = static_cast<const std::byte*>(m.data) + static_cast<std::size_t>(r) * row_bytes;
        const float a = k.max_abs(row, elem_of(m.dtype), m.cols);
        if (a == std::numeric_limits<float>::infinity()) {
          std::int64_t seen = first.load();
          while (r < seen && !first.compare_exchange_weak(seen, r)) {
          }
          return;
        }
        local = std::max(local, a);
      }
      float seen = largest.load();
      while (local > seen && !largest.compare_exchange_weak(seen, local)) {
      }
    }
  });
  const std::int64_t r = first.load();
  return {largest.load(), r == std::numeric_limits<std::int64_t>::max() ? -1 : r};
}

void check_ld(std::int64_t got, std::int64_t planned, const char* name) {
  if (got != planned) {
    throw Error(name, "ld " + std::to_string(got) + " differs from the " + std::to_string(planned) +
                          " the plan was built for (LmHeadShape::*_ld)");
  }
}

ByteRange span_range(std::span<float> s) { return byte_range(s.data(), s.size_bytes()); }

}  // namespace

void validate_lm_head_operands(const LmHeadCallSpec& spec, const LmHeadInputs& in) {
  const LmHeadShape& s = spec.shape;
  const std::int64_t rows = s.batch * s.seq_len;
  const bool vocab_major = s.layout == WeightLayout::vocab_major;
  validate_matrix(in.hidden, "hidden", rows, s.hidden, s.dtype);
  check_ld(in.hidden.ld, s.hidden_ld, "hidden");
  validate_matrix(in.weight, "weight", vocab_major ? s.vocab : s.hidden, vocab_major ? s.hidden : s.vocab, s.dtype);
  check_ld(in.weight.ld, s.weight_ld, "weight");
  if (s.has_bias) {
    if (in.bias.empty()) throw Error("bias", "is required: the plan was built with has_bias");
    if (in.bias.size != s.vocab) {
      throw Error("bias", "has " + std::to_string(in.bias.size) + " elements, expected " + std::to_string(s.vocab));
    }
    if (!known_dtype(in.bias.dtype)) throw Error("bias", "must be f32, bf16 or f16");
    if (in.bias.dtype != spec.bias_dtype) throw Error("bias", "dtype differs from the plan's bias dtype");
  } else if (!in.bias.empty()) {
    throw Error("bias", "was given but the plan was built without has_bias");
  }
}

void validate_lm_head_gradients(const LmHeadCallSpec& spec, const LmHeadOutputs& out) {
  const LmHeadShape& s = spec.shape;
  const std::int64_t rows = s.batch * s.seq_len;
  const bool vocab_major = s.layout == WeightLayout::vocab_major;
  if (spec.forward_only) {
    if (!out.dhidden.empty()) throw Error("dhidden", "was given but the plan is forward-only");
    if (!out.dweight.empty()) throw Error("dweight", "was given but the plan is forward-only");
    if (!out.dbias.empty()) throw Error("dbias", "was given but the plan is forward-only");
    return;
  }
  validate_matrix(out.dhidden, "dhidden", rows, s.hidden, spec.dhidden_dtype);
  if (spec.dhidden_dense && out.dhidden.ld != s.hidden)
    throw Error("dhidden", "must be dense (ld == hidden) for the baseline", ErrorKind::unsupported);
  if (spec.frozen_weight) {
    if (!out.dweight.empty()) throw Error("dweight", "was given but the plan's options.frozen_weight is set");
    if (!out.dbias.empty()) throw Error("dbias", "was given but the plan's options.frozen_weight is set");
    return;
  }
  validate_matrix(out.dweight, "dweight", vocab_major ? s.vocab : s.hidden, vocab_major ? s.hidden : s.vocab,
                  spec.dweight_dtype);
  check_ld(out.dweight.ld, s.dweight_ld, "dweight");
  if (s.has_bias) {
    if (out.dbias.size() != static_cast<std::size_t>(s.vocab)) {
      throw Error("dbias",
                  "has " + std::to_string(out.dbias.size()) + " elements, expected " + std::to_string(s.vocab));
    }
  } else if (!out.dbias.empty()) {
    throw Error("dbias", "was given but the plan was built without has_bias");
  }
}

OperandBounds validate_lm_head_values(const LmHeadCallSpec& spec, const LmHeadInputs& in) {
  const LmHeadShape& s = spec.shape;
  const std::int64_t rows = s.batch * s.seq_len;
  // Values: bias may hold -inf (banned tokens) but not NaN / +inf, and a valid
  // row's chosen token must not be banned.
  const kernels::StageKernels& k = kernels::kernels();
  const bool sharded = global_vocab_of(s) != s.vocab;
  if (s.has_bias) {
    if (!k.no_nan_or_pos_inf(in.bias.data, elem_of(in.bias.dtype), in.bias.size)) {
      throw Error("bias", "contains NaN or +inf");
    }
    // A bias banning every token makes every row's logits all -inf, which the
    // fused driver would only meet inside its first token block -- after it
    // zeroed dbias. Refuse it here, with the other value checks. A vocabulary
    // shard may ban all its tokens: the vocab group checks them together
    // (scale_out_plan.cpp).
    bool any_allowed = sharded;
    for (std::int64_t v = 0; v < s.vocab && !any_allowed; ++v) {
      const float b = element_at(in.bias.data, in.bias.dtype, v);
      any_allowed = b != -std::numeric_limits<float>::infinity();
    }
    if (!any_allowed) throw Error("bias", "is -inf for every token: every row's logits would be -inf");
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!in.batch.mask.empty() && in.batch.mask[r] == 0.0F) continue;  // no mask: every row valid
      const std::int64_t id = in.batch.ids[r] - s.vocab_offset;          // ids are global; the bias is this shard's
      if (id < 0 || id >= s.vocab) continue;
      const float b = element_at(in.bias.data, in.bias.dtype, id);
      if (b == -std::numeric_limits<float>::infinity()) {
        throw Error("ids", "row " + std::to_string(r) + " chose token " + std::to_string(in.batch.ids[r]) +
                               " whose bias is -inf");
      }
    }
  }
  const Magnitude hidden = scan_magnitude(in.hidden, spec.threads);
  if (hidden.first_bad_row >= 0) {
    throw Error("hidden", "row " + std::to_string(hidden.first_bad_row) + " contains NaN or inf");
  }
  const Magnitude weight = scan_magnitude(in.weight, spec.threads);
  if (weight.first_bad_row >= 0) {
    throw Error("weight", "row " + std::to_string(weight.first_bad_row) + " contains NaN or inf");
  }
  // Finite operands can still overflow f32, and the fused kernel only meets a
  // token block's logits after earlier blocks' outputs were written; so refuse
  // here, from bounds: |z| <= B_z = H max|h| max|W| + max|b|; the softmax sees
  // x = z * scale, and |x_y - LSE(x)| <= 2 B_x + log V; logp multiplies that by
  // post (1/tau under temperature_on_logp).
  double bias_max = 0.0;
  if (s.has_bias) {
    for (std::int64_t v = 0; v < s.vocab; ++v) {
      const float b = element_at(in.bias.data, in.bias.dtype, v);
      if (b != -std::numeric_limits<float>::infinity()) bias_max = std::max(bias_max, static_cast<double>(std::abs(b)));
    }
  }
  const double f32_max = std::numeric_limits<float>::max();
  const double tau = spec.config.temperature;
  const double scale = spec.config.temperature_on_logp ? 1.0 : 1.0 / tau;
  const double post = spec.config.temperature_on_logp ? 1.0 / tau : 1.0;
  const double z_bound = static_cast<double>(s.hidden) * hidden.max_abs * weight.max_abs + bias_max;
  if (!(z_bound * 4.0 < f32_max)) {
    throw Error("hidden", "hidden (max |h| = " + std::to_string(hidden.max_abs) + ") and weight (max |W| = " +
                              std::to_string(weight.max_abs) + ") can produce logits that overflow f32");
  }
  // The softmax sees x = z' * scale: z' = c tanh(s z / c) is bounded by c; z' = s z without a cap.
  const double s_logit = spec.config.logit_scale;
  const double x_bound =
      (spec.config.logit_softcap ? std::min(static_cast<double>(*spec.config.logit_softcap), s_logit * z_bound)
                                 : s_logit * z_bound) *
      scale;
  const double logp_bound = (2.0 * x_bound + std::log(static_cast<double>(global_vocab_of(s)))) * post;
  if (!(x_bound * 4.0 < f32_max) || !(logp_bound * 4.0 < f32_max)) {
    throw Error("config.temperature", "temperature " + std::to_string(tau) + " scales logits bounded by " +
                                          std::to_string(z_bound) +
                                          " (from max |h|, max |W|) to log-probabilities that can overflow f32");
  }
  return {hidden.max_abs, weight.max_abs, x_bound};
}

std::array<NamedRange, 3> operand_ranges(const LmHeadInputs& in) {
  const std::size_t bias_bytes =
      static_cast<std::size_t>(in.bias.size) * (in.bias.empty() ? 0 : size_of(in.bias.dtype));
  return {{{byte_range(in.hidden), "hidden"},
           {byte_range(in.weight), "weight"},
           {byte_range(in.bias.data, bias_bytes), "bias"}}};
}

std::string describe_threads(const LmHeadPlanData& plan) {
  const int slots = plan.schedule.slots;
  std::string s = " threads=" + std::to_string(slots);
  if (slots < plan.threads) {
    s += " (of " + std::to_string(plan.threads) + ": options.workspace_budget " +
         std::to_string(plan.options.workspace_budget) + "B holds " + std::to_string(slots) + " slot" +
         (slots == 1 ? "" : "s") + " beside the token block; " + std::to_string(plan.threads) + " take " +
         std::to_string(plan.layout.slots + plan.layout.slot_bytes * static_cast<std::size_t>(plan.threads)) + "B)";
  }
  return s;
}

std::string describe_gemms(const LmHeadPlanData& plan) {
  std::string s = std::string(" gemm=forward:") + plan.forward.gemms.full->implementation();
  if (!plan.backward.dhidden.empty()) {
    if (!plan.options.frozen_weight)
      s += std::string(",dweight:") + plan.backward.dweight.back().full[0]->implementation();
    s += std::string(",dhidden:") + plan.backward.dhidden.back().full->implementation();
  }
  // The plan's own memory beside the workspace (LmHeadSchedule::plan_bytes: measured, an estimate).
  s +=
      " plan=" + std::to_string(plan.schedule.plan_bytes) + "B (" + std::to_string(plan.schedule.gemm_count) + " gemms";
  if (!plan.backward.dhidden.empty()) {
    s += "; backward rows padded to " + std::to_string(plan.row_ladder.entries().size()) + " sizes up to " +
         std::to_string(plan.row_ladder.entries().back());
  }
  s += ")";
  if (plan.filter) {
    const FilterPlan& f = *plan.filter;
    // grad_filter=2^-12 for a power of two, else the threshold as given.
    int e = 0;
    const float m = std::frexp(f.eps, &e);
    s += " grad_filter=" + (m == 0.5F ? "2^" + std::to_string(e - 1) : std::to_string(f.eps)) +
         " (per token block, the kept vocab columns in groups of " + std::to_string(f.kept_tile) + ", up to " +
         std::to_string(f.kept_cap) + " of " + std::to_string(plan.shape.vocab) + "; the rest back in rank " +
         std::to_string(f.tail_rank) +
         (f.kept_lo_cap > 0 ? ", the kept entries' bf16 remainders, up to " + std::to_string(f.kept_lo_cap) + " per row"
                            : std::string()) +
         (f.guard ? "; guarded: a block whose left-out part outweighs " +
                        std::to_string(static_cast<int>(kGuardRatio * 100.0)) +
                        "% of the exact step's error tries eps / 4^r, r < " + std::to_string(kFilterRungs) +
                        ", then runs exact"
                  : std::string()) +
         ")";
  }
  return s;
}

std::byte* call_workspace(std::span<std::byte> given, std::size_t need, Allocator* allocator, Buffer& owned) {
  if (given.empty()) {
    owned = Buffer(resolve(allocator), need);
    return owned.as();
  }
  if (given.size() < need) {
    throw Error("workspace", "has " + std::to_string(given.size()) + " bytes, the plan needs " + std::to_string(need));
  }
  if (reinterpret_cast<std::uintptr_t>(given.data()) % kAlignment != 0) {
    throw Error("workspace", "must be 64-byte aligned");
  }
  return given.data();
}

double validate_lm_head_call(const LmHeadCallSpec& spec, const LmHeadInputs& in, const LmHeadOutputs& out) {
  const LmHeadShape& s = spec.shape;
  const std::int64_t rows = s.batch * s.seq_len;
  validate_lm_head_operands(spec, in);
  if (!std::isfinite(in.grad_scale)) throw Error("grad_scale", "must be finite, got " + std::to_string(in.grad_scale));
  if (spec.dhidden_dense && in.grad_scale != 1.0) {
    throw Error("grad_scale", "the unfused baseline takes no gradient scale", ErrorKind::unsupported);
  }
  const BatchMagnitudes magnitudes = validate_batch(spec.config, s.batch, s.seq_len, global_vocab_of(s), in.batch);
  validate_token_outputs(out.tokens, rows);
  validate_lm_head_gradients(spec, out);

  const std::array<NamedRange, 3> inputs = operand_ranges(in);
  // Every output with its bytes (a fixed array: validation allocates nothing).
  std::array<NamedRange, 6> outputs = {{{span_range(out.tokens.logp), "logp"},
                                        {span_range(out.tokens.entropy), "entropy"},
                                        {span_range(out.tokens.kl), "kl"}}};
  std::size_t num_outputs = 3;
  if (!spec.forward_only) {
    outputs[num_outputs++] = {byte_range(out.dhidden.as_const()), "dhidden"};
    outputs[num_outputs++] = {byte_range(out.dweight.as_const()), "dweight"};
    outputs[num_outputs++] = {span_range(out.dbias), "dbias"};
  }
  check_outputs_apart(std::span<const NamedRange>(outputs.data(), num_outputs), inputs, [&](std::size_t a) {
    check_output_vs_batch(outputs[a].first, outputs[a].second, in.batch, a == 0);
  });

  const OperandBounds bounds = validate_lm_head_values(spec, in);
  if (spec.forward_only) return std::numeric_limits<double>::infinity();
  // dweight and dbias sum dlogits over the valid rows (times h for dW); a
  // dhidden row sums |onehot - p| <= 2 times max |W|.
  const auto n_valid = static_cast<double>(magnitudes.num_valid);
  const double fan_in = std::max(n_valid, 2.0);
  const double operand_max =
      std::max({1.0, static_cast<double>(bounds.max_hidden), static_cast<double>(bounds.max_weight)});
  const double limit = check_coefficient_bound(spec.config, magnitudes.sequences, magnitudes, fan_in, operand_max,
                                               2.0 * static_cast<double>(bounds.x_bound));
  // grad_scale multiplies every coefficient: above 1 it shrinks the room. The
  // policy part is linear in the advantages, so the same check with them
  // scaled by |grad_scale| bounds it; the KL part is met by the returned limit.
  const double g = std::fabs(in.grad_scale);
  if (g <= 1.0) return limit;
  BatchMagnitudes scaled = magnitudes;
  scaled.max_abs_advantage *= g;
  try {
    check_coefficient_bound(spec.config, scaled.sequences, scaled, fan_in, operand_max,
                            2.0 * static_cast<double>(bounds.x_bound) * g);
  } catch (const Error& e) {
    throw Error("grad_scale", "grad_scale " + std::to_string(in.grad_scale) + " with " + e.what());
  }
  return limit / g;
}

}  // namespace grpo::detail
