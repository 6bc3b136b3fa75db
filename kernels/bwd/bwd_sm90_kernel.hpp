// hipflash — the dk/dv pass of the backward on Hopper (sm_90a): warpgroup MMAs on
// 128-byte-swizzled shared-memory tiles (atoms/sm90), cp.async loads (head dims 64 and 128).
//
// A block owns kBlockN = 128 keys of one (batch, kv head), 64 per warpgroup, and walks every
// query block of 64 rows that sees them, for each query head of the group; Q, dO and the rows'
// (lse_log2, delta) are double-buffered. Per query block, each warpgroup computes
//   S^T  = K_wg Q^T,  dP^T = V_wg dO^T                       (wgmma SS, 64 keys x 64 queries)
//   P^T  = exp2(S^T scale log2e - lse_log2),  dS^T = P^T (dP^T - delta)  (from the saved LSE)
//   dV  += P^T dO,  dK += dS^T Q      (wgmma RS: the probabilities stay in registers as the A
//                                      operand; dO and Q are read MN-major)
// and, on the atomic path, dS^T goes to shared memory and dQ = dS K is a third product (wgmma
// SS with both operands MN-major) whose fp32 result is added to dq_accum with vector
// reductions (red.global.add.v2.f32), each warpgroup taking a 64 x 64 piece over all 128 keys:
// at head dim 128 one 64-column panel of the 64 query rows, at head dim 64 (128 query rows a
// step, which halves the per-step overheads of the smaller products) all columns of 64 rows.
// The deterministic path leaves dQ to the dq pass (bwd_sm80_kernel.hpp's bwd_dq_sm80_kernel).
#pragma once

#include "atoms/sm80.hpp"
#include "atoms/sm90/tile_loader.hpp"
#include "atoms/sm90/wgmma.hpp"
#include "atoms/sm90/wgmma_ops.hpp"
#include "bwd/bwd_block_info.hpp"
#include "bwd/dkdv_sm90_parts.hpp"
#include "common/block_info.hpp"
#include "common/element.hpp"
#include "hipflash/detail/softmax_state.hpp"

namespace hipflash::bwd {

template <int kHeadDim_>
struct DkdvSm90Tile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128, kWarpgroups = 2, kThreads = 256;
  /// Query rows per step: 128 at head dim 64 (S^T and dP^T are 64 registers each, dK / dV 32),
  /// 64 at head dim 128 (where dK / dV take 64 each).
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
  /// dQ's 64 x 64 pieces: by columns (one panel each) when the head dim has two panels, else
  /// by query rows (64 each).
  static constexpr bool kDqByColumns = kHeadDim == 128;
  static_assert(kDqByColumns ? kBlockM == 64 : kBlockM == 128, "two 64 x 64 dQ pieces");
  static constexpr int kSmemKV = kBlockN * kHeadDim * 2, kSmemQ = kBlockM * kHeadDim * 2;
  static constexpr int kSmemDs = kBlockN * kBlockM * 2;
  // K, V, Q[2], dO[2], dS^T, then lse_log2[2] and delta[2]; 1024 bytes of alignment slack.
  static constexpr int kSmemBytes = 2 * kSmemKV + 4 * kSmemQ + kSmemDs + 4 * kBlockM * 4 + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (one or two panels)");
};

template <class Traits>
__global__ void __launch_bounds__(256, 1)
    bwd_dkdv_sm90_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_n_blocks) {
#if defined(HIPFLASH_HAS_WGMMA)
  using namespace ::hipflash::atom::sm90;
  using namespace ::hipflash::atom::sm80;  // cp.async group helpers, pack2
  using Cfg = DkdvSm90Tile<Traits::kHeadDim>;
  using T = common::element_t<Traits::kDType>;
  constexpr DType kDT = Traits::kDType;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kHD = Cfg::kHeadDim;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = smem0, sV = sK + Cfg::kSmemKV;
  auto sQ = [&](int st) { return sV + Cfg::kSmemKV + uint32_t(st) * Cfg::kSmemQ; };
  auto sdO = [&](int st) { return sV + Cfg::kSmemKV + uint32_t(2 + st) * Cfg::kSmemQ; };
  const uint32_t sdS = sV + Cfg::kSmemKV + 4 * Cfg::kSmemQ;  // [kBN keys][kBM queries]
  float* const stats = reinterpret_cast<float*>(smem_raw + (sdS + Cfg::kSmemDs - smem_addr(smem_raw)));
  auto sLse = [&](int st) { return stats + st * kBM; };
  auto sDelta = [&](int st) { return stats + (2 + st) * kBM; };

  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int wg = warp / 4, wi = warp % 4, g = lane / 4, t = lane % 4;

  // Grid order: key block fastest (the blocks of one kv head run together and share its Q / dO
  // in L2); masked calls key block slowest instead, so that every head's heaviest key blocks
  // (causal: the first ones, seen by the most rows) start first and none is left for the tail.
  const KeyBlock kb(p, blockIdx.x, num_n_blocks,
                    Traits::kMasked ? KeyOrder::kSlowest : KeyOrder::kFastest, kBN, kBM);
  if (kb.past_keys()) return;  // past this varlen sequence's keys
  const int64_t hk = kb.hk, b = kb.b, n0 = kb.n0, groups = kb.groups, row_lo = kb.row_lo;
  const SeqBounds& seq = kb.seq;
  const int hd = int(p.head_dim);
  const float scale_log2 = p.softmax_scale * detail::kLog2e;
  const int64_t row_hi = kb.row_hi;
  const int64_t m_steps = (row_hi - row_lo + kBM - 1) / kBM;  // per query head
  const int64_t steps = m_steps * groups;

  auto load_step = [&](int64_t s) {  // Q, dO and the row statistics of step s into stage s % 2
    const int64_t h = hk * groups + s / m_steps, m0 = row_lo + (s % m_steps) * kBM;
    const int st = int(s % 2);
    const T* q = q_rows<T>(p, b, seq.q_start, h);
    const T* dout = dout_rows<T>(p, b, seq.q_start, h);
    TileLoader<kBM, kHD, Cfg::kThreads, T>(q, p.q_row_stride, hd).load(sQ(st), m0, seq.len_q);
    TileLoader<kBM, kHD, Cfg::kThreads, T>(dout, p.do_row_stride, hd).load(sdO(st), m0, seq.len_q);
    const int i = int(threadIdx.x);
    if (i < kBM / 4)
      cp_async_16(sLse(st) + 4 * i, p.lse_log2 + p.ws_row(b, h, m0) + 4 * i, true);
    else if (i >= 128 && i < 128 + kBM / 4)  // the other warpgroup's threads
      cp_async_16(sDelta(st) + 4 * (i - 128), p.delta + p.ws_row(b, h, m0) + 4 * (i - 128), true);
  };
  {
    const T* k = k_rows<T>(p, b, seq.k_start, hk);
    const T* v = v_rows<T>(p, b, seq.k_start, hk);
    TileLoader<kBN, kHD, Cfg::kThreads, T>(k, p.k_row_stride, hd).load(sK, n0, seq.len_k);
    TileLoader<kBN, kHD, Cfg::kThreads, T>(v, p.v_row_stride, hd).load(sV, n0, seq.len_k);
    if (steps > 0) load_step(0);
    cp_async_commit();
  }

  // Accumulators in wgmma order: element 4i + 2h + e is row g + 8h of this warp's 16 (keys
  // here, queries for dQ), column 8i + 2t + e.
  float dK[kHD / 2], dV[kHD / 2];
#pragma unroll
  for (int i = 0; i < kHD / 2; ++i) dK[i] = dV[i] = 0.f;
  const uint32_t sK_wg = sK + wg * 64 * 128, sV_wg = sV + wg * 64 * 128;
  const int64_t key0 = n0 + wg * 64 + wi * 16 + g;  // this thread's keys: key0, key0 + 8

  for (int64_t s = 0; s < steps; ++s) {
    const int st = int(s % 2);
    const int64_t h = hk * groups + s / m_steps, m0 = row_lo + (s % m_steps) * kBM;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // step s landed for every thread; step s - 1's wgmmas are all done
    if (s + 1 < steps) load_step(s + 1);
    cp_async_commit();

    // S^T = K Q^T and dP^T = V dO^T over head-dim steps of 16 (panel ks / 4, 32 B a step).
    float S[kBM / 2], dP[kBM / 2];
#pragma unroll
    for (int i = 0; i < kBM / 2; ++i) S[i] = dP[i] = 0.f;
    wgmma::fence();
    sm90_parts::issue_scores<kDT, kBM, kBN, kHD>(S, sK_wg, sQ(st));
    sm90_parts::issue_scores<kDT, kBM, kBN, kHD>(dP, sV_wg, sdO(st));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(S);
    wgmma::fence_operands(dP);

    // P^T and dS^T from the saved LSE (a select for masked pairs: a masked NaN leaks nothing).
    const float* lse2 = sLse(st);
    const float* delta = sDelta(st);
    // The rows seeing this thread's keys key0 and key0 + 8 (KeyPairRows).
    const KeyPairRows<kBM, Traits::kMasked> key_rows(seq, p, m0, n0, kBN, key0);
#pragma unroll
    for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * i + 2 * t + e;
        const float l2 = lse2[col], dl = delta[col];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 4 * i + 2 * hh + e;
          const bool valid = key_rows.sees(col, hh);
          const float pr = exp2f(S[r] * scale_log2 - l2);
          S[r] = valid ? pr : 0.f;
          dP[r] = valid ? pr * (dP[r] - dl) : 0.f;
        }
      }
    // The C fragments of two 8-query tiles are the A fragment of one 16-query step.
    uint32_t Pf[kBM / 16][4], dSf[kBM / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        Pf[kk][j] = pack2<kDT>(S[8 * kk + 2 * j], S[8 * kk + 2 * j + 1]);
        dSf[kk][j] = pack2<kDT>(dP[8 * kk + 2 * j], dP[8 * kk + 2 * j + 1]);
      }
    if (!p.deterministic) {  // dS^T (rounded, as the A operand of dQ) into its SW128 tile
      unsigned char* ds = smem_raw + (sdS - smem_addr(smem_raw));
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = wg * 64 + wi * 16 + g + 8 * hh;
          // dS^T[4i + 2hh .. + 1] is the pair packed as dSf[i / 2][2 (i % 2) + hh].
          *reinterpret_cast<uint32_t*>(ds + sw128_offset<kBN>(row, i) + 4 * t) =
              dSf[i / 2][2 * (i % 2) + hh];
        }
    }

    // dV += P^T dO, dK += dS^T Q over query steps of 16 (2048 bytes of rows a step).
    wgmma::fence();
    sm90_parts::issue_grad<kDT, kBM, kHD>(dV, Pf, sdO(st));
    sm90_parts::issue_grad<kDT, kBM, kHD>(dK, dSf, sQ(st));
    wgmma::commit();

    if (!p.deterministic) {
      wgmma::wait<0>();     // dV, dK done: P and dS leave the registers before dQ's arrive
      wgmma::fence_operands(dV);
      wgmma::fence_operands(dK);
      fence_proxy_async();  // dS^T's generic-proxy stores, visible to the wgmma reads below
      __syncthreads();      // ... of both warpgroups
      // A: dS^T's panel of this piece's 64 queries; B: K's panel of its 64 columns.
      const uint32_t a0 = sdS + (Cfg::kDqByColumns ? 0 : wg * kBN * 128);
      const uint32_t b0 = sK + (Cfg::kDqByColumns ? wg * kBN * 128 : 0);
      float dQ[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) dQ[i] = 0.f;
      wgmma::fence();
      sm90_parts::issue_dq<kDT, kBN>(dQ, a0, b0);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(dQ);
      const int col0 = Cfg::kDqByColumns ? wg * 64 : 0;
      const int64_t row0 = m0 + (Cfg::kDqByColumns ? 0 : wg * 64) + wi * 16 + g;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t row = row0 + 8 * hh;
        if (row >= seq.len_q) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i)
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(
                           p.dq_accum + dq_accum_index(p, b, h, row, col0 + 8 * i + 2 * t)),
                       "f"(dQ[4 * i + 2 * hh]), "f"(dQ[4 * i + 2 * hh + 1])
                       : "memory");
      }
    } else {
      wgmma::wait<0>();
    }
    wgmma::fence_operands(dV);
    wgmma::fence_operands(dK);
  }

  cp_async_wait<0>();  // no copy outlives the block (no step: K and V were never read)

  // dk = scale dS^T Q, dv = P^T dO, rows of this thread's keys.
  sm90_parts::store_dkdv<kDT, kHD>(p, seq, b, hk, key0, t, dK, dV);
#else
  port::trap();  // wgmma needs sm_90a; the launcher picks this kernel only where it was built
#endif  // HIPFLASH_HAS_WGMMA
}

}  // namespace hipflash::bwd
