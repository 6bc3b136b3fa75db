// hipflash — the compile-time flags of a forward kernel, in one traits type.
#pragma once

#include <string>

#include "hipflash/types.hpp"

namespace hipflash {

/// Flags of one forward instantiation, folded where a flag cannot matter (STYLE.md, "Habits
/// worth taking" 4):
///  * split-K kernels always write partial LSE, so kSplit implies the LSE store;
///  * varlen, the Sk boundary and the split range are runtime (they cost a predicate per tile);
///  * causal is a window, so one kMasked flag covers causal and sliding windows.
/// kKvDType: k and v — kDType, or e4m3 for an fp8 KV cache (the kernels whose registry entry
/// reads one: kernels.def's cache_fp8).
template <DType kDType_, int kHeadDim_, bool kReturnLse_, bool kMasked_, bool kSplit_,
          DType kKvDType_ = kDType_>
struct FwdTraits {
  static constexpr DType kDType = kDType_;     ///< q (and out, but for e4m3)
  static constexpr DType kKvDType = kKvDType_; ///< k and v
  /// out: q's dtype, bf16 for fp8 (e4m3) q, k and v (FlashAttention 3's)
  static constexpr DType kOutDType = kDType_ == DType::e4m3 ? DType::bf16 : kDType_;
  static constexpr int kHeadDim = kHeadDim_;  ///< padded head dim of the instantiation
  static constexpr bool kReturnLse = kReturnLse_ || kSplit_;
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kSplit = kSplit_;
};

/// Flags of one backward instantiation (SPEC §7): the dtype of q, k, v, out and the gradients,
/// the padded head dim, and kMasked (causal or a sliding window), as FwdTraits folds it. The
/// deterministic choice and varlen are runtime (a separate dq pass; per-sequence bounds).
template <DType kDType_, int kHeadDim_, bool kMasked_>
struct BwdTraits {
  static constexpr DType kDType = kDType_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kMasked = kMasked_;
};

/// The runtime twin of FwdTraits: which instantiation a call needs.
struct KernelKey {
  DType dtype = DType::f16;
  int head_dim = 128;  ///< padded
  bool return_lse = false;
  bool masked = false;
  bool split = false;
  DType kv_dtype = DType::f16;  ///< k and v: dtype, or e4m3 (an fp8 KV cache)

  /// Self-describing name, e.g. "bf16_hd128_causal_lse" (STYLE.md, "Habits worth taking" 12).
  std::string name() const {
    std::string s = dtype == DType::bf16   ? "bf16"
                    : dtype == DType::f16  ? "fp16"
                    : dtype == DType::e4m3 ? "fp8"
                                           : "unsupported";
    if (kv_dtype == DType::e4m3 && dtype != DType::e4m3) s += "_kvfp8";  // a cache of its own
    s += "_hd" + std::to_string(head_dim);
    if (masked) s += "_masked";
    if (split) s += "_splitk";
    else if (return_lse) s += "_lse";
    return s;
  }
};

}  // namespace hipflash
