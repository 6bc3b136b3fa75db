// hipflash — the portable backward kernels (plain fp32 FMAs, any warp size): the AMD path today
// (COMPILE-CHECKED ONLY: no AMD GPU runs it) and, behind HIPFLASH_BWD_PORTABLE=1, a second
// GPU implementation on NVIDIA that the tests compare with the matrix-core one.
//
// Both passes work on 16 x 16 (query row, key) tiles with P recomputed from the saved LSE:
//   P = exp2(s * scale * log2e - lse_log2),  dS = P * (dP - delta),  dP = dO V^T,
// masked pairs (window, keys past the sequence) give P = dS = 0 by a select, so NaN never
// leaks through a multiplication by zero. Operand tiles live in shared memory as raw words,
// rows padded by one 32-bit word so that the sixteen rows of a column sit in distinct banks.
//
// bwd_dkdv_portable_kernel: a block owns 16 keys of one (batch, kv head) and walks every query
// row that sees them, for each query head of the group (so dk / dv need no reduction across
// blocks and are deterministic), accumulating dV += P^T dO and dK += dS^T Q in registers.
// bwd_dq_portable_kernel: a block owns 16 query rows and walks their key blocks in order,
// dQ += dS K in registers. The portable path is always deterministic (no atomic dq: on AMD its
// extra live state spilled scalar registers, and the path exists for correctness, not speed).
#pragma once

#include "bwd/bwd_block_info.hpp"
#include "bwd/bwd_score_mods.hpp"
#include "common/block_info.hpp"
#include "common/words.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::bwd {

template <int kHeadDim_>
struct PortableTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 16, kBlockN = 16, kThreads = 256;
  static constexpr int kPitch = kHeadDim + 2;       ///< words per shared-memory row
  static constexpr int kAcc = kHeadDim / 16;        ///< head-dim columns per thread
  static_assert(kBlockM * kBlockN == kThreads, "one thread per (row, key) pair");
};

/// The shared-memory tiles and the scores step both kernels share.
template <class Traits>
struct PortableStep {
  using Tile = PortableTile<Traits::kHeadDim>;
  using B = common::Bits<Traits::kDType>;
  using W = typename B::word;
  static constexpr int kBM = Tile::kBlockM, kBN = Tile::kBlockN, kP = Tile::kPitch;

  W q[kBM * kP], dout[kBM * kP], k[kBN * kP], v[kBN * kP];
  float p[kBM][kBN + 1], ds[kBM][kBN + 1];
  float lse2[kBM], delta[kBM];

  /// Rows [row0, row0 + n) of a [len, D] operand into `dst`; rows past len and columns past
  /// head_dim are zero. 16-byte pieces, the block's threads striding over them.
  __device__ __forceinline__ static void load_rows(W* dst, const W* src, int64_t ld,
                                                   int64_t row0, int64_t len, int n,
                                                   int head_dim) {
    constexpr int kPieces = Tile::kHeadDim / 8;
    for (int i = int(threadIdx.x); i < n * kPieces; i += Tile::kThreads) {
      const int r = i / kPieces, c = (i % kPieces) * 8;
      W w[8] = {};
      if (row0 + r < len && c < head_dim) common::load_words<W, 8>(src + (row0 + r) * ld + c, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[r * kP + c + e] = w[e];
    }
  }

  /// lse_log2 and delta of rows [row0, row0 + kBM) of (b, h) (the workspace is padded).
  __device__ __forceinline__ void load_row_stats(const BwdParams& prm, int64_t b, int64_t h,
                                                 int64_t row0) {
    if (threadIdx.x < kBM) {
      const int64_t ws = prm.ws_row(b, h, row0 + threadIdx.x);
      lse2[threadIdx.x] = prm.lse_log2[ws];
      delta[threadIdx.x] = prm.delta[ws];
    }
  }

  /// Thread (row qi, key kj): P and dS of the pair into p / ds. `valid`: the mask's verdict;
  /// `dist`: the row's distance from the key (i + diag - j, for ALiBi).
  __device__ __forceinline__ void scores(int qi, int kj, bool valid, const ScoreMods& mods,
                                         int64_t dist) {
    float s = 0.f, dp = 0.f;
#pragma unroll 4
    for (int d = 0; d < Tile::kHeadDim; ++d) {
      s += B::to_float(q[qi * kP + d]) * B::to_float(k[kj * kP + d]);
      dp += B::to_float(dout[qi * kP + d]) * B::to_float(v[kj * kP + d]);
    }
    float slope = 1.f;  // d(the score the softmax saw) / d(s): the cap's 1 - tanh^2
    if constexpr (kBwdScoreMods) s = mods.apply(s, float(dist), slope);
    const float pr = valid ? exp2f(s * mods.scale_log2 - lse2[qi]) : 0.f;
    p[qi][kj] = pr;
    ds[qi][kj] = valid ? pr * (dp - delta[qi]) * slope : 0.f;
  }
};

template <class Traits>
__global__ void __launch_bounds__(PortableTile<Traits::kHeadDim>::kThreads)
    bwd_dkdv_portable_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_n_blocks) {
  using Step = PortableStep<Traits>;
  using Tile = typename Step::Tile;
  using B = typename Step::B;
  using W = typename Step::W;
  constexpr int kBM = Tile::kBlockM, kBN = Tile::kBlockN, kP = Tile::kPitch, kAcc = Tile::kAcc;
  __shared__ Step sm;

  const KeyBlock kb(p, blockIdx.x, num_n_blocks, KeyOrder::kFastest, kBN, kBM, /*clamp=*/false);
  if (kb.past_keys()) return;  // past this varlen sequence's keys
  const int64_t hk = kb.hk, b = kb.b, n0 = kb.n0, groups = kb.groups;
  const SeqBounds& seq = kb.seq;
  const int hd = int(p.head_dim);

  const W* k = k_rows<W>(p, b, seq.k_start, hk);
  const W* v = v_rows<W>(p, b, seq.k_start, hk);
  Step::load_rows(sm.k, k, p.k_row_stride, n0, seq.len_k, kBN, hd);
  Step::load_rows(sm.v, v, p.v_row_stride, n0, seq.len_k, kBN, hd);

  // Thread roles: scores (qi, kj) = (t / 16, t % 16); accumulation (key kj, columns c0 + 16 e).
  const int t = int(threadIdx.x), qi = t / kBN, kj = t % kBN;
  const int acc_key = t / 16, c0 = t % 16;
  float dk[kAcc] = {}, dv[kAcc] = {};

  for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) {
    const W* q = q_rows<W>(p, b, seq.q_start, h);
    const W* dout = dout_rows<W>(p, b, seq.q_start, h);
    const ScoreMods mods = kBwdScoreMods ? ScoreMods::of(p, b, h) : ScoreMods::plain(p);
    for (int64_t m0 = kb.row_lo; m0 < kb.row_hi; m0 += kBM) {
      __syncthreads();  // the previous step is done with q, dout, p, ds
      Step::load_rows(sm.q, q, p.q_row_stride, m0, seq.len_q, kBM, hd);
      Step::load_rows(sm.dout, dout, p.do_row_stride, m0, seq.len_q, kBM, hd);
      sm.load_row_stats(p, b, h, m0);
      __syncthreads();
      const bool valid = m0 + qi < seq.len_q &&
                         common::BlockInfo<kBM, kBN>::key_valid(p, m0 + qi, n0 + kj, seq.len_k,
                                                                seq.diag, Traits::kMasked);
      sm.scores(qi, kj, valid, mods, m0 + qi + seq.diag - (n0 + kj));
      __syncthreads();
      // Rows one at a time (not unrolled: the accumulators are the only live state).
      for (int r = 0; r < kBM; ++r) {
        const float pr = sm.p[r][acc_key], dsr = sm.ds[r][acc_key];
#pragma unroll
        for (int e = 0; e < kAcc; ++e) {
          dv[e] += pr * B::to_float(sm.dout[r * kP + c0 + 16 * e]);
          dk[e] += dsr * B::to_float(sm.q[r * kP + c0 + 16 * e]);
        }
      }
    }
  }

  // dk = scale * dS^T Q, dv = P^T dO, for this block's keys of the sequence.
  const int64_t j = n0 + acc_key;
  if (j >= seq.len_k) return;
  W* dk_row = dk_rows<W>(p, b, seq.k_start, hk) + j * p.dk_row_stride;
  W* dv_row = dv_rows<W>(p, b, seq.k_start, hk) + j * p.dv_row_stride;
#pragma unroll
  for (int e = 0; e < kAcc; ++e) {
    const int d = c0 + 16 * e;
    if (d >= hd) continue;
    dk_row[d] = B::from_float(dk[e] * p.softmax_scale);
    dv_row[d] = B::from_float(dv[e]);
  }
}

template <class Traits>
__global__ void __launch_bounds__(PortableTile<Traits::kHeadDim>::kThreads)
    bwd_dq_portable_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int num_m_blocks) {
  using Step = PortableStep<Traits>;
  using Tile = typename Step::Tile;
  using B = typename Step::B;
  using W = typename Step::W;
  constexpr int kBM = Tile::kBlockM, kBN = Tile::kBlockN, kP = Tile::kPitch, kAcc = Tile::kAcc;
  __shared__ Step sm;

  // Which (query block, head, batch), its sequence bounds and its key blocks (in order).
  const common::BlockInfo<kBM, kBN> bi(p, blockIdx.x, num_m_blocks, false);
  const int64_t m0 = int64_t(bi.m_block) * kBM;
  if (m0 >= bi.len_q) return;
  const int hd = int(p.head_dim);
  const ScoreMods mods = kBwdScoreMods ? ScoreMods::of(p, bi.b, bi.h) : ScoreMods::plain(p);

  const W* q = q_rows<W>(p, bi.b, bi.q_start, bi.h);
  const W* dout = dout_rows<W>(p, bi.b, bi.q_start, bi.h);
  const W* k = k_rows<W>(p, bi.b, bi.k_start, bi.h_kv);
  const W* v = v_rows<W>(p, bi.b, bi.k_start, bi.h_kv);
  Step::load_rows(sm.q, q, p.q_row_stride, m0, bi.len_q, kBM, hd);
  Step::load_rows(sm.dout, dout, p.do_row_stride, m0, bi.len_q, kBM, hd);
  sm.load_row_stats(p, bi.b, bi.h, m0);

  const int t = int(threadIdx.x), qi = t / kBN, kj = t % kBN;
  float dq[kAcc] = {};  // thread (qi, kj): columns kj + 16 e of row qi
  for (int n = bi.n_block_min; n < bi.n_block_max; ++n) {
    const int64_t n0 = int64_t(n) * kBN;
    __syncthreads();  // the previous step is done with k, v, ds
    Step::load_rows(sm.k, k, p.k_row_stride, n0, bi.len_k, kBN, hd);
    Step::load_rows(sm.v, v, p.v_row_stride, n0, bi.len_k, kBN, hd);
    __syncthreads();
    const bool valid = m0 + qi < bi.len_q &&
                       common::BlockInfo<kBM, kBN>::key_valid(p, m0 + qi, n0 + kj, bi.len_k,
                                                              bi.diag, Traits::kMasked);
    sm.scores(qi, kj, valid, mods, m0 + qi + bi.diag - (n0 + kj));
    __syncthreads();
    for (int c = 0; c < kBN; ++c) {
      const float dsc = sm.ds[qi][c];
#pragma unroll
      for (int e = 0; e < kAcc; ++e) dq[e] += dsc * B::to_float(sm.k[c * kP + kj + 16 * e]);
    }
  }

  const int64_t row = m0 + qi;
  if (row >= bi.len_q) return;
  W* dq_row = dq_rows<W>(p, bi.b, bi.q_start, bi.h) + row * p.dq_row_stride;
#pragma unroll
  for (int e = 0; e < kAcc; ++e) {
    const int d = kj + 16 * e;
    if (d < hd) dq_row[d] = B::from_float(dq[e] * p.softmax_scale);
  }
}

}  // namespace hipflash::bwd
