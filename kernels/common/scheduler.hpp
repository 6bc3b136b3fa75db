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
  /// Blocks to launch for `tiles` work tiles.
  HIPFLASH_HD static int64_t grid(int64_t tiles) { return tiles; }

#if defined(__CUDACC__) || defined(__HIPCC__)
  /// Calls body(tile) for every tile this block owns: exactly one.
  template <class Body>
  __device__ __forceinline__ static void run(Body&& body) {
    body(int64_t(blockIdx.x));
  }
#endif  // device compiler
};

}  // namespace hipflash::common
