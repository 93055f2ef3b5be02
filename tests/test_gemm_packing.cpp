// The blocked GEMM's packing alone (src/kernels/gemm_pack_avx512.hpp and
// gemm_pack_avx2.hpp, through gemm_pack_hooks.hpp): every layout a micro
// declares (gemm_micro.hpp), the avx2 one's from bf16 and from f32 sources,
// from K-contiguous and from transposed sources whose padding holds NaN,
// at the layouts' own edges (8-row groups, 16-row tiles, 32-row panels, k
// pairs, 32-k steps), against the layout written out as plain index
// arithmetic: each element where the layout says, and zeros in the padding.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm_amx_emulated.hpp"
#include "gemm_pack_hooks.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels::testing {
namespace {

constexpr std::uint16_t kNan = 0x7fc0;        // bf16 NaN: the sources' padding
constexpr std::uint16_t kUnwritten = 0xffff;  // the packed buffers before packing

std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }

// A rows x cols bf16 matrix of random non-NaN bit patterns, K-contiguous
// (kcontig: element (i, j) at i * ld + j) or transposed (at j * ld + i), ld
// the extent + 3, the padding NaN.
struct Source {
  std::vector<std::uint16_t> data;
  std::int64_t rs = 0, cs = 0;
  std::uint16_t at(std::int64_t i, std::int64_t j) const { return data[static_cast<std::size_t>(i * rs + j * cs)]; }
};
Source make_source(std::int64_t rows, std::int64_t cols, bool row_contiguous, std::mt19937& rng) {
  Source s;
  const std::int64_t ld = (row_contiguous ? cols : rows) + 3;
  s.rs = row_contiguous ? ld : 1;
  s.cs = row_contiguous ? 1 : ld;
  s.data.assign(static_cast<std::size_t>((row_contiguous ? rows : cols) * ld), kNan);
  std::uniform_int_distribution<int> bits(0, 0x7f7f);  // finite magnitudes; sign below
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      s.data[static_cast<std::size_t>(i * s.rs + j * s.cs)] =
          static_cast<std::uint16_t>(bits(rng) | ((i + j) % 2 == 0 ? 0 : 0x8000));
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
  std::uint16_t operator[](std::int64_t i) const { return data_[i]; }
  // Packed f32 element i's bits as a bf16 (exact: the low half is zero), or
  // kUnwritten when the low half is not (a value the packing never wrote).
  std::uint16_t f32_at(std::int64_t i) const {
    std::uint32_t bits = 0;
    std::memcpy(&bits, data_ + 2 * i, sizeof(bits));
    return (bits & 0xffffU) == 0 ? static_cast<std::uint16_t>(bits >> 16) : kUnwritten;
  }

 private:
  std::vector<std::uint16_t> storage_;
  std::uint16_t* data_ = nullptr;
};

// A packed block against its source: element (i, j) of the rows x cols
// source where the layout's index arithmetic got(i, j) says, 0 in the padding
// up to padded_rows x padded_cols. At most three mismatches are reported.
template <class Got>
void expect_packed(const Source& src, const char* name, std::int64_t rows, std::int64_t cols, std::int64_t padded_rows,
                   std::int64_t padded_cols, Got got) {
  int bad = 0;
  for (std::int64_t i = 0; i < padded_rows && bad < 3; ++i) {
    for (std::int64_t j = 0; j < padded_cols && bad < 3; ++j) {
      const std::uint16_t want = i < rows && j < cols ? src.at(i, j) : 0;
      const std::uint16_t g = got(i, j);
      if (g != want) {
        ++bad;
        ADD_FAILURE() << name << "(" << i << ", " << j << ") packed as 0x" << std::hex << g << ", want 0x" << want;
      }
    }
  }
}

const PackedX kXLayouts[] = {PackedX::tiles, PackedX::groups_bf16, PackedX::groups_f32};
const char* name(PackedX l) {
  return l == PackedX::tiles ? "XTiles" : l == PackedX::groups_bf16 ? "XRowGroups<8, Bf16>" : "XRowGroups<8, F32>";
}

TEST(GemmPacking, XPanelsInEveryLayout) {
  if (!amx_emulation_runs()) GTEST_SKIP() << "the packers are AVX-512 code; this CPU has no AVX-512F/BW/DQ/VL";
  std::mt19937 rng(2029);
  for (const PackedX layout : kXLayouts) {
    for (const bool kcontig : {true, false}) {
      for (const std::int64_t rows : {1, 7, 8, 9, 15, 16, 17, 31, 32}) {
        for (const std::int64_t kb : {1, 2, 3, 31, 32, 33, 64, 65}) {
          SCOPED_TRACE(std::string(name(layout)) + (kcontig ? " K-contiguous" : " transposed") + " rows " +
                       std::to_string(rows) + " kb " + std::to_string(kb) + " (seed 2029)");
          const Source x = make_source(rows, kb, kcontig, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          const bool f32 = layout == PackedX::groups_f32;
          Packed out(32 * kb32 * (f32 ? 2 : 1));
          pack_x_panel(layout, x.data.data(), x.rs, x.cs, rows, kb, out.data());
          expect_packed(x, "X", rows, kb, 32, kb32, [&](std::int64_t r, std::int64_t k) -> std::uint16_t {
            if (layout == PackedX::tiles) {
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
  for (const PackedY layout : {PackedY::vnni_bf16, PackedY::vnni_f32}) {
    for (const bool ncontig : {true, false}) {
      for (const std::int64_t nb : {1, 15, 16, 17, 31, 32, 33, 64}) {
        for (const std::int64_t kb : {1, 2, 3, 31, 32, 33, 64, 65}) {
          const bool f32 = layout == PackedY::vnni_f32;
          SCOPED_TRACE(std::string(f32 ? "YVnni<F32>" : "YVnni<Bf16>") + (ncontig ? " N-contiguous" : " transposed") +
                       " nb " + std::to_string(nb) + " kb " + std::to_string(kb) + " (seed 2030)");
          const Source y = make_source(kb, nb, ncontig, rng);
          const std::int64_t kb32 = round_up(kb, 32);
          const std::int64_t nb32 = round_up(nb, 32);
          Packed out(nb32 * kb32 * (f32 ? 2 : 1));
          pack_y_block(layout, y.data.data(), y.rs, y.cs, kb, nb, out.data());
          expect_packed(y, "Y", kb, nb, kb32, nb32, [&](std::int64_t k, std::int64_t n) -> std::uint16_t {
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

// The avx2 micro's sources: s's elements as f32 (exact), the padding NaN.
std::vector<float> widened(const Source& s) {
  std::vector<float> out(s.data.size());
  for (std::size_t i = 0; i < s.data.size(); ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(s.data[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof(float));
  }
  return out;
}

// XRowGroups<6, F32> panels of 24 rows (the avx2 micro's): per group of 6
// rows, [k pair][6 rows][2] f32, from bf16 and from f32 sources.
TEST(GemmPacking, Avx2XPanelsInRowGroupsOfSix) {
  if (!avx2_gemm_usable()) GTEST_SKIP() << "the avx2 packer is AVX2 code; this CPU has no AVX2 and FMA";
  std::mt19937 rng(2031);
  for (const bool f32 : {false, true}) {
    for (const bool kcontig : {true, false}) {
      for (const std::int64_t rows : {1, 5, 6, 7, 11, 12, 13, 23, 24}) {
        for (const std::int64_t kb : {1, 2, 3, 7, 8, 9, 31, 32, 33, 65}) {
          SCOPED_TRACE(std::string(f32 ? "f32" : "bf16") + (kcontig ? " K-contiguous" : " transposed") + " rows " +
                       std::to_string(rows) + " kb " + std::to_string(kb) + " (seed 2031)");
          const Source x = make_source(rows, kb, kcontig, rng);
          const std::vector<float> xf = widened(x);
          const std::int64_t kb32 = round_up(kb, 32);
          Packed out(24 * kb32 * 2);
          pack_x_panel_avx2(f32 ? static_cast<const void*>(xf.data()) : x.data.data(), f32, x.rs, x.cs, rows, kb,
                            reinterpret_cast<float*>(out.data()));
          expect_packed(x, "X", rows, kb, 24, kb32, [&](std::int64_t r, std::int64_t k) {
            return out.f32_at((r / 6) * 6 * kb32 + (k / 2) * 12 + (r % 6) * 2 + k % 2);
          });
        }
      }
    }
  }
}

// YVnni<F32> blocks (the avx2 micro's): per 16 columns, [kb32][16] f32.
TEST(GemmPacking, Avx2YBlocksAsF32Rows) {
  if (!avx2_gemm_usable()) GTEST_SKIP() << "the avx2 packer is AVX2 code; this CPU has no AVX2 and FMA";
  std::mt19937 rng(2032);
  for (const bool f32 : {false, true}) {
    for (const bool ncontig : {true, false}) {
      for (const std::int64_t nb : {1, 15, 16, 17, 31, 32, 33, 64}) {
        for (const std::int64_t kb : {1, 2, 3, 7, 8, 9, 31, 32, 33, 65}) {
          SCOPED_TRACE(std::string(f32 ? "f32" : "bf16") + (ncontig ? " N-contiguous" : " transposed") + " nb " +
                       std::to_string(nb) + " kb " + std::to_string(kb) + " (seed 2032)");
          const Source y = make_source(kb, nb, ncontig, rng);
          const std::vector<float> yf = widened(y);
          const std::int64_t kb32 = round_up(kb, 32);
          const std::int64_t nb32 = round_up(nb, 32);
          Packed out(nb32 * kb32 * 2);
          pack_y_block_avx2(f32 ? static_cast<const void*>(yf.data()) : y.data.data(), f32, y.rs, y.cs, kb, nb,
                            reinterpret_cast<float*>(out.data()));
          expect_packed(y, "Y", kb, nb, kb32, nb32, [&](std::int64_t k, std::int64_t n) {
            return out.f32_at((n / 16) * kb32 * 16 + k * 16 + n % 16);
          });
        }
      }
    }
  }
}

}  // namespace
}  // namespace grpo::kernels::testing
