// hipflash — tile shapes of the generic forward kernel, per padded head dim.
#pragma once

namespace hipflash::generic {

/// A thread block owns kBlockM query rows of one (batch, head) and walks the keys in blocks of
/// kBlockN. Each of the kNWarps warps owns kMTiles * 16 consecutive query rows.
template <int kHeadDim>
struct TileConfig;

template <>
struct TileConfig<64> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
};
template <>
struct TileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4;
};

template <int kHeadDim_>
struct Tile : TileConfig<kHeadDim_> {
  using Base = TileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = Base::kNWarps * 32;
  static constexpr int kWarpRows = Base::kBlockM / Base::kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;  ///< 16-row MMA tiles per warp
  static constexpr int kNTiles = Base::kBlockN / 8;   ///< 8-column score tiles
  static constexpr int kDTiles = kHeadDim / 8;        ///< 8-column output tiles
  static constexpr int kChunks = kHeadDim / 8;        ///< 16-byte chunks per smem row
  static constexpr int kSmemQ = Base::kBlockM * kHeadDim;  // elements
  static constexpr int kSmemKV = Base::kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * 2;
  static_assert(kWarpRows % 16 == 0, "each warp owns whole 16-row tiles");
};

/// Element offset of (row, chunk, elem) in a [rows][kChunks*8] tile swizzled per 128-byte
/// line: chunk' = chunk ^ (row % 8) within each group of 8 chunks. Conflict-free for
/// ldmatrix (8 rows, one chunk) and for 16-byte row-contiguous stores.
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "rows are whole 128-byte lines");
  return row * kChunks * 8 + ((chunk & ~7) | ((chunk ^ row) & 7)) * 8;
}

}  // namespace hipflash::generic
