// hipflash — the gfx950 "dualwave" forward kernel: 256-row blocks of eight waves, two waves per
// SIMD, MFMA 32x32x16, lazy rescaling. COMPILE-CHECKED ONLY (Debian's clang 22, gfx950): no AMD
// GPU has run it; its portable half (dualwave_schedule.hpp) runs in tests/cpp/test_dualwave.cpp.
//
// One wave owns 32 query rows and computes, per 64-key block,
//   S^T = K Q^T   (A = K from LDS, B = Q held in registers: two 32x32 tiles, keys 0-31, 32-63)
//   O^T += V^T P^T (A = V^T by transposed LDS reads, B = P^T straight from the S^T accumulators)
// so that lane l owns query row l % 32 throughout: its scores, its running (m, l), its output
// columns. The row max and sum need one lane-pair swap (l, l ^ 32); rescaling the output is a
// per-lane multiply, and with the lazy rule it is skipped for most key blocks. P never leaves
// the registers. K and V tiles are double-buffered in padded LDS, loaded by the whole block
// (registers -> LDS) one key block ahead; one barrier per key block. Two waves share each SIMD:
// the MFMA bursts run at raised issue priority, so that one wave's matrix work keeps the pipe
// busy while the other wave's softmax (exp, max, sum: VALU) runs, and each MFMA is scheduled
// with the LDS reads of its operand (sched_group_barrier). Not done (yet): the upstream design's
// staggered start of the second wave group, and its softmax pipelined across key blocks
// (the exps of one block under the MFMAs of the next) — docs/design-decisions.md#amd-gfx950.
#pragma once

#include "atoms/gfx950.hpp"
#include "common/element.hpp"
#include "common/epilogue.hpp"
#include "common/scheduler.hpp"
#include "gfx950/dualwave_schedule.hpp"
#include "hipflash/detail/kernel_traits.hpp"
#include "hipflash/params.hpp"

namespace hipflash::gfx950 {

#if defined(HIPFLASH_IS_GFX950)

using namespace ::hipflash::atom::gfx950;  // the atom this body is written in

/// Block-wide copy of one 64-key tile of K or V (rows >= len zero, columns >= head_dim zero)
/// through registers: `fetch` issues the global loads, `store` writes them to a padded LDS tile.
template <class Cfg, class T>
struct TileStager {
  static constexpr int kChunks = Cfg::kHeadDim / 8;  ///< 16-byte chunks per row
  static constexpr int kPerThread = Cfg::kBlockN * kChunks / Cfg::kThreads;
  static_assert(Cfg::kBlockN * kChunks % Cfg::kThreads == 0, "whole chunks per thread");
  uint4 regs[kPerThread];

  template <class Rows>
  __device__ __forceinline__ void fetch(const Rows& src, int64_t row0, int64_t len, int head_dim) {
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int idx = int(threadIdx.x) + c * Cfg::kThreads;
      const int r = idx / kChunks, ch = idx % kChunks;
      regs[c] = row0 + r < len && ch * 8 < head_dim
                    ? *reinterpret_cast<const uint4*>(src.row(row0 + r) + ch * 8)
                    : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void store(T* lds) const {
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int idx = int(threadIdx.x) + c * Cfg::kThreads;
      const int r = idx / kChunks, ch = idx % kChunks;
      *reinterpret_cast<uint4*>(lds + r * Cfg::kPitch + ch * 8) = regs[c];
    }
  }
};

template <class Traits>
__device__ __forceinline__ void fwd_block(const FwdParams& p, int64_t tile, int num_m_blocks) {
  using Cfg = DualwaveTile<Traits::kHeadDim>;
  using T = common::element_t<Traits::kDType>;
  constexpr DType kDT = Traits::kDType;
  static_assert(Traits::kKvDType == Traits::kDType, "q, k and v of one element type (for now)");
  using F8 = frag8_t<kDT>;
  using E = frag_elem_t<kDT>;  // the fragments' element type
  constexpr int kD = Cfg::kHeadDim, kDSteps = kD / 16, kDChunks = kD / 32;

  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);          // [stage][64][kPitch]
  T* sV = sK + Cfg::kStages * Cfg::kSmemTile;      // [stage][64][kPitch]

  const int lane = int(threadIdx.x) % 64, wave = int(threadIdx.x) / 64;
  const int qi = lane % 32, g = lane / 32;  // this lane's query row in the wave, its k-group
  const Info bi(p, tile, num_m_blocks, Traits::kMasked);
  const int64_t m0 = int64_t(bi.m_block) * Cfg::kBlockM;
  if (common::block_past_sequence<Traits, Cfg::kBlockM, Cfg::kThreads>(p, bi.b, bi.h, m0, bi.len_q))
    return;  // past this varlen sequence
  const int hd = int(p.head_dim);
  const auto q_src = bi.template q_source<T>(p);
  const auto k_src = bi.template k_source<T>(p);
  const auto v_src = bi.template v_source<T>(p);
  const WaveWalk walk = WaveWalk::of(p, bi, m0, wave, Traits::kMasked);
  const int64_t row = walk.r0 + qi;  // this lane's query row of the sequence

  // Q^T as the B operand, held for the whole loop: b[e] = Q[row][16 ks + 8 g + e].
  F8 qf[kDSteps];
#pragma unroll
  for (int ks = 0; ks < kDSteps; ++ks) {
    const int col = 16 * ks + 8 * g;
    if (row < bi.len_q && col < hd) {
      qf[ks] = *reinterpret_cast<const F8*>(q_src.row(row) + col);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[ks][e] = E(0.f);
    }
  }

  f32x16 O[kDChunks];  // O^T: O[dc][j] = O[row][32 dc + 8 (j / 4) + 4 g + j % 4]
#pragma unroll
  for (int dc = 0; dc < kDChunks; ++dc)
#pragma unroll
    for (int j = 0; j < 16; ++j) O[dc][j] = 0.f;
  float m = detail::kNegInf;  // the row's reference max (lazy, base 2)
  float l = 0.f;              // this lane's part of the row sum (its 32 keys of each block)
  const float scale_log2 = p.softmax_scale * detail::kLog2e;

  TileStager<Cfg, T> k_stage, v_stage;
  const int n_hi = bi.n_block_max - 1, n_lo = bi.n_block_min;
  if (n_hi >= n_lo) {
    k_stage.fetch(k_src, int64_t(n_hi) * Cfg::kBlockN, bi.len_k, hd);
    v_stage.fetch(v_src, int64_t(n_hi) * Cfg::kBlockN, bi.len_k, hd);
    k_stage.store(sK);
    v_stage.store(sV);
  }
  __syncthreads();

  for (int n = n_hi, it = 0; n >= n_lo; --n, ++it) {
    const int stage = it % 2;
    const T* tK = sK + stage * Cfg::kSmemTile;
    const T* tV = sV + stage * Cfg::kSmemTile;
    if (n > n_lo) {  // the next key block's loads fly under this block's compute
      k_stage.fetch(k_src, int64_t(n - 1) * Cfg::kBlockN, bi.len_k, hd);
      v_stage.fetch(v_src, int64_t(n - 1) * Cfg::kBlockN, bi.len_k, hd);
    }
    if (walk.visits(n)) {
      // ---- S^T = K Q^T: S[h][j] = s(row, key 32 h + 8 (j / 4) + 4 g + j % 4) ----
      f32x16 S[2];
      __builtin_amdgcn_s_setprio(1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 16; ++j) S[h][j] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kDSteps; ++ks)
          S[h] = mfma32<kDT>(lds_frag8<kDT>(tK + (32 * h + qi) * Cfg::kPitch + 16 * ks + 8 * g),
                             qf[ks], S[h]);
      }
      // Interleave: each K fragment read issues one MFMA ahead of its use.
#pragma unroll
      for (int i = 0; i < 2 * kDSteps; ++i) {
        HIPFLASH_SCHED_GROUP(kSchedDsRead, 1);
        HIPFLASH_SCHED_GROUP(kSchedMfma, 1);
      }
      __builtin_amdgcn_s_setprio(0);
      const int64_t n0 = int64_t(n) * Cfg::kBlockN;
      if (walk.needs_mask(p, bi, n, Traits::kMasked)) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int64_t key = n0 + 32 * h + 8 * (j / 4) + 4 * g + j % 4;
            if (!Info::key_valid(p, row, key, bi.len_k, bi.diag, Traits::kMasked))
              S[h][j] = detail::kNegInf;
          }
      }
      // ---- Row max over the block (the lane's 32 keys, then its pair's), the lazy rule ----
      float mx = detail::kNegInf;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) mx = fmaxf(mx, S[h][j]);
      mx = pair_max(mx);
      const LazyMax lz = lazy_max(m, mx * scale_log2);
      if (__any(lz.grew)) {  // wave-uniform: rare after the first key blocks
        l *= lz.scale;
#pragma unroll
        for (int dc = 0; dc < kDChunks; ++dc)
#pragma unroll
          for (int j = 0; j < 16; ++j) O[dc][j] *= lz.scale;
      }
      m = lz.m;
      // ---- P = 2^(x - m) in fp32 (sum) and in the input dtype (the B operand of P V) ----
      const float m_use = detail::SoftmaxState::safe_max(m);
      F8 P[4];  // k-step s (16 keys): P[s][e] = P(row, key 16 s + 8 (e / 4) + 4 g + e % 4)
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float pv = __builtin_amdgcn_exp2f(fmaf(S[s / 2][8 * (s % 2) + e], scale_log2, -m_use));
          l += pv;
          P[s][e] = E(pv);
        }
      // ---- O^T += V^T P^T: A = V^T read transposed, a[e] = V[key(s, g, e)][32 dc + lane % 32] ----
      __builtin_amdgcn_s_setprio(1);
      const int grp = lane / 16, li = lane % 16;
#pragma unroll
      for (int dc = 0; dc < kDChunks; ++dc)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const T* v = tV + (16 * s + 4 * (grp / 2) + li / 4) * Cfg::kPitch + 32 * dc +
                       16 * (grp % 2) + 4 * (li % 4);
          const auto lo = lds_read_tr<kDT>(v), hi = lds_read_tr<kDT>(v + 8 * Cfg::kPitch);
          const F8 a = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
          O[dc] = mfma32<kDT>(a, P[s], O[dc]);
        }
      // Interleave: the two transposed reads of a V operand, then its MFMA.
#pragma unroll
      for (int i = 0; i < 4 * kDChunks; ++i) {
        HIPFLASH_SCHED_GROUP(kSchedDsRead, 2);
        HIPFLASH_SCHED_GROUP(kSchedMfma, 1);
      }
      __builtin_amdgcn_s_setprio(0);
    }
    if (n > n_lo) {  // the other stage was read last in the previous block, before its barrier
      k_stage.store(sK + (1 - stage) * Cfg::kSmemTile);
      v_stage.store(sV + (1 - stage) * Cfg::kSmemTile);
    }
    __syncthreads();
  }

  // ---- Epilogue (common/epilogue.hpp): the row's (m, l) complete across the lane pair ----
  l = pair_sum(l);
  const float inv = detail::SoftmaxState::inv_sum(l);
  const common::FwdEpilogue<Traits, Info> ep(p, bi);
  if (row < bi.len_q) {
    const auto out = ep.row(row, 4 * g);
#pragma unroll
    for (int dc = 0; dc < kDChunks; ++dc)
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) {  // dims 32 dc + 8 q4 + 4 g + 0..3
        // Head dims 32 and 96 run the 64 and 128 tiles: past head_dim a split's partial
        // columns are zeros (O's there are not); out's are not written.
        const int col = 32 * dc + 8 * q4;
        const float f = col < hd ? inv : 0.f;
        out.put(col, {O[dc][4 * q4] * f, O[dc][4 * q4 + 1] * f, O[dc][4 * q4 + 2] * f,
                      O[dc][4 * q4 + 3] * f});
      }
    if (g == 0) out.stat(detail::SoftmaxState{m, l});
  }
  ep.template finish<Cfg::kBlockM, Cfg::kThreads>(m0);
}

#endif  // HIPFLASH_IS_GFX950

/// The map from the launch grid to work tiles; the launcher sizes the grid with it too.
using Scheduler = common::StaticScheduler;

/// The gfx950 dualwave forward kernel: one 512-thread block per (256-row query block, split,
/// head, batch). Other targets compile a trapping stub (the selector never picks it there).
/// __launch_bounds__' second argument on AMD: at least two waves per SIMD (EU), i.e. at most 256
/// registers (VGPRs + AGPRs) per lane — the "dual wave" of the schedule.
template <class Traits>
__global__ void __launch_bounds__(DualwaveTile<Traits::kHeadDim>::kThreads, 2)
    fwd_dualwave_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p, int num_m_blocks) {
#if defined(HIPFLASH_IS_GFX950)
  Scheduler::run([&](int64_t tile) { fwd_block<Traits>(p, tile, num_m_blocks); });
#else
  port::trap();  // the dualwave schedule needs gfx950's MFMA 32x32x16 and transposed LDS reads
#endif  // HIPFLASH_IS_GFX950
}

}  // namespace hipflash::gfx950
