// hipflash — the Hopper forward kernel (sm_90a): the FlashAttention-2 schedule on warpgroup
// MMAs. S = Q K^T reads Q and K from 128-byte-swizzled shared memory (wgmma SS); the
// probabilities stay in registers as the A operand of O += P V (wgmma RS, V MN-major).
// K and V are double-buffered with cp.async; the online softmax, the mask (BlockInfo) and the
// epilogue conventions are the generic kernel's. One warpgroup per thread block (64 rows).
#pragma once

#include "generic/block_info.hpp"
#include "generic/element.hpp"
#include "generic/epilogue.hpp"
#include "generic/mma_sm80.hpp"
#include "generic/softmax.hpp"
#include "generic/tile_config.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"
#include "sm90/tile.hpp"
#include "sm90/wgmma.hpp"
#include "sm90/wgmma_ops.hpp"

namespace hipflash::sm90 {

#if defined(HIPFLASH_HAS_WGMMA)

/// Copies rows [row0, row0 + kRows) of a [len, D] operand into a panelled SW128 tile at shared
/// address `dst`; rows >= len and columns >= head_dim are zero-filled (and never read).
template <int kRows, int kHeadDim, int kThreads, class T>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* gmem, int64_t ld, int64_t row0,
                                          int64_t len, int head_dim) {
  constexpr int kChunks = kHeadDim / 8, kTotal = kRows * kChunks;
  static_assert(kTotal % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = int(threadIdx.x) + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = row0 + r < len && c * 8 < head_dim;
    const T* src = valid ? gmem + (row0 + r) * ld + c * 8 : gmem;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     dst + sw128_offset<kRows>(r, c)),
                 "l"(src), "r"(valid ? 16 : 0));
  }
}

template <class Traits>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int num_m_blocks) {
  using namespace generic::sm80;  // cp.async group helpers, pack2
  using Cfg = Tile<Traits::kHeadDim>;
  using T = typename generic::Element<Traits::kDType>::type;
  using Info = generic::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  constexpr int kHD = Cfg::kHeadDim, kBN = Cfg::kBlockN, kBM = Cfg::kBlockM;
  constexpr DType kDT = Traits::kDType;
  using QK = wgmma::Op<kDT, kBN>;
  using PV = wgmma::Op<kDT, kHD>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem0;
  // Then K stage 0, K stage 1, V stage 0, V stage 1 (addresses, not arrays: no local memory).
  auto sK = [&](int s) { return sQ + Cfg::kSmemQ + uint32_t(s) * Cfg::kSmemKV; };
  auto sV = [&](int s) { return sQ + Cfg::kSmemQ + uint32_t(2 + s) * Cfg::kSmemKV; };

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int g = lane / 4, t = lane % 4;
  const Info bi(p, blockIdx.x, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (m0 >= bi.len_q) {  // past this varlen sequence: only the padded LSE rows to write
    if constexpr (Traits::kReturnLse && !Traits::kSplit)
      generic::write_padded_lse_tail<kBM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q);
    return;
  }

  const int hd = int(p.head_dim);
  const T* gQ = static_cast<const T*>(p.q) + bi.b * p.q_batch_stride +
                bi.q_start * p.q_row_stride + bi.h * p.q_head_stride;
  const T* gK = static_cast<const T*>(p.k) + bi.b * p.k_batch_stride +
                bi.k_start * p.k_row_stride + bi.h_kv * p.k_head_stride;
  const T* gV = static_cast<const T*>(p.v) + bi.b * p.v_batch_stride +
                bi.k_start * p.v_row_stride + bi.h_kv * p.v_head_stride;

  // Accumulators in wgmma order: element 4i + 2h + e is row g + 8h (of this warp's 16), column
  // 8i + 2t + e.
  float O[kHD / 2];
#pragma unroll
  for (int i = 0; i < kHD / 2; ++i) O[i] = 0.f;
  generic::RowSoftmax<2> softmax;
  const float scale_log2 = p.softmax_scale * detail::kLog2e;
  auto row_of = [&](int h) { return m0 + warp * 16 + h * 8 + g; };

  int n = bi.n_block_max - 1, stage = 0;
  if (n >= bi.n_block_min) {
    load_tile<kBM, kHD, Cfg::kThreads>(sQ, gQ, p.q_row_stride, m0, bi.len_q, hd);
    load_tile<kBN, kHD, Cfg::kThreads>(sK(0), gK, p.k_row_stride, int64_t(n) * kBN, bi.len_k, hd);
    cp_async_commit();
    load_tile<kBN, kHD, Cfg::kThreads>(sV(0), gV, p.v_row_stride, int64_t(n) * kBN, bi.len_k, hd);
    cp_async_commit();
  }
  for (; n >= bi.n_block_min; --n, stage ^= 1) {
    cp_async_wait<1>();  // K(n) landed (V(n) may still be in flight)
    fence_proxy_async();
    __syncthreads();
    if (n > bi.n_block_min)
      load_tile<kBN, kHD, Cfg::kThreads>(sK(stage ^ 1), gK, p.k_row_stride,
                                         int64_t(n - 1) * kBN, bi.len_k, hd);
    cp_async_commit();

    // S = Q K^T over head-dim steps of 16: panel ks / 4, 32 bytes per step inside the line.
    float S[kBN / 2];
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < kHD / 16; ++ks) {
      const uint32_t step = (ks % 4) * 32;
      QK::ss(S, wgmma::desc_k_major(sQ + (ks / 4) * kBM * 128 + step),
             wgmma::desc_k_major(sK(stage) + (ks / 4) * kBN * 128 + step), ks > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(S);

    float sc[2][kBN / 4];  // [row h][column 2i + e]
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[h][2 * i] = S[4 * i + 2 * h];
        sc[h][2 * i + 1] = S[4 * i + 2 * h + 1];
      }
    if (bi.needs_mask(p, n, Traits::kMasked)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int lo, hi;
        bi.key_range(p, row_of(h), int64_t(n) * kBN, Traits::kMasked, lo, hi);
#pragma unroll
        for (int c = 0; c < kBN / 4; ++c) {
          const int col = (c / 2) * 8 + 2 * t + c % 2;
          if (col < lo || col > hi) sc[h][c] = detail::kNegInf;
        }
      }
    }
    float rescale[2];
    softmax.update(sc, scale_log2, rescale);
#pragma unroll
    for (int i = 0; i < kHD / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        O[4 * i + 2 * h] *= rescale[h];
        O[4 * i + 2 * h + 1] *= rescale[h];
      }
    // The C fragment of two 8-key score tiles is the A fragment of one 16-key step.
    uint32_t P[kBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      P[kk][0] = pack2<kDT>(sc[0][4 * kk], sc[0][4 * kk + 1]);
      P[kk][1] = pack2<kDT>(sc[1][4 * kk], sc[1][4 * kk + 1]);
      P[kk][2] = pack2<kDT>(sc[0][4 * kk + 2], sc[0][4 * kk + 3]);
      P[kk][3] = pack2<kDT>(sc[1][4 * kk + 2], sc[1][4 * kk + 3]);
    }

    cp_async_wait<1>();  // V(n) landed (K(n - 1) may still be in flight)
    fence_proxy_async();
    __syncthreads();
    if (n > bi.n_block_min)
      load_tile<kBN, kHD, Cfg::kThreads>(sV(stage ^ 1), gV, p.v_row_stride,
                                         int64_t(n - 1) * kBN, bi.len_k, hd);
    cp_async_commit();

    // O += P V over key steps of 16 (2048 bytes of V rows); panels kBN * 128 bytes apart.
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      PV::rs(O, P[kk], wgmma::desc_mn_major(sV(stage) + kk * 16 * 128, kBN * 128), 1);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(O);
  }
  softmax.finalize();

  // ---- Epilogue (as the generic kernel's) ----
  if constexpr (Traits::kSplit) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_of(h);
      if (row >= bi.len_q) continue;
      const int64_t prow = generic::partial_row(p, bi.split, bi.b, bi.h, row);
      const float inv = softmax.inv_sum(h);
      float* dst = p.out_partial + prow * kHD;
#pragma unroll
      for (int i = 0; i < kHD / 8; ++i)
        *reinterpret_cast<float2*>(dst + 8 * i + 2 * t) =
            make_float2(O[4 * i + 2 * h] * inv, O[4 * i + 2 * h + 1] * inv);
      if (t == 0) p.lse_partial[prow] = softmax.lse(h);
    }
  } else {
    if constexpr (Traits::kReturnLse) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row_of(h);
        if (t == 0 && row < bi.len_q)
          p.lse[generic::lse_index(p, bi.b, bi.h, bi.q_start, row)] = softmax.lse(h);
      }
      generic::write_padded_lse_tail<kBM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q);
    }
    // Stage the rounded tile in shared memory (over Q), then write 16-byte rows.
    cp_async_wait<0>();
    __syncthreads();  // every wgmma reading sQ is done; no copy is in flight
    T* sO = reinterpret_cast<T*>(smem_raw + (sQ - smem_addr(smem_raw)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float inv = softmax.inv_sum(h);
      const int srow = warp * 16 + h * 8 + g;
#pragma unroll
      for (int i = 0; i < kHD / 8; ++i)
        *reinterpret_cast<uint32_t*>(sO + generic::swizzle<Cfg::kChunks>(srow, i) + 2 * t) =
            pack2<kDT>(O[4 * i + 2 * h] * inv, O[4 * i + 2 * h + 1] * inv);
    }
    __syncthreads();
    T* gO = static_cast<T*>(p.out) + bi.b * p.o_batch_stride + bi.q_start * p.o_row_stride +
            bi.h * p.o_head_stride;
    constexpr int kTotal = kBM * Cfg::kChunks;
#pragma unroll
    for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
      const int idx = int(threadIdx.x) + i * Cfg::kThreads;
      const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
      if (m0 + r < bi.len_q && c * 8 < hd)
        *reinterpret_cast<uint4*>(gO + (m0 + r) * p.o_row_stride + c * 8) =
            *reinterpret_cast<const uint4*>(sO + generic::swizzle<Cfg::kChunks>(r, c));
    }
  }
}

#endif  // HIPFLASH_HAS_WGMMA

/// The sm90 forward kernel: one warpgroup per (64-row query block, split, head, batch).
template <class Traits>
__global__ void __launch_bounds__(Tile<Traits::kHeadDim>::kThreads,
                                  Tile<Traits::kHeadDim>::kMinBlocks)
    fwd_sm90_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_HAS_WGMMA)
  fwd_block<Traits>(p, num_m_blocks);
#else
  port::trap();  // wgmma needs sm_90a; the selector picks this kernel only where it was built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::sm90
