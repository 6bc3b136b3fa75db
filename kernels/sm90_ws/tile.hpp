// hipflash — tile shapes and the shared-memory map of the warp-specialised Hopper forward
// kernel (kernels/sm90_ws), per padded head dim.
#pragma once

#include <cstdint>

namespace hipflash::sm90ws {

/// kBlockN keys per K/V stage, kStages stages of each. The Q tile, the K and V rings and the
/// small tail (LSE staging, barriers) must fit the 227 KiB of one block: hd128 keeps two
/// 128-key stages (160 KiB), hd256 two 80-key stages (224 KiB).
template <int kHeadDim>
struct TileConfig;
template <>
struct TileConfig<128> {
  static constexpr int kBlockN = 128, kStages = 2;
};
template <>
struct TileConfig<256> {
  static constexpr int kBlockN = 80, kStages = 2;
};

/// A block is three warpgroups: two consumers (threads 0..255), each owning 64 query rows (one
/// wgmma M) of the 128-row query tile, and one producer (threads 256..383) whose first thread
/// issues every TMA load. Register reallocation gives the consumers 240 registers each (ptxas
/// budgets a 288-thread block like a 384-thread one: 168 registers, too few for hd 256).
template <int kHeadDim_>
struct Tile : TileConfig<kHeadDim_> {
  using Base = TileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = Base::kBlockN;
  static constexpr int kStages = Base::kStages;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kMinBlocks = 1;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128 x 24 + 256 x 240 <= 64 K
  static constexpr int kElemBytes = 2;                 ///< bf16 / f16 inputs and outputs
  static constexpr int kPanels = kHeadDim / 64;        ///< 128-byte-wide panels of a tile
  static constexpr int kChunks = kHeadDim / 8;         ///< 16-byte chunks per row
  static constexpr uint32_t kSmemQ = kBlockM * kHeadDim * kElemBytes;
  static constexpr uint32_t kSmemKV = kBlockN * kHeadDim * kElemBytes;  ///< one K or V stage
  // Shared-memory map (from the 1024-byte-aligned base): Q | K stages | V stages | LSE | bars.
  static constexpr uint32_t kOffK = kSmemQ;
  static constexpr uint32_t kOffV = kOffK + kStages * kSmemKV;
  static constexpr uint32_t kOffLse = kOffV + kStages * kSmemKV;
  static constexpr uint32_t kOffBars = kOffLse + kBlockM * 4;
  /// Barriers: Q full / empty, then full / empty per K stage and per V stage.
  static constexpr int kNumBars = 2 + 4 * kStages;
  static constexpr int kSmemBytes = int(kOffBars) + kNumBars * 8 + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "one block's shared memory on sm_90");
  static_assert(kHeadDim % 64 == 0, "whole 128-byte panels");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "a wgmma N and whole 16-key steps");
  static_assert((kBlockN * 128) % 1024 == 0, "panels keep the 1024-byte swizzle alignment");
};

}  // namespace hipflash::sm90ws
