// hipflash — FlashAttention 3's seqused_q on the GPU (SPEC §3): sequence b of a varlen call uses
// only its first seqused_q[b] query rows; its other rows, [seqused_q[b], its cu_seqlens length),
// take part in nothing: out 0 and, in the packed LSE layout, -inf (the padded layout's rows past
// seqused_q[b] are the forward kernels' own: BlockInfo's len_q is seqused_q[b]). The forward
// kernels never write those rows, so this kernel writes them, on the same stream. A block row
// per sequence (blockIdx.y, striding over the batch past 65535), its blocks striding over that
// sequence's unused rows x heads x head-dim words; 2-byte elements (bf16 / f16 out), 64-bit
// indices.
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::varlen {

inline constexpr int kThreads = 256;
inline constexpr unsigned kBlocksPerSequence = 16;
inline constexpr int64_t kMaxSequenceBlocks = 65535;  ///< gridDim.y's limit

__global__ void __launch_bounds__(kThreads) unused_rows_kernel(const HIPFLASH_GRID_CONSTANT FwdParams p) {
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const int64_t q_start = p.cu_seqlens_q[b], rows = p.cu_seqlens_q[b + 1] - q_start;
    const int64_t used = p.seqused_q[b];  // validated: 0 <= used <= rows
    const int64_t D = p.head_dim, per_row = p.heads_q * D, items = (rows - used) * per_row;
    const int64_t step = int64_t(gridDim.x) * kThreads;
    auto* out = static_cast<uint16_t*>(p.out);
    for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items;
         item += step) {
      const int64_t r = used + item / per_row, rest = item % per_row;
      const int64_t h = rest / D, d = rest - h * D;
      out[(q_start + r) * p.o_row_stride + h * p.o_head_stride + d] = 0;  // +0 in bf16 and f16
      if (d == 0 && p.lse != nullptr && p.lse_layout == LseLayout::packed)
        p.lse[p.lse_offset(b, h, q_start, r)] = detail::kNegInf;
    }
  }
}

}  // namespace hipflash::varlen
