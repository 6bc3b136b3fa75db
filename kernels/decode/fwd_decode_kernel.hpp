// hipflash — the decode forward kernel (NVIDIA sm_80+, mma.sync).
//
// For problems with at most 16 query rows per (batch, head) — decode, with the GQA heads of one
// kv head packed into those rows — the generic kernel's 128-row block would spend most of its
// matrix-core work on rows that do not exist. Here a thread block owns one 16-row block and
// its 4 warps split every 64-key block: warp w takes keys [16w, 16w + 16) and keeps its own
// online-softmax state and O accumulator. A kStages-deep cp.async ring streams K/V; at the end
// the warps' states are merged through shared memory with the shared SoftmaxState, and the
// epilogue (common/epilogue.hpp) writes O (or the split's fp32 partial) and, for kReturnLse
// kernels only, the LSE.
// Same FwdParams, BlockInfo (varlen, windows, split range) and flags as the generic kernel.
#pragma once

#include <type_traits>

#include "decode/decode_tile.hpp"
#include "decode/warp_keys.hpp"
#include "atoms/sm80.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "common/scheduler.hpp"
#include "common/softmax.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"

namespace hipflash::decode {

/// The decode kernel's tile for Traits: K / V of q's dtype, or e4m3 (an fp8 KV cache).
template <class Traits>
using TileOf = DecodeTile<Traits::kHeadDim, Traits::kKvDType == DType::e4m3 ? 1 : 2>;

#if defined(HIPFLASH_HAS_MMA_SYNC)

template <class Traits, common::KvRows kKv>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int64_t tile, int num_m_blocks) {
  using namespace atom::sm80;
  using Cfg = TileOf<Traits>;
  using T = typename common::Element<Traits::kDType>::type;
  constexpr bool kFp8Kv = Cfg::kKvBytes == 1;
  using KvT = std::conditional_t<kFp8Kv, uint8_t, T>;  // e4m3 travels as bytes
  using Info = common::BlockInfo<Cfg::kBlockM, Cfg::kBlockN>;
  using KvLoad = typename Cfg::KvLoad;
  constexpr int kBN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kKvRowBytes = Cfg::kKvChunks * 16;
  constexpr DType kDT = Traits::kDType;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  KvT* sRing = reinterpret_cast<KvT*>(sQ + Cfg::kSmemQ);  // stage s: K tile, then V tile
  constexpr int kStageElems = 2 * Cfg::kSmemKV;

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int g = lane / 4, t = lane % 4;
  const Info bi(p, tile, num_m_blocks, false);
  const int64_t m0 = int64_t(bi.m_block) * Cfg::kBlockM;
  if (common::block_past_sequence<Traits, Cfg::kBlockM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;  // past this varlen sequence

  const int hd = int(p.head_dim);
  // Row sources of this block's (batch, head) in q, k and v (common/kv_source.hpp).
  const auto q_src = bi.template q_source<T>(p);
  const auto k_src = bi.template k_source_of<KvT, kKv>(p);  // contiguous or paged (KV cache)
  const auto v_src = bi.template v_source_of<KvT, kKv>(p);

  const int n_begin = bi.n_block_min, num_n = bi.n_block_max - bi.n_block_min;
  // Key block n_begin + i goes to stage i % kStages; one commit group per block, empty ones
  // included, so that "all but the newest kStages - 2 groups" always means block i landed.
  // The rows of the next block to load are resolved one load ahead (a paged cache's block-table
  // entries: see TileRows).
  TileRows<KvLoad, kBN, std::remove_const_t<decltype(k_src)>> next_rows;
  auto load_kv = [&](int i) {
    if (i < num_n) {
      KvT* sK = sRing + (i % kStages) * kStageElems;
      const int64_t row0 = int64_t(n_begin + i) * kBN;
      load_tile_by_runs<KvLoad, kBN>(sK, k_src, next_rows, row0, bi.len_k, hd);
      load_tile_by_runs<KvLoad, kBN>(sK + Cfg::kSmemKV, v_src, next_rows, row0, bi.len_k, hd);
      if (i + 1 < num_n) next_rows.fetch(k_src, row0 + kBN, bi.len_k);
    }
    cp_async_commit();
  };
  if (num_n > 0) next_rows.fetch(k_src, int64_t(n_begin) * kBN, bi.len_k);
  load_tile<Cfg, Cfg::kBlockM>(sQ, q_src, m0, bi.len_q, hd);  // joins group 0
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) load_kv(i);

  uint32_t qf[Cfg::kDSteps][4];  // Q as the A operand, loaded once
  float O[2][2 * Cfg::kDTiles];
  zero_rows<Cfg::kDTiles>(O);
  common::RowSoftmax<2> softmax;
  const common::ScoreCap cap(p);  // the softcap, when the call has one
  const float scale_log2 = cap.scale_log2(p);
  const common::ScoreBias<true> bias{p, bi.b, bi.h};  // ALiBi, when the call has it
  // The scores' mask, cap and bias (the caller's S: this warp's 16 keys of block n).
  const auto score_mods = [&](float (&S)[2][4], int n) {
    cap.apply(S);
    bias.apply(S, [&](int r) { return m0 + g + 8 * r; }, bi.diag,
               int64_t(n) * kBN + warp * Cfg::kWarpKeys + 2 * t);
    if (!bi.needs_mask(p, n, Traits::kMasked)) return;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = int64_t(n) * kBN + warp * Cfg::kWarpKeys + (c / 2) * 8 + 2 * t + c % 2;
        if (!Info::key_valid(p, m0 + g + 8 * r, j, bi.len_k, bi.diag, Traits::kMasked))
          S[r][c] = detail::kNegInf;
      }
  };

  // Per-kind key step: e4m3 K / V as f16 operands, Q's rows scaled into f16's range
  // (warp_keys.hpp), or 16-bit K / V by ldmatrix (see gemm_qk / gemm_pv: rows are == lane % 8
  // (mod 8) throughout).
  float row_scale[2];  // fp8: 2^e of a row's Q times the K scale
  const float k_scale = kFp8Kv ? p.k_descale.at(bi.b, bi.h_kv) : 1.f;
  const auto key_lanes = [&] {
    if constexpr (kFp8Kv)
      return Fp8KeyLanes<kKvRowBytes>(lane, warp * Cfg::kWarpKeys);
    else
      return WarpKeyLanes<kKvRowBytes>(lane, warp * Cfg::kWarpKeys);
  }();
  for (int i = 0; i < num_n; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block i landed; every warp is done with block i - 1's stage
    if (i == 0) {
      if constexpr (kFp8Kv) {
        load_q_f16<Cfg::kDSteps, kDT>(qf, row_scale, sQ, lane);
        row_scale[0] *= k_scale, row_scale[1] *= k_scale;
      } else {
        WarpQueryLanes<Cfg::kChunks * 16>(smem_addr(sQ), lane).load(qf);
      }
    }
    load_kv(i + kStages - 1);  // into the stage block i - 1 used
    const uint32_t sK = smem_addr(sRing + (i % kStages) * kStageElems);
    const int n = n_begin + i;
    const auto mods = [&](float (&S)[2][4]) { score_mods(S, n); };
    if constexpr (kFp8Kv)
      warp_keys_step_fp8<Cfg>(qf, sK, sK + Cfg::kSmemKV, key_lanes, row_scale, O, softmax,
                              scale_log2, mods);
    else
      warp_keys_step<Cfg, kDT>(qf, sK, sK + Cfg::kSmemKV * 2, key_lanes, O, softmax,
                               scale_log2, mods);
  }
  softmax.finalize();

  // ---- Merge the warps' partial states (the ring is reused as the merge buffer) ----
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring
  constexpr int kPitch = Cfg::kMergePitch;
  float* sO = reinterpret_cast<float*>(sRing);  // [warp][row][kPitch]
  float* sM = sO + Cfg::kNWarps * Cfg::kBlockM * kPitch;
  float* sL = sM + Cfg::kNWarps * Cfg::kBlockM;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * Cfg::kBlockM + g + 8 * r;
    if constexpr (kFp8Kv) {
#pragma unroll
      for (int c = 0; c < Cfg::kDTiles / 2; ++c)  // 16-column chunks, d in fp8_o_columns' order
        *reinterpret_cast<float4*>(sO + row * kPitch + 16 * c + 4 * t) =
            fp8_o_columns<Cfg::kDTiles>(O, r, c);
    } else {
#pragma unroll
      for (int c = 0; c < 2 * Cfg::kDTiles; c += 2)
        *reinterpret_cast<float2*>(sO + row * kPitch + (c / 2) * 8 + 2 * t) =
            make_float2(O[r][c], O[r][c + 1]);
    }
    if (t == 0) {
      sM[row] = softmax.m[r];
      sL[row] = softmax.l[r];
    }
  }
  __syncthreads();

  // ---- Epilogue (common/epilogue.hpp): one thread per (row, 8-column chunk) ----
  // An fp8 cache's O is (2^15 P) times the e4m3 values: its V scale and 2^-15 apply here.
  float o_scale = 1.f;
  if constexpr (kFp8Kv) o_scale = p.v_descale.at(bi.b, bi.h_kv) * (1.f / 32768.f);
  const common::FwdEpilogue<Traits, Info> ep(p, bi);
  for (int idx = int(threadIdx.x); idx < Cfg::kBlockM * Cfg::kChunks; idx += Cfg::kThreads) {
    const int row = idx / Cfg::kChunks, ch = idx % Cfg::kChunks;
    const int64_t q_row_idx = m0 + row;
    if (q_row_idx >= bi.len_q) continue;
    detail::SoftmaxState total;
    float w[Cfg::kNWarps];
#pragma unroll
    for (int wp = 0; wp < Cfg::kNWarps; ++wp)
      total.merge({sM[wp * Cfg::kBlockM + row], sL[wp * Cfg::kBlockM + row]});
    const float inv = detail::SoftmaxState::inv_sum(total.l) * o_scale;
#pragma unroll
    for (int wp = 0; wp < Cfg::kNWarps; ++wp)
      w[wp] = detail::SoftmaxState::rescale(sM[wp * Cfg::kBlockM + row], total.m) * inv;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int wp = 0; wp < Cfg::kNWarps; ++wp) {
      const float* src = sO + (wp * Cfg::kBlockM + row) * kPitch + ch * 8;
      const float4 lo = *reinterpret_cast<const float4*>(src);
      const float4 hi = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += w[wp] * lo.x, acc[1] += w[wp] * lo.y, acc[2] += w[wp] * lo.z, acc[3] += w[wp] * lo.w;
      acc[4] += w[wp] * hi.x, acc[5] += w[wp] * hi.y, acc[6] += w[wp] * hi.z, acc[7] += w[wp] * hi.w;
    }
    const auto out = ep.row(q_row_idx, 0);
    out.put(ch * 8, acc);
    if (ch == 0) out.stat(total);
  }
  ep.template finish<Cfg::kBlockM, Cfg::kThreads>(m0);
}

#endif  // HIPFLASH_HAS_MMA_SYNC

/// The map from the launch grid to work tiles; the launcher sizes the grid with it too.
using Scheduler = common::StaticScheduler;

/// The decode forward kernel: one thread block per (16-row query block, split, head, batch);
/// kKv: K and V rows at a stride, or through a KV cache's block table.
template <class Traits, common::KvRows kKv = common::KvRows::contiguous>
__global__ void __launch_bounds__(TileOf<Traits>::kThreads)
    fwd_decode_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_HAS_MMA_SYNC)
  if constexpr (Traits::kKvDType == DType::e4m3 && !kHasE4m3Cvt) {
    port::trap();  // an fp8 KV cache needs sm_89's cvt; the selector knows (kFp8KvMinSm)
  } else {
    // A split kernel's combine pass waits for this grid (griddepcontrol); its blocks may be
    // placed as soon as every block here has started.
    if constexpr (Traits::kSplit) port::allow_dependent_launch();
    Scheduler::run([&](int64_t tile) { fwd_block<Traits, kKv>(p, tile, num_m_blocks); });
  }
#else
  port::trap();  // the decode kernel exists for mma.sync targets only; the selector knows
#endif  // HIPFLASH_HAS_MMA_SYNC
}

}  // namespace hipflash::decode
