// hipflash — the backward's first and last passes (portable: NVIDIA and AMD).
//
// bwd_preprocess_kernel, before the dk/dv pass: per (b, h, row) of the padded workspace,
//   delta    = rowsum(dO * O) in fp32, from the saved (rounded) output;
//   lse_log2 = the forward's LSE in base 2, with -inf (a row that sees no key) made +inf so
//              that P = exp2(s * scale * log2e - lse_log2) is exactly 0 there; NaN stays NaN;
//   rows past the sequence: delta 0, lse_log2 +inf (they take part in nothing);
//   and, where the dk/dv pass adds dq, the row's dq_accum zeroed (and its 64-row block's
//   counter, where it adds in key-block order; the pass's tile counter, where it takes tiles
//   from one, by the first row's thread).
// Eight threads own a row; each sums 16-byte pieces and the eight reduce by shuffles.
// Both passes walk the (batch, head) pairs last first, so that what each touches last (the
// preprocess) or first (the conversion) is what the dk/dv pass touches first or last: L2 hits
// where the workspace is larger than L2 (short rows, many heads).
//
// bwd_dq_convert_kernel, after it wherever the dk/dv pass adds dq: dq = softmax_scale *
// dq_accum, rounded to the dtype, for the rows of every sequence (dq_accum's swizzled rows:
// dq_accum_index).
//
// On sm_90+ the warp-specialised dk/dv pass follows the preprocess, and the conversion the dk/dv
// pass, as programmatic dependents (port.hpp): the preprocess lets the dk/dv pass's blocks be
// placed once all of its own have started, and each dependent waits for the pass before it
// where it first reads what that pass wrote.
//
// bwd_dkv_convert_kernel, after the dq conversion wherever the dk/dv pass's GQA tiles took
// slices of a kv head's query heads: dk and dv = the sums of the slices' parts of dkv_accum
// (dK already scaled), slice 0 first, rounded to the dtype.
//
// bwd_zero_outside_kernel (varlen): the rows of a [total, H, D] gradient before cu_seqlens[0]
// and from cu_seqlens[B] on belong to no sequence; their gradient is 0 (the CPU backward's rule).
#pragma once

#include "bwd/bwd_block_info.hpp"
#include "common/words.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::bwd {

inline constexpr int kPrepThreads = 256;
inline constexpr int kPrepLanesPerRow = 8;
inline constexpr int kPrepRows = kPrepThreads / kPrepLanesPerRow;  ///< rows per thread block

/// Grid: ceil(seqlen_rounded / kPrepRows) * Hq * B blocks (row block fastest).
template <DType kDType>
__global__ void __launch_bounds__(kPrepThreads)
    bwd_preprocess_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int row_blocks) {
  using B = common::Bits<kDType>;
  using W = typename B::word;
  port::allow_dependent_launch();  // the dk/dv pass's blocks wait for ours to finish
  // (batch, head) pairs last first: the blocks that run last, whose dq_accum rows, dO and
  // statistics are then still in L2, are the pairs the dk/dv pass starts with.
  const int64_t linear = blockIdx.x, pairs = gridDim.x / row_blocks;
  const int64_t rb = linear % row_blocks, rest = pairs - 1 - linear / row_blocks;
  const int64_t h = rest % p.heads_q, b = rest / p.heads_q;
  const int lane = int(threadIdx.x) % kPrepLanesPerRow;
  const int64_t row = rb * kPrepRows + int(threadIdx.x) / kPrepLanesPerRow;
  if (row >= p.seqlen_rounded) return;
  const SeqBounds seq(p, b);
  const int64_t ws = p.ws_row(b, h, row);

  float delta = 0.f, lse2 = __int_as_float(0x7f800000);  // +inf
  if (row < seq.len_q) {
    const W* o = out_rows<W>(p, b, seq.q_start, h) + row * p.o_row_stride;
    const W* dout = dout_rows<W>(p, b, seq.q_start, h) + row * p.do_row_stride;
    for (int c = lane * 8; c < p.head_dim; c += kPrepLanesPerRow * 8) {
      W ov[8], dv[8];
      common::load_words<W, 8>(o + c, ov);
      common::load_words<W, 8>(dout + c, dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) delta += B::to_float(ov[e]) * B::to_float(dv[e]);
    }
    const float lse = p.lse[p.lse_offset(b, h, seq.q_start, row)];
    if (lse != detail::kNegInf) lse2 = lse * detail::kLog2e;
  }
#pragma unroll
  for (int m = 1; m < kPrepLanesPerRow; m *= 2) delta += port::shfl_xor(delta, m);
  if (lane == 0) {
    const int64_t at = p.stats_index(ws);
    p.delta[at] = delta;
    p.lse_log2[at] = lse2;
  }
  if (p.dq_accum != nullptr) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + ws * p.padded_head_dim);
    for (int c = lane; c < p.padded_head_dim / 4; c += kPrepLanesPerRow)
      acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq_semaphore != nullptr && lane == 0 && row % 64 == 0) p.dq_semaphore[ws / 64] = 0;
  if (p.tile_counter != nullptr && lane == 0 && ws == 0) *p.tile_counter = 0;
}

inline constexpr int kConvertThreads = 256;

/// A conversion thread's piece: columns c .. c + 7 of row `row` of its (batch, head), rows
/// split in padded_head_dim / 8 pieces, kConvertThreads pieces to block `piece_block`.
struct ConvertPiece {
  int64_t row;
  int c;
  __device__ __forceinline__ ConvertPiece(const BwdParams& p, int64_t piece_block) {
    const int pieces = p.padded_head_dim / 8;
    const int64_t piece = piece_block * kConvertThreads + threadIdx.x;
    row = piece / pieces;
    c = int(piece % pieces) * 8;
  }
};

/// Grid: ceil(seqlen_rounded / 2 * padded_head_dim / 8 / kConvertThreads) * Hq * B blocks; a
/// thread converts 8 columns of one pair of rows (r and r + 8 of 16: dq_accum_index), four
/// 16-byte chunks together.
template <DType kDType>
__global__ void __launch_bounds__(kConvertThreads)
    bwd_dq_convert_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int piece_blocks) {
  using B = common::Bits<kDType>;
  using W = typename B::word;
  // (batch, head) pairs last first: the dk/dv pass ends with the last ones (its tiles run in
  // (batch, kv head) order), whose dq_accum rows are then still in L2.
  const int64_t linear = blockIdx.x, pairs = gridDim.x / piece_blocks;
  const int64_t pb = linear % piece_blocks, rest = pairs - 1 - linear / piece_blocks;
  const int64_t h = rest % p.heads_q, b = rest / p.heads_q;
  const auto [pair, c] = ConvertPiece(p, pb);
  const int64_t row = pair / 8 * 16 + pair % 8;  // and row + 8
  const SeqBounds seq(p, b);
  // Every thread waits for the dk/dv pass, also one with nothing to convert: the work after
  // this grid waits for it alone, so it may not end before the pass does.
  port::wait_prerequisite_grids();
  if (row >= seq.len_q || c >= p.head_dim) return;
  // Columns c .. c + 7 of both rows: four 16-byte chunks (dq_accum_index), chunk j columns
  // c + 2j and + 1 of row, then of row + 8.
  float acc[2][8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v =
        *reinterpret_cast<const float4*>(p.dq_accum + dq_accum_index(p, b, h, row, c + 2 * j));
    acc[0][2 * j] = v.x;
    acc[0][2 * j + 1] = v.y;
    acc[1][2 * j] = v.z;
    acc[1][2 * j + 1] = v.w;
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (row + 8 * hh >= seq.len_q) break;
    W w[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = B::from_float(acc[hh][e] * p.softmax_scale);
    W* dq = dq_rows<W>(p, b, seq.q_start, h) + (row + 8 * hh) * p.dq_row_stride + c;
    common::store_words<W, 8>(dq, w);
  }
}

/// Grid: ceil(seqlen_k_rounded * padded_head_dim / 8 / kConvertThreads) * Hkv * B blocks; a
/// thread converts 8 elements of one key's dk row and the same of its dv row.
template <DType kDType>
__global__ void __launch_bounds__(kConvertThreads)
    bwd_dkv_convert_kernel(const HIPFLASH_GRID_CONSTANT BwdParams p, int piece_blocks) {
  using B = common::Bits<kDType>;
  using W = typename B::word;
  const int64_t linear = blockIdx.x;
  const int64_t pb = linear % piece_blocks, rest = linear / piece_blocks;
  const int64_t hk = rest % p.heads_kv, b = rest / p.heads_kv;
  const auto [key, c] = ConvertPiece(p, pb);
  const SeqBounds seq(p, b);
  if (key >= seq.len_k || c >= p.head_dim) return;
  W* dst[2] = {dk_rows<W>(p, b, seq.k_start, hk) + key * p.dk_row_stride + c,
               dv_rows<W>(p, b, seq.k_start, hk) + key * p.dv_row_stride + c};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float acc[8] = {};
    for (int64_t slice = 0; slice < p.dkv_slices(); ++slice) {
      const float4* src = reinterpret_cast<const float4*>(p.dkv_row(half, slice, b, hk, key) + c);
      const float4 lo = src[0], hi = src[1];
      const float part[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += part[e];
    }
    W w[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = B::from_float(acc[e]);
    common::store_words<W, 8>(dst[half], w);
  }
}

/// Grid: ceil(total * H * D / 8 / kConvertThreads) blocks; a thread owns 8 elements of one
/// (row, head) and zeroes them when the row is in no sequence's used rows: outside
/// [cu[0], cu[batch]), or (`used`, FlashAttention 3's seqused) at or past its sequence's
/// cu[b] + used[b] — the rows no other pass writes.
template <DType kDType>
__global__ void __launch_bounds__(kConvertThreads)
    bwd_zero_outside_kernel(typename common::Bits<kDType>::word* base, int64_t row_stride,
                            int64_t head_stride, int64_t total, int64_t heads, int head_dim,
                            const int32_t* __restrict__ cu, const int32_t* __restrict__ used,
                            int64_t batch) {
  using W = typename common::Bits<kDType>::word;
  const int pieces = head_dim / 8;
  const int64_t i = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  const int64_t row = i / (heads * pieces), h = (i / pieces) % heads;
  if (row >= total) return;
  if (row >= cu[0] && row < cu[batch]) {
    if (used == nullptr) return;
    // The sequence holding the row: the last b with cu[b] <= row (cu non-decreasing, so the
    // empty sequences before it are passed over).
    int64_t lo = 0, hi = batch;  // cu[lo] <= row < cu[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (cu[mid] <= row)
        lo = mid;
      else
        hi = mid;
    }
    if (row < cu[lo] + used[lo]) return;
  }
  const W zero[8] = {};
  common::store_words<W, 8>(base + row * row_stride + h * head_stride + (i % pieces) * 8, zero);
}

}  // namespace hipflash::bwd
