// hipflash — the backward's view of the problem (host and device): a sequence's bounds, the
// query rows that see a key block (the dk/dv pass walks them), and the row pointers of the
// gradients. The key range of a query block (the dq pass) is common::BlockInfo's.
#pragma once

#include <cstdint>

#include "hipflash/bwd_params.hpp"

namespace hipflash::bwd {

/// Sequence b's first rows and lengths (varlen: from cu_seqlens; dense: 0 and the call's).
struct SeqBounds {
  int64_t q_start = 0, k_start = 0, len_q = 0, len_k = 0;
  int64_t diag = 0;  ///< len_k - len_q: key j is on row i's diagonal at j = i + diag

  HIPFLASH_HD SeqBounds(const FwdParams& p, int64_t b) {
    if (p.cu_seqlens_q != nullptr) {
      q_start = p.cu_seqlens_q[b];
      k_start = p.cu_seqlens_k[b];
      len_q = p.cu_seqlens_q[b + 1] - q_start;
      len_k = p.cu_seqlens_k[b + 1] - k_start;
    } else {
      len_q = p.seqlen_q;
      len_k = p.seqlen_k;
    }
    diag = len_k - len_q;
  }

  /// The query rows [lo, hi) that see at least one key of [n0, n1) under the window (SPEC §3:
  /// row i sees keys [i + diag - left, i + diag + right], -1 unbounded).
  HIPFLASH_HD void rows_seeing(const FwdParams& p, int64_t n0, int64_t n1, int64_t& lo,
                               int64_t& hi) const {
    lo = p.window_right >= 0 ? n0 - diag - p.window_right : 0;
    hi = p.window_left >= 0 ? n1 - 1 - diag + p.window_left + 1 : len_q;
    lo = lo < 0 ? 0 : lo;
    hi = hi > len_q ? len_q : hi;
    if (hi < lo) hi = lo;
  }

  /// Whether the tile of rows [m0, m0 + bm) and keys [n0, n0 + bn) needs per-element masking:
  /// keys past the sequence, or a window edge inside the tile (common::BlockInfo::needs_mask's
  /// rule for any tile).
  HIPFLASH_HD bool pair_needs_mask(const FwdParams& p, int64_t m0, int bm, int64_t n0, int bn,
                                   bool masked) const {
    if (n0 + bn > len_k) return true;
    if (!masked) return false;
    if (p.window_left >= 0 && n0 < m0 + bm - 1 + diag - p.window_left) return true;
    if (p.window_right >= 0 && n0 + bn - 1 > m0 + diag + p.window_right) return true;
    return false;
  }
};

/// Row 0 of (batch b, head h) of sequence `s` in a dense [B, S, H, D] or varlen [total, H, D]
/// tensor with these strides (varlen: batch stride 0, rows offset by the sequence start).
template <class T>
HIPFLASH_HD T* rows_of(T* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                       int64_t b, int64_t start, int64_t h) {
  return base + b * batch_stride + start * row_stride + h * head_stride;
}

}  // namespace hipflash::bwd
