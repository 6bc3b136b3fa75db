// hipflash — shared by every forward schedule: the online softmax over one thread's score
// fragment, on top of the detail::SoftmaxState math (base 2, see its header).
//
// A thread holds kRows rows of the score tile; the lanes that share a row are reduced with
// butterflies over the atom's lane masks (`Lanes`): a quad for mma.sync and wgmma accumulators
// (rows g and g+8 of each 16-row tile, lanes 4g..4g+3), the four lanes of one query for the
// CDNA MFMA body's transposed scores (lanes i, i+16, i+32, i+48).
#pragma once

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::common {

using detail::kNegInf;
using detail::SoftmaxState;

/// The scores' softcap (SPEC §3, detail::Softcap) on a tile of raw q·k before the mask and the
/// online-softmax update: each becomes tanh(x * softmax_scale / softcap), and the update then
/// takes softcap * log2(e) as its scale (scale_log2), so that the capped score softcap * tanh
/// costs one multiply and one tanh an element. Every kernel masks after apply(), so a masked
/// score is -inf in the update; a raw -inf or +inf (infinite inputs) caps to -+softcap, as on
/// the CPU. softcap <= 0: nothing. One uniform branch a key block.
struct ScoreCap {
  float scale;    ///< softmax_scale / softcap
  float softcap;  ///< 0: off

  __device__ __forceinline__ explicit ScoreCap(const FwdParams& p)
      : scale(p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f), softcap(p.softcap) {}
  __device__ __forceinline__ bool on() const { return softcap > 0.f; }
  /// The scale_log2 RowSoftmax::update takes after apply(): softcap * log2(e), or the plain one.
  __device__ __forceinline__ float scale_log2(const FwdParams& p) const {
    return (on() ? softcap : p.softmax_scale) * detail::kLog2e;
  }
  template <int kN>
  __device__ __forceinline__ void apply(float (&s)[kN]) const {
    if (!on()) return;
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = detail::fast_tanh(s[i] * scale);
  }
  template <int kR, int kC>
  __device__ __forceinline__ void apply(float (&s)[kR][kC]) const {
    if (!on()) return;
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int c = 0; c < kC; ++c) s[r][c] = detail::fast_tanh(s[r][c] * scale);
  }
};

/// ALiBi (SPEC §3, FlashAttention 2's alibi_slopes) on a tile of scores after ScoreCap::apply,
/// in the units the update's scale multiplies: the bias -slope * |i + diag - j| becomes
/// -(slope / unit) * |d| with unit the softcap (capped) or softmax_scale, one add and one
/// fused multiply-add an element. A tile is one query head of one batch (its slope read and
/// divided once a tile, off the key loop's critical path), or — kMayPack, the decode kernels,
/// which alone take packed GQA decode calls with slopes (FwdParams::packs_gqa_decode) — in a
/// packed tile (FwdParams::gqa_packed_heads) a row per query head of the one query row: a
/// slope a row. The mask may come before or after (-inf stays -inf). No slopes: nothing, one
/// uniform branch.
template <bool kMayPack = false>
struct ScoreBias {
  const FwdParams& p;
  int64_t b, h;  ///< the tile's batch and head (a packed tile's kv head)
  float k_tile;  ///< the tile's slope / unit (0 without slopes), read once a tile

  __device__ __forceinline__ ScoreBias(const FwdParams& p_, int64_t b_, int64_t h_)
      : p(p_), b(b_), h(h_), k_tile(on() ? p.alibi_slope(b, h) / unit() : 0.f) {}
  __device__ __forceinline__ bool on() const { return p.alibi_slopes != nullptr; }
  __device__ __forceinline__ float unit() const {
    return p.softcap > 0.f ? p.softcap : p.softmax_scale;
  }
  /// Row `row`'s slope / unit (k: the tile's on entry) and the distance of its key col0 (d0).
  __device__ __forceinline__ void row(int64_t row, int64_t diag, int64_t col0, float& k,
                                      float& d0) const {
    d0 = float(row + diag - col0);  // exact below 2^24
    if constexpr (kMayPack) {
      if (const int64_t packed = p.gqa_packed_heads; packed > 0) {
        // query head h * packed + row, of the call's one query row (diag = len_k - packed)
        k = row < packed ? p.alibi_slope(b, h * packed + row) / unit() : 0.f;
        d0 = float(diag + packed - 1 - col0);
      }
    }
  }
  /// mma.sync order: s[r][c] is row_of(r)'s key col0 + 8 (c / 2) + c % 2 (diag = len_k -
  /// len_q, BlockInfo's).
  template <int kR, int kC, class RowOf>
  __device__ __forceinline__ void apply(float (&s)[kR][kC], const RowOf& row_of, int64_t diag,
                                        int64_t col0) const {
    if (!on()) return;
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      float k = k_tile, d0;
      row(int64_t(row_of(r)), diag, col0, k, d0);
#pragma unroll
      for (int c = 0; c < kC; ++c)
        s[r][c] = fmaf(-fabsf(d0 - float(8 * (c / 2) + c % 2)), k, s[r][c]);
    }
  }
  /// wgmma order (atoms/sm90/consumer.hpp): element 4i + 2h + e is row_of(h)'s key
  /// col0 + 8i + e.
  template <int kN, class RowOf>
  __device__ __forceinline__ void apply(float (&s)[kN], const RowOf& row_of, int64_t diag,
                                        int64_t col0) const {
    if (!on()) return;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float k = k_tile, d0;
      row(int64_t(row_of(hr)), diag, col0, k, d0);
#pragma unroll
      for (int i = 0; i < kN / 4; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          s[4 * i + 2 * hr + e] = fmaf(-fabsf(d0 - float(8 * i + e)), k, s[4 * i + 2 * hr + e]);
    }
  }
  /// wgmma order, split where the key block [key0, key0 + 2 kN) lies wholly on one side of the
  /// diagonal of every row of the warp (all but the diagonal blocks): about the thread's first
  /// row's diagonal c = row_of(0) + diag, -k |a - j| = ±k (j - c) ∓ k (a - c) (a = row + diag,
  /// + left of the diagonal), so each element takes the column part (one add; one multiply-add
  /// a column of two rows) and the row part goes to the online-softmax update as the row's
  /// offset `row_off` (RowSoftmax::update), a constant of the block. Blocks across a diagonal:
  /// the exact form above, row_off zero. No slopes: nothing, row_off zero.
  template <int kN, class RowOf>
  __device__ __forceinline__ void apply(float (&s)[kN], const RowOf& row_of, int64_t diag,
                                        int64_t col0, int64_t key0,
                                        float (&row_off)[2]) const {
    static_assert(!kMayPack, "a packed tile's rows have a slope each: the exact form");
    row_off[0] = row_off[1] = 0.f;
    if (!on()) return;
    const int64_t a0 = int64_t(row_of(0)) + diag, a1 = int64_t(row_of(1)) + diag;
    const int64_t key_last = key0 + 2 * kN - 1;  // a thread's kN scores span the block's keys
    const bool left = port::all_lanes(key_last <= (a0 < a1 ? a0 : a1));
    const bool right = port::all_lanes(key0 >= (a0 < a1 ? a1 : a0));
    if (!left && !right) {
      apply(s, row_of, diag, col0);
      return;
    }
    const float ks = left ? k_tile : -k_tile;
    const float at_col0 = ks * float(col0 - a0);  // exact distances below 2^24
    row_off[1] = -ks * float(a1 - a0);
#pragma unroll
    for (int i = 0; i < kN / 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float col = fmaf(ks, float(8 * i + e), at_col0);
        s[4 * i + e] += col;
        s[4 * i + 2 + e] += col;
      }
  }
};

/// The lanes that hold one row's columns, reduced with one butterfly per mask.
template <int... kMasks>
struct XorLanes {
  __device__ __forceinline__ static float max(float x) {
    ((x = fmaxf(x, port::shfl_xor(x, kMasks))), ...);
    return x;
  }
  __device__ __forceinline__ static float sum(float x) {
    ((x += port::shfl_xor(x, kMasks)), ...);
    return x;
  }
};
using QuadLanes = XorLanes<1, 2>;         ///< mma.sync / wgmma accumulators: 4 lanes per row
using QueryLanes64 = XorLanes<16, 32>;    ///< CDNA 16x16 MFMA, scores transposed: 4 lanes per query

template <int kRows, class Lanes = QuadLanes>
struct RowSoftmax {
  float m[kRows];  ///< running max, base-2 units (x = s * scale * log2 e)
  float l[kRows];  ///< running sum, partial over this thread's columns until finalize()

  __device__ __forceinline__ RowSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = kNegInf;
      l[r] = 0.f;
    }
  }

  /// scores[r][c] holds raw q·k (or -inf when masked). Turns them into probabilities
  /// 2^(x - m + kExpOffset), updates (m, l) and returns the factor rescaling each row's
  /// accumulator. kExpOffset (the fp8 forward's 8, FlashAttention 3's max offset) puts the
  /// probabilities in (0, 2^kExpOffset], where e4m3 keeps them from underflowing; l then
  /// carries the factor 2^kExpOffset too, which the caller takes out before finalize().
  /// row_off (optional): row r's scores are scores[r][c] + row_off[r] (ScoreBias's row part).
  template <int kCols, int kExpOffset = 0>
  __device__ __forceinline__ void update(float (&scores)[kRows][kCols], float scale_log2,
                                         float (&rescale)[kRows],
                                         const float* row_off = nullptr) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = kNegInf;
#pragma unroll
      for (int c = 0; c < kCols; ++c) mx = fmaxf(mx, scores[r][c]);
      mx = Lanes::max(mx);
      if (row_off) mx += row_off[r];
      const float m_new = fmaxf(m[r], mx * scale_log2);  // scale > 0 (validated)
      rescale[r] = SoftmaxState::rescale(m[r], m_new);
      m[r] = m_new;
      const float m_use = SoftmaxState::safe_max(m_new) - float(kExpOffset);
      const float shift = row_off ? fmaf(row_off[r], scale_log2, -m_use) : -m_use;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        scores[r][c] = detail::fast_exp2(fmaf(scores[r][c], scale_log2, shift));
        sum += scores[r][c];
      }
      l[r] = l[r] * rescale[r] + sum;
    }
  }

  /// Completes the row sums across the row's lanes. Call once, after the last key block.
  __device__ __forceinline__ void finalize() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) l[r] = Lanes::sum(l[r]);
  }

  __device__ __forceinline__ float inv_sum(int r) const { return SoftmaxState::inv_sum(l[r]); }
  __device__ __forceinline__ float lse(int r) const { return SoftmaxState::lse_of(m[r], l[r]); }
  /// Row r's (m, l): what a split hands to the combine kernel.
  __device__ __forceinline__ SoftmaxState state(int r) const { return SoftmaxState{m[r], l[r]}; }
};

}  // namespace hipflash::common
