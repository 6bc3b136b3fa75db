// hipflash — attention against a KV cache (SPEC §7), contiguous or paged.
//
//   hipflash::kvcache_forward(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
//                             out, lse, opts, stream)
//
// q        [B, Sq, Hq, D]                      bf16 / f16, last dimension contiguous (the
//          caches q's dtype, or float8_e4m3fn with KvCacheOptions::k_scale / v_scale: CPU only)
// k_cache  [B, S_cache, Hkv, D]                contiguous cache (block_table == nullptr), or
//          [num_blocks, page_size, Hkv, D]     paged cache, any page_size >= 1
// v_cache  the shape of k_cache
// block_table   int32 [B, max_blocks], last dimension contiguous: row j of sequence b lives in
//               page block_table[b][j / page_size], at row j % page_size of that page
// cache_seqlens int32 [B], contiguous, or nullptr: sequence b holds cache_seqlens[b] keys
//               (nullptr: every sequence fills its capacity, S_cache or max_blocks * page_size)
// k_new, v_new  [B, S_new, Hkv, D] or nullptr: appended in place at rows cache_seqlens[b] ...
//               cache_seqlens[b] + S_new - 1 of sequence b before attending (needs cache_seqlens)
// out      [B, Sq, Hq, D]; lse fp32 [B, Hq, Sq] contiguous (only with opts.return_lse)
//
// Sequence b attends to its first cache_seqlens[b] + S_new keys; causal and windows are
// bottom-right aligned against that length (SPEC §3 with Sk = that length). A paged and a
// contiguous cache holding the same rows give bitwise the same out and LSE.
//
// Checked before anything is written (SPEC §4): shapes, dtypes, devices, page size, that
// cache_seqlens[b] >= 0 and cache_seqlens[b] + S_new fit the sequence's capacity, and that the
// block-table entries a sequence uses (the first ceil(length / page_size)) name existing pages.
// Entries past a sequence's length are never read, so they may hold anything (e.g. -1). Two
// sequences whose entries name the same page are not detected: appending to both writes one page.
//
// CPU tensors run on the CPU backend. GPU tensors (NVIDIA; run on the H200): the append kernel
// (kernels/kvcache), then the decode or generic kernel — its paged instantiation (reading K/V
// through common::PagedRows) for a paged cache, never an sm90 kernel — split-K and LSE as for
// forward(); cache_seqlens is copied to the host for the checks above unless the caller passes
// its values (KvCacheOptions::cache_seqlens_host; skipped while the stream captures a graph
// without them), the block table is not: on the GPU an entry out of range is not detected
// (a device fault). AMD GPUs: not_implemented.
#pragma once

#include <vector>

#include "hipflash/forward.hpp"
#include "hipflash/types.hpp"

namespace hipflash {

/// Every page size >= 1 runs on the CPU and the GPU. The GPU kernels read pages of a power of
/// two from kGroupedPageSize rows a 16-row group at a time (one block-table entry per group);
/// any other page size gathers each row through the block table (page size 1: SGLang's
/// token-granular cache), still a bandwidth kernel.
inline constexpr int64_t kGroupedPageSize = 16;
inline constexpr bool grouped_page_size(int64_t page) {
  return page >= kGroupedPageSize && (page & (page - 1)) == 0;
}

/// Options of kvcache_forward: those of the forward (causal and windows are aligned against
/// each sequence's key count), and an fp8 cache's scales.
struct KvCacheOptions : FwdOptions {
  /// An fp8 KV cache (vLLM's kv_cache_dtype="fp8"): float8_e4m3fn k_cache / v_cache with
  /// bfloat16 / float16 q, holding K / k_scale and V / v_scale; fp32 [] / [1] scales, nullptr: 1.
  /// The scores are q.(k * k_scale), out is softmax . (v * v_scale) in q's dtype; appended rows
  /// are quantised in place as k / k_scale (v / v_scale), rounded to nearest even and saturated
  /// to +-448 (a NaN stays NaN). Refused with other cache dtypes. The CPU backend and NVIDIA GPUs
  /// running sm_89+ code of the build (Arch::fp8_cvt): the decode kernel up to 16 query rows per
  /// kv head, the generic kernel beyond.
  const TensorRef* k_scale = nullptr;
  const TensorRef* v_scale = nullptr;
  /// FlashAttention's cache_batch_idx: int32 [batch] on q's device, or nullptr. With a
  /// contiguous cache of any batch size, sequence b reads and appends to cache entry
  /// cache_batch_idx[b] (each in [0, k_cache.shape[0])); with a block_table of any number of
  /// rows, through its row cache_batch_idx[b] (FlashAttention 3's rule). An entry named twice
  /// is refused when k / v are appended (but while a GPU stream captures a graph, whose entries
  /// are not copied back: then it is the caller's error).
  const TensorRef* cache_batch_idx = nullptr;
  /// FlashAttention's cache_leftpad: int32 [batch] on q's device, or nullptr (0). Sequence b's
  /// keys start at row cache_leftpad[b] of its cache (each in [0, its cached length]): it
  /// attends to rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), causal and windows
  /// aligned to those keys; new rows are still appended at cache_seqlens[b]. Paged caches on
  /// CPU tensors only (a GPU call with a block_table raises not_implemented).
  const TensorRef* cache_leftpad = nullptr;
  /// The values of cache_seqlens and cache_leftpad as the caller already holds them in host
  /// memory (int32 [batch] each; nullptr: not held). A GPU call otherwise copies those tensors
  /// back to check them, and the copy waits for every kernel queued before it: in a decode loop,
  /// once per layer and step, the host then stops running ahead of the GPU. They must be the
  /// device tensors' values (hipflash's Python layer uploads the device tensors from them); the
  /// checks read them, also while a stream captures a graph.
  const int32_t* cache_seqlens_host = nullptr;
  const int32_t* cache_leftpad_host = nullptr;
};

/// Attention of q against a KV cache, after appending k_new / v_new (see the header comment).
void kvcache_forward(const TensorRef& q, const TensorRef& k_cache, const TensorRef& v_cache,
                     const TensorRef* k_new, const TensorRef* v_new,
                     const TensorRef* cache_seqlens, const TensorRef* block_table,
                     const TensorRef& out, const TensorRef* lse, const KvCacheOptions& opts = {},
                     Stream stream = nullptr, Workspace workspace = {});

/// A tensor and the name its errors use.
struct NamedRef {
  const TensorRef* ref;  ///< nullptr: an argument not given (skipped)
  const char* name;
};

/// SPEC §4's aliasing rules for buffers a caller writes before a hipflash call reads them (the
/// Python package's KV-cache appends by PyTorch ops, for varlen queries and attention_chunk,
/// before the read-only paged call): no written tensor may overlap itself (an expanded cache),
/// another written one, or any read one. invalid_argument naming the pair, as kvcache_forward's
/// own checks of its append. Nothing is read through the pointers.
void check_written_buffers(const std::vector<NamedRef>& written,
                           const std::vector<NamedRef>& read);

/// Chunked prefill (SPEC §7): varlen queries against a paged KV cache, FlashAttention-2's
/// The options of varlen queries against a paged cache: varlen_forward's, and an fp8 cache's
/// scales (KvCacheOptions::k_scale / v_scale: float8_e4m3fn k_cache / v_cache holding K / k_scale
/// and V / v_scale; nullptr: 1).
struct PagedVarlenOptions : VarlenOptions {
  PagedVarlenOptions() = default;
  PagedVarlenOptions(const VarlenOptions& o) : VarlenOptions(o) {}  // NOLINT: no scales
  const TensorRef* k_scale = nullptr;
  const TensorRef* v_scale = nullptr;
};

/// `flash_attn_varlen_func(..., block_table=...)`. q / out [total_q, Hq, D] with cu_seqlens_q as
/// for varlen_forward; k_cache / v_cache [num_blocks, page_size, Hkv, D] (any page_size >= 1);
/// block_table int32 [B, max_blocks]; cu_seqlens_k int32 [B + 1]: sequence b
/// attends to the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its cache (the cache
/// already holds the chunk's own keys), causal / windows bottom-right against that length; LSE
/// in opts.lse_layout. Checked first: everything varlen_forward checks, the page size, each
/// sequence's length against max_blocks * page_size, and the block-table entries it uses. The
/// same out and LSE, bitwise, as varlen_forward on the sequences' keys gathered contiguously.
/// On NVIDIA GPUs the paged instantiations of the decode and generic kernels read it (as for
/// kvcache_forward, the block-table entries of a GPU call are not copied back to be checked:
/// an entry out of range is the caller's error, docs/spec.md §7); AMD: not_implemented. An fp8
/// cache (bfloat16 / float16 q) as kvcache_forward reads one: the CPU backend, NVIDIA sm_89+.
void varlen_paged_forward(const TensorRef& q, const TensorRef& k_cache, const TensorRef& v_cache,
                          const TensorRef& out, const TensorRef* lse, const TensorRef& cu_seqlens_q,
                          const TensorRef& cu_seqlens_k, const TensorRef& block_table,
                          const PagedVarlenOptions& opts, Stream stream = nullptr,
                          Workspace workspace = {});

}  // namespace hipflash
