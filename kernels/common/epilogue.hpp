// hipflash — shared by every forward schedule: the epilogue pieces. Where a row's LSE and its
// split-K partial (fp32 out normalised by the split's sum, and the split's SoftmaxState) live
// is FwdParams' (lse_offset, partial_row: one definition for the kernels, the combine kernel
// and the CPU backend); here are the writers every schedule shares.
#pragma once

#include "common/swizzle.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::common {

/// Padded varlen LSE (kReturnLse, non-split): rows [len_q, max_seqlen_q) of this query block
/// are -inf, so the buffer has no undefined entries. Done by the block that owns those rows.
/// `thread` is the caller's thread index (0 .. kThreads - 1), here and below: a persistent
/// kernel passes one read where it is used (atoms/sm90/consumer.hpp thread_index).
template <int kBlockM, int kThreads>
__device__ __forceinline__ void write_padded_lse_tail(const FwdParams& p, int64_t b, int64_t h,
                                                      int64_t m0, int64_t len_q,
                                                      int thread = int(threadIdx.x)) {
  if (!(p.cu_seqlens_q && p.lse_layout == LseLayout::padded)) return;
  for (int r = thread; r < kBlockM; r += kThreads) {
    const int64_t row = m0 + r;
    if (row >= len_q && row < p.seqlen_q)
      p.lse[p.lse_offset(b, h, 0, row)] = detail::kNegInf;  // padded: no sequence offset
  }
}

/// The first step of every forward schedule: a query block that starts past its varlen
/// sequence has no rows — only, for kReturnLse unsplit kernels, its padded LSE rows to write.
/// True when the block is done.
template <class Traits, int kBlockM, int kThreads>
__device__ __forceinline__ bool block_past_sequence(const FwdParams& p, int64_t b, int64_t h,
                                                    int64_t m0, int64_t len_q,
                                                    int thread = int(threadIdx.x)) {
  if (m0 < len_q) return false;
  if constexpr (Traits::kReturnLse && !Traits::kSplit)
    write_padded_lse_tail<kBlockM, kThreads>(p, b, h, m0, len_q, thread);
  return true;
}

/// Writes rows [m0, min(m0 + kRows, len_q)) of the output, staged (rounded) in shared memory as
/// a swizzled [kRows][kChunks * 8] tile (panel-major with kPanelRows: staged_swizzle), to gO
/// (row stride ld) in 16-byte pieces; columns past head_dim are not written. The caller
/// synchronises the block before (staging done).
template <int kRows, int kChunks, int kThreads, int kPanelRows = 0, class T>
__device__ __forceinline__ void store_staged_rows(T* gO, int64_t ld, const T* staged, int64_t m0,
                                                  int64_t len_q, int head_dim,
                                                  int thread = int(threadIdx.x)) {
  constexpr int kTotal = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = thread + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    if (m0 + r < len_q && c * 8 < head_dim)
      *reinterpret_cast<uint4*>(gO + (m0 + r) * ld + c * 8) =
          *reinterpret_cast<const uint4*>(staged + staged_swizzle<kChunks, kPanelRows>(r, c));
  }
}

}  // namespace hipflash::common
