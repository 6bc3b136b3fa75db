// hipflash — the split-K combine kernel (SPEC §3).
//
// One warp per (batch, head, row): merge the splits' LSEs with the shared SoftmaxState, then
// out = sum_s w_s * out_s with w_s = exp(lse_s - lse) (0 for an empty split). All splits empty:
// out = 0, lse = -inf. RETURN_LSE is a compile-time flag: without it no LSE store exists.
#pragma once

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::combine {

inline constexpr int kWarpsPerBlock = 4;

/// Rows are (b, h, row) over the padded query length; kPaddedDim is the workspace row pitch.
template <class T, int kPaddedDim, bool kReturnLse>
__global__ void __launch_bounds__(kWarpsPerBlock * port::kWarpSize)
    combine_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p) {
  using detail::SoftmaxState;
  constexpr int kWarp = port::kWarpSize;
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x) / kWarp;
  const int64_t rows_total = p.batch * p.heads_q * p.seqlen_q;
  if (item >= rows_total) return;
  const int64_t row = item % p.seqlen_q;
  const int64_t h = (item / p.seqlen_q) % p.heads_q;
  const int64_t b = item / (p.seqlen_q * p.heads_q);
  int64_t q_start = 0, len_q = p.seqlen_q;
  if (p.cu_seqlens_q) {
    q_start = p.cu_seqlens_q[b];
    len_q = p.cu_seqlens_q[b + 1] - q_start;
  }
  if (row >= len_q) {  // padded varlen LSE rows are -inf; there is no output row
    if constexpr (kReturnLse) {
      if (lane == 0 && p.lse_layout == LseLayout::padded)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + row * p.lse_row_stride] =
            detail::kNegInf;
    }
    return;
  }
  // Split s's partial row: ((s * B + b) * Hq + h) * Sq + row.
  const int64_t split_stride = p.batch * p.heads_q * p.seqlen_q;
  const int64_t base = (b * p.heads_q + h) * p.seqlen_q + row;

  // Lane l holds the LSEs of splits l, l + 32, ... (num_splits <= kMaxSplits, validated).
  constexpr int kSplitRegs = kMaxSplits / kWarp;
  float lse_s[kSplitRegs];
  SoftmaxState total;
#pragma unroll
  for (int i = 0; i < kSplitRegs; ++i) {
    const int s = lane + i * kWarp;
    lse_s[i] = s < p.num_splits ? p.lse_partial[s * split_stride + base] : detail::kNegInf;
    total.merge(SoftmaxState::from_lse(lse_s[i]));
  }
  for (int off = kWarp / 2; off > 0; off /= 2) {
    SoftmaxState other{port::shfl_xor(total.m, off), port::shfl_xor(total.l, off)};
    total.merge(other);
  }

  // Lane l accumulates columns [l * kPerLane, (l + 1) * kPerLane) with vector loads; the
  // splits' rows are independent loads, unrolled so that several are in flight.
  constexpr int kPerLane = kPaddedDim / kWarp;
  static_assert(kPaddedDim % kWarp == 0, "whole columns per lane");
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kSplitRegs; ++i) {
    if (i * kWarp >= p.num_splits) break;
    const float w_mine = detail::combine_weight(lse_s[i], total);
    const int n = p.num_splits - i * kWarp < kWarp ? p.num_splits - i * kWarp : kWarp;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float w = port::shfl(w_mine, j);
      if (w == 0.f) continue;  // empty split (uniform across the warp)
      const float* src =
          p.out_partial + (int64_t(i * kWarp + j) * split_stride + base) * kPaddedDim + lane * kPerLane;
      if constexpr (kPerLane % 4 == 0) {
#pragma unroll
        for (int e = 0; e < kPerLane; e += 4) {
          const float4 v = *reinterpret_cast<const float4*>(src + e);
          acc[e] += w * v.x, acc[e + 1] += w * v.y, acc[e + 2] += w * v.z, acc[e + 3] += w * v.w;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[e] += w * src[e];
      }
    }
  }
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + (q_start + row) * p.o_row_stride +
           h * p.o_head_stride;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int col = lane * kPerLane + i;
    if (col < p.head_dim) out[col] = port::from_float<T>(acc[i]);
  }
  if constexpr (kReturnLse) {
    if (lane == 0) {
      const int64_t r = p.lse_layout == LseLayout::packed && p.cu_seqlens_q ? q_start + row : row;
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + r * p.lse_row_stride] = total.lse();
    }
  }
}

}  // namespace hipflash::combine
