// hipflash — the online-softmax state, shared by every forward kernel, the split-K combine
// kernel and the CPU backend.
//
// Log base: 2. A row's scores enter as x = s * softmax_scale * log2(e), so exp(s*scale) = 2^x.
//   m = running max of x,  l = sum of 2^(x - m).
// The natural-log LSE of SPEC §3 is  lse = (m + log2(l)) * ln(2), and -inf when l == 0
// (no valid key): set explicitly, never obtained from log(0) under fast math.
//
// Non-finite scores (SPEC §3): the maxima ignore NaN (fmaxf), but a NaN score makes its
// 2^(x - m) NaN, so l turns NaN and stays NaN through every rescale and merge; every test on l
// below is written so that NaN falls through to the arithmetic (l == 0 is "empty", anything
// else, NaN included, is "has keys"), never to the empty-row answer.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#include "hipflash/port/port.hpp"  // __host__ / __device__ / __forceinline__ on either vendor
#define HIPFLASH_HD __host__ __device__ __forceinline__
#else
#define HIPFLASH_HD inline
#endif

namespace hipflash::detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

HIPFLASH_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);  // ex2.approx under -use_fast_math; 2^-inf == 0
#else
  return std::exp2(x);
#endif
}

/// Logit soft-capping (FlashAttention 2's `softcap`, Gemma 2's attn_logit_softcapping): a row's
/// scaled score s = softmax_scale * q.k enters the softmax as cap * tanh(s / cap) when cap > 0
/// (as is when cap == 0), and the LSE is that of the capped scores. Its slope, for the
/// backward: d(capped) / ds = 1 - tanh^2(s / cap). NaN stays NaN; +-inf caps to +-cap.
/// tanh: the hardware's approximation on NVIDIA sm_75+ (tanh.approx.f32, ~2^-11 relative,
/// within the low-precision tolerance of SPEC §6), tanhf on other devices, std::tanh on the
/// host (the CPU backend: the reference).
HIPFLASH_HD float fast_tanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#elif defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

struct Softcap {
  float cap = 0.f;  ///< 0: off
  HIPFLASH_HD bool on() const { return cap > 0.f; }
  /// tanh(s / cap) (on() only).
  HIPFLASH_HD float tanh_of(float s) const { return fast_tanh(s / cap); }
  HIPFLASH_HD float apply(float s) const { return on() ? cap * tanh_of(s) : s; }
};

/// ALiBi (FlashAttention 2's alibi_slopes; BLOOM, MPT): the bias -slope * |diag - key| added to
/// a row's score of `key` after the softcap, diag = i + Sk - Sq for row i of a sequence of Sq
/// queries and Sk keys — 0 on the bottom-right diagonal for a finite slope. A product, as the
/// GPU kernels form it: a NaN or infinite slope makes the diagonal key's bias NaN too (SPEC §3).
HIPFLASH_HD float alibi_bias(float slope, int64_t diag, int64_t key) {
  const int64_t d = diag > key ? diag - key : key - diag;
  return -slope * float(d);
}

struct SoftmaxState {
  float m = kNegInf;  ///< running max, base-2 scaled units
  float l = 0.f;      ///< running sum of 2^(x - m)

  /// The max to subtract: m itself, or 0 while the row has seen no valid key (keeps
  /// 2^(x - m) at 0 instead of NaN for x = m = -inf).
  HIPFLASH_HD static float safe_max(float m) { return m == kNegInf ? 0.f : m; }

  /// Factor that moves a sum taken against m_old onto m_new (>= m_old): 2^(m_old - m_new).
  HIPFLASH_HD static float rescale(float m_old, float m_new) {
    return fast_exp2(m_old - safe_max(m_new));
  }

  /// Natural-log LSE of a (m, l) pair; -inf for an empty row, NaN for a NaN sum.
  HIPFLASH_HD static float lse_of(float m, float l) {
    return l == 0.f ? kNegInf : (m + log2f(l)) * kLn2;
  }

  /// 1/l for normalising the output; 0 for an empty row so that out = 0 (NaN stays NaN).
  HIPFLASH_HD static float inv_sum(float l) { return l == 0.f ? 0.f : 1.f / l; }

  /// Whether the row has seen a valid key (a NaN sum counts: it must reach the output).
  HIPFLASH_HD bool live() const { return l != 0.f; }

  HIPFLASH_HD float lse() const { return lse_of(m, l); }

  /// The state of a finished partial result with natural-log LSE `lse` (split-K combine).
  HIPFLASH_HD static SoftmaxState from_lse(float lse) {
    SoftmaxState s;
    if (lse != kNegInf) {
      s.m = lse * kLog2e;
      s.l = 1.f;
    }
    return s;
  }

  /// Folds one more score x (base-2 scaled) in; returns the factor that rescales the
  /// running output accumulator.
  HIPFLASH_HD float update_max(float x_max) {
    float m_new = x_max > m ? x_max : m;
    float r = rescale(m, m_new);
    l *= r;
    m = m_new;
    return r;
  }

  /// Merges another state; returns {factor for this side, factor for the other side}.
  struct Weights { float self, other; };
  HIPFLASH_HD Weights merge(const SoftmaxState& o) {
    float m_new = o.m > m ? o.m : m;
    Weights w{rescale(m, m_new), rescale(o.m, m_new)};
    l = l * w.self + o.l * w.other;
    m = m_new;
    return w;
  }
};

}  // namespace hipflash::detail

namespace hipflash::detail {

/// Split-K combine (SPEC §3): the weight w_s = exp(lse_s - lse) of a partial result whose
/// softmax state is `s` in the total state `total` (the merge of every split's state). The
/// splits hand over their (m, l) rather than a rounded natural-log LSE: at large |scores| an
/// fp32 LSE keeps no bits of log(l) (1e8 + log 16 == 1e8 in fp32), and tied rows would be
/// weighted 1/2 : 1/2 instead of 16/25 : 9/25. 0 for an empty split; NaN propagates.
HIPFLASH_HD float combine_weight(const SoftmaxState& s, const SoftmaxState& total) {
  if (!s.live()) return 0.f;
  return fast_exp2(s.m - total.m) * s.l / total.l;
}

}  // namespace hipflash::detail
