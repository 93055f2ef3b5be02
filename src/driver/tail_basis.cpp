// The filtered backward's numerics (see tail_basis.hpp).
#include "driver/tail_basis.hpp"

#include <cmath>

#include "driver/filter_plan.hpp"

namespace grpo::detail {

void fill_probes(float* y, std::int64_t ld, std::int64_t k, std::int64_t kc, std::int64_t n) {
  for (std::int64_t r = k; r < kc; ++r) {
    for (std::int64_t c = 0; c < n; ++c) y[r * ld + c] = tail_sign(c, 1000 + r);
  }
}

void tail_basis(const float* y, std::int64_t ld_y, std::int64_t rows, std::int64_t k, std::int64_t n, double* work,
                std::byte* basis, std::int64_t ld_basis, DType type, float* dual) {
  double* q = work;
  double* m = work + rows * n;
  const auto dot = [&](const double* a, const double* b) {
    double d = 0.0;
    for (std::int64_t c = 0; c < n; ++c) d += a[c] * b[c];
    return d;
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    double* qr = q + r * n;
    for (std::int64_t c = 0; c < n; ++c) qr[c] = y[r * ld_y + c];
    const double norm0 = std::sqrt(dot(qr, qr));
    for (int pass = 0; pass < 2; ++pass) {
      for (std::int64_t t = 0; t < r; ++t) {
        const double d = dot(q + t * n, qr);
        for (std::int64_t c = 0; c < n; ++c) qr[c] -= d * q[t * n + c];
      }
    }
    const double norm = std::sqrt(dot(qr, qr));
    const double scale = norm0 > 0.0 && norm > 1e-6 * norm0 ? 1.0 / norm : 0.0;
    for (std::int64_t c = 0; c < n; ++c) {
      // The rounded value, kept in q for the Gram matrix below.
      if (type == DType::bf16) {
        const std::uint16_t b = kernels::float_to_bf16(static_cast<float>(qr[c] * scale));
        reinterpret_cast<std::uint16_t*>(basis)[r * ld_basis + c] = b;
        qr[c] = kernels::bf16_to_float(b);
      } else {
        const auto f = static_cast<float>(qr[c] * scale);
        reinterpret_cast<float*>(basis)[r * ld_basis + c] = f;
        qr[c] = f;
      }
    }
  }
  // M = Bb Bb^T of the first k rows (1 on the diagonal of a zero row: its
  // dual row stays zero), Cholesky M = L L^T in place.
  for (std::int64_t r = 0; r < k; ++r) {
    for (std::int64_t t = 0; t <= r; ++t) m[r * k + t] = dot(q + r * n, q + t * n);
    if (m[r * k + r] == 0.0) m[r * k + r] = 1.0;
  }
  for (std::int64_t r = 0; r < k; ++r) {
    for (std::int64_t t = 0; t <= r; ++t) {
      double v = m[r * k + t];
      for (std::int64_t x = 0; x < t; ++x) v -= m[r * k + x] * m[t * k + x];
      m[r * k + t] = r == t ? std::sqrt(v) : v / m[t * k + t];
    }
  }
  // dual = M^-1 Bb, column by column: L z = b, L^T x = z.
  for (std::int64_t c = 0; c < n; ++c) {
    double z[kTailRank];
    for (std::int64_t r = 0; r < k; ++r) {
      double v = q[r * n + c];
      for (std::int64_t x = 0; x < r; ++x) v -= m[r * k + x] * z[x];
      z[r] = v / m[r * k + r];
    }
    for (std::int64_t r = k - 1; r >= 0; --r) {
      double v = z[r];
      for (std::int64_t x = r + 1; x < k; ++x) v -= m[x * k + r] * z[x];
      z[r] = v / m[r * k + r];
    }
    for (std::int64_t r = 0; r < k; ++r) dual[r * n + c] = static_cast<float>(z[r]);
  }
}

}  // namespace grpo::detail
