// The config sections grpo-microbench and grpo-gradcheck share: the problem
// shape, the loss options (every LossConfig field) and how inputs are
// synthesized. Field names and meanings are listed in configs/README.md.
#pragma once

#include <cstdint>
#include <string>

#include "config_reader.hpp"
#include "grpo/grpo.hpp"

namespace grpo::bench {

struct ShapeSpec {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t hidden = 0;  // 0 for logits-level runs
  std::int64_t vocab = 0;

  std::int64_t rows() const { return batch * seq_len; }
  bool operator==(const ShapeSpec&) const = default;
};

enum class Distribution : std::uint8_t { normal, uniform, rademacher, student_t };
enum class OldLogp : std::uint8_t { none, noisy };
// random: i.i.d. Gaussian W and hidden (logits near uniform over V);
// trained_like: logits with per-token entropy in a set range (synth_trained.cpp);
// file: an LM head saved by scripts/export_trained_head.py (input_file.hpp).
enum class InputGenerator : std::uint8_t { random, trained_like, file };

const char* to_string(Distribution d);

// How inputs are synthesized. Everything is a pure function of these fields
// and the shape, so two runs of one config see the same tensors.
struct InputSpec {
  std::uint64_t seed = 1;
  InputGenerator generator = InputGenerator::random;
  // trained_like: per-token target entropies (nats) within [entropy_min,
  // entropy_max], uniform, or a truncated exponential of mean entropy_mean
  // when that is > 0 (most tokens near the low end, as in a trained model).
  // A row cannot hold more than its tail's entropy (~8.2 nats for the Zipf
  // prior at V = 151936, less at small V): higher targets land there.
  double entropy_min = 0.3;
  double entropy_max = 3.0;
  double entropy_mean = 0.0;
  // trained_like: the unigram prior is Zipf, p(rank) ~ (1 + rank)^-zipf_exponent;
  // an id's frequency rank sorts log(1 + id) + N(0, frequency_order_noise)
  // (0: ids in frequency order; large: shuffled).
  double zipf_exponent = 1.0;
  double frequency_order_noise = 1.0;
  // trained_like: std of the context-dependent noise on every logit.
  double tail_noise = 0.7;
  // file: the input file (relative paths from the working directory).
  std::string path;
  // LM head: W ~ N(0, logit_std / sqrt(H)) and hidden ~ unit variance, so the
  // logits have std ~ logit_std (trained heads sit around 2..4). Logits level:
  // the logits themselves have this std.
  double logit_std = 3.0;
  // normal, or student_t (3 degrees of freedom, scaled to unit variance): heavy tails.
  Distribution hidden_distribution = Distribution::normal;
  // Rows whose chosen token dominates, as after training: the chosen logit is
  // raised by peaky_margin (logit units) above where it would be.
  double peaky_fraction = 0.0;
  double peaky_margin = 10.0;
  // noisy: old_logp = logp + N(0, old_logp_noise), logp from a forward-only
  // run of the same shape, so the ratio crosses both clip edges. none: on-policy.
  OldLogp old_logp = OldLogp::noisy;
  double old_logp_noise = 0.3;
  // ref_logp = logp + N(0, ref_logp_noise); built only when loss.beta != 0.
  double ref_logp_noise = 0.1;
  // > 0: is_weight = exp(N(0, is_weight_noise)) per token; 0: absent.
  double is_weight_noise = 0.0;
  Distribution advantage = Distribution::normal;  // normal | uniform | rademacher
  double advantage_scale = 1.0;
  bool advantage_per_token = false;  // [N] instead of the GRPO default [B]
  // Sequences (or, per token, tokens) whose advantage is exactly 0.
  double zero_advantage_fraction = 0.0;
  // Trailing positions of each sequence that are padding (mask 0).
  double masked_fraction = 0.0;
  // > 0: redraw old_logp noise for tokens whose ratio lands within this
  // relative distance of a clip edge, so paths that differ by rounding agree
  // on the branch (gradcheck). 0 for benchmarks.
  double kink_margin = 0.0;

  bool operator==(const InputSpec&) const = default;
};

// "auto" values of the loss config that are filled in from the inputs.
struct LossAutos {
  bool max_completion_length = false;  // = seq_len
  bool num_items_in_batch = false;     // = valid tokens of the synthesized batch
};

struct LossSpec {
  LossConfig config;
  LossAutos autos;
};

ShapeSpec parse_shape(MapReader& parent, bool needs_hidden, const std::string& impl_name);
LossSpec parse_loss(MapReader& parent);
InputSpec parse_inputs(MapReader& parent);
DType parse_dtype(MapReader& r, const std::string& key, DType fallback);
WeightLayout parse_layout(MapReader& r, const std::string& key);

// A config's file name without directory and extension.
std::string file_stem(const std::string& path);

}  // namespace grpo::bench
