// hipflash — the epilogue piece of the generic kernel: normalise O, write it (or the split's
// fp32 partial) and, for RETURN_LSE kernels only, the natural-log LSE of each row.
#pragma once

#include "generic/block_info.hpp"
#include "generic/softmax.hpp"
#include "generic/tile_config.hpp"
#include "hipflash/params.hpp"

namespace hipflash::generic {

/// Index of row `row` (relative to its sequence) of head h in the LSE buffer (SPEC §2).
__device__ __forceinline__ int64_t lse_index(const FwdParams& p, int64_t b, int64_t h,
                                             int64_t q_start, int64_t row) {
  const int64_t r = p.lse_layout == LseLayout::packed && p.cu_seqlens_q ? q_start + row : row;
  return b * p.lse_batch_stride + h * p.lse_head_stride + r * p.lse_row_stride;
}

/// Index of (split, b, h, row) in the split-K partial buffers ([splits, B, Hq, Sq(max)]).
__device__ __forceinline__ int64_t partial_row(const FwdParams& p, int split, int64_t b,
                                               int64_t h, int64_t row) {
  return ((int64_t(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q + row;
}

/// Padded varlen LSE (RETURN_LSE, non-split): rows [len_q, max_seqlen_q) of this query block
/// are -inf, so the buffer has no undefined entries. Done by the block that owns those rows.
template <int kBlockM, int kThreads>
__device__ __forceinline__ void write_padded_lse_tail(const FwdParams& p, int64_t b, int64_t h,
                                                      int64_t m0, int64_t len_q) {
  if (!(p.cu_seqlens_q && p.lse_layout == LseLayout::padded)) return;
  for (int r = int(threadIdx.x); r < kBlockM; r += kThreads) {
    const int64_t row = m0 + r;
    if (row >= len_q && row < p.seqlen_q)
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + row * p.lse_row_stride] =
          detail::kNegInf;
  }
}

/// Writes rows [m0, min(m0 + kRows, len_q)) of the output, staged (rounded) in shared memory as
/// a swizzled [kRows][kChunks * 8] tile, to gO (row stride ld) in 16-byte pieces; columns past
/// head_dim are not written. The caller synchronises the block before (staging done).
template <int kRows, int kChunks, int kThreads, class T>
__device__ __forceinline__ void store_staged_rows(T* gO, int64_t ld, const T* staged, int64_t m0,
                                                  int64_t len_q, int head_dim) {
  constexpr int kTotal = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = int(threadIdx.x) + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    if (m0 + r < len_q && c * 8 < head_dim)
      *reinterpret_cast<uint4*>(gO + (m0 + r) * ld + c * 8) =
          *reinterpret_cast<const uint4*>(staged + swizzle<kChunks>(r, c));
  }
}

}  // namespace hipflash::generic
