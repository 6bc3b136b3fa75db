// hipflash — shared by every forward schedule: how the launch grid maps to work tiles. A work
// tile is one (query block, split, head, batch), numbered as BlockInfo decodes it (query block
// fastest; reversed for masked calls, so that the heaviest causal blocks come first). The host
// half (how many blocks to launch) and the device half (which tiles a block runs) live in one
// type, which a kernel's launch traits name (src/gpu/launch_fwd.hpp).
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD

namespace hipflash::common {

/// One thread block per work tile: the grid is the tile count, a block runs tile blockIdx.x.
struct StaticScheduler {
  static constexpr bool kPersistent = false;
  /// Blocks to launch for `tiles` work tiles (`slots`: resident blocks the GPU holds; unused).
  HIPFLASH_HD static int64_t grid(int64_t tiles, int64_t /*slots*/) { return tiles; }

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
  HIPFLASH_HD static int64_t grid(int64_t tiles, int64_t slots) {
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

}  // namespace hipflash::common
