#include "gradcheck_diff.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace grpo::bench {

void DiffStats::add(double a, double b, std::int64_t index) {
  ++count;
  if (!std::isfinite(a) || !std::isfinite(b)) {
    ++nonfinite;
    if (worst < 0) worst = index;
    return;
  }
  const double d = std::abs(a - b);
  sum_sq_diff += d * d;
  sum_sq_ref += b * b;
  if (d > max_abs || worst < 0) {
    if (d > max_abs) max_abs = d;
    worst = index;
  }
  max_ref = std::max(max_ref, std::abs(b));
}

void DiffStats::merge(const DiffStats& o) {
  if (o.max_abs > max_abs || worst < 0) worst = o.worst;
  max_abs = std::max(max_abs, o.max_abs);
  max_ref = std::max(max_ref, o.max_ref);
  count += o.count;
  nonfinite += o.nonfinite;
  sum_sq_diff += o.sum_sq_diff;
  sum_sq_ref += o.sum_sq_ref;
}

bool CheckRow::passed() const {
  return diff.nonfinite == 0 && diff.count > 0 && diff.max_abs <= tolerance.abs && diff.rel() <= tolerance.rel;
}

bool print_verdict(const std::string& title, const std::vector<CheckRow>& rows) {
  std::printf("%s\n", title.c_str());
  std::printf("%-9s %-30s %12s %12s %12s %12s %10s %10s  %s\n", "quantity", "pair", "max_abs", "max_rel", "tol_abs",
              "tol_rel", "max|ref|", "l2_rel", "verdict");
  bool all = true;
  for (const CheckRow& r : rows) {
    const bool ok = r.passed();
    all = all && ok;
    std::string verdict = ok ? "ok" : "FAIL";
    if (r.diff.nonfinite > 0) verdict += " (" + std::to_string(r.diff.nonfinite) + " non-finite)";
    if (r.diff.count == 0) verdict += " (nothing compared)";
    if (!ok && r.diff.worst >= 0) verdict += " worst at " + std::to_string(r.diff.worst);
    std::printf("%-9s %-30s %12.3e %12.3e %12.3e %12.3e %10.3e %10.3e  %s\n", r.quantity.c_str(), r.pair.c_str(),
                r.diff.max_abs, r.diff.rel(), r.tolerance.abs, r.tolerance.rel, r.diff.max_ref, r.diff.rel_l2(),
                verdict.c_str());
  }
  std::printf("%s\n", all ? "gradcheck: PASS" : "gradcheck: FAIL");
  return all;
}

}  // namespace grpo::bench
