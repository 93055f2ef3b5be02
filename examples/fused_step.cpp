// One fused GRPO forward/backward step through the installed grpo package.
// Prints the loss, the library version and the SIMD path; exits non-zero when
// the loss or a gradient is not finite.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include <grpo/grpo.hpp>

int main() {
  // Small enough to run in milliseconds, large enough for several vocab tiles.
  constexpr std::int64_t kBatch = 2;
  constexpr std::int64_t kSeqLen = 16;
  constexpr std::int64_t kHidden = 64;
  constexpr std::int64_t kVocab = 1000;
  constexpr std::int64_t kRows = kBatch * kSeqLen;

  // Fixed seed: the example prints the same loss on every run.
  std::mt19937 rng(20240601);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_int_distribution<std::int32_t> token(0, kVocab - 1);
  std::vector<float> hidden(kRows * kHidden);
  std::vector<float> weight(kVocab * kHidden);
  for (float& v : hidden) v = normal(rng);
  // Weights ~ N(0, 1/H) keep logits at unit scale, like a trained LM head.
  for (float& v : weight) v = normal(rng) / std::sqrt(static_cast<float>(kHidden));
  std::vector<std::int32_t> ids(kRows);
  for (auto& id : ids) id = token(rng);
  std::vector<float> mask(kRows, 1.0F);
  mask[kSeqLen - 1] = 0.0F;  // one padded position
  const std::vector<float> advantages = {1.0F, -0.5F};
  // Old log-probs a little off the current policy, so the ratio is not 1 and
  // both the clipped and unclipped branches occur.
  std::vector<float> old_logp(kRows);
  for (float& v : old_logp) v = -std::log(static_cast<float>(kVocab)) + 0.3F * normal(rng);

  grpo::LossConfig config;  // grpo, eps 0.2, beta 0
  const grpo::LmHeadShape shape{
      .batch = kBatch, .seq_len = kSeqLen, .hidden = kHidden, .vocab = kVocab, .dtype = grpo::DType::f32};
  const grpo::LmHeadLossPlan plan(shape, config);
  std::vector<std::byte> workspace(plan.workspace_size() + 64);
  // The caller-owned workspace must be 64-byte aligned.
  auto* base = workspace.data();
  const auto misalign = reinterpret_cast<std::uintptr_t>(base) % 64;
  std::span<std::byte> ws(base + (misalign ? 64 - misalign : 0), plan.workspace_size());

  std::vector<float> logp(kRows);
  std::vector<float> dhidden(kRows * kHidden);
  std::vector<float> dweight(kVocab * kHidden);
  grpo::Metrics metrics;
  try {
    plan.execute({.hidden = {hidden.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                  .weight = {weight.data(), grpo::DType::f32, kVocab, kHidden, kHidden},
                  .batch = {.ids = ids, .mask = mask, .advantages = advantages, .old_logp = old_logp}},
                 {.tokens = {.logp = logp},
                  .dhidden = {dhidden.data(), grpo::DType::f32, kRows, kHidden, kHidden},
                  .dweight = {dweight.data(), grpo::DType::f32, kVocab, kHidden, kHidden},
                  .metrics = &metrics},
                 ws);
  } catch (const grpo::Error& e) {
    std::fprintf(stderr, "grpo refused the step: %s\n", e.what());
    return 1;
  }

  double grad_norm2 = 0.0;
  for (float v : dhidden) grad_norm2 += static_cast<double>(v) * v;
  for (float v : dweight) grad_norm2 += static_cast<double>(v) * v;
  std::printf("grpo %s (header %s), simd path %s\n", grpo::version(), GRPO_VERSION_STRING, grpo::simd_path());
  std::printf("%s\n", plan.describe().c_str());
  std::printf("loss %.9g\n", metrics.loss);
  std::printf("valid tokens %lld, clip ratio %.4f, |grad| %.6g\n", static_cast<long long>(metrics.num_valid),
              metrics.clip_ratio_region, std::sqrt(grad_norm2));
  return std::isfinite(metrics.loss) && std::isfinite(grad_norm2) ? 0 : 1;
}
