// hipflash — merging attention states (SPEC §7): attention over disjoint key sets, combined by
// their LSEs with the split-K combine's math.
//
//   hipflash::merge_attn_states(outs, lses, out, &lse)
//
// outs stacks N partial outputs, lses their natural-log LSEs, in hipflash's layouts:
//   packed  outs [N, T, H, D]  lses [N, H, T]     ->  out [T, H, D]  lse [H, T]
//   dense   outs [N, T, H, D]  lses [N, B, H, S]  ->  out [T, H, D]  lse [B, H, S]
// where the dense form's T = B * S rows are the (batch, row) pairs of a [B, S, H, D] output
// (the Python function reshapes [N, B, S, H, D] for you)
// (the packed form is FlashAttention's and vLLM's merge_attn_states layout). out = sum_i w_i
// out_i with w_i = exp(lse_i - lse), lse = ln sum_i exp(lse_i): a part with lse -inf contributes
// nothing, all -inf gives out 0 and lse -inf, a NaN in any part's out or lse reaches the rows it
// touches. FlashInfer's base-2 LSE converts as lse = lse2 * ln 2 (and back: lse2 = lse * log2 e).
// The LSEs are fp32: at score magnitudes of ~1e7 and beyond an fp32 LSE keeps little of log l,
// so parts whose scores tie there are weighed by their LSEs' rounding (the forward's own
// split-K combine keeps (m, l) and is exact; an LSE interface cannot be).
// CPU tensors run on the host; GPU tensors run the merge kernel (kernels/merge) on `stream`, one
// pass over the parts with 16-byte loads where rows are 16-byte aligned. Both follow the same
// sequence of softmax-state operations (MergeParams::total_state); they differ only by the
// device's exp2/log2 and fused multiply-adds (within a rounding step of the output dtype).
#pragma once

#include "hipflash/forward.hpp"
#include "hipflash/merge_params.hpp"
#include "hipflash/types.hpp"

namespace hipflash {

/// The largest number of parts one merge takes.
inline constexpr int kMaxMergeParts = 256;

/// Merges N = outs.sizes[0] partial attention results (see the header comment for layouts).
/// outs: bf16, f16 or f32, last dimension contiguous, other strides free; lses: fp32, any
/// strides (views such as a slice of a larger LSE, or a transposed one, are read in place);
/// out: the dtype of outs, any strides with a contiguous last dimension; lse: fp32, any strides,
/// or nullptr. out and lse must not overlap themselves, each other or the parts.
void merge_attn_states(const TensorRef& outs, const TensorRef& lses, const TensorRef& out,
                       const TensorRef* lse, Stream stream = nullptr);

}  // namespace hipflash
