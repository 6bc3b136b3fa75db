// hipflash — the softmax piece of the generic kernel: online softmax over one thread's score
// fragment, on top of the shared detail::SoftmaxState math (base 2, see its header).
//
// A thread holds kRows rows of the score tile (on sm80: rows g and g+8 of each 16-row MMA tile);
// the lanes sharing a row are a quad, reduced with two butterflies.
#pragma once

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::generic {

using detail::kNegInf;
using detail::SoftmaxState;

template <int kRows>
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
  /// 2^(x - m), updates (m, l) and returns the factor rescaling each row's accumulator.
  template <int kCols>
  __device__ __forceinline__ void update(float (&scores)[kRows][kCols], float scale_log2,
                                         float (&rescale)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = kNegInf;
#pragma unroll
      for (int c = 0; c < kCols; ++c) mx = fmaxf(mx, scores[r][c]);
      mx = fmaxf(mx, port::shfl_xor(mx, 1));
      mx = fmaxf(mx, port::shfl_xor(mx, 2));
      const float m_new = fmaxf(m[r], mx * scale_log2);  // scale > 0 (validated)
      rescale[r] = SoftmaxState::rescale(m[r], m_new);
      m[r] = m_new;
      const float m_use = SoftmaxState::safe_max(m_new);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        scores[r][c] = detail::fast_exp2(fmaf(scores[r][c], scale_log2, -m_use));
        sum += scores[r][c];
      }
      l[r] = l[r] * rescale[r] + sum;
    }
  }

  /// Completes the row sums across the quad. Call once, after the last key block.
  __device__ __forceinline__ void finalize() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      l[r] += port::shfl_xor(l[r], 1);
      l[r] += port::shfl_xor(l[r], 2);
    }
  }

  __device__ __forceinline__ float inv_sum(int r) const { return SoftmaxState::inv_sum(l[r]); }
  __device__ __forceinline__ float lse(int r) const { return SoftmaxState::lse_of(m[r], l[r]); }
  /// Row r's (m, l): what a split hands to the combine kernel.
  __device__ __forceinline__ SoftmaxState state(int r) const { return SoftmaxState{m[r], l[r]}; }
};

}  // namespace hipflash::generic
