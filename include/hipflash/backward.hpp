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
// CPU tensors run the CPU backward; GPU tensors the backward kernels (kernels/bwd: warpgroup
// MMAs on Hopper, mma.sync on other NVIDIA GPUs, the portable kernels on AMD), which take a
// workspace from `workspace` (or allocate it on the stream) of R = B * Hq * round_up(Sq, 128)
// rows: 4 R (2 + D) bytes (D the padded head dim; deterministic off Hopper: 4 R 2 bytes), and
// on Hopper (head dims up to 128) when deterministic R / 16 bytes more (a counter per 64
// rows) plus 4 (a tile counter) when causal or windowed; and on Hopper, for a causal or
// windowed dense GQA call whose dk/dv tiles take slices of a kv head's query heads
// (bwd_heads_per_tile in hipflash/detail/selector.hpp), 8 s B Hkv round_up(Sk, 128) D bytes
// more (s slices; at most 2 x 4 tiles a multiprocessor of 128 keys each: s B Hkv round_up(Sk,
// 128) <= 1024 x the multiprocessors).
#pragma once

#include <optional>

#include "hipflash/forward.hpp"

namespace hipflash {

struct BwdOptions {
  std::optional<float> softmax_scale;  ///< the forward's (default 1/sqrt(D))
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.f;  ///< the forward's (FwdOptions::softcap)
  const TensorRef* alibi_slopes = nullptr;  ///< the forward's (FwdOptions::alibi_slopes)
  /// Bitwise-repeatable gradients. The CPU backward always is (each kv head's dk/dv are
  /// accumulated by one thread, in a fixed order). On the GPU dk/dv always are (one thread block
  /// owns a key block of a kv head and walks its query heads, or a slice of them whose sums a
  /// later pass adds in slice order); dq, when set, is summed in a
  /// fixed order (on Hopper by the dk/dv pass, its terms ordered by counters; elsewhere by a
  /// separate pass), else added by fp32 atomics from the dk/dv pass (faster, the order of the
  /// additions varies from run to run). Repeatable run to run on one GPU model: the order may
  /// differ between models (it follows the multiprocessor count) and between deterministic
  /// and default calls. False by default, as in FlashAttention.
  bool deterministic = false;
};

/// Gradients of forward(q, k, v) -> (out, lse) for upstream gradient dout (like out). dq like
/// q, dk / dv like k / v, all of q's dtype; every argument is validated first and nothing is
/// written on a bad call.
void backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k, const TensorRef& v,
              const TensorRef& out, const TensorRef& lse, const TensorRef& dq,
              const TensorRef& dk, const TensorRef& dv, const BwdOptions& opts = {},
              Stream stream = nullptr, Workspace workspace = {});

/// The varlen backward: q/dq [total_q, Hq, D], k/v/dk/dv [total_k, Hkv, D], the forward's LSE
/// in the layout it was written with (opts.lse_layout), cu_seqlens as for varlen_forward.
struct VarlenBwdOptions : BwdOptions {
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  LseLayout lse_layout = LseLayout::padded;
  const TensorRef* seqused_q = nullptr;  ///< the forward's (VarlenOptions::seqused_q)
  const TensorRef* seqused_k = nullptr;  ///< the forward's (VarlenOptions::seqused_k)
};
void varlen_backward(const TensorRef& dout, const TensorRef& q, const TensorRef& k,
                     const TensorRef& v, const TensorRef& out, const TensorRef& lse,
                     const TensorRef& cu_seqlens_q, const TensorRef& cu_seqlens_k,
                     const TensorRef& dq, const TensorRef& dk, const TensorRef& dv,
                     const VarlenBwdOptions& opts, Stream stream = nullptr,
                     Workspace workspace = {});

}  // namespace hipflash
