// hipflash — the one plain params struct of the forward kernels.
//
// Built by the launcher from validated TensorRefs (see make_fwd_params in src/); kernels take
// it by value. Strides are in elements and 64-bit; the last dimension always has stride 1.
#pragma once

#include <cstdint>

#include "hipflash/detail/fast_div.hpp"
#include "hipflash/detail/softmax_state.hpp"
#include "hipflash/types.hpp"

namespace hipflash {

/// Problems with at most this many query rows per (batch, head) take the decode kernels (their
/// query block; checked against the kernels' tile where they are launched).
inline constexpr int64_t kDecodeMaxRows = 16;

/// The largest split-K count a call may ask for (FwdOptions::num_splits); the combine kernel
/// keeps one LSE per split in registers, sized by it.
inline constexpr int kMaxSplits = 256;

/// The largest softmax_scale a call may pass: beyond it |q.k| * scale * log2(e) overflows fp32
/// for ordinary inputs and the softmax turns into inf - inf.
inline constexpr float kMaxSoftmaxScale = 65536.f;

/// An fp8 call's descale factor (FlashAttention 3's q_descale / k_descale / v_descale): one
/// fp32 value for the tensor (both strides 0) or one per (batch, kv head); nullptr: 1.
struct Descale {
  const float* __restrict__ ptr = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  HIPFLASH_HD float at(int64_t b, int64_t h_kv) const {
    return ptr ? ptr[b * batch_stride + h_kv * head_stride] : 1.f;
  }
};

struct FwdParams {
  // Operands. Dense: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]. Varlen: the batch stride is 0 and
  // sequence b starts at row cu_seqlens_q[b] (cu_seqlens_k[b]).
  const void* __restrict__ q = nullptr;
  const void* __restrict__ k = nullptr;
  const void* __restrict__ v = nullptr;
  void* __restrict__ out = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // LSE, natural log, fp32. Written only by kReturnLse kernels; nullptr otherwise.
  // Dense and padded varlen: [B, Hq, Sq or max_seqlen_q]. Packed varlen: [Hq, total_q], where
  // lse_batch_stride is 0 and the row is offset by cu_seqlens_q[b].
  float* __restrict__ lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 1;
  LseLayout lse_layout = LseLayout::padded;

  // Varlen: int32 [B + 1] prefix sums, or nullptr for dense.
  const int32_t* __restrict__ cu_seqlens_q = nullptr;
  const int32_t* __restrict__ cu_seqlens_k = nullptr;
  // Varlen: FlashAttention 3's seqused_q / seqused_k, int32 [B] or nullptr: sequence b's used
  // query rows / keys (at most its cu_seqlens length). The CPU backend reads them.
  const int32_t* __restrict__ seqused_q = nullptr;
  const int32_t* __restrict__ seqused_k = nullptr;

  // KV cache (SPEC §7, kvcache_forward; dense q only). seqlens_k: int32 [B], sequence b has
  // seqlens_k[b] + seqlen_k_new keys (nullptr: seqlen_k each). block_table: int32 [B, *] with
  // row stride block_table_stride, or nullptr for a contiguous cache; when set, k/v are pages
  // [num_blocks, page_size, Hkv, D], k_batch_stride / v_batch_stride are the page strides, and
  // key j of sequence b is row j % page_size of page block_table[b][j / page_size]
  // (common::PagedRows for powers of two from 16 rows, common::GatheredRows for any other).
  const int32_t* __restrict__ seqlens_k = nullptr;
  int64_t seqlen_k_new = 0;
  const int32_t* __restrict__ block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_shift = 0;     ///< log2(page_size) when it is a power of two
  int64_t page_size = 0;  ///< rows a page (any size >= 1)
  detail::FastDiv page_div;  ///< page_size as a divisor (a sequence's rows are below 2^31)
  /// The KV cache's batch indirection (FlashAttention's cache_batch_idx), int32 [B] or nullptr:
  /// sequence b reads and appends to cache entry cache_batch_idx[b] of a contiguous cache, or
  /// through row cache_batch_idx[b] of block_table (block_table_row).
  const int32_t* __restrict__ cache_batch_idx = nullptr;
  /// FlashAttention's cache_leftpad, int32 [B] or nullptr: sequence b's keys are cache rows
  /// [cache_leftpad[b], seqlens_k[b] + seqlen_k_new) (SeqBounds::k_start; a contiguous cache on
  /// the GPU).
  const int32_t* __restrict__ cache_leftpad = nullptr;

  int64_t batch = 0;
  int64_t seqlen_q = 0;  ///< dense Sq, or max_seqlen_q for varlen
  int64_t seqlen_k = 0;  ///< dense Sk, or max_seqlen_k for varlen
  /// Varlen: the rows of q / out and of k / v (the packed tensors' extents, which a tensor map
  /// of them describes as one batch); 0 for dense calls.
  int64_t total_q = 0, total_k = 0;
  int64_t heads_q = 0, heads_kv = 0;
  int64_t head_dim = 0;

  DType dtype = DType::f16;      ///< q, k, v (and out, but for fp8)
  DType out_dtype = DType::f16;  ///< out: dtype, or bf16 for e4m3 inputs
  DType kv_dtype = DType::f16;   ///< k, v: dtype, or e4m3 for an fp8 KV cache (bf16 / f16 q)
  /// e4m3 inputs: the scores are q.k * q_descale * k_descale (then softmax_scale), out is
  /// P.v * v_descale, each at (batch, kv head); an fp8 KV cache's k_scale / v_scale are its
  /// k_descale / v_descale.
  Descale q_descale, k_descale, v_descale;
  float softmax_scale = 1.f;
  float softcap = 0.f;  ///< > 0: scores capped to softcap * tanh(score / softcap) (detail::Softcap)
  /// ALiBi slopes, fp32 [Hq] (alibi_batch_stride 0) or [B, Hq], or nullptr: row i's score of key
  /// j gets detail::alibi_bias(slope, i + Sk - Sq, j) (per sequence for varlen and a KV cache).
  const float* __restrict__ alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  /// A packed GQA decode call (gpu_backend.cu's pack_gqa_decode): the query heads of a kv head
  /// per row block, row r of kv head h being query head h * gqa_packed_heads + r of the call's
  /// one query row; 0 otherwise. The kernels read it for ALiBi's per-head slopes.
  int64_t gqa_packed_heads = 0;
  // Key j is valid for row i when  i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right;
  // -1 means unbounded. Causal is (window_left, 0).
  int64_t window_left = -1, window_right = -1;

  bool return_lse = false;
  int num_splits = 1;  ///< resolved split count (1 .. kMaxSplits); the heuristic has already run

  // Split-K workspace (num_splits > 1): fp32 partial out [splits, B, Hq, Sq, D] (normalised by
  // the split's own sum) and the split's softmax state (m, l) [splits, B, Hq, Sq], contiguous,
  // indexed by the padded row. The state, not a rounded LSE, so the combine is exact for tied
  // rows at any score magnitude (see detail::combine_weight).
  float* __restrict__ out_partial = nullptr;
  detail::SoftmaxState* __restrict__ state_partial = nullptr;

  /// Offset in `lse` of row `row` (counted from its sequence's first row, q_start) of query
  /// head h of batch b (SPEC §2): the one LSE index of the kernels, the combine kernel and the
  /// CPU backend.
  HIPFLASH_HD int64_t lse_offset(int64_t b, int64_t h, int64_t q_start, int64_t row) const {
    const int64_t r = lse_layout == LseLayout::packed && cu_seqlens_q ? q_start + row : row;
    return b * lse_batch_stride + h * lse_head_stride + r * lse_row_stride;
  }
  /// Row of (split, b, h, row) in the split-K workspace ([splits, B, Hq, Sq(max)], padded rows).
  HIPFLASH_HD int64_t partial_row(int split, int64_t b, int64_t h, int64_t row) const {
    return ((int64_t(split) * batch + b) * heads_q + h) * seqlen_q + row;
  }

  /// Sequence b's row of the block table (row cache_batch_idx[b] where that is set).
  HIPFLASH_HD const int32_t* block_table_row(int64_t b) const {
    return block_table + (cache_batch_idx ? int64_t(cache_batch_idx[b]) : b) * block_table_stride;
  }

  /// The ALiBi slope of (batch b, query head h); 0 without ALiBi.
  HIPFLASH_HD float alibi_slope(int64_t b, int64_t h) const {
    return alibi_slopes ? alibi_slopes[b * alibi_batch_stride + h] : 0.f;
  }

  HIPFLASH_HD bool is_varlen() const { return cu_seqlens_q != nullptr; }
  /// The rows and batches of q's and of k's (v's) TMA tensor maps: a varlen call's packed rows
  /// as one batch, else (Sq or Sk, B).
  int64_t map_rows_q() const { return is_varlen() ? total_q : seqlen_q; }
  int64_t map_rows_k() const { return is_varlen() ? total_k : seqlen_k; }
  int64_t map_batch() const { return is_varlen() ? 1 : batch; }
  bool is_kvcache() const { return seqlens_k != nullptr || block_table != nullptr; }
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  /// The softcap or ALiBi modifies the scores (SPEC §3).
  bool has_score_mods() const { return softcap > 0.f || alibi_slopes != nullptr; }
  /// GQA decode (one query row, no window, dense): the GPU launcher packs the query heads that
  /// share a kv head into the rows of one query block (see gpu_backend.cu). With ALiBi (the
  /// kernels that read a slope a row) or an fp8 KV cache (the kernel that reads one) only where
  /// those rows fit the decode kernels' block.
  bool packs_gqa_decode() const {
    return seqlen_q == 1 && !has_window() && !is_varlen() && heads_q > heads_kv &&
           dtype != DType::e4m3 &&  // fp8 q, k and v: the sm90_ws kernel, rows as they are
           ((alibi_slopes == nullptr && kv_dtype != DType::e4m3) ||
            heads_q / heads_kv <= kDecodeMaxRows);
  }
  /// Query rows and heads per batch as the GPU kernels see them (the packing above applied).
  int64_t gpu_query_rows() const { return packs_gqa_decode() ? heads_q / heads_kv : seqlen_q; }
  int64_t gpu_heads() const { return packs_gqa_decode() ? heads_kv : heads_q; }
};

}  // namespace hipflash
