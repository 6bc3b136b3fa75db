// hipflash — the split-K combine kernels (SPEC §3).
//
// out = sum_s w_s * out_s over a row's splits, with w_s = exp(lse_s - lse) from the splits'
// softmax states (m, l) merged by the shared SoftmaxState (0 for an empty split; NaN when a
// split's sum is NaN, so a NaN input is never weighed away); all splits empty: out = 0,
// lse = -inf. Two launch shapes of the same math, bitwise the same result:
// - combine_kernel: one thread block per (batch, head, row), split s on warp s % kWarps, for
//   many splits (each warp keeps kBatch of its splits' partial rows in flight; the warps' sums
//   are added in shared memory);
// - combine_rows_kernel: one warp per row, kWarps rows a block, for up to kRowSplits splits
//   (every partial row of the row in flight at once, no block barrier): a quarter of the
//   blocks, so that a wide decode batch's rows are placed in one wave.
// A row's partial sums are kept per group g = s % kGroups in both (combine_kernel's warps,
// combine_rows_kernel's accumulators), each product through accumulate_cols, and the groups are
// added in the order g = 0, 1, ...: the same operations in the same order (no build of the
// kernels reassociates floating point), so the launcher picks either by the split count
// alone. kReturnLse is a compile-time flag: without it no LSE store exists. On sm_90+ the kernels are programmatic
// dependents of the split kernel before them (src/gpu/combine_launch.cu): their blocks are
// placed while that kernel runs and wait for it, which saves the launch gap between the two.
#pragma once

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::combine {

inline constexpr int kWarps = 4;  ///< warps a block: combine_kernel's per row, or rows a block
inline constexpr int kThreads = kWarps * port::kWarpSize;
/// Partial-sum groups of a row (split s in group s % kGroups): combine_kernel's warps.
inline constexpr int kGroups = kWarps;
/// Splits each warp has in flight at once (combine_kernel).
inline constexpr int kBatch = 8;
/// The most splits combine_rows_kernel takes (its warp holds every one's partial row).
inline constexpr int kRowSplits = 8;

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

/// The row being combined: (b, h, row) over the padded query length, its varlen sequence's
/// start and length, and its partial rows' places in the workspace.
struct CombineRow {
  int64_t b, h, row, q_start, len_q;
  int64_t base;          ///< p.partial_row(0, b, h, row)
  int64_t split_stride;  ///< partial_row(s, ...) = s * split_stride + base

  __device__ CombineRow(const FwdParams& p, int64_t item)
      : b(item / (p.seqlen_q * p.heads_q)), h((item / p.seqlen_q) % p.heads_q),
        row(item % p.seqlen_q), q_start(0), len_q(p.seqlen_q),
        base(p.partial_row(0, b, h, row)), split_stride(p.batch * p.heads_q * p.seqlen_q) {
    if (p.cu_seqlens_q) {
      q_start = p.cu_seqlens_q[b];
      len_q = p.seqused_q != nullptr ? p.seqused_q[b] : p.cu_seqlens_q[b + 1] - q_start;
    }
  }
  /// A padded varlen row: its LSE is -inf (written by the caller's lane 0), there is no output.
  __device__ bool padded() const { return row >= len_q; }
  /// Split s's partial row in the workspace (its pitch kPaddedDim floats).
  template <int kPaddedDim>
  __device__ const float* partial(const FwdParams& p, int s) const {
    return p.out_partial + (int64_t(s) * split_stride + base) * kPaddedDim;
  }
  /// The row of the output it combines into.
  template <class T>
  __device__ T* out_row(const FwdParams& p) const {
    return static_cast<T*>(p.out) + b * p.o_batch_stride + (q_start + row) * p.o_row_stride +
           h * p.o_head_stride;
  }
};

/// Lane l's splits are l, l + kWarp, ... (num_splits <= kMaxSplits, validated).
inline constexpr int kSplitRegs = kMaxSplits / port::kWarpSize;

/// One warp: this lane's splits' weights in the row's total softmax state (the merge of every
/// split's) and whether each saw a key; lane 0 stores the row's LSE. The one merge order of
/// both kernels.
template <bool kReturnLse>
__device__ __forceinline__ void row_weights(const FwdParams& p, const CombineRow& r, int lane,
                                            float (&weight)[kSplitRegs],
                                            bool (&live)[kSplitRegs]) {
  using detail::SoftmaxState;
  SoftmaxState state_s[kSplitRegs];
  SoftmaxState total;
#pragma unroll
  for (int i = 0; i < kSplitRegs; ++i) {
    const int s = lane + i * port::kWarpSize;
    if (s < p.num_splits) state_s[i] = p.state_partial[s * r.split_stride + r.base];
    total.merge(state_s[i]);
  }
  for (int off = port::kWarpSize / 2; off > 0; off /= 2) {
    const SoftmaxState other{port::shfl_xor(total.m, off), port::shfl_xor(total.l, off)};
    total.merge(other);
  }
#pragma unroll
  for (int i = 0; i < kSplitRegs; ++i) {
    weight[i] = detail::combine_weight(state_s[i], total);
    live[i] = state_s[i].live();
  }
  if constexpr (kReturnLse) {
    if (lane == 0) p.lse[p.lse_offset(r.b, r.h, r.q_start, r.row)] = total.lse();
  }
}

/// acc += w * v over a partial row's columns (0 * NaN stays NaN).
template <int kN>
__device__ __forceinline__ void accumulate_cols(float (&acc)[kN], float w, const float (&v)[kN]) {
#pragma unroll
  for (int e = 0; e < kN; ++e) acc[e] += w * v[e];
}

/// A padded varlen row's LSE: -inf in the padded layout (the packed one has no such row).
template <bool kReturnLse>
__device__ __forceinline__ void write_padded_lse(const FwdParams& p, const CombineRow& r) {
  if constexpr (kReturnLse) {
    if (p.lse_layout == LseLayout::padded)
      p.lse[p.lse_offset(r.b, r.h, 0, r.row)] = detail::kNegInf;
  }
}

/// Many splits: one thread block per row (kPaddedDim is the workspace row pitch).
template <class T, int kPaddedDim, bool kReturnLse>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p) {
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
  const CombineRow r(p, blockIdx.x);
  if (r.padded()) {  // padded varlen LSE rows are -inf; there is no output row
    if (threadIdx.x == 0) write_padded_lse<kReturnLse>(p, r);
    return;
  }
  const int splits = p.num_splits;
  auto partial = [&](int s) { return r.partial<kPaddedDim>(p, s) + lane * kPerLane; };
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
      accumulate_cols(acc, s_weight[s], v[j]);
    }
  };

  float v[kBatch][kPerLane];
  load_batch(0, v);  // in flight while warp 0 merges the states
  if (warp == 0) {
    float weight[kSplitRegs];
    bool live[kSplitRegs];
    row_weights<kReturnLse>(p, r, lane, weight, live);
#pragma unroll
    for (int i = 0; i < kSplitRegs; ++i) {
      const int s = lane + i * kWarp;
      if (s < splits) s_weight[s] = weight[i], s_live[s] = live[i];
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
  T* out = r.out_row<T>(p);
  for (int col = int(threadIdx.x); col < kPaddedDim && col < p.head_dim; col += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += s_acc[w][col];
    out[col] = port::from_float<T>(sum);
  }
}

/// Up to kRowSplits splits: one warp per row, kWarps rows a block (the launcher checks the
/// count). The partial sums are kept per group s % kGroups as combine_kernel's warps keep them.
template <class T, int kPaddedDim, bool kReturnLse>
__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p) {
  constexpr int kWarp = port::kWarpSize;
  constexpr int kPerLane = kPaddedDim / kWarp;
  static_assert(kPaddedDim % kWarp == 0, "whole columns per lane");
  static_assert(kRowSplits <= kWarp, "a lane holds each split's weight (weight[0] of lane s)");

  port::wait_prerequisite_grids();  // as in combine_kernel
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  const int64_t item = int64_t(blockIdx.x) * kWarps + warp;
  if (item >= p.batch * p.heads_q * p.seqlen_q) return;
  const CombineRow r(p, item);
  if (r.padded()) {
    if (lane == 0) write_padded_lse<kReturnLse>(p, r);
    return;
  }
  const int splits = p.num_splits;
  float v[kRowSplits][kPerLane];
#pragma unroll
  for (int s = 0; s < kRowSplits; ++s)  // every partial row in flight while the states merge
    if (s < splits)
      load_cols<kPerLane>(r.partial<kPaddedDim>(p, s) + lane * kPerLane, v[s]);
  float weight[kSplitRegs];
  bool live[kSplitRegs];
  row_weights<kReturnLse>(p, r, lane, weight, live);

  float acc[kGroups][kPerLane];
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[g][e] = 0.f;
#pragma unroll
  for (int s = 0; s < kRowSplits; ++s) {
    // Split s's weight and liveness live on lane s (in the lanes' first register).
    const float w = port::shfl(weight[0], s);
    const bool live_s = port::shfl(int(live[0]), s) != 0;
    if (s < splits && live_s) accumulate_cols(acc[s % kGroups], w, v[s]);  // empty: never read
  }
  T* out = r.out_row<T>(p);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int col = lane * kPerLane + e;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) sum += acc[g][e];
    if (col < p.head_dim) out[col] = port::from_float<T>(sum);
  }
}

}  // namespace hipflash::combine
