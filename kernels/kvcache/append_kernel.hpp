// hipflash — the KV-cache append kernel (SPEC §7): writes the new keys and values k_new / v_new
// [B, S_new, Hkv, D] into rows cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 of each
// sequence's cache, contiguous or paged (common::PagedRows), before the forward reads them on the
// same stream. One thread per element (2-byte words; S_new is small in decode and chunked
// prefill, so the copy is a few microseconds), grid-stride loop, 64-bit indices.
#pragma once

#include <cstdint>

#include "common/kv_source.hpp"
#include "hipflash/params.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::kvcache {

inline constexpr int kThreads = 256;
inline constexpr int64_t kMaxBlocks = 65536;

/// The cache (FwdParams: k, v, their strides, block table, seqlens_k) and the rows to append.
struct AppendParams {
  FwdParams cache;
  const void* __restrict__ k_new = nullptr;
  const void* __restrict__ v_new = nullptr;
  int64_t new_batch_stride[2] = {0, 0}, new_row_stride[2] = {0, 0}, new_head_stride[2] = {0, 0};
  int64_t s_new = 0;
};

/// Copies every element of k_new and v_new to its cache row (validated: the rows fit the
/// capacity and, for a paged cache, the block-table entries are the caller's).
__global__ void __launch_bounds__(kThreads) append_kernel(const HIPFLASH_GRID_CONSTANT AppendParams a) {
  const FwdParams& p = a.cache;
  const int64_t D = p.head_dim, row_elems = p.heads_kv * D, per_seq = a.s_new * row_elems;
  const int64_t per_tensor = p.batch * per_seq, items = 2 * per_tensor;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items; item += step) {
    const int which = item >= per_tensor ? 1 : 0;  // 0: k, 1: v
    int64_t rest = item - which * per_tensor;
    const int64_t b = rest / per_seq;
    rest -= b * per_seq;
    const int64_t j = rest / row_elems;
    rest -= j * row_elems;
    const int64_t hk = rest / D, d = rest - hk * D;
    const auto* src = static_cast<const uint16_t*>(which ? a.v_new : a.k_new) +
                      b * a.new_batch_stride[which] + j * a.new_row_stride[which] +
                      hk * a.new_head_stride[which] + d;
    auto* cache = const_cast<uint16_t*>(static_cast<const uint16_t*>(which ? p.v : p.k));
    const int64_t batch_stride = which ? p.v_batch_stride : p.k_batch_stride;
    const int64_t row_stride = which ? p.v_row_stride : p.k_row_stride;
    const int64_t head_stride = which ? p.v_head_stride : p.k_head_stride;
    const int64_t row = p.seqlens_k[b] + j;
    uint16_t* dst;
    if (p.block_table != nullptr) {
      const common::PagedRows<uint16_t> rows{cache + hk * head_stride,
                                             p.block_table + b * p.block_table_stride,
                                             batch_stride, row_stride, p.page_shift};
      dst = rows.row(row) + d;
    } else {
      dst = cache + b * batch_stride + row * row_stride + hk * head_stride + d;
    }
    *dst = *src;
  }
}

}  // namespace hipflash::kvcache
