// Scalar per-row glue shared by the logits-level and LM-head drivers: the
// logit transform (softcap, scale, temperature), the chosen logit, turning
// RowStats into LSE / logp / entropy, and the dlogits stage of one row.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "grpo/loss_config.hpp"
#include "grpo/types.hpp"
#include "kernels/bf16.hpp"
#include "kernels/f16.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::detail {

inline kernels::Elem elem_of(DType dtype) {
  switch (dtype) {
    case DType::f32: return kernels::Elem::f32;
    case DType::bf16: return kernels::Elem::bf16;
    case DType::f16: return kernels::Elem::f16;
  }
  return kernels::Elem::f32;
}

// Element i of a contiguous run of dtype, as f32 (the bias checks).
inline float element_at(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::bf16: return kernels::bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::f16: return kernels::f16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0.0F;
}

// n values of dtype at src, widened to f32 at dst (exact).
inline void load_as_f32(const kernels::StageKernels& k, const void* src, DType dtype, float* dst, std::int64_t n) {
  switch (dtype) {
    case DType::f32: std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float)); return;
    case DType::bf16: k.bf16_to_f32(static_cast<const std::uint16_t*>(src), dst, n); return;
    case DType::f16: k.f16_to_f32(static_cast<const std::uint16_t*>(src), dst, n); return;
  }
}

// n f32 values stored at dst as dtype: copied, rounded to bf16, or rounded
// to f16 saturating at +-65504. Returns the f16 entries that saturated.
inline std::int64_t store_f32_as(const kernels::StageKernels& k, const float* src, void* dst, DType dtype,
                                 std::int64_t n) {
  switch (dtype) {
    case DType::f32: std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float)); return 0;
    case DType::bf16: k.f32_to_bf16(src, static_cast<std::uint16_t*>(dst), n); return 0;
    case DType::f16: return k.f32_to_f16_saturated(src, static_cast<std::uint16_t*>(dst), n);
  }
  return 0;
}

// x = z' * scale is what the softmax sees; logp = (x_y - LSE(x)) * post;
// dlogits = c * grad_scale * (onehot - p) (= c / tau in both conventions).
// The entropy is that of softmax(x), so dEnt/dz' = scale * dEnt/dx: 1/tau by
// default, 1 under temperature_on_logp (the entropy of softmax(z')).
// z' is the logit after the model's transform (LossConfig::logit_softcap /
// logit_scale). Without a cap, z' = s z is linear and s is folded into scale
// and both gradient scales (s = 1 multiplies exactly: defaults unchanged).
// With a cap, the drivers map z to z' = c tanh(s z / c) (softcap) and the
// backward multiplies by dz'/dz = s (1 - t^2), t = z' / c = x * cap_k.
// The temperature and the model's logit transform (softcap or linear scale) together.
struct LogitTransform {
  explicit LogitTransform(const LossConfig& c)
      : scale((c.temperature_on_logp ? 1.0F : 1.0F / c.temperature) * linear(c)),
        post(c.temperature_on_logp ? 1.0F / c.temperature : 1.0F),
        grad_scale(1.0F / c.temperature * linear(c)),
        entropy_grad_scale(scale),
        softcap(c.logit_softcap.value_or(0.0F)),
        softcap_scale(c.logit_softcap ? c.logit_scale : 1.0F),
        cap_k(c.logit_softcap ? 1.0F / (scale * *c.logit_softcap) : 0.0F) {}
  static float linear(const LossConfig& c) { return c.logit_softcap ? 1.0F : c.logit_scale; }
  bool capped() const { return softcap != 0.0F; }
  float scale;
  float post;
  float grad_scale;
  float entropy_grad_scale;
  float softcap;        // c, 0 = no cap
  float softcap_scale;  // s inside the cap
  float cap_k;          // 1 / (scale * c): t = x * cap_k
};

inline float load_scaled(const void* row, kernels::Elem type, std::int64_t index, float scale) {
  if (type == kernels::Elem::f32) return static_cast<const float*>(row)[index] * scale;
  return kernels::bf16_to_float(static_cast<const std::uint16_t*>(row)[index]) * scale;
}

struct RowResult {
  float lse = 0.0F;
  float logp = 0.0F;
  float entropy = 0.0F;
};

// target_x: the chosen token's x (ignored when !valid).
inline RowResult finish_row(const kernels::RowStats& st, float target_x, bool valid, const LogitTransform& t) {
  RowResult res;
  const float log_s = std::log(st.sum);
  res.lse = st.max + log_s;
  res.entropy = log_s - st.dot / st.sum;
  res.logp = valid ? (target_x - res.lse) * t.post : 0.0F;
  return res;
}

// Refuses rows whose statistics show NaN / +inf input, an all -inf row, or a
// valid row whose chosen token has logit -inf.
inline void check_row(float lse, float logp, bool valid, std::int64_t row, const char* argument) {
  if (std::isnan(lse) || lse == std::numeric_limits<float>::infinity()) {
    throw Error(argument, "row " + std::to_string(row) + " contains NaN or +inf logits");
  }
  if (lse == -std::numeric_limits<float>::infinity()) {
    throw Error(argument, "row " + std::to_string(row) + " has every logit -inf");
  }
  if (valid && !std::isfinite(logp)) {
    throw Error("ids", "row " + std::to_string(row) + " chose a token whose logit is -inf");
  }
}

// What one row's dlogits take from upstream: a = dL/dlogp and b = dL/dEnt,
// both times their gradient scales, and mean = E_p[x] = LSE - entropy.
// entropy: the row takes the entropy term (dlogits_entropy_row) even when b
// is 0; without it, b and mean are not read (except through a softcap, whose
// kernel takes both terms in one).
struct RowUpstream {
  float a = 0.0F;
  float b = 0.0F;
  float mean = 0.0F;
  bool entropy = false;
};

// One row's dlogits (+ dbias): the softcap kernel under a cap, else the
// entropy kernel or the plain one. in: z' (f32) under a cap, else the stored
// or given logits, x = in * in_scale + in_shift (see StageKernels).
inline void dlogits_row(const kernels::StageKernels& k, const LogitTransform& t, const void* in, kernels::Elem in_type,
                        std::int64_t n, float in_scale, float in_shift, float lse, const RowUpstream& u,
                        std::int64_t target, void* out, kernels::Elem out_type, float* dbias) {
  if (t.capped()) {
    k.dlogits_softcap_row(in, in_type, n, in_scale, in_shift, lse, u.a, u.b, u.mean, t.cap_k, t.softcap_scale, target,
                          out, out_type, dbias);
  } else if (u.entropy) {
    k.dlogits_entropy_row(in, in_type, n, in_scale, in_shift, lse, u.a, u.b, u.mean, target, out, out_type, dbias);
  } else {
    k.dlogits_row(in, in_type, n, in_scale, in_shift, lse, u.a, target, out, out_type, dbias);
  }
}

}  // namespace grpo::detail
