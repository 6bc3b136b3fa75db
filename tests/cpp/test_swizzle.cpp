// common::swizzle and common::staged_swizzle: the shared-memory layouts of staged tiles. The
// panel-major layout is what a bulk tensor store with the 128-byte swizzle reads, so it must
// put every (row, chunk) where the TMA's address rule does: within a 1024-byte-aligned panel
// of 128-byte rows, the 16-byte chunk bits [4, 7) of the address XORed with its bits [7, 10).
#include <gtest/gtest.h>

#include <set>

#include "common/swizzle.hpp"
#include "sm90_ws/tile.hpp"

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

// fp8's V -> Vt transposer (sm90_ws::VtSteps): each lane's ldmatrix row is the byte where the
// TMA landed its key and head-dim chunk (the 128- or 64-byte swizzle: chunk bits [4, 7) or
// [4, 6) XORed with bits [7, 10) or [7, 9)), each stmatrix row its Vt row's key chunk in the
// 128-byte swizzle; over a stage's steps every 16-byte chunk of V is read once and every one
// of Vt written once, at any 1024-byte-aligned stage base.
int tma_swizzled(int row_bytes, int row, int chunk) {
  const int plain = row * row_bytes + chunk * 16;
  return plain ^ (((plain >> 7) & (row_bytes == 128 ? 7 : 3)) << 4);
}

template <int kRowBytes, int kHeadBytes>
void check_vt_steps(uint32_t sV, uint32_t sVt) {
  constexpr int kBN = 128, kChunks = kRowBytes / 16;
  std::set<uint32_t> read, written;
  for (uint32_t pair = 0; pair < kHeadBytes / 32; ++pair)
    for (uint32_t k16 = 0; k16 < kBN / 16; ++k16)
      for (uint32_t lane = 0; lane < 32; ++lane) {
        const sm90_ws::VtSteps<kRowBytes, kBN> at(sV, sVt, lane);
        const int m = int(lane) / 8, r = int(lane) % 8;
        const int key = 16 * int(k16) + 8 * (m & 1) + r, chunk = 2 * int(pair) + m / 2;
        const uint32_t v = sV + uint32_t((chunk / kChunks) * kBN * kRowBytes +
                                         tma_swizzled(kRowBytes, key, chunk % kChunks));
        const int vt_row = 16 * chunk + 2 * r + ((m & 1) ^ (r >= 4 ? 1 : 0));
        const uint32_t vt = sVt + uint32_t(tma_swizzled(128, vt_row, int(k16)));
        ASSERT_EQ(at.ld(k16, pair), v) << "pair " << pair << " k16 " << k16 << " lane " << lane;
        ASSERT_EQ(at.st(k16, pair), vt) << "pair " << pair << " k16 " << k16 << " lane " << lane;
        read.insert(v);
        written.insert(vt);
      }
  EXPECT_EQ(read.size(), size_t(kBN * kHeadBytes / 16));
  EXPECT_EQ(written.size(), size_t(kBN * kHeadBytes / 16));
  EXPECT_EQ(*read.rbegin() - sV, uint32_t(kBN * kHeadBytes - 16));
  EXPECT_EQ(*written.rbegin() - sVt, uint32_t(kBN * kHeadBytes - 16));
}

TEST(Swizzle, Fp8TransposerAddressesFollowTheTmaLayouts) {
  for (uint32_t base : {0u, 1024u * 37u, 1024u * 200u}) {
    check_vt_steps<64, 64>(base, base + 8192);     // hd64: one 64-byte panel
    check_vt_steps<128, 128>(base, base + 16384);  // hd128: one 128-byte panel
    check_vt_steps<128, 256>(base, base + 32768);  // two panels (no fp8 kernel takes hd256)
  }
}

}  // namespace
}  // namespace hipflash::test
