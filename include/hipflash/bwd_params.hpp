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
  /// With dq_semaphore, masked and varlen calls: the tiles the dk/dv pass has handed out
  /// (bwd_sm90_ws_kernel.hpp's TileFeed), zeroed with the counters.
  int32_t* __restrict__ tile_counter = nullptr;
  int64_t seqlen_rounded = 0;
  int padded_head_dim = 0;
  /// lse_log2 and delta in 16-row blocks (the warp-specialised dk/dv pass), each permuted so
  /// that a consumer thread's four columns of it lie together (16 bytes): row 8k + 2t + e of a
  /// block at 4t + 2k + e (false: row order, the other passes').
  bool stats_permuted = false;
  /// Where (b, h, row)'s lse_log2 and delta are: ws_row's index, permuted within its 16-row
  /// block (blocks start at multiples of 16: seqlen_rounded is one).
  HIPFLASH_HD int64_t stats_index(int64_t ws) const {
    if (!stats_permuted) return ws;
    const int c = int(ws & 15);
    return ws - c + (c & 7) / 2 * 4 + c / 8 * 2 + (c & 1);
  }
  /// GQA calls whose warp-specialised dk/dv tiles walk heads_per_tile of a kv head's Hq / Hkv
  /// query heads (0: all of them): each tile writes its slice's dK (scaled) and dV to
  /// dkv_accum, fp32 [2 (dk, dv), slices, B, Hkv, seqlen_k_rounded, padded head dim], and the
  /// conversion after the pass sums the slices in order into dk / dv (bitwise repeatable).
  int heads_per_tile = 0;
  int64_t seqlen_k_rounded = 0;
  float* __restrict__ dkv_accum = nullptr;

  /// The query heads one dk/dv tile walks: its slice, or the kv head's whole group.
  HIPFLASH_HD int64_t tile_query_heads() const {
    return heads_per_tile > 0 ? heads_per_tile : heads_q / heads_kv;
  }
  /// The key blocks (block_n keys each) a dk/dv tile walks: its sequence's; for varlen calls
  /// the mean sequence's (total_k / batch), a typical tile's rather than the longest one's.
  HIPFLASH_HD int64_t tile_key_blocks(int block_n) const {
    const int64_t keys = is_varlen() && batch > 0 ? (total_k + batch - 1) / batch : seqlen_k;
    return (keys + block_n - 1) / block_n;
  }
  /// Slices of a kv head's query heads (1: whole groups).
  HIPFLASH_HD int64_t dkv_slices() const {
    return heads_per_tile > 0 ? heads_q / heads_kv / heads_per_tile : 1;
  }
  /// Floats in one slice's dk (or dv) part of dkv_accum.
  HIPFLASH_HD int64_t dkv_part() const {
    return batch * heads_kv * seqlen_k_rounded * padded_head_dim;
  }
  /// dkv_accum's row of (dk: half 0, dv: 1), slice, b, kv head, key.
  HIPFLASH_HD float* dkv_row(int half, int64_t slice, int64_t b, int64_t hk, int64_t key) const {
    return dkv_accum + (half * dkv_slices() + slice) * dkv_part() +
           ((b * heads_kv + hk) * seqlen_k_rounded + key) * padded_head_dim;
  }

  /// The workspace row of (b, h, row): lse_log2 / delta at stats_index of it; dq_accum's
  /// 16-row group at it rounded down to 16, times padded_head_dim (bwd::dq_accum_index).
  HIPFLASH_HD int64_t ws_row(int64_t b, int64_t h, int64_t row) const {
    return (b * heads_q + h) * seqlen_rounded + row;
  }
};

}  // namespace hipflash
