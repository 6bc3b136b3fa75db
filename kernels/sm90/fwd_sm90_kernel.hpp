// hipflash — the Hopper forward kernel (sm_90a): the FlashAttention-2 schedule on warpgroup
// MMAs. S = Q K^T reads Q and K from 128-byte-swizzled shared memory (wgmma SS); the
// probabilities stay in registers as the A operand of O += P V (wgmma RS, V MN-major).
// K and V are double-buffered with cp.async and the loop is software-pipelined: the softmax of
// one key block overlaps the P V of the previous one. The online softmax, the mask (BlockInfo)
// and the epilogue conventions are the generic kernel's.
#pragma once

#include "atoms/sm80.hpp"
#include "atoms/sm90/consumer.hpp"
#include "atoms/sm90/tile_loader.hpp"
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
#include "sm90/tile.hpp"

namespace hipflash::sm90 {

using namespace ::hipflash::atom::sm90;  // wgmma, the SW128 tile layout

#if defined(HIPFLASH_HAS_WGMMA)

template <class Traits>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int64_t tile, int num_m_blocks) {
  using namespace atom::sm80;  // cp.async group helpers, smem_addr
  using Cfg = Tile<Traits::kHeadDim>;
  using T = typename common::Element<Traits::kDType>::type;
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  constexpr int kHD = Cfg::kHeadDim, kBN = Cfg::kBlockN, kBM = Cfg::kBlockM;
  constexpr int kThreads = Cfg::kThreads;
  constexpr DType kDT = Traits::kDType;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem0;
  // Then K stages 0 and 1, V stages 0 and 1; key block n lives in stage n % 2.
  auto sK = [&](int n) { return sQ + Cfg::kSmemQ + uint32_t(n & 1) * Cfg::kSmemKV; };
  auto sV = [&](int n) { return sQ + Cfg::kSmemQ + uint32_t(2 + (n & 1)) * Cfg::kSmemKV; };

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;  // warp / 4: warpgroup
  const int g = lane / 4, t = lane % 4;
  const Info bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (common::block_past_sequence<Traits, kBM, kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;  // past this varlen sequence

  const int hd = int(p.head_dim);
  const T* gQ = bi.template q_rows<T>(p);
  const T* gK = bi.template k_rows<T>(p);
  const T* gV = bi.template v_rows<T>(p);
  const TileLoader<kBN, kHD, kThreads, T> k_loader(gK, p.k_row_stride, hd);
  const TileLoader<kBN, kHD, kThreads, T> v_loader(gV, p.v_row_stride, hd);
  auto load_k = [&](int n) { k_loader.load(sK(n), int64_t(n) * kBN, bi.len_k); };
  auto load_v = [&](int n) { v_loader.load(sV(n), int64_t(n) * kBN, bi.len_k); };

  // The consumer pieces (atoms/sm90/consumer.hpp) on this schedule's stages: accumulators in wgmma
  // order; this warp's rows row_of(0 / 1), its warpgroup's Q 64 (warp / 4) rows into the tile.
  float O[kHD / 2];
#pragma unroll
  for (int i = 0; i < kHD / 2; ++i) O[i] = 0.f;
  common::RowSoftmax<2> softmax;
  const common::ScoreCap cap(p);  // the softcap, when the call has one
  const float scale_log2 = cap.scale_log2(p);
  auto row_of = [&](int h) { return m0 + warp * 16 + h * 8 + g; };
  const uint32_t sQ_wg = sQ + (warp / 4) * 64 * 128;
  auto issue_qk = [&](float(&S)[kBN / 2], int n) {
    consumer::issue_qk<kDT, kBM, kBN, kHD>(S, sQ_wg, sK(n));
  };
  auto issue_pv = [&](const uint32_t(&P)[kBN / 16][4], int n) {
    consumer::issue_pv<kDT, kBN, kHD>(O, P, sV(n));
  };
  const common::ScoreBias<> bias{p, bi.b, bi.h};  // ALiBi, when the call has it
  auto softmax_step = [&](float(&S)[kBN / 2], int n, float(&rescale)[2]) {
    cap.apply(S);
    bias.apply(S, row_of, bi.diag, int64_t(n) * kBN + 2 * t);
    consumer::softmax_step<Traits, kBN>(p, bi, softmax, scale_log2, S, n, row_of, t, rescale);
  };

  // Software pipeline (key blocks from last to first): while P(n) V(n) runs on the tensor
  // cores, the softmax of the already computed S(n - 1) runs on the CUDA cores. Loads run one
  // block ahead: iteration n reads K(n - 1), V(n) and fills K(n - 2), V(n - 1).
  const int n_hi = bi.n_block_max - 1, n_lo = bi.n_block_min;
  if (n_hi >= n_lo) {
    uint32_t P[kBN / 16][4];
    {
      TileLoader<kBM, kHD, kThreads, T>(gQ, p.q_row_stride, hd).load(sQ, m0, bi.len_q);
      load_k(n_hi);
      cp_async_commit();
      load_v(n_hi);
      if (n_hi > n_lo) load_k(n_hi - 1);
      cp_async_commit();
      cp_async_wait<1>();  // Q and K(n_hi); the rest lands under the first softmax
      fence_proxy_async();
      __syncthreads();
      float S[kBN / 2];
      issue_qk(S, n_hi);
      wgmma::wait<0>();
      wgmma::fence_operands(S);
      float unused[2];
      softmax_step(S, n_hi, unused);
      consumer::pack_p<kDT, kBN>(S, P);
    }
    for (int n = n_hi; n >= n_lo; --n) {
      cp_async_wait<0>();  // V(n) and K(n - 1) landed
      fence_proxy_async();
      __syncthreads();  // ... for every thread; every wgmma of iteration n + 1 is done
      // S is zeroed although its first wgmma overwrites it: on the last block it is not issued,
      // and ptxas serialises every wgmma when an accumulator may be undefined on some path.
      float S[kBN / 2];
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) S[i] = 0.f;
      const bool more = n > n_lo;
      if (more) issue_qk(S, n - 1);
      issue_pv(P, n);
      // Stages free now: K(n)'s (its Q K^T finished) and V(n + 1)'s (its P V finished).
      if (n - 2 >= n_lo) load_k(n - 2);
      if (more) load_v(n - 1);
      cp_async_commit();
      if (more) {
        wgmma::wait<1>();  // S(n - 1) ready; P(n) V(n) may still run
        wgmma::fence_operands(S);
        float rescale[2];
        softmax_step(S, n - 1, rescale);
        wgmma::wait<0>();  // P(n) V(n) done: P and O are free
        wgmma::fence_operands(O);
        consumer::rescale_o<kHD>(O, rescale);
        consumer::pack_p<kDT, kBN>(S, P);
      } else {
        wgmma::wait<0>();
        wgmma::fence_operands(O);
      }
    }
  }
  softmax.finalize();

  // ---- Epilogue (common/epilogue.hpp) ----
  if constexpr (Traits::kSplit) {
    consumer::write_split<Traits>(p, bi, O, softmax, row_of, t);
  } else {
    // Stage the rounded tile in shared memory (over Q), then write 16-byte rows.
    cp_async_wait<0>();
    __syncthreads();  // every wgmma reading sQ is done; no copy is in flight
    // The rows' LSEs are staged too (in K's first stage, free now), for one coalesced store.
    const common::StagedTile<Traits, Cfg::kChunks> tile{
        reinterpret_cast<T*>(smem_raw + (sQ - smem_addr(smem_raw))),
        reinterpret_cast<float*>(smem_raw + (sK(0) - smem_addr(smem_raw)))};
    // Warps in order: warpgroup w owns rows 64w ..
    consumer::stage_rows<kHD>(tile, O, softmax, warp * 16 + g, t);
    __syncthreads();
    tile.template store<kBM, kThreads, true>(p, bi, m0);
  }
}

#endif  // HIPFLASH_HAS_WGMMA

/// The map from the launch grid to work tiles; the launcher sizes the grid with it too.
using Scheduler = common::StaticScheduler;

/// The sm90 forward kernel: one thread block per (query block, split, head, batch).
template <class Traits>
__global__ void __launch_bounds__(Tile<Traits::kHeadDim>::kThreads,
                                  Tile<Traits::kHeadDim>::kMinBlocks)
    fwd_sm90_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_HAS_WGMMA)
  Scheduler::run([&](int64_t tile) { fwd_block<Traits>(p, tile, num_m_blocks); });
#else
  port::trap();  // wgmma needs sm_90a; the selector picks this kernel only where it was built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::sm90
