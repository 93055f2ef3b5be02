// Stage kernels, both paths, against a double-precision reference computed
// here. Every buffer sits between PROT_NONE guard pages with the rest of its
// mapping filled with 0xff bytes (NaN in f32, bf16 and f16): an access outside
// [0, n) faults, or shows up as a NaN in a result, or as a changed byte.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "grpo/version.hpp"
#include "kernels/f16.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {
namespace {

constexpr double kU = 0x1p-24;     // unit roundoff of f32: half an ulp of 1
constexpr double kUBf16 = 0x1p-8;  // bf16 keeps 8 significant bits
constexpr double kUF16 = 0x1p-11;  // f16 keeps 11 significant bits
constexpr double kExpU = 4.0;      // exp error <= 2 ulp = 4u on both paths (ExpAccuracy below)
constexpr float kInf = std::numeric_limits<float>::infinity();
// Vector (16) and segment (2048) edges, several segments plus a tail, and the Qwen vocabulary.
const std::vector<std::int64_t> kLengths = {0, 1, 15, 16, 17, 31, 33, 2047, 2048, 2049, 3 * 2048 + 5, 151936};

enum class Place { head, tail, head_plus_one };  // aligned / flush with the end / misaligned by one element
constexpr Place kPlaces[] = {Place::head, Place::tail, Place::head_plus_one};

class Guarded {
 public:
  Guarded(std::int64_t n, std::size_t elem, Place place) : bytes_(static_cast<std::size_t>(n) * elem) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    body_ = (bytes_ + elem + page - 1) / page * page;
    void* map = mmap(nullptr, body_ + 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) std::abort();
    map_ = static_cast<char*>(map);
    mprotect(map_, page, PROT_NONE);
    mprotect(map_ + page + body_, page, PROT_NONE);
    lo_ = map_ + page;
    std::memset(lo_, 0xff, body_);
    data_ = place == Place::head ? lo_ : place == Place::tail ? lo_ + body_ - bytes_ : lo_ + elem;
    size_ = body_ + 2 * page;
  }
  ~Guarded() { munmap(map_, size_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  bool outside_untouched() const {
    for (const char* p = lo_; p != lo_ + body_; ++p) {
      if ((p < data_ || p >= data_ + bytes_) && static_cast<unsigned char>(*p) != 0xff) return false;
    }
    return true;
  }

 private:
  std::size_t bytes_, body_ = 0, size_ = 0;
  char* map_ = nullptr;
  char* lo_ = nullptr;
  char* data_ = nullptr;
};

std::size_t size_of(Elem t) { return t == Elem::f32 ? 4 : 2; }

// Independent f16 decoding (bit fields, no _Float16): the reference side.
double f16_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const double mag = e == 0    ? std::ldexp(h & 0x3ff, -24)
                     : e == 31 ? ((h & 0x3ff) != 0 ? std::nan("") : kInf)
                               : std::ldexp(1024 + (h & 0x3ff), e - 25);
  return (h & 0x8000) != 0 ? -mag : mag;
}

// Writes v (already representable in t) into a guarded buffer of type t.
void fill(const Guarded& g, Elem t, const std::vector<float>& v) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (t == Elem::f32) {
      g.as<float>()[i] = v[i];
    } else if (t == Elem::bf16) {
      g.as<std::uint16_t>()[i] = float_to_bf16(v[i]);
    } else {
      const auto h = static_cast<_Float16>(v[i]);
      std::memcpy(g.as<std::uint16_t>() + i, &h, 2);
    }
  }
}

// Rounds v to what type t can hold, so fill() stores it exactly.
void round_to(Elem t, std::vector<float>& v) {
  for (float& x : v) x = t == Elem::bf16 ? bf16_to_float(float_to_bf16(x)) : t == Elem::f16 ? float(_Float16(x)) : x;
}

enum class Kind { normal, huge, banned, offset, equal, all_neg_inf };
constexpr int kKinds = 6;
const char* kKindNames[] = {"normal", "uniform +-1e4", "banned(-inf)", "+-1e4 offset", "all-equal", "all -inf"};

std::vector<float> make_row(Kind kind, std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0F, 3.0F);  // a realistic logit spread
  std::uniform_real_distribution<float> wide(-1e4F, 1e4F);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) {
    switch (kind) {
      case Kind::normal: v[i] = normal(rng); break;
      case Kind::huge: v[i] = wide(rng); break;  // a few terms matter, the rest underflow
      case Kind::offset: v[i] = (seed % 2 != 0 ? 1e4F : -1e4F) + normal(rng); break;  // x - max rounds at 1e4
      case Kind::banned: v[i] = (i == 0 || i + 1 == v.size() || rng() % 8 == 0) ? -kInf : normal(rng); break;
      case Kind::equal: v[i] = 7.25F; break;
      case Kind::all_neg_inf: v[i] = -kInf; break;
    }
  }
  return v;
}

struct Ref {
  double sum = 0.0, dot = 0.0, dot2 = 0.0;  // S, D and Q = sum e d^2, relative to the kernel's (float) max
};

Ref reference(const std::vector<float>& z, float scale, float max) {
  Ref r;
  for (float zi : z) {
    if (zi == -kInf) continue;
    const double d = double(zi) * scale - max;  // z * scale is exact in double
    const double e = std::exp(d);
    r.sum += e;
    r.dot += e * d;
    r.dot2 += e * d * d;
  }
  return r;
}

float expected_max(const std::vector<float>& z, float scale) {
  float m = -kInf;
  for (float zi : z) m = std::max(m, zi * scale);  // the kernels' x = fl(z * scale)
  return m;
}

// Worst-case error of S and D in f32. The kernels round x_v = fl(z_v * scale)
// (absolute u|x_v| <= u(|M| + |d_v|), none when scale == 1) and d_v = x_v - M
// (u|d_v|), so e_v = exp(d_v) is off by u(m + 2|d_v|) relative (m = |M| when
// scaled, else 0) plus exp's own 4u; a sum of same-sign terms accumulated
// depth deep adds depth*u relative. Summed over v:
//   |dS| <= u((depth + 4 + m) S + 2|D|).
// D's terms e_v d_v carry e_v's error times |d_v|, d_v's own absolute error
// times e_v, and the product's rounding:
//   |dD| <= u((depth + 7 + m)|D| + 2Q + m S),  Q = sum e_v d_v^2.
// Underflow flushed to 0 loses < n * 104 * FLT_MIN (|d| < 104 below there).
void expect_stats(const RowStats& got, float max, const Ref& ref, double depth, std::int64_t n, bool scaled) {
  ASSERT_EQ(got.max, max);
  if (max == -kInf) {
    EXPECT_EQ(got.sum, 0.0F);
    EXPECT_EQ(got.dot, 0.0F);
    return;
  }
  const double flush = double(n) * 104 * std::numeric_limits<float>::min();
  const double m = scaled ? std::fabs(double(max)) : 0.0;
  EXPECT_NEAR(got.sum, ref.sum, kU * ((depth + kExpU + m) * ref.sum + 2 * std::fabs(ref.dot)) + flush);
  EXPECT_NEAR(got.dot, ref.dot,
              kU * ((depth + kExpU + 3 + m) * std::fabs(ref.dot) + 2 * ref.dot2 + m * ref.sum) + flush);
}

// Accumulation depth of row_stats: one segment, plus 8 roundings per merge
// (the rescale exp, its argument, the products and sums in merge()).
double segmented_depth(std::int64_t n) {
  return double(std::min(n, kSegment)) + 8.0 * double((n + kSegment - 1) / kSegment);
}

enum class Path { scalar, avx512, avx2 };

class StageKernelsTest : public testing::TestWithParam<std::tuple<Path, std::int64_t>> {
 protected:
  void SetUp() override {
    switch (std::get<0>(GetParam())) {
      case Path::scalar: k_ = &scalar_kernels(); break;
      case Path::avx512:
        k_ = avx512_kernels();
        if (k_ == nullptr) GTEST_SKIP() << "CPU lacks AVX-512F/BW/DQ/VL";
        break;
      case Path::avx2:
        k_ = avx2_kernels();
        if (k_ == nullptr) GTEST_SKIP() << "CPU lacks AVX2/FMA/F16C";
        break;
    }
    n_ = std::get<1>(GetParam());
  }
  const StageKernels* k_ = nullptr;
  std::int64_t n_ = 0;
};

TEST_P(StageKernelsTest, RowStats) {
  for (Elem t : {Elem::f32, Elem::bf16}) {
    for (int kind = 0; kind < kKinds; ++kind) {
      for (float scale : {1.0F, 1.0F / 0.7F}) {  // tau = 0.7: x = z / tau
        const Place place = kPlaces[kind % 3];
        const std::uint32_t seed = 1000u + 7u * std::uint32_t(n_) + 131u * std::uint32_t(kind);
        SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " kind=" << kKindNames[kind]
                                        << " bf16=" << (t == Elem::bf16) << " scale=" << scale);
        std::vector<float> z = make_row(Kind(kind), n_, seed);
        round_to(t, z);
        Guarded buf(n_, size_of(t), place);
        fill(buf, t, z);
        const RowStats st = k_->row_stats(buf.as<void>(), t, n_, scale);
        const float max = expected_max(z, scale);
        expect_stats(st, max, reference(z, scale, max), segmented_depth(n_), n_, scale != 1.0F);
        if (Kind(kind) == Kind::equal) {  // every e = exp(0) = 1 exactly, and n <= 2^24 sums exactly
          EXPECT_EQ(st.sum, float(n_));
          EXPECT_EQ(st.dot, 0.0F);
        }
      }
    }
    if (n_ == 0) continue;
    // Non-finite input must reach the LSE so the driver can refuse the row.
    std::vector<float> z = make_row(Kind::normal, n_, 7);
    Guarded buf(n_, size_of(t), Place::tail);
    z.back() = std::nanf("");
    fill(buf, t, z);
    RowStats st = k_->row_stats(buf.as<void>(), t, n_, 1.0F);
    EXPECT_TRUE(std::isnan(st.max + std::log(st.sum)));
    z.back() = 0.0F;
    z.front() = kInf;
    fill(buf, t, z);
    st = k_->row_stats(buf.as<void>(), t, n_, 1.0F);
    EXPECT_FALSE(std::isfinite(st.max + std::log(st.sum)));
    EXPECT_NE(st.max + std::log(st.sum), -kInf);
  }
}

TEST_P(StageKernelsTest, RowStatsStore) {
  for (Elem out_t : {Elem::f32, Elem::f16}) {
    for (int kind = 0; kind < kKinds; ++kind) {
      const Place place = kPlaces[kind % 3];
      const float scale = 1.0F / 0.7F;
      const std::uint32_t seed = 2000u + 7u * std::uint32_t(n_) + 131u * std::uint32_t(kind);
      SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " kind=" << kKindNames[kind]
                                      << " f16=" << (out_t == Elem::f16));
      const std::vector<float> z = make_row(Kind(kind), n_, seed);
      Guarded in(n_, 4, place);
      Guarded out(n_, size_of(out_t), place);
      fill(in, Elem::f32, z);
      const RowStats st = k_->row_stats_store(in.as<float>(), n_, scale, out.as<void>(), out_t);
      const float max = expected_max(z, scale);
      expect_stats(st, max, reference(z, scale, max), double(n_), n_, true);  // unsegmented: depth n
      EXPECT_TRUE(out.outside_untouched());
      for (std::int64_t i = 0; i < n_; ++i) {
        // u = fl(fl(z * scale) - max): u|x| + u|u|, then for f16 half an ulp
        // (2^-11 relative, 2^-25 absolute in the subnormal range), or -inf
        // beyond the f16 range.
        const double x = double(z[i]) * scale;
        const double u_ref = max == -kInf || z[i] == -kInf ? -kInf : x - max;
        const double u = out_t == Elem::f32 ? out.as<float>()[i] : f16_value(out.as<std::uint16_t>()[i]);
        if (std::isinf(u_ref) || (out_t == Elem::f16 && u_ref < -65520.0)) {
          ASSERT_EQ(u, -kInf) << "i=" << i;
          continue;
        }
        const double tol32 = kU * (std::fabs(u_ref) + std::fabs(x));
        const double tol = tol32 + (out_t == Elem::f16 ? kUF16 * (std::fabs(u_ref) + tol32) + 0x1p-25 : 0.0);
        ASSERT_NEAR(u, u_ref, tol) << "i=" << i;
      }
    }
  }
}

TEST_P(StageKernelsTest, DlogitsRow) {
  int combo = 0;
  for (Elem in_t : {Elem::f32, Elem::bf16, Elem::f16}) {
    for (Elem out_t : {Elem::f32, Elem::bf16}) {
      for (int kind = 0; kind <= int(Kind::offset); ++kind) {
        for (std::int64_t target : {std::int64_t{-1}, std::int64_t{0}, n_ / 2, n_ - 1, n_, n_ + 3}) {
          const bool with_bias = (combo % 2) == 0;
          const Place place = kPlaces[combo++ % 3];
          const std::uint32_t seed =
              3000u + 7u * std::uint32_t(n_) + 131u * std::uint32_t(kind) + 17u * std::uint32_t(combo);
          SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " kind=" << kKindNames[kind]
                                          << " in=" << int(in_t) << " out=" << int(out_t) << " target=" << target);
          std::vector<float> z = make_row(Kind(kind), n_, seed);
          // f16 holds u = x - max in the fused driver; f32/bf16 hold raw logits.
          const float zmax = expected_max(z, 1.0F);
          const float scale = in_t == Elem::f16 ? 1.0F : 1.0F / 0.7F;
          const float shift = in_t == Elem::f16 ? 0.0F : 0.375F;  // a shift that is not 0 goes through the fma
          if (in_t == Elem::f16) {
            for (float& v : z) v -= zmax == -kInf ? 0.0F : zmax;
          }
          round_to(in_t, z);
          // lse of x = z * scale + shift in double; 0 when no entry is finite
          // (then p = 0 everywhere, a valid call).
          double xmax = -kInf;
          for (float v : z) xmax = std::max(xmax, double(v) * scale + shift);
          double s = 0.0;
          for (float v : z) s += v == -kInf ? 0.0 : std::exp(double(v) * scale + shift - xmax);
          const float lse = xmax == -kInf ? 0.0F : float(xmax + std::log(s));
          const float a = -0.8125F;
          Guarded in(n_, size_of(in_t), place);
          Guarded out(n_, size_of(out_t), place);
          Guarded bias(n_, 4, place);
          fill(in, in_t, z);
          std::vector<float> bias0 = make_row(Kind::normal, n_, seed + 1);
          fill(bias, Elem::f32, bias0);
          k_->dlogits_row(in.as<void>(), in_t, n_, scale, shift, lse, a, target, out.as<void>(), out_t,
                          with_bias ? bias.as<float>() : nullptr);
          EXPECT_TRUE(out.outside_untouched());
          EXPECT_TRUE(bias.outside_untouched());
          for (std::int64_t i = 0; i < n_; ++i) {
            // The exponent carries the roundings of x = fl(in * scale + shift)
            // and of x - lse (u|x| + u|d| absolute), exp 4u; onehot - p and the
            // product by a round once each. bf16 output adds half a bf16 ulp.
            const double x = double(z[i]) * scale + shift;
            const double d = x - double(lse);
            const double p = std::exp(d);
            const double g_ref = a * ((i == target ? 1.0 : 0.0) - p);
            const double rel_p =
                p == 0.0 ? 0.0 : p * kU * (std::fabs(x) + std::fabs(d) + kExpU);  // -inf: p = 0 exactly
            const double tol32 =
                std::fabs(a) * rel_p + 2 * kU * std::fabs(g_ref) + std::fabs(a) * std::numeric_limits<float>::min();
            const double g = out_t == Elem::f32 ? out.as<float>()[i] : bf16_to_float(out.as<std::uint16_t>()[i]);
            const double tol = tol32 + (out_t == Elem::bf16 ? kUBf16 * (std::fabs(g_ref) + tol32) : 0.0);
            ASSERT_NEAR(g, g_ref, tol) << "i=" << i;
            const double b = with_bias ? bias0[i] + g_ref : bias0[i];
            ASSERT_NEAR(bias.as<float>()[i], b, (with_bias ? tol32 : 0.0) + kU * (std::fabs(b) + tol32)) << "i=" << i;
          }
          // In place: out aliases in exactly (element sizes match) and must give
          // the same bits as the separate call.
          if (size_of(in_t) != size_of(out_t)) continue;
          k_->dlogits_row(in.as<void>(), in_t, n_, scale, shift, lse, a, target, in.as<void>(), out_t, nullptr);
          ASSERT_EQ(std::memcmp(in.as<void>(), out.as<void>(), std::size_t(n_) * size_of(out_t)), 0);
        }
      }
    }
  }
}

// The generic head's dlogits: the dlogits_row terms plus -b p (x - mean), both
// paths against the double reference, with the same inputs and targets.
TEST_P(StageKernelsTest, DlogitsEntropyRow) {
  int combo = 0;
  for (Elem in_t : {Elem::f32, Elem::bf16, Elem::f16}) {
    for (Elem out_t : {Elem::f32, Elem::bf16}) {
      for (int kind = 0; kind <= int(Kind::offset); ++kind) {
        for (std::int64_t target : {std::int64_t{-1}, n_ / 2, n_ - 1}) {
          const bool with_bias = (combo % 2) == 0;
          const Place place = kPlaces[combo++ % 3];
          const std::uint32_t seed =
              5000u + 7u * std::uint32_t(n_) + 131u * std::uint32_t(kind) + 17u * std::uint32_t(combo);
          SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " kind=" << kKindNames[kind]
                                          << " in=" << int(in_t) << " out=" << int(out_t) << " target=" << target);
          std::vector<float> z = make_row(Kind(kind), n_, seed);
          // f16 holds u = x - tile max in the fused driver, the shift brings the max back.
          const float zmax = expected_max(z, 1.0F);
          const float scale = in_t == Elem::f16 ? 1.0F : 1.0F / 0.7F;
          const float shift = in_t == Elem::f16 ? (zmax == -kInf ? 0.0F : zmax) : 0.375F;
          if (in_t == Elem::f16) {
            for (float& v : z) v -= zmax == -kInf ? 0.0F : zmax;
          }
          round_to(in_t, z);
          double xmax = -kInf;
          for (float v : z) xmax = std::max(xmax, double(v) * scale + shift);
          double s = 0.0, sx = 0.0;
          for (float v : z) {
            if (v == -kInf) continue;
            const double e = std::exp(double(v) * scale + shift - xmax);
            s += e;
            sx += e * (double(v) * scale + shift);
          }
          const float lse = xmax == -kInf ? 0.0F : float(xmax + std::log(s));
          const float mean = xmax == -kInf ? 0.0F : float(sx / s);  // E_p[x], given to the kernel
          const float a = -0.8125F;
          const float b = 0.6875F;
          Guarded in(n_, size_of(in_t), place);
          Guarded out(n_, size_of(out_t), place);
          Guarded bias(n_, 4, place);
          fill(in, in_t, z);
          std::vector<float> bias0 = make_row(Kind::normal, n_, seed + 1);
          fill(bias, Elem::f32, bias0);
          k_->dlogits_entropy_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, target, out.as<void>(), out_t,
                                  with_bias ? bias.as<float>() : nullptr);
          EXPECT_TRUE(out.outside_untouched());
          EXPECT_TRUE(bias.outside_untouched());
          for (std::int64_t i = 0; i < n_; ++i) {
            // dlogits_row's bound (see DlogitsRow) for the first term; the
            // entropy term carries p's relative error times |x - mean|, the
            // roundings of in_shift - mean and of the centered x (u each),
            // of b p (u) and of the final fused add (u |g|); lanes flushed
            // to p = 0 lose at most |b| FLT_MIN |x - mean|.
            const double x = double(z[i]) * scale + shift;
            const double d = x - double(lse);
            const double p = z[i] == -kInf ? 0.0 : std::exp(d);
            const double xc = z[i] == -kInf ? 0.0 : x - double(mean);
            const double g_ref = a * ((i == target ? 1.0 : 0.0) - p) - b * p * xc;
            const double rel_p = p == 0.0 ? 0.0 : p * kU * (std::fabs(x) + std::fabs(d) + kExpU);
            const double flush = (std::fabs(a) + std::fabs(b) * std::fabs(xc)) * std::numeric_limits<float>::min();
            const double tol32 = std::fabs(a) * rel_p + 2 * kU * std::fabs(a * ((i == target ? 1.0 : 0.0) - p)) +
                                 std::fabs(b) * (rel_p * std::fabs(xc) +
                                                 p * kU * (std::fabs(double(shift) - mean) + 3 * std::fabs(xc))) +
                                 kU * std::fabs(g_ref) + flush;
            const double g = out_t == Elem::f32 ? out.as<float>()[i] : bf16_to_float(out.as<std::uint16_t>()[i]);
            const double tol = tol32 + (out_t == Elem::bf16 ? kUBf16 * (std::fabs(g_ref) + tol32) : 0.0);
            ASSERT_NEAR(g, g_ref, tol) << "i=" << i;
            const double want_bias = with_bias ? bias0[i] + g_ref : bias0[i];
            ASSERT_NEAR(bias.as<float>()[i], want_bias, (with_bias ? tol32 : 0.0) + kU * (std::fabs(want_bias) + tol32))
                << "i=" << i;
          }
          // b = 0 gives dlogits_row's values exactly (the fused path's kernel;
          // a zero may change sign: g - 0 * (x - mean)).
          if (!with_bias) {
            Guarded plain(n_, size_of(out_t), place);
            k_->dlogits_row(in.as<void>(), in_t, n_, scale, shift, lse, a, target, plain.as<void>(), out_t, nullptr);
            k_->dlogits_entropy_row(in.as<void>(), in_t, n_, scale, shift, lse, a, 0.0F, mean, target, out.as<void>(),
                                    out_t, nullptr);
            for (std::int64_t i = 0; i < n_; ++i) {
              const float want =
                  out_t == Elem::f32 ? plain.as<float>()[i] : bf16_to_float(plain.as<std::uint16_t>()[i]);
              const float got = out_t == Elem::f32 ? out.as<float>()[i] : bf16_to_float(out.as<std::uint16_t>()[i]);
              ASSERT_EQ(got, want) << "i=" << i;
            }
          }
          // In place, exact aliasing: the same bits as the separate call.
          if (size_of(in_t) != size_of(out_t)) continue;
          k_->dlogits_entropy_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, target, out.as<void>(), out_t,
                                  nullptr);
          k_->dlogits_entropy_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, target, in.as<void>(), out_t,
                                  nullptr);
          ASSERT_EQ(std::memcmp(in.as<void>(), out.as<void>(), std::size_t(n_) * size_of(out_t)), 0);
        }
      }
    }
  }
}

// The logit softcap: cap tanh(scale z / cap) within a few ulp of cap (the
// polynomial / (1 - e) / (1 + e) split on AVX-512, std::tanh on the scalar
// path), f32 and bf16 input, in place for f32, nothing outside [0, n) written.
TEST_P(StageKernelsTest, Softcap) {
  for (Elem in_t : {Elem::f32, Elem::bf16}) {
    for (const float cap : {0.5F, 4.0F, 30.0F}) {
      SCOPED_TRACE(testing::Message() << "n=" << n_ << " in=" << int(in_t) << " cap=" << cap);
      std::vector<float> z = make_row(Kind::normal, n_, 9100u + std::uint32_t(n_));
      for (std::size_t i = 0; i < z.size(); i += 7) z[i] *= 40.0F;  // some saturated entries
      round_to(in_t, z);
      const float scale = 1.3F;
      Guarded in(n_, size_of(in_t), Place::head);
      Guarded out(n_, 4, Place::tail);
      fill(in, in_t, z);
      k_->softcap(in.as<void>(), in_t, n_, scale, cap, out.as<float>());
      EXPECT_TRUE(out.outside_untouched());
      for (std::int64_t i = 0; i < n_; ++i) {
        const double want = double(cap) * std::tanh(double(scale) / double(cap) * double(z[i]));
        // scale / cap rounds once (u), the product once (u): 2u |y| |tanh'| <= 2u |y| of the argument; tanh within 4u.
        const double y = double(scale) / double(cap) * double(z[i]);
        const double tol = double(cap) * (8.0 * kU + 3.0 * kU * std::fabs(y) / std::cosh(std::min(std::fabs(y), 40.0)) /
                                                         std::cosh(std::min(std::fabs(y), 40.0)));
        ASSERT_NEAR(out.as<float>()[i], want, tol) << "i=" << i << " z=" << z[i];
      }
      if (in_t == Elem::f32) {  // in place: the same values
        const std::vector<float> copy(out.as<float>(), out.as<float>() + n_);
        k_->softcap(in.as<void>(), in_t, n_, scale, cap, in.as<float>());
        ASSERT_TRUE(std::equal(copy.begin(), copy.end(), in.as<float>(),
                               [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }));
      }
    }
  }
}

// dlogits through a softcap: the entropy row times s (1 - t^2), t = x cap_k,
// against double; dbias gets the final value; in place gives the same bits.
TEST_P(StageKernelsTest, DlogitsSoftcapRow) {
  for (Elem in_t : {Elem::f32, Elem::f16}) {
    for (Elem out_t : {Elem::f32, Elem::bf16}) {
      for (std::int64_t target : {std::int64_t{-1}, n_ / 2}) {
        SCOPED_TRACE(testing::Message() << "n=" << n_ << " in=" << int(in_t) << " out=" << int(out_t)
                                        << " target=" << target);
        std::vector<float> z = make_row(Kind::normal, n_, 9300u + std::uint32_t(n_));
        const float zmax = expected_max(z, 1.0F);
        const float scale = in_t == Elem::f16 ? 1.0F : 1.0F / 0.7F;
        const float shift = in_t == Elem::f16 ? zmax : 0.375F;
        if (in_t == Elem::f16) {
          for (float& v : z) v -= zmax;
        }
        round_to(in_t, z);
        double xmax = -kInf, sum = 0.0, sum_x = 0.0;
        for (float v : z) xmax = std::max(xmax, double(v) * scale + shift);
        for (float v : z) {
          const double e = std::exp(double(v) * scale + shift - xmax);
          sum += e;
          sum_x += e * (double(v) * scale + shift);
        }
        const float lse = float(xmax + std::log(sum));
        const float mean = float(sum_x / sum);
        const float a = -0.8125F, b = 0.6875F, cap_k = 1.0F / (scale * 12.0F), cap_s = 1.3F;
        Guarded in(n_, size_of(in_t), Place::head);
        Guarded out(n_, size_of(out_t), Place::tail);
        Guarded bias(n_, 4, Place::head_plus_one);
        fill(in, in_t, z);
        std::vector<float> bias0 = make_row(Kind::normal, n_, 9301u);
        fill(bias, Elem::f32, bias0);
        k_->dlogits_softcap_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, cap_k, cap_s, target,
                                out.as<void>(), out_t, bias.as<float>());
        EXPECT_TRUE(out.outside_untouched());
        EXPECT_TRUE(bias.outside_untouched());
        for (std::int64_t i = 0; i < n_; ++i) {
          const double x = double(z[i]) * scale + shift;
          const double d = x - double(lse);
          const double p = std::exp(d);
          const double xc = x - double(mean);
          const double inner = a * ((i == target ? 1.0 : 0.0) - p) - b * p * xc;
          const double t = x * double(cap_k);
          const double chain = double(cap_s) * (1.0 - t * t);
          const double g_ref = inner * chain;
          // The entropy row's bound (DlogitsEntropyRow) times |chain|, plus the
          // chain's own error: t rounds twice (2u relative), 1 - t^2 in one fma
          // (4u t^2 + u), the two products (2u); flushed lanes as there.
          const double rel_p = p * kU * (std::fabs(x) + std::fabs(d) + kExpU);
          const double flush = (std::fabs(a) + std::fabs(b) * std::fabs(xc)) * std::numeric_limits<float>::min();
          const double inner_tol =
              std::fabs(a) * rel_p + 2 * kU * std::fabs(a * ((i == target ? 1.0 : 0.0) - p)) +
              std::fabs(b) * (rel_p * std::fabs(xc) + p * kU * (std::fabs(double(shift) - mean) + 3 * std::fabs(xc))) +
              kU * std::fabs(inner) + flush;
          const double tol32 = inner_tol * std::fabs(chain) +
                               std::fabs(inner) * double(cap_s) * (4.0 * kU * t * t + 5.0 * kU) + kU * std::fabs(g_ref);
          const double g = out_t == Elem::f32 ? out.as<float>()[i] : bf16_to_float(out.as<std::uint16_t>()[i]);
          const double tol = tol32 + (out_t == Elem::bf16 ? kUBf16 * (std::fabs(g_ref) + tol32) : 0.0);
          ASSERT_NEAR(g, g_ref, tol) << "i=" << i;
          ASSERT_NEAR(bias.as<float>()[i], bias0[i] + g_ref, tol32 + kU * (std::fabs(bias0[i] + g_ref) + tol32))
              << "i=" << i;
        }
        if (size_of(in_t) != size_of(out_t)) continue;
        k_->dlogits_softcap_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, cap_k, cap_s, target,
                                out.as<void>(), out_t, nullptr);
        k_->dlogits_softcap_row(in.as<void>(), in_t, n_, scale, shift, lse, a, b, mean, cap_k, cap_s, target,
                                in.as<void>(), out_t, nullptr);
        ASSERT_EQ(std::memcmp(in.as<void>(), out.as<void>(), std::size_t(n_) * size_of(out_t)), 0);
      }
    }
  }
}

TEST_P(StageKernelsTest, Finiteness) {
  for (Elem t : {Elem::f32, Elem::bf16, Elem::f16}) {
    for (Place place : kPlaces) {
      const std::uint32_t seed = 4000u + 7u * std::uint32_t(n_);
      SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " type=" << int(t)
                                      << " place=" << int(place));
      std::vector<float> z = make_row(Kind::normal, n_, seed);
      round_to(t, z);
      Guarded buf(n_, size_of(t), place);
      fill(buf, t, z);
      EXPECT_TRUE(k_->all_finite(buf.as<void>(), t, n_));
      EXPECT_TRUE(k_->no_nan_or_pos_inf(buf.as<void>(), t, n_));
      if (n_ == 0) continue;
      // Raw bit patterns: quiet NaN, signalling NaN, negative NaN, +inf, -inf
      // (the last one allowed by no_nan_or_pos_inf).
      const std::uint32_t f32_bad[] = {0x7fc00000, 0x7f800001, 0xffc00001, 0x7f800000, 0xff800000};
      const std::uint16_t bf16_bad[] = {0x7fc0, 0x7f81, 0xffc1, 0x7f80, 0xff80};
      const std::uint16_t f16_bad[] = {0x7e00, 0x7c01, 0xfe01, 0x7c00, 0xfc00};
      for (std::int64_t pos : {std::int64_t{0}, n_ / 2, n_ - 1}) {
        for (int b = 0; b < 5; ++b) {
          SCOPED_TRACE(testing::Message() << "pos=" << pos << " pattern=" << b);
          if (t == Elem::f32) {
            std::memcpy(buf.as<float>() + pos, &f32_bad[b], 4);
          } else {
            buf.as<std::uint16_t>()[pos] = t == Elem::bf16 ? bf16_bad[b] : f16_bad[b];
          }
          EXPECT_FALSE(k_->all_finite(buf.as<void>(), t, n_));
          EXPECT_EQ(k_->no_nan_or_pos_inf(buf.as<void>(), t, n_), b == 4);
          fill(buf, t, z);
        }
      }
    }
  }
}

TEST_P(StageKernelsTest, Conversions) {
  for (Place place : kPlaces) {
    const std::uint32_t seed = 5000u + 7u * std::uint32_t(n_);
    SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " place=" << int(place));
    std::mt19937 rng(seed);
    Guarded f(n_, 4, place);
    Guarded h(n_, 2, place);
    for (std::int64_t i = 0; i < n_; ++i) {
      const std::uint32_t bits = rng();  // every class: normals, subnormals, inf, NaN
      std::memcpy(f.as<float>() + i, &bits, 4);
    }
    k_->f32_to_bf16(f.as<float>(), h.as<std::uint16_t>(), n_);
    EXPECT_TRUE(h.outside_untouched());
    for (std::int64_t i = 0; i < n_; ++i) ASSERT_EQ(h.as<std::uint16_t>()[i], float_to_bf16(f.as<float>()[i]));
    Guarded back(n_, 4, place);
    k_->bf16_to_f32(h.as<std::uint16_t>(), back.as<float>(), n_);
    EXPECT_TRUE(back.outside_untouched());
    for (std::int64_t i = 0; i < n_; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, back.as<float>() + i, 4);
      ASSERT_EQ(bits, std::uint32_t{h.as<std::uint16_t>()[i]} << 16);
    }
    // The f16 gradient form: f16.hpp's float_to_f16_saturated bit for bit
    // (a NaN only as a NaN: vcvtps2ph keeps payload bits the software form
    // drops), the same count, and never an f16 infinity.
    Guarded g(n_, 2, place);
    const std::int64_t saturated = k_->f32_to_f16_saturated(f.as<float>(), g.as<std::uint16_t>(), n_);
    EXPECT_TRUE(g.outside_untouched());
    std::int64_t want_saturated = 0;
    for (std::int64_t i = 0; i < n_; ++i) {
      const float x = f.as<float>()[i];
      const std::uint16_t want = float_to_f16_saturated(x, &want_saturated);
      const std::uint16_t got = g.as<std::uint16_t>()[i];
      if (std::isnan(x)) {
        ASSERT_TRUE((got & 0x7c00U) == 0x7c00U && (got & 0x3ffU) != 0) << "i=" << i;
        continue;
      }
      ASSERT_EQ(got, want) << "i=" << i << " x=" << x;
      ASSERT_NE(got & 0x7fffU, 0x7c00U) << "an f16 infinity at i=" << i;
    }
    EXPECT_EQ(saturated, want_saturated);
    // And back: every f16 (NaN payloads included) widened exactly.
    Guarded wide(n_, 4, place);
    k_->f16_to_f32(g.as<std::uint16_t>(), wide.as<float>(), n_);
    EXPECT_TRUE(wide.outside_untouched());
    for (std::int64_t i = 0; i < n_; ++i) {
      const float want = f16_to_float(g.as<std::uint16_t>()[i]);
      const float got = wide.as<float>()[i];
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << "i=" << i;
      } else {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want)) << "i=" << i;
      }
    }
  }
}

// The saturation's edges: 65519.99 rounds to 65504 (not counted), 65520
// and beyond (and inf) are written as +-65504 and counted.
TEST(StageKernelF16, SaturatesAtTheRangeEdge) {
  const float edge_below = std::nextafter(65520.0F, 0.0F);
  const std::vector<float> x = {65504.0F, edge_below, 65520.0F, -65520.0F, 1e30F, kInf, -kInf, -1.0F, 0.5F};
  const std::vector<std::uint16_t> want = {0x7bff, 0x7bff, 0x7bff, 0xfbff, 0x7bff, 0x7bff, 0xfbff, 0xbc00, 0x3800};
  for (const StageKernels* k : {&scalar_kernels(), avx512_kernels(), avx2_kernels()}) {
    if (k == nullptr) continue;
    SCOPED_TRACE(k->name);
    std::vector<std::uint16_t> out(x.size());
    EXPECT_EQ(k->f32_to_f16_saturated(x.data(), out.data(), std::int64_t(x.size())), 5);
    EXPECT_EQ(out, want);
  }
}

// The filtered backward's two row kernels against plain loops: mark_kept
// sets exactly the marks of |g| >= threshold and leaves the others as they
// were, and returns the sum of the |g| below it in its fixed lane order; add_row adds in f32 and rounds a bf16 row once
// (nearest even).
TEST_P(StageKernelsTest, FilterRows) {
  for (Place place : kPlaces) {
    const std::uint32_t seed = 6000u + 7u * std::uint32_t(n_);
    SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n_ << " place=" << int(place));
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    Guarded g32(n_, 4, place);
    Guarded g16(n_, 2, place);
    for (std::int64_t i = 0; i < n_; ++i) {
      const float x = normal(rng) * (i % 3 == 0 ? 1e-4F : 1.0F);  // a third far below the threshold
      g32.as<float>()[i] = i % 11 == 5 ? -0.5F : x;               // and some exactly at it, negative
      g16.as<std::uint16_t>()[i] = float_to_bf16(g32.as<float>()[i]);
    }
    for (const Elem type : {Elem::f32, Elem::bf16}) {
      const void* g = type == Elem::f32 ? static_cast<const void*>(g32.as<float>()) : g16.as<std::uint16_t>();
      std::vector<std::uint8_t> marks(static_cast<std::size_t>(n_) + 1, 0);
      for (std::int64_t i = 0; i < n_; ++i) marks[i] = i % 7 == 3 ? 1 : 0;  // earlier rows' marks stay
      marks[n_] = 9;                                                        // past the row: untouched
      const std::vector<std::uint8_t> before = marks;
      const float below = k_->mark_kept(g, type, n_, 0.5F, marks.data());
      std::array<float, 16> lane{};  // |g| below the threshold, element i in lane i mod 16
      for (std::int64_t i = 0; i < n_; ++i) {
        const float x = type == Elem::f32 ? g32.as<float>()[i] : bf16_to_float(g16.as<std::uint16_t>()[i]);
        ASSERT_EQ(marks[i], std::fabs(x) >= 0.5F ? 1 : before[i]) << "i=" << i;
        if (std::fabs(x) < 0.5F) lane[static_cast<std::size_t>(i % 16)] += std::fabs(x);
      }
      float want_below = 0.0F;
      for (const float l : lane) want_below += l;
      EXPECT_EQ(below, want_below);  // bitwise: the same lanes in the same order on every path
      EXPECT_EQ(marks[n_], 9);
    }
    Guarded add(n_, 4, place);
    for (std::int64_t i = 0; i < n_; ++i) add.as<float>()[i] = normal(rng);
    Guarded out32(n_, 4, place);
    Guarded out16(n_, 2, place);
    for (std::int64_t i = 0; i < n_; ++i) {
      out32.as<float>()[i] = normal(rng);
      out16.as<std::uint16_t>()[i] = float_to_bf16(out32.as<float>()[i]);
    }
    std::vector<float> want32(static_cast<std::size_t>(n_));
    std::vector<std::uint16_t> want16(static_cast<std::size_t>(n_));
    for (std::int64_t i = 0; i < n_; ++i) {
      want32[i] = out32.as<float>()[i] + add.as<float>()[i];
      want16[i] = float_to_bf16(bf16_to_float(out16.as<std::uint16_t>()[i]) + add.as<float>()[i]);
    }
    k_->add_row(add.as<float>(), out32.as<float>(), Elem::f32, n_);
    k_->add_row(add.as<float>(), out16.as<std::uint16_t>(), Elem::bf16, n_);
    EXPECT_TRUE(out32.outside_untouched());
    EXPECT_TRUE(out16.outside_untouched());
    for (std::int64_t i = 0; i < n_; ++i) {
      ASSERT_EQ(out32.as<float>()[i], want32[i]) << "i=" << i;
      ASSERT_EQ(out16.as<std::uint16_t>()[i], want16[i]) << "i=" << i;
    }
  }
}

std::string param_name(const testing::TestParamInfo<StageKernelsTest::ParamType>& info) {
  const Path path = std::get<0>(info.param);
  return std::string(path == Path::scalar   ? "scalar"
                     : path == Path::avx512 ? "avx512"
                                            : "avx2") +
         "_n" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Lengths, StageKernelsTest,
                         testing::Combine(testing::Values(Path::scalar, Path::avx512, Path::avx2),
                                          testing::ValuesIn(kLengths)),
                         param_name);

// The paths round x = fl(z * scale) and u = x - max identically, so the
// max and the stored u agree bit for bit (S and D differ by their exp and
// summation order, bounded against the reference above).
TEST(StageKernelPaths, MaxAndStoredUAgreeBitwise) {
  const StageKernels& ref = scalar_kernels();
  int compared = 0;
  for (const StageKernels* simd : {avx512_kernels(), avx2_kernels()}) {
    if (simd == nullptr) continue;
    ++compared;
    SCOPED_TRACE(simd->name);
    for (std::int64_t n : kLengths) {
      if (n == 0) continue;  // nothing to compare (and memcmp on null is undefined)
      for (int kind = 0; kind < kKinds; ++kind) {
        const std::uint32_t seed = 7000u + 7u * std::uint32_t(n) + 131u * std::uint32_t(kind);
        SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n << " kind=" << kKindNames[kind]);
        std::vector<float> z = make_row(Kind(kind), n, seed);
        const float scale = 1.0F / 0.7F;
        EXPECT_EQ(simd->row_stats(z.data(), Elem::f32, n, scale).max, ref.row_stats(z.data(), Elem::f32, n, scale).max);
        for (Elem out_t : {Elem::f32, Elem::f16}) {
          std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
          simd->row_stats_store(z.data(), n, scale, a.data(), out_t);
          ref.row_stats_store(z.data(), n, scale, b.data(), out_t);
          EXPECT_EQ(std::memcmp(a.data(), b.data(), std::size_t(n) * size_of(out_t)), 0);
        }
      }
    }
  }
  if (compared == 0) GTEST_SKIP() << "CPU has neither AVX-512F/BW/DQ/VL nor AVX2/FMA/F16C";
}

// float_to_bf16 against rounding by distance in double: pick the nearer of the
// two bf16 neighbours, ties to the even one; the step past the largest finite
// bf16 is 2^128, encoded as inf.
TEST(StageKernelConversions, Bf16RoundsToNearestEven) {
  std::mt19937 rng(6000);
  std::vector<std::uint32_t> patterns = {0x00000000, 0x80000000, 0x3f808000, 0x3f818000, 0x3f80c000, 0x7f7fffff,
                                         0x7f7f7fff, 0x7f7f8000, 0xff7fffff, 0x00008000, 0x00018000, 0x7f800000,
                                         0xff800000, 0x7f800001, 0xffc00000, 0x7fff0000, 0x007fffff};
  for (int i = 0; i < 200000; ++i) patterns.push_back(rng());
  for (std::uint32_t bits : patterns) {
    SCOPED_TRACE(testing::Message() << "seed=6000 bits=0x" << std::hex << bits);
    float f;
    std::memcpy(&f, &bits, 4);
    const std::uint16_t got = float_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(got)));
      EXPECT_EQ(got & 0x8000, (bits >> 16) & 0x8000);
      continue;
    }
    const std::uint16_t lo = std::uint16_t(bits >> 16);
    const int biased = (lo >> 7) & 0xff;
    const double lo_mag = std::fabs(double(bf16_to_float(lo)));
    const double step = std::ldexp(1.0, std::max(biased, 1) - 134);  // bf16 ulp: 2^(e - 127 - 7)
    const double rem = std::fabs(double(f)) - lo_mag;
    const bool up = rem > step / 2 || (rem == step / 2 && (lo & 1) != 0);
    EXPECT_EQ(got, std::uint16_t(lo + (up ? 1 : 0)));
    for (const StageKernels* simd : {avx512_kernels(), avx2_kernels()}) {
      if (simd == nullptr) continue;
      std::uint16_t v;
      simd->f32_to_bf16(&f, &v, 1);
      EXPECT_EQ(v, got) << simd->name;
    }
  }
}

// e^x through dlogits_row (a = -1, lse = 0, no target gives g = p exactly) on
// every 1009th float in [-88, 0]; below ln(FLT_MIN) only 0 or the exact
// subnormal is accepted.
TEST(StageKernelExp, WithinTwoUlp) {
  std::vector<float> x;
  const float lim = -88.0F;
  std::uint32_t last;
  std::memcpy(&last, &lim, 4);
  for (std::uint32_t b = 0x80000000u; b <= last; b += 1009) x.push_back(std::bit_cast<float>(b));
  for (float v : {0.0F, -kInf, -1e30F, -87.33654F}) x.push_back(v);
  std::vector<float> e(x.size());
  for (const StageKernels* k : {&scalar_kernels(), avx512_kernels(), avx2_kernels()}) {
    if (k == nullptr) continue;
    SCOPED_TRACE(k->name);
    k->dlogits_row(x.data(), Elem::f32, std::int64_t(x.size()), 1.0F, 0.0F, 0.0F, -1.0F, -1, e.data(), Elem::f32,
                   nullptr);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double ref = std::exp(double(x[i]));
      if (ref < std::numeric_limits<float>::min()) {
        ASSERT_LE(std::fabs(e[i]), ref + 0x1p-149) << "x=" << x[i];  // 0 or a subnormal within one step
        continue;
      }
      ASSERT_NEAR(e[i], ref, 2 * std::ldexp(1.0, std::ilogb(ref) - 23)) << "x=" << x[i];
    }
    EXPECT_EQ(e[x.size() - 4], 1.0F);  // exp(0) is exactly 1
    EXPECT_EQ(e[x.size() - 3], 0.0F);
  }
}

TEST(StageKernelMaxAbs, MatchesReferenceAndFlagsNonFinite) {
  const std::int64_t lengths[] = {0, 1, 15, 16, 17, 33, 2049};
  std::mt19937 rng(4242);
  std::normal_distribution<float> normal(0.0F, 50.0F);
  for (const StageKernels* k : {&scalar_kernels(), avx512_kernels(), avx2_kernels()}) {
    if (k == nullptr) continue;
    for (std::int64_t n : lengths) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n) + " seed=4242");
      std::vector<float> x(n);
      for (float& v : x) v = normal(rng);
      float want = 0.0F;
      for (float v : x) want = std::max(want, std::fabs(v));
      EXPECT_EQ(k->max_abs(x.data(), Elem::f32, n), want);  // max is exact: no tolerance
      std::vector<std::uint16_t> b(n);
      float want_b = 0.0F;
      for (std::int64_t i = 0; i < n; ++i) {
        b[i] = float_to_bf16(x[i]);
        want_b = std::max(want_b, std::fabs(bf16_to_float(b[i])));
      }
      EXPECT_EQ(k->max_abs(b.data(), Elem::bf16, n), want_b);
      std::vector<std::uint16_t> f(n);
      float want_f = 0.0F;
      for (std::int64_t i = 0; i < n; ++i) {
        f[i] = float_to_f16(x[i]);
        want_f = std::max(want_f, std::fabs(f16_to_float(f[i])));
      }
      EXPECT_EQ(k->max_abs(f.data(), Elem::f16, n), want_f);
      if (n == 0) continue;
      for (const std::uint16_t bad : {std::uint16_t{0x7c00}, std::uint16_t{0xfc00}, std::uint16_t{0x7e00}}) {
        std::vector<std::uint16_t> g = f;
        g[n - 1] = bad;
        EXPECT_EQ(k->max_abs(g.data(), Elem::f16, n), kInf) << "f16 bits " << bad;
      }
      for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
        for (std::int64_t at : {std::int64_t{0}, n - 1}) {
          std::vector<float> y = x;
          y[at] = bad;
          EXPECT_EQ(k->max_abs(y.data(), Elem::f32, n), kInf) << "bad value " << bad << " at " << at;
        }
      }
    }
  }
}

// The widest path the CPU has, unless GRPO_SIMD forces one.
TEST(StageKernelDispatch, PicksTheWidestPathAndReportsIt) {
  const std::string forced = std::getenv("GRPO_SIMD") != nullptr ? std::getenv("GRPO_SIMD") : "";
  const char* expected = "scalar";
  if (forced != "scalar" && avx2_kernels() != nullptr) expected = "avx2";
  if (forced != "scalar" && forced != "avx2" && avx512_kernels() != nullptr) expected = "avx512";
  EXPECT_STREQ(kernels().name, expected);
  EXPECT_STREQ(grpo::simd_path(), expected);
  EXPECT_STREQ(grpo::version(), GRPO_VERSION_STRING);
}

}  // namespace
}  // namespace grpo::kernels
