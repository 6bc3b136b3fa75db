// hipflash — the portable half of the gfx950 "dualwave" schedule: its tile, the key blocks each
// wave visits, and the lazy-rescale rule of its online softmax. Host and device code: the
// gfx950 kernel (fwd_dualwave_kernel.hpp) runs it on MFMA atoms, and the host test
// (tests/cpp/test_dualwave.cpp) runs the same schedule with scalar arithmetic against the fp64
// reference — the only way it executes until an MI350 is reachable.
//
// The schedule (after ROCm/FlyDSL's gfx950 attention kernel, written anew): a thread block owns
// 256 query rows of one (batch, head, split) and walks 64-key blocks; eight waves of 64 lanes
// own 32 rows each, two waves per SIMD, so that one wave's softmax (VALU, exp) runs while the
// other wave's MFMAs do. K and V are double-buffered in padded LDS and shared by the eight waves.
#pragma once

#include <cstdint>

#include "common/block_info.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"

namespace hipflash::gfx950 {

/// The dualwave tile for padded head dim 64 or 128.
template <int kHeadDim_>
struct DualwaveTile {
  static_assert(kHeadDim_ == 64 || kHeadDim_ == 128, "dualwave: head dims 64 and 128");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 256;   ///< query rows per block
  static constexpr int kWaves = 8;      ///< two per SIMD
  static constexpr int kWaveRows = 32;  ///< one 32x32 MFMA row tile per wave
  static constexpr int kBlockN = 64;    ///< keys per block
  static constexpr int kThreads = kWaves * 64;
  static constexpr int kStages = 2;     ///< K/V double buffer
  /// Padded LDS row of K and V (elements): the 16-byte pad staggers rows over the banks.
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kSmemTile = kBlockN * kPitch;  ///< elements of one K or V tile
  static constexpr int kSmemBytes = kStages * 2 * kSmemTile * 2;
  static_assert(kWaves * kWaveRows == kBlockM, "the waves cover the block's rows");
};

using Info = common::BlockInfo<256, 64>;

/// The key blocks one wave visits: the block's range narrowed to the wave's 32 rows. Under a
/// causal or sliding-window mask the waves at the two ends of a 256-row block see fewer key
/// blocks than the block as a whole; a wave outside its range skips the block's compute (it
/// still takes part in the block's loads and barriers).
struct WaveWalk {
  int n_min = 0, n_max = 0;  ///< key blocks [n_min, n_max) the wave computes
  int64_t r0 = 0, r1 = 0;    ///< the wave's rows [r0, r1) of its sequence (r1 <= len_q)

  HIPFLASH_HD static WaveWalk of(const FwdParams& p, const Info& bi, int64_t m0, int wave,
                                 bool masked) {
    constexpr int kBN = 64;
    WaveWalk w;
    w.r0 = m0 + int64_t(wave) * 32;
    w.r1 = w.r0 + 32 < bi.len_q ? w.r0 + 32 : bi.len_q;
    w.n_min = w.n_max = bi.n_block_min;
    if (w.r1 <= w.r0) return w;  // the wave's rows are all past the sequence
    int64_t lo = 0, hi = bi.len_k;
    if (masked && p.window_left >= 0) lo = w.r0 + bi.diag - p.window_left;
    if (masked && p.window_right >= 0) hi = (w.r1 - 1) + bi.diag + p.window_right + 1;
    lo = lo < 0 ? 0 : lo;
    hi = hi > bi.len_k ? bi.len_k : hi;
    if (hi <= lo) return w;  // no row of the wave sees a key
    const int n_lo = int(lo / kBN), n_hi = int((hi + kBN - 1) / kBN);
    w.n_min = n_lo > bi.n_block_min ? n_lo : bi.n_block_min;
    w.n_max = n_hi < bi.n_block_max ? n_hi : bi.n_block_max;
    if (w.n_max < w.n_min) w.n_max = w.n_min;
    return w;
  }

  HIPFLASH_HD bool visits(int n) const { return n >= n_min && n < n_max; }

  /// Whether key block n needs the per-element mask for this wave's rows.
  HIPFLASH_HD bool needs_mask(const FwdParams& p, const Info& bi, int n, bool masked) const {
    const int64_t n0 = int64_t(n) * 64;
    if (n0 + 64 > bi.len_k) return true;
    if (!masked) return false;
    if (p.window_left >= 0 && n0 < (r1 - 1) + bi.diag - p.window_left) return true;
    if (p.window_right >= 0 && n0 + 63 > r0 + bi.diag + p.window_right) return true;
    return false;
  }
};

/// Lazy rescaling. Each row keeps a reference max m (base 2) that may trail its running max by
/// up to kLazyThreshold; a key block whose max stays within it leaves m — and the row's output
/// accumulator — as they are, its probabilities 2^(x - m) being at most 2^kLazyThreshold
/// (harmless in fp32, and exact in bf16/f16 up to the usual rounding). The (m, l) pair is still a
/// SoftmaxState (l = sum 2^(x - m) holds for any m), so the LSE, the split partials and the
/// combine need nothing special. The wave rescales its accumulator only when some row's max
/// grew past the threshold, which after the first key blocks is rare.
inline constexpr float kLazyThreshold = 8.f;

struct LazyMax {
  float m;     ///< the row's reference max after this key block
  float scale; ///< factor for the row's l and output accumulator (1 when m stays)
  bool grew;   ///< whether m moved (then the wave must rescale its accumulator)
};

/// `m`: the row's reference max so far (-inf before its first valid key); `x_max`: the block's
/// max of x = s * scale * log2(e) over the row's valid keys (-inf if none; NaN scores are
/// ignored by the max and reach l through their own 2^(NaN - m)).
HIPFLASH_HD LazyMax lazy_max(float m, float x_max) {
  if (x_max > m + kLazyThreshold)  // also the first valid key: m + 8 == -inf
    return {x_max, detail::SoftmaxState::rescale(m, x_max), true};
  return {m, 1.f, false};
}

}  // namespace hipflash::gfx950
