#include "gradcheck_reference.hpp"

#include <algorithm>

#include <tbb/blocked_range.h>
#include <tbb/combinable.h>
#include <tbb/parallel_for.h>

#include "oracle/oracle.hpp"

namespace grpo::bench {
namespace {

// Vocabulary rows widened to double at a time: 16 rows of H <= 8192 doubles
// stay within 1 MiB, so a block is reused from L2 across all N token rows.
constexpr std::int64_t kVocabBlock = 16;

// The double loops are the whole cost of oracle: loss; build them for AVX-512
// when the CPU has it (function multi-versioning keeps the binary portable).
__attribute__((target_clones("avx512f", "default"))) double dot(const double* a, const double* b, std::int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums let the compiler vectorize
  std::int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  }
  double s = 0.0;
  for (; k < n; ++k) s += a[k] * b[k];
  for (const double x : acc) s += x;
  return s;
}

__attribute__((target_clones("avx512f", "default"))) void axpy(double c, const double* x, double* y, std::int64_t n) {
  for (std::int64_t k = 0; k < n; ++k) y[k] += c * x[k];
}

std::vector<double> widen(const HostBuffer& b, DType dtype, std::size_t count) {
  std::vector<double> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = load_float(b.data(), dtype, i);
  return out;
}

// Rows [v0, v1) of W as doubles, vocab-major, whatever the stored layout.
void weight_rows(const Problem& p, std::int64_t v0, std::int64_t v1, std::vector<double>& out) {
  const std::int64_t h = p.spec.shape.hidden, vocab = p.spec.shape.vocab;
  const bool vm = p.spec.layout == WeightLayout::vocab_major;
  out.resize(static_cast<std::size_t>((v1 - v0) * h));
  for (std::int64_t v = v0; v < v1; ++v) {
    for (std::int64_t k = 0; k < h; ++k) {
      out[(v - v0) * h + k] =
          load_float(p.weight.data(), p.spec.dtype, static_cast<std::size_t>(vm ? v * h + k : k * vocab + v));
    }
  }
}

oracle::Problem head_problem(const Problem& p) {
  oracle::Problem o;
  o.batch = p.spec.shape.batch;
  o.seq_len = p.spec.shape.seq_len;
  o.vocab = p.spec.shape.vocab;
  o.ids = p.ids;
  o.mask.assign(p.mask.begin(), p.mask.end());
  o.advantages.assign(p.advantages.begin(), p.advantages.end());
  o.old_logp.assign(p.old_logp.begin(), p.old_logp.end());
  o.ref_logp.assign(p.ref_logp.begin(), p.ref_logp.end());
  o.is_weight.assign(p.is_weight.begin(), p.is_weight.end());
  o.config = p.config;
  return o;
}

template <class F>
void for_vocab_blocks(std::int64_t vocab, F&& f) {
  tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, (vocab + kVocabBlock - 1) / kVocabBlock, 1),
                    [&](const tbb::blocked_range<std::int64_t>& r) {
                      std::vector<double> w;
                      for (std::int64_t b = r.begin(); b != r.end(); ++b) {
                        const std::int64_t v0 = b * kVocabBlock, v1 = std::min(vocab, v0 + kVocabBlock);
                        f(v0, v1, w);
                      }
                    });
}

}  // namespace

ReferenceResult reference_lm_head(const Problem& p) {
  const ShapeSpec& s = p.spec.shape;
  oracle::LmHeadProblem o;
  o.head = head_problem(p);
  o.hidden_size = s.hidden;
  o.hidden = widen(p.hidden, p.spec.dtype, static_cast<std::size_t>(s.rows() * s.hidden));
  weight_rows(p, 0, s.vocab, o.weight);
  if (!p.bias.empty()) o.bias = widen(p.bias, DType::f32, static_cast<std::size_t>(s.vocab));
  oracle::LmHeadResult res = oracle::evaluate_lm_head(o);
  ReferenceResult r;
  r.loss = res.head.loss;
  r.logp = std::move(res.head.logp);
  r.entropy = std::move(res.head.entropy);
  r.dhidden = std::move(res.dhidden);
  r.dweight = std::move(res.dweight);
  r.dbias = std::move(res.dbias);
  return r;
}

ReferenceResult reference_loss(const Problem& p, const std::vector<const HeadResult*>& compare) {
  const ShapeSpec& s = p.spec.shape;
  const std::int64_t n = s.rows(), h = s.hidden, vocab = s.vocab;
  const std::vector<double> hid = widen(p.hidden, p.spec.dtype, static_cast<std::size_t>(n * h));
  const std::vector<double> bias =
      p.bias.empty() ? std::vector<double>{} : widen(p.bias, DType::f32, static_cast<std::size_t>(vocab));

  // Logits z = h W^T + b, in double.
  oracle::Problem head = head_problem(p);
  head.logits.assign(static_cast<std::size_t>(n * vocab), 0.0);
  for_vocab_blocks(vocab, [&](std::int64_t v0, std::int64_t v1, std::vector<double>& w) {
    weight_rows(p, v0, v1, w);
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t v = v0; v < v1; ++v) {
        head.logits[t * vocab + v] = dot(&hid[t * h], &w[(v - v0) * h], h) + (bias.empty() ? 0.0 : bias[v]);
      }
    }
  });
  oracle::Result res = oracle::evaluate(head);
  head.logits = {};
  const std::vector<double>& dz = res.dlogits;

  // dh = dz W (per-thread partial sums), dW = dz^T h row by row, db = column sums.
  ReferenceResult r;
  r.loss = res.loss;
  r.logp = std::move(res.logp);
  r.entropy = std::move(res.entropy);
  if (!bias.empty()) r.dbias.assign(static_cast<std::size_t>(vocab), 0.0);
  tbb::combinable<std::vector<double>> dh_parts(
      [&] { return std::vector<double>(static_cast<std::size_t>(n * h), 0.0); });
  tbb::combinable<std::vector<DiffStats>> diff_parts([&] { return std::vector<DiffStats>(compare.size()); });
  for_vocab_blocks(vocab, [&](std::int64_t v0, std::int64_t v1, std::vector<double>& w) {
    weight_rows(p, v0, v1, w);
    std::vector<double>& dh = dh_parts.local();
    std::vector<DiffStats>& diffs = diff_parts.local();
    std::vector<double> dw(static_cast<std::size_t>(h));
    for (std::int64_t v = v0; v < v1; ++v) {
      std::fill(dw.begin(), dw.end(), 0.0);
      double db = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        const double c = dz[t * vocab + v];
        if (c == 0.0) continue;
        axpy(c, &w[(v - v0) * h], &dh[t * h], h);
        axpy(c, &hid[t * h], dw.data(), h);
        db += c;
      }
      if (!bias.empty()) r.dbias[v] = db;
      for (std::size_t i = 0; i < compare.size(); ++i) {
        for (std::int64_t k = 0; k < h; ++k) diffs[i].add(compare[i]->dweight_at(p, v, k), dw[k], v * h + k);
      }
    }
  });
  r.dhidden.assign(static_cast<std::size_t>(n * h), 0.0);
  dh_parts.combine_each([&](const std::vector<double>& part) {
    for (std::size_t i = 0; i < part.size(); ++i) r.dhidden[i] += part[i];
  });
  r.dweight_diffs.assign(compare.size(), DiffStats{});
  diff_parts.combine_each([&](const std::vector<DiffStats>& part) {
    for (std::size_t i = 0; i < part.size(); ++i) r.dweight_diffs[i].merge(part[i]);
  });
  return r;
}

}  // namespace grpo::bench
