// hipflash — the merge_attn_states kernel (SPEC §7): N partial attention results merged by
// their LSEs with the split-K combine's math (detail::SoftmaxState, detail::combine_weight).
//
// Memory-bound: every part's row is read once, the merged row written once. A thread owns one
// kVec-element piece of one (row, head): 32 or 16 bytes (16 / 8 bf16/f16, 8 / 4 f32) on the
// vector paths, one element on the scalar path the launcher takes for rows that are not
// 16-byte aligned; pieces stay packed in registers until used (common::PackedVec). It
// merges the parts' LSEs into the row's total state (the same sequence of operations as the CPU
// merge, MergeParams::total_state), then reads the parts' pieces kBatch at a time and
// accumulates w_i * out_i in fp32 in part order. The first batch's pieces are requested before
// the LSEs, so that both are in flight together: a row costs one memory latency, not two (the
// loads of the LSEs, then of the pieces they weigh). A part with LSE -inf contributes nothing:
// its piece may be read but is never used (its out may hold anything, NaN included); a NaN LSE
// makes every weight NaN; every part empty gives out 0 and LSE -inf. The piece-0 thread of a
// row writes the merged LSE. Grid-stride loop over the pieces, 64-bit offsets; the item index
// is split into (piece, head, row) with host-prepared multiplicative divisions where it fits
// in 31 bits (MergeDivisors; NVIDIA only, kHostDivisions), 64-bit divisions otherwise.
#pragma once

#include <cstdint>

#include "common/words.hpp"
#include "hipflash/detail/fast_div.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/merge_params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::merge {

using common::Bits;
using common::store_words;

inline constexpr int kThreads = 256;
/// Parts whose loads a thread keeps in flight at once: with 32-byte pieces, 2 keeps the kernel
/// at 64 registers (four 256-thread blocks per SM, 64 KiB of loads in flight per SM for a
/// two-part merge); 4 would take 94 (two blocks per SM: 32 KiB for the same merge).
inline constexpr int kBatch = 2;
/// The grid-stride loop's block count cap (enough to fill any GPU several times over).
inline constexpr int64_t kMaxBlocks = 65536;

/// The divisions of the item index, prepared on the host (detail::FastDiv) for the common
/// case where every index is below 2^31 (`narrow`); otherwise the kernel divides in 64 bits.
struct MergeDivisors {
  bool narrow = false;
  detail::FastDiv pieces, heads, lse_seqlen;
};
/// Whether the kernel has the host-divisions path: not on AMD, where its divisors' scalar
/// registers spilled (gfx90a to gfx950, clang 15 and 22); the 64-bit divisions stay there.
#if defined(HIPFLASH_PLATFORM_AMD)
inline constexpr bool kHostDivisions = false;
#else
inline constexpr bool kHostDivisions = true;
#endif

/// Merges p.parts partial results (validated; head_dim a multiple of kVec, and for 16-byte
/// vectors aligned pointers and strides — the launcher's choice).
template <DType kDType, int kVec>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(const HIPFLASH_GRID_CONSTANT MergeParams p, const MergeDivisors div) {
  using detail::SoftmaxState;
  using B = Bits<kDType>;
  using W = typename B::word;
  const W* outs = static_cast<const W*>(p.outs);
  W* out = static_cast<W*>(p.out);
  // Pieces per (row, head); at least one, so that a row of head_dim 0 still gets its LSE.
  const int64_t pieces = p.head_dim >= kVec ? p.head_dim / kVec : 1;
  const int64_t items = p.rows * p.heads * pieces;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items; item += step) {
    // Piece c of (row t, head h); the offsets of its part-0 LSE (row) and merged LSE (lse_at).
    int64_t c, h, t, row, lse_at;
    if (kHostDivisions && div.narrow) {  // a high multiply, an add and a shift per division
      uint32_t c32, h32, s32;
      const uint32_t rh = div.pieces.divmod(uint32_t(item), c32);
      const uint32_t t32 = div.heads.divmod(rh, h32);
      const uint32_t tb = div.lse_seqlen.divmod(t32, s32);
      c = int64_t(c32) * kVec, h = h32, t = t32;
      row = tb * p.lses_batch_stride + h * p.lses_head_stride + s32 * p.lses_row_stride;
      lse_at = tb * p.lse_batch_stride + h * p.lse_head_stride + s32 * p.lse_row_stride;
    } else {
      c = (item % pieces) * kVec;
      const int64_t rh = item / pieces;
      h = rh % p.heads, t = rh / p.heads;
      row = p.lses_offset(t, h);
      lse_at = p.lse_offset(t, h);
    }

    // The pieces of parts [i0, i0 + kBatch): plain loads, used only after the LSEs arrive.
    common::PackedVec<kDType, kVec> v[kBatch];
    const auto load_batch = [&](int64_t i0) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (i0 + j < p.parts && c < p.head_dim) v[j].load(outs + p.outs_offset(i0 + j, t, h) + c);
    };
    // The parts' states kBatch at a time (all LSE loads of a batch in flight together), merged
    // in part order: MergeParams::total_state's sequence of operations, unrolled.
    SoftmaxState first[kBatch];  // the first batch's states, kept for the weights
    float shift = detail::kNegInf;  // the row's (MergeParams::row_shift), found below
    const auto load_states = [&](int64_t i0, SoftmaxState (&s)[kBatch]) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (i0 + j < p.parts) s[j] = p.part_state(i0 + j, row, shift);
    };
    // The states of parts [i0, i0 + kBatch): the first batch's as kept, later ones loaded.
    const auto states_of = [&](int64_t i0, SoftmaxState (&s)[kBatch]) {
      if (i0 == 0) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) s[j] = first[j];
      } else {
        load_states(i0, s);
      }
    };
    // The first batch's pieces, then its LSEs, all in flight together; the row's shift
    // (MergeParams::row_shift) from those LSEs and any later part's, then their states.
    load_batch(0);
    float first_lse[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      first_lse[j] = j < p.parts ? p.lses[row + j * p.lses_part_stride] : detail::kNegInf;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) shift = MergeParams::fold_shift(shift, first_lse[j]);
    for (int64_t i0 = kBatch; i0 < p.parts; i0 += kBatch) {  // later parts' LSEs, a batch's
      float lse[kBatch];                                      // loads in flight together
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        lse[j] = i0 + j < p.parts ? p.lses[row + (i0 + j) * p.lses_part_stride] : detail::kNegInf;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) shift = MergeParams::fold_shift(shift, lse[j]);
    }
    shift = MergeParams::finish_shift(shift);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) first[j] = MergeParams::state_of(first_lse[j], shift);
    SoftmaxState total;
    for (int64_t i0 = 0; i0 < p.parts; i0 += kBatch) {
      SoftmaxState s[kBatch];
      states_of(i0, s);
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (i0 + j < p.parts) total.merge(s[j]);
    }
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int64_t i0 = 0; i0 < p.parts; i0 += kBatch) {
      SoftmaxState s[kBatch];
      if (i0 > 0) load_batch(i0);
      states_of(i0, s);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (i0 + j >= p.parts || !s[j].live()) continue;  // an empty part's piece is never used
        const float w = detail::combine_weight(s[j], total);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += w * v[j].get(e);  // 0 * NaN stays NaN
      }
    }
    if (c < p.head_dim) {
      W r[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) r[e] = B::from_float(acc[e]);
      store_words<W, kVec>(out + p.out_offset(t, h) + c, r);
    }
    if (p.lse != nullptr && c == 0) p.lse[lse_at] = MergeParams::merged_lse(total, shift);
  }
}

}  // namespace hipflash::merge
