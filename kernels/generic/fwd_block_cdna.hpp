// hipflash — the AMD CDNA body of the generic forward kernel: MFMA 16x16x16 (bf16_1k / f16),
// wave64. COMPILE-CHECKED ONLY (gfx90a, gfx940 with Debian's hipcc): no AMD GPU has run it.
//
// MFMA 16x16x16 fragments, lane l = 16 * kg + i (kg = l / 16, i = l % 16):
//   A[16x16]: A[i][4kg .. 4kg+3]   B[16x16]: B[4kg .. 4kg+3][i]   D[16x16]: D[4kg .. 4kg+3][i]
// The wave computes S^T = K Q^T, so its D fragment holds, for query i, keys 4kg..4kg+3: exactly
// the A fragment of P in O = P V. Row statistics therefore live in lane (query) i; the O
// fragment's rows 4kg + j fetch theirs with a shuffle. Q stays in registers; K and V are staged
// in LDS with a padded pitch (no async copies, one barrier pair per key block).
#pragma once

#include "atoms/cdna.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "common/softmax.hpp"
#include "generic/tile_config.hpp"
#include "hipflash/params.hpp"

namespace hipflash::generic::cdna {

#if defined(HIPFLASH_HAS_MFMA)

using namespace ::hipflash::atom::cdna;  // the atom this body is written in
using namespace ::hipflash::common;      // the pieces every schedule shares

/// The mask on query q_row's scores S[0][c] of key block n (keys n kBN + 16 (c / 4) + 4 kg +
/// c % 4: the S^T fragment both bodies hold), in the blocks that need it.
template <class Traits, int kBM, int kBN, int kCols>
__device__ __forceinline__ void mask_scores(const FwdParams& p, const BlockInfo<kBM, kBN>& bi,
                                            int n, int64_t q_row, int kg, float (&S)[1][kCols]) {
  if (!bi.needs_mask(p, n, Traits::kMasked)) return;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t key = int64_t(n) * kBN + (c / 4) * 16 + kg * 4 + c % 4;
    if (!BlockInfo<kBM, kBN>::key_valid(p, q_row, key, bi.len_k, bi.diag, Traits::kMasked))
      S[0][c] = detail::kNegInf;
  }
}

/// The epilogue (common/epilogue.hpp) both bodies share: the lane holds O[query 4kg + j][dim
/// 16 dt + i], query r's statistics live in lane r (finalized); rows normalised and times
/// o_scale (1, or fp8's factors).
template <class Traits, class Cfg, int kBM, int kBN, int kDT>
__device__ __forceinline__ void store_rows(const FwdParams& p, const BlockInfo<kBM, kBN>& bi,
                                           int64_t m0, int wave, int lane,
                                           const float4_t (&O)[kDT],
                                           const RowSoftmax<1, QueryLanes64>& softmax,
                                           float o_scale) {
  const int i = lane % 16, kg = lane / 16;
  const FwdEpilogue<Traits, BlockInfo<kBM, kBN>> ep(p, bi);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int src = kg * 4 + j;
    const float inv = port::shfl(softmax.inv_sum(0), src) * o_scale;
    const SoftmaxState state{port::shfl(softmax.m[0], src), port::shfl(softmax.l[0], src)};
    const int64_t row = m0 + wave * 16 + src;
    if (row >= bi.len_q) continue;
    const auto out = ep.row(row, i);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) out.put(dt * 16, {O[dt][j] * inv});
    if (i == 0) out.stat(state);
  }
  ep.template finish<kBM, Cfg::kThreads>(m0);
}

template <class Traits>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int64_t tile, int num_m_blocks) {
  using Cfg = Tile<Traits::kHeadDim>;
  using T = typename Element<Traits::kDType>::type;
  using F = typename Frag<Traits::kDType>::type;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = Traits::kHeadDim;
  constexpr int kKT = kBN / 16, kDS = kD / 16;  // 16-key tiles, 16-wide head-dim steps
  static_assert(Cfg::kMTiles == 1, "one 16-row MFMA tile per wave");

  extern __shared__ unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBN * Cfg::kPitch;

  const int lane = int(threadIdx.x) % 64, wave = int(threadIdx.x) / 64;
  const int i = lane % 16, kg = lane / 16;
  const BlockInfo<kBM, kBN> bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (common::block_past_sequence<Traits, kBM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;  // past this varlen sequence
  const int hd = int(p.head_dim);
  // Row sources of this block's (batch, head) in q, k and v (common/kv_source.hpp).
  const auto q_src = bi.template q_source<T>(p);
  const auto k_src = bi.template k_source<T>(p);
  const auto v_src = bi.template v_source<T>(p);

  // This lane's query (B operand of S^T = K Q^T): row i of the wave's tile, dims 4kg + 16 ds.
  const int64_t q_row = m0 + wave * 16 + i;
  F qf[kDS];
#pragma unroll
  for (int ds = 0; ds < kDS; ++ds) {
    const int col = ds * 16 + kg * 4;
    if (q_row < bi.len_q && col < hd)
      qf[ds] = load4<Traits::kDType>(q_src.row(q_row) + col);
    else
      qf[ds] = F{0, 0, 0, 0};
  }

  float4_t O[kDS];
#pragma unroll
  for (int dt = 0; dt < kDS; ++dt) O[dt] = float4_t{0.f, 0.f, 0.f, 0.f};
  // Query i's statistics (partial over this lane's keys until finalize).
  RowSoftmax<1, QueryLanes64> softmax;
  const float scale_log2 = p.softmax_scale * detail::kLog2e;

  for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n) {
    __syncthreads();  // every wave is done with the previous K and V
    load_tile<Cfg, kBN>(sK, k_src, int64_t(n) * kBN, bi.len_k, hd);
    load_tile<Cfg, kBN>(sV, v_src, int64_t(n) * kBN, bi.len_k, hd);
    __syncthreads();

    // S^T tile kt: lane holds scores of query i against keys n*kBN + 16kt + 4kg + j.
    float S[1][4 * kKT];
#pragma unroll
    for (int kt = 0; kt < kKT; ++kt) {
      float4_t acc{0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ds = 0; ds < kDS; ++ds)
        acc = mfma16<Traits::kDType>(
            load4<Traits::kDType>(sK + (kt * 16 + i) * Cfg::kPitch + ds * 16 + kg * 4), qf[ds],
            acc);
#pragma unroll
      for (int j = 0; j < 4; ++j) S[0][4 * kt + j] = acc[j];
    }
    mask_scores<Traits>(p, bi, n, q_row, kg, S);
    // Row statistics are reduced across the four lanes of query i (QueryLanes64: xor 16, 32);
    // the probabilities replace the scores, then become the A fragments of P V.
    float rescale_row[1];
    softmax.update(S, scale_log2, rescale_row);
    const float rescale = rescale_row[0];
    F pf[kKT];
#pragma unroll
    for (int kt = 0; kt < kKT; ++kt) {
      uint16_t bits[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) bits[j] = to_bits<Traits::kDType>(S[0][4 * kt + j]);
      pf[kt] = *reinterpret_cast<const F*>(bits);
    }

    // O rows are queries 4kg + j: fetch their rescale factor from lane 4kg + j.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float r = port::shfl(rescale, kg * 4 + j);
#pragma unroll
      for (int dt = 0; dt < kDS; ++dt) O[dt][j] *= r;
    }
#pragma unroll
    for (int dt = 0; dt < kDS; ++dt)
#pragma unroll
      for (int kt = 0; kt < kKT; ++kt) {
        uint16_t vb[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          vb[j] = *reinterpret_cast<const uint16_t*>(sV + (kt * 16 + kg * 4 + j) * Cfg::kPitch +
                                                     dt * 16 + i);
        O[dt] = mfma16<Traits::kDType>(pf[kt], *reinterpret_cast<const F*>(vb), O[dt]);
      }
  }
  softmax.finalize();  // query i's sum across its four lanes

  store_rows<Traits, Cfg>(p, bi, m0, wave, lane, O, softmax, 1.f);
}

/// fp8 (e4m3 q, k, v; out bf16): the same schedule on MFMA 16x16x32 e4m3 (gfx94x, gfx950),
/// COMPILE-CHECKED ONLY. K and V are staged as bytes (a row of kD, padded by 16); Q stays in
/// registers. S^T = K Q^T takes 32 head-dim bytes a step. The S^T fragment leaves a lane keys
/// 4kg + j and 16 + 4kg + j of each 32-key step, where P's A fragment wants slots 8kg .. 8kg + 7:
/// slot 8kg + j is taken to be key 4kg + j and slot 8kg + 4 + j key 16 + 4kg + j, and the lane
/// gathers V's rows in that order, so P packs from the lane's own scores. Probabilities are
/// 2^7 times the softmax's (e4m3fnuz's largest finite is 240), taken out of O and l at the end
/// with v_descale; on gfx94x the operands read OCP bytes as fnuz (half their value, NaN and -0
/// fixed by fnuz_of), which the scale puts back.
template <class Traits>
__device__ __forceinline__ void fwd_block_fp8(const FwdParams& p, int64_t tile, int num_m_blocks) {
#if defined(HIPFLASH_HAS_MFMA_FP8)
  using Cfg = Tile<Traits::kHeadDim>;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = Traits::kHeadDim;
  constexpr int kKT = kBN / 16, kK32 = kBN / 32, kDS = kD / 32, kDT = kD / 16;
  constexpr int kPitch = kD + 16;   // bytes a staged K / V row
  constexpr int kExpOffset = 7;     // probabilities in (0, 128]
  static_assert(Cfg::kMTiles == 1 && kBN % 32 == 0, "one 16-row tile a wave, 32-key steps");
  static_assert(2 * kBN * kPitch <= Cfg::kSmemBytes, "K and V bytes fit the tile's LDS");

  extern __shared__ unsigned char smem_raw[];
  uint8_t* sK = smem_raw;
  uint8_t* sV = sK + kBN * kPitch;

  const int lane = int(threadIdx.x) % 64, wave = int(threadIdx.x) / 64;
  const int i = lane % 16, kg = lane / 16;
  const BlockInfo<kBM, kBN> bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (common::block_past_sequence<Traits, kBM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;
  const int hd = int(p.head_dim);
  const auto q_src = bi.template q_source<uint8_t>(p);
  const auto k_src = bi.template k_source<uint8_t>(p);
  const auto v_src = bi.template v_source<uint8_t>(p);

  const int64_t q_row = m0 + wave * 16 + i;
  uint64_t qf[kDS];  // B operand of S^T: query i, head-dim bytes 32 ds + 8 kg ..
#pragma unroll
  for (int ds = 0; ds < kDS; ++ds) {
    const int col = ds * 32 + kg * 8;
    qf[ds] = q_row < bi.len_q && col < hd
                 ? fnuz_of(*reinterpret_cast<const uint64_t*>(q_src.row(q_row) + col))
                 : 0;
  }

  // Rows [row0, row0 + kBN) of K or V as bytes, 16 a thread-step; past len / head_dim zero.
  const auto stage = [&](uint8_t* lds, const auto& src, int64_t row0) {
    constexpr int kChunks = kD / 16;
    for (int idx = int(threadIdx.x); idx < kBN * kChunks; idx += Cfg::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row0 + r < bi.len_k && c * 16 < hd)
        v = *reinterpret_cast<const uint4*>(src.row(row0 + r) + c * 16);
      *reinterpret_cast<uint4*>(lds + r * kPitch + c * 16) = v;
    }
  };

  float4_t O[kDT];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) O[dt] = float4_t{0.f, 0.f, 0.f, 0.f};
  RowSoftmax<1, QueryLanes64> softmax;
  const float qk_descale = p.q_descale.at(bi.b, bi.h_kv) * p.k_descale.at(bi.b, bi.h_kv);
  const float scale_log2 =
      p.softmax_scale * detail::kLog2e * qk_descale * kFp8OperandScale * kFp8OperandScale;

  for (int n = bi.n_block_max - 1; n >= bi.n_block_min; --n) {
    __syncthreads();
    stage(sK, k_src, int64_t(n) * kBN);
    stage(sV, v_src, int64_t(n) * kBN);
    __syncthreads();

    float S[1][4 * kKT];  // query i against keys n kBN + 16 kt + 4 kg + j
#pragma unroll
    for (int kt = 0; kt < kKT; ++kt) {
      float4_t acc{0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ds = 0; ds < kDS; ++ds)
        acc = mfma16_fp8(
            fnuz_of(*reinterpret_cast<const uint64_t*>(sK + (kt * 16 + i) * kPitch + ds * 32 +
                                                       kg * 8)),
            qf[ds], acc);
#pragma unroll
      for (int j = 0; j < 4; ++j) S[0][4 * kt + j] = acc[j];
    }
    mask_scores<Traits>(p, bi, n, q_row, kg, S);
    float rescale_row[1];
    softmax.template update<4 * kKT, kExpOffset>(S, scale_log2, rescale_row);
    const float rescale = rescale_row[0];
    // P's A fragment of 32-key step t: slots 8kg + j <- key 4kg + j (16-key tile 2t), slots
    // 8kg + 4 + j <- key 16 + 4kg + j (tile 2t + 1).
    uint64_t pf[kK32];
#pragma unroll
    for (int t = 0; t < kK32; ++t) {
      const float* lo = &S[0][8 * t];
      const float* hi = &S[0][8 * t + 4];
      pf[t] = uint64_t(pack2_fp8(lo[0], lo[1]) | pack2_fp8(lo[2], lo[3]) << 16) |
              uint64_t(pack2_fp8(hi[0], hi[1]) | pack2_fp8(hi[2], hi[3]) << 16) << 32;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float r = port::shfl(rescale, kg * 4 + j);
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) O[dt][j] *= r;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int t = 0; t < kK32; ++t) {
        uint64_t vb = 0;  // B: V at slots 8kg .. 8kg + 7 (the keys above), head-dim byte 16dt + i
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int key = 32 * t + (s / 4) * 16 + 4 * kg + s % 4;
          vb |= uint64_t(sV[key * kPitch + dt * 16 + i]) << (8 * s);
        }
        O[dt] = mfma16_fp8(pf[t], fnuz_of(vb), O[dt]);
      }
  }
  // The probabilities' 2^7 out of l and O, v_descale (and the fnuz read of V) into O.
  constexpr float kUnscale = 1.f / float(1 << kExpOffset);
  softmax.l[0] *= kUnscale;
  softmax.finalize();
  const float o_scale = p.v_descale.at(bi.b, bi.h_kv) * kFp8OperandScale * kUnscale;

  store_rows<Traits, Cfg>(p, bi, m0, wave, lane, O, softmax, o_scale);
#else
  (void)p, (void)tile, (void)num_m_blocks;
  port::trap();  // no fp8 MFMA on this arch; the selector never picks it here
#endif  // HIPFLASH_HAS_MFMA_FP8
}

#endif  // HIPFLASH_HAS_MFMA

}  // namespace hipflash::generic::cdna
