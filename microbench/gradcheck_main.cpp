// grpo-gradcheck --config configs/gradcheck/<name>.yaml [--test-perturb-gradient]
//
// Runs the fused LM-head plan and the unfused baseline on one synthesized
// problem, computes the double reference the config asks for, and prints max
// abs / max rel differences of loss, logp, entropy, dhidden and dweight (and
// dbias) for every pair. Exit 0: every difference within the config's
// tolerance and every value finite; 1: something exceeded or was non-finite;
// 2: bad config or arguments.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <tbb/task_arena.h>
#include <CLI/CLI.hpp>

#include "gradcheck_config.hpp"
#include "gradcheck_reference.hpp"
#include "grpo/baseline.hpp"

namespace {

using namespace grpo;
using namespace grpo::bench;

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

HeadResult allocate_result(const GradcheckConfig& c) {
  const auto n = static_cast<std::size_t>(c.shape.rows()), h = static_cast<std::size_t>(c.shape.hidden),
             v = static_cast<std::size_t>(c.shape.vocab);
  HeadResult r;
  r.logp.assign(n, 0.0F);
  r.entropy.assign(n, 0.0F);
  if (c.loss.config.beta != 0.0F) r.kl.assign(n, 0.0F);
  r.dhidden.assign(n * h, 0.0F);
  r.dweight = HostBuffer(v * h * sizeof(float));
  r.dweight.fill_zero();
  if (c.bias) r.dbias.assign(v, 0.0F);
  return r;
}

LmHeadOutputs outputs_of(const GradcheckConfig& c, HeadResult& r) {
  const std::int64_t n = c.shape.rows(), h = c.shape.hidden, v = c.shape.vocab;
  LmHeadOutputs o;
  o.tokens = {r.logp, r.entropy, r.kl};
  o.dhidden = {r.dhidden.data(), DType::f32, n, h, h};
  o.dweight = c.layout == WeightLayout::vocab_major ? MutMatrixView{r.dweight.data(), DType::f32, v, h, h}
                                                    : MutMatrixView{r.dweight.data(), DType::f32, h, v, v};
  o.dbias = r.dbias;
  o.metrics = &r.metrics;
  return o;
}

HeadResult run_fused(const GradcheckConfig& c, const Problem& p, std::string& describe, double grad_filter = 0.0) {
  LmHeadOptions o;
  o.grad_filter = grad_filter;
  o.token_block = c.token_block;
  o.vocab_tile = c.vocab_tile;
  o.workspace_budget = c.workspace_budget;
  o.max_threads = c.threads;
  const LmHeadLossPlan plan(p.lm_head_shape(), p.config, o);
  describe = plan.describe();
  HeadResult r = allocate_result(c);
  LmHeadStepStats stats;
  LmHeadOutputs out = outputs_of(c, r);
  out.stats = &stats;
  plan.execute(p.lm_head_inputs(), out);
  if (grad_filter != 0.0 && stats.dhidden_gemm_rows > 0) {
    describe += "; left out: " +
                std::to_string(static_cast<double>(stats.dhidden_skipped_row_columns) /
                               (static_cast<double>(stats.dhidden_gemm_rows) * static_cast<double>(c.shape.vocab))) +
                " of the backward GEMMs' rows x V";
  }
  return r;
}

HeadResult run_baseline(const GradcheckConfig& c, const Problem& p) {
  LmHeadBaselineOptions o;
  o.logits_dtype = c.baseline_logits_dtype;
  o.max_threads = c.threads;
  const LmHeadBaseline baseline(p.lm_head_shape(), p.config, o);
  HeadResult r = allocate_result(c);
  baseline.execute(p.lm_head_inputs(), outputs_of(c, r));
  return r;
}

// The test-only corruption: one dhidden element (the largest) moved by far more
// than any tolerance allows, as a wrong gradient would be.
void perturb(HeadResult& r, const Tolerance& tol) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < r.dhidden.size(); ++i) {
    if (std::abs(r.dhidden[i]) > std::abs(r.dhidden[at])) at = i;
  }
  const double scale = std::abs(r.dhidden[at]);
  const double delta = std::max({0.05 * scale, 4.0 * tol.abs, 4.0 * tol.rel * scale, 1e-6});
  std::printf("--test-perturb-gradient: fused dhidden[%zu] moved by %.3e (was %.3e)\n", at, delta,
              static_cast<double>(r.dhidden[at]));
  r.dhidden[at] += static_cast<float>(r.dhidden[at] >= 0.0F ? delta : -delta);
}

template <class A, class B>
DiffStats diff_vectors(const A& a, const B& b, const std::vector<float>* mask) {
  DiffStats d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (mask == nullptr || (*mask)[i] != 0.0F) d.add(a[i], b[i], static_cast<std::int64_t>(i));
  }
  return d;
}

DiffStats diff_dweight(const Problem& p, const HeadResult& a, const HeadResult& b) {
  DiffStats d;
  for (std::int64_t v = 0; v < p.spec.shape.vocab; ++v) {
    for (std::int64_t k = 0; k < p.spec.shape.hidden; ++k)
      d.add(a.dweight_at(p, v, k), b.dweight_at(p, v, k), v * p.spec.shape.hidden + k);
  }
  return d;
}

DiffStats scalar_diff(double a, double b) {
  DiffStats d;
  d.add(a, b, 0);
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"grpo-gradcheck: the fused LM head vs the unfused baseline vs the double oracle"};
  std::string config_path;
  bool perturb_gradient = false;
  app.add_option("--config", config_path, "configs/gradcheck/<name>.yaml")->required();
  app.add_flag("--test-perturb-gradient", perturb_gradient,
               "test only: corrupt one element of the fused dhidden; the check must then fail");
  std::string grad_filter_arg;
  app.add_option("--grad-filter", grad_filter_arg,
                 "also run the fused plan with LmHeadOptions::grad_filter (auto or a threshold in (0, 1)) and check "
                 "it against the oracle and beside the exact fused path (docs/filtered_backward.md)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  double grad_filter = 0.0;
  if (!grad_filter_arg.empty()) {
    char* end = nullptr;
    grad_filter = grad_filter_arg == "auto" ? kGradFilterAuto : std::strtod(grad_filter_arg.c_str(), &end);
    if (grad_filter_arg != "auto" &&
        (end == grad_filter_arg.c_str() || *end != '\0' || !(grad_filter > 0.0) || !(grad_filter < 1.0))) {
      std::fprintf(stderr, "grpo-gradcheck: --grad-filter must be auto or a threshold in (0, 1), got %s\n",
                   grad_filter_arg.c_str());
      return 2;
    }
  }
  GradcheckConfig c;
  try {
    c = load_gradcheck_config(config_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grpo-gradcheck: %s\n", e.what());
    return 2;
  }
  tbb::task_arena arena(c.threads > 0 ? c.threads : tbb::this_task_arena::max_concurrency());
  return arena.execute([&] {
    try {
      ProblemSpec spec;
      spec.shape = c.shape;
      spec.dtype = c.dtype;
      spec.layout = c.layout;
      spec.bias = c.bias;
      spec.loss = c.loss;
      spec.inputs = c.inputs;
      spec.threads = c.threads;
      auto t0 = std::chrono::steady_clock::now();
      const Problem p = synthesize(spec);
      std::printf("gradcheck %s: B=%lld T=%lld H=%lld V=%lld dtype=%s layout=%s%s loss=%s oracle=%s (inputs %.1f s)\n",
                  c.name.c_str(), static_cast<long long>(c.shape.batch), static_cast<long long>(c.shape.seq_len),
                  static_cast<long long>(c.shape.hidden), static_cast<long long>(c.shape.vocab), to_string(c.dtype),
                  to_string(c.layout), c.bias ? " bias" : "", to_string(p.config.loss_type), to_string(c.oracle),
                  since(t0));
      std::string describe;
      t0 = std::chrono::steady_clock::now();
      HeadResult fused = run_fused(c, p, describe);
      std::printf("  %s (%.1f s)\n", describe.c_str(), since(t0));
      std::printf("  clip ratios low %.3f high %.3f region %.3f, entropy_mean %.3f, valid rows %lld\n",
                  fused.metrics.clip_ratio_low, fused.metrics.clip_ratio_high, fused.metrics.clip_ratio_region,
                  fused.metrics.entropy_mean, static_cast<long long>(fused.metrics.num_valid));
      if (perturb_gradient) perturb(fused, c.tolerance.at("dhidden"));
      HeadResult filtered;
      if (grad_filter != 0.0) {
        t0 = std::chrono::steady_clock::now();
        std::string filtered_describe;
        filtered = run_fused(c, p, filtered_describe, grad_filter);
        std::printf("  filtered: %s (%.1f s)\n", filtered_describe.c_str(), since(t0));
      }
      t0 = std::chrono::steady_clock::now();
      const HeadResult base = run_baseline(c, p);
      std::printf("  unfused baseline, %s logits (%.1f s)\n", to_string(c.baseline_logits_dtype), since(t0));

      std::vector<CheckRow> rows;
      auto add_pair = [&](const std::string& pair, const HeadResult& a, const auto& b_loss, const auto& b_logp,
                          const auto& b_entropy, const auto& b_dhidden, const auto& b_dbias, const DiffStats& dweight) {
        rows.push_back({"loss", pair, scalar_diff(a.metrics.loss, b_loss), c.tolerance.at("loss")});
        rows.push_back({"logp", pair, diff_vectors(a.logp, b_logp, &p.mask), c.tolerance.at("logp")});
        rows.push_back({"entropy", pair, diff_vectors(a.entropy, b_entropy, &p.mask), c.tolerance.at("entropy")});
        rows.push_back({"dhidden", pair, diff_vectors(a.dhidden, b_dhidden, nullptr), c.tolerance.at("dhidden")});
        rows.push_back({"dweight", pair, dweight, c.tolerance.at("dweight")});
        if (c.bias) rows.push_back({"dbias", pair, diff_vectors(a.dbias, b_dbias, nullptr), c.tolerance.at("dbias")});
      };
      if (c.oracle != OracleMode::none) {
        t0 = std::chrono::steady_clock::now();
        std::vector<const HeadResult*> fast = {&fused, &base};
        if (grad_filter != 0.0) fast.push_back(&filtered);
        const ReferenceResult ref = c.oracle == OracleMode::lm_head ? reference_lm_head(p) : reference_loss(p, fast);
        std::printf("  double reference (oracle: %s) (%.1f s)\n", to_string(c.oracle), since(t0));
        const char* names[] = {"fused vs oracle", "baseline vs oracle", "fused filtered vs oracle"};
        for (std::size_t i = 0; i < fast.size(); ++i) {
          DiffStats dw;
          if (c.oracle == OracleMode::loss) {
            dw = ref.dweight_diffs[i];
          } else {
            for (std::int64_t v = 0; v < c.shape.vocab; ++v) {
              for (std::int64_t k = 0; k < c.shape.hidden; ++k) {
                dw.add(fast[i]->dweight_at(p, v, k), ref.dweight[v * c.shape.hidden + k], v * c.shape.hidden + k);
              }
            }
          }
          add_pair(names[i], *fast[i], ref.loss, ref.logp, ref.entropy, ref.dhidden, ref.dbias, dw);
        }
      }
      add_pair("fused vs baseline", fused, base.metrics.loss, base.logp, base.entropy, base.dhidden, base.dbias,
               diff_dweight(p, fused, base));
      std::printf("\n");
      return print_verdict("max_rel = max|a-b| / max|b| over the quantity; logp and entropy over valid rows", rows) ? 0
                                                                                                                    : 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "grpo-gradcheck: %s: %s\n", c.name.c_str(), e.what());
      return 2;
    }
  });
}
