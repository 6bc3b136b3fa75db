// hipflash — the NVIDIA sm_80+ body of the generic forward kernel (see fwd_kernel.hpp for the
// schedule). One thread block: kBlockM query rows, kNWarps warps of kMTiles 16-row MMA tiles.
#pragma once

#include <type_traits>

#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "common/softmax.hpp"
#include "generic/mainloop_sm80.hpp"
#include "generic/tile_config.hpp"
#include "hipflash/params.hpp"

namespace hipflash::generic::sm80 {

#if defined(HIPFLASH_HAS_MMA_SYNC)

template <class Traits, common::KvRows kKv>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int64_t tile, int num_m_blocks) {
  using Cfg = Tile<Traits::kHeadDim>;
  using T = typename Element<Traits::kDType>::type;
  // An fp8 KV cache: e4m3 K / V travel as bytes, fetched into registers a step early and widened
  // to q's dtype in shared memory (Fp8Tile); the K scale applies to the scores, V's to O.
  constexpr bool kFp8Kv = Traits::kKvDType == DType::e4m3;
  using KvT = std::conditional_t<kFp8Kv, uint8_t, T>;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kMT = Cfg::kMTiles;
  constexpr int kRows = 2 * kMT;  // fragment rows per thread

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Cfg::kSmemQ;
  T* sV = sK + Cfg::kSmemKV;

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const BlockInfo<kBM, kBN> bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (common::block_past_sequence<Traits, kBM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;  // past this varlen sequence

  const int hd = int(p.head_dim);
  // Row sources of this block's (batch, head) in q, k and v (common/kv_source.hpp).
  const auto q_src = bi.template q_source<T>(p);
  const auto k_src = bi.template k_source_of<KvT, kKv>(p);  // contiguous or paged (KV cache)
  const auto v_src = bi.template v_source_of<KvT, kKv>(p);
  Fp8Tile<Cfg, kBN, Traits::kDType> k8, v8;  // (unused for 16-bit K / V)
  const float k_scale = kFp8Kv ? p.k_descale.at(bi.b, bi.h_kv) : 1.f;
  // K or V rows [n0, n0 + kBN): a cp.async copy, or (fp8) the register fetch that `land` stores.
  auto load_kv = [&](T* smem, Fp8Tile<Cfg, kBN, Traits::kDType>& staged, const auto& src,
                     int64_t n0) {
    if constexpr (kFp8Kv)
      staged.fetch(src, n0, bi.len_k, hd);
    else
      load_tile<Cfg, kBN>(smem, src, n0, bi.len_k, hd);
  };

  float O[kRows][2 * Cfg::kDTiles];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < 2 * Cfg::kDTiles; ++c) O[r][c] = 0.f;
  RowSoftmax<kRows> softmax;
  const common::ScoreCap cap(p);  // the softcap, when the call has one
  const float scale_log2 = cap.scale_log2(p);
  const common::ScoreBias<> bias{p, bi.b, bi.h};  // ALiBi, when the call has it

  // Row (within the sequence) of fragment row r, and column of fragment column c.
  const int g = lane / 4, t = lane % 4;
  auto frag_row = [&](int r) { return m0 + warp * Cfg::kWarpRows + (r / 2) * 16 + (r % 2) * 8 + g; };

  int n = bi.n_block_max - 1;
  if (n >= bi.n_block_min) {
    load_tile<Cfg, kBM>(sQ, q_src, m0, bi.len_q, hd);
    load_kv(sK, k8, k_src, int64_t(n) * kBN);
    if constexpr (kFp8Kv) k8.store(sK);
    cp_async_commit();
  }
  for (; n >= bi.n_block_min; --n) {
    cp_async_wait<0>();
    __syncthreads();  // K(n) landed; every warp is done with V(n+1)
    load_kv(sV, v8, v_src, int64_t(n) * kBN);
    cp_async_commit();

    float S[kRows][2 * Cfg::kNTiles];
    gemm_qk<Cfg, Traits::kDType>(S, smem_addr(sQ), smem_addr(sK), warp, lane);
    if constexpr (kFp8Kv) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < 2 * Cfg::kNTiles; ++c) S[r][c] *= k_scale;
      v8.store(sV);  // (every warp finished P V(n + 1) before this step's first barrier)
    }
    cap.apply(S);
    bias.apply(S, frag_row, bi.diag, int64_t(n) * kBN + 2 * t);
    if (bi.needs_mask(p, n, Traits::kMasked)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < 2 * Cfg::kNTiles; ++c) {
          const int64_t j = int64_t(n) * kBN + (c / 2) * 8 + 2 * t + (c % 2);
          if (!BlockInfo<kBM, kBN>::key_valid(p, frag_row(r), j, bi.len_k, bi.diag,
                                              Traits::kMasked))
            S[r][c] = detail::kNegInf;
        }
    }

    cp_async_wait<0>();
    __syncthreads();  // V(n) landed; every warp is done with K(n)
    if (n > bi.n_block_min) {
      load_kv(sK, k8, k_src, int64_t(n - 1) * kBN);
      cp_async_commit();
    }

    float rescale[kRows];
    softmax.update(S, scale_log2, rescale);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < 2 * Cfg::kDTiles; ++c) O[r][c] *= rescale[r];
    gemm_pv<Cfg, Traits::kDType>(O, S, smem_addr(sV), lane);
    if constexpr (kFp8Kv)
      if (n > bi.n_block_min) k8.store(sK);  // (every warp finished Q K^T(n): the barrier above)
  }
  softmax.finalize();
  // An fp8 cache's O is P times the e4m3 values: the V scale applies with 1 / l.
  const float o_scale = kFp8Kv ? p.v_descale.at(bi.b, bi.h_kv) : 1.f;

  // ---- Epilogue (common/epilogue.hpp), fragments in mma.sync order ----
  if constexpr (Traits::kSplit) {
    const FwdEpilogue<Traits, BlockInfo<kBM, kBN>> ep(p, bi);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = frag_row(r);
      if (row >= bi.len_q) continue;
      const auto out = ep.row(row, 2 * t);
      const float inv = softmax.inv_sum(r) * o_scale;
#pragma unroll
      for (int c = 0; c < 2 * Cfg::kDTiles; c += 2)
        out.put((c / 2) * 8, {O[r][c] * inv, O[r][c + 1] * inv});
      if (t == 0) out.stat(softmax.state(r));
    }
  } else {
    // Stage the rounded tile in shared memory (over Q) and its LSEs (over K, free once every
    // warp is past the last Q K^T), then write 16-byte rows.
    __syncthreads();  // every warp is done reading sQ and sK
    const StagedTile<Traits, Cfg::kChunks> tile{sQ, reinterpret_cast<float*>(sK)};
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float inv = softmax.inv_sum(r) * o_scale;
      const int srow = warp * Cfg::kWarpRows + (r / 2) * 16 + (r % 2) * 8 + g;
      tile.lse(srow, softmax.lse(r));
#pragma unroll
      for (int c = 0; c < 2 * Cfg::kDTiles; c += 2)
        tile.put2(srow, c / 2, 2 * t, O[r][c] * inv, O[r][c + 1] * inv);
    }
    __syncthreads();
    tile.template store<kBM, Cfg::kThreads, true>(p, bi, m0);
  }
}

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::generic::sm80
