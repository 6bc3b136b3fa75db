// hipflash — the forward's score modifiers (SPEC §3: the softcap, then ALiBi's bias) as the
// backward kernels recompute them: the portable kernels (bwd_portable_kernel.hpp) and the
// warp-specialised Hopper dk/dv pass's score-modifier instantiation (bwd_sm90_ws_kernel.hpp).
#pragma once

#include "hipflash/bwd_params.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::bwd {

/// Whether the backward kernels apply the softcap and ALiBi: on NVIDIA GPUs. AMD GPUs refuse
/// both (the launcher, as their forward does): reading them for every head kept more kernel
/// arguments in scalar registers through the dk/dv walk, which spilled on gfx942 / gfx950.
#if defined(HIPFLASH_PLATFORM_NVIDIA)
inline constexpr bool kBwdScoreMods = true;
#else
inline constexpr bool kBwdScoreMods = false;
#endif

/// The forward's score modifiers (SPEC §3) for one (batch, query head), recomputed as the
/// forward kernels apply them (common::ScoreCap, then common::ScoreBias): the capped score
/// tanh(s scale / cap) in units of the cap, then -(slope / unit) |i + diag - j|; the softmax's
/// scale_log2 takes the unit (the cap, or softmax_scale) back. Neither: s as it is.
struct ScoreMods {
  float scale_log2;  ///< of the (capped, biased) score: the unit times log2 e
  float cap_scale;   ///< softmax_scale / softcap; 0: no cap
  float bias_k;      ///< slope / unit; 0: no ALiBi

  /// No modifier: the plain scale.
  __device__ __forceinline__ static ScoreMods plain(const BwdParams& p) {
    return {p.softmax_scale * detail::kLog2e, 0.f, 0.f};
  }
  __device__ __forceinline__ static ScoreMods of(const BwdParams& p, int64_t b, int64_t h) {
    const float unit = p.softcap > 0.f ? p.softcap : p.softmax_scale;
    return {unit * detail::kLog2e, p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f,
            p.alibi_slopes ? p.alibi_slope(b, h) / unit : 0.f};
  }
  /// The modified score of s, and (slope) the cap's derivative 1 - tanh^2 (else left at 1);
  /// dist: the row's distance from the key's diagonal, i + diag - j (exact below 2^24).
  __device__ __forceinline__ float apply(float s, float dist, float& slope) const {
    if (cap_scale > 0.f) {
      const float t = detail::fast_tanh(s * cap_scale);
      s = t;
      slope = 1.f - t * t;
    }
    if (bias_k != 0.f) s = fmaf(-fabsf(dist), bias_k, s);
    return s;
  }
};

}  // namespace hipflash::bwd
