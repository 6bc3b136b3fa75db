// common::RowMask (BlockInfo::row_mask): the sm90_ws consumers' mask in a few ints, solved once
// per tile for one warpgroup's rows. Its full-block range and per-row key ranges must give the
// per-element rule of BlockInfo::key_valid (SPEC §3), and must mask no fewer elements than
// BlockInfo's own per-tile test, over lengths, windows on either side or both, and row ranges
// inside, across and past the sequence.
#include <gtest/gtest.h>

#include "common/block_info.hpp"
#include "test_util.hpp"

namespace hipflash::test {
namespace {

// kBN: a power of two as at hd64 / hd128, and one that is not, as hd256's 80-key blocks.
template <int kBN>
void check_row_mask() {
  constexpr int kBM = 32, kRows = 16, kN = 2;
  using Info = common::BlockInfo<kBM, kBN>;
  int checked = 0, full_blocks = 0;
  for_each_mask_case({1, 7, 16, 37, 70}, {1, 9, 16, 40, 75}, [&](const FwdParams& p,
                                                                 bool masked) {
    const int64_t len_q = p.seqlen_q, len_k = p.seqlen_k;
    const int num_m_blocks = int((len_q + kBM - 1) / kBM);
    for (int m = 0; m < num_m_blocks; ++m) {
      const Info bi(p, m, num_m_blocks, false);
      const int64_t m0 = int64_t(bi.m_block) * kBM;
      // Each half of the tile (a "warpgroup" of kRows rows), its rows in pairs as a thread
      // holds them (rows r and r + 8).
      for (int64_t i0 = m0; i0 < m0 + kBM; i0 += kRows)
        for (int r = 0; r < 8; ++r) {
          const auto row_of = [&](int h) { return i0 + r + 8 * h; };
          const auto mask = bi.template row_mask<kRows, kN>(p, i0, masked, row_of);
          for (int n = 0; n * kBN < len_k + kBN; ++n) {
            // A block the tile's own test calls full is full for its rows too.
            if (!bi.needs_mask(p, n, masked)) ASSERT_FALSE(mask.needs_mask(n));
            if (!mask.needs_mask(n)) ++full_blocks;
            for (int h = 0; h < kN; ++h) {
              int lo, hi;
              mask.key_range(h, n, lo, hi);
              for (int col = 0; col < kBN; ++col) {
                const int64_t j = int64_t(n) * kBN + col;
                const bool rule = Info::key_valid(p, row_of(h), j, len_k, bi.diag, masked);
                const bool got = mask.needs_mask(n) ? col >= lo && col <= hi : true;
                ASSERT_EQ(got, rule) << "len_q " << len_q << " len_k " << len_k << " window ("
                                     << p.window_left << ", " << p.window_right << ") row "
                                     << row_of(h) << " key " << j << " block " << n;
                ++checked;
              }
            }
          }
        }
    }
  });
  EXPECT_GT(checked, 100000);
  EXPECT_GT(full_blocks, 1000);
}

TEST(RowMask, SolvedBoundsEqualThePerElementRule) { check_row_mask<16>(); }
TEST(RowMask, SolvedBoundsEqualThePerElementRuleOddBlock) { check_row_mask<20>(); }

// common::TileDivisors (the sm90_ws kernel's tile decode): the same (query block, split,
// head, batch, KV head) and key blocks as BlockInfo's plain divisions, for every tile of calls
// with odd and power-of-two counts, GQA groups, splits, and both query-block orders.
TEST(TileDivisors, DecodeEveryTileAsThePlainDivisions) {
  int64_t checked = 0;
  for (int64_t batch : {1, 3, 8})
    for (int64_t heads_kv : {1, 3, 4})
      for (int64_t group : {1, 2, 5})
        for (int splits : {1, 3, 4})
          for (int64_t len_q : {1, 64, 200, 1000}) {
            FwdParams p;
            p.batch = batch;
            p.heads_kv = heads_kv;
            p.heads_q = heads_kv * group;
            p.num_splits = splits;
            p.seqlen_q = len_q;
            p.seqlen_k = len_q + 77;
            using Info = common::BlockInfo<64, 128>;
            const int num_m_blocks = int((len_q + 63) / 64);
            const common::TileDivisors div(p, num_m_blocks);
            const int64_t tiles = int64_t(num_m_blocks) * splits * p.heads_q * batch;
            for (bool reverse : {false, true})
              for (int64_t t = 0; t < tiles; ++t) {
                const Info a(p, t, num_m_blocks, reverse), b(p, t, div, reverse);
                ASSERT_EQ(a.m_block, b.m_block) << t;
                ASSERT_EQ(a.split, b.split) << t;
                ASSERT_EQ(a.h, b.h) << t;
                ASSERT_EQ(a.b, b.b) << t;
                ASSERT_EQ(a.h_kv, b.h_kv) << t;
                ASSERT_EQ(a.n_block_min, b.n_block_min) << t;
                ASSERT_EQ(a.n_block_max, b.n_block_max) << t;
                ++checked;
              }
          }
  EXPECT_GT(checked, 100000);
}

}  // namespace
}  // namespace hipflash::test
