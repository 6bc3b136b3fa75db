// hipflash — tile shape of the decode kernel (kernels/decode), per padded head dim.
//
// Decode (a few query rows against a long key sequence) is bound by the K/V read. One thread
// block owns a 16-row query block (one MMA tile, the GQA-packed heads of one kv head) and
// kNWarps warps that split every kBlockN-key block between them, so no matrix-core work is
// spent on rows that do not exist; a kStages-deep cp.async ring keeps K/V reads in flight.
#pragma once

#include "hipflash/port/port.hpp"

namespace hipflash::decode {

template <int kHeadDim_>
struct DecodeTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 16;   ///< query rows per block (one MMA tile)
  static constexpr int kNWarps = 4;
  static constexpr int kWarpKeys = 16;  ///< keys of a block each warp owns
  static constexpr int kBlockN = kNWarps * kWarpKeys;
  /// K+V bytes per stage: 16 KiB (hd64), 32 KiB (hd128), 64 KiB (hd256); two blocks per SM
  /// fit with three stages up to hd128.
  static constexpr int kStages = kHeadDim == 256 ? 2 : 3;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;  ///< 16-byte chunks per row
  static constexpr int kDSteps = kHeadDim / 16;  ///< k-steps of Q K^T
  static constexpr int kDTiles = kHeadDim / 8;   ///< 8-column output tiles
  static constexpr int kSmemQ = kBlockM * kHeadDim;  // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;
  static constexpr int kSmemStage = 2 * kSmemKV;
  static constexpr int kSmemBytes = (kSmemQ + kStages * kSmemStage) * 2;
  /// The cross-warp merge reuses the ring: O (fp32, padded rows), then m and l.
  static constexpr int kMergePitch = kHeadDim + 4;
  static constexpr int kMergeBytes = (kNWarps * kBlockM * kMergePitch + 2 * kNWarps * kBlockM) * 4;
  static_assert(kMergeBytes <= kStages * kSmemStage * 2, "merge buffer fits in the ring");
};

}  // namespace hipflash::decode
