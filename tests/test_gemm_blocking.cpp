// The blocked GEMM's blocking (src/kernels/gemm_blocking.hpp) alone: a pure
// function of the spec and the micro's declared shape, checked here without
// any ISA (the GEMM tester runs what it plans; this checks the plan's own
// rules): the orientation, Y blocks within their byte budgets and on tile
// edges, the whole-Y cases, the shared-row caps, and the scratch layout.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/gemm_blocking.hpp"

namespace grpo::kernels::blocked {
namespace {

// The micros' shapes as they declare them (gemm_micro.hpp's micro_shape):
// amx bf16 tiles staged through memory with a 64-byte tile configuration;
// avx512bf16 bf16 groups, Y taken whole; avx512fma the same in f32; avx2 f32
// in panels of 24 rows and Y blocks of 256 KiB, Y never whole.
constexpr MicroShape kAmx{
    .x_elem_bytes = 2, .y_elem_bytes = 2, .whole_shared_y = false, .staged_floats = kStagedFloats, .state_bytes = 64};
constexpr MicroShape kBf16{.x_elem_bytes = 2, .y_elem_bytes = 2, .whole_shared_y = true};
constexpr MicroShape kFma{.x_elem_bytes = 4, .y_elem_bytes = 4, .whole_shared_y = true};
constexpr MicroShape kAvx2{.x_elem_bytes = 4,
                           .y_elem_bytes = 4,
                           .panel_rows = 24,
                           .y_block_bytes = std::size_t{256} << 10,
                           .whole_shared_y = false};
constexpr MicroShape kShapes[] = {kAmx, kBf16, kFma, kAvx2};

GemmSpec spec_of(std::int64_t m, std::int64_t k, std::int64_t n, bool a_t, bool b_t,
                 SharedOperand shared = SharedOperand::none) {
  GemmSpec s;
  s.a = a_t ? GemmOperand{DType::bf16, m, k, 1, m} : GemmOperand{DType::bf16, m, k, k, 1};
  s.b = b_t ? GemmOperand{DType::bf16, k, n, 1, k} : GemmOperand{DType::bf16, k, n, n, 1};
  s.c = {DType::f32, m, n, n, 1};
  s.shared = shared;
  return s;
}

// The step's three GEMMs at H = 4096, a 2048-column vocab tile, T rows.
GemmSpec forward(std::int64_t t) { return spec_of(t, 4096, 2048, false, true, SharedOperand::a); }
GemmSpec dhidden(std::int64_t t) {
  GemmSpec s = spec_of(t, 151936, 2048, false, false);
  s.b.row_stride = 4096;  // a 2048-column chunk of W [V, 4096]
  return s;
}

TEST(GemmBlocking, SharedOperandIsY) {
  for (const MicroShape& micro : kShapes) {
    EXPECT_TRUE(plan_blocking(spec_of(64, 256, 512, false, false, SharedOperand::a), micro).swapped);
    EXPECT_FALSE(plan_blocking(spec_of(512, 256, 64, true, true, SharedOperand::b), micro).swapped);
  }
}

TEST(GemmBlocking, OrientationPacksFewerElements) {
  // A K-contiguous X costs a quarter of a transposing pack; Y is always
  // rearranged. M = 32 rows of A against N = 4096 columns of B: packing B
  // as Y costs 4096 K, as X (B^T, K-contiguous when B is transposed) K.
  EXPECT_TRUE(plan_blocking(spec_of(32, 512, 4096, false, true), kBf16).swapped);
  EXPECT_FALSE(plan_blocking(spec_of(4096, 512, 32, false, false), kBf16).swapped);
}

TEST(GemmBlocking, YBlocksFitTheirBudgetOnTileEdges) {
  for (const MicroShape& micro : kShapes) {
    for (const std::int64_t m : {1, 31, 32, 33, 640}) {
      for (const std::int64_t k : {1, 31, 32, 33, 3000, 4096, 151936}) {
        for (const std::int64_t n : {1, 17, 256, 2000, 2048}) {
          const Blocking b = plan_blocking(spec_of(m, k, n, false, true), micro);
          SCOPED_TRACE(testing::Message() << m << " x " << k << " x " << n);
          EXPECT_EQ(b.kc % kKStep, 0);
          EXPECT_EQ(b.nc % kPanel, 0);
          EXPECT_LE(b.kc, round_up(b.k, kKStep));
          EXPECT_LE(b.nc, round_up(b.ny, kPanel));
          // An L2 block, or Y taken whole (within the wide-Y budget).
          const auto y = static_cast<std::size_t>(b.kc * b.nc * micro.y_elem_bytes);
          EXPECT_LE(y,
                    b.nc == round_up(b.ny, kPanel) ? std::max(micro.y_block_bytes, kWideYBytes) : micro.y_block_bytes);
          EXPECT_EQ(b.y_bytes % kAlignBytes, 0U);
          // Partial sums only when K is split.
          EXPECT_EQ(b.acc_bytes == 0, b.kc >= b.k);
        }
      }
    }
  }
}

TEST(GemmBlocking, ScratchIsItsParts) {
  for (const MicroShape& micro : kShapes) {
    for (const GemmSpec& spec : {forward(640), dhidden(512), spec_of(2048, 512, 4096, true, false)}) {
      const Blocking b = plan_blocking(spec, micro);
      EXPECT_EQ(b.scratch_bytes, b.y_bytes + b.x_bytes + b.acc_bytes +
                                     static_cast<std::size_t>(micro.staged_floats) * sizeof(float) + micro.state_bytes);
      // Given the packed shared Y, its block's room goes.
      EXPECT_EQ(scratch_bytes_with_packed(spec, b),
                spec.shared == SharedOperand::none ? b.scratch_bytes : b.scratch_bytes - b.y_bytes);
      EXPECT_EQ(shared_packed_bytes(spec, b), spec.shared == SharedOperand::none
                                                  ? 0
                                                  : static_cast<std::size_t>(b.k_blocks() * b.n_blocks()) * b.y_bytes);
    }
  }
}

// The forward's hidden rows, shared: a whole_shared_y micro takes them whole
// in k blocks of kSharedKBlock (= H here, so no partial sums) up to
// kSharedYWholeBytes: 8 MiB / (4096 x 2 bytes) = 1024 rows in bf16, 512 in
// f32. AMX keeps L2 blocks and caps the partial sums at kSharedAccBytes:
// 5 MiB / (2048 x 4 bytes) = 640 rows; avx2 likewise, its 2048 X rows padded
// to panels of 24: 5 MiB / (2064 x 4 bytes), 608 rows.
TEST(GemmBlocking, SharedRowCaps) {
  EXPECT_EQ(plan_blocking(forward(160), kBf16).max_shared_rows, 1024);
  EXPECT_EQ(plan_blocking(forward(160), kFma).max_shared_rows, 512);
  EXPECT_EQ(plan_blocking(forward(160), kAmx).max_shared_rows, 640);
  EXPECT_EQ(plan_blocking(forward(160), kAvx2).max_shared_rows, 608);
  const Blocking whole = plan_blocking(forward(1024), kBf16);
  EXPECT_EQ(whole.kc, 4096);
  EXPECT_EQ(whole.nc, 1024);
  EXPECT_EQ(whole.acc_bytes, 0U);
  // Past the cap the L2 blocks stay.
  EXPECT_LT(plan_blocking(forward(1056), kBf16).nc, 1056);
}

// dhidden's W chunk (2048 columns of rows 8 KiB apart) is wider than an L2
// block: a whole_shared_y micro takes it whole in k blocks of
// kWideYBytes / (2048 x 2 bytes) = 1024; in f32 they would be 512, under
// kWideYMinK, so the L2 blocks stay; AMX always keeps them.
TEST(GemmBlocking, WideYTakenWholeInLongKBlocks) {
  const Blocking bf16 = plan_blocking(dhidden(512), kBf16);
  EXPECT_FALSE(bf16.swapped);
  EXPECT_EQ(bf16.nc, 2048);
  EXPECT_EQ(bf16.kc, 1024);
  EXPECT_LT(plan_blocking(dhidden(512), kFma).nc, 2048);
  EXPECT_LT(plan_blocking(dhidden(512), kAmx).nc, 2048);
}

// X is packed a whole k block at a time when Y spans several column blocks
// (each panel then serves all of them), within kXWholeBytes; one panel at a
// time otherwise.
TEST(GemmBlocking, XWholeOnlyAcrossColumnBlocks) {
  for (const MicroShape& micro : kShapes) {
    for (const GemmSpec& spec : {forward(640), dhidden(512), spec_of(33, 3000, 256, false, false),
                                 spec_of(40, 640, 1100, false, false), spec_of(40000, 512, 3000, false, false)}) {
      const Blocking b = plan_blocking(spec, micro);
      const std::int64_t mx_padded = round_up(b.mx, micro.panel_rows);
      const bool several = b.nc < round_up(b.ny, kPanel);
      const bool fits = static_cast<std::size_t>(mx_padded * b.kc * micro.x_elem_bytes) <= kXWholeBytes;
      EXPECT_EQ(b.x_whole, several && fits);
      EXPECT_EQ(b.x_bytes, align_up(static_cast<std::size_t>((b.x_whole ? mx_padded : micro.panel_rows) * b.kc *
                                                             micro.x_elem_bytes)));
      // Partial sums for whole panels of X rows by whole blocks of Y columns.
      if (b.acc_bytes > 0) EXPECT_EQ(b.acc_bytes, align_up(static_cast<std::size_t>(mx_padded * b.acc_ld) * 4));
    }
  }
}

TEST(GemmBlocking, ServesBf16WithOneContiguousDimension) {
  EXPECT_TRUE(serves(spec_of(7, 9, 11, true, false)));
  GemmSpec f32 = spec_of(7, 9, 11, false, false);
  f32.a.dtype = DType::f32;
  EXPECT_FALSE(serves(f32));
  GemmSpec strided = spec_of(7, 9, 11, false, false);
  strided.b.col_stride = 2;
  EXPECT_FALSE(serves(strided));
}

// serves_widened (the avx2 backend's): A and B each f32, bf16 or f16, with
// the same contiguity rules as serves(); serves_f16_mix (what the avx512fma
// backend takes beside serves()'s): those with an f16 A or B.
TEST(GemmBlocking, ServesWidenedDtypesWithOneContiguousDimension) {
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (const DType a : dtypes) {
    for (const DType b : dtypes) {
      SCOPED_TRACE(std::string(to_string(a)) + " x " + to_string(b));
      GemmSpec mixed = spec_of(7, 9, 11, false, true);
      mixed.a.dtype = a;
      mixed.b.dtype = b;
      const bool f16 = a == DType::f16 || b == DType::f16;
      EXPECT_TRUE(serves_widened(mixed));
      EXPECT_EQ(serves_f16_mix(mixed), f16);
      EXPECT_EQ(serves(mixed), a == DType::bf16 && b == DType::bf16);
      mixed.b.row_stride = 2;  // B [9, 11] with neither stride 1
      EXPECT_FALSE(serves_widened(mixed));
      EXPECT_FALSE(serves_f16_mix(mixed));
    }
  }
}

}  // namespace
}  // namespace grpo::kernels::blocked
