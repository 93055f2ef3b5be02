#include "runners.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "unfused_gemms.hpp"

namespace grpo::bench {

HeadOutputs::HeadOutputs(const BenchConfig& c, bool forward_only)
    : HeadOutputs(c, forward_only, c.shape.rows(), c.shape.vocab) {}

HeadOutputs::HeadOutputs(const BenchConfig& c, bool forward_only, std::int64_t n_rows, std::int64_t n_vocab)
    : rows(n_rows), vocab(n_vocab), logp(static_cast<std::size_t>(n_rows)) {
  if (forward_only) return;
  const auto n = static_cast<std::size_t>(rows), h = static_cast<std::size_t>(c.shape.hidden),
             v = static_cast<std::size_t>(vocab);
  dhidden = HostBuffer(n * h * size_of(c.dhidden_dtype));
  dhidden.fill_zero();
  if (c.frozen_weight) return;
  dweight = HostBuffer(v * h * size_of(c.dweight_dtype));
  dweight.fill_zero();
  if (c.bias) dbias.assign(v, 0.0F);
}

LmHeadOutputs HeadOutputs::view(const BenchConfig& c, Metrics* metrics, LmHeadStepStats* stats) {
  const std::int64_t n = rows, h = c.shape.hidden, v = vocab;
  LmHeadOutputs o;
  o.tokens.logp = logp;
  o.metrics = metrics;
  o.stats = stats;
  if (dhidden.empty()) return o;
  o.dhidden = {dhidden.data(), c.dhidden_dtype, n, h, h};
  if (dweight.empty()) return o;  // frozen_weight
  o.dweight = c.layout == WeightLayout::vocab_major ? MutMatrixView{dweight.data(), c.dweight_dtype, v, h, h}
                                                    : MutMatrixView{dweight.data(), c.dweight_dtype, h, v, v};
  o.dbias = dbias;
  return o;
}

LmHeadOptions plan_options(const BenchConfig& c, Allocator& a) {
  LmHeadOptions o;
  o.token_block = c.token_block;
  o.vocab_tile = c.vocab_tile;
  o.workspace_budget = c.workspace_budget;
  o.max_threads = c.threads;
  o.forward_only = c.forward_only;
  o.frozen_weight = c.frozen_weight;
  o.grad_filter = c.grad_filter;
  o.dweight_dtype = c.dweight_dtype;
  o.dhidden_dtype = c.dhidden_dtype;
  o.allocator = &a;
  return o;
}

namespace {

LmHeadBaselineOptions baseline_options(const BenchConfig& c, DType logits_dtype, Allocator* allocator) {
  LmHeadBaselineOptions o;
  o.logits_dtype = logits_dtype;
  o.max_threads = c.threads;
  o.forward_only = c.forward_only;
  o.dweight_dtype = c.dweight_dtype;
  o.dhidden_dtype = c.dhidden_dtype;
  o.allocator = allocator;
  return o;
}

// The unfused step's GEMMs alone at the problem's shapes, best of reps. Their
// [N, V] operands come from the default allocator: this runs after the timed
// steps and must not count in the run's tracked peak.
double best_unfused_gemms(const BenchConfig& c, const Problem& p, DType logits_dtype, const LmHeadOutputs& out,
                          int reps) {
  const UnfusedGemms gemms(p.lm_head_shape(), p.config, baseline_options(c, logits_dtype, nullptr));
  double best = 0.0;
  for (int i = 0; i < reps; ++i) {
    const double t = gemms.run(p.lm_head_inputs(), out).total();
    best = i == 0 ? t : std::min(best, t);
  }
  return best;
}

class FusedRunner final : public Runner {
 public:
  FusedRunner(const BenchConfig& c, const Problem& p, Allocator& a) : c_(c), p_(p), a_(a), out_(c, c.forward_only) {}

  void create() override { plan_.emplace(p_.lm_head_shape(), p_.config, plan_options(c_, a_)); }
  std::optional<double> step() override {
    // No workspace passed: the plan allocates it through the tracker each
    // call (from the caching allocator's free list in steady state).
    plan_->execute(p_.lm_head_inputs(), out_.view(c_, &metrics_, &rows_));
    return std::nullopt;
  }
  std::string describe() const override { return plan_->describe(); }
  std::size_t workspace_bytes() const override { return plan_->workspace_size(); }
  std::optional<LmHeadStepStats> step_stats() const override { return rows_; }
  std::optional<double> unfused_gemms_seconds(int reps) override {
    // The fused forward GEMM writes f32 logit tiles; its backward reads
    // dlogits in the input dtype, as the unfused step's GEMMs do.
    return best_unfused_gemms(c_, p_, DType::f32, out_.view(c_, nullptr), reps);
  }

 private:
  const BenchConfig& c_;
  const Problem& p_;
  Allocator& a_;
  HeadOutputs out_;
  LmHeadStepStats rows_;
  std::optional<LmHeadLossPlan> plan_;
};

// The generic log-prob head as a trainer drives it: forward (logp, entropy),
// the loss computed outside the library from logp, then backward from
// dL/dlogp. The outside loss is the token-level clipped GRPO family term with
// its aggregation weight (what TRL computes on the head's logp; no KL), so the
// step does the fused loss's work through the generic interface.
class GenericHeadRunner final : public Runner {
 public:
  GenericHeadRunner(const BenchConfig& c, const Problem& p, Allocator& a)
      : c_(c), p_(p), a_(a), out_(c, false), entropy_(out_.logp.size()), dlogp_(out_.logp.size()) {
    const LossConfig& l = p.config;
    if (l.beta != 0.0F || l.importance_sampling_level != IsLevel::token || c.forward_only ||
        (l.loss_type != LossType::grpo && l.loss_type != LossType::dapo && l.loss_type != LossType::bnpo)) {
      throw std::invalid_argument(
          "impl generic_head computes a token-level grpo / bnpo / dapo loss without KL outside the head: "
          "set loss.type accordingly, loss.beta 0, importance sampling level token, forward_only false");
    }
  }

  void create() override {
    LogProbConfig lc;
    lc.temperature = p_.config.temperature;
    lc.temperature_on_logp = p_.config.temperature_on_logp;
    plan_.emplace(p_.lm_head_shape(), lc, plan_options(c_, a_));  // forward_only is refused above
  }
  std::optional<double> step() override {
    const LmHeadInputs head = p_.lm_head_inputs();
    const LogProbInputs in{head.hidden, head.weight, head.bias, p_.ids, p_.mask};
    plan_->forward(in, {out_.logp, entropy_, &forward_rows_});
    outside_loss();
    const LmHeadOutputs g = out_.view(c_, nullptr);
    plan_->backward(in, {dlogp_, {}}, {g.dhidden, g.dweight, g.dbias, &rows_});
    rows_.logits_gemm_rows += forward_rows_.logits_gemm_rows;
    return std::nullopt;
  }
  std::string describe() const override { return plan_->describe(); }
  std::size_t workspace_bytes() const override { return plan_->workspace_size(); }
  std::optional<LmHeadStepStats> step_stats() const override { return rows_; }

 private:
  // dL/dlogp_t and the loss / clip metrics, in double, as a trainer would.
  void outside_loss() {
    const LossConfig& l = p_.config;
    const std::int64_t b = p_.spec.shape.batch, t_len = p_.spec.shape.seq_len, n = b * t_len;
    const double lo = 1.0 - l.epsilon_low, hi = 1.0 + l.epsilon_high;
    double loss = 0.0, clipped = 0.0, valid = 0.0;
    for (float m : p_.mask) valid += m;
    for (std::int64_t i = 0; i < b; ++i) {
      double seq_valid = 0.0;
      for (std::int64_t t = i * t_len; t < (i + 1) * t_len; ++t) seq_valid += p_.mask[t];
      double w = 1.0;  // dLoss/dl_t
      if (l.loss_type == LossType::grpo) w = 1.0 / (static_cast<double>(b) * std::max(seq_valid, 1.0));
      if (l.loss_type == LossType::bnpo) w = 1.0 / std::max(valid, 1.0);
      if (l.loss_type == LossType::dapo) w = 1.0 / l.num_items_in_batch;
      for (std::int64_t t = i * t_len; t < (i + 1) * t_len; ++t) {
        dlogp_[t] = 0.0F;
        if (p_.mask[t] == 0.0F) continue;
        const double a = p_.advantages.size() == static_cast<std::size_t>(n) ? p_.advantages[t] : p_.advantages[i];
        const double q = p_.old_logp.empty() ? 0.0 : std::clamp(out_.logp[t] - double{p_.old_logp[t]}, -20.0, 20.0);
        const double r = std::exp(q);
        const double unclipped = r * a, clip = std::clamp(r, lo, hi) * a;
        loss -= w * std::min(unclipped, clip);
        clipped += (r < lo && a < 0) || (r > hi && a > 0) ? 1.0 : 0.0;
        if (unclipped <= clip) dlogp_[t] = static_cast<float>(-w * a * r);
      }
    }
    metrics_.loss = loss;
    metrics_.clip_ratio_region = clipped / std::max(valid, 1.0);
    metrics_.num_valid = static_cast<std::int64_t>(valid);
  }
  const BenchConfig& c_;
  const Problem& p_;
  Allocator& a_;
  HeadOutputs out_;
  std::vector<float> entropy_, dlogp_;
  LmHeadStepStats rows_, forward_rows_;
  std::optional<LmHeadLogProbPlan> plan_;
};

class BaselineRunner final : public Runner {
 public:
  BaselineRunner(const BenchConfig& c, const Problem& p, Allocator& a) : c_(c), p_(p), a_(a), out_(c, c.forward_only) {}

  void create() override {
    baseline_.emplace(p_.lm_head_shape(), p_.config, baseline_options(c_, c_.logits_dtype, &a_));
  }
  std::optional<double> step() override {
    baseline_->execute(p_.lm_head_inputs(), out_.view(c_, &metrics_, &rows_));
    return std::nullopt;
  }
  std::string describe() const override {
    std::ostringstream os;
    os << "unfused lm-head: logits=" << to_string(c_.logits_dtype) << " dlogits=" << to_string(c_.dtype)
       << (c_.forward_only ? " forward-only" : "");
    return os.str();
  }
  std::optional<LmHeadStepStats> step_stats() const override { return rows_; }
  std::optional<double> unfused_gemms_seconds(int reps) override {
    return best_unfused_gemms(c_, p_, c_.logits_dtype, out_.view(c_, nullptr), reps);
  }

 private:
  const BenchConfig& c_;
  const Problem& p_;
  Allocator& a_;
  HeadOutputs out_;
  LmHeadStepStats rows_;
  std::optional<LmHeadBaseline> baseline_;
};

// The unfused step's three GEMMs alone as the run itself (impl unfused_gemms):
// their operands come from the run's allocator, so the tracked peak counts them.
class UnfusedGemmsRunner final : public Runner {
 public:
  UnfusedGemmsRunner(const BenchConfig& c, const Problem& p, Allocator& a)
      : c_(c), p_(p), a_(a), out_(c, c.forward_only) {}

  void create() override { gemms_.emplace(p_.lm_head_shape(), p_.config, baseline_options(c_, c_.logits_dtype, &a_)); }
  std::optional<double> step() override { return gemms_->run(p_.lm_head_inputs(), out_.view(c_, nullptr)).total(); }
  std::string describe() const override {
    std::ostringstream os;
    os << "the unfused step's oneDNN GEMMs alone: logits=" << to_string(c_.logits_dtype)
       << " dlogits=" << to_string(c_.dtype) << (c_.forward_only ? " forward-only" : "");
    return os.str();
  }
  std::optional<LmHeadStepStats> step_stats() const override {
    const std::int64_t n = c_.shape.rows();
    return LmHeadStepStats{n, c_.forward_only ? 0 : n, c_.forward_only ? 0 : n};  // every row, no loss work
  }

 private:
  const BenchConfig& c_;
  const Problem& p_;
  Allocator& a_;
  HeadOutputs out_;
  std::optional<UnfusedGemms> gemms_;
};

class LogitsRunner final : public Runner {
 public:
  LogitsRunner(const BenchConfig& c, const Problem& p, Allocator& a) : c_(c), p_(p), a_(a), logp_(c.shape.rows()) {
    if (c.in_place) {
      // The step overwrites the logits: each step starts from a fresh copy.
      pristine_ = &p.logits;
      work_ = HostBuffer(p.logits.size());
      std::memcpy(work_.data(), p.logits.data(), p.logits.size());
    } else if (!c.forward_only) {
      work_ = HostBuffer(p.logits.size());
      work_.fill_zero();
    }
  }

  void create() override {
    const LogitsShape shape{c_.shape.batch, c_.shape.seq_len, c_.shape.vocab, c_.logits_dtype};
    const ExecOptions options{c_.threads, &a_};
    if (c_.impl == Impl::logits_fused) {
      fused_ = std::make_unique<LogitsLossPlan>(shape, p_.config, options);
    } else {
      baseline_ = std::make_unique<LogitsBaseline>(shape, p_.config, options);
    }
  }
  void before_step() override {
    if (pristine_ != nullptr) std::memcpy(work_.data(), pristine_->data(), pristine_->size());
  }
  std::optional<double> step() override {
    MatrixView logits = p_.logits_view();
    if (c_.in_place) logits.data = work_.data();
    LogitsOutputs out{.tokens = {.logp = logp_}, .metrics = &metrics_};
    if (!c_.forward_only) out.dlogits = {work_.data(), c_.logits_dtype, logits.rows, logits.cols, logits.ld};
    if (fused_) {
      fused_->execute(logits, p_.batch(), out);
    } else {
      baseline_->execute(logits, p_.batch(), out);
    }
    return std::nullopt;
  }
  std::string describe() const override {
    return std::string(fused_ ? "fused logits-level" : "unfused logits-level") +
           ": logits=" + to_string(c_.logits_dtype) + (c_.in_place ? " in place" : "") +
           (c_.forward_only ? " forward-only" : "");
  }

 private:
  const BenchConfig& c_;
  const Problem& p_;
  Allocator& a_;
  std::vector<float> logp_;
  std::unique_ptr<LogitsLossPlan> fused_;
  std::unique_ptr<LogitsBaseline> baseline_;
  const HostBuffer* pristine_ = nullptr;
  HostBuffer work_;
};

// A copy of the logits bytes into a second buffer: the same bytes a fused
// logits-level step must read and write, at the speed the memory allows.
// Split over the configured threads (one memcpy per 1 MiB chunk), because a
// single-threaded memcpy would understate the bandwidth the kernel competes with.
class CopyRunner final : public Runner {
 public:
  CopyRunner(const BenchConfig& c, const Problem& p) : c_(c), p_(p), dst_(p.logits.size()) { dst_.fill_zero(); }

  std::optional<double> step() override {
    constexpr std::size_t kChunk = std::size_t{1} << 20;
    const std::size_t bytes = p_.logits.size();
    tbb::task_arena arena(c_.threads > 0 ? c_.threads : tbb::this_task_arena::max_concurrency());
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, (bytes + kChunk - 1) / kChunk, 1),
                        [&](const tbb::blocked_range<std::size_t>& r) {
                          for (std::size_t i = r.begin(); i != r.end(); ++i) {
                            const std::size_t at = i * kChunk;
                            std::memcpy(dst_.data() + at, p_.logits.data() + at, std::min(kChunk, bytes - at));
                          }
                        });
    });
    return std::nullopt;
  }
  std::string describe() const override { return "memcpy of " + std::to_string(p_.logits.size()) + " logits bytes"; }

 private:
  const BenchConfig& c_;
  const Problem& p_;
  HostBuffer dst_;
};

bool same_loss(const LossConfig& a, const LossConfig& b) {
  return a.loss_type == b.loss_type && a.importance_sampling_level == b.importance_sampling_level &&
         a.epsilon_low == b.epsilon_low && a.epsilon_high == b.epsilon_high && a.delta == b.delta && a.beta == b.beta &&
         a.kl_bias_correction == b.kl_bias_correction && a.temperature == b.temperature &&
         a.temperature_on_logp == b.temperature_on_logp && a.max_completion_length == b.max_completion_length &&
         a.num_items_in_batch == b.num_items_in_batch && a.sapo_tau_pos == b.sapo_tau_pos &&
         a.sapo_tau_neg == b.sapo_tau_neg && a.kl_clamp == b.kl_clamp && a.kl_estimator == b.kl_estimator &&
         a.vespo_k_pos == b.vespo_k_pos && a.vespo_lambda_pos == b.vespo_lambda_pos && a.vespo_k_neg == b.vespo_k_neg &&
         a.vespo_lambda_neg == b.vespo_lambda_neg && a.off_policy_mask_threshold == b.off_policy_mask_threshold &&
         a.clip_ratio_c == b.clip_ratio_c && a.entropy_coef == b.entropy_coef &&
         a.top_entropy_quantile == b.top_entropy_quantile && a.logit_softcap == b.logit_softcap &&
         a.logit_scale == b.logit_scale;
}

}  // namespace

std::unique_ptr<Runner> make_runner(const BenchConfig& config, const Problem& problem, Allocator& allocator) {
  switch (config.impl) {
    case Impl::fused: return std::make_unique<FusedRunner>(config, problem, allocator);
    case Impl::generic_head: return std::make_unique<GenericHeadRunner>(config, problem, allocator);
    case Impl::baseline: return std::make_unique<BaselineRunner>(config, problem, allocator);
    case Impl::unfused_gemms: return std::make_unique<UnfusedGemmsRunner>(config, problem, allocator);
    case Impl::logits_fused:
    case Impl::logits_baseline: return std::make_unique<LogitsRunner>(config, problem, allocator);
    case Impl::copy: return std::make_unique<CopyRunner>(config, problem);
  }
  return nullptr;
}

ProblemSpec problem_spec(const BenchConfig& c) {
  ProblemSpec s;
  s.shape = c.shape;
  s.lm_head = is_lm_head(c.impl);
  s.dtype = c.dtype;
  s.logits_dtype = c.logits_dtype;
  s.layout = c.layout;
  s.bias = c.bias;
  s.loss = c.loss;
  s.inputs = c.inputs;
  s.threads = c.threads;
  return s;
}

bool same_problem(const ProblemSpec& a, const ProblemSpec& b) {
  if (a.shape != b.shape || a.lm_head != b.lm_head || !(a.inputs == b.inputs)) return false;
  if (!same_loss(a.loss.config, b.loss.config) ||
      a.loss.autos.max_completion_length != b.loss.autos.max_completion_length ||
      a.loss.autos.num_items_in_batch != b.loss.autos.num_items_in_batch) {
    return false;
  }
  if (a.lm_head) return a.dtype == b.dtype && a.layout == b.layout && a.bias == b.bias;
  return a.logits_dtype == b.logits_dtype;
}

double nominal_flops(const BenchConfig& c) {
  if (!is_lm_head(c.impl)) return 0.0;
  const double one = 2.0 * static_cast<double>(c.shape.rows()) * static_cast<double>(c.shape.vocab) *
                     static_cast<double>(c.shape.hidden);
  return one * (c.forward_only ? 1.0 : (c.frozen_weight ? 2.0 : 3.0));
}

double executed_flops(const BenchConfig& c, const LmHeadStepStats& rows) {
  const double per_row = 2.0 * static_cast<double>(c.shape.vocab) * static_cast<double>(c.shape.hidden);
  const double per_row_column = 2.0 * static_cast<double>(c.shape.hidden);
  return per_row * static_cast<double>(rows.logits_gemm_rows + rows.dhidden_gemm_rows + rows.dweight_gemm_rows) -
         per_row_column * static_cast<double>(rows.dhidden_skipped_row_columns + rows.dweight_skipped_row_columns);
}

double nominal_bytes(const BenchConfig& c) {
  if (is_lm_head(c.impl)) return 0.0;
  const double logits = static_cast<double>(c.shape.rows()) * static_cast<double>(c.shape.vocab) *
                        static_cast<double>(size_of(c.logits_dtype));
  return c.forward_only ? logits : 2.0 * logits;
}

}  // namespace grpo::bench
