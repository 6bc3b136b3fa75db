// hipflash — the split-K combine kernel (SPEC §3).
//
// One thread block per (batch, head, row). Warp 0 merges the splits' softmax states (m, l) with
// the shared SoftmaxState into the row's LSE and each split's weight w_s = exp(lse_s - lse) (0
// for an empty split; NaN when a split's sum is NaN, so a NaN input is never weighed away);
// meanwhile every warp has already issued the loads of its splits' partial rows
// (split s belongs to warp s % kWarps), so the row costs about one memory round trip however
// many splits there are. out = sum_s w_s * out_s is reduced across the warps in shared memory.
// All splits empty: out = 0, lse = -inf. RETURN_LSE is a compile-time flag: without it no LSE
// store exists. On sm_90+ the kernel is a programmatic dependent of the split kernel before it
// (src/gpu/combine_launch.cu): its blocks are placed while that kernel runs and wait for it,
// which saves the launch gap between the two.
#pragma once

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::combine {

inline constexpr int kWarps = 4;  ///< warps per row
inline constexpr int kThreads = kWarps * port::kWarpSize;
/// Splits each warp has in flight at once.
inline constexpr int kBatch = 8;

/// kN consecutive floats of a partial row, in the widest aligned vectors.
template <int kN>
__device__ __forceinline__ void load_cols(const float* src, float (&v)[kN]) {
  if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int e = 0; e < kN; e += 4) {
      const float4 x = *reinterpret_cast<const float4*>(src + e);
      v[e] = x.x, v[e + 1] = x.y, v[e + 2] = x.z, v[e + 3] = x.w;
    }
  } else if constexpr (kN % 2 == 0) {
#pragma unroll
    for (int e = 0; e < kN; e += 2) {
      const float2 x = *reinterpret_cast<const float2*>(src + e);
      v[e] = x.x, v[e + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kN; ++e) v[e] = src[e];
  }
}

/// Rows are (b, h, row) over the padded query length; kPaddedDim is the workspace row pitch.
template <class T, int kPaddedDim, bool kReturnLse>
__global__ void __launch_bounds__(kThreads) combine_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p) {
  using detail::SoftmaxState;
  constexpr int kWarp = port::kWarpSize;
  constexpr int kPerLane = kPaddedDim / kWarp;  // columns per lane
  static_assert(kPaddedDim % kWarp == 0, "whole columns per lane");
  __shared__ float s_weight[kMaxSplits];
  __shared__ bool s_live[kMaxSplits];  ///< the split saw a key: its partial row was written
  __shared__ float s_acc[kWarps][kPaddedDim];

  // Launched as a programmatic dependent of the split kernel where the GPU has that: its
  // partials are complete and visible past this point.
  port::wait_prerequisite_grids();
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  const int64_t item = blockIdx.x;
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
      if (threadIdx.x == 0 && p.lse_layout == LseLayout::padded)
        p.lse[p.lse_offset(b, h, 0, row)] = detail::kNegInf;
    }
    return;
  }
  // Split s's partial row, p.partial_row(s, b, h, row) = s * split_stride + base.
  const int64_t split_stride = p.batch * p.heads_q * p.seqlen_q;
  const int64_t base = p.partial_row(0, b, h, row);
  const int splits = p.num_splits;
  auto partial = [&](int s) {
    return p.out_partial + (int64_t(s) * split_stride + base) * kPaddedDim + lane * kPerLane;
  };
  // Split warp + kWarps * j of batch `first` (j < kBatch). Workspace rows of splits that exist
  // are always readable; an empty split's row may hold anything and gets weight 0 below.
  auto load_batch = [&](int first, float (&v)[kBatch][kPerLane]) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = first + warp + kWarps * j;
      if (s < splits) load_cols<kPerLane>(partial(s), v[j]);
    }
  };
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  auto accumulate = [&](int first, const float (&v)[kBatch][kPerLane]) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = first + warp + kWarps * j;
      if (s >= splits || !s_live[s]) continue;  // an empty split's row is never read
      const float w = s_weight[s];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] += w * v[j][e];  // 0 * NaN stays NaN
    }
  };

  float v[kBatch][kPerLane];
  load_batch(0, v);
  if (warp == 0) {
    // Lane l holds the states of splits l, l + kWarp, ... (num_splits <= kMaxSplits, validated).
    constexpr int kSplitRegs = kMaxSplits / kWarp;
    SoftmaxState state_s[kSplitRegs];
    SoftmaxState total;
#pragma unroll
    for (int i = 0; i < kSplitRegs; ++i) {
      const int s = lane + i * kWarp;
      if (s < splits) state_s[i] = p.state_partial[s * split_stride + base];
      total.merge(state_s[i]);
    }
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const SoftmaxState other{port::shfl_xor(total.m, off), port::shfl_xor(total.l, off)};
      total.merge(other);
    }
#pragma unroll
    for (int i = 0; i < kSplitRegs; ++i) {
      const int s = lane + i * kWarp;
      if (s < splits) {
        s_weight[s] = detail::combine_weight(state_s[i], total);
        s_live[s] = state_s[i].live();
      }
    }
    if constexpr (kReturnLse) {
      if (lane == 0) {
        p.lse[p.lse_offset(b, h, q_start, row)] = total.lse();
      }
    }
  }
  __syncthreads();  // the weights are in shared memory
  accumulate(0, v);
  for (int first = kWarps * kBatch; first < splits; first += kWarps * kBatch) {
    load_batch(first, v);
    accumulate(first, v);
  }

  // Sum the warps' partial rows; every thread stores whole columns.
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) s_acc[warp][lane * kPerLane + e] = acc[e];
  __syncthreads();
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + (q_start + row) * p.o_row_stride +
           h * p.o_head_stride;
  for (int col = int(threadIdx.x); col < kPaddedDim && col < p.head_dim; col += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += s_acc[w][col];
    out[col] = port::from_float<T>(sum);
  }
}

}  // namespace hipflash::combine
