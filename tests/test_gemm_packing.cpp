// The blocked GEMM's packing alone (src/kernels/gemm_pack_avx512.hpp and
// gemm_pack_avx2.hpp, through gemm_pack_hooks.hpp): every layout a micro
// declares (gemm_micro.hpp), from every source dtype it takes (bf16; for the
// f32 layouts f16 and f32 too), from K-contiguous and from transposed
// sources whose padding holds NaN, at the layouts' own edges (8-row groups,
// 16-row tiles, 32-row panels, k pairs, 16-k f32 steps, 32-k steps), against
// the layout written out as plain index arithmetic: each element where the
// layout says (widened exactly for an f32 layout), and zeros in the padding.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm_amx_emulated.hpp"
#include "gemm_pack_hooks.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels::testing {
namespace {

constexpr std::uint16_t kUnwritten = 0xffff;  // the packed buffers before packing (as f32: 0xffffffff)

std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }

// A rows x cols matrix of random finite values of dtype, K-contiguous
// (row_contiguous: element (i, j) at i * ld + j) or transposed (at j * ld +
// i), ld the extent + 3, the padding NaN.
struct Source {
  DType dtype = DType::bf16;
  std::vector<std::uint16_t> half;  // bf16 or f16 bits
  std::vector<std::uint32_t> full;  // f32 bits
  std::int64_t rs = 0, cs = 0;
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(full.data()) : static_cast<const void*>(half.data());
  }
  std::size_t at(std::int64_t i, std::int64_t j) const { return static_cast<std::size_t>(i * rs + j * cs); }
  // Element (i, j) as a bf16 layout holds it: its bits.
  std::uint32_t bits(std::int64_t i, std::int64_t j) const { return half[at(i, j)]; }
  // Element (i, j) as an f32 layout holds it: widened exactly.
  std::uint32_t widened(std::int64_t i, std::int64_t j) const {
    switch (dtype) {
      case DType::bf16: return static_cast<std::uint32_t>(half[at(i, j)]) << 16;
      case DType::f16: return std::bit_cast<std::uint32_t>(f16_to_float(half[at(i, j)]));
      case DType::f32: return full[at(i, j)];
    }
    return 0;
  }
};
Source make_source(std::int64_t rows, std::int64_t cols, bool row_contiguous, DType dtype, std::mt19937& rng) {
  Source s;
  s.dtype = dtype;
  const std::int64_t ld = (row_contiguous ? cols : rows) + 3;
  s.rs = row_contiguous ? ld : 1;
  s.cs = row_contiguous ? 1 : ld;
  const auto size = static_cast<std::size_t>((row_contiguous ? rows : cols) * ld);
  // Finite magnitudes (every exponent but the all-ones one), signs below;
  // the padding is the dtype's quiet NaN.
  const std::uint32_t max_magnitude = dtype == DType::f32 ? 0x7f7fffffU : dtype == DType::f16 ? 0x7bffU : 0x7f7fU;
  const std::uint32_t sign = dtype == DType::f32 ? 0x80000000U : 0x8000U;
  if (dtype == DType::f32) {
    s.full.assign(size, 0x7fc00000U);
  } else {
    s.half.assign(size, dtype == DType::f16 ? 0x7e00 : 0x7fc0);
  }
  std::uniform_int_distribution<std::uint32_t> bits(0, max_magnitude);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::uint32_t v = bits(rng) | ((i + j) % 2 == 0 ? 0 : sign);
      if (dtype == DType::f32) {
        s.full[s.at(i, j)] = v;
      } else {
        s.half[s.at(i, j)] = static_cast<std::uint16_t>(v);
      }
    }
  }
  return s;
}

// The packed block, 64-byte aligned as the GEMM's scratch is (the packers
// store whole aligned lines), every element kUnwritten before packing.
class Packed {
 public:
  explicit Packed(std::int64_t elems) : storage_(static_cast<std::size_t>(elems) + 32, kUnwritten) {
    const auto p = reinterpret_cast<std::uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - p % 64) % 64) / sizeof(std::uint16_t);
  }
  std::uint16_t* data() { return data_; }
  std::uint32_t operator[](std::int64_t i) const { return data_[i]; }
  // Packed f32 element i's bits.
  std::uint32_t f32_at(std::int64_t i) const {
    std::uint32_t bits = 0;
    std::memcpy(&bits, data_ + 2 * i, sizeof(bits));
    return bits;
  }

 private:
  std::vector<std::uint16_t> storage_;
  std::uint16_t* data_ = nullptr;
};

// A packed block against its source: element (i, j) of the rows x cols
// source, as want(i, j) says the layout holds it, where the layout's index
// arithmetic got(i, j) says; 0 in the padding up to padded_rows x
// padded_cols. At most three mismatches are reported.
template <class Want, class Got>
void expect_packed(const char* name, std::int64_t rows, std::int64_t cols, std::int64_t padded_rows,
                   std::int64_t padded_cols, Want want, Got got) {
  int bad = 0;
  for (std::int64_t i = 0; i < padded_rows && bad < 3; ++i) {
    for (std::int64_t j = 0; j < padded_cols && bad < 3; ++j) {
      const std::uint32_t w = i < rows && j < cols ? want(i, j) : 0;
      const std::uint32_t g = got(i, j);
      if (g != w) {
        ++bad;
        ADD_FAILURE() << name << "(" << i << ", " << j << ") packed as 0x" << std::hex << g << ", want 0x" << w;
      }
    }
  }
}

const char* name(PackedX l) {
  return l == PackedX::tiles ? "XTiles" : l == PackedX::groups_bf16 ? "XRowGroups<8, Bf16>" : "XRowGroups<8, F32>";
}

// A layout and a source dtype it takes.
struct XCase {
  PackedX layout;
  DType dtype;
};
struct YCase {
  PackedY layout;
  DType dtype;
};

TEST(GemmPacking, XPanelsInEveryLayout) {
  if (!amx_emulation_runs()) GTEST_SKIP() << "the packers are AVX-512 code; this CPU has no AVX-512F/BW/DQ/VL";
  std::mt19937 rng(2029);
  for (const XCase c : {XCase{PackedX::tiles, DType::bf16}, XCase{PackedX::groups_bf16, DType::bf16},
                        XCase{PackedX::groups_f32, DType::bf16}, XCase{PackedX::groups_f32, DType::f16},
                        XCase{PackedX::groups_f32, DType::f32}}) {
    for (const bool kcontig : {true, false}) {
      for (const std::int64_t rows : {1, 7, 8, 9, 15, 16, 17, 31, 32}) {
        for (const std::int64_t kb : {1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 65}) {
          SCOPED_TRACE(std::string(name(c.layout)) + " from " + to_string(c.dtype) +
                       (kcontig ? " K-contiguous" : " transposed") + " rows " + std::to_string(rows) + " kb " +
                       std::to_string(kb) + " (seed 2029)");
          const Source x = make_source(rows, kb, kcontig, c.dtype, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          const bool f32 = c.layout == PackedX::groups_f32;
          Packed out(32 * kb32 * (f32 ? 2 : 1));
          pack_x_panel(c.layout, x.data(), c.dtype, x.rs, x.cs, rows, kb, out.data());
          const auto want = [&](std::int64_t r, std::int64_t k) { return f32 ? x.widened(r, k) : x.bits(r, k); };
          expect_packed("X", rows, kb, 32, kb32, want, [&](std::int64_t r, std::int64_t k) -> std::uint32_t {
            if (c.layout == PackedX::tiles) {
              // [k step][2 tiles][16 rows][32 k]: the panel's row r of k step k / 32.
              return out[(k / 32) * 32 * 32 + r * 32 + k % 32];
            }
            // Per group of 8 rows: [k pair][8 rows] pairs of (k, k + 1).
            const std::int64_t pair = (r / 8) * 8 * (kb32 / 2) + (k / 2) * 8 + r % 8;
            return f32 ? out.f32_at(2 * pair + k % 2) : out[2 * pair + k % 2];
          });
        }
      }
    }
  }
}

TEST(GemmPacking, YBlocksInVnniRows) {
  if (!amx_emulation_runs()) GTEST_SKIP() << "the packers are AVX-512 code; this CPU has no AVX-512F/BW/DQ/VL";
  std::mt19937 rng(2030);
  for (const YCase c : {YCase{PackedY::vnni_bf16, DType::bf16}, YCase{PackedY::vnni_f32, DType::bf16},
                        YCase{PackedY::vnni_f32, DType::f16}, YCase{PackedY::vnni_f32, DType::f32}}) {
    for (const bool ncontig : {true, false}) {
      for (const std::int64_t nb : {1, 15, 16, 17, 31, 32, 33, 64}) {
        for (const std::int64_t kb : {1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 65}) {
          const bool f32 = c.layout == PackedY::vnni_f32;
          SCOPED_TRACE(std::string(f32 ? "YVnni<F32>" : "YVnni<Bf16>") + " from " + to_string(c.dtype) +
                       (ncontig ? " N-contiguous" : " transposed") + " nb " + std::to_string(nb) + " kb " +
                       std::to_string(kb) + " (seed 2030)");
          const Source y = make_source(kb, nb, ncontig, c.dtype, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          const std::int64_t nb32 = round_up(nb, 32);
          Packed out(nb32 * kb32 * (f32 ? 2 : 1));
          pack_y_block(c.layout, y.data(), c.dtype, y.rs, y.cs, kb, nb, out.data());
          const auto want = [&](std::int64_t k, std::int64_t n) { return f32 ? y.widened(k, n) : y.bits(k, n); };
          expect_packed("Y", kb, nb, kb32, nb32, want, [&](std::int64_t k, std::int64_t n) -> std::uint32_t {
            // Per 16 columns: kb32 / 2 rows of 16 (k, k + 1) pairs; F32: each
            // row's 16 k values, then its 16 k + 1 values.
            const std::int64_t row = (n / 16) * (kb32 / 2) * 32 + (k / 2) * 32;
            return f32 ? out.f32_at(row + (k % 2) * 16 + n % 16) : out[row + (n % 16) * 2 + k % 2];
          });
        }
      }
    }
  }
}

// XRowGroups<6, F32> panels of 24 rows (the avx2 micro's): per group of 6
// rows, [k pair][6 rows][2] f32, from bf16, f16 and f32 sources.
TEST(GemmPacking, Avx2XPanelsInRowGroupsOfSix) {
  if (!avx2_gemm_usable()) GTEST_SKIP() << "the avx2 packer is AVX2 code; this CPU has no AVX2, FMA and F16C";
  std::mt19937 rng(2031);
  for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (const bool kcontig : {true, false}) {
      for (const std::int64_t rows : {1, 5, 6, 7, 11, 12, 13, 23, 24}) {
        for (const std::int64_t kb : {1, 2, 3, 7, 8, 9, 31, 32, 33, 65}) {
          SCOPED_TRACE(std::string(to_string(dtype)) + (kcontig ? " K-contiguous" : " transposed") + " rows " +
                       std::to_string(rows) + " kb " + std::to_string(kb) + " (seed 2031)");
          const Source x = make_source(rows, kb, kcontig, dtype, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          Packed out(24 * kb32 * 2);
          pack_x_panel_avx2(x.data(), dtype, x.rs, x.cs, rows, kb, reinterpret_cast<float*>(out.data()));
          const auto want = [&](std::int64_t r, std::int64_t k) { return x.widened(r, k); };
          expect_packed("X", rows, kb, 24, kb32, want, [&](std::int64_t r, std::int64_t k) {
            return out.f32_at((r / 6) * 6 * kb32 + (k / 2) * 12 + (r % 6) * 2 + k % 2);
          });
        }
      }
    }
  }
}

// YVnni<F32> blocks (the avx2 micro's): per 16 columns, [kb32][16] f32.
TEST(GemmPacking, Avx2YBlocksAsF32Rows) {
  if (!avx2_gemm_usable()) GTEST_SKIP() << "the avx2 packer is AVX2 code; this CPU has no AVX2, FMA and F16C";
  std::mt19937 rng(2032);
  for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (const bool ncontig : {true, false}) {
      for (const std::int64_t nb : {1, 15, 16, 17, 31, 32, 33, 64}) {
        for (const std::int64_t kb : {1, 2, 3, 7, 8, 9, 31, 32, 33, 65}) {
          SCOPED_TRACE(std::string(to_string(dtype)) + (ncontig ? " N-contiguous" : " transposed") + " nb " +
                       std::to_string(nb) + " kb " + std::to_string(kb) + " (seed 2032)");
          const Source y = make_source(kb, nb, ncontig, dtype, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          const std::int64_t nb32 = round_up(nb, 32);
          Packed out(nb32 * kb32 * 2);
          pack_y_block_avx2(y.data(), dtype, y.rs, y.cs, kb, nb, reinterpret_cast<float*>(out.data()));
          const auto want = [&](std::int64_t k, std::int64_t n) { return y.widened(k, n); };
          expect_packed("Y", kb, nb, kb32, nb32, want, [&](std::int64_t k, std::int64_t n) {
            return out.f32_at((n / 16) * kb32 * 16 + k * 16 + n % 16);
          });
        }
      }
    }
  }
}

}  // namespace
}  // namespace grpo::kernels::testing
