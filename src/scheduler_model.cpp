// hipflash — the host model of the snake walk (kernels/common/scheduler.hpp SnakeScheduler):
// whether a persistent grid walking causal / window tiles in a snake beats one block per tile.
#include <array>
#include <cstdint>
#include <vector>

#include "common/scheduler.hpp"

namespace hipflash::common {

/// Costs are in key blocks: a tile costs its key blocks plus its exposed prologue and epilogue —
/// a key block's worth with one block per tile (its Q and first K/V loads and its output store
/// overlap nothing), a quarter on the walk (the next tile's loads run under the last one's
/// epilogue). Measured on the H200, the walk led by up to 13% at causal S <= 4k and lost 1.3x
/// at hd128 S = 16k, where a few rounds of 1 .. 128 key-block tiles leave it 1.5x unbalanced;
/// the model picks each side there (docs/design-decisions.md#persistent-grid-and-tile-order).
/// Varlen and KV-cache lengths live on the device: no model, one block per tile.
bool snake_walk_pays(const FwdParams& p, TileKeyBlocks key_blocks, int64_t num_m_blocks,
                     int64_t tiles, int64_t blocks) {
  constexpr double kOneBlockPerTileCost = 1.0, kWalkTileCost = 0.25;
  constexpr int64_t kMaxModelTiles = int64_t(1) << 22;  // the model's host time: ~1 ns a tile
  if (p.cu_seqlens_q != nullptr || p.seqlens_k != nullptr || blocks >= tiles ||
      tiles > kMaxModelTiles)
    return false;
  // The last call's answer: a training or serving loop repeats its shapes.
  // (tiles = num_m_blocks x splits x heads x batch, launch_fwd's count: heads and batch enter
  // through it.)
  const std::array<int64_t, 9> key{int64_t(reinterpret_cast<uintptr_t>(key_blocks)),
                                   num_m_blocks, tiles, blocks, p.seqlen_q, p.seqlen_k,
                                   p.num_splits, p.window_left, p.window_right};
  thread_local std::array<int64_t, 9> last_key{};  // tiles 0: never a real call's key
  thread_local bool last_pays = false;
  if (key == last_key) return last_pays;

  // One (split, head, batch) group's tile costs in the tiles' order (query blocks heaviest
  // first, then splits): the same in every group when the lengths are the call's.
  std::vector<double> cost(size_t(num_m_blocks * p.num_splits));
  for (size_t t = 0; t < cost.size(); ++t)
    cost[t] = double(key_blocks(p, int64_t(t), int(num_m_blocks)));
  const auto period = int64_t(cost.size());
  double work = 0;  // every tile's key blocks
  for (const double c : cost) work += c * double(tiles / period);
  double busiest = 0;
  for (int64_t j = 0; j < blocks; ++j) {
    double load = 0;
    SnakeScheduler::walk(tiles, j, blocks,
                         [&](int64_t u) { load += cost[size_t(u % period)] + kWalkTileCost; });
    busiest = load > busiest ? load : busiest;
  }
  last_key = key;
  last_pays = busiest <= (work + kOneBlockPerTileCost * double(tiles)) / double(blocks);
  return last_pays;
}

}  // namespace hipflash::common
