// hipflash — tile shape of the decode kernel (kernels/decode), per padded head dim.
//
// Decode (a few query rows against a long key sequence) is bound by the K/V read. One thread
// block owns a 16-row query block (one MMA tile, the GQA-packed heads of one kv head) and
// kNWarps warps that split every kBlockN-key block between them, so no matrix-core work is
// spent on rows that do not exist; a kStages-deep cp.async ring keeps K/V reads in flight.
#pragma once

#include "hipflash/port/port.hpp"

namespace hipflash::decode {

template <int kHeadDim_, int kKvBytes_ = 2>
struct DecodeTile {
  static constexpr int kHeadDim = kHeadDim_;
  /// Bytes of a K / V element: 2, or 1 for an fp8 (e4m3) KV cache, whose tiles stay e4m3 in
  /// shared memory and are converted to f16 in registers (warp_keys_step_fp8).
  static constexpr int kKvBytes = kKvBytes_;
  static constexpr int kBlockM = 16;   ///< query rows per block (one MMA tile)
  static constexpr int kNWarps = 4;
  static constexpr int kWarpKeys = 16;  ///< keys of a block each warp owns
  static constexpr int kBlockN = kNWarps * kWarpKeys;
  /// K+V bytes per stage: 16 KiB (hd64), 32 KiB (hd128), 64 KiB (hd256), half that for fp8.
  /// Two stages — one key block in flight while the warps work on the other — from hd128 on:
  /// on the H200 the decode calls read faster with fewer bytes in flight (hd128, two blocks an
  /// SM: 64 KiB in flight an SM streamed 0.5-1.3% faster than three stages' 128 KiB). hd64
  /// keeps three: its 16 KiB stages read 10-13% slower with two. See
  /// docs/design-decisions.md#decode-kernel. An fp8 ring keeps the same bytes in flight in
  /// twice the stages of half the size.
  static constexpr int kStages16 = kHeadDim == 64 ? 3 : 2;
  static constexpr int kStages = kKvBytes == 2 ? kStages16 : 2 * (kStages16 - 1) + 1;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;  ///< 16-byte chunks per row of Q
  static constexpr int kKvChunks = kHeadDim * kKvBytes / 16;  ///< 16-byte chunks per K / V row
  static constexpr int kDSteps = kHeadDim / 16;  ///< k-steps of Q K^T
  static constexpr int kDTiles = kHeadDim / 8;   ///< 8-column output tiles
  static constexpr int kSmemQ = kBlockM * kHeadDim;  // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;  // elements of K (or V) a stage
  static constexpr int kSmemStageBytes = 2 * kSmemKV * kKvBytes;
  static constexpr int kSmemBytes = kSmemQ * 2 + kStages * kSmemStageBytes;
  /// The cross-warp merge reuses the ring: O (fp32, padded rows), then m and l.
  static constexpr int kMergePitch = kHeadDim + 4;
  static constexpr int kMergeBytes = (kNWarps * kBlockM * kMergePitch + 2 * kNWarps * kBlockM) * 4;
  static_assert(kMergeBytes <= kStages * kSmemStageBytes, "merge buffer fits in the ring");

  /// The K / V loads' shape (load_tile_by_runs, TileRows): the block's threads, the K / V row's
  /// chunks; thread t copies rows t / kChunks + i kThreads / kChunks.
  struct KvLoad {
    static constexpr int kThreads = DecodeTile::kThreads;
    static constexpr int kChunks = kKvChunks;
    static constexpr int kFirstRowThreads = kChunks;
  };
};

}  // namespace hipflash::decode

namespace hipflash::decode {

/// The head-group decode tile (fwd_decode_heads_kernel): every kv head of a batch — up to kHeads
/// — in one block, a warp a head, so that with the heads adjacent in memory ([B, Sk, Hkv, D]:
/// FlashAttention's and vLLM's KV cache) a stage's loads read whole key rows, the cache front
/// to back, where a block per kv head reads a 1/Hkv slice of every row. Each warp owns its
/// head's 16 query rows (the packed GQA heads) and every key of a stage: no cross-warp merge.
template <int kHeadDim_>
struct DecodeHeadsTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 16;  ///< query rows per head (one MMA tile)
  static constexpr int kHeads = 8;    ///< kv heads per block, a warp each
  static constexpr int kNWarps = kHeads;
  static constexpr int kBlockN = 16;  ///< keys of every head per stage (one P V k-step)
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;   ///< 16-byte chunks per row
  static constexpr int kDSteps = kHeadDim / 16;  ///< k-steps of Q K^T
  static constexpr int kDTiles = kHeadDim / 8;   ///< 8-column output tiles
  /// A stage's loads: thread t copies chunk t % kChunks of head (t / kChunks) % kHeads, key rows
  /// kKeyStep apart from row t / (kChunks * kHeads) — consecutive threads, consecutive 16-byte
  /// chunks of one key row across the heads.
  static constexpr int kKeyStep = kThreads / (kChunks * kHeads);
  static constexpr int kCopiesPerThread = kBlockN / kKeyStep;
  static constexpr int kHeadTile = kBlockN * kHeadDim;  ///< one head's K (or V) tile, elements
  static constexpr int kSmemKV = kHeads * kHeadTile;     ///< a stage's K (or V), every head
  static constexpr int kSmemStage = 2 * kSmemKV;
  /// K+V bytes per stage: 32 KiB (hd64), 64 KiB (hd128); three stages (the hook's default),
  /// all but one in flight.
  static constexpr int kStages = 3;
  static_assert(kStages >= 2, "a stage in flight while the warps work on another");
  /// Q (every head's 16 rows) is loaded into the last stage, which the ring first fills after
  /// every warp has read its Q into registers.
  static constexpr int kSmemQ = kHeads * kBlockM * kHeadDim;
  static constexpr int kSmemBytes = kStages * kSmemStage * 2;
  /// Resident blocks per SM (228 KiB of shared memory on sm_90, 1 KiB reserved per block; the
  /// selector gives the kernel to sm_90 only).
  static constexpr int kMinBlocks = 228 * 1024 / (kSmemBytes + 1024);
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (the selector's rule)");
  static_assert(kThreads % (kChunks * kHeads) == 0 && kBlockN % kKeyStep == 0,
                "whole key rows per pass of the block's threads");
  static_assert(kSmemQ <= kSmemStage, "Q fits in one stage");
  static_assert(kMinBlocks >= 1, "one block's ring fits on an SM");
};

}  // namespace hipflash::decode
