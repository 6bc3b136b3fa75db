// The CPU backward's validation (include/hipflash/backward.hpp); its numerics are tested against
// fp64 autograd in tests/python/test_backward.py. And the GPU backward's mask bounds (host code
// of kernels/bwd/bwd_block_info.hpp and common::BlockInfo) against the per-element rule.
#include <vector>

#include "bwd/bwd_block_info.hpp"
#include "common/block_info.hpp"
#include "test_util.hpp"

namespace hipflash::test {
namespace {

// The backward's checks (include/hipflash/backward.hpp): the forward's, then the gradients'.
TEST(Backward, BadCallsAreRefusedBeforeAnythingIsWritten) {
  Dense t = make_dense({DType::bf16, 1, 9, 12, 2, 1, 64}, 5);
  t.run();
  HostTensor dout = t.out, dq = t.q, dk = t.k, dv = t.v;
  dq.fill(kNaN);
  auto expect = [&](const std::string& what, TensorRef dq_ref, TensorRef dk_ref) {
    try {
      backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq_ref, dk_ref, dv.ref);
      ADD_FAILURE() << "no exception; expected '" << what << "'";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(dq.all_nan());
  };
  TensorRef short_dq = dq.ref;
  short_dq.sizes[1] = 8;
  expect("dq must have the shape of q", short_dq, dk.ref);
  expect("dk must not alias dv", dq.ref, dv.ref);
  TensorRef on_gpu = dq.ref;
  expect("dq must be on the device of q", [&] { on_gpu.loc = {Location::gpu, 0}; return on_gpu; }(), dk.ref);
  // A valid call writes finite gradients.
  backward(dout.ref, t.q.ref, t.k.ref, t.v.ref, t.out.ref, t.lse.ref, dq.ref, dk.ref, dv.ref);
  EXPECT_FALSE(dq.all_nan());
}

// The backward passes test an element against bounds solved once per tile: the rows that see a
// key (SeqBounds::rows_seeing_key, dk/dv passes; in the unmasked instantiation only lo <= hi, a
// flag per key) and the keys a row sees (BlockInfo::key_range, dq pass). Both must give the rule
// of BlockInfo::key_valid (SPEC §3) for every element, over lengths, windows on either side or
// both, tiles inside, across and past the sequence.
TEST(BackwardMask, SolvedBoundsEqualThePerElementRule) {
  constexpr int kBM = 16, kBN = 16;
  using Info = common::BlockInfo<kBM, kBN>;
  int checked = 0;
  for_each_mask_case({1, 7, 16, 37}, {1, 9, 16, 40}, [&](const FwdParams& p, bool masked) {
    const int64_t len_q = p.seqlen_q, len_k = p.seqlen_k;
    const bwd::SeqBounds seq(p, 0);
    const Info bi(p, 0, 1, false);
    ASSERT_EQ(bi.len_k, len_k);
    ASSERT_EQ(bi.diag, seq.diag);
    for (int64_t m0 = 0; m0 < len_q + kBM; m0 += kBM)
      for (int64_t j = 0; j < len_k + kBN; ++j) {
        int lo, hi;
        seq.rows_seeing_key(p, j, m0, kBM, masked, lo, hi);
        for (int col = 0; col < kBM; ++col) {
          const bool rule = Info::key_valid(p, m0 + col, j, len_k, seq.diag, masked);
          const bool got = masked ? col >= lo && col <= hi : lo <= hi;
          ASSERT_EQ(got, rule) << "rows_seeing_key: len_q " << len_q << " len_k " << len_k
                               << " window (" << p.window_left << ", " << p.window_right
                               << ") m0 " << m0 << " key " << j << " row " << m0 + col;
          ++checked;
        }
      }
    for (int64_t i = 0; i < len_q; ++i)
      for (int64_t n0 = 0; n0 < len_k + kBN; n0 += kBN) {
        int lo, hi;
        bi.key_range(p, i, n0, masked, lo, hi);
        for (int col = 0; col < kBN; ++col) {
          const bool rule = Info::key_valid(p, i, n0 + col, len_k, seq.diag, masked);
          ASSERT_EQ(col >= lo && col <= hi, rule)
              << "key_range: len_q " << len_q << " len_k " << len_k << " window ("
              << p.window_left << ", " << p.window_right << ") row " << i << " key " << n0 + col;
          ++checked;
        }
      }
  });
  EXPECT_GT(checked, 10000);
}

// The deterministic dk/dv pass's rotated walk (bwd::RotatedWalk): at every step the n key
// blocks' ranks are 0..n-1 in the order their walks reach the step when they keep pace, and
// consecutive ranks arrive at least one step apart (no walk waits on another); consecutive key
// blocks start at most kMaxSpacing steps apart (a row block's rows still in L2 for the next).
TEST(BackwardRotatedWalk, RanksFollowTheArrivalOrder) {
  int checked = 0;
  for (uint32_t steps = 1; steps <= 69; ++steps)
    for (uint32_t n = 1; n <= steps; ++n) {
      ASSERT_TRUE(bwd::RotatedWalk::applies(n, steps));
      const bwd::RotatedWalk walk{n, steps};
      for (uint32_t j = 1; j < n; ++j)
        ASSERT_LE(walk.first(j) - walk.first(j - 1), bwd::RotatedWalk::kMaxSpacing);
      for (uint32_t x = 0; x < steps; ++x) {
        std::vector<uint32_t> arrival(n);  // the step of its walk at which key block j reaches x
        for (uint32_t j = 0; j < n; ++j) arrival[j] = (x + steps - walk.first(j)) % steps;
        std::vector<int> by_rank(n, -1);
        for (uint32_t j = 0; j < n; ++j) {
          const uint32_t r = walk.rank(x, j);
          ASSERT_LT(r, n);
          ASSERT_EQ(by_rank[r], -1) << "steps " << steps << " n " << n << " x " << x;
          by_rank[r] = int(j);
        }
        for (uint32_t r = 1; r < n; ++r)
          ASSERT_LT(arrival[by_rank[r - 1]], arrival[by_rank[r]])
              << "steps " << steps << " n " << n << " x " << x << " rank " << r;
        ++checked;
      }
    }
  EXPECT_FALSE(bwd::RotatedWalk::applies(5, 4));                  // starts would repeat
  EXPECT_FALSE(bwd::RotatedWalk::applies(70000, 70000));          // past 32 bits
  EXPECT_GT(checked, 50000);
}

// GQA tiles of the warp-specialised dk/dv pass over slices of a kv head's query heads
// (BwdParams::heads_per_tile): in every order, the tiles cover each (batch, query head, key
// block) exactly once, each with the kv head that query head reads; whole groups (0) as before.
// Deterministic masked calls walk heads side by side (kFastestLastFirst): each head's key blocks
// still come last first, so a tile waits only on tiles numbered before it.
TEST(BackwardKeyBlock, SlicesCoverEveryQueryHeadOnce) {
  FwdParams p;
  p.batch = 3, p.heads_q = 8, p.heads_kv = 2, p.head_dim = 64, p.num_splits = 1;
  p.seqlen_q = p.seqlen_k = 300;
  p.window_left = -1, p.window_right = 0;
  constexpr int kBN = 128, kBM = 64;
  const int n_blocks = 3;
  for (const bwd::KeyOrder order :
       {bwd::KeyOrder::kFastest, bwd::KeyOrder::kFastestLastFirst, bwd::KeyOrder::kSlowest})
    for (const int64_t per_tile : {0, 1, 2, 4})
      for (const int64_t side_by_side : {1, 2, 5, 16}) {
        if (side_by_side > 1 && order != bwd::KeyOrder::kFastestLastFirst) continue;
        const int64_t heads = per_tile > 0 ? per_tile : 4;
        const int64_t tiles = n_blocks * p.batch * p.heads_q / heads;
        std::vector<int> seen(size_t(p.batch * p.heads_q * n_blocks), 0);
        std::vector<int> last(size_t(p.batch * p.heads_q), n_blocks);  // a head's last key block
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const bwd::KeyBlock kb(p, tile, n_blocks, order, kBN, kBM, true, per_tile,
                                 side_by_side);
          ASSERT_EQ(kb.groups, heads);
          ASSERT_LT(kb.b, p.batch);
          ASSERT_LT(kb.n_block, n_blocks);
          for (int64_t h = kb.h0; h < kb.h0 + kb.groups; ++h) {
            ASSERT_EQ(h / (p.heads_q / p.heads_kv), kb.hk) << "tile " << tile;
            ++seen[size_t((kb.b * p.heads_q + h) * n_blocks + kb.n_block)];
            if (order == bwd::KeyOrder::kFastestLastFirst) {
              int& at = last[size_t(kb.b * p.heads_q + h)];
              ASSERT_EQ(kb.n_block, at - 1) << "tile " << tile << " side by side " << side_by_side;
              at = kb.n_block;
            }
          }
        }
        for (int s : seen)
          ASSERT_EQ(s, 1) << "order " << int(order) << " per tile " << per_tile << " side by side "
                          << side_by_side;
        if (side_by_side > 1) {  // tile 1: the next head's last key block, not tile 0's head's
          const bwd::KeyBlock t0(p, 0, n_blocks, order, kBN, kBM, true, per_tile, side_by_side);
          const bwd::KeyBlock t1(p, 1, n_blocks, order, kBN, kBM, true, per_tile, side_by_side);
          EXPECT_EQ(t1.n_block, n_blocks - 1);
          EXPECT_NE(t1.b * p.heads_q + t1.h0, t0.b * p.heads_q + t0.h0);
        }
      }
}

// The key blocks a dk/dv tile walks, which the side-by-side count reads: a dense call's
// sequence; a varlen call's mean sequence (not its longest).
TEST(BackwardKeyBlock, TileKeyBlocks) {
  BwdParams p;
  p.batch = 4;
  p.seqlen_k = 2048;
  EXPECT_EQ(p.tile_key_blocks(128), 16);
  p.seqlen_k = 2049;
  EXPECT_EQ(p.tile_key_blocks(128), 17);
  const int32_t cu[] = {0, 512, 4608, 6656, 9216};  // 512, 4096, 2048 and 2560 keys
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  p.seqlen_k = 4096;  // max_seqlen_k
  p.total_k = 9216;
  EXPECT_EQ(p.tile_key_blocks(128), 18);  // 2304 keys a sequence, not the longest's 32 blocks
  p.total_k = 9217;
  EXPECT_EQ(p.tile_key_blocks(128), 19);  // 2305 (rounded up) -> 19
  EXPECT_EQ(bwd_heads_side_by_side(p.tile_key_blocks(128), 132, 64, true, true), 14);
  p.batch = 0;  // no sequences: the dense rule (a zero count gives one head)
  EXPECT_EQ(p.tile_key_blocks(128), 32);
}

// The heads a deterministic masked dk/dv pass walks side by side: two steps' worth of takes
// (2 x SMs / key blocks), 1 to 16, at head dim 64; one head at a time elsewhere.
TEST(BackwardKeyBlock, HeadsSideBySideRule) {
  constexpr int kSms = 132;
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, true, true), 16);  // S = 2k: 17 -> 16
  EXPECT_EQ(bwd_heads_side_by_side(32, kSms, 64, true, true), 9);   // S = 4k, varlen to 4k
  EXPECT_EQ(bwd_heads_side_by_side(64, kSms, 64, true, true), 5);
  EXPECT_EQ(bwd_heads_side_by_side(128, kSms, 64, true, true), 3);
  EXPECT_EQ(bwd_heads_side_by_side(4096, kSms, 64, true, true), 1);
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 128, true, true), 1);  // hd128: the lead suffices
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, false, true), 1);  // atomic dq
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, true, false), 1);  // unmasked: rotated walks
  EXPECT_EQ(bwd_heads_side_by_side(0, kSms, 64, true, true), 1);
  // GQA tiles walking 4 / 8 query heads: as long as 4 / 8 times the key blocks.
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, true, true, 4), 5);  // 264 / 64 -> 5
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, true, true, 8), 3);
  EXPECT_EQ(bwd_heads_side_by_side(64, kSms, 64, true, true, 4), 2);
  EXPECT_EQ(bwd_heads_side_by_side(16, kSms, 64, true, true, 1),
            bwd_heads_side_by_side(16, kSms, 64, true, true));
}

// The workspace layouts the warp-specialised dk/dv pass reads and stages: each 16-row group of
// dq_accum holds its rows' elements once (rows r and r + 8 paired in 16-byte chunks), so that a
// 64-row block is one contiguous run (the bulk reduce-add's), and the statistics' 16-row
// permutation is a bijection that puts a consumer thread's columns 8k + 2t + e at 4t + 2k + e.
TEST(BackwardWorkspace, DqAccumAndStatisticsLayouts) {
  for (const int hd : {64, 128, 256}) {
    BwdParams p;
    p.heads_q = 2;
    p.seqlen_rounded = 128;
    p.padded_head_dim = hd;
    std::vector<int> seen(size_t(2 * 128 * hd), 0);
    for (int h = 0; h < 2; ++h)
      for (int row = 0; row < 128; ++row)
        for (int col = 0; col < hd; ++col) {
          const int64_t at = bwd::dq_accum_index(p, 0, h, row, col);
          const int64_t block = p.ws_row(0, h, row / 64 * 64) * hd;
          ASSERT_GE(at, block);
          ASSERT_LT(at, block + 64 * hd);
          ++seen[size_t(at)];
          if (col % 2 == 1)  // a column pair of a row: adjacent (the 8-byte red.global.add)
            ASSERT_EQ(at, bwd::dq_accum_index(p, 0, h, row, col - 1) + 1);
        }
    for (const int n : seen) ASSERT_EQ(n, 1) << "head dim " << hd;
  }
  BwdParams p;
  p.stats_permuted = true;
  std::vector<int> seen(64, 0);
  for (int64_t ws = 0; ws < 64; ++ws) ++seen[size_t(p.stats_index(ws))];
  for (const int n : seen) EXPECT_EQ(n, 1);
  for (int k = 0; k < 2; ++k)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 2; ++e)
        EXPECT_EQ(p.stats_index(32 + 8 * k + 2 * t + e), 32 + 4 * t + 2 * k + e);
  p.stats_permuted = false;
  EXPECT_EQ(p.stats_index(37), 37);
}

// The split's rule (bwd_heads_per_tile): the fewest slices that give kBwdMinTilesPerSm tiles a
// multiprocessor, whole groups where nothing needs it.
TEST(BackwardKeyBlock, HeadsPerTileRule) {
  constexpr int kSms = 132;
  // GQA 8 causal hd128 at S = 2k, B 8, Hkv 2: 256 whole-group tiles -> 4 slices of 2 heads.
  EXPECT_EQ(bwd_heads_per_tile(256, 8, kSms, true, false), 2);
  EXPECT_EQ(bwd_heads_per_tile(512, 4, kSms, true, false), 2);  // GQA 4: 2 slices
  EXPECT_EQ(bwd_heads_per_tile(4, 8, kSms, true, false), 1);    // never enough: all
  EXPECT_EQ(bwd_heads_per_tile(528, 8, kSms, true, false), 0);  // enough already
  EXPECT_EQ(bwd_heads_per_tile(4, 8, kSms, false, false), 0);   // unmasked
  EXPECT_EQ(bwd_heads_per_tile(4, 8, kSms, true, true), 0);     // varlen
  EXPECT_EQ(bwd_heads_per_tile(4, 1, kSms, true, false), 0);    // no group
  EXPECT_EQ(bwd_heads_per_tile(100, 6, kSms, true, false), 1);  // 6 slices: 600 tiles
  // Never past twice the target: GQA 7 at 300 tiles (7 slices: 2100) keeps whole groups; GQA 6
  // at 200 tiles (3 slices: 600; 6: 1200) takes 3 slices; at 120 tiles (6 slices: 720) all 6.
  EXPECT_EQ(bwd_heads_per_tile(300, 7, kSms, true, false), 0);
  EXPECT_EQ(bwd_heads_per_tile(200, 6, kSms, true, false), 2);
  EXPECT_EQ(bwd_heads_per_tile(120, 6, kSms, true, false), 1);
  EXPECT_EQ(bwd_heads_per_tile(60, 12, kSms, true, false), 1);   // 12 slices: 720
  EXPECT_EQ(bwd_heads_per_tile(40, 12, kSms, true, false), 1);   // 12 slices: 480, below: all
  for (int64_t tiles = 1; tiles < 2000; ++tiles)
    for (int64_t group : {2, 3, 4, 6, 7, 8, 12, 16}) {
      const int64_t per_tile = bwd_heads_per_tile(tiles, group, kSms, true, false);
      const int64_t slices = per_tile > 0 ? group / per_tile : 1;
      ASSERT_EQ(group % slices, 0);
      ASSERT_TRUE(slices == 1 || tiles * slices <= 2 * kBwdMinTilesPerSm * kSms)
          << tiles << " tiles, group " << group;
    }
}

}  // namespace
}  // namespace hipflash::test
