// The online log-sum-exp merge of two segments' statistics (see stage_kernels.hpp).
#include <cmath>
#include <limits>

#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {

RowStats merge(const RowStats& a, const RowStats& b) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (b.max == kNegInf) return a;
  if (a.max == kNegInf) return b;
  const float m = a.max > b.max ? a.max : b.max;
  const float da = a.max - m;  // <= 0
  const float db = b.max - m;  // <= 0
  const float ea = std::exp(da);
  const float eb = std::exp(db);
  // sum e^(x-m) (x-m) = e^(a.max-m) * (D_a + (a.max-m) S_a), same for b.
  return {m, ea * a.sum + eb * b.sum, ea * (a.dot + da * a.sum) + eb * (b.dot + db * b.sum)};
}

}  // namespace grpo::kernels
