// hipflash — tile shapes of the generic forward kernel, per padded head dim.
#pragma once

#include "common/swizzle.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::generic {

/// A thread block owns kBlockM query rows of one (batch, head) and walks the keys in blocks of
/// kBlockN. Each of the kNWarps warps owns kMTiles * 16 consecutive query rows.
template <int kHeadDim>
struct TileConfig;

#if defined(HIPFLASH_PLATFORM_AMD)
// CDNA (wave64, 64 KiB LDS): each of 4 waves owns one 16-row MFMA tile; hd256 halves the key
// block so K and V fit in LDS.
template <int kHeadDim>
struct TileConfig {
  static constexpr int kBlockM = 64, kBlockN = kHeadDim == 256 ? 32 : 64, kNWarps = 4;
};
#else

template <>
struct TileConfig<64> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
};
template <>
struct TileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8;
};

#endif  // HIPFLASH_PLATFORM_AMD

template <int kHeadDim_>
struct Tile : TileConfig<kHeadDim_> {
  using Base = TileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = Base::kNWarps * port::kWarpSize;
  static constexpr int kWarpRows = Base::kBlockM / Base::kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;  ///< 16-row MMA tiles per warp
  static constexpr int kNTiles = Base::kBlockN / 8;   ///< 8-column score tiles
  static constexpr int kDTiles = kHeadDim / 8;        ///< 8-column output tiles
  static constexpr int kChunks = kHeadDim / 8;        ///< 16-byte chunks per smem row
  static constexpr int kSmemQ = Base::kBlockM * kHeadDim;  // elements
  static constexpr int kSmemKV = Base::kBlockN * kHeadDim;
#if defined(HIPFLASH_PLATFORM_AMD)
  static constexpr int kPitch = kHeadDim + 8;  ///< padded LDS row (elements) of K and V
  static constexpr int kSmemBytes = 2 * Base::kBlockN * kPitch * 2;  // Q lives in registers
#else
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * 2;
#endif  // HIPFLASH_PLATFORM_AMD
  static_assert(kWarpRows % 16 == 0, "each warp owns whole 16-row tiles");
};

}  // namespace hipflash::generic
