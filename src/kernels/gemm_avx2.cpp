// The AVX2 GEMM backend: A and B in bf16 or f32 on CPUs with AVX2 and FMA and
// no AVX-512. There oneDNN 2.6 has no bf16 matmul at all ("could not create a
// primitive descriptor" on a Zen 2/3 or an AVX2-only Intel part), and its f32
// matmul's result for a row depends on the row's place in the call (measured
// on a Zen 3: BatchInvariance fails), so both run here.
//
// bf16 operands are widened to f32 while they are packed (a bf16 value is the
// top half of an f32: a shift, exact), and the product runs as an f32 GEMM
// with FMA: every product of two bf16 values is exact in f32, so this is the
// bf16 GEMM with f32 accumulation the other backends compute.
//
// Scheme (BLIS's loops, sized for a Zen 3 core: 32 KiB L1, 512 KiB L2; the
// blocking is gemm_avx2_blocking.hpp's, a pure function):
//   for each column block of B (nc columns), for each k block (kc deep):
//     pack B's block into panels of kNr columns, [kc][kNr] f32 each;
//     for each row block of A (kMc rows): pack it into panels of kMr rows,
//     [kc][kMr] f32 each; for each B panel, for each A panel: the kMr x kNr
//     register block (12 ymm accumulators) over the kc products.
//   K longer than kKcSingle is split into equal k blocks (<= kKcMax); the partial sums of a
//   block go to an f32 buffer and are loaded back into the registers for the
//   next, exactly: every element of C is one FMA chain over k ascending,
//   then + bias, then + C when accumulating, whatever M, N, the blocking or
//   the element's position. So a row's result does not depend on its batch
//   (GemmTraits::m_independent), nor on the thread count.
//   spec.threads > 1 (the unfused baseline's whole-batch calls) splits C's
//   columns into one run of panels per thread, each with its own packing
//   buffers in the scratchpad.
//
// This file alone is compiled with AVX2 and FMA; nothing here runs unless
// avx2_gemm_usable() (gemm_dispatch.cpp, compiled for any x86-64) found them.
#include <immintrin.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/bf16_avx2.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_avx2_blocking.hpp"
#include "kernels/gemm_backend.hpp"
#include "kernels/prefetch.hpp"

namespace grpo::kernels {
namespace {

using avx2::kMr;
using avx2::kNr;

float widen(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float v = 0.0F;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
__m256 widen8(const std::uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// An operand's elements as f32: bf16 widened, f32 as they are.
float load1(const std::uint16_t* p) { return widen(*p); }
float load1(const float* p) { return *p; }
__m256 load8(const std::uint16_t* p) { return widen8(p); }
__m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
std::uint16_t to_bf16(float v) { return float_to_bf16<Bf16Nan::canonical>(v); }
// 16 f32 (lo, hi) -> 16 bf16 at dst, as to_bf16 does each.
void store_bf16x16(std::uint16_t* dst, __m256 lo, __m256 hi) {
  const auto round = [](__m256 v) { return float_to_bf16x8_epi32<Bf16Nan::canonical>(v); };
  // packus interleaves 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7]; put them in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round(lo), round(hi)), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// 8 x 8 f32 transpose in registers.
void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// The kMr x kNr register block: acc (+)= A panel [kc][kMr] x B panel
// [kc][kNr], k ascending; from zero (first) or from acc (ld floats apart),
// left in acc.
void micro(const float* a, const float* b, std::int64_t kc, float* acc, std::int64_t ld, bool first) {
  // Twelve named accumulators: GCC keeps an array of __m256 in registers
  // but also stores it to the stack on every k (measured in the object
  // code), which halves the FMA rate.
  const auto init = [&](std::int64_t r, std::int64_t h) {
    return first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * ld + h * 8);
  };
  __m256 c00 = init(0, 0), c01 = init(0, 1), c10 = init(1, 0), c11 = init(1, 1), c20 = init(2, 0), c21 = init(2, 1);
  __m256 c30 = init(3, 0), c31 = init(3, 1), c40 = init(4, 0), c41 = init(4, 1), c50 = init(5, 0), c51 = init(5, 1);
  // Unrolled by 4: the loop's own instructions then cost less than the
  // FMA ports' slack (+5% from L1 on a Zen 3).
#pragma GCC unroll 4
  for (std::int64_t k = 0; k < kc; ++k) {
    const float* ak = a + k * kMr;
    const __m256 b0 = _mm256_load_ps(b + k * kNr);
    const __m256 b1 = _mm256_load_ps(b + k * kNr + 8);
    __m256 x = _mm256_broadcast_ss(ak);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(ak + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(ak + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(ak + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(ak + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(ak + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
  }
  const __m256 out[kMr][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (std::int64_t r = 0; r < kMr; ++r) {
    _mm256_storeu_ps(acc + r * ld, out[r][0]);
    _mm256_storeu_ps(acc + r * ld + 8, out[r][1]);
  }
}

class Avx2Gemm final : public GemmBackend {
 public:
  explicit Avx2Gemm(const GemmSpec& spec) : spec_(spec), b_(avx2::plan_blocking(spec)) {}

  GemmBackendKind kind() const override { return GemmBackendKind::avx2; }
  GemmTile tile() const override { return {.mr = kMr, .nr = kNr, .kr = 1}; }
  const char* implementation() const override { return "grpo:avx2_fma"; }
  GemmTraits traits() const override { return {.m_independent = true}; }
  std::size_t scratchpad_bytes() const override { return b_.scratch_bytes(); }

  void run(const void* a, const void* b, void* c, const void* bias, void* scratch,
           const void* /*packed*/) const override {
    auto* s = static_cast<std::byte*>(scratch);
    auto* acc = reinterpret_cast<float*>(s);
    const auto columns = [&](int t) {
      std::byte* own = s + b_.acc_bytes + b_.per_thread * static_cast<std::size_t>(t);
      const std::int64_t j0 = t * b_.cols_per_thread;
      run_columns(a, b, c, bias, acc, own, j0, std::min(b_.n, j0 + b_.cols_per_thread));
    };
    if (b_.threads == 1) {
      columns(0);
      return;
    }
    tbb::parallel_for(
        tbb::blocked_range<int>(0, b_.threads, 1),
        [&](const tbb::blocked_range<int>& r) {
          for (int t = r.begin(); t < r.end(); ++t) columns(t);
        },
        tbb::static_partitioner());
  }

 private:
  // C's columns [j_begin, j_end), all rows.
  void run_columns(const void* a, const void* b, void* c, const void* bias, float* acc, std::byte* own,
                   std::int64_t j_begin, std::int64_t j_end) const {
    auto* bpack = reinterpret_cast<float*>(own);
    auto* apack = reinterpret_cast<float*>(own + b_.b_bytes);
    auto* tile = reinterpret_cast<float*>(own + b_.b_bytes + b_.a_bytes);
    for (std::int64_t j0 = j_begin; j0 < j_end; j0 += b_.nc) {
      const std::int64_t nb = std::min(b_.nc, j_end - j0);
      for (std::int64_t k0 = 0; k0 < b_.k; k0 += b_.kc) {
        const std::int64_t kb = std::min(b_.kc, b_.k - k0);
        const bool first = k0 == 0;
        const bool last = k0 + kb >= b_.k;
        if (spec_.b.dtype == DType::bf16) {
          pack_b(static_cast<const std::uint16_t*>(b), k0, kb, j0, nb, bpack);
        } else {
          pack_b(static_cast<const float*>(b), k0, kb, j0, nb, bpack);
        }
        for (std::int64_t i0 = 0; i0 < b_.m; i0 += b_.mc) {
          const std::int64_t mb = std::min(b_.mc, b_.m - i0);
          if (spec_.a.dtype == DType::bf16) {
            pack_a(static_cast<const std::uint16_t*>(a), i0, mb, k0, kb, apack);
          } else {
            pack_a(static_cast<const float*>(a), i0, mb, k0, kb, apack);
          }
          for (std::int64_t jj = 0; jj < nb; jj += kNr) {
            const float* bp = bpack + jj * kb;
            for (std::int64_t ii = 0; ii < mb; ii += kMr) {
              const float* ap = apack + ii * kb;
              // The next register block's partial sums and C rows are far
              // (L3 or DRAM: C and the partial sums are [M x N]); ask for them
              // while this block computes (dW +9-19%, dhidden +3-14%).
              std::int64_t next_i = ii + kMr;
              std::int64_t next_j = jj;
              if (next_i >= mb) {
                next_i = 0;
                next_j = jj + kNr;
              }
              if (next_j < nb) prefetch_block(acc, c, i0 + next_i, j0 + next_j, first, last);
              if (last) {
                // The block's last k: partial sums (if any) in, the
                // finished block to the tile, then to C.
                if (!first) {
                  const float* from = acc + (i0 + ii) * b_.acc_ld + j0 + jj;
                  for (std::int64_t r = 0; r < kMr; ++r) {
                    std::memcpy(tile + r * kNr, from + r * b_.acc_ld, kNr * sizeof(float));
                  }
                }
                micro(ap, bp, kb, tile, kNr, first);
                store(tile, i0 + ii, j0 + jj, c, bias);
              } else {
                micro(ap, bp, kb, acc + (i0 + ii) * b_.acc_ld + j0 + jj, b_.acc_ld, first);
              }
            }
          }
        }
      }
    }
  }

  // The lines of the register block at (i, j) that the next micro() call
  // reads (partial sums, unless first) and store() reads or writes (C, when
  // last): the start and the end of each row's 16 elements.
  void prefetch_block(const float* acc, const void* c, std::int64_t i, std::int64_t j, bool first, bool last) const {
    const std::int64_t rows = std::min(kMr, b_.m - i);
    if (!first) {
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* p = acc + (i + r) * b_.acc_ld + j;
        prefetch_l1(p);
        prefetch_l1(p + kNr - 1);
      }
    }
    if (last) {
      const GemmOperand& co = spec_.c;
      const std::int64_t size = co.dtype == DType::f32 ? 4 : 2;
      for (std::int64_t r = 0; r < rows; ++r) {
        const char* p = static_cast<const char*>(c) + ((i + r) * co.row_stride + j) * size;
        prefetch_l1(p);
        prefetch_l1(p + (kNr - 1) * size);
      }
    }
  }

  // B's k [k0, k0 + kb) x columns [j0, j0 + nb) -> panels of kNr columns,
  // [kb][kNr] f32 each, zero past N.
  template <class T>
  void pack_b(const T* b, std::int64_t k0, std::int64_t kb, std::int64_t j0, std::int64_t nb, float* out) const {
    const std::int64_t rs = spec_.b.row_stride;
    const std::int64_t cs = spec_.b.col_stride;
    for (std::int64_t jj = 0; jj < nb; jj += kNr) {
      float* panel = out + jj * kb;
      const std::int64_t cols = std::min(kNr, nb - jj);
      const T* at = b + k0 * rs + (j0 + jj) * cs;
      std::int64_t k = 0;
      if (cols == kNr && cs == 1) {  // rows of B N-contiguous: 16 at a time
        for (; k < kb; ++k) {
          _mm256_store_ps(panel + k * kNr, load8(at + k * rs));
          _mm256_store_ps(panel + k * kNr + 8, load8(at + k * rs + 8));
        }
      } else if (cols == kNr && rs == 1) {  // columns K-contiguous: 8 x 8 transposes
        for (; k + 8 <= kb; k += 8) {
          for (std::int64_t h = 0; h < 2; ++h) {
            __m256 r[8];
            for (std::int64_t j = 0; j < 8; ++j) r[j] = load8(at + (h * 8 + j) * cs + k);
            transpose8(r);
            for (std::int64_t i = 0; i < 8; ++i) _mm256_store_ps(panel + (k + i) * kNr + h * 8, r[i]);
          }
        }
      }
      for (; k < kb; ++k) {  // the rest, element by element
        for (std::int64_t j = 0; j < kNr; ++j) panel[k * kNr + j] = j < cols ? load1(at + k * rs + j * cs) : 0.0F;
      }
    }
  }

  // A's rows [i0, i0 + mb) x k [k0, k0 + kb) -> panels of kMr rows, [kb][kMr]
  // f32 each, zero past M.
  template <class T>
  void pack_a(const T* a, std::int64_t i0, std::int64_t mb, std::int64_t k0, std::int64_t kb, float* out) const {
    const std::int64_t rs = spec_.a.row_stride;
    const std::int64_t cs = spec_.a.col_stride;
    for (std::int64_t ii = 0; ii < mb; ii += kMr) {
      float* panel = out + ii * kb;
      const std::int64_t rows = std::min(kMr, mb - ii);
      const T* at = a + (i0 + ii) * rs + k0 * cs;
      std::int64_t k = 0;
      if (rows == kMr && cs == 1) {
        // Rows K-contiguous: 8 k of the 6 rows (and 2 zero rows), an 8 x 8
        // transpose, then each k's 6 values (a masked store).
        const __m256i six = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
        for (; k + 8 <= kb; k += 8) {
          __m256 r[8];
          for (std::int64_t i = 0; i < kMr; ++i) r[i] = load8(at + i * rs + k);
          r[6] = r[7] = _mm256_setzero_ps();
          transpose8(r);
          for (std::int64_t i = 0; i < 8; ++i) _mm256_maskstore_ps(panel + (k + i) * kMr, six, r[i]);
        }
      } else if (rows == kMr && rs == 1) {
        // Columns contiguous: each k's 6 values are adjacent.
        for (; k < kb; ++k) {
          const T* src = at + k * cs;
          for (std::int64_t i = 0; i < kMr; ++i) panel[k * kMr + i] = load1(src + i);
        }
      }
      for (std::int64_t r = 0; r < kMr && k < kb; ++r) {
        if (r >= rows) {
          for (std::int64_t kk = k; kk < kb; ++kk) panel[kk * kMr + r] = 0.0F;
          continue;
        }
        const T* row = at + r * rs;
        for (std::int64_t kk = k; kk < kb; ++kk) panel[kk * kMr + r] = load1(row + kk * cs);
      }
    }
  }

  // The finished kMr x kNr block (tile, rows i0.., columns j0..) into C:
  // + bias, + C when accumulating, bf16 C rounded to nearest even; rows and
  // columns past C's edges dropped.
  void store(const float* tile, std::int64_t i0, std::int64_t j0, void* c, const void* bias) const {
    const std::int64_t rows = std::min(kMr, b_.m - i0);
    const std::int64_t cols = std::min(kNr, b_.n - j0);
    alignas(32) float bv[kNr] = {};
    if (spec_.has_bias) {
      for (std::int64_t j = 0; j < cols; ++j) {
        bv[j] = spec_.bias_dtype == DType::f32 ? static_cast<const float*>(bias)[j0 + j]
                                               : widen(static_cast<const std::uint16_t*>(bias)[j0 + j]);
      }
    }
    const GemmOperand& co = spec_.c;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t at = (i0 + r) * co.row_stride + j0;
      __m256 lo = _mm256_loadu_ps(tile + r * kNr);
      __m256 hi = _mm256_loadu_ps(tile + r * kNr + 8);
      if (spec_.has_bias) {
        lo = _mm256_add_ps(lo, _mm256_load_ps(bv));
        hi = _mm256_add_ps(hi, _mm256_load_ps(bv + 8));
      }
      if (cols == kNr) {
        if (co.dtype == DType::f32) {
          float* dst = static_cast<float*>(c) + at;
          if (spec_.accumulate) {
            lo = _mm256_add_ps(_mm256_loadu_ps(dst), lo);
            hi = _mm256_add_ps(_mm256_loadu_ps(dst + 8), hi);
          }
          _mm256_storeu_ps(dst, lo);
          _mm256_storeu_ps(dst + 8, hi);
        } else {
          std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at;
          if (spec_.accumulate) {
            lo = _mm256_add_ps(widen8(dst), lo);
            hi = _mm256_add_ps(widen8(dst + 8), hi);
          }
          store_bf16x16(dst, lo, hi);
        }
        continue;
      }
      alignas(32) float v[kNr];
      _mm256_store_ps(v, lo);
      _mm256_store_ps(v + 8, hi);
      for (std::int64_t j = 0; j < cols; ++j) {
        if (co.dtype == DType::f32) {
          float* dst = static_cast<float*>(c) + at + j;
          *dst = spec_.accumulate ? *dst + v[j] : v[j];
        } else {
          std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at + j;
          *dst = to_bf16(spec_.accumulate ? widen(*dst) + v[j] : v[j]);
        }
      }
    }
  }

  GemmSpec spec_;
  avx2::Blocking b_;
};

}  // namespace

std::unique_ptr<GemmBackend> detail::make_avx2_gemm_on_cpu(const GemmSpec& spec) {
  const auto one_dim_contiguous = [](const GemmOperand& o) { return o.col_stride == 1 || o.row_stride == 1; };
  if (spec.c.col_stride != 1 || !one_dim_contiguous(spec.a) || !one_dim_contiguous(spec.b) || spec.a.rows <= 0 ||
      spec.a.cols <= 0 || spec.b.cols <= 0) {
    return nullptr;
  }
  return std::make_unique<Avx2Gemm>(spec);
}

}  // namespace grpo::kernels
