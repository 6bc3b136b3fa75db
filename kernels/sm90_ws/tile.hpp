// hipflash — tile shapes and the shared-memory map of the warp-specialised Hopper forward
// kernel (kernels/sm90_ws), per padded head dim.
#pragma once

#include <cstdint>
#include <type_traits>

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD
#include "hipflash/types.hpp"

namespace hipflash::sm90_ws {

/// kConsumers warpgroups of 64 query rows each, kBlockN keys per K/V stage, kStages stages of
/// each. The Q tile, the K and V rings and the small tail (LSE staging, barriers) must fit the
/// 227 KiB of one block: hd64 keeps a 192-row Q tile and two 128-key stages (88 KiB), hd128 two
/// 128-key stages (160 KiB), hd256 two 80-key stages (224 KiB). Three consumers at hd64: its
/// GEMMs are half as long, so a third warpgroup's softmax is needed to keep the tensor cores fed.
/// Masked (causal, window) calls keep square 128 x 128 tiles at hd64 and hd128 — one diagonal
/// block per query block, and no 192-row tile two-thirds empty at the end of a short sequence.
/// Calls with long rows (kLongRows: the launcher's choice, long_row_tile) take a tile of their
/// own: masked hd64 the three consumers of unmasked calls, unmasked hd128 176-key blocks (half
/// again as much GEMM per softmax step; their K / V ring leaves no room to stage the output
/// apart from Q, which short rows pay for).
/// fp8 (e4m3 q, k, v; hd64 and hd128): 128-key blocks, three stages of K, V and V
/// transposed (Vt) each — 193 KiB at hd128 with the bf16 output staged apart: the transposing
/// warps put a step between V's landing and P V, which a third stage absorbs. Two consumers;
/// unmasked hd64 three, as its 16-bit tile (half as much GEMM a softmax step), and masked hd64
/// three on its long-row tile, as the 16-bit one (hd128 has none: Vt is one 128-key block).
template <int kHeadDim, bool kMasked, bool kLongRows, bool kFp8 = false>
struct TileConfig;
/// hd64's consumer warpgroups, 16-bit and fp8 alike: two on masked short rows, else three.
constexpr int hd64_consumers(bool masked, bool long_rows) { return masked && !long_rows ? 2 : 3; }
template <int kHeadDim, bool kMasked, bool kLongRows>
struct TileConfig<kHeadDim, kMasked, kLongRows, true> {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the fp8 tiles: head dims 64 and 128");
  static_assert(!kLongRows || (kHeadDim == 64 && kMasked), "fp8's long-row tile: masked hd64");
  static constexpr int kConsumers = kHeadDim == 64 ? hd64_consumers(kMasked, kLongRows) : 2;
  static constexpr int kBlockN = 128, kStages = 3;
};
template <bool kMasked, bool kLongRows>
struct TileConfig<64, kMasked, kLongRows> {
  static constexpr int kConsumers = hd64_consumers(kMasked, kLongRows);
  static constexpr int kBlockN = 128, kStages = 2;
};
template <bool kMasked, bool kLongRows>
struct TileConfig<128, kMasked, kLongRows> {
  static constexpr int kConsumers = 2, kStages = 2;
  static constexpr int kBlockN = kMasked || !kLongRows ? 128 : 176;
};
template <bool kMasked, bool kLongRows>
struct TileConfig<256, kMasked, kLongRows> {
  static constexpr int kConsumers = 2, kBlockN = 80, kStages = 2;
};

/// A block is kConsumers + 1 warpgroups: the consumers (threads 0 .. 128 kConsumers - 1), each
/// owning 64 query rows (one wgmma M) of the query tile, and one producer whose first thread
/// issues every TMA load. Register reallocation gives the consumers what the producer does not
/// need: 240 each with two consumers, 160 with three (ptxas budgets a block with a producer
/// *warp* like one with a producer warpgroup, so the warpgroup costs nothing). One block per
/// SM: blocks of one consumer, two to an SM, lost 1.5% geomean at masked hd64 (causal 1k -5%;
/// docs/design-decisions.md#sm90_ws-forward-kernel).
///
/// fp8 (kFp8): q, k and v are e4m3, out bf16. Rows of Q, K and V are kRowBytes wide (128, or
/// 64 with the 64-byte swizzle at hd64); V also lands transposed in a ring of its own (Vt, 128
/// key bytes a head-dim row: fp8 wgmma reads both operands K-major), written by the producer
/// warpgroup's warps (kTransposers), on the producer's registers.
template <int kHeadDim_, bool kMasked_ = false, bool kLongRows_ = false, bool kFp8_ = false>
struct Tile : TileConfig<kHeadDim_, kMasked_, kLongRows_, kFp8_> {
  using Base = TileConfig<kHeadDim_, kMasked_, kLongRows_, kFp8_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kConsumers = Base::kConsumers;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = Base::kBlockN;
  static constexpr int kStages = Base::kStages;
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kThreads = kConsumerThreads + 128;
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static constexpr int kMinBlocks = 1;  ///< blocks resident per SM
  // What the block holds from its launch (65,536 / threads, rounded down to 8, each): 168 x 384
  // = 128 x 24 + 256 x 240 = 64,512 (and fp8: 128 x 40 + 256 x 232), 128 x 512 = 128 x 32 +
  // 384 x 160 = 65,536. More than that (fp8 at 48 / 232 asked for 65,536) waits on registers
  // no block frees: it hung whenever another kernel's blocks (the split's combine, launched
  // early) took the multiprocessor's last 1,024. fp8 with four transposing warps: 128 x 48 +
  // 256 x 224 (the loading warp transposes too; at 40 it spilled).
  static constexpr bool kLoaderTransposes = kFp8 && kHeadDim == 128 && kConsumers == 2;
  static constexpr int kProducerRegs =
      kConsumers == 3 ? 32 : kLoaderTransposes ? 48 : kFp8 ? 40 : 24;
  static constexpr int kConsumerRegs =
      kConsumers == 3 ? 160 : kLoaderTransposes ? 224 : kFp8 ? 232 : 240;
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "setmaxnreg moves the block's own registers: no more than it launched with");
  /// Producer warps transposing V (fp8): at head dim 128 all four, the loading one a block
  /// behind its loads (+2-9% at S >= 1k, -9% at causal 512, H100); at head dim 64 the three
  /// others (four: -3 to -7% causal; beside three consumers its share spilled 76 bytes).
  static constexpr int kTransposers = !kFp8 ? 0 : kLoaderTransposes ? 4 : 3;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;      ///< q, k and v
  static constexpr int kOutBytes = 2;                  ///< out: bf16 / f16
  static constexpr int kRowBytes = kHeadDim * kElemBytes < 128 ? kHeadDim * kElemBytes : 128;
  static constexpr int kPanelElems = kRowBytes / kElemBytes;  ///< elements a panel row
  static constexpr int kPanels = kHeadDim / kPanelElems;      ///< kRowBytes-wide panels a tile
  static constexpr int kChunks = kHeadDim / 8;         ///< 16-byte chunks per output row
  static constexpr uint32_t kSmemQ = kBlockM * kHeadDim * kElemBytes;
  static constexpr uint32_t kSmemKV = kBlockN * kHeadDim * kElemBytes;  ///< one K, V or Vt stage
  static constexpr uint32_t kSmemO = kBlockM * kHeadDim * kOutBytes;    ///< the staged output
  /// The K and V (and Vt) rings; the tail with q_stages Q stages: LSE staging, the barriers (Q
  /// full / empty per Q stage, then full / empty per K stage, per V stage and per Vt stage)
  /// and the slack that aligns the base to 1024 bytes.
  static constexpr int kRings = kFp8 ? 3 : 2;
  static constexpr uint32_t kSmemKVRings = kRings * kStages * kSmemKV;
  static constexpr uint32_t tail_bytes(int q_stages) {
    return kBlockM * 4 + (2 * q_stages + 2 * kRings * kStages) * 8 + 1024;
  }
  /// The output tile is staged in a buffer of its own where it fits (hd64, hd128 with 128-key
  /// blocks, fp8), so that Q is free — and the next tile's Q loading — once the last Q K^T is
  /// done; else (hd256, hd128's 176-key long-row tile) over Q.
  static constexpr bool kOwnStaging = kSmemQ + kSmemO + kSmemKVRings + tail_bytes(1) <= 227 * 1024;
  static_assert(kOwnStaging || kSmemO <= kSmemQ, "the output staged over Q fits there");
  /// Q tiles in flight: one. With two (where they fit: hd64, hd128), the next tile's Q lands
  /// while this tile runs and a tile's last P V shares its turn with the next tile's first
  /// Q K^T; measured slower on the H200 (docs/design-decisions.md#sm90_ws-forward-kernel), kept
  /// as a parameter of the ring and the consumers.
  static constexpr int kQStages = 1;
  static constexpr int kNumBars = 2 * kQStages + 2 * kRings * kStages;
  static constexpr uint32_t kSmemTail = tail_bytes(kQStages);
  // Shared-memory map (from the 1024-byte-aligned base): Q stages | K stages | V stages |
  // [Vt stages] | [O] | LSE | bars.
  static constexpr uint32_t kOffK = kQStages * kSmemQ;
  static constexpr uint32_t kOffV = kOffK + kStages * kSmemKV;
  static constexpr uint32_t kOffVt = kOffV + kStages * kSmemKV;
  static constexpr uint32_t kEndKV = kOffK + kSmemKVRings;
  static constexpr uint32_t kOffO = kOwnStaging ? kEndKV : 0;
  static constexpr uint32_t kOffLse = kOwnStaging ? kEndKV + kSmemO : kEndKV;
  static constexpr uint32_t kOffBars = kOffLse + kBlockM * 4;
  static constexpr int kSmemBytes = int(kOffLse + kSmemTail);
  static_assert(kSmemBytes <= 227 * 1024, "one block's shared memory on sm_90");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024,
                "kMinBlocks blocks' shared memory (and the 1 KiB each reserves) on one SM");
  static_assert(kSmemQ % 1024 == 0 && kSmemKV % 1024 == 0,
                "every Q, K and V stage starts 1024-byte aligned (the 128-byte swizzle's period)");
  static_assert(kHeadDim % 64 == 0, "whole panels");
  static_assert(!kFp8 || kBlockN % 128 == 0, "fp8: whole 128-key panels of Vt");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "a wgmma N and whole 16-key steps");
  static_assert((kBlockN * 128) % 1024 == 0, "panels keep the 1024-byte swizzle alignment");
};

/// The keys a masked hd64 row, and an unmasked hd128 row, must see for the long-row tile.
inline constexpr int64_t kLongRowKeys = 4096, kHd128LongRowKeys = 8192;
/// Whether a call of the sm90_ws kernel runs on the long-row tile. Never split. Masked hd64:
/// rows seeing kLongRowKeys keys or more on average — a causal row
/// sk - sq / 2 (bottom-right aligned), a window at most its width —, sequences long enough
/// (4k rows) that the last, partly empty 192-row tile costs under 3% of the rows, and 192-row
/// tiles enough for two per multiprocessor (`heads` = batch x query heads), so that no SM the
/// 128-row tiles would have used sits idle. Measured on the H200
/// (docs/design-decisions.md#tiles-per-head-dim): three consumers lose 16% at S = 1k causal, are
/// level at 4k and 6-7% faster at 8k and 16k. Unmasked hd128 (and hd96, padded to it):
/// kHd128LongRowKeys keys or more (the 176-key blocks: -15% at S = 512, -5% at
/// 1k, level at 4k, +3-4% at 16k). A pure function of the call; the launcher decides with it.
inline bool long_row_tile(int head_dim, bool masked, bool split, int64_t seqlen_q,
                          int64_t seqlen_k, int64_t window_left, int64_t window_right,
                          int64_t heads, int64_t num_sms) {
  if (split) return false;
  if (head_dim == 128) return !masked && seqlen_k >= kHd128LongRowKeys;
  if (head_dim != 64 || !masked || seqlen_q < 4096) return false;
  constexpr int64_t kRows = Tile<64, true, true>::kBlockM;
  if ((seqlen_q + kRows - 1) / kRows * heads < 2 * num_sms) return false;
  const int64_t right = window_right > 0 ? window_right : 0;
  int64_t keys = seqlen_k - seqlen_q / 2 + right;
  if (window_left >= 0 && window_left + 1 + right < keys) keys = window_left + 1 + right;
  return keys >= kLongRowKeys;
}

/// fp8: the shared-memory addresses of a transposing warp's steps (the kernel's transpose_v).
/// A step moves 16 keys (group k16) x 32 head-dim bytes (pair); lane l addresses row r = l % 8
/// of 8 x 8 matrix m = l / 8: for ldmatrix, key 16 k16 + 8 (m & 1) + r of V's head-dim chunk
/// 2 pair + m / 2 (a stage of kRowBytes-wide panels as the TMA lands them, in its 128- or
/// 64-byte swizzle); for stmatrix, Vt row 16 (2 pair + m / 2) + 2r + ((m & 1) ^ (r >= 4)) at
/// key chunk k16 (128-key-byte rows, the 128-byte swizzle). All but (k16, pair) is the lane's,
/// computed once a block: the swizzles' row terms (a key group is 16 keys, a Vt chunk 16 rows:
/// multiples of their periods) and the lane's chunk m / 2 of the pair (2 pair is even: adding
/// m / 2 is an exclusive or inside the panel). A swizzle exclusive-ors bits 4-6 of an address
/// whose other terms leave them clear (stage bases 1024-byte aligned, rows multiples of 64
/// bytes): the lane's part of it is folded into its base, the step's applied to the sum.
template <int kRowBytes, int kBlockN = 128>
struct VtSteps {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "the TMA's 128- or 64-byte swizzle");
  static_assert(kBlockN == 128, "Vt: one 128-key-byte row a head-dim row");
  static constexpr uint32_t kChunks = kRowBytes / 16;  ///< 16-byte chunks in a panel row
  uint32_t ld_lane, st_lane;

  HIPFLASH_HD VtSteps(uint32_t sV, uint32_t sVt, uint32_t lane) {
    const uint32_t m = lane / 8, r = lane % 8;
    ld_lane = sV + (8 * (m & 1) + r) * kRowBytes +
              (((m / 2) ^ (kRowBytes == 128 ? r : r / 2)) * 16);
    const uint32_t st_row = 2 * r + ((m & 1) ^ (r >= 4 ? 1u : 0u));
    st_lane = sVt + (m / 2) * (16 * 128) + st_row * 128 + (st_row % 8) * 16;
  }
  /// This lane's ldmatrix row of step (k16, pair), in V.
  HIPFLASH_HD uint32_t ld(uint32_t k16, uint32_t pair) const {
    return (ld_lane + (2 * pair / kChunks) * (kBlockN * kRowBytes) + k16 * (16 * kRowBytes)) ^
           ((2 * pair % kChunks) * 16);
  }
  /// This lane's stmatrix row of step (k16, pair), in Vt.
  HIPFLASH_HD uint32_t st(uint32_t k16, uint32_t pair) const {
    return (st_lane + pair * (32 * 128)) ^ (k16 * 16);
  }
};

/// A kernel's traits on the long-row tile: Base's, with kLongRows (the launcher's choice).
template <class Base>
struct LongRows : Base {
  static constexpr bool kLongRows = true;
};
template <class Traits, class = void>
inline constexpr bool kLongRowsOf = false;
template <class Traits>
inline constexpr bool kLongRowsOf<Traits, std::void_t<decltype(Traits::kLongRows)>> =
    Traits::kLongRows;
/// The tile a kernel of these traits runs.
template <class Traits>
using TileOf = Tile<Traits::kHeadDim, Traits::kMasked, kLongRowsOf<Traits>,
                    Traits::kDType == DType::e4m3>;
/// Whether these traits have a long-row variant (the instantiations long_row_tile can pick).
template <class Traits>
inline constexpr bool kHasLongRowTile =
    ((Traits::kHeadDim == 64 && Traits::kMasked) ||
     (Traits::kHeadDim == 128 && !Traits::kMasked && Traits::kDType != DType::e4m3)) &&
    !Traits::kSplit && !kLongRowsOf<Traits>;

}  // namespace hipflash::sm90_ws
