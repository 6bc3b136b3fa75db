// hipflash — the epilogue piece of the generic kernel: normalise O, write it (or the split's
// fp32 partial) and, for RETURN_LSE kernels only, the natural-log LSE of each row.
#pragma once

#include "generic/block_info.hpp"
#include "generic/softmax.hpp"
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

}  // namespace hipflash::generic
