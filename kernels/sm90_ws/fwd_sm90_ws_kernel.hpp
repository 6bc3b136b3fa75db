// hipflash — the warp-specialised Hopper forward kernel (sm_90a).
//
// One producer warpgroup and two or three consumer warpgroups per block:
//  * the producer's first thread loads the Q tile (64 rows per consumer) once per work tile and the
//    K and V tiles of every key block with the tensor-memory accelerator (TMA) into a ring of
//    kStages stages each; a stage's "full" mbarrier counts the bytes landed, its "empty"
//    mbarrier the consumer warps done with it. The producer gives its registers to the
//    consumers.
//  * each consumer warpgroup owns 64 query rows: S = Q K^T (wgmma SS) and O += P V (wgmma RS,
//    P from registers) with the online softmax of the generic kernel (common::RowSoftmax), the
//    softmax of key block n - 1 issued while P(n) V(n) is on the tensor cores (ptxas still
//    waits for P V at the softmax's start: see run()). The consumers take turns issuing their
//    GEMMs (named barriers, round robin), so that one's softmax runs under the others' GEMMs.
// The shared-memory tiles use the panelled 128-byte swizzle of atoms/sm90/wgmma.hpp, which is
// the TMA's SWIZZLE_128B layout of [rows x 64] boxes. Masks, split-K and the LSE follow the
// other schedules (common/block_info.hpp, common/epilogue.hpp). A varlen call's maps take its
// packed rows as one batch, a tile's boxes starting at its sequence's first row: the rows a
// box reads past its sequence are the next sequence's, which the mask keeps out of the scores
// and which are zeroed in V before P V reads them (a neighbour's Inf must not reach this
// sequence as 0 x Inf); its output rows are stored by the threads, bounded by the sequence.
#pragma once

#include <type_traits>

#include "atoms/sm80.hpp"
#include "atoms/sm90/consumer.hpp"
#include "atoms/sm90/tma.hpp"
#include "atoms/sm90/wgmma.hpp"
#include "atoms/sm90/wgmma_ops.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "atoms/sm90/tensor_map.hpp"
#include "common/scheduler.hpp"
#include "common/softmax.hpp"
#include "common/swizzle.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"
#include "sm90_ws/tile.hpp"

namespace hipflash::sm90_ws {

using ::hipflash::atom::sm90::TensorMap;
/// Head dims whose staged output rows go out by TMA (where the tile stages them apart from Q):
/// out then gets a tensor map (the launcher) and the consumers a bulk store (Consumer).
template <int kHeadDim>
inline constexpr bool kOutByTma =
    kHeadDim == 64;
/// The tensor maps of q, k and v: 4-d (head dim, row, head, batch), boxes of [rows x one
/// panel row] (128 bytes; 64 for fp8 at hd64); at
/// hd64 also out's (boxes of a warpgroup's
/// 64 rows), where one can describe it (o_ok).
struct TmaMaps {
  TensorMap q, k, v;
  TensorMap o;
  int o_ok = 0;
};

/// Every work tile is a (query block, split, head, batch); one block per SM (Tile::kMinBlocks)
/// walks them (persistent), its producer loading the next tile's Q and K while the consumers
/// finish the last. Unmasked tiles all cost the same: a fixed stride. Causal and window tiles differ up to
/// Sk / kBlockN-fold in cost, which a fixed stride deals out unevenly: the snake
/// (common::SnakeScheduler), or one block per tile where its host model finds the snake
/// unbalanced (long causal rows).
template <class Traits>
using Scheduler =
    std::conditional_t<Traits::kMasked, common::SnakeScheduler, common::PersistentScheduler>;

#if defined(HIPFLASH_HAS_WGMMA)

using namespace ::hipflash::atom::sm90;
using ::hipflash::atom::sm80::smem_addr;

/// Where a ring's next stage is: stage `it % kStages`, phase parity `(it / kStages) & 1`
/// (the K and V rings, and the Q tiles' ring of Tile::kQStages).
template <int kStages>
struct RingPos {
  uint32_t it = 0;
  __device__ __forceinline__ int stage() const { return int(it % kStages); }
  __device__ __forceinline__ uint32_t parity() const { return (it / kStages) & 1u; }
};

/// The block's shared memory: tiles and barriers at fixed offsets (Tile's map).
template <class Cfg>
struct Smem {
  uint32_t base;  ///< 1024-byte aligned shared-window address
  __device__ __forceinline__ uint32_t q(int s) const { return base + s * Cfg::kSmemQ; }
  __device__ __forceinline__ uint32_t k(int s) const { return base + Cfg::kOffK + s * Cfg::kSmemKV; }
  __device__ __forceinline__ uint32_t v(int s) const { return base + Cfg::kOffV + s * Cfg::kSmemKV; }
  __device__ __forceinline__ uint32_t vt(int s) const { return base + Cfg::kOffVt + s * Cfg::kSmemKV; }
  __device__ __forceinline__ uint32_t o() const { return base + Cfg::kOffO; }  ///< staged output
  __device__ __forceinline__ uint32_t lse() const { return base + Cfg::kOffLse; }
  __device__ __forceinline__ Mbarrier bar(int i) const { return {base + Cfg::kOffBars + 8u * i}; }
  static constexpr int kQ = Cfg::kQStages, kS = Cfg::kStages;
  __device__ __forceinline__ Mbarrier q_full(int s) const { return bar(s); }
  __device__ __forceinline__ Mbarrier q_empty(int s) const { return bar(kQ + s); }
  __device__ __forceinline__ Mbarrier k_full(int s) const { return bar(2 * kQ + s); }
  __device__ __forceinline__ Mbarrier k_empty(int s) const { return bar(2 * kQ + kS + s); }
  __device__ __forceinline__ Mbarrier v_full(int s) const { return bar(2 * kQ + 2 * kS + s); }
  __device__ __forceinline__ Mbarrier v_empty(int s) const { return bar(2 * kQ + 3 * kS + s); }
  __device__ __forceinline__ Mbarrier vt_full(int s) const { return bar(2 * kQ + 4 * kS + s); }
  __device__ __forceinline__ Mbarrier vt_empty(int s) const { return bar(2 * kQ + 5 * kS + s); }
  /// The stage of V the consumers read (P V's B operand): V, or fp8's Vt; the barrier saying it
  /// is ready and the one they free it on.
  __device__ __forceinline__ uint32_t pv_operand(int s) const { return Cfg::kFp8 ? vt(s) : v(s); }
  __device__ __forceinline__ Mbarrier pv_full(int s) const { return Cfg::kFp8 ? vt_full(s) : v_full(s); }
  __device__ __forceinline__ Mbarrier pv_empty(int s) const {
    return Cfg::kFp8 ? vt_empty(s) : v_empty(s);
  }

  /// One thread: Q / stage "full" barriers take the producer's one arrival (plus bytes); the
  /// "empty" ones one arrival per consumer warp. fp8: V's "empty" and Vt's "full" one arrival
  /// per transposing warp, Vt's "empty" one per consumer warp.
  __device__ __forceinline__ void init() const {
    constexpr uint32_t kConsumerWarps = Cfg::kConsumerThreads / 32;
    for (int s = 0; s < Cfg::kQStages; ++s) {
      q_full(s).init(1);
      q_empty(s).init(kConsumerWarps);
    }
    for (int s = 0; s < Cfg::kStages; ++s) {
      k_full(s).init(1);
      v_full(s).init(1);
      k_empty(s).init(kConsumerWarps);
      v_empty(s).init(Cfg::kFp8 ? Cfg::kTransposers : kConsumerWarps);
      if constexpr (Cfg::kFp8) {
        vt_full(s).init(Cfg::kTransposers);
        vt_empty(s).init(kConsumerWarps);
      }
    }
  }
};

/// Named barriers (0 is __syncthreads): consumer warpgroup w issues its GEMMs after a sync on
/// kTurn + w, then hands the turn to the next, round robin; kEpilogue (+ w where each
/// warpgroup stages its own rows) syncs the epilogue's staging.
enum NamedBarrier : int { kTurn = 1, kEpilogue = 1 + 3, kTailZeroed = kEpilogue + 3 };

/// The producer thread: Q into the next free Q stage, then K(n) and V(n) for the tile's key
/// blocks from last to first (the consumers' order), each into the next free stage of its ring.
/// Map rows: the sequence's (varlen: from its first packed row, in the maps' one batch).
template <class Traits, class AfterBlock>
__device__ __forceinline__ void produce(const FwdParams& p, const TmaMaps& maps,
                                        const Smem<TileOf<Traits>>& sm, int64_t tile,
                                        const common::TileDivisors& div,
                                        RingPos<TileOf<Traits>::kQStages>& q_pos,
                                        RingPos<TileOf<Traits>::kStages>& k_pos,
                                        RingPos<TileOf<Traits>::kStages>& v_pos, bool issuer,
                                        AfterBlock&& after_block) {
  using Cfg = TileOf<Traits>;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  const Info bi(p, tile, div, Traits::kMasked);
  const int m0 = bi.m_block * Cfg::kBlockM;
  if (m0 >= bi.len_q) return;  // past a varlen sequence: the consumers skip it too
  const int h = int(bi.h), h_kv = int(bi.h_kv), b = p.is_varlen() ? 0 : int(bi.b);
  const int q0 = int(bi.q_start), k0 = int(bi.k_start);

  const int qs = q_pos.stage();
  sm.q_empty(qs).wait(q_pos.parity() ^ 1u);
  if (issuer) {
    sm.q_full(qs).arrive_expect_tx(Cfg::kSmemQ);
#pragma unroll
    for (int c = 0; c < Cfg::kPanels; ++c)
      tma::load_4d(sm.q(qs) + c * Cfg::kBlockM * Cfg::kRowBytes, &maps.q, sm.q_full(qs),
                   Cfg::kPanelElems * c, q0 + m0, h, b);
  }
  ++q_pos.it;

  // The key block at `row` of K (kV false) or V into the next free stage of its ring.
  auto load_block = [&](auto is_v, int row) {
    constexpr bool kV = decltype(is_v)::value;
    auto& pos = kV ? v_pos : k_pos;
    const int s = pos.stage();
    const auto full = kV ? sm.v_full(s) : sm.k_full(s);
    (kV ? sm.v_empty(s) : sm.k_empty(s)).wait(pos.parity() ^ 1u);
    if (issuer) {
      full.arrive_expect_tx(Cfg::kSmemKV);
#pragma unroll
      for (int c = 0; c < Cfg::kPanels; ++c)
        tma::load_4d((kV ? sm.v(s) : sm.k(s)) + c * Cfg::kBlockN * Cfg::kRowBytes,
                     kV ? &maps.v : &maps.k, full, Cfg::kPanelElems * c, k0 + row, h_kv, b);
    }
    ++pos.it;
  };
  for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n) {
    const int row = n * Cfg::kBlockN;
    load_block(std::false_type{}, row);
    load_block(std::true_type{}, row);
    after_block(bi, n);
  }
  after_block(bi, bi.n_block_min - 1);
}

/// fp8: one stage of V ([kBN keys x kHD] bytes, kRowBytes-wide swizzled panels as the TMA
/// lands it) transposed into Vt ([kHD x kBN], 128-key-byte rows, 128-byte swizzle: P V's
/// K-major B operand) by the kTransposers warps, warp `w_id` of them. Vt's slot 4t + i of each
/// 16-key group holds key 2t + (i & 1) + 8 (i >> 1) of it (consumer::pack_p_fp8's order).
/// A step moves 16 keys x 32 head-dim bytes: one ldmatrix.x4.trans reads them as four 8 x 8
/// matrices of 16-bit pairs (keys 0-7 and 8-15 of two 16-byte head-dim chunks), which leaves
/// each lane (g = lane / 4, t = lane % 4) keys 2t, 2t + 1 (and 8 + 2t, 9 + 2t) of head-dim
/// bytes 2g, 2g + 1 of each chunk; two prmt a chunk make the words of Vt rows 2g and 2g + 1,
/// slots 4t .. 4t + 3, and one stmatrix.x4 writes the four 8-row matrices (a matrix takes the
/// even rows of its chunk for g < 4 and the odd ones above, so that its eight rows fall in
/// eight different 16-byte bank groups under the swizzle). The measured alternative, 32-bit
/// loads and stores a 4 x 4 byte block, issued as many instructions again as the consumers and
/// held the kernel at 0.73x bf16 (docs/design-decisions.md#fp8-forward). Keys from `valid` on
/// (kTail: a key block past its sequence's end, a varlen neighbour's rows) are written as
/// zeros; that path is not unrolled, so that the producer's registers (Tile) hold it.
template <class Cfg, bool kTail>
__device__ __forceinline__ void transpose_v(uint32_t sV, uint32_t sVt, int w_id, int lane,
                                            int valid) {
  constexpr int kBN = Cfg::kBlockN, kHD = Cfg::kHeadDim, kRB = Cfg::kRowBytes;
  static_assert(Cfg::kOffV % 1024 == 0 && Cfg::kOffVt % 1024 == 0 && Cfg::kSmemKV % 1024 == 0,
                "V and Vt stages 1024-byte aligned: the swizzles' bits clear in their bases");
  constexpr uint32_t kSteps = (kBN / 16) * (kHD / 32);  // (16-key group, 32-byte head-dim pair)
  constexpr int kPerWarp = (kSteps + Cfg::kTransposers - 1) / Cfg::kTransposers;
  const VtSteps<kRB, kBN> at(sV, sVt, uint32_t(lane));  // the lane's addresses, once a block
  // g >= 4: this lane's row of an even matrix is an odd Vt row (and of an odd one an even row):
  // the byte selections of the odd and even words, swapped there.
  const bool upper = lane / 4 >= 4;
  const uint32_t sel_a = upper ? 0x7531 : 0x6420, sel_b = upper ? 0x6420 : 0x7531;
#pragma unroll(kTail ? 1 : 4)
  for (int i = 0; i < kPerWarp; ++i) {
    const uint32_t step = uint32_t(w_id) + uint32_t(i) * Cfg::kTransposers;
    if (kSteps % Cfg::kTransposers != 0 && step >= kSteps) break;
    const uint32_t k16 = step % (kBN / 16), pair = step / (kBN / 16);
    uint32_t v[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(at.ld(k16, pair)));
    // Vt rows 16 (2 pair + m / 2) + 2g (0x6420: the even bytes) and + 1 (0x7531), slots
    // 4t .. 4t + 3 of group k16: the words of matrices 0 .. 3 as this lane holds them.
    uint32_t w0 = __byte_perm(v[0], v[1], sel_a), w1 = __byte_perm(v[0], v[1], sel_b);
    uint32_t w2 = __byte_perm(v[2], v[3], sel_a), w3 = __byte_perm(v[2], v[3], sel_b);
    if (kTail) {  // byte i of each word is key 16 k16 + 2t + (i & 1) + 8 (i >> 1)
      const int below = valid - 16 * int(k16) - 2 * (lane % 4);
      const uint32_t keep = (below > 0 ? 0xffu : 0u) | (below > 1 ? 0xff00u : 0u) |
                            (below > 8 ? 0xff0000u : 0u) | (below > 9 ? 0xff000000u : 0u);
      w0 &= keep;
      w1 &= keep;
      w2 &= keep;
      w3 &= keep;
    }
    stmatrix_x4(at.st(k16, pair), {w0, w1, w2, w3});
  }
}

/// fp8: a transposing warp's part of key block n of a tile (its V stage at `pos`), once V has
/// landed and its Vt stage is free (transpose_v); then Vt's stage to the consumers (the writes
/// made visible to the tensor cores' async proxy first) and V's back to the producer.
template <class Cfg, class Info>
__device__ __forceinline__ void transpose_block(const Smem<Cfg>& sm, const Info& bi, int n,
                                                RingPos<Cfg::kStages>& pos, int w_id, int lane) {
  __syncwarp();  // (the loading warp: its lane 0 comes from issuing loads)
  const int s = pos.stage();
  sm.v_full(s).wait(pos.parity());
  sm.vt_empty(s).wait(pos.parity() ^ 1u);
  const int64_t valid = bi.len_k - int64_t(n) * Cfg::kBlockN;
  if (valid < Cfg::kBlockN)
    transpose_v<Cfg, true>(sm.v(s), sm.vt(s), w_id, lane, int(valid));
  else
    transpose_v<Cfg, false>(sm.v(s), sm.vt(s), w_id, lane, Cfg::kBlockN);
  fence_proxy_async();
  __syncwarp();
  if (lane == 0) {
    sm.vt_full(s).arrive();
    sm.v_empty(s).arrive();
  }
  ++pos.it;
}

/// fp8: a transposing warp's part of a tile: every key block's V stage into Vt, in the
/// consumers' order (transpose_block). The loading warp does its part a block behind its loads
/// (produce's after_block).
template <class Traits>
__device__ __forceinline__ void transpose_tile(const FwdParams& p, const Smem<TileOf<Traits>>& sm,
                                               int64_t tile, const common::TileDivisors& div,
                                               RingPos<TileOf<Traits>::kStages>& pos, int w_id,
                                               int lane) {
  using Cfg = TileOf<Traits>;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  const Info bi(p, tile, div, Traits::kMasked);
  if (bi.m_block * Cfg::kBlockM >= bi.len_q) return;  // past a varlen sequence (as produce())
  for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n)
    transpose_block(sm, bi, n, pos, w_id, lane);
}

/// A consumer warpgroup's registers for one tile: the output accumulator, the probabilities
/// (P V's A operand) and the rows' softmax state; with two Q stages (Consumer::kCarry) they
/// also carry a tile's last P V and epilogue into the next tile: `tile` is that tile, -1 none.
template <int kHD, int kBN, int kPSteps>
struct Accumulators {
  float O[kHD / 2];
  uint32_t P[kPSteps][4];  ///< kBN / 16 (16-bit P) or kBN / 32 (fp8) key steps
  common::RowSoftmax<2> softmax;
  int64_t tile = -1;
};

/// A consumer warpgroup of the block: the pieces of atoms/sm90/consumer.hpp on this schedule's
/// rings, turns and staging. Constructed per tile (thread-derived values are not hoisted out
/// of the tile loop: consumer::thread_index).
template <class Traits>
struct Consumer {
  using Cfg = TileOf<Traits>;
  using T = common::element_t<Traits::kOutDType>;  // the staged output's element
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  using Ring = RingPos<Cfg::kStages>;
  using QRing = RingPos<Cfg::kQStages>;
  static constexpr int kHD = Cfg::kHeadDim, kBN = Cfg::kBlockN, kBM = Cfg::kBlockM;
  static constexpr int kThreads = Cfg::kConsumerThreads;
  static constexpr DType kDT = Traits::kDType;
  static constexpr bool kFp8 = Cfg::kFp8;
  using Acc = Accumulators<kHD, kBN, kFp8 ? kBN / 32 : kBN / 16>;
  /// fp8's probabilities are 2^8 times the softmax's (common::RowSoftmax's kExpOffset), taken
  /// out of O and l in the epilogue.
  static constexpr int kExpOffset = kFp8 ? 8 : 0;
  /// With two Q stages the next tile's Q has landed by the time this tile's last P V is due, so
  /// that P V is issued in one turn with the next tile's first Q K^T (else it has a turn of its
  /// own), and the tile's epilogue runs after that turn, under the other consumers' GEMMs.
  static constexpr bool kCarry = Cfg::kQStages > 1;
  static_assert(sizeof(T) == Cfg::kOutBytes, "the staged output's element size");
  static_assert(Cfg::kConsumers <= kEpilogue - kTurn, "the turn barriers end before kEpilogue");

  const FwdParams& p;
  const Smem<Cfg>& sm;
  const common::TileDivisors& div;
  const TmaMaps& maps;
  QRing& q_pos;
  Ring& k_pos;
  Ring& v_pos;
  /// The masked consumers of the long-row tile (160 registers, not 240) and of hd256 are lean:
  /// they hold the mask in a few ints (common::RowMask) and only the thread's lane, warpgroup
  /// and column quad, so that ptxas keeps the key loop spill-free (BlockInfo and the whole
  /// thread place held through it spilled 96-124 bytes at the long-row tile, 60-100 at hd256;
  /// lean hd256 measured +2-4% at causal 1k / 4k: docs/design-decisions.md#registers).
  /// The others keep the place and BlockInfo's per-block mask.
  static constexpr bool kLean = Traits::kMasked && (Cfg::kConsumers == 3 || kHD == 256);
  using Place = std::conditional_t<kLean, consumer::LeanThreadPlace, consumer::ThreadPlace>;
  const Place place;  // read per tile: not hoisted out of the tile loop
  __device__ __forceinline__ int warp() const { return place.warp(); }
  __device__ __forceinline__ int g() const { return place.g(); }

  __device__ __forceinline__ Info info(int64_t tile) const {
    return Info(p, tile, div, Traits::kMasked);
  }
  /// The tile's first query row.
  __device__ __forceinline__ static int64_t m0_of(const Info& bi) {
    return int64_t(bi.m_block) * kBM;
  }
  /// The sequence row of this thread's row h (of 2) in the tile at m0: accumulators in wgmma
  /// order, element 4i + 2h + e is row g + 8h of this warp's 16, column 8i + 2t + e.
  __device__ __forceinline__ int64_t row_of(int64_t m0, int h) const {
    return m0 + warp() * 16 + h * 8 + g();
  }
  __device__ __forceinline__ void turn_begin() const {
    if constexpr (Cfg::kConsumers > 1) named_sync<256>(kTurn + place.wg);
  }
  __device__ __forceinline__ void turn_end() const {
    if constexpr (Cfg::kConsumers > 1) named_arrive<256>(kTurn + (place.wg + 1) % Cfg::kConsumers);
  }
  __device__ __forceinline__ void release(const Mbarrier& bar) const {
    if (place.lane == 0) bar.arrive();
  }
  /// Q is read by the Q K^T GEMMs only: with an output staging buffer of its own, each warp
  /// frees it for the next tile's Q as soon as its last Q K^T is done (staged over Q, store()
  /// frees it after the epilogue instead).
  __device__ __forceinline__ void q_read(int qs) const {
    if constexpr (Cfg::kOwnStaging) release(sm.q_empty(qs));
  }
  /// S = Q K^T of this warpgroup's rows of the Q tile in stage qs.
  __device__ __forceinline__ void issue_qk(float (&S)[kBN / 2], int qs, uint32_t sK) const {
    consumer::issue_qk<kDT, kBM, kBN, kHD, Cfg::kRowBytes>(
        S, sm.q(qs) + place.wg * 64 * Cfg::kRowBytes, sK);
  }
  /// O += P V from stage vs of V (fp8: of Vt).
  __device__ __forceinline__ void issue_pv(Acc& c, int vs) const {
    if constexpr (kFp8)
      consumer::issue_pv_fp8<kBN, kHD>(c.O, c.P, sm.vt(vs));
    else
      consumer::issue_pv<kDT, kBN, kHD>(c.O, c.P, sm.v(vs));
  }
  /// The probabilities as P V's A operand.
  __device__ __forceinline__ static void pack(const float (&S)[kBN / 2], Acc& c) {
    if constexpr (kFp8)
      consumer::pack_p_fp8<kBN>(S, c.P);
    else
      consumer::pack_p<kDT, kBN>(S, c.P);
  }
  /// S(n) done: K's stage back to the producer, and after the tile's last Q K^T q_read().
  __device__ __forceinline__ void qk_done(float (&S)[kBN / 2], bool last_qk, int qs) const {
    wgmma::fence_operands(S);
    release(sm.k_empty(k_pos.stage()));
    ++k_pos.it;
    if (last_qk) q_read(qs);
  }
  /// This tile's Q stage, waited for.
  __device__ __forceinline__ int wait_q() const {
    const int qs = q_pos.stage();
    sm.q_full(qs).wait(q_pos.parity());
    ++q_pos.it;
    return qs;
  }
  /// P V done: O readable, V's stage back to the producer.
  __device__ __forceinline__ void pv_done(float (&O)[kHD / 2], int vs) const {
    wgmma::fence_operands(O);
    release(sm.pv_empty(vs));
    ++v_pos.it;
  }
  /// The lean consumers' mask: this warpgroup's 64 rows' RowMask, solved once per tile (the
  /// others read BlockInfo's per-block test; for them the mask is empty).
  struct NoMask {};
  using LeanMask = std::conditional_t<kLean, common::RowMask<kBN, 2>, NoMask>;
  __device__ __forceinline__ LeanMask lean_mask_of(const Info& bi) const {
    if constexpr (kLean) {
      const int64_t m0 = m0_of(bi);
      return bi.template row_mask<64, 2>(p, m0 + 64 * place.wg, Traits::kMasked,
                                         [&](int h) { return row_of(m0, h); });
    } else {
      return {};
    }
  }
  /// What a tile's key blocks share of the score modifiers (the softcap, ALiBi's slope, fp8's
  /// descales), read and divided once a tile: in the key loop those loads and divisions would
  /// sit between each block's Q K^T and its softmax.
  struct TileScores {
    common::ScoreCap cap;
    float scale_log2;  ///< RowSoftmax::update's, after cap.apply()
    common::ScoreBias<> bias;
  };
  __device__ __forceinline__ TileScores tile_scores(const Info& bi) const {
    TileScores ts{common::ScoreCap(p), 0.f, common::ScoreBias<>(p, bi.b, bi.h)};
    ts.scale_log2 = ts.cap.scale_log2(p);
    if constexpr (kFp8) {  // the scores of the descaled q and k (no ALiBi: the selector's rule)
      const float qk = p.q_descale.at(bi.b, bi.h_kv) * p.k_descale.at(bi.b, bi.h_kv);
      if (ts.cap.on())
        ts.cap.scale *= qk;
      else
        ts.scale_log2 *= qk;
    }
    return ts;
  }
  /// The masked online-softmax step of key block n on S (left holding the probabilities).
  __device__ __forceinline__ void softmax_step(const Info& bi, const LeanMask& lean,
                                               const TileScores& ts,
                                               common::RowSoftmax<2>& softmax,
                                               float (&S)[kBN / 2], int n,
                                               float (&rescale)[2]) const {
    ts.cap.apply(S);
    const int64_t m0 = m0_of(bi);
    const auto rows = [&](int h) { return row_of(m0, h); };
    float row_off[2];  // ALiBi's row part (ScoreBias), zero without slopes
    const int64_t key0 = int64_t(n) * kBN;
    ts.bias.apply(S, rows, bi.diag, key0 + 2 * place.t, key0, row_off);
    if constexpr (kLean) {
      consumer::softmax_step<kBN, kExpOffset>(lean, softmax, ts.scale_log2, S, n, place.t,
                                              rescale, row_off);
    } else {
      consumer::softmax_step<Traits, kBN, kExpOffset>(p, bi, softmax, ts.scale_log2, S, n, rows,
                                                      place.t, rescale, row_off);
    }
  }

  /// The epilogue, in two halves: `stage` the rounded tile (and LSEs) in shared memory — or,
  /// for a split, write its fp32 partials from registers —, then `store` the staged rows as
  /// 16-byte rows (and the LSEs) and, staged over Q, free Q. In a buffer of its own, each
  /// warpgroup stages and writes its own 64 rows between barriers of its own (its warps done
  /// reading its last tile's rows; its rows staged), so that the warpgroups keep their
  /// turn-taking offset from one tile into the next. Over Q, the whole tile's consumers sync: a
  /// row of the staged tile spans Q rows of both warpgroups, which every Q K^T must be done
  /// reading.
  static constexpr int kStageRows = Cfg::kOwnStaging ? 64 : kBM;  // rows a barrier's threads stage
  static constexpr int kStagers = Cfg::kOwnStaging ? 128 : kThreads;
  __device__ __forceinline__ int stage_barrier() const {
    return Cfg::kOwnStaging ? kEpilogue + place.wg : kEpilogue;
  }
  /// This thread's index among the kStagers (0 writes the TMA store).
  __device__ __forceinline__ int stager() const {
    return consumer::thread_index() - (Cfg::kOwnStaging ? 128 * place.wg : 0);
  }
  /// hd64, in a buffer of their own: the tile
  /// is staged panel-major (common::staged_swizzle: the TMA's 128-byte swizzle of [64 x 64]
  /// boxes), and a warpgroup's staged rows go out in one bulk tensor store per 64-column panel
  /// by its first thread, where out's map exists (o_ok); the LSEs by the threads as before
  /// (measured on the H200: +2-4% at short hd64 rows, hd64 causal 512 +5% with LSE;
  /// docs/design-decisions.md#key-loop-tile-boundary-and-epilogue).
  static constexpr bool kTmaStore = kOutByTma<kHD> && Cfg::kOwnStaging && !Traits::kSplit;
  static constexpr int kPanelRows = kTmaStore ? kBM : 0;  ///< the staged tile's layout
  __device__ __forceinline__ bool tma_store_on() const { return kTmaStore && maps.o_ok; }
  /// The staged rows from tile row `first` (this warpgroup's) by one bulk store per panel,
  /// their LSEs by the stagers; false where out has no map (the caller stores them).
  __device__ __forceinline__ bool tma_store(const Info& bi, int first, int stager) const {
    if (!tma_store_on()) return false;
    const int64_t m0 = m0_of(bi) + first;
    if (stager == 0) {
#pragma unroll
      for (int panel = 0; panel < kHD / 64; ++panel)  // the output's 128-byte panels
        tma::store_4d(&maps.o, sm.o() + (panel * kBM + first) * 64 * Cfg::kOutBytes, panel * 64,
                      int(m0), int(bi.h), int(bi.b));
      tma::commit_group();
    }
    staged(first).template store_lse<kStageRows, kStagers, false>(p, bi, m0, stager);
    return true;
  }
  /// Before the staging buffer is written again (and before the block exits): the last bulk
  /// store has read it.
  __device__ __forceinline__ void drain() const {
    if (tma_store_on() && stager() == 0) tma::wait_group_read<0>();
  }
  /// The staged tile (common::StagedTile) from tile row `first`.
  __device__ __forceinline__ common::StagedTile<Traits, Cfg::kChunks, kPanelRows> staged(
      int first) const {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    return {reinterpret_cast<T*>(smem_raw + (sm.o() - smem_addr(smem_raw))) +
                first * (kPanelRows ? 64 : kHD),
            reinterpret_cast<float*>(smem_raw + (sm.lse() - smem_addr(smem_raw))) + first};
  }
  __device__ __forceinline__ void stage(const Info& bi, const float (&O)[kHD / 2],
                                        common::RowSoftmax<2>& softmax) const {
    softmax.finalize();
    if constexpr (Traits::kSplit) {
      const int64_t m0 = m0_of(bi);
      consumer::write_split<Traits>(p, bi, O, softmax, [&](int h) { return row_of(m0, h); },
                                    place.t);
    } else {
      if constexpr (kTmaStore) drain();
      named_sync<kStagers>(stage_barrier());
      consumer::stage_rows<kHD>(staged(0), O, softmax, warp() * 16 + g(), place.t);
      if constexpr (kTmaStore) fence_proxy_async();  // the staged rows, visible to the TMA
    }
  }
  __device__ __forceinline__ void store(const Info& bi) const {
    if constexpr (!Traits::kSplit) {
      named_sync<kStagers>(stage_barrier());
      const int first = Cfg::kOwnStaging ? 64 * place.wg : 0;  // the stagers' first tile row
      const int me = stager();
      bool stored = false;  // by TMA
      if constexpr (kTmaStore) stored = tma_store(bi, first, me);
      if (!stored)  // (varlen: bounded by the sequence, and the padded LSE layout's tail)
        staged(first).template store<kStageRows, kStagers, true>(p, bi, m0_of(bi) + first, me);
      // Staged over Q: the next tile's Q (an async-proxy write) may land over sO once every
      // warp has read it.
      if constexpr (!Cfg::kOwnStaging) fence_proxy_async();
    }
    if constexpr (!Cfg::kOwnStaging) release(sm.q_empty(0));
  }
  /// fp8 first takes the probabilities' 2^8 out of O and l, and applies v_descale to O.
  __device__ __forceinline__ void epilogue(const Info& bi, float (&O)[kHD / 2],
                                           common::RowSoftmax<2>& softmax) const {
    if constexpr (kFp8) {
      constexpr float kUnscale = 1.f / float(1 << kExpOffset);
      const float o_scale = p.v_descale.at(bi.b, bi.h_kv) * kUnscale;
#pragma unroll
      for (int i = 0; i < kHD / 2; ++i) O[i] *= o_scale;
#pragma unroll
      for (int r = 0; r < 2; ++r) softmax.l[r] *= kUnscale;
    }
    stage(bi, O, softmax);
    store(bi);
  }

  /// A varlen tile's last key block V(n_hi), the next stage of V, has rows from `keys` on that
  /// are the next sequence's: zeroed by all consumer threads (they meet here once per such
  /// tile, each after its first turn) before any P V reads the stage.
  __device__ __forceinline__ void zero_v_tail(int keys) const {
    static_assert(Cfg::kRowBytes == 128, "V's rows: 128 bytes of each panel (16-bit elements)");
    const int vs = v_pos.stage();
    sm.v_full(vs).wait(v_pos.parity());
    zero_rows<kBN, Cfg::kPanels, kThreads>(sm.v(vs), keys, consumer::thread_index());
    fence_proxy_async();
    named_sync<kThreads>(kTailZeroed);
  }

  /// The tile's last P V, in a turn of its own, and waited for.
  __device__ __forceinline__ void last_pv(Acc& c) const {
    const int vs = v_pos.stage();
    sm.pv_full(vs).wait(v_pos.parity());
    turn_begin();
    issue_pv(c, vs);
    turn_end();
    wgmma::wait<0>();
    pv_done(c.O, vs);
  }

  /// The carried tile finished, if one is: its last P V, then its epilogue. After the last
  /// tile and before a tile without key blocks.
  __device__ __forceinline__ void flush(Acc& c) const {
    if (!kCarry || c.tile < 0) return;  // (without kCarry no tile is ever left pending)
    last_pv(c);
    epilogue(info(c.tile), c.O, c.softmax);
    c.tile = -1;
  }

  /// One tile: its 64 query rows of this warpgroup against the tile's key blocks, from last to
  /// first. The softmax of S(n - 1) comes after P(n) V(n)'s issue, before its wait (in the
  /// SASS the wait is at the softmax's start). Each block's Q K^T is issued unconditionally,
  /// so S needs no zeroing against an undefined path (which serialises the wgmmas, C7515).
  /// The last P V runs alone, or with kCarry in the next tile's first turn. `acc` is the
  /// caller's where something is carried.
  __device__ __forceinline__ void run(int64_t tile, Acc& acc) const {
    const Info bi = info(tile);
    const int64_t m0 = m0_of(bi);
    // Past a varlen sequence: no rows, only the padded LSE layout's to write (-inf).
    if (common::block_past_sequence<Traits, kBM, kThreads>(p, bi.b, bi.h, m0, bi.len_q,
                                                           consumer::thread_index()))
      return;
    const int n_hi = bi.n_block_max - 1, n_lo = bi.n_block_min;
    const LeanMask lean = lean_mask_of(bi);
    const TileScores ts = tile_scores(bi);
    Acc local;
    Acc& c = kCarry ? acc : local;
    if (n_hi < n_lo) {  // no key block: Q is not read at all; out 0, LSE -inf
      flush(c);
      q_read(wait_q());
#pragma unroll
      for (int i = 0; i < kHD / 2; ++i) c.O[i] = 0.f;
      if constexpr (kCarry) c.softmax = common::RowSoftmax<2>();
      epilogue(bi, c.O, c.softmax);  // (a fresh softmax state: l = 0, LSE -inf)
      return;
    }
    // The first key block: its Q K^T (with the carried tile's last P V in the same turn), its
    // softmax, then the carried tile's epilogue. Two straight paths, so that ptxas sees which
    // accumulators the wgmmas in flight own on each (C7515).
    int qs = 0;
    auto first_block = [&](auto carried_t) {
      constexpr bool kCarried = decltype(carried_t)::value;
      float S[kBN / 2];
      int vs = 0;
      qs = wait_q();
      sm.k_full(k_pos.stage()).wait(k_pos.parity());
      if constexpr (kCarried) {
        vs = v_pos.stage();
        sm.pv_full(vs).wait(v_pos.parity());
      }
      turn_begin();
      issue_qk(S, qs, sm.k(k_pos.stage()));
      if constexpr (kCarried) issue_pv(c, vs);
      turn_end();
      wgmma::wait<kCarried ? 1 : 0>();  // S ready; the carried P V may still run
      qk_done(S, n_hi == n_lo, qs);
      float unused[2];
      if constexpr (kCarried) {
        common::RowSoftmax<2> fresh;  // the carried tile's state is its epilogue's until then
        softmax_step(bi, lean, ts, fresh, S, n_hi, unused);
        wgmma::wait<0>();  // the carried P V done: P and O free, V's stage back
        pv_done(c.O, vs);
        pack(S, c);
        epilogue(info(c.tile), c.O, c.softmax);
        c.tile = -1;
        c.softmax = fresh;
      }
#pragma unroll
      for (int i = 0; i < kHD / 2; ++i) c.O[i] = 0.f;
      if constexpr (!kCarried) {
        if constexpr (kCarry) c.softmax = common::RowSoftmax<2>();  // the last tile's, else
        softmax_step(bi, lean, ts, c.softmax, S, n_hi, unused);
        pack(S, c);
      }
    };
    if (kCarry && c.tile >= 0)  // the same on every consumer thread: they walk the same tiles
      first_block(std::true_type{});
    else
      first_block(std::false_type{});
    if constexpr (!kFp8) {  // (fp8: the transposing warps zero Vt's keys instead)
      const int64_t keys = bi.len_k - int64_t(n_hi) * kBN;
      if (p.is_varlen() && keys < kBN) zero_v_tail(int(keys));
    }
    for (int n = n_hi; n > n_lo; --n) {
      float S[kBN / 2];
      const int ks = k_pos.stage(), vs = v_pos.stage();
      sm.k_full(ks).wait(k_pos.parity());
      if constexpr (!kFp8) sm.pv_full(vs).wait(v_pos.parity());
      turn_begin();
      issue_qk(S, qs, sm.k(ks));
      // fp8: Vt(n) comes through the transposing warps, a step behind V: Q K^T(n - 1) goes
      // first, whatever they still have to do.
      if constexpr (kFp8) sm.pv_full(vs).wait(v_pos.parity());
      issue_pv(c, vs);
      turn_end();
      wgmma::wait<1>();  // S(n - 1) ready; P(n) V(n) may still run
      qk_done(S, n - 1 == n_lo, qs);
      float rescale[2];
      softmax_step(bi, lean, ts, c.softmax, S, n - 1, rescale);
      if constexpr (kFp8) {
        // The step's results pinned before the wait (measured +1-8% on the H100). The pins
        // order the PTX only: in the SASS, P V's wait still sits at the softmax's start (ptxas
        // schedules it to the top of its block), in 16-bit P's too, so the softmax does not
        // yet run under P(n) V(n) (docs/design-decisions.md#fp8-forward).
        wgmma::fence_operands(S);
        wgmma::fence_operands(c.softmax.l);
        wgmma::fence_operands(rescale);
      }
      wgmma::wait<0>();  // P(n) V(n) done: P, O and V's stage are free
      pv_done(c.O, vs);
      consumer::rescale_o<kHD>(c.O, rescale);
      pack(S, c);
    }
    if constexpr (kCarry) {
      c.tile = tile;  // its last P V goes with the next tile's first Q K^T
    } else {
      last_pv(c);
      epilogue(bi, c.O, c.softmax);
    }
  }
};

#endif  // HIPFLASH_HAS_WGMMA

/// The warp-specialised sm90 forward kernel: a persistent grid, kMinBlocks blocks per SM (or one
/// per tile: SnakeScheduler).
template <class Traits>
__global__ void __launch_bounds__(TileOf<Traits>::kThreads, TileOf<Traits>::kMinBlocks)
    fwd_sm90_ws_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks,
                       const HIPFLASH_GRID_CONSTANT TmaMaps maps,
                       const HIPFLASH_GRID_CONSTANT common::TileDivisors div) {
#if defined(HIPFLASH_HAS_WGMMA)
  using Cfg = TileOf<Traits>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Smem<Cfg> sm{(smem_addr(smem_raw) + 1023u) & ~1023u};
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    sm.init();
    Mbarrier::fence_init();
  }
  if (warp == Cfg::kConsumerThreads / 32 && lane == 0) {  // the producer thread
    tma::prefetch_map(&maps.q);
    tma::prefetch_map(&maps.k);
    tma::prefetch_map(&maps.v);
  }
  __syncthreads();

  const int64_t tiles =
      int64_t(num_m_blocks) * p.num_splits * p.heads_q * p.batch;  // the launcher's count
  RingPos<Cfg::kQStages> q_pos;
  RingPos<Cfg::kStages> k_pos, v_pos;
  if (threadIdx.x >= Cfg::kConsumerThreads) {  // the producer warpgroup
    setmaxnreg_dec<Cfg::kProducerRegs>();
    const int producer_warp = warp - Cfg::kConsumerThreads / 32;
    if (producer_warp == 0) {
      if constexpr (Cfg::kLoaderTransposes) {
        // Its lane 0 loads, and the whole warp transposes its part of each key block once the
        // next one's loads are issued.
        RingPos<Cfg::kStages> t_pos;  // the V stages this warp has transposed
        Scheduler<Traits>::run(tiles, [&](int64_t tile) {
          produce<Traits>(p, maps, sm, tile, div, q_pos, k_pos, v_pos, lane == 0,
                          [&](const auto& bi, int n) {
                            if (n + 1 < bi.n_block_max)
                              transpose_block(sm, bi, n + 1, t_pos, 0, lane);
                          });
        });
      } else if (lane == 0) {
        Scheduler<Traits>::run(tiles, [&](int64_t tile) {
          produce<Traits>(p, maps, sm, tile, div, q_pos, k_pos, v_pos, true,
                          [](const auto&, int) {});
        });
      }
    } else if constexpr (Cfg::kFp8) {  // the other transposing warps: V into Vt as it lands
      const int w_id = Cfg::kLoaderTransposes ? producer_warp : producer_warp - 1;
      if (w_id < Cfg::kTransposers)
        Scheduler<Traits>::run(tiles, [&](int64_t tile) {
          transpose_tile<Traits>(p, sm, tile, div, v_pos, w_id, lane);
        });
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    // The first turn is consumer 0's: the last consumer hands it over once.
    if constexpr (Cfg::kConsumers > 1)
      if (warp / 4 == Cfg::kConsumers - 1) named_arrive<256>(kTurn);
    using C = Consumer<Traits>;
    typename C::Acc carried;  // read only with C::kCarry
    Scheduler<Traits>::run(tiles, [&](int64_t tile) {
      C{p, sm, div, maps, q_pos, k_pos, v_pos}.run(tile, carried);
    });
    if constexpr (C::kCarry) C{p, sm, div, maps, q_pos, k_pos, v_pos}.flush(carried);
    if constexpr (C::kTmaStore) C{p, sm, div, maps, q_pos, k_pos, v_pos}.drain();
  }
#else
  port::trap();  // TMA and wgmma need sm_90a; the selector picks this kernel only where built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::sm90_ws
