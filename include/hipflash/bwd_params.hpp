// hipflash — the one plain params struct of the backward kernels (SPEC §7).
//
// The forward's FwdParams (q, k, v, out, the LSE and its layout, masks, varlen) plus the
// upstream gradient, the three gradients and the fp32 workspace the backward kernels share.
// Built by src/backward.cpp from validated TensorRefs; kernels take it by value.
#pragma once

#include <cstdint>

#include "hipflash/params.hpp"

namespace hipflash {

struct BwdParams : FwdParams {
  // dout like out; dq like q; dk, dv like k, v (all of q's dtype). Strides in elements.
  const void* __restrict__ dout = nullptr;
  void* __restrict__ dq = nullptr;
  void* __restrict__ dk = nullptr;
  void* __restrict__ dv = nullptr;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  /// Bitwise-repeatable dq: a separate dq pass sums each row's key blocks in a fixed order.
  /// Otherwise the dk/dv pass adds its dq terms into dq_accum with fp32 atomics.
  bool deterministic = true;

  // Workspace, fp32, indexed by (b, h, row) with the row padded to seqlen_rounded (rows of a
  // varlen sequence counted from its first): the forward's LSE in base 2 with -inf (a row that
  // sees no key) turned into +inf so that exp2(s - lse) is 0; D = rowsum(dO * O); and, where
  // the dk/dv pass adds dq (atomic or ordered), dq_accum [B, Hq, seqlen_rounded, padded head dim].
  float* __restrict__ lse_log2 = nullptr;
  float* __restrict__ delta = nullptr;
  float* __restrict__ dq_accum = nullptr;
  /// Deterministic dq inside the warp-specialised dk/dv pass: a counter per (b, h, 64-row block)
  /// of dq_accum, zeroed with it, of the key blocks whose terms it holds; each key block adds
  /// its term when the counter reaches its rank (key-block order), so the fp32 sums are
  /// repeatable. Null: atomic dq, or the deterministic dq pass.
  int32_t* __restrict__ dq_semaphore = nullptr;
  /// With dq_semaphore, masked calls: the tiles the dk/dv pass has handed out
  /// (bwd_sm90_ws_kernel.hpp's TileFeed), zeroed with the counters.
  int32_t* __restrict__ tile_counter = nullptr;
  int64_t seqlen_rounded = 0;
  int padded_head_dim = 0;
  /// GQA calls whose warp-specialised dk/dv tiles walk heads_per_tile of a kv head's Hq / Hkv
  /// query heads (0: all of them): the tiles of one key block then add their dK (scaled) and
  /// dV into dkv_accum, fp32 [2 (dk, dv), B, Hkv, seqlen_k_rounded, padded head dim], zeroed
  /// by the preprocess and rounded into dk / dv by the conversion after the pass.
  int heads_per_tile = 0;
  int64_t seqlen_k_rounded = 0;
  float* __restrict__ dkv_accum = nullptr;

  /// Index of (b, kv head, key) in one half of dkv_accum; times padded_head_dim, its row.
  HIPFLASH_HD int64_t dkv_row(int64_t b, int64_t hk, int64_t key) const {
    return (b * heads_kv + hk) * seqlen_k_rounded + key;
  }
  /// Floats in one half of dkv_accum (dk's; dv's follow).
  HIPFLASH_HD int64_t dkv_half() const {
    return batch * heads_kv * seqlen_k_rounded * padded_head_dim;
  }

  /// Index of (b, h, row) in lse_log2 / delta; times padded_head_dim, the row of dq_accum.
  HIPFLASH_HD int64_t ws_row(int64_t b, int64_t h, int64_t row) const {
    return (b * heads_q + h) * seqlen_rounded + row;
  }
};

}  // namespace hipflash
