// hipflash — the sm_90 forward atom: what a consumer warpgroup does with its 64 query rows,
// composed by both Hopper schedules, the cp.async kernel (sm90/) and the TMA warp-specialised
// one (sm90_ws/): the two GEMMs on warpgroup MMAs, the masked online-softmax
// step, the probabilities as P V's A operand, O's rescale, and the walk of O's fragments into
// the one forward epilogue (common/epilogue.hpp: the split's fp32 partials, or the rounded
// tile staged in shared memory). The schedules differ in how K and V arrive and how the
// warpgroups take turns, not in these.
//
// Fragments are in wgmma order: element 4i + 2h + e of an accumulator is row g + 8h of the
// warp's 16 (g = lane / 4), column 8i + 2t + e (t = lane % 4); row_of(h) is the sequence row
// of the thread's row h (m0 + 16 warp + 8 h + g, as the schedule spells it).
#pragma once

#include <cstdint>
#include <type_traits>

#include "atoms/sm80.hpp"
#include "atoms/sm90/wgmma.hpp"
#include "atoms/sm90/wgmma_ops.hpp"
#include "common/block_info.hpp"
#include "common/epilogue.hpp"
#include "common/softmax.hpp"
#include "common/swizzle.hpp"
#include "hipflash/params.hpp"

namespace hipflash::atom::sm90::consumer {

#if defined(HIPFLASH_HAS_WGMMA)

using ::hipflash::atom::sm80::pack2;

/// threadIdx.x, read where it is used. In a persistent kernel's tile loop the compiler hoists
/// everything derived from threadIdx.x (fragment rows, epilogue addresses) out of the loop, and
/// those registers then live through the key loop: ptxas spilled 32-332 bytes in the sm90_ws
/// consumers (docs/design-decisions.md#registers). A volatile read cannot be hoisted, so they are
/// recomputed per tile, which costs a few instructions a tile.
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

/// A consumer thread's place, read once per tile: its index, lane, warp, warpgroup, and the
/// fragment row group g and column quad t (wgmma order).
struct ThreadPlace {
  const int thread_ = thread_index();
  const int lane = thread_ % 32, warp_ = thread_ / 32;
  const int wg = warp_ / 4, g_ = lane / 4, t = lane % 4;
  __device__ __forceinline__ int thread() const { return thread_; }
  __device__ __forceinline__ int warp() const { return warp_; }
  __device__ __forceinline__ int g() const { return g_; }
};
/// The same place for a consumer short of registers: lane, warpgroup and column quad held, the
/// rest read again where used.
struct LeanThreadPlace {
  const int lane = thread_index() % 32, wg = thread_index() / 128;
  const int t = lane % 4;
  __device__ __forceinline__ static int thread() { return thread_index(); }
  __device__ __forceinline__ static int warp() { return thread_index() / 32; }
  __device__ __forceinline__ static int g() { return thread_index() % 32 / 4; }
};

/// S = Q K^T of this warpgroup's 64 rows (Q at sQ_wg, rows kBM * kRowBytes bytes a panel
/// apart) against kBN keys (K at sK), over head-dim steps of 32 bytes (16 elements of 16 bits,
/// 32 of fp8): panel 32 ks / kRowBytes, the step's place inside the row after it. Issued and
/// committed, not waited for.
template <DType kDT, int kBM, int kBN, int kHD, int kRowBytes = 128>
__device__ __forceinline__ void issue_qk(float (&S)[kBN / 2], uint32_t sQ_wg, uint32_t sK) {
  constexpr int kSteps = kHD * (kDT == DType::e4m3 ? 1 : 2) / 32;
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint32_t panel = ks * 32 / kRowBytes, step = ks * 32 % kRowBytes;
    wgmma::Op<kDT, kBN>::ss(
        S, wgmma::desc_k_major_rows<kRowBytes>(sQ_wg + panel * kBM * kRowBytes + step),
        wgmma::desc_k_major_rows<kRowBytes>(sK + panel * kBN * kRowBytes + step), ks > 0);
  }
  wgmma::commit();
}

/// fp8: O += P V over key steps of 32 with V transposed (Vt: head-dim rows of 128 key bytes a
/// panel, 128-byte swizzle, panels kHD * 128 bytes apart; keys in the order pack_p_fp8 leaves
/// P's, sm90_ws::transpose_v). Issued and committed, not waited for.
template <int kBN, int kHD>
__device__ __forceinline__ void issue_pv_fp8(float (&O)[kHD / 2], const uint32_t (&P)[kBN / 32][4],
                                             uint32_t sVt) {
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < kBN / 32; ++kk)
    wgmma::Op<DType::e4m3, kHD>::rs(
        O, P[kk], wgmma::desc_k_major(sVt + (kk / 4) * kHD * 128 + (kk % 4) * 32), 1);
  wgmma::commit();
}

/// Four floats -> one register of four e4m3 bytes (a first, lowest), rounded to nearest even
/// and saturated to +-448 (NaN stays NaN).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
  return uint32_t(lo) | uint32_t(hi) << 16;
}

/// fp8 probabilities -> P V's A fragments, without moving a value between lanes: the A
/// fragment of a 32-key step holds, per row, four consecutive k slots 4t .. 4t + 3 (and
/// 16 + 4t ..), while the thread's scores of those 32 keys are keys 2t, 2t + 1, 8 + 2t, 9 + 2t
/// (and 16 + ..). Slot 4t + i is taken to be key 2t + (i & 1) + 8 (i >> 1) — V's rows are put
/// in that order when it is transposed (sm90_ws::transpose_v) — so that each register is four
/// of the thread's own scores.
template <int kBN>
__device__ __forceinline__ void pack_p_fp8(const float (&S)[kBN / 2], uint32_t (&P)[kBN / 32][4]) {
#pragma unroll
  for (int kk = 0; kk < kBN / 32; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // j: row h = j % 2, keys 16 (j / 2) ..
      const int e = 16 * kk + 8 * (j / 2) + 2 * (j % 2);
      P[kk][j] = pack4_e4m3(S[e], S[e + 1], S[e + 4], S[e + 5]);
    }
}

/// O += P V over key steps of 16 (2048 bytes of V rows a step; panels kBN * 128 bytes apart).
/// Issued and committed, not waited for.
template <DType kDT, int kBN, int kHD>
__device__ __forceinline__ void issue_pv(float (&O)[kHD / 2], const uint32_t (&P)[kBN / 16][4],
                                         uint32_t sV) {
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk)
    wgmma::Op<kDT, kHD>::rs(O, P[kk], wgmma::desc_mn_major(sV + kk * 16 * 128, kBN * 128), 1);
  wgmma::commit();
}

/// The scores S of key block n -> the masked online-softmax step (the mask's per-element test
/// in the blocks that need one); S is left holding the probabilities, `rescale` O's factor per
/// row. A Mask has needs_mask(n) and key_range(h, n, lo, hi) (common::RowMask's).
template <int kBN, int kExpOffset = 0, class Mask>
__device__ __forceinline__ void softmax_step(const Mask& mask, common::RowSoftmax<2>& softmax,
                                             float scale_log2, float (&S)[kBN / 2], int n, int t,
                                             float (&rescale)[2], const float* row_off = nullptr) {
  float sc[2][kBN / 4];  // [row h][column 2i + e]
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h][2 * i] = S[4 * i + 2 * h];
      sc[h][2 * i + 1] = S[4 * i + 2 * h + 1];
    }
  if (mask.needs_mask(n)) {
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) mask.key_range(h, n, lo[h], hi[h]);
    // Each row's test on columns relative to this thread's first (2t), so that the column
    // compared is a constant. Causal rows (and every row whose window starts at or before the
    // block) have no left bound in the block: one compare per element instead of two.
    auto apply = [&](auto left_t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int l = lo[h] - 2 * t, r = hi[h] - 2 * t;
#pragma unroll
        for (int c = 0; c < kBN / 4; ++c) {
          const int col = (c / 2) * 8 + c % 2;
          if ((decltype(left_t)::value && col < l) || col > r) sc[h][c] = detail::kNegInf;
        }
      }
    };
    if (lo[0] <= 0 && lo[1] <= 0)
      apply(std::false_type{});
    else
      apply(std::true_type{});
  }
  softmax.template update<kBN / 4, kExpOffset>(sc, scale_log2, rescale, row_off);
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      S[4 * i + 2 * h] = sc[h][2 * i];
      S[4 * i + 2 * h + 1] = sc[h][2 * i + 1];
    }
}

/// The same step with BlockInfo's mask evaluated per key block for the rows row_of(0 / 1).
template <class Traits, int kBN, int kExpOffset = 0, class Info, class RowOf>
__device__ __forceinline__ void softmax_step(const FwdParams& p, const Info& bi,
                                             common::RowSoftmax<2>& softmax, float scale_log2,
                                             float (&S)[kBN / 2], int n, const RowOf& row_of,
                                             int t, float (&rescale)[2],
                                             const float* row_off = nullptr) {
  struct InfoMask {
    const FwdParams& p;
    const Info& bi;
    const RowOf& row_of;
    __device__ bool needs_mask(int n) const { return bi.needs_mask(p, n, Traits::kMasked); }
    __device__ void key_range(int h, int n, int& lo, int& hi) const {
      bi.key_range(p, row_of(h), int64_t(n) * kBN, Traits::kMasked, lo, hi);
    }
  };
  softmax_step<kBN, kExpOffset>(InfoMask{p, bi, row_of}, softmax, scale_log2, S, n, t, rescale,
                                row_off);
}

/// Probabilities -> P V's A fragments: the C fragment of two 8-key score tiles (wgmma order
/// 8kk .. 8kk + 7) is the A fragment of one 16-key step.
template <DType kDT, int kBN>
__device__ __forceinline__ void pack_p(const float (&S)[kBN / 2], uint32_t (&P)[kBN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) {
    P[kk][0] = pack2<kDT>(S[8 * kk], S[8 * kk + 1]);
    P[kk][1] = pack2<kDT>(S[8 * kk + 2], S[8 * kk + 3]);
    P[kk][2] = pack2<kDT>(S[8 * kk + 4], S[8 * kk + 5]);
    P[kk][3] = pack2<kDT>(S[8 * kk + 6], S[8 * kk + 7]);
  }
}

/// O's rows times the softmax step's factors.
template <int kHD>
__device__ __forceinline__ void rescale_o(float (&O)[kHD / 2], const float (&rescale)[2]) {
#pragma unroll
  for (int i = 0; i < kHD / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      O[4 * i + 2 * h] *= rescale[h];
      O[4 * i + 2 * h + 1] *= rescale[h];
    }
}

/// Split-K epilogue: the warp's rows of O (normalised) and their softmax states into the
/// split's fp32 partials (common::FwdEpilogue), walked in wgmma order.
template <class Traits, class Info, class RowOf>
__device__ __forceinline__ void write_split(const FwdParams& p, const Info& bi,
                                            const float (&O)[Traits::kHeadDim / 2],
                                            const common::RowSoftmax<2>& softmax,
                                            const RowOf& row_of, int t) {
  const common::FwdEpilogue<Traits, Info> ep(p, bi);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row_of(h);
    if (row >= bi.len_q) continue;
    const auto out = ep.row(row, 2 * t);
    const float inv = softmax.inv_sum(h);
#pragma unroll
    for (int i = 0; i < Traits::kHeadDim / 8; ++i)
      out.put(8 * i, {O[4 * i + 2 * h] * inv, O[4 * i + 2 * h + 1] * inv});
    if (t == 0) out.stat(softmax.state(h));
  }
}

/// The warp's rows of O, normalised, and their LSEs into the staged tile (common::StagedTile;
/// the warp's rows start at srow0 = 16 warp + g), walked in wgmma order. The caller syncs
/// before (the tile's smem is free) and after (all staged).
template <int kHD, class Tile>
__device__ __forceinline__ void stage_rows(const Tile& tile, const float (&O)[kHD / 2],
                                           const common::RowSoftmax<2>& softmax, int srow0,
                                           int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = softmax.inv_sum(h);
    const int srow = srow0 + h * 8;
    tile.lse(srow, softmax.lse(h));
#pragma unroll
    for (int i = 0; i < kHD / 8; ++i)
      tile.put2(srow, i, 2 * t, O[4 * i + 2 * h] * inv, O[4 * i + 2 * h + 1] * inv);
  }
}

#endif  // HIPFLASH_HAS_WGMMA

}  // namespace hipflash::atom::sm90::consumer
