// hipflash — shared by every forward schedule: how the launch grid maps to work tiles. A work
// tile is one (query block, split, head, batch), numbered as BlockInfo decodes it (query block
// fastest; reversed for masked calls, so that the heaviest causal blocks come first). The host
// half (how many blocks to launch) and the device half (which tiles a block runs) live in one
// type, which a kernel's launch traits name (src/gpu/launch_fwd.hpp).
#pragma once

#include <cstdint>

#include "common/block_info.hpp"
#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD
#include "hipflash/params.hpp"

namespace hipflash::common {

/// One thread block per work tile: the grid is the tile count, a block runs tile blockIdx.x.
struct StaticScheduler {
  static constexpr bool kPersistent = false;
  /// Blocks to launch for `tiles` work tiles of `Tile`'s shape (`slots`: resident blocks the
  /// GPU holds; unused), num_m_blocks query blocks a (split, head, batch).
  template <class Tile>
  static int64_t grid(const FwdParams&, int64_t /*num_m_blocks*/, int64_t tiles,
                      int64_t /*slots*/) {
    return tiles;
  }

#if defined(__CUDACC__) || defined(__HIPCC__)
  /// Calls body(tile) for every tile this block owns: exactly one.
  template <class Body>
  __device__ __forceinline__ static void run(Body&& body) {
    body(int64_t(blockIdx.x));
  }
  /// The same, for kernels written against a tile count (which one block per tile ignores).
  template <class Body>
  __device__ __forceinline__ static void run(int64_t /*tiles*/, Body&& body) {
    body(int64_t(blockIdx.x));
  }
#endif  // device compiler
};

/// Persistent blocks: one per resident slot (multiprocessors x blocks per multiprocessor), each
/// walking the tiles blockIdx.x, blockIdx.x + gridDim.x, ... — tile 0's query blocks first, so
/// the heavy causal blocks (BlockInfo's reversed order) start in the first wave. A kernel keeps
/// its pipeline (barrier phases, prefetched stages) running from one tile into the next.
struct PersistentScheduler {
  static constexpr bool kPersistent = true;
  template <class Tile>
  static int64_t grid(const FwdParams&, int64_t /*num_m_blocks*/, int64_t tiles, int64_t slots) {
    return tiles < slots ? tiles : slots;
  }

#if defined(__CUDACC__) || defined(__HIPCC__)
  /// Calls body(tile) for every tile this block owns, in order.
  template <class Body>
  __device__ __forceinline__ static void run(int64_t tiles, Body&& body) {
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) body(tile);
  }
#endif  // device compiler
};

/// The key blocks tile `tile` of a masked call visits (BlockInfo's range), on the host.
template <int kBlockM, int kBlockN>
int tile_key_blocks(const FwdParams& p, int64_t tile, int num_m_blocks) {
  const BlockInfo<kBlockM, kBlockN> bi(p, tile, num_m_blocks, /*reverse_m=*/true);
  return bi.n_block_max - bi.n_block_min;
}
using TileKeyBlocks = int (*)(const FwdParams&, int64_t tile, int num_m_blocks);

/// The snake walk's host model (SnakeScheduler below; src/scheduler_model.cpp): whether
/// `blocks` persistent blocks walking `tiles` tiles (num_m_blocks query blocks a (split, head,
/// batch), BlockInfo's order; `key_blocks` a tile's key blocks) finish before one block per
/// tile would.
bool snake_walk_pays(const FwdParams& p, TileKeyBlocks key_blocks, int64_t num_m_blocks,
                     int64_t tiles, int64_t blocks);

/// Persistent blocks for tiles of unequal cost (causal, window: a query block's cost grows with
/// its index). A fixed stride would give a block the same query block of every (split, head,
/// batch) whenever the grid is a multiple of the query-block count; instead the tiles are
/// dealt in their order (a (split, head, batch)'s query blocks together, heaviest first, so
/// that the blocks at work share that head's K and V in L2) in a snake: in round r block j
/// takes tile r * blocks + j, or r * blocks + blocks - 1 - j when r is odd, so that two rounds
/// pair a heavy tile with a light one. Static: no atomics, nothing to reset between launches,
/// and the producer and consumers of a block walk the same tiles by calling run alike. Where
/// the walk would be unbalanced (snake_walk_pays) the grid is one block per tile, the walk that
/// tile.
struct SnakeScheduler {
  static constexpr bool kPersistent = true;

  /// Calls body(tile) for every tile block `block` of `blocks` owns, in the walk's order.
  template <class Body>
  HIPFLASH_HD static void walk(int64_t tiles, int64_t block, int64_t blocks, Body&& body) {
    // From round r's tile to round r + 1's: 2 (blocks - block) - 1 after an even round,
    // 2 block + 1 after an odd one.
    const int64_t to_odd = 2 * (blocks - block) - 1, to_even = 2 * block + 1;
    bool odd = false;
    for (int64_t u = block; u < tiles; u += odd ? to_even : to_odd, odd = !odd) body(u);
  }

  template <class Tile>
  static int64_t grid(const FwdParams& p, int64_t num_m_blocks, int64_t tiles, int64_t slots) {
    const int64_t persistent = PersistentScheduler::grid<Tile>(p, num_m_blocks, tiles, slots);
    constexpr TileKeyBlocks kKeyBlocks = tile_key_blocks<Tile::kBlockM, Tile::kBlockN>;
    return snake_walk_pays(p, kKeyBlocks, num_m_blocks, tiles, persistent) ? persistent : tiles;
  }

#if defined(__CUDACC__) || defined(__HIPCC__)
  /// Calls body(tile) for every tile this block owns, in the walk's order.
  template <class Body>
  __device__ __forceinline__ static void run(int64_t tiles, Body&& body) {
    walk(tiles, blockIdx.x, gridDim.x, static_cast<Body&&>(body));
  }
#endif  // device compiler
};

}  // namespace hipflash::common
