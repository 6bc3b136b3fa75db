// hipflash — tile shapes of the sm90 (Hopper, wgmma) forward kernel, per padded head dim.
#pragma once

namespace hipflash::sm90 {

/// A thread block is kWarpgroups warpgroups, each owning 64 query rows (one wgmma M), that
/// share K and V: the keys are walked in blocks of kBlockN, K and V double-buffered in shared
/// memory. Large N keeps the Q K^T wgmma off the shared-memory bandwidth limit.
/// Measured on the H200: docs/design-decisions.md#forward-before-the-tma-kernel.
template <int kHeadDim>
struct TileConfig;
template <>
struct TileConfig<64> {
  // One warpgroup and 64-key blocks (41 KiB; launch bounds for four blocks per SM, so at most
  // 128 registers): one block's prologue, epilogue and softmax overlap the others' wgmma.
  // Measured against 128-key blocks at two per SM: faster in every FA-grid cell, most for
  // short causal rows.
  static constexpr int kWarpgroups = 1, kBlockN = 64, kMinBlocks = 4;
};
template <>
struct TileConfig<128> {
  static constexpr int kWarpgroups = 2, kBlockN = 128, kMinBlocks = 1;  // 160 KiB
};

template <int kHeadDim_>
struct Tile : TileConfig<kHeadDim_> {
  using Base = TileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64 * Base::kWarpgroups;
  static constexpr int kBlockN = Base::kBlockN;
  static constexpr int kThreads = 128 * Base::kWarpgroups;
  static constexpr int kChunks = kHeadDim / 8;    ///< 16-byte chunks per row
  static constexpr int kSmemQ = kBlockM * kHeadDim * 2;   // bytes
  static constexpr int kSmemKV = kBlockN * kHeadDim * 2;  // bytes, one K or V stage
  /// Q, K[2], V[2], plus slack to align the tiles to 1024 bytes (the swizzle atom).
  static constexpr int kSmemBytes = kSmemQ + 4 * kSmemKV + 1024;
  static_assert(kHeadDim % 64 == 0, "whole 64-element panels");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "a wgmma N and whole 16-key steps");
};

}  // namespace hipflash::sm90
