// The double-precision reference of grpo-gradcheck, built on tests/oracle.
//
// oracle: lm_head hands the whole problem to grpo::oracle::evaluate_lm_head
// (long double plain loops, O(N*V*H), small shapes only).
// oracle: loss computes the three GEMMs here in double (blocked over the
// vocabulary, two threads, the weight widened from its stored dtype row by
// row) and the loss, logp, entropy and dlogits with grpo::oracle::evaluate,
// so real vocabularies (V = 151936) and hidden sizes (H = 4096) fit in seconds
// and a few hundred MB. dweight is compared row by row as it is produced and
// never stored in double.
#pragma once

#include <vector>

#include "gradcheck_diff.hpp"
#include "synth.hpp"

namespace grpo::bench {

// What a fast path (fused or baseline) produced.
struct HeadResult {
  std::vector<float> logp, entropy, kl;
  std::vector<float> dhidden;  // [N, H] f32, dense
  HostBuffer dweight;          // f32 in the weight's layout
  std::vector<float> dbias;    // [V] or empty
  Metrics metrics;

  // dweight element (v, k) whatever the layout.
  float dweight_at(const Problem& p, std::int64_t v, std::int64_t k) const {
    const std::int64_t h = p.spec.shape.hidden, vocab = p.spec.shape.vocab;
    const std::size_t at =
        static_cast<std::size_t>(p.spec.layout == WeightLayout::vocab_major ? v * h + k : k * vocab + v);
    return dweight.as<float>()[at];
  }
};

struct ReferenceResult {
  double loss = 0.0;
  std::vector<double> logp, entropy;  // [N]
  std::vector<double> dhidden;        // [N, H]
  std::vector<double> dbias;          // [V] or empty
  // oracle: lm_head only (vocab-major); oracle: loss streams dweight into
  // dweight_diffs instead.
  std::vector<double> dweight;
  std::vector<DiffStats> dweight_diffs;  // one per compared result, same order
};

ReferenceResult reference_lm_head(const Problem& p);
ReferenceResult reference_loss(const Problem& p, const std::vector<const HeadResult*>& compare);

}  // namespace grpo::bench
