// hipflash — shared by every forward schedule: which (batch, head, query block, split) a thread
// block owns, its sequence bounds, the key blocks it visits, and the mask. Host and device code:
// the CPU-side tests of the schedules (tests/cpp/test_dualwave.cpp) walk blocks with it too.
#pragma once

#include <cstdint>

#include "common/kv_source.hpp"
#include "hipflash/detail/fast_div.hpp"
#include "hipflash/params.hpp"  // HIPFLASH_HD: host and device (the host tests use it too)

namespace hipflash::common {

/// x / d rounded towards negative infinity (d > 0): a window's edge may lie before key 0.
HIPFLASH_HD int64_t floor_div(int64_t x, int64_t d) {
  return x >= 0 ? x / d : -((-x + d - 1) / d);
}

/// Sequence b's first rows and lengths: varlen from cu_seqlens; dense 0 and the call's, a KV
/// cache its cached keys plus the appended ones. The forward's BlockInfo and the backward's
/// passes (bwd::SeqBounds) both derive them here.
struct SeqBounds {
  int64_t q_start = 0, k_start = 0;  ///< first row of this sequence (varlen), else 0
  int64_t len_q = 0, len_k = 0;
  int64_t diag = 0;  ///< len_k - len_q: key j is on row i's diagonal at j = i + diag

  SeqBounds() = default;
  HIPFLASH_HD SeqBounds(const FwdParams& p, int64_t b) {
    if (p.cu_seqlens_q != nullptr) {
      q_start = p.cu_seqlens_q[b];
      k_start = p.cu_seqlens_k[b];
      // FlashAttention 3's seqused: the rows and keys the sequence uses (validated <= its
      // cu_seqlens lengths; the unused rows are varlen::unused_rows_kernel's).
      len_q = p.seqused_q != nullptr ? p.seqused_q[b] : p.cu_seqlens_q[b + 1] - q_start;
      len_k = p.seqused_k != nullptr ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - k_start;
    } else {
      q_start = 0;
      len_q = p.seqlen_q;
      // A KV cache: sequence b holds its cached keys plus the appended ones, from its left
      // padding on (FlashAttention's cache_leftpad; validated <= its cached length).
      k_start = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
      len_k = (p.seqlens_k != nullptr ? p.seqlens_k[b] + p.seqlen_k_new : p.seqlen_k) - k_start;
    }
    diag = len_k - len_q;
  }
};

/// A block's mask held in a few ints (BlockInfo::row_mask): key blocks [full_lo, full_hi] need
/// no per-element mask for these rows, and row h's valid keys are [lo[h], hi[h]] (sequence
/// columns). Ints: a sequence's rows and keys are int-indexed in every kernel.
template <int kBlockN, int N>
struct RowMask {
  int full_lo, full_hi;
  int lo[N], hi[N];

  HIPFLASH_HD bool needs_mask(int n) const { return n < full_lo || n > full_hi; }
  /// Row h's valid keys in key block n as columns [l, r] relative to the block, clamped to
  /// [-1, kBlockN] (empty when l > r): BlockInfo::key_range's result.
  HIPFLASH_HD void key_range(int h, int n, int& l, int& r) const {
    const int a = lo[h] - n * kBlockN, b = hi[h] - n * kBlockN;
    l = a < -1 ? -1 : a > kBlockN ? kBlockN : a;
    r = b < -1 ? -1 : b > kBlockN ? kBlockN : b;
  }
};

/// The divisions that decode a work tile's index into (query block, split, head, batch) and
/// the KV head, prepared on the host (detail::FastDiv): exact for tile indices below 2^31,
/// which the launchers that pass them check.
struct TileDivisors {
  detail::FastDiv m_blocks, splits, heads_q, group;

  TileDivisors() = default;
  TileDivisors(const FwdParams& p, int64_t num_m_blocks)
      : m_blocks(uint32_t(num_m_blocks)),
        splits(uint32_t(p.num_splits)),
        heads_q(uint32_t(p.heads_q)),
        group(uint32_t(p.heads_q / p.heads_kv)) {}
};

template <int kBlockM, int kBlockN>
struct BlockInfo : SeqBounds {
  int64_t b, h, h_kv;
  int m_block, split;
  int n_block_min, n_block_max;  ///< key blocks [min, max) this block visits

  /// blockIdx.x enumerates (m_block fastest, then split, head, batch): one dimension, so
  /// B >= 65536 and Hq >= 65536 launch without overflowing grid.y/z.
  HIPFLASH_HD BlockInfo(const FwdParams& p, int64_t linear, int num_m_blocks,
                                       bool reverse_m) {
    m_block = int(linear % num_m_blocks);
    int64_t rest = linear / num_m_blocks;
    split = int(rest % p.num_splits);
    rest /= p.num_splits;
    h = rest % p.heads_q;
    b = rest / p.heads_q;
    h_kv = h / (p.heads_q / p.heads_kv);
    bound(p, num_m_blocks, reverse_m);
  }
  /// The same tile decoded by the host's divisors (TileDivisors: a few multiplies, for kernels
  /// that decode a tile per loop iteration).
  HIPFLASH_HD BlockInfo(const FwdParams& p, int64_t linear, const TileDivisors& div,
                        bool reverse_m) {
    uint32_t m = 0, s = 0, hq = 0;
    uint32_t rest = div.m_blocks.divmod(uint32_t(linear), m);
    rest = div.splits.divmod(rest, s);
    b = div.heads_q.divmod(rest, hq);
    m_block = int(m);
    split = int(s);
    h = hq;
    h_kv = div.group.div(hq);
    bound(p, int(div.m_blocks.divisor), reverse_m);
  }

 private:
  /// From (batch, head, query block, split): the sequence bounds and the key blocks.
  HIPFLASH_HD void bound(const FwdParams& p, int num_m_blocks, bool reverse_m) {
    if (reverse_m) m_block = num_m_blocks - 1 - m_block;  // heavy causal blocks first
    static_cast<SeqBounds&>(*this) = SeqBounds(p, b);
    // Keys any row of this block may see (SPEC §3 window, bottom-right aligned).
    const int64_t m0 = int64_t(m_block) * kBlockM;
    int64_t lo = 0, hi = len_k;
    if (p.window_left >= 0) lo = m0 + diag - p.window_left;
    if (p.window_right >= 0) hi = m0 + kBlockM - 1 + diag + p.window_right + 1;
    lo = lo < 0 ? 0 : lo;
    hi = hi > len_k ? len_k : hi;
    const int total_blocks = int((len_k + kBlockN - 1) / kBlockN);
    n_block_min = int(lo / kBlockN);
    n_block_max = hi > lo ? int((hi + kBlockN - 1) / kBlockN) : n_block_min;
    if (p.num_splits > 1) {  // the split's share of the sequence's key blocks
      const int per_split = (total_blocks + p.num_splits - 1) / p.num_splits;
      const int s_lo = split * per_split, s_hi = s_lo + per_split;
      n_block_min = n_block_min > s_lo ? n_block_min : s_lo;
      n_block_max = n_block_max < s_hi ? n_block_max : s_hi;
    }
    if (n_block_max < n_block_min) n_block_max = n_block_min;
  }

 public:
  /// Whether key block n needs per-element masking for this query block.
  HIPFLASH_HD bool needs_mask(const FwdParams& p, int n, bool masked) const {
    const int64_t n0 = int64_t(n) * kBlockN, m0 = int64_t(m_block) * kBlockM;
    if (n0 + kBlockN > len_k) return true;
    if (!masked) return false;
    if (p.window_left >= 0 && n0 < m0 + kBlockM - 1 + diag - p.window_left) return true;
    if (p.window_right >= 0 && n0 + kBlockN - 1 > m0 + diag + p.window_right) return true;
    return false;
  }

  /// The valid keys of query row i inside the key block starting at n0, as columns [lo, hi]
  /// relative to n0 and clamped to [-1, kBlockN] (empty when lo > hi): the same rule as
  /// key_valid, evaluated once per row so the per-element test is two int compares.
  HIPFLASH_HD void key_range(const FwdParams& p, int64_t i, int64_t n0,
                                            bool masked, int& lo, int& hi) const {
    int64_t l = 0, h = len_k - 1;
    if (masked && p.window_left >= 0 && i + diag - p.window_left > l) l = i + diag - p.window_left;
    if (masked && p.window_right >= 0 && i + diag + p.window_right < h) h = i + diag + p.window_right;
    l -= n0;
    h -= n0;
    lo = int(l < -1 ? -1 : l > kBlockN ? kBlockN : l);
    hi = int(h < -1 ? -1 : h > kBlockN ? kBlockN : h);
  }

  /// The mask of kRows rows from row i0 (the tile's, or one warpgroup's share of it) in a few
  /// ints, for key loops short of registers: a RowMask<kBlockN, N> for the thread's rows
  /// row_of(0 .. N - 1). The same rule as needs_mask / key_range.
  template <int kRows, int N, class RowOf>
  HIPFLASH_HD auto row_mask(const FwdParams& p, int64_t i0, bool masked,
                            const RowOf& row_of) const;

  /// Row 0 of this block's (batch, head) — of its sequence, for varlen — in q, k, v and out.
  template <class T>
  HIPFLASH_HD const T* q_rows(const FwdParams& p) const {
    return static_cast<const T*>(p.q) + b * p.q_batch_stride + q_start * p.q_row_stride +
           h * p.q_head_stride;
  }
  template <class T>
  HIPFLASH_HD const T* k_rows(const FwdParams& p) const {
    return static_cast<const T*>(p.k) + b * p.k_batch_stride + k_start * p.k_row_stride +
           h_kv * p.k_head_stride;
  }
  template <class T>
  HIPFLASH_HD const T* v_rows(const FwdParams& p) const {
    return static_cast<const T*>(p.v) + b * p.v_batch_stride + k_start * p.v_row_stride +
           h_kv * p.v_head_stride;
  }
  template <class T>
  HIPFLASH_HD T* o_rows(const FwdParams& p) const {
    return static_cast<T*>(p.out) + b * p.o_batch_stride + q_start * p.o_row_stride +
           h * p.o_head_stride;
  }

  /// The same rows as row sources for the tile loaders (common/kv_source.hpp).
  template <class T>
  HIPFLASH_HD ContiguousRows<T> q_source(const FwdParams& p) const {
    return {q_rows<T>(p), p.q_row_stride};
  }
  template <class T>
  HIPFLASH_HD ContiguousRows<T> k_source(const FwdParams& p) const {
    return {k_rows<T>(p), p.k_row_stride};
  }
  template <class T>
  HIPFLASH_HD ContiguousRows<T> v_source(const FwdParams& p) const {
    return {v_rows<T>(p), p.v_row_stride};
  }

  /// K and V as the loaders of a kernel instantiated for `kKv` read them (SPEC §7): through
  /// the pages of p.block_table (common::PagedRows or GatheredRows; k_rows / v_rows are wrong
  /// for a paged cache), else k_source / v_source. A compile-time choice: the launcher runs a
  /// paged instantiation only for calls with a block table of its page sizes, so the kernels
  /// of every other call are the contiguous code alone (the NVIDIA decode and generic kernels
  /// have all three; a KV cache is refused on AMD).
  /// A contiguous cache with FlashAttention's cache_batch_idx reads entry cache_batch_idx[b].
  template <class T, KvRows kKv>
  HIPFLASH_HD auto k_source_of(const FwdParams& p) const {
    return kv_source_of<T, kKv>(p, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                k_rows<T>(p));
  }
  template <class T, KvRows kKv>
  HIPFLASH_HD auto v_source_of(const FwdParams& p) const {
    return kv_source_of<T, kKv>(p, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                v_rows<T>(p));
  }
  template <class T, KvRows kKv>
  HIPFLASH_HD auto kv_source_of(const FwdParams& p, const void* cache, int64_t batch_stride,
                                int64_t row_stride, int64_t head_stride, const T* rows) const {
    const T* head = static_cast<const T*>(cache) + h_kv * head_stride;
    if constexpr (kKv == KvRows::pages)
      return PagedRows<const T>{head, p.block_table_row(b), batch_stride, row_stride,
                                p.page_shift};
    else if constexpr (kKv == KvRows::gathered)  // from the cache's leftpad row
      return GatheredRows<const T>{head, p.block_table_row(b), batch_stride, row_stride,
                                   p.page_div, p.cache_leftpad ? p.cache_leftpad[b] : 0};
    else
      return ContiguousRows<T>{rows + cache_entry_offset(p) * batch_stride, row_stride};
  }
  /// Batches from b to the cache entry this sequence reads (cache_batch_idx[b] - b; 0 without).
  HIPFLASH_HD int64_t cache_entry_offset(const FwdParams& p) const {
    return p.cache_batch_idx ? int64_t(p.cache_batch_idx[b]) - b : 0;
  }

  /// Whether key j is valid for query row i (both relative to this sequence).
  HIPFLASH_HD static bool key_valid(const FwdParams& p, int64_t i, int64_t j,
                                                   int64_t len_k, int64_t diag, bool masked) {
    if (j >= len_k) return false;
    if (!masked) return true;
    if (p.window_left >= 0 && j < i + diag - p.window_left) return false;
    if (p.window_right >= 0 && j > i + diag + p.window_right) return false;
    return true;
  }
};

template <int kBlockM, int kBlockN>
template <int kRows, int N, class RowOf>
HIPFLASH_HD auto BlockInfo<kBlockM, kBlockN>::row_mask(const FwdParams& p, int64_t i0,
                                                        bool masked, const RowOf& row_of) const {
  const auto clamp = [](int64_t x) {
    return int(x < -(int64_t(1) << 30) ? -(1 << 30) : x > (int64_t(1) << 30) ? 1 << 30 : x);
  };
  RowMask<kBlockN, N> m;
  // needs_mask(n) is false exactly for n0 + kBlockN <= len_k and, masked, inside both window
  // edges for every row of [i0, i0 + kRows): a range of blocks.
  int64_t hi = len_k / kBlockN - 1, lo = 0;
  if (masked && p.window_right >= 0) {
    const int64_t h = floor_div(i0 + diag + p.window_right - kBlockN + 1, kBlockN);
    hi = h < hi ? h : hi;
  }
  if (masked && p.window_left >= 0) {
    const int64_t l = -floor_div(-(i0 + kRows - 1 + diag - p.window_left), kBlockN);  // ceiling
    lo = l > lo ? l : lo;
  }
  m.full_lo = clamp(lo);
  m.full_hi = clamp(hi);
  for (int h = 0; h < N; ++h) {
    const int64_t i = row_of(h);
    int64_t l = 0, r = len_k - 1;
    if (masked && p.window_left >= 0 && i + diag - p.window_left > l)
      l = i + diag - p.window_left;
    if (masked && p.window_right >= 0 && i + diag + p.window_right < r)
      r = i + diag + p.window_right;
    m.lo[h] = clamp(l);
    m.hi[h] = clamp(r);
  }
  return m;
}

}  // namespace hipflash::common
