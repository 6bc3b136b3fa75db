// hipflash — the backward kernels on the NVIDIA sm_80+ atom (mma.sync; run on the H200).
//
// bwd_dkdv_sm80_kernel — FlashAttention-2's key-block schedule in the transposed form: a block
// owns kBlockN keys of one (batch, kv head); each warp owns 16 of them (and, at head dim 256,
// half of the head dim's dK / dV columns, two warps computing the same scores). It walks every
// query block that sees its keys, for each query head of the group, Q / dO / LSE / delta tiles
// double-buffered with cp.async, and per query block computes on the matrix cores
//   S^T  = K Q^T,   dP^T = V dO^T                     (16 x kBlockM per warp)
//   P^T  = exp2(S^T scale log2e - lse_log2),  dS^T = P^T (dP^T - delta)   (from the saved LSE)
//   dV  += P^T dO,  dK += dS^T Q                         (registers, across the whole walk)
//   dq_accum += dS K                                      (atomic path: dS^T staged in shared
//                                                          memory, fp32 atomics)
// With the keys as the fragment rows, P^T and dS^T are the A operands of dV / dK straight from
// the accumulators (no shared-memory round trip); only the atomic dq needs dS in memory.
//
// bwd_dq_sm80_kernel — the deterministic dq: a block owns kBlockM query rows of one (batch,
// head), walks their key blocks in order (K / V double-buffered), S = Q K^T, dP = dO V^T,
// dQ += dS K; every element of dq summed in one fixed order.
#pragma once

#include "bwd/bwd_block_info.hpp"
#include "bwd/warp_gemm_sm80.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "common/swizzle.hpp"
#include "hipflash/detail/softmax_state.hpp"

namespace hipflash::bwd {

/// The dk/dv pass's tile.
template <int kHeadDim_>
struct DkdvTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;                          ///< query rows per step
  static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;  ///< keys per block
  static constexpr int kNWarps = 8, kThreads = kNWarps * 32;
  static constexpr int kKeyWarps = kBlockN / 16;              ///< warps with distinct keys
  static constexpr int kDSplit = kNWarps / kKeyWarps;         ///< warps sharing 16 keys
  static constexpr int kDCols = kHeadDim / kDSplit;           ///< dK / dV columns per warp
  static constexpr int kChunks = kHeadDim / 8, kRowBytes = kHeadDim * 2;
  static constexpr int kDsChunks = kBlockM / 8, kDsRowBytes = kBlockM * 2;
  // dq GEMM: 4 warps of 16 rows x (kNWarps / 4) column slices.
  static constexpr int kDqColWarps = kNWarps / (kBlockM / 16);
  static constexpr int kDqCols = kHeadDim / kDqColWarps;
  // Shared memory (elements of 2 bytes, then fp32 row statistics).
  static constexpr int kSmemKV = kBlockN * kHeadDim, kSmemQ = kBlockM * kHeadDim;
  static constexpr int kSmemDs = kBlockN * kBlockM;
  static constexpr int kSmemBytes = (2 * kSmemKV + 4 * kSmemQ + kSmemDs) * 2 + 4 * kBlockM * 4;
  static_assert(kKeyWarps * kDSplit == kNWarps && kDCols % 16 == 0 && kDqCols % 16 == 0);
};

/// The dq pass's tile.
template <int kHeadDim_>
struct DqTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128, kBlockN = kHeadDim == 256 ? 32 : 64;
  static constexpr int kNWarps = kBlockM / 16, kThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8, kRowBytes = kHeadDim * 2;
  static constexpr int kSmemQ = kBlockM * kHeadDim, kSmemKV = kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (2 * kSmemQ + 4 * kSmemKV) * 2;
};

#if defined(HIPFLASH_HAS_MMA_SYNC)

namespace detail_sm80 {

using namespace ::hipflash::bwd::sm80;

/// Copies rows [row0, row0 + kRows) of a [len, D] operand into a swizzled tile (cp.async);
/// rows >= len and columns >= head_dim are zero-filled.
template <int kRows, int kChunks, int kThreads, class T>
__device__ __forceinline__ void load_rows(T* smem, const T* src, int64_t ld, int64_t row0,
                                          int64_t len, int head_dim) {
  constexpr int kTotal = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int idx = int(threadIdx.x) + i * kThreads;
    if (kTotal % kThreads != 0 && idx >= kTotal) break;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = row0 + r < len && c * 8 < head_dim;
    const T* from = valid ? src + (row0 + r) * ld + c * 8 : src;
    cp_async_16(smem + common::swizzle<kChunks>(r, c), from, valid);
  }
}

/// kRows fp32 row statistics from the (padded, always in range) workspace, 16 bytes a thread.
template <int kRows>
__device__ __forceinline__ void load_stats(float* smem, const float* src) {
  if (int(threadIdx.x) < kRows / 4) cp_async_16(smem + threadIdx.x * 4, src + threadIdx.x * 4, true);
}

/// Stores a warp's C fragment (16 rows from `row0` of the tile, columns from col0) into a
/// [rows][kChunks * 8] swizzled tile, rounded.
template <DType kDType, int kChunks, int kCols, class T>
__device__ __forceinline__ void store_c(T* smem, const float (&C)[2][kCols], int row0, int col0,
                                        int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const int row = row0 + g + 8 * h, col = col0 + (c / 2) * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(smem + common::swizzle<kChunks>(row, col / 8) + col % 8) =
          pack2<kDType>(C[h][c], C[h][c + 1]);
    }
}

/// Writes a warp's C fragment times `scale`, rounded, to rows row0 + (g, g + 8) of a global
/// [len, D] operand (rows >= len and columns >= head_dim skipped).
template <DType kDType, int kCols, class T>
__device__ __forceinline__ void write_c(T* dst, int64_t ld, const float (&C)[2][kCols],
                                        int64_t row0, int col0, int64_t len, int head_dim,
                                        float scale, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + g + 8 * h;
    if (row >= len) continue;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const int col = col0 + (c / 2) * 8 + 2 * t;
      if (col < head_dim)
        *reinterpret_cast<uint32_t*>(dst + row * ld + col) =
            pack2<kDType>(C[h][c] * scale, C[h][c + 1] * scale);
    }
  }
}

}  // namespace detail_sm80

#endif  // HIPFLASH_HAS_MMA_SYNC

template <class Traits>
__global__ void __launch_bounds__(DkdvTile<Traits::kHeadDim>::kThreads)
    bwd_dkdv_sm80_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_n_blocks) {
#if defined(HIPFLASH_HAS_MMA_SYNC)
  using namespace detail_sm80;
  using Cfg = DkdvTile<Traits::kHeadDim>;
  using T = common::element_t<Traits::kDType>;
  constexpr DType kDT = Traits::kDType;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kHD = Cfg::kHeadDim;
  constexpr int kMCols = 2 * (kBM / 8);       // fragment columns of S^T (queries)
  constexpr int kDCols = 2 * (Cfg::kDCols / 8);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Cfg::kSmemKV;
  T* sQ = sV + Cfg::kSmemKV;            // [2][kBM][kHD]
  T* sdO = sQ + 2 * Cfg::kSmemQ;        // [2][kBM][kHD]
  T* sdS = sdO + 2 * Cfg::kSmemQ;       // [kBN][kBM]: dS^T
  float* sLse = reinterpret_cast<float*>(sdS + Cfg::kSmemDs);  // [2][kBM]
  float* sDelta = sLse + 2 * kBM;                                 // [2][kBM]

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int key_warp = warp / Cfg::kDSplit, dpart = warp % Cfg::kDSplit;
  const int g = lane / 4, t = lane % 4;

  const KeyBlock kb(p, blockIdx.x, num_n_blocks, KeyOrder::kFastest, kBN, kBM);
  if (kb.past_keys()) return;  // past this varlen sequence's keys
  const int64_t hk = kb.hk, b = kb.b, n0 = kb.n0, groups = kb.groups, row_lo = kb.row_lo;
  const SeqBounds& seq = kb.seq;
  const int hd = int(p.head_dim);
  const float scale_log2 = p.softmax_scale * detail::kLog2e;

  const T* k = k_rows<T>(p, b, seq.k_start, hk);
  const T* v = v_rows<T>(p, b, seq.k_start, hk);
  const int64_t row_hi = kb.row_hi;
  const int64_t m_steps = (row_hi - row_lo + kBM - 1) / kBM;  // per query head
  const int64_t steps = m_steps * groups;

  // Step s: query head hk * groups + s / m_steps, rows row_lo + (s % m_steps) * kBM.
  auto load_step = [&](int64_t s) {
    const int64_t h = hk * groups + s / m_steps, m0 = row_lo + (s % m_steps) * kBM;
    const int stage = int(s % 2);
    const T* q = q_rows<T>(p, b, seq.q_start, h);
    const T* dout = dout_rows<T>(p, b, seq.q_start, h);
    load_rows<kBM, Cfg::kChunks, Cfg::kThreads>(sQ + stage * Cfg::kSmemQ, q, p.q_row_stride, m0,
                                                seq.len_q, hd);
    load_rows<kBM, Cfg::kChunks, Cfg::kThreads>(sdO + stage * Cfg::kSmemQ, dout, p.do_row_stride,
                                                m0, seq.len_q, hd);
    load_stats<kBM>(sLse + stage * kBM, p.lse_log2 + p.ws_row(b, h, m0));
    if (threadIdx.x >= 32 && threadIdx.x < 32 + kBM / 4) {  // delta: another warp's lanes
      const int i = int(threadIdx.x) - 32;
      cp_async_16(sDelta + stage * kBM + i * 4, p.delta + p.ws_row(b, h, m0) + i * 4, true);
    }
  };

  load_rows<kBN, Cfg::kChunks, Cfg::kThreads>(sK, k, p.k_row_stride, n0, seq.len_k, hd);
  load_rows<kBN, Cfg::kChunks, Cfg::kThreads>(sV, v, p.v_row_stride, n0, seq.len_k, hd);
  if (steps > 0) load_step(0);
  cp_async_commit();

  float dK[2][kDCols], dV[2][kDCols];
  zero(dK);
  zero(dV);
  const LaneRows k_lanes = lanes_a(smem_addr(sK) + key_warp * 16 * Cfg::kRowBytes, Cfg::kRowBytes, lane);
  const LaneRows v_lanes = lanes_a(smem_addr(sV) + key_warp * 16 * Cfg::kRowBytes, Cfg::kRowBytes, lane);
  const int64_t key0 = n0 + key_warp * 16 + g;  // this thread's keys: key0 and key0 + 8

  for (int64_t s = 0; s < steps; ++s) {
    const int stage = int(s % 2);
    const int64_t h = hk * groups + s / m_steps, m0 = row_lo + (s % m_steps) * kBM;
    cp_async_wait<0>();
    __syncthreads();  // step s landed; every warp is done with step s - 1's buffers and dS
    if (s + 1 < steps) load_step(s + 1);
    cp_async_commit();

    const uint32_t q_tile = smem_addr(sQ + stage * Cfg::kSmemQ);
    const uint32_t do_tile = smem_addr(sdO + stage * Cfg::kSmemQ);
    float S[2][kMCols], dP[2][kMCols];
    zero(S);
    zero(dP);
    gemm_nt<kDT, kBM / 8, kHD / 16>(S, k_lanes, lanes_b(q_tile, Cfg::kRowBytes, lane), Cfg::kRowBytes);
    gemm_nt<kDT, kBM / 8, kHD / 16>(dP, v_lanes, lanes_b(do_tile, Cfg::kRowBytes, lane), Cfg::kRowBytes);

    // P^T and dS^T from the saved LSE (rows: keys; columns: queries).
    const float* lse2 = sLse + stage * kBM;
    const float* delta = sDelta + stage * kBM;
    // The rows seeing this thread's keys key0 and key0 + 8 (KeyPairRows).
    const KeyPairRows<kBM, Traits::kMasked> key_rows(seq, p, m0, n0, kBN, key0);
#pragma unroll
    for (int c = 0; c < kMCols; ++c) {
      const int col = (c / 2) * 8 + 2 * t + (c % 2);
      const float l2 = lse2[col], dl = delta[col];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const bool valid = key_rows.sees(col, hh);
        const float pr = exp2f(S[hh][c] * scale_log2 - l2);
        S[hh][c] = valid ? pr : 0.f;  // a select: a masked NaN score leaks nothing
        dP[hh][c] = valid ? pr * (dP[hh][c] - dl) : 0.f;
      }
    }
    if (!p.deterministic && dpart == 0)
      store_c<kDT, Cfg::kDsChunks>(sdS, dP, key_warp * 16, 0, lane);

    const int chunk0 = dpart * Cfg::kDCols / 8;
    gemm_rs<kDT, Cfg::kDCols / 8, kBM / 16>(dV, S, lanes_bt(do_tile, Cfg::kRowBytes, lane),
                                             Cfg::kRowBytes, chunk0);
    gemm_rs<kDT, Cfg::kDCols / 8, kBM / 16>(dK, dP, lanes_bt(q_tile, Cfg::kRowBytes, lane),
                                             Cfg::kRowBytes, chunk0);

    if (!p.deterministic) {  // dq_accum += dS K: warp (row tile, column slice)
      __syncthreads();       // dS^T complete
      constexpr int kQCols = 2 * (Cfg::kDqCols / 8);
      const int mt = warp / Cfg::kDqColWarps, cs = warp % Cfg::kDqColWarps;
      float dQ[2][kQCols];
      zero(dQ);
      gemm_tn<kDT, Cfg::kDqCols / 8, kBN / 16>(dQ, lanes_b(smem_addr(sdS), Cfg::kDsRowBytes, lane),
                                               Cfg::kDsRowBytes, 2 * mt,
                                               lanes_bt(smem_addr(sK), Cfg::kRowBytes, lane),
                                               Cfg::kRowBytes, cs * Cfg::kDqCols / 8);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t row = m0 + mt * 16 + g + 8 * hh;
        if (row >= seq.len_q) continue;
#pragma unroll
        for (int c = 0; c < kQCols; ++c)
          atomicAdd(p.dq_accum + dq_accum_index(p, b, h, row,
                                                cs * Cfg::kDqCols + (c / 2) * 8 + 2 * t + (c % 2)),
                    dQ[hh][c]);
      }
    }
  }

  // dk = scale dS^T Q, dv = P^T dO for this warp's keys and columns.
  const int col0 = dpart * Cfg::kDCols;
  T* dk = dk_rows<T>(p, b, seq.k_start, hk);
  T* dv = dv_rows<T>(p, b, seq.k_start, hk);
  write_c<kDT>(dk, p.dk_row_stride, dK, n0 + key_warp * 16, col0, seq.len_k, hd, p.softmax_scale, lane);
  write_c<kDT>(dv, p.dv_row_stride, dV, n0 + key_warp * 16, col0, seq.len_k, hd, 1.f, lane);
#else
  port::trap();  // mma.sync targets only
#endif  // HIPFLASH_HAS_MMA_SYNC
}

template <class Traits>
__global__ void __launch_bounds__(DqTile<Traits::kHeadDim>::kThreads)
    bwd_dq_sm80_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_HAS_MMA_SYNC)
  using namespace detail_sm80;
  using Cfg = DqTile<Traits::kHeadDim>;
  using T = common::element_t<Traits::kDType>;
  constexpr DType kDT = Traits::kDType;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kHD = Cfg::kHeadDim;
  constexpr int kNCols = 2 * (kBN / 8), kQCols = 2 * (kHD / 8);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + Cfg::kSmemQ;
  T* sK = sdO + Cfg::kSmemQ;  // [2][kBN][kHD]
  T* sV = sK + 2 * Cfg::kSmemKV;

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int g = lane / 4;
  const common::BlockInfo<kBM, kBN> bi(p, blockIdx.x, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (m0 >= bi.len_q) return;  // past this varlen sequence
  const int hd = int(p.head_dim);
  const float scale_log2 = p.softmax_scale * detail::kLog2e;

  const T* q = q_rows<T>(p, bi.b, bi.q_start, bi.h);
  const T* dout = dout_rows<T>(p, bi.b, bi.q_start, bi.h);
  const T* k = k_rows<T>(p, bi.b, bi.k_start, bi.h_kv);
  const T* v = v_rows<T>(p, bi.b, bi.k_start, bi.h_kv);
  auto load_kv = [&](int n, int stage) {
    load_rows<kBN, Cfg::kChunks, Cfg::kThreads>(sK + stage * Cfg::kSmemKV, k, p.k_row_stride,
                                                int64_t(n) * kBN, bi.len_k, hd);
    load_rows<kBN, Cfg::kChunks, Cfg::kThreads>(sV + stage * Cfg::kSmemKV, v, p.v_row_stride,
                                                int64_t(n) * kBN, bi.len_k, hd);
  };

  load_rows<kBM, Cfg::kChunks, Cfg::kThreads>(sQ, q, p.q_row_stride, m0, bi.len_q, hd);
  load_rows<kBM, Cfg::kChunks, Cfg::kThreads>(sdO, dout, p.do_row_stride, m0, bi.len_q, hd);
  if (bi.n_block_min < bi.n_block_max) load_kv(bi.n_block_min, 0);
  cp_async_commit();

  // This thread's rows (g and g + 8 of the warp's 16) and their statistics.
  const int64_t row0 = m0 + warp * 16 + g;
  float lse2[2], delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t ws = p.ws_row(bi.b, bi.h, row0 + 8 * hh);
    lse2[hh] = p.lse_log2[ws];
    delta[hh] = p.delta[ws];
  }
  const LaneRows q_lanes = lanes_a(smem_addr(sQ) + warp * 16 * Cfg::kRowBytes, Cfg::kRowBytes, lane);
  const LaneRows do_lanes = lanes_a(smem_addr(sdO) + warp * 16 * Cfg::kRowBytes, Cfg::kRowBytes, lane);

  float dQ[2][kQCols];
  zero(dQ);
  for (int n = bi.n_block_min; n < bi.n_block_max; ++n) {
    const int stage = (n - bi.n_block_min) % 2;
    cp_async_wait<0>();
    __syncthreads();  // K/V(n) landed; every warp is done with the other stage
    if (n + 1 < bi.n_block_max) load_kv(n + 1, stage ^ 1);
    cp_async_commit();

    const uint32_t k_tile = smem_addr(sK + stage * Cfg::kSmemKV);
    const uint32_t v_tile = smem_addr(sV + stage * Cfg::kSmemKV);
    float S[2][kNCols], dP[2][kNCols];
    zero(S);
    zero(dP);
    gemm_nt<kDT, kBN / 8, kHD / 16>(S, q_lanes, lanes_b(k_tile, Cfg::kRowBytes, lane), Cfg::kRowBytes);
    gemm_nt<kDT, kBN / 8, kHD / 16>(dP, do_lanes, lanes_b(v_tile, Cfg::kRowBytes, lane), Cfg::kRowBytes);
    // Keys of this block that rows row0 + 8 hh see, solved per block in masked blocks only.
    int lo[2] = {-1, -1}, hi[2] = {kBN, kBN};
    if (bi.needs_mask(p, n, Traits::kMasked)) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        bi.key_range(p, row0 + 8 * hh, int64_t(n) * kBN, Traits::kMasked, lo[hh], hi[hh]);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int c = 0; c < kNCols; ++c) {
        const int col = (c / 2) * 8 + 2 * (lane % 4) + (c % 2);
        const bool valid = col >= lo[hh] && col <= hi[hh];
        const float pr = exp2f(S[hh][c] * scale_log2 - lse2[hh]);
        S[hh][c] = valid ? pr * (dP[hh][c] - delta[hh]) : 0.f;  // dS
      }
    gemm_rs<kDT, kHD / 8, kBN / 16>(dQ, S, lanes_bt(k_tile, Cfg::kRowBytes, lane), Cfg::kRowBytes, 0);
  }

  T* dq = dq_rows<T>(p, bi.b, bi.q_start, bi.h);
  write_c<kDT>(dq, p.dq_row_stride, dQ, m0 + warp * 16, 0, bi.len_q, hd, p.softmax_scale, lane);
#else
  port::trap();  // mma.sync targets only
#endif  // HIPFLASH_HAS_MMA_SYNC
}

}  // namespace hipflash::bwd
