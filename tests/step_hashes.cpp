// grpo-step-hashes: a fingerprint of what the fused plans compute, for
// refactorings that must not change a bit (issue 45 item 4). Runs a fixed
// list of cases through the public API (LmHeadLossPlan, LmHeadLogProbPlan,
// LogitsLossPlan) with every GEMM backend named on the command line (default:
// the default choice, then each backend of the table, kernels::gemm_backends(),
// that this CPU runs, forced by GRPO_GEMM), and prints one line per
// case: an FNV-1a hash of logp, entropy, kl, dhidden, dweight, dbias, the
// metrics, the step's counters (not its times) and of describe() (its
// measured plan bytes left out). Compare two builds' outputs with diff.
// Not a test (nothing is asserted); not in ctest.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "grpo/grpo.hpp"
#include "kernels/gemm_backend.hpp"

namespace {

using grpo::DType;
using grpo::WeightLayout;

class Fnv {
 public:
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ULL;
    }
  }
  template <class T>
  void add(const std::vector<T>& v) {
    add(v.data(), v.size() * sizeof(T));
  }
  template <class T>
  void value(const T& v) {
    add(&v, sizeof(T));
  }
  std::uint64_t get() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

std::uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFU + ((u >> 16) & 1U);
  return static_cast<std::uint16_t>(u >> 16);
}

// Values stored in dtype, as bytes.
std::vector<std::byte> store(const std::vector<float>& v, DType dtype) {
  std::vector<std::byte> out(v.size() * grpo::size_of(dtype));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const std::uint16_t b = to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

constexpr std::int64_t kB = 2, kT = 40, kH = 64, kV = 4096, kN = kB * kT;

// One problem's inputs: logits of a wide spread (sigma ~ 5, peaked rows the
// filter can leave most columns of), two nearly uniform rows (the filter's
// dense rows), a few masked rows.
struct Problem {
  std::vector<float> hidden, weight, bias;  // hidden [N, H]; weight [V, H] (vocab-major values)
  std::vector<std::int32_t> ids;
  std::vector<float> mask, advantages, old_logp, ref_logp;

  explicit Problem(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    hidden.resize(kN * kH);
    weight.resize(kV * kH);
    bias.resize(kV);
    for (float& x : hidden) x = normal(rng);
    for (std::int64_t r : {3, 57}) {
      for (std::int64_t c = 0; c < kH; ++c) hidden[r * kH + c] *= 0.001F;
    }
    const float w_scale = 5.0F / std::sqrt(static_cast<float>(kH));
    for (float& x : weight) x = normal(rng) * w_scale;
    for (float& x : bias) x = normal(rng) * 0.1F;
    std::uniform_int_distribution<std::int32_t> id(0, kV - 1);
    ids.resize(kN);
    mask.assign(kN, 1.0F);
    for (std::int64_t r = 0; r < kN; ++r) ids[r] = id(rng);
    for (std::int64_t r : {0, 1, 2, 41, 79}) mask[r] = 0.0F;
    advantages = {0.7F, -1.3F};
    // logp in double (vocab-major values, no bias) for old_logp = logp + N(0, 0.3).
    old_logp.resize(kN);
    ref_logp.resize(kN);
    std::vector<double> z(kV);
    for (std::int64_t r = 0; r < kN; ++r) {
      double m = -1e300;
      for (std::int64_t v = 0; v < kV; ++v) {
        double s = 0.0;
        for (std::int64_t c = 0; c < kH; ++c) s += double(hidden[r * kH + c]) * weight[v * kH + c];
        z[v] = s;
        m = std::max(m, s);
      }
      double sum = 0.0;
      for (double x : z) sum += std::exp(x - m);
      const double logp = z[ids[r]] - m - std::log(sum);
      old_logp[r] = static_cast<float>(logp + 0.3 * normal(rng));
      ref_logp[r] = static_cast<float>(logp + 0.2 * normal(rng));
    }
  }
};

struct Case {
  std::string name;
  grpo::LossConfig config;
  grpo::LmHeadOptions options;
  bool bias = false;
  bool beta_inputs = false;
  bool log_prob_head = false;  // LmHeadLogProbPlan forward + backward
};

void hash_stats(Fnv& h, const grpo::LmHeadStepStats& s) {
  for (std::int64_t v :
       {s.logits_gemm_rows, s.dhidden_gemm_rows, s.dweight_gemm_rows, s.active_rows, s.dhidden_skipped_row_columns,
        s.dweight_skipped_row_columns, s.filter_guard_blocks, s.filter_lowered_blocks}) {
    h.value(v);
  }
  h.value(s.schedule_bytes);
}

std::string describe_stable(const std::string& d) {
  return std::regex_replace(d, std::regex(" plan=[0-9]+B"), " plan=?B");
}

std::string run_case(const Case& c, const Problem& pb, DType dtype, WeightLayout layout) {
  grpo::LmHeadShape shape{.batch = kB, .seq_len = kT, .hidden = kH, .vocab = kV, .dtype = dtype, .layout = layout};
  shape.has_bias = c.bias;
  const std::vector<std::byte> hidden = store(pb.hidden, dtype);
  std::vector<float> w = pb.weight;
  if (layout == WeightLayout::hidden_major) {
    for (std::int64_t v = 0; v < kV; ++v) {
      for (std::int64_t k = 0; k < kH; ++k) w[k * kV + v] = pb.weight[v * kH + k];
    }
  }
  const std::vector<std::byte> weight = store(w, dtype);
  const std::int64_t wr = layout == WeightLayout::vocab_major ? kV : kH;
  const std::int64_t wc = layout == WeightLayout::vocab_major ? kH : kV;
  const grpo::MatrixView hv{hidden.data(), dtype, kN, kH, kH};
  const grpo::MatrixView wv{weight.data(), dtype, wr, wc, wc};
  const grpo::VectorView bv = c.bias ? grpo::VectorView{pb.bias.data(), DType::f32, kV} : grpo::VectorView{};

  const bool backward = !c.options.forward_only;
  const bool dw = backward && !c.options.frozen_weight;
  const DType dh_type = c.options.dhidden_dtype, dw_type = c.options.dweight_dtype;
  std::vector<float> logp(kN), entropy(kN), kl(kN), dbias(dw && c.bias ? kV : 0);
  std::vector<std::byte> dhidden(backward ? kN * kH * grpo::size_of(dh_type) : 0);
  std::vector<std::byte> dweight(dw ? kV * kH * grpo::size_of(dw_type) : 0);
  const grpo::MutMatrixView dhv =
      backward ? grpo::MutMatrixView{dhidden.data(), dh_type, kN, kH, kH} : grpo::MutMatrixView{};
  const grpo::MutMatrixView dwv = dw ? grpo::MutMatrixView{dweight.data(), dw_type, wr, wc, wc} : grpo::MutMatrixView{};
  grpo::Metrics metrics;
  grpo::LmHeadStepStats stats;
  std::string described;

  if (c.log_prob_head) {
    grpo::LogProbConfig lc{.temperature = c.config.temperature,
                           .logit_softcap = c.config.logit_softcap,
                           .logit_scale = c.config.logit_scale};
    const grpo::LmHeadLogProbPlan plan(shape, lc, c.options);
    described = plan.describe();
    const grpo::LogProbInputs in{hv, wv, bv, pb.ids, pb.mask};
    plan.forward(in, {.logp = logp, .entropy = entropy, .stats = &stats});
    if (backward) {
      std::vector<float> dlogp(kN), dent(kN);
      for (std::int64_t r = 0; r < kN; ++r) {
        dlogp[r] = (r % 7 == 3) ? 0.0F : 0.01F * static_cast<float>((r * 37) % 11 - 5);
        dent[r] = (r % 5 == 1) ? 0.0F : 0.003F * static_cast<float>((r * 13) % 7 - 3);
      }
      plan.backward(in, {.dlogp = dlogp, .dentropy = dent},
                    {.dhidden = dhv, .dweight = dwv, .dbias = dbias, .stats = &stats});
    }
  } else {
    const grpo::LmHeadLossPlan plan(shape, c.config, c.options);
    described = plan.describe();
    grpo::BatchInputs batch{.ids = pb.ids, .mask = pb.mask, .advantages = pb.advantages, .old_logp = pb.old_logp};
    if (c.beta_inputs) batch.ref_logp = pb.ref_logp;
    const grpo::LmHeadInputs in{hv, wv, bv, batch};
    grpo::LmHeadOutputs out{.tokens = {logp, entropy, kl},
                            .dhidden = dhv,
                            .dweight = dwv,
                            .dbias = dbias,
                            .metrics = &metrics,
                            .stats = &stats};
    plan.execute(in, out);
  }
  Fnv h;
  h.add(logp);
  h.add(entropy);
  h.add(kl);
  h.add(dhidden);
  h.add(dweight);
  h.add(dbias);
  for (double v : {metrics.loss, metrics.clip_ratio_low, metrics.clip_ratio_high, metrics.clip_ratio_region,
                   metrics.kl_mean, metrics.entropy_mean}) {
    h.value(v);
  }
  h.value(metrics.num_valid);
  hash_stats(h, stats);
  Fnv hd;
  const std::string d = describe_stable(described);
  hd.add(d.data(), d.size());
  char line[128];
  std::snprintf(line, sizeof line, "%016llx describe=%016llx", static_cast<unsigned long long>(h.get()),
                static_cast<unsigned long long>(hd.get()));
  return line;
}

std::vector<Case> cases() {
  std::vector<Case> list;
  const auto add = [&](std::string name, auto&& edit) {
    Case c;
    c.name = std::move(name);
    c.options.max_threads = 2;
    edit(c);
    list.push_back(std::move(c));
  };
  add("default", [](Case&) {});
  add("grpo_bias", [](Case& c) { c.bias = true; });
  add("blocks32", [](Case& c) { c.options.token_block = 32; });
  add("beta", [](Case& c) {
    c.config.beta = 0.04F;
    c.beta_inputs = true;
  });
  add("gspo_spans_blocks", [](Case& c) {
    c.config.importance_sampling_level = grpo::IsLevel::sequence;
    c.options.token_block = 32;
  });
  add("gspo_whole", [](Case& c) { c.config.importance_sampling_level = grpo::IsLevel::sequence; });
  add("top_entropy_blocks", [](Case& c) {
    c.config.top_entropy_quantile = 0.5F;
    c.options.token_block = 32;
  });
  add("entropy_bonus", [](Case& c) { c.config.entropy_coef = 0.01F; });
  add("softcap", [](Case& c) {
    c.config.logit_softcap = 30.0F;
    c.config.temperature = 0.7F;
  });
  add("frozen", [](Case& c) { c.options.frozen_weight = true; });
  add("dapo", [](Case& c) {
    c.config.loss_type = grpo::LossType::dapo;
    c.config.num_items_in_batch = 64.0;
  });
  add("forward_only", [](Case& c) { c.options.forward_only = true; });
  add("bf16_grads", [](Case& c) {
    c.options.dweight_dtype = DType::bf16;
    c.options.dhidden_dtype = DType::bf16;
  });
  add("filter_auto", [](Case& c) {
    c.options.grad_filter = grpo::kGradFilterAuto;
    c.bias = true;
  });
  add("filter_auto_blocks", [](Case& c) {
    c.options.grad_filter = grpo::kGradFilterAuto;
    c.options.token_block = 32;
    c.options.vocab_tile = 1000;
  });
  add("filter_eps", [](Case& c) { c.options.grad_filter = 1e-2; });
  add("filter_eps_blocks_bonus", [](Case& c) {
    c.options.grad_filter = 1e-2;
    c.options.token_block = 32;
    c.config.entropy_coef = 0.01F;
  });
  add("filter_eps_frozen", [](Case& c) {
    c.options.grad_filter = 1e-2;
    c.options.frozen_weight = true;
  });
  add("filter_eps_softcap_accumulate", [](Case& c) {
    c.options.grad_filter = 1e-3;
    c.config.logit_softcap = 20.0F;
    c.options.accumulate_weight_grads = true;
  });
  add("logprob", [](Case& c) {
    c.log_prob_head = true;
    c.bias = true;
  });
  add("logprob_blocks_filter", [](Case& c) {
    c.log_prob_head = true;
    c.options.token_block = 32;
    c.options.grad_filter = 1e-2;
  });
  add("logprob_filter_auto", [](Case& c) {
    c.log_prob_head = true;
    c.options.grad_filter = grpo::kGradFilterAuto;
  });
  return list;
}

// The logits-level loss (no GEMM): once per dtype.
std::string run_logits(const Problem& pb, DType dtype) {
  std::vector<float> z(kN * kV);
  for (std::int64_t r = 0; r < kN; ++r) {
    for (std::int64_t v = 0; v < kV; ++v) {
      float s = 0.0F;
      for (std::int64_t c = 0; c < kH; ++c) s += pb.hidden[r * kH + c] * pb.weight[v * kH + c];
      z[r * kV + v] = s;
    }
  }
  const std::vector<std::byte> logits = store(z, dtype);
  grpo::LossConfig config;
  config.beta = 0.04F;
  config.entropy_coef = 0.01F;
  const grpo::LogitsLossPlan plan({.batch = kB, .seq_len = kT, .vocab = kV, .logits_dtype = dtype}, config,
                                  {.max_threads = 2});
  std::vector<float> logp(kN), entropy(kN), kl(kN), dlogits(kN * kV);
  grpo::Metrics m;
  const grpo::BatchInputs batch{
      .ids = pb.ids, .mask = pb.mask, .advantages = pb.advantages, .old_logp = pb.old_logp, .ref_logp = pb.ref_logp};
  plan.execute({logits.data(), dtype, kN, kV, kV}, batch,
               {.tokens = {logp, entropy, kl}, .dlogits = {dlogits.data(), DType::f32, kN, kV, kV}, .metrics = &m});
  Fnv h;
  h.add(logp);
  h.add(entropy);
  h.add(kl);
  h.add(dlogits);
  h.value(m.loss);
  h.value(m.entropy_mean);
  char line[64];
  std::snprintf(line, sizeof line, "%016llx", static_cast<unsigned long long>(h.get()));
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  // The default choice, then each backend of the table this CPU can run, forced.
  std::vector<std::string> backends = {""};
  for (const grpo::kernels::GemmBackendEntry& e : grpo::kernels::gemm_backends()) {
    if (e.unusable() == nullptr) backends.emplace_back(e.name);
  }
  if (argc > 1) backends.assign(argv + 1, argv + argc);
  const Problem pb(20261129);
  int n = 0;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    std::printf("logits dtype=%s %s\n", grpo::to_string(dtype), run_logits(pb, dtype).c_str());
    ++n;
  }
  for (const std::string& backend : backends) {
    if (backend.empty()) {
      unsetenv("GRPO_GEMM");
    } else {
      setenv("GRPO_GEMM", backend.c_str(), 1);
    }
    for (const DType dtype : {DType::f32, DType::bf16}) {
      for (const WeightLayout layout : {WeightLayout::vocab_major, WeightLayout::hidden_major}) {
        for (const Case& c : cases()) {
          // The hidden-major layout for the cases whose code differs by layout.
          if (layout == WeightLayout::hidden_major && c.name != "default" && c.name != "filter_auto" &&
              c.name != "filter_eps_blocks_bonus" && c.name != "logprob_blocks_filter" && c.name != "grpo_bias") {
            continue;
          }
          std::string result;
          try {
            result = run_case(c, pb, dtype, layout);
          } catch (const std::exception& e) {
            result = std::string("error: ") + e.what();
          }
          std::printf("gemm=%s dtype=%s layout=%s %s %s\n", backend.empty() ? "default" : backend.c_str(),
                      grpo::to_string(dtype), grpo::to_string(layout), c.name.c_str(), result.c_str());
          ++n;
        }
      }
    }
  }
  std::fprintf(stderr, "%d cases\n", n);
  return 0;
}
