// hipflash — the one plain params struct of merge_attn_states (SPEC §7), shared by the CPU
// implementation (src/merge.cpp) and the GPU merge kernel (kernels/merge/merge_kernel.hpp), so
// that both index the parts and the LSEs the same way.
//
// Rows t of the parts are the [T, H, D] rows of the stacked outs [N, T, H, D]. The LSEs of a row
// sit at (t / lse_seqlen, h, t % lse_seqlen) of a [batch, H, lse_seqlen] layout: the dense form
// ([N, B, H, S] -> [B, H, S], T = B * S) has lse_seqlen = S, the packed form ([N, H, T] -> [H, T])
// lse_seqlen = T with a batch stride of 0.
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD
#include "hipflash/types.hpp"

namespace hipflash {

struct MergeParams {
  const void* __restrict__ outs = nullptr;  ///< [N, T, H, D], dtype
  const float* __restrict__ lses = nullptr; ///< natural-log LSE of each part, fp32
  void* __restrict__ out = nullptr;         ///< [T, H, D], dtype
  float* __restrict__ lse = nullptr;        ///< merged LSE, fp32; nullptr: not written

  int64_t parts = 0, rows = 0, heads = 0, head_dim = 0;
  DType dtype = DType::bf16;  ///< of outs and out: bf16, f16 or f32

  // Strides in elements; the last dimension of outs and out is contiguous.
  int64_t outs_part_stride = 0, outs_row_stride = 0, outs_head_stride = 0;
  int64_t out_row_stride = 0, out_head_stride = 0;

  int64_t lse_seqlen = 1;  ///< >= 1; see the header comment
  int64_t lses_part_stride = 0, lses_batch_stride = 0, lses_head_stride = 0, lses_row_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 0;

  /// Offset in `lses` of part 0's LSE of (row t, head h); part i's is i * lses_part_stride on.
  HIPFLASH_HD int64_t lses_offset(int64_t t, int64_t h) const {
    return (t / lse_seqlen) * lses_batch_stride + h * lses_head_stride +
           (t % lse_seqlen) * lses_row_stride;
  }
  /// Offset in `lse` of the merged LSE of (row t, head h).
  HIPFLASH_HD int64_t lse_offset(int64_t t, int64_t h) const {
    return (t / lse_seqlen) * lse_batch_stride + h * lse_head_stride +
           (t % lse_seqlen) * lse_row_stride;
  }
  HIPFLASH_HD int64_t outs_offset(int64_t i, int64_t t, int64_t h) const {
    return i * outs_part_stride + t * outs_row_stride + h * outs_head_stride;
  }
  HIPFLASH_HD int64_t out_offset(int64_t t, int64_t h) const {
    return t * out_row_stride + h * out_head_stride;
  }

  /// The shift of a row whose part-0 LSE is at `row`: its largest finite LSE (0 if it has
  /// none). Every part's state is taken relative to it, so that the base-2 maxima stay finite
  /// for every finite LSE (lse * log2(e) overflows fp32 above ~2.4e38) and the differences
  /// that weigh the parts keep their bits at any magnitude; the merged LSE adds it back
  /// (merged_lse). ±inf and NaN LSEs keep their meaning: -inf - shift is still empty, +inf and
  /// NaN still reach the total.
  HIPFLASH_HD float row_shift(int64_t row) const {
    float shift = detail::kNegInf;
    for (int64_t i = 0; i < parts; ++i) shift = fold_shift(shift, lses[row + i * lses_part_stride]);
    return finish_shift(shift);
  }
  /// row_shift's steps, for a caller that holds some LSEs already: fold each in (start from
  /// -inf), then finish.
  HIPFLASH_HD static float fold_shift(float shift, float lse) {
    return lse > shift && lse < -detail::kNegInf ? lse : shift;  // finite: NaN, +inf compare false
  }
  HIPFLASH_HD static float finish_shift(float shift) {
    return shift == detail::kNegInf ? 0.f : shift;
  }
  /// The softmax state of a part with natural-log LSE `lse` in a row with that shift. A finite
  /// LSE so far below the row's largest that the difference (or its base-2 form) overflows to
  /// -inf still names a part that saw keys: its weight underflows to 0, and that 0 still
  /// multiplies its out (0 x NaN is NaN). So the difference is held at kFloor, finite in both
  /// forms, instead; -inf (an empty part) and NaN pass as they are.
  static constexpr float kFloor = -2e38f;
  HIPFLASH_HD static detail::SoftmaxState state_of(float lse, float shift) {
    const float x = lse - shift;
    return detail::SoftmaxState::from_lse(lse != detail::kNegInf && x < kFloor ? kFloor : x);
  }
  /// Part i's state of the row whose part-0 LSE is at `row` (lses_offset).
  HIPFLASH_HD detail::SoftmaxState part_state(int64_t i, int64_t row, float shift) const {
    return state_of(lses[row + i * lses_part_stride], shift);
  }
  /// The merged state of that row: every part's state merged in part order (the split-K
  /// combine's math; -inf parts are empty, a NaN LSE makes the total NaN). CPU and GPU run
  /// this same sequence of operations.
  HIPFLASH_HD detail::SoftmaxState total_state(int64_t row, float shift) const {
    detail::SoftmaxState total;
    for (int64_t i = 0; i < parts; ++i) total.merge(part_state(i, row, shift));
    return total;
  }
  /// The natural-log LSE of a merged state (total_state) of a row with that shift.
  HIPFLASH_HD static float merged_lse(const detail::SoftmaxState& total, float shift) {
    return total.lse() + shift;
  }
};

}  // namespace hipflash
