// hipflash — the warp-specialised Hopper forward kernel (sm_90a).
//
// One producer warpgroup and two or three consumer warpgroups per block:
//  * the producer's first thread loads the 128-row Q tile once per work tile and the K and V
//    tiles of every key block with the tensor-memory accelerator (TMA) into a ring of kStages
//    stages each; a stage's "full" mbarrier counts the bytes landed, its "empty" mbarrier the
//    consumer warps done with it. The producer gives its registers to the consumers.
//  * each consumer warpgroup owns 64 query rows: S = Q K^T (wgmma SS) and O += P V (wgmma RS,
//    P from registers) with the online softmax of the generic kernel (common::RowSoftmax), the
//    softmax of key block n - 1 running while P(n) V(n) is on the tensor cores. The two
//    consumers take turns issuing their GEMMs (named barriers, round robin), so that one's
//    softmax runs under the others' GEMMs.
// The shared-memory tiles use the panelled 128-byte swizzle of atoms/sm90/wgmma.hpp, which is
// the TMA's SWIZZLE_128B layout of [rows x 64] boxes. Masks, split-K and the LSE follow the
// other schedules (common/block_info.hpp, common/epilogue.hpp).
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
#include "common/scheduler.hpp"
#include "common/softmax.hpp"
#include "common/swizzle.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"
#include "sm90_ws/tile.hpp"

namespace hipflash::sm90ws {

/// A TMA tensor map as the kernel sees it: the 128 opaque bytes the host encoded
/// (CUtensorMap), passed by value in the kernel's parameters.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};
/// The tensor maps of q, k and v: 4-d (head dim, row, head, batch), boxes of [rows x 64].
struct TmaMaps {
  TensorMap q, k, v;
};

/// Every work tile is a (query block, split, head, batch); one block per SM walks them
/// (persistent), its producer loading the next tile's Q and K while the consumers finish the
/// last. Unmasked tiles all cost the same: a fixed stride. Causal and window tiles differ up to
/// Sk / kBlockN-fold in cost, which a fixed stride deals out unevenly: the snake
/// (common::SnakeScheduler), or one block per tile where its host model finds the snake
/// unbalanced (long causal rows, varlen).
#ifndef HIPFLASH_SM90WS_PERSISTENT  // a tuning hook: 0 launches one block per tile everywhere
#define HIPFLASH_SM90WS_PERSISTENT 1
#endif
template <class Traits>
using Scheduler = std::conditional_t<
    !HIPFLASH_SM90WS_PERSISTENT, common::StaticScheduler,
    std::conditional_t<Traits::kMasked, common::SnakeScheduler, common::PersistentScheduler>>;

#if defined(HIPFLASH_HAS_WGMMA)

using namespace ::hipflash::atom::sm90;
using ::hipflash::atom::sm80::smem_addr;

/// Where a ring's next stage is: stage `it % kStages`, phase parity `(it / kStages) & 1`.
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
  __device__ __forceinline__ uint32_t q() const { return base; }
  __device__ __forceinline__ uint32_t k(int s) const { return base + Cfg::kOffK + s * Cfg::kSmemKV; }
  __device__ __forceinline__ uint32_t v(int s) const { return base + Cfg::kOffV + s * Cfg::kSmemKV; }
  __device__ __forceinline__ uint32_t o() const { return base + Cfg::kOffO; }  ///< staged output
  __device__ __forceinline__ uint32_t lse() const { return base + Cfg::kOffLse; }
  __device__ __forceinline__ Mbarrier bar(int i) const { return {base + Cfg::kOffBars + 8u * i}; }
  __device__ __forceinline__ Mbarrier q_full() const { return bar(0); }
  __device__ __forceinline__ Mbarrier q_empty() const { return bar(1); }
  __device__ __forceinline__ Mbarrier k_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ Mbarrier k_empty(int s) const { return bar(2 + Cfg::kStages + s); }
  __device__ __forceinline__ Mbarrier v_full(int s) const { return bar(2 + 2 * Cfg::kStages + s); }
  __device__ __forceinline__ Mbarrier v_empty(int s) const { return bar(2 + 3 * Cfg::kStages + s); }

  /// One thread: Q / stage "full" barriers take the producer's one arrival (plus bytes); the
  /// "empty" ones one arrival per consumer warp.
  __device__ __forceinline__ void init() const {
    constexpr uint32_t kConsumerWarps = Cfg::kConsumerThreads / 32;
    q_full().init(1);
    q_empty().init(kConsumerWarps);
    for (int s = 0; s < Cfg::kStages; ++s) {
      k_full(s).init(1);
      v_full(s).init(1);
      k_empty(s).init(kConsumerWarps);
      v_empty(s).init(kConsumerWarps);
    }
  }
};

/// Named barriers (0 is __syncthreads): consumer warpgroup w issues its GEMMs after a sync on
/// kTurn + w, then hands the turn to the next, round robin; kEpilogue (+ w where each
/// warpgroup stages its own rows) syncs the epilogue's staging.
enum NamedBarrier : int { kTurn = 1, kEpilogue = 1 + 3 };  // up to three consumers

/// The producer thread: Q, then K(n) and V(n) for the tile's key blocks from last to first
/// (the consumers' order), each into the next free stage of its ring.
template <class Traits>
__device__ __forceinline__ void produce(const FwdParams& p, const TmaMaps& maps,
                                        const Smem<Tile<Traits::kHeadDim, Traits::kMasked>>& sm, int64_t tile,
                                        int num_m_blocks, uint32_t& q_it,
                                        RingPos<Tile<Traits::kHeadDim, Traits::kMasked>::kStages>& k_pos,
                                        RingPos<Tile<Traits::kHeadDim, Traits::kMasked>::kStages>& v_pos) {
  using Cfg = Tile<Traits::kHeadDim, Traits::kMasked>;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  const Info bi(p, tile, num_m_blocks, Traits::kMasked);
  const int m0 = bi.m_block * Cfg::kBlockM;
  if (m0 >= bi.len_q) return;  // the consumers skip it too (common::block_past_sequence)
  const int h = int(bi.h), h_kv = int(bi.h_kv), b = int(bi.b);

  sm.q_empty().wait((q_it & 1u) ^ 1u);
  sm.q_full().arrive_expect_tx(Cfg::kSmemQ);
#pragma unroll
  for (int c = 0; c < Cfg::kPanels; ++c)
    tma::load_4d(sm.q() + c * Cfg::kBlockM * 128, &maps.q, sm.q_full(), 64 * c, m0, h, b);
  ++q_it;

  // The key block at `row` of K (kV false) or V into the next free stage of its ring.
  auto load_block = [&](auto is_v, int row) {
    constexpr bool kV = decltype(is_v)::value;
    auto& pos = kV ? v_pos : k_pos;
    const int s = pos.stage();
    const auto full = kV ? sm.v_full(s) : sm.k_full(s);
    (kV ? sm.v_empty(s) : sm.k_empty(s)).wait(pos.parity() ^ 1u);
    full.arrive_expect_tx(Cfg::kSmemKV);
#pragma unroll
    for (int c = 0; c < Cfg::kPanels; ++c)
      tma::load_4d((kV ? sm.v(s) : sm.k(s)) + c * Cfg::kBlockN * 128, kV ? &maps.v : &maps.k, full,
                   64 * c, row, h_kv, b);
    ++pos.it;
  };
  for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n) {
    const int row = n * Cfg::kBlockN;
    load_block(std::false_type{}, row);
    load_block(std::true_type{}, row);
  }
}

/// One consumer warpgroup's work on one tile: its 64 query rows against the tile's key blocks,
/// then the epilogue (its own rows where the output has its own staging buffer, else the
/// whole tile with the other consumers).
template <class Traits>
__device__ __forceinline__ void consume(const FwdParams& p, const Smem<Tile<Traits::kHeadDim, Traits::kMasked>>& sm,
                                        int64_t tile, int num_m_blocks, uint32_t& q_it,
                                        RingPos<Tile<Traits::kHeadDim, Traits::kMasked>::kStages>& k_pos,
                                        RingPos<Tile<Traits::kHeadDim, Traits::kMasked>::kStages>& v_pos) {
  using Cfg = Tile<Traits::kHeadDim, Traits::kMasked>;
  using T = typename common::Element<Traits::kDType>::type;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  constexpr int kHD = Cfg::kHeadDim, kBN = Cfg::kBlockN, kBM = Cfg::kBlockM;
  constexpr int kThreads = Cfg::kConsumerThreads;
  constexpr DType kDT = Traits::kDType;
  static_assert(sizeof(T) == Cfg::kElemBytes, "the tile's element size");
  static_assert(Cfg::kConsumers <= kEpilogue - kTurn, "the turn barriers end before kEpilogue");

  const int thread = consumer::thread_index();  // not hoisted out of the tile loop
  const int lane = thread % 32, warp = thread / 32;  // consumer warps
  const int wg = warp / 4, g = lane / 4, t = lane % 4;
  const Info bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (common::block_past_sequence<Traits, kBM, kThreads>(p, bi.b, bi.h, m0, bi.len_q, thread))
    return;

  // Accumulators in wgmma order: element 4i + 2h + e is row g + 8h (of this warp's 16), column
  // 8i + 2t + e. Warpgroup wg's Q rows start 64 wg rows into the tile.
  float O[kHD / 2];
#pragma unroll
  for (int i = 0; i < kHD / 2; ++i) O[i] = 0.f;
  common::RowSoftmax<2> softmax;
  const float scale_log2 = p.softmax_scale * detail::kLog2e;
  auto row_of = [&](int h) { return m0 + warp * 16 + h * 8 + g; };
  const uint32_t sQ_wg = sm.q() + wg * 64 * 128;

  auto turn_begin = [&] { named_sync<256>(kTurn + wg); };
  auto turn_end = [&] { named_arrive<256>(kTurn + (wg + 1) % Cfg::kConsumers); };
  auto release = [&](const Mbarrier& bar) {
    if (lane == 0) bar.arrive();
  };
  // Q is read by the Q K^T GEMMs only: with an output staging buffer of its own, each warp
  // frees it for the next tile's Q as soon as its last Q K^T is done (else after the epilogue).
  auto q_read = [&] {
    if constexpr (Cfg::kOwnStaging) release(sm.q_empty());
  };

  // The consumer pieces (atoms/sm90/consumer.hpp) on this schedule's ring stages.
  auto issue_qk = [&](float(&S)[kBN / 2], uint32_t sK) {
    consumer::issue_qk<kDT, kBM, kBN, kHD>(S, sQ_wg, sK);
  };
  auto issue_pv = [&](const uint32_t(&P)[kBN / 16][4], uint32_t sV) {
    consumer::issue_pv<kDT, kBN, kHD>(O, P, sV);
  };
  auto softmax_step = [&](float(&S)[kBN / 2], int n, float(&rescale)[2]) {
    consumer::softmax_step<Traits, kBN>(p, bi, softmax, scale_log2, S, n, row_of, t,
                                              rescale);
  };

  sm.q_full().wait(q_it & 1u);
  ++q_it;
  // Software pipeline (key blocks from last to first): while P(n) V(n) runs on the tensor
  // cores, the softmax of S(n - 1) runs on the CUDA cores.
  const int n_hi = bi.n_block_max - 1, n_lo = bi.n_block_min;
  if (n_hi >= n_lo) {
    uint32_t P[kBN / 16][4];
    {
      const int ks = k_pos.stage();
      sm.k_full(ks).wait(k_pos.parity());
      float S[kBN / 2];
      turn_begin();
      issue_qk(S, sm.k(ks));
      turn_end();
      wgmma::wait<0>();
      wgmma::fence_operands(S);
      release(sm.k_empty(ks));
      ++k_pos.it;
      if (n_hi == n_lo) q_read();
      float unused[2];
      softmax_step(S, n_hi, unused);
      consumer::pack_p<kDT, kBN>(S, P);
    }
    for (int n = n_hi; n >= n_lo; --n) {
      // S is zeroed although its first wgmma overwrites it: on the last block it is not issued,
      // and ptxas serialises every wgmma when an accumulator may be undefined on some path.
      float S[kBN / 2];
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) S[i] = 0.f;
      const bool more = n > n_lo;
      const int ks = k_pos.stage(), vs = v_pos.stage();
      if (more) sm.k_full(ks).wait(k_pos.parity());
      sm.v_full(vs).wait(v_pos.parity());
      turn_begin();
      if (more) issue_qk(S, sm.k(ks));
      issue_pv(P, sm.v(vs));
      turn_end();
      if (more) {
        wgmma::wait<1>();  // S(n - 1) ready; P(n) V(n) may still run
        wgmma::fence_operands(S);
        release(sm.k_empty(ks));
        ++k_pos.it;
        if (n - 1 == n_lo) q_read();
        float rescale[2];
        softmax_step(S, n - 1, rescale);
        wgmma::wait<0>();  // P(n) V(n) done: P, O and V's stage are free
        wgmma::fence_operands(O);
        release(sm.v_empty(vs));
        ++v_pos.it;
        consumer::rescale_o<kHD>(O, rescale);
        consumer::pack_p<kDT, kBN>(S, P);
      } else {
        wgmma::wait<0>();
        wgmma::fence_operands(O);
        release(sm.v_empty(vs));
        ++v_pos.it;
      }
    }
  } else {
    q_read();  // no key block: Q is not read at all
  }
  softmax.finalize();

  // ---- Epilogue ----
  if constexpr (Traits::kSplit) {
    consumer::write_split<kHD>(p, bi, O, softmax, row_of, t);
  } else {
    // Stage the rounded tile in shared memory, then write 16-byte rows. In a buffer of its own,
    // each warpgroup stages and writes its own 64 rows between barriers of its own (its warps
    // done reading its last tile's rows; its rows staged), so that the warpgroups keep their
    // turn-taking offset from one tile into the next. Over Q, the whole tile's consumers sync:
    // a row of the staged tile spans Q rows of both warpgroups, which every Q K^T must be done
    // reading.
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    T* sO = reinterpret_cast<T*>(smem_raw + (sm.o() - smem_addr(smem_raw)));
    float* sL = reinterpret_cast<float*>(smem_raw + (sm.lse() - smem_addr(smem_raw)));
    constexpr int kRows = Cfg::kOwnStaging ? 64 : kBM;  // rows a barrier's threads stage
    constexpr int kStagers = Cfg::kOwnStaging ? 128 : kThreads;
    const int first = Cfg::kOwnStaging ? 64 * wg : 0;  // their first row in the tile
    const int bar = Cfg::kOwnStaging ? kEpilogue + wg : kEpilogue;
    named_sync<kStagers>(bar);
    consumer::stage_rows<kDT, Traits::kReturnLse, Cfg::kChunks, kHD>(sO, sL, O, softmax,
                                                                            warp * 16 + g, t);
    named_sync<kStagers>(bar);
    const int stager = consumer::thread_index() - (Cfg::kOwnStaging ? 128 * wg : 0);
    consumer::store_staged<kRows, Cfg::kChunks, kStagers, Traits::kReturnLse>(
        p, bi, sO + first * kHD, sL + first, m0 + first, int(p.head_dim), stager);
    // Staged over Q: the next tile's Q (an async-proxy write) may land over sO once every warp
    // has read it.
    if constexpr (!Cfg::kOwnStaging) fence_proxy_async();
  }
  if constexpr (!Cfg::kOwnStaging) release(sm.q_empty());
}

#endif  // HIPFLASH_HAS_WGMMA

/// The warp-specialised sm90 forward kernel: a persistent grid, one block per SM (or one per
/// tile: SnakeScheduler).
template <class Traits>
__global__ void __launch_bounds__(Tile<Traits::kHeadDim, Traits::kMasked>::kThreads, 1)
    fwd_sm90_ws_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks,
                       const HIPFLASH_GRID_CONSTANT TmaMaps maps) {
#if defined(HIPFLASH_HAS_WGMMA)
  using Cfg = Tile<Traits::kHeadDim, Traits::kMasked>;
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
  uint32_t q_it = 0;
  RingPos<Cfg::kStages> k_pos, v_pos;
  if (threadIdx.x >= Cfg::kConsumerThreads) {  // the producer warpgroup
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == Cfg::kConsumerThreads / 32 && lane == 0)
      Scheduler<Traits>::run(tiles, [&](int64_t tile) {
        produce<Traits>(p, maps, sm, tile, num_m_blocks, q_it, k_pos, v_pos);
      });
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    // The first turn is consumer 0's: the last consumer hands it over once.
    if (warp / 4 == Cfg::kConsumers - 1) named_arrive<256>(kTurn);
    Scheduler<Traits>::run(tiles, [&](int64_t tile) {
      consume<Traits>(p, sm, tile, num_m_blocks, q_it, k_pos, v_pos);
    });
  }
#else
  port::trap();  // TMA and wgmma need sm_90a; the selector picks this kernel only where built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::sm90ws
