// hipflash — kvcache_forward (SPEC §7): validation of the cache, its lengths and block table,
// the append of new keys/values, then the forward's select -> dispatch on FwdParams that read
// K/V through the cache (per-sequence lengths; pages through the block table).
#include "hipflash/kvcache.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "common/kv_source.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "tensor_checks.hpp"

static_assert(hipflash::common::PagedRows<float>::kMinRows == hipflash::kGroupedPageSize,
              "the kernels' paged loaders group rows by the smallest page");

namespace hipflash {
namespace {

using detail::check_disjoint;
using detail::check_no_self_overlap;
using detail::shape_str;

/// A cache-like operand: rank 4, sizes >= 0, indexable in 64 bits, q's dtype (or, fp8_ok: a
/// cache, float8_e4m3fn) and device, contiguous last dimension.
void check_operand(const TensorRef& t, const char* name, const TensorRef& q, const char* layout,
                   bool fp8_ok = false) {
  HIPFLASH_CHECK(t.rank == 4, name, " must have rank 4 (", layout, "), got shape ", shape_str(t));
  for (int i = 0; i < 4; ++i)
    HIPFLASH_CHECK(t.sizes[i] >= 0, name, " has a negative size: ", shape_str(t));
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(t, &why), name, " with shape ", shape_str(t),
                 " cannot be indexed in 64 bits: ", why);
  detail::check_known_location(t, name);
  HIPFLASH_CHECK_AS(dtype_error, t.dtype == q.dtype || (fp8_ok && t.dtype == DType::e4m3), name,
                    " must have dtype ", dtype_name(q.dtype), " (the dtype of q)",
                    fp8_ok ? " or float8_e4m3fn (an fp8 cache)" : "", ", got ",
                    dtype_name(t.dtype));
  HIPFLASH_CHECK(t.loc == q.loc, name, " must be on the device of q");
  HIPFLASH_CHECK(detail::last_dim_contiguous(t), name,
                 " must have a contiguous last dimension (stride 1), got stride ", t.strides[3]);
  HIPFLASH_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data pointer");
}

/// An int32 index tensor of the given rank on q's device, contiguous last dimension.
void check_index(const TensorRef& t, const char* name, int rank, const char* layout,
                 const TensorRef& q) {
  HIPFLASH_CHECK(t.dtype == DType::i32, name, " must have dtype int32, got ", dtype_name(t.dtype));
  HIPFLASH_CHECK(t.rank == rank, name, " must have rank ", rank, " (", layout, "), got shape ",
                 shape_str(t));
  const char* why = "";
  HIPFLASH_CHECK(detail::indexable(t, &why), name, " cannot be indexed in 64 bits: ", why);
  HIPFLASH_CHECK(detail::last_dim_contiguous(t), name,
                 " must have a contiguous last dimension (stride 1)");
  HIPFLASH_CHECK(t.loc == q.loc, name, " must be on the device of q");
  HIPFLASH_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data pointer");
}

bool power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int log2_of(int64_t x) {
  int s = 0;
  while ((int64_t(1) << s) < x) ++s;
  return s;
}

/// A paged cache's page size (any >= 1) and its sequences' capacity, max_blocks * page rows:
/// below 2^31, as a sequence's length (int32) is, so that row indices divide in 32 bits.
void check_pages(int64_t page, int64_t max_blocks, const char* what) {
  HIPFLASH_CHECK(page >= 1, "the page size (", what, ") must be >= 1, got ", page);
  HIPFLASH_CHECK(max_blocks <= ((int64_t(1) << 31) - 1) / page,
                 "block_table has too many columns: max_blocks_per_seq * page_size (",
                 max_blocks, " * ", page, ") must be below 2^31");
}

/// A paged cache's block table and page size into p: the size, its divisor (the GPU kernels'
/// gathered rows) and, for a power of two, its log2 (their 16-row groups).
void point_at_pages(FwdParams& p, const TensorRef& block_table, int64_t page) {
  p.block_table = static_cast<const int32_t*>(block_table.data);
  p.block_table_stride = block_table.strides[0];
  p.page_size = page;
  p.page_shift = power_of_two(page) ? log2_of(page) : 0;
  p.page_div = detail::FastDiv(uint32_t(page));
}

/// The entries of block-table row b that a sequence uses for `keys` rows (the first
/// ceil(keys / page)) must name pages of the cache; entries past them are never read.
void check_pages_used(const TensorRef& block_table, int64_t b, int64_t keys, int64_t page,
                      int64_t num_blocks) {
  const auto* row = static_cast<const int32_t*>(block_table.data) + b * block_table.strides[0];
  const int64_t used = (keys + page - 1) / page;
  for (int64_t e = 0; e < used; ++e)
    HIPFLASH_CHECK(row[e] >= 0 && row[e] < num_blocks, "block_table[", b, ", ", e, "] = ",
                   row[e], " is not a page of the cache (num_blocks = ", num_blocks, ")");
}

/// The operands of a GPU call: 16-byte aligned, every stride but the last (which is 1) a
/// multiple of 16 bytes (8 elements; 16 of an fp8 cache), as the kernels' 16-byte vector loads
/// need.
void check_gpu_vectors(std::initializer_list<std::pair<const TensorRef*, const char*>> operands) {
  for (auto [t, name] : operands) {
    HIPFLASH_CHECK((reinterpret_cast<uintptr_t>(t->data) & 15u) == 0, name,
                   " must be 16-byte aligned for the GPU kernels");
    const int64_t per16 = 16 / dtype_size(t->dtype);
    for (int d = 0; d + 1 < t->rank; ++d)
      HIPFLASH_CHECK(t->strides[d] % per16 == 0, name, " strides must be multiples of ", per16,
                     " elements (16 bytes) for the GPU kernels, got ", t->strides[d]);
  }
}

/// p's K and V: the cache's data and strides (batch or page, row, head).
void point_at_cache(FwdParams& p, const TensorRef& k_cache, const TensorRef& v_cache) {
  p.k = k_cache.data;
  p.v = v_cache.data;
  p.k_batch_stride = k_cache.strides[0], p.k_row_stride = k_cache.strides[1];
  p.k_head_stride = k_cache.strides[2];
  p.v_batch_stride = v_cache.strides[0], p.v_row_stride = v_cache.strides[1];
  p.v_head_stride = v_cache.strides[2];
}

/// Copies the rows of `src` ([B, S_new, Hkv, D], q's dtype) to rows cache_seqlens[b] + j of
/// the cache at `cache` (strides of FwdParams: batch or page, row, head) through its row source,
/// contiguous or paged: the append, on host memory. An fp8 cache (p.kv_dtype e4m3) takes each
/// value divided by `scale`, rounded to nearest even and saturated to +-448 (NaN stays NaN).
void append_on_cpu(const FwdParams& p, const TensorRef& src, void* cache, int64_t batch_stride,
                   int64_t row_stride, int64_t head_stride, float scale) {
  const int64_t es = dtype_size(p.kv_dtype);  // bytes an element of the cache
  const bool quantise = p.kv_dtype != src.dtype;
  auto* rows = static_cast<char*>(cache);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t start = p.seqlens_k[b];
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const int32_t* table = p.block_table ? p.block_table_row(b) : nullptr;
      for (int64_t j = 0; j < src.sizes[1]; ++j) {
        const int64_t from = b * src.strides[0] + j * src.strides[1] + hk * src.strides[2];
        const int64_t r = start + j;  // any page size: a division per row
        const int64_t to = table ? hk * head_stride + table[r / p.page_size] * batch_stride +
                                       (r % p.page_size) * row_stride
                                 : (p.cache_batch_idx ? p.cache_batch_idx[b] : b) * batch_stride +
                                       hk * head_stride + r * row_stride;
        if (!quantise) {
          std::memcpy(rows + to * es, static_cast<const char*>(src.data) + from * es,
                      size_t(p.head_dim * es));
          continue;
        }
        for (int64_t d = 0; d < p.head_dim; ++d) {
          const float x = detail::load_as_float(src.data, from + d, src.dtype) / scale;
          const float clamped = std::isnan(x) ? x : std::clamp(x, -448.f, 448.f);
          detail::store_from_float(rows, to + d, clamped, p.kv_dtype);
        }
      }
    }
  }
}

/// An fp8 cache's scales (KvCacheOptions::k_scale / v_scale): fp32 [] / [1] on q's device, not
/// written by the call; into p's k_descale / v_descale. Refused for other cache dtypes.
void fill_cache_scales(FwdParams& p, const TensorRef* k_scale, const TensorRef* v_scale,
                       const TensorRef& q,
                       std::initializer_list<std::pair<const TensorRef*, const char*>> written) {
  for (auto [t, dst, name] : {std::tuple{k_scale, &p.k_descale, "k_scale"},
                              std::tuple{v_scale, &p.v_descale, "v_scale"}}) {
    if (t == nullptr) continue;
    HIPFLASH_CHECK(p.kv_dtype == DType::e4m3, name, " applies to float8_e4m3fn caches only (the "
                   "cache is ", dtype_name(p.kv_dtype), ")");
    HIPFLASH_CHECK_AS(dtype_error, t->dtype == DType::f32, name, " must have dtype float32, got ",
                      dtype_name(t->dtype));
    HIPFLASH_CHECK(t->rank == 0 || (t->rank == 1 && t->sizes[0] == 1), name,
                   " must have shape [] or [1] (one scale for the cache), got ", shape_str(*t));
    HIPFLASH_CHECK(t->data != nullptr, name, " has no data pointer");
    HIPFLASH_CHECK(t->loc == q.loc, name, " must be on the device of q");
    for (auto [w, w_name] : written)
      if (w) check_disjoint(*w, w_name, *t, name);
    *dst = {static_cast<const float*>(t->data), 0, 0};
  }
}

}  // namespace

void kvcache_forward(const TensorRef& q, const TensorRef& k_cache, const TensorRef& v_cache,
                     const TensorRef* k_new, const TensorRef* v_new,
                     const TensorRef* cache_seqlens, const TensorRef* block_table,
                     const TensorRef& out, const TensorRef* lse, const KvCacheOptions& opts,
                     Stream stream, Workspace workspace) {
  // ---- Shapes, dtypes, devices (SPEC §4): nothing is read or written before these pass.
  HIPFLASH_CHECK(q.rank == 4, "q must have rank 4 ([batch, seqlen_q, heads_q, head_dim]), got ",
                 "shape ", shape_str(q));
  HIPFLASH_CHECK_AS(not_implemented, q.dtype != DType::e4m3,
                    "float8_e4m3fn queries with a KV cache are not implemented: an fp8 cache "
                    "(float8_e4m3fn k_cache / v_cache) takes bfloat16 or float16 queries");
  const bool paged = block_table != nullptr;
  const char* cache_layout = paged ? "[num_blocks, page_size, heads_kv, head_dim] with a block_table"
                                   : "[batch, seqlen_cache, heads_kv, head_dim]";
  check_operand(k_cache, "k_cache", q, cache_layout, true);
  check_operand(v_cache, "v_cache", q, cache_layout, true);
  HIPFLASH_CHECK_AS(dtype_error, v_cache.dtype == k_cache.dtype, "v_cache must have dtype ",
                    dtype_name(k_cache.dtype), " (the dtype of k_cache), got ",
                    dtype_name(v_cache.dtype));
  const bool fp8 = k_cache.dtype == DType::e4m3;
  for (int i = 0; i < 4; ++i)
    HIPFLASH_CHECK(v_cache.sizes[i] == k_cache.sizes[i], "k_cache and v_cache must have the same "
                   "shape: k_cache ", shape_str(k_cache), ", v_cache ", shape_str(v_cache));
  const int64_t batch = q.sizes[0];
  int64_t capacity = k_cache.sizes[1], page = 0, max_blocks = 0;
  if (paged) {
    check_index(*block_table, "block_table", 2, "[batch, max_blocks_per_seq]", q);
    page = k_cache.sizes[1];
    // With cache_batch_idx, sequence b reads row cache_batch_idx[b] (FlashAttention 3's rule).
    HIPFLASH_CHECK(opts.cache_batch_idx != nullptr || block_table->sizes[0] == batch,
                   "block_table must have one row per sequence (batch = ", batch, "), got shape ",
                   shape_str(*block_table));
    max_blocks = block_table->sizes[1];
    check_pages(page, max_blocks, "k_cache.shape[1] with a block_table");
    capacity = max_blocks * page;
  } else if (opts.cache_batch_idx == nullptr) {
    HIPFLASH_CHECK(k_cache.sizes[0] == batch, "k_cache must have the batch size of q (", batch,
                   ") without a block_table, got shape ", shape_str(k_cache));
  }
  // cache_batch_idx: the entry of a contiguous cache, or the block-table row, sequence b uses.
  const TensorRef* batch_idx = opts.cache_batch_idx;
  std::vector<int32_t> idx;  // its entries on the host (none while a stream captures)
  const int64_t entries = paged ? block_table->sizes[0] : k_cache.sizes[0];
  if (batch_idx) {
    check_index(*batch_idx, "cache_batch_idx", 1, "[batch]", q);
    HIPFLASH_CHECK(batch_idx->sizes[0] == batch, "cache_batch_idx must have one entry per "
                   "sequence (batch = ", batch, "), got shape ", shape_str(*batch_idx));
    // The entries, on the host: copied back from a GPU as cache_seqlens are (not while the
    // stream captures a graph, where an entry out of range is the caller's error, as for a
    // block table: docs/spec.md §7).
    idx.assign(size_t(batch), 0);
    const bool on_gpu = q.loc.kind == Location::gpu;
    if (batch > 0 && !on_gpu)
      std::memcpy(idx.data(), batch_idx->data, size_t(batch) * sizeof(int32_t));
    else if (batch > 0 && !gpu::stream_capturing(stream))
      gpu::copy_to_host(idx.data(), batch_idx->data, size_t(batch) * sizeof(int32_t), stream);
    else
      idx.clear();
    for (size_t b = 0; b < idx.size(); ++b)
      HIPFLASH_CHECK(idx[b] >= 0 && idx[b] < entries, "cache_batch_idx[", b, "] = ", idx[b],
                     paged ? " is not a row of block_table (block_table.shape[0] = "
                           : " is not an entry of the cache (k_cache.shape[0] = ",
                     entries, ")");
    // Two sequences appending to one entry would write the same rows (on the GPU in no order).
    if (k_new != nullptr) {
      std::vector<int32_t> sorted = idx;
      std::sort(sorted.begin(), sorted.end());
      const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
      HIPFLASH_CHECK(dup == sorted.end(), "cache_batch_idx names entry ",
                     dup == sorted.end() ? 0 : *dup, " twice: sequences appending k and v need "
                     "entries of their own");
    }
  }
  // The forward's checks of q, out, lse and the options, against a view of the cache with the
  // right batch and q's dtype; a paged cache (no batch) and an fp8 one (another dtype) as
  // empty views: their overlap with out is checked below.
  TensorRef k_view = k_cache, v_view = v_cache;
  for (TensorRef* t : {&k_view, &v_view}) {
    t->dtype = q.dtype;
    if (paged || fp8 || batch_idx) t->sizes[0] = batch, t->sizes[1] = 0;
  }
  FwdParams p = make_dense_params(q, k_view, v_view, out, lse, opts);
  p.kv_dtype = k_cache.dtype;
  fill_cache_scales(p, opts.k_scale, opts.v_scale, q, {{&out, "out"}, {opts.return_lse ? lse : nullptr, "lse"},
                                 {k_new ? &k_cache : nullptr, "k_cache"},
                                 {k_new ? &v_cache : nullptr, "v_cache"}});
  if (paged || fp8 || batch_idx) {
    for (auto [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
      check_disjoint(out, "out", *t, name);
      if (opts.return_lse) check_disjoint(*lse, "lse", *t, name);
    }
  }
  HIPFLASH_CHECK((k_new == nullptr) == (v_new == nullptr), "k and v (the new keys and values) "
                 "must be given together");
  int64_t s_new = 0;
  if (k_new) {
    HIPFLASH_CHECK(cache_seqlens != nullptr, "appending k and v needs cache_seqlens (where each "
                   "sequence's new rows go)");
    check_operand(*k_new, "k", q, "[batch, seqlen_new, heads_kv, head_dim]");
    check_operand(*v_new, "v", q, "[batch, seqlen_new, heads_kv, head_dim]");
    for (int i = 0; i < 4; ++i)
      HIPFLASH_CHECK(v_new->sizes[i] == k_new->sizes[i], "k and v must have the same shape: k ",
                     shape_str(*k_new), ", v ", shape_str(*v_new));
    HIPFLASH_CHECK(k_new->sizes[0] == batch && k_new->sizes[2] == k_cache.sizes[2] &&
                       k_new->sizes[3] == k_cache.sizes[3],
                   "k must have shape [batch, seqlen_new, heads_kv, head_dim] = [", batch,
                   ", *, ", k_cache.sizes[2], ", ", k_cache.sizes[3], "], got ", shape_str(*k_new));
    s_new = k_new->sizes[1];
    // The caches are written first, then read with q: no row of one may be another row's
    // (an expanded, stride-0 cache would take every sequence's rows into one place), and
    // nothing they are read with may share their memory.
    check_written_buffers({{&k_cache, "k_cache"}, {&v_cache, "v_cache"}},
                          {{k_new, "k"}, {v_new, "v"}, {&q, "q"}, {cache_seqlens, "cache_seqlens"},
                           {block_table, "block_table"}, {batch_idx, "cache_batch_idx"},
                           {opts.cache_leftpad, "cache_leftpad"}});
    for (auto [r, r_name] : {std::pair{k_new, "k"}, {v_new, "v"}}) {
      check_disjoint(out, "out", *r, r_name);
      if (opts.return_lse) check_disjoint(*lse, "lse", *r, r_name);
    }
  }
  if (cache_seqlens) {
    check_index(*cache_seqlens, "cache_seqlens", 1, "[batch]", q);
    HIPFLASH_CHECK(cache_seqlens->sizes[0] == batch, "cache_seqlens must have one entry per "
                   "sequence (batch = ", batch, "), got shape ", shape_str(*cache_seqlens));
  }
  const TensorRef* leftpad = opts.cache_leftpad;
  const bool gpu = q.loc.kind == Location::gpu;
  if (leftpad) {
    check_index(*leftpad, "cache_leftpad", 1, "[batch]", q);
    HIPFLASH_CHECK(leftpad->sizes[0] == batch, "cache_leftpad must have one entry per sequence "
                   "(batch = ", batch, "), got shape ", shape_str(*leftpad));
  }
  for (const TensorRef* t : {cache_seqlens, block_table, batch_idx, leftpad}) {
    if (!t) continue;
    const char* name = t == cache_seqlens ? "cache_seqlens"
                       : t == block_table ? "block_table"
                       : t == batch_idx   ? "cache_batch_idx" : "cache_leftpad";
    check_disjoint(out, "out", *t, name);
    if (opts.return_lse) check_disjoint(*lse, "lse", *t, name);
  }
  // The GPU kernels move 16-byte vectors (gpu::run_forward checks the same, but only after the
  // append would have written the caches).
  if (gpu) check_gpu_vectors({{&q, "q"}, {&out, "out"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}});

  // ---- The values: lengths, and (CPU) the block-table entries each sequence uses. On the GPU
  // the lengths are copied back as cu_seqlens are (not while the stream captures a graph); the
  // block table is not (a copy of every entry per call is not cheap): an entry out of range
  // there is the caller's error (docs/spec.md §7).
  std::vector<int32_t> lens(size_t(batch), 0), pads(size_t(batch), 0);
  const bool capturing = gpu && gpu::stream_capturing(stream);
  bool known = true;  // every value the checks need is on the host
  for (auto [t, held, host] : {std::tuple{cache_seqlens, opts.cache_seqlens_host, &lens},
                               {leftpad, opts.cache_leftpad_host, &pads}}) {
    if (!t || batch == 0) continue;
    const size_t bytes = size_t(batch) * sizeof(int32_t);
    if (!gpu || held) std::memcpy(host->data(), gpu ? held : t->data, bytes);
    else if (!capturing) gpu::copy_to_host(host->data(), t->data, bytes, stream);
    else known = false;
  }
  for (int64_t b = 0; b < batch && known; ++b) {
    const int64_t len = cache_seqlens ? int64_t(lens[size_t(b)]) : capacity;
    HIPFLASH_CHECK(len >= 0, "cache_seqlens[", b, "] = ", len, " is negative");
    const int64_t pad = pads[size_t(b)];
    HIPFLASH_CHECK(pad >= 0 && pad <= len, "cache_leftpad[", b, "] = ", pad, " is not in [0, ",
                   len, "] (the sequence's cached rows)");
    HIPFLASH_CHECK(len + s_new <= capacity, "sequence ", b, " needs ", len, " cached + ", s_new,
                   " new keys but its cache holds ", capacity,
                   paged ? " (max_blocks_per_seq * page_size)" : " (k_cache.shape[1])");
    if (paged && !gpu)
      check_pages_used(*block_table, batch_idx ? idx[size_t(b)] : b, len + s_new, page,
                       k_cache.sizes[0]);
  }

  // ---- FwdParams over the cache, the append, the forward.
  point_at_cache(p, k_cache, v_cache);
  p.seqlen_k = capacity;  // the longest a sequence can be: the split heuristic's key range
  p.seqlens_k = cache_seqlens ? static_cast<const int32_t*>(cache_seqlens->data) : nullptr;
  p.seqlen_k_new = s_new;
  if (paged) {
    point_at_pages(p, *block_table, page);
  }
  if (batch_idx) p.cache_batch_idx = static_cast<const int32_t*>(batch_idx->data);
  if (leftpad) p.cache_leftpad = static_cast<const int32_t*>(leftpad->data);
  // The window saturates against the capacity (the paged view above had no keys): no sequence
  // has more keys, so a left bound of capacity - 1 reaches every key (fill_window's rule).
  p.window_left = opts.window_left >= capacity - 1 ? -1 : opts.window_left;
  check_forward_plan(p, opts, q.loc);  // what would stop the forward stops the append too
  if (k_new && s_new > 0 && gpu) {
    gpu::run_kvcache_append(p, *k_new, *v_new, q.loc.index, stream);
  } else if (k_new && s_new > 0) {
    append_on_cpu(p, *k_new, k_cache.data, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                  p.k_descale.at(0, 0));
    append_on_cpu(p, *v_new, v_cache.data, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                  p.v_descale.at(0, 0));
  }
  dispatch_forward(p, opts, q.loc, stream, std::move(workspace));
}

void check_written_buffers(const std::vector<NamedRef>& written,
                           const std::vector<NamedRef>& read) {
  for (const auto& group : {&written, &read})
    for (const NamedRef& t : *group) {
      const char* why = "";
      HIPFLASH_CHECK(!t.ref || detail::indexable(*t.ref, &why), t.name, " with shape ",
                     shape_str(*t.ref), " cannot be indexed in 64 bits: ", why);
    }
  for (auto w = written.begin(); w != written.end(); ++w) {
    if (!w->ref) continue;
    check_no_self_overlap(*w->ref, w->name);
    for (auto o = written.begin(); o != w; ++o)
      if (o->ref) check_disjoint(*o->ref, o->name, *w->ref, w->name);
    for (const NamedRef& r : read)
      if (r.ref) check_disjoint(*w->ref, w->name, *r.ref, r.name);
  }
}

void varlen_paged_forward(const TensorRef& q, const TensorRef& k_cache, const TensorRef& v_cache,
                          const TensorRef& out, const TensorRef* lse, const TensorRef& cu_seqlens_q,
                          const TensorRef& cu_seqlens_k, const TensorRef& block_table,
                          const PagedVarlenOptions& opts, Stream stream, Workspace workspace) {
  const char* layout = "[num_blocks, page_size, heads_kv, head_dim] with a block_table";
  HIPFLASH_CHECK_AS(not_implemented, q.dtype != DType::e4m3,
                    "float8_e4m3fn queries against a paged KV cache are not implemented (an fp8 "
                    "cache takes bfloat16 / float16 queries)");
  check_operand(k_cache, "k_cache", q, layout, true);
  check_operand(v_cache, "v_cache", q, layout, true);
  HIPFLASH_CHECK_AS(dtype_error, v_cache.dtype == k_cache.dtype, "v_cache must have dtype ",
                    dtype_name(k_cache.dtype), " (k_cache's), got ", dtype_name(v_cache.dtype));
  for (int i = 0; i < 4; ++i)
    HIPFLASH_CHECK(v_cache.sizes[i] == k_cache.sizes[i], "k_cache and v_cache must have the same "
                   "shape: k_cache ", shape_str(k_cache), ", v_cache ", shape_str(v_cache));
  HIPFLASH_CHECK(cu_seqlens_q.rank == 1 && cu_seqlens_q.sizes[0] >= 1,
                 "cu_seqlens_q must be a 1-D tensor of length batch + 1, got shape ",
                 shape_str(cu_seqlens_q));
  const int64_t batch = cu_seqlens_q.sizes[0] - 1, page = k_cache.sizes[1];
  check_index(block_table, "block_table", 2, "[batch, max_blocks_per_seq]", q);
  HIPFLASH_CHECK(block_table.sizes[0] == batch, "block_table must have one row per sequence ",
                 "(batch = ", batch, "), got shape ", shape_str(block_table));
  const int64_t max_blocks = block_table.sizes[1];
  check_pages(page, max_blocks, "k_cache.shape[1]");
  const int64_t capacity = max_blocks * page;
  HIPFLASH_CHECK(opts.max_seqlen_k <= capacity, "max_seqlen_k = ", opts.max_seqlen_k,
                 " exceeds what a sequence's cache holds (max_blocks_per_seq * page_size = ",
                 capacity, ")");
  // varlen_forward's checks of q, out, lse, cu_seqlens and the options, against the cache seen
  // as [2^31, Hkv, D] rows of stride 0 (more rows than an int32 cu_seqlens_k can count: the
  // shape and dtype checks apply, each sequence's length against its pages is checked below).
  TensorRef k_view = k_cache, v_view = v_cache;
  for (TensorRef* t : {&k_view, &v_view}) {
    t->dtype = q.dtype;  // (an fp8 cache: its dtype is checked above)
    t->rank = 3;
    t->sizes[0] = int64_t(1) << 31;
    t->sizes[1] = k_cache.sizes[2];
    t->sizes[2] = k_cache.sizes[3];
    t->strides[0] = 0;
    t->strides[1] = (t == &k_view ? k_cache : v_cache).strides[2];
    t->strides[2] = 1;
  }
  std::vector<int32_t> cu_k;  // cu_seqlens_k on the host (empty while a graph is captured)
  FwdParams p = make_varlen_params(q, k_view, v_view, out, lse, cu_seqlens_q, cu_seqlens_k, opts,
                                   stream, &cu_k);
  p.kv_dtype = k_cache.dtype;
  fill_cache_scales(p, opts.k_scale, opts.v_scale, q,
                    {{&out, "out"}, {opts.return_lse ? lse : nullptr, "lse"}});
  for (auto [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    check_disjoint(out, "out", *t, name);
    if (opts.return_lse) check_disjoint(*lse, "lse", *t, name);
  }
  check_disjoint(out, "out", block_table, "block_table");
  if (opts.return_lse) check_disjoint(*lse, "lse", block_table, "block_table");
  const bool gpu = q.loc.kind == Location::gpu;
  if (gpu) check_gpu_vectors({{&k_cache, "k_cache"}, {&v_cache, "v_cache"}});
  // Lengths against the capacity, and (CPU) the block-table entries each sequence uses; on the
  // GPU the block table is not copied back (as for kvcache_forward: docs/spec.md §7).
  for (size_t b = 0; b + 1 < cu_k.size(); ++b) {
    const int64_t len = int64_t(cu_k[b + 1]) - cu_k[b];
    HIPFLASH_CHECK(len <= capacity, "sequence ", b, " has ", len, " keys but its cache holds ",
                   capacity, " (max_blocks_per_seq * page_size)");
    if (!gpu) check_pages_used(block_table, int64_t(b), len, page, k_cache.sizes[0]);
  }
  point_at_cache(p, k_cache, v_cache);
  point_at_pages(p, block_table, page);
  dispatch_forward(p, opts, q.loc, stream, std::move(workspace));
}

}  // namespace hipflash
