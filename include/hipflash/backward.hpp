// hipflash — the backward pass (SPEC §7): gradients of the forward from its saved
// (q, k, v, out, lse).
//
//   hipflash::backward(dout, q, k, v, out, lse, dq, dk, dv, opts)
//
// P is recomputed from the forward's LSE (P_ij = exp(s_ij - lse_i), never a second online
// softmax): a wrong LSE gives wrong gradients. D_i = rowsum(dO_i * O_i); dS = P (dP - D);
// dq = scale dS k, dk = scale dS^T q (summed over the query heads of a kv head), dv = P^T dO.
// Rows with no valid key (lse -inf) get zero gradients; NaN propagates.
// Dense layouts (q/dq [B, Sq, Hq, D], k/v/dk/dv [B, Sk, Hkv, D], lse [B, Hq, Sq]); CPU tensors.
// The GPU kernels and varlen are not built yet: such calls throw hipflash::not_implemented.
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

}  // namespace hipflash
