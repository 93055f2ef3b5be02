#include "filter_analysis.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "runners.hpp"

namespace grpo::bench {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Segments of kFilterSegmentRows consecutive rows (start, length), evenly
// spread; segments == 0: every row, segment after segment.
std::vector<std::pair<std::int64_t, std::int64_t>> segments_of(std::int64_t n, int segments) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (segments == 0 || n <= kFilterSegmentRows) {
    for (std::int64_t start = 0; start < n; start += kFilterSegmentRows)
      out.emplace_back(start, std::min(kFilterSegmentRows, n - start));
    return out;
  }
  for (int i = 0; i < segments; ++i) {
    const std::int64_t mid = (2 * i + 1) * n / (2 * segments);
    const std::int64_t start =
        std::clamp<std::int64_t>(mid - kFilterSegmentRows / 2, 0, n - kFilterSegmentRows) / 32 * 32;
    if (out.empty() || start >= out.back().first + kFilterSegmentRows) out.emplace_back(start, kFilterSegmentRows);
  }
  return out;
}

// pos[id] = position of id in descending order of key (ties by id).
std::vector<std::int64_t> positions_by(const std::vector<double>& key) {
  std::vector<std::int64_t> order(key.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return key[a] > key[b]; });
  std::vector<std::int64_t> pos(key.size());
  for (std::size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<std::int64_t>(i);
  return pos;
}

}  // namespace

FilterAnalysis analyze_filter(const BenchConfig& config, const FilterAnalysisOptions& o) {
  if (!is_lm_head(config.impl)) throw std::invalid_argument("--analyze-filter needs an LM-head config");
  ProblemSpec spec = problem_spec(config);
  spec.inputs.old_logp = OldLogp::none;  // the filter looks at p and the ids alone
  spec.loss.config.beta = 0.0F;
  const auto t0 = std::chrono::steady_clock::now();
  const Problem p = synthesize(spec);
  FilterAnalysis out;
  out.synth_s = seconds_since(t0);
  const std::int64_t n = spec.shape.rows(), v = spec.shape.vocab, h = spec.shape.hidden;

  // Average forward logit per column: W (mean of the valid rows' h).
  std::vector<double> mean_h(static_cast<std::size_t>(h), 0.0);
  double valid = 0.0;
  for (std::int64_t r = 0; r < n; ++r) {
    if (p.mask[r] == 0.0F) continue;
    valid += 1.0;
    for (std::int64_t k = 0; k < h; ++k) mean_h[k] += load_float(p.hidden.data(), spec.dtype, r * h + k);
  }
  for (double& x : mean_h) x /= std::max(valid, 1.0);
  const bool vm = spec.layout == WeightLayout::vocab_major;
  std::vector<double> avg_logit(static_cast<std::size_t>(v));
  tbb::task_arena arena(spec.threads > 0 ? spec.threads : tbb::this_task_arena::max_concurrency());
  arena.execute([&] {
    tbb::parallel_for(std::int64_t{0}, v, [&](std::int64_t t) {
      double z = p.bias.empty() ? 0.0 : p.bias.as<float>()[t];
      for (std::int64_t k = 0; k < h; ++k)
        z += mean_h[k] * load_float(p.weight.data(), spec.dtype, static_cast<std::size_t>(vm ? t * h + k : k * v + t));
      avg_logit[t] = z;
    });
  });

  // Significant ids of every analysed row (empty for masked rows).
  const std::vector<std::pair<std::int64_t, std::int64_t>> segs = segments_of(n, o.segments);
  std::vector<std::vector<std::vector<std::int32_t>>> sig(segs.size());
  std::vector<double> counts(static_cast<std::size_t>(v), 0.0), even_counts(counts);
  double above = 0.0, logp = 0.0;
  for (std::size_t s = 0; s < segs.size(); ++s) {
    std::vector<std::int64_t> rows(static_cast<std::size_t>(segs[s].second));
    std::iota(rows.begin(), rows.end(), segs[s].first);
    const std::vector<float> z = reference_logits(p, rows, spec.threads);
    sig[s].resize(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (p.mask[rows[i]] == 0.0F) continue;
      RowFacts f = row_facts(std::span<const float>(&z[i * v], v), p.ids[rows[i]], o.eps);
      out.stats.entropy.push_back(f.entropy);
      logp += f.logp;
      above += static_cast<double>(f.significant.size());
      for (const std::int32_t id : f.significant) {
        counts[id] += 1.0;
        if (s % 2 == 0) even_counts[id] += 1.0;
      }
      sig[s][i] = std::move(f.significant);
    }
  }
  out.analysis_s = seconds_since(t0) - out.synth_s;
  InputStats& st = out.stats;
  st.eps = o.eps;
  st.rows = static_cast<std::int64_t>(st.entropy.size());
  if (st.rows > 0) {
    std::vector<double> e = st.entropy;
    std::sort(e.begin(), e.end());
    auto q = [&](double f) { return e[static_cast<std::size_t>(f * static_cast<double>(e.size() - 1))]; };
    st.entropy_mean = std::accumulate(e.begin(), e.end(), 0.0) / static_cast<double>(e.size());
    st.entropy_min = e.front();
    st.entropy_max = e.back();
    st.entropy_p10 = q(0.1);
    st.entropy_p50 = q(0.5);
    st.entropy_p90 = q(0.9);
    st.logp_mean = logp / static_cast<double>(st.rows);
    st.significant_per_row = above / static_cast<double>(st.rows);
    st.frac_above = st.significant_per_row / static_cast<double>(v);
  }

  std::vector<double> natural_key(static_cast<std::size_t>(v));
  for (std::int64_t t = 0; t < v; ++t) natural_key[t] = -static_cast<double>(t);
  struct Order {
    const char* name;
    std::vector<std::int64_t> pos;
    bool odd_segments_only;  // sig_heldout: ordered on the even segments, scored on the odd ones
  };
  std::vector<Order> orders = {{"natural", positions_by(natural_key), false},
                               {"avg_logit", positions_by(avg_logit), false},
                               {"sig_count", positions_by(counts), false}};
  if (segs.size() >= 2) orders.push_back({"sig_heldout", positions_by(even_counts), true});
  for (const auto& [name, pos, odd_only] : orders) {
    for (const std::int64_t br : o.block_rows) {
      for (const std::int64_t tc : o.tile_cols) {
        const std::int64_t tiles = (v + tc - 1) / tc;
        double kept = 0.0, total = 0.0;  // FLOP weights: rows x columns of each block
        std::vector<char> hit(static_cast<std::size_t>(tiles));
        for (std::size_t s = odd_only ? 1 : 0; s < segs.size(); s += odd_only ? 2 : 1) {
          const std::int64_t seg_rows = segs[s].second;
          for (std::int64_t r0 = 0; r0 < seg_rows; r0 += br) {
            const std::int64_t rows = std::min(br, seg_rows - r0);
            std::fill(hit.begin(), hit.end(), 0);
            for (std::int64_t r = r0; r < r0 + rows; ++r) {
              for (const std::int32_t id : sig[s][r]) hit[pos[id] / tc] = 1;
            }
            for (std::int64_t t = 0; t < tiles; ++t) {
              const auto w = static_cast<double>(rows * (std::min(v, (t + 1) * tc) - t * tc));
              total += w;
              if (hit[t] != 0) kept += w;
            }
          }
        }
        out.blocks.push_back({name, br, tc, total > 0.0 ? 1.0 - kept / total : 0.0});
      }
    }
  }
  return out;
}

std::string FilterAnalysis::table() const {
  char line[256];
  std::snprintf(line, sizeof line, "inputs built in %.1f s, rows analysed in %.1f s\n", synth_s, analysis_s);
  std::string s = line + stats.summary() + "\n";
  // The backward GEMMs are two of the step's three: skipping a fraction f of
  // them bounds the step's speedup at 1 / (1/3 + 2/3 (1 - f)).
  s += "skippable fraction of the backward GEMMs' (row block x vocab tile) blocks; in brackets the step speedup "
       "bound 1 / (1/3 + 2/3 (1 - f))\n";
  std::snprintf(line, sizeof line, "%-11s %6s", "order", "rows");
  s += line;
  std::vector<std::int64_t> cols;
  for (const auto& b : blocks) {
    if (std::find(cols.begin(), cols.end(), b.tile_cols) == cols.end()) cols.push_back(b.tile_cols);
  }
  for (const std::int64_t c : cols) {
    std::snprintf(line, sizeof line, " %17s", (std::to_string(c) + " cols").c_str());
    s += line;
  }
  s += "\n";
  for (std::size_t i = 0; i < blocks.size(); i += cols.size()) {
    std::snprintf(line, sizeof line, "%-11s %6lld", blocks[i].order.c_str(),
                  static_cast<long long>(blocks[i].block_rows));
    s += line;
    for (std::size_t j = i; j < i + cols.size() && j < blocks.size(); ++j) {
      const double f = blocks[j].skip_frac;
      std::snprintf(line, sizeof line, " %8.4f (%5.2fx)", f, 1.0 / (1.0 / 3.0 + 2.0 / 3.0 * (1.0 - f)));
      s += line;
    }
    s += "\n";
  }
  return s;
}

}  // namespace grpo::bench
