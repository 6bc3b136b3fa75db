// common::swizzle and common::staged_swizzle: the shared-memory layouts of staged tiles. The
// panel-major layout is what a bulk tensor store with the 128-byte swizzle reads, so it must
// put every (row, chunk) where the TMA's address rule does: within a 1024-byte-aligned panel
// of 128-byte rows, the 16-byte chunk bits [4, 7) of the address XORed with its bits [7, 10).
#include <gtest/gtest.h>

#include <set>

#include "common/swizzle.hpp"

namespace hipflash::test {
namespace {

// Byte offset of chunk c of row r in a [rows][64] box swizzled the TMA's 128-byte way.
int tma_box_byte(int r, int c) {
  const int plain = r * 128 + c * 16;
  return plain ^ (((plain >> 7) & 7) << 4);
}

template <int kChunks, int kPanelRows>
void check_layout(int rows) {
  std::set<int> seen;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < kChunks; ++c) {
      const int off = common::staged_swizzle<kChunks, kPanelRows>(r, c);
      ASSERT_EQ(off % 8, 0) << "16-byte chunks";
      ASSERT_GE(off, 0);
      ASSERT_LT(off, rows * kChunks * 8);
      ASSERT_TRUE(seen.insert(off).second) << "row " << r << " chunk " << c << " overlaps";
      if (kPanelRows == 0 || kChunks == 8) {
        EXPECT_EQ(off, common::swizzle<kChunks>(r, c));
      } else {
        const int panel = c / 8;
        EXPECT_EQ(2 * off, panel * kPanelRows * 128 + tma_box_byte(r, c % 8))
            << "row " << r << " chunk " << c;
      }
    }
}

TEST(Swizzle, RowMajorIsABijection) {
  check_layout<8, 0>(64);
  check_layout<16, 0>(128);
  check_layout<32, 0>(64);
}

TEST(Swizzle, OnePanelIsTheTmaBox) {
  // hd64: the row-major tile is one panel; both are the TMA's box.
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 8; ++c)
      EXPECT_EQ(2 * common::swizzle<8>(r, c), tma_box_byte(r, c)) << r << " " << c;
  check_layout<8, 128>(128);
}

TEST(Swizzle, PanelMajorTilesAreTmaBoxes) {
  check_layout<16, 128>(128);  // hd128, two consumers of 64 rows
  check_layout<16, 64>(64);
  check_layout<32, 128>(128);
}

// The fp8 tiles (16 one-byte elements a chunk): each row's chunks a bijection within the row,
// and the eight rows of an ldmatrix (one chunk each, any eight consecutive rows from a multiple
// of 8) on eight different 16-byte bank groups of a 128-byte line — for 64-byte rows (hd64),
// two rows a line, too.
template <int kChunks>
void check_fp8_rows() {
  for (int r = 0; r < 64; ++r) {
    std::set<int> in_row;
    for (int c = 0; c < kChunks; ++c) {
      const int off = common::swizzle<kChunks, 16>(r, c);
      EXPECT_EQ(off / (kChunks * 16), r) << "row " << r << " chunk " << c << " stays in its row";
      EXPECT_TRUE(in_row.insert(off).second) << "row " << r << " chunk " << c;
    }
  }
  for (int r0 = 0; r0 < 64; r0 += 8)
    for (int c = 0; c < kChunks; ++c) {
      std::set<int> groups;
      for (int r = r0; r < r0 + 8; ++r) groups.insert(common::swizzle<kChunks, 16>(r, c) / 16 % 8);
      EXPECT_EQ(groups.size(), 8u) << "rows " << r0 << ".. chunk " << c << ": bank conflicts";
    }
}

TEST(Swizzle, Fp8TilesAreConflictFree) {
  check_fp8_rows<4>();   // hd64
  check_fp8_rows<8>();   // hd128
  check_fp8_rows<16>();  // hd256
}

}  // namespace
}  // namespace hipflash::test
