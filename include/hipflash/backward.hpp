// hipflash — the backward pass (SPEC §7): gradients of the forward from its saved
// (q, k, v, out, lse).
//
//   hipflash::backward(dout, q, k, v, out, lse, dq, dk, dv, opts)
//
// P is recomputed from the forward's LSE (P_ij = exp(s_ij - lse_i), never a second online
// softmax): a wrong LSE gives wrong gradients. D_i = rowsum(dO_i * O_i); dS = P (dP - D);
// dq = scale dS k, dk = scale dS^T q (summed over the query heads of a kv head), dv = P^T dO.
// Rows with no valid key (lse -inf) get zero gradients; NaN propagates.
// Dense (q/dq [B, Sq, Hq, D], k/v/dk/dv [B, Sk, Hkv, D], lse [B, Hq, Sq]) and varlen layouts;
// CPU tensors. The GPU kernels are not built yet: a GPU call throws hipflash::not_implemented.
#pragma once

#include <optional>

#include "hipflash/forward.hpp"

namespace hipflash {

struct BwdOptions {
  std::optional<float> softmax_scale;  ///< the forward's (default 1/sqrt(D))
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  /// Bitwise-repeatable gradients. The CPU backward always is (each kv head's dk/dv are
  /// accumulated by one thread, in a fixed order); the flag is for the GPU kernels to come.
  bool deterministic = true;
};

/// Gradients of forward(q, k, v) -> (out, lse) for upstream gradient dout (like out). dq like
/// q, dk / dv like k / v, all of q's dtype; every argument is validated first and nothing is
/// written on a bad call.
void backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k, const TensorRef& v,
              const TensorRef& out, const TensorRef& lse, const TensorRef& dq,
              const TensorRef& dk, const TensorRef& dv, const BwdOptions& opts = {},
              Stream stream = nullptr);

/// The varlen backward: q/dq [total_q, Hq, D], k/v/dk/dv [total_k, Hkv, D], the forward's LSE
/// in the layout it was written with (opts.lse_layout), cu_seqlens as for varlen_forward.
struct VarlenBwdOptions : BwdOptions {
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  LseLayout lse_layout = LseLayout::padded;
};
void varlen_backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k,
                     const TensorRef& v, const TensorRef& out, const TensorRef& lse,
                     const TensorRef& cu_seqlens_q, const TensorRef& cu_seqlens_k,
                     const TensorRef& dq, const TensorRef& dk, const TensorRef& dv,
                     const VarlenBwdOptions& opts, Stream stream = nullptr);

}  // namespace hipflash
