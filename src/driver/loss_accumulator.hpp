// Turns per-token log-probabilities into the loss, the metrics and the
// per-token gradient coefficient c_t = dLoss/dlogp_t. Every normalizer that
// depends only on the mask (|o_i|, sum m) is computed up front, so rows can be
// fed block by block in row order and the sums come out identical to one
// pass over all rows.
#pragma once

#include <cstdint>
#include <span>

#include "driver/sequences.hpp"
#include "grpo/loss_config.hpp"

namespace grpo::detail {

// Whether the coefficients of a token need its whole sequence's logp first:
// sequence-level IS (s_i), vespo (phi_i) and the off-policy sequence mask.
// The fused driver then keeps whole sequences per block or runs its
// two-pass schedule (lm_head_schedule.cpp).
bool needs_whole_sequences(const LossConfig& config);

// Whether the coefficients need every row's entropy first (top_entropy_quantile
// < 1: the threshold is a quantile over the whole call). The fused driver then
// runs its two-pass schedule unless all rows fit one token block.
bool needs_all_rows(const LossConfig& config);

class LossAccumulator {
 public:
  // The batch must already be validated. max_abs_coef: the largest |c_t| whose
  // gradients stay finite in f32 (from the call's bounds; see
  // check_coefficient_bound); the policy part is bounded up front, so only a
  // KL term can exceed it.
  LossAccumulator(const LossConfig& config, std::int64_t batch, std::int64_t seq_len, const BatchInputs& inputs,
                  double max_abs_coef);
  // seqs: the call's sequences (its shape's, or inputs.sequence_offsets).
  LossAccumulator(const LossConfig& config, const Sequences& seqs, const BatchInputs& inputs, double max_abs_coef);

  // Rows [r0, r1): logp and entropy indexed by r - r0. Writes coef[r - r0] and
  // kl[r - r0] (the per-token KL term; kl may be null), nothing else: the
  // caller copies them out, so refusals here (a KL that overflows f32) come
  // before this block writes any output. When needs_whole_sequences(config),
  // [r0, r1) must consist of whole sequences. When needs_all_rows(config),
  // set_entropy_threshold() first. ent_coef (may be null when entropy_coef is
  // 0) receives dLoss/dEnt_t. Call in row order.
  void add_rows(std::int64_t r0, std::int64_t r1, const float* logp, const float* entropy, float* coef, float* kl,
                float* ent_coef = nullptr);

  // top_entropy_quantile: the threshold q from the entropies of all N rows
  // (entropy[r] for row r; only valid rows count). scratch: N floats.
  void set_entropy_threshold(const float* entropy, float* scratch);

  Metrics metrics() const { return metrics(sums()); }

  // Data parallelism (scale_out.cpp): this batch is one rank's share of a
  // batch of global_batch sequences and global_valid valid tokens. The
  // normalizers and the metrics' denominators become the global ones (and
  // num_items_in_batch := global_valid when num_items is set). Call before add_rows.
  void use_global_counts(std::int64_t global_batch, std::int64_t global_valid, bool num_items);
  // The metrics' numerators over this accumulator's rows; a data-parallel
  // step adds them over the ranks (in rank order) and calls metrics(sums).
  struct Sums {
    double loss = 0.0;
    double clip_low = 0.0;
    double clip_high = 0.0;
    double clip_region = 0.0;
    double kl = 0.0;
    double entropy = 0.0;
  };
  Sums sums() const { return {loss_, clip_low_, clip_high_, clip_region_, kl_sum_, entropy_sum_}; }
  Metrics metrics(const Sums& sums) const;

 private:
  void set_norm(std::int64_t batch, std::int64_t num_valid);

  double advantage(std::int64_t row) const;
  double is_weight(std::int64_t row) const;
  double weight(std::int64_t row);  // w_t = dLoss/dl_t
  double log_ratio(std::int64_t row, double logp) const;
  // Adds one ratio to the clip counts (TRL's rules; see Metrics).
  void count_clip(double ratio, double adv, double weight);
  // 1 / max(|o_i|, 1) for the sequence of `row`; rows arrive in order, so it is
  // recomputed once per sequence (no per-batch allocation).
  double seq_norm(std::int64_t row);
  // Per-sequence or per-token input v's value at `row`.
  double per_row(std::span<const float> v, std::int64_t row) const;

  LossConfig config_;
  Sequences seqs_;
  std::int64_t batch_;  // sequences: B, or S packed
  BatchInputs in_;
  std::int64_t norm_seq_ = -1;  // sequence whose norm is cached
  double norm_seq_value_ = 0.0;
  double norm_ = 0.0;  // the loss-type normalizer (except grpo/sapo's per-sequence one)
  double max_abs_coef_ = 0.0;
  std::int64_t num_valid_ = 0;
  std::int64_t metric_batch_ = 0;  // the metrics' denominators: this batch's, or the global ones
  std::int64_t metric_valid_ = 0;
  bool per_sequence_clip_ = false;  // sequence-level IS with [B] advantages: clip ratios over sequences

  double loss_ = 0.0;
  double clip_low_ = 0.0;
  double clip_high_ = 0.0;
  double clip_region_ = 0.0;
  double kl_sum_ = 0.0;
  // Entropy bonus and top-entropy mask (LossConfig::entropy_coef, top_entropy_quantile).
  bool entropy_mask_ = false;       // top_entropy_quantile < 1
  float entropy_threshold_ = 0.0F;  // q: tokens with Ent >= q keep their policy term
  double entropy_norm_ = 0.0;       // 1 / max(sum_t m_t e_t, 1)
  double entropy_sum_ = 0.0;
};

}  // namespace grpo::detail
