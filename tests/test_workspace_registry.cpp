// The workspace registry's uses of a region (WorkspaceRegistry::book_use,
// src/driver/workspace_registry.hpp): laid out from the host region's first
// byte, piece after piece on their alignment, taking no bytes of their own,
// and refused when they outgrow the host at the laid-out block.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <stdexcept>
#include <vector>

#include "driver/workspace_registry.hpp"

namespace grpo::detail {
namespace {

TEST(WorkspaceRegistry, UsesLieInTheirRegionAndTakeNoBytes) {
  WorkspaceRegistry w;
  w.book(Region::block, 100);  // 100 bytes a block row
  w.book(Region::stage, 0, 256);
  const std::size_t total = w.lay_out(8, 1).total;
  const std::array<WorkspacePiece, 2> kept{{{40, 0}, {30, 0}}};
  w.book_use(RegionUse::kept_dlogits, Region::block, kept);
  const std::array<WorkspacePiece, 1> probes{{{0, 256}}};
  w.book_use(RegionUse::tail_probes, Region::stage, probes);
  const WorkspaceLayout l = w.lay_out(8, 1);
  EXPECT_EQ(l.total, total);
  std::vector<std::byte> ws(l.total);
  const std::span<std::byte> first = l.use_piece<std::byte>(ws.data(), RegionUse::kept_dlogits, 0);
  const std::span<std::byte> second = l.use_piece<std::byte>(ws.data(), RegionUse::kept_dlogits, 1);
  EXPECT_EQ(first.data(), ws.data() + l.at(Region::block));
  EXPECT_EQ(first.size(), 8U * 40);
  EXPECT_EQ(second.data(), ws.data() + l.at(Region::block) + 320);  // 320: already on a 64-byte line
  EXPECT_EQ(second.size(), 8U * 30);
  EXPECT_EQ(l.use_piece<std::byte>(ws.data(), RegionUse::tail_probes, 0).data(), ws.data() + l.at(Region::stage));
  EXPECT_TRUE(l.use_piece<std::byte>(ws.data(), RegionUse::tail_apply, 0).empty());  // not booked
}

TEST(WorkspaceRegistry, AUseThatOutgrowsItsRegionIsRefused) {
  WorkspaceRegistry w;
  w.book(Region::block, 100);
  // 60 + 50 bytes a row: at 8 rows the second piece starts at 512 (480 on
  // its 64-byte line) and ends at 912, past the region's 800.
  const std::array<WorkspacePiece, 2> kept{{{60, 0}, {50, 0}}};
  w.book_use(RegionUse::kept_dlogits, Region::block, kept);
  EXPECT_THROW(w.lay_out(8, 1), std::logic_error);
  const std::array<WorkspacePiece, 2> fits{{{40, 0}, {40, 0}}};
  w.book_use(RegionUse::kept_dlogits, Region::block, fits);
  EXPECT_NO_THROW(w.lay_out(8, 1));
}

}  // namespace
}  // namespace grpo::detail
